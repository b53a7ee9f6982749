"""Mono-InternVL (the remote InternVLChatModel with an InternVisionPatchModel and an
InternLM2VEForCausalLM: multimodal/mono_internvl.py, models/internlm2_ve.py) against a
reference composed of transformers' classes and plain torch.

No transformers class holds visual experts, so the reference is HF's
InternVLForConditionalGeneration with a tower of no layers (its embeddings alone: the patch
model) over a Llama decoder, whose every layer's MLP output is replaced, on the prompt rows
holding <IMG_CONTEXT> during the one-shot prefill, by a second Llama MLP of its own random
weights applied to the MLP's input (vLLM's internlm2_ve.py routing; the remote model's, whose
cached decode steps run the text MLP alone). The checkpoint is written again in the remote
layout (test_internvl_chat_remote.to_remote: InternLM2's packed wqkv and names), the experts
as `feed_forward_ve.w1 / w3 / w2`, config.json with vision_config model_type
"intern_vit_patch" and llm_config architectures ["InternLM2VEForCausalLM"]. paged must give the
reference's prompt ids, greedy tokens and top-5 logprobs (1e-3, float32) for one image, two
and text alone, also in 8-token prefill chunks; half-Mono configs are refused by name.
"""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch
from image_checks import (
    check_config_refused,
    check_engine_matches_hf,
    engine,
    hf_cases,
    hf_refs,
)
from test_internvl_chat_remote import (
    CTX,
    MARKER,
    PROMPT,
    TEXT,
    TWO,
    save_tiling_processor,
    to_remote,
)
from vlm_checkpoints import (
    chatml_template,
    finish_checkpoint,
    load_hf_vlm,
    tiled_context_inputs,
    tokenizer_with,
)

from paged_engine.multimodal.internvl_chat import internvl_config
from paged_engine.testing import _COMMON, _save_random, tiny_config

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

SIZES = ((40, 56), (36, 20), (33, 47))  # tiles: 2 + thumbnail, 1, 1


def write_tiny_mono_hf(path, seed: int):
    """transformers' InternVL checkpoint with a tower of no layers and a Llama decoder (its
    GotOcr2 tiling processor, a tokenizer with <img>, </img>, <IMG_CONTEXT> and "<image>")."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer, ids = tokenizer_with(["<img>", "</img>", CTX, MARKER], seed)
    text = tiny_config("llama", vocab_size=len(tokenizer)).to_dict()
    vision = {"hidden_size": 32, "num_hidden_layers": 0, "num_attention_heads": 4}
    vision |= {"image_size": [32, 32], "patch_size": [4, 4]}
    config = transformers.InternVLConfig(
        text_config=text, vision_config=vision, image_token_id=ids[CTX], **_COMMON
    )
    _save_random(transformers.InternVLForConditionalGeneration, config, seed, path)
    save_tiling_processor(path)
    return finish_checkpoint(path, tokenizer, chatml_template(MARKER + "\n"))


def visual_experts(text_config, seed: int) -> list:
    """One random HF LlamaMLP a decoder layer: the visual experts."""
    gen = torch.Generator().manual_seed(seed)
    experts = []
    for _ in range(text_config.num_hidden_layers):
        mlp = transformers.models.llama.modeling_llama.LlamaMLP(text_config)
        with torch.no_grad():
            for p in mlp.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
        experts.append(mlp.eval())
    return experts


def to_mono(hf_dir, path, experts: list):
    """`hf_dir` in Mono-InternVL's remote layout at `path` (see the module doc)."""
    to_remote(hf_dir, path, internlm2=True)
    state = safetensors.load_file(str(path / "model.safetensors"))
    for i, mlp in enumerate(experts):
        base = f"language_model.model.layers.{i}.feed_forward_ve."
        for hub, proj in (("w1", mlp.gate_proj), ("w3", mlp.up_proj), ("w2", mlp.down_proj)):
            state[f"{base}{hub}.weight"] = proj.weight.detach().clone()
    safetensors.save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    vision = config["vision_config"]
    config["vision_config"] = {
        "architectures": ["InternVisionPatchModel"],
        "model_type": "intern_vit_patch",
        **{k: vision[k] for k in ("hidden_size", "image_size", "patch_size", "num_channels")},
    }
    config["llm_config"]["architectures"] = ["InternLM2VEForCausalLM"]
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


class RoutedReference:
    """HF's model with `experts` on the <IMG_CONTEXT> rows of its prefill, in plain torch:
    each layer's MLP output there is experts[i](the MLP's input)."""

    def __init__(self, model, experts: list, token: int) -> None:
        self.mask: torch.Tensor | None = None
        self.token = token
        model.register_forward_pre_hook(self._rows, with_kwargs=True)
        for layer, expert in zip(model.model.language_model.layers, experts, strict=True):
            layer.mlp.register_forward_hook(partial(self._route, expert))

    def _rows(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids")
        prefill = ids is not None and ids.shape[1] > 1  # generate's cached steps: one row
        self.mask = (ids == self.token)[..., None] if prefill else None

    def _route(self, expert, module, args, out) -> torch.Tensor:
        return out if self.mask is None else torch.where(self.mask, expert(args[0]), out)


@pytest.fixture(scope="module")
def mono(tmp_path_factory):
    """(the remote Mono-InternVL dir, the references of hf_cases)."""
    root = tmp_path_factory.mktemp("mono_internvl")
    hf_dir = write_tiny_mono_hf(root / "hf", seed=8)
    model = load_hf_vlm(transformers.InternVLForConditionalGeneration, hf_dir)
    experts = visual_experts(model.config.text_config, seed=9)
    remote = to_mono(hf_dir, root / "remote", experts)
    RoutedReference(model, experts, model.config.image_token_id)
    cases = hf_cases(PROMPT, TEXT, TWO, SIZES)

    def inputs(text: str, images: list) -> tuple[list[int], dict]:
        return tiled_context_inputs(hf_dir, text.replace(MARKER, CTX), images)

    return remote, cases, hf_refs(model, cases, inputs)


def test_matches_reference(mono):
    """One image ("<image>"), two (<IMG_CONTEXT>) and text alone give the reference's ids,
    tokens and logprobs; so do 8-token prefill chunks (image runs split across steps)."""
    remote, cases, refs = mono
    check_engine_matches_hf(engine(remote), cases, refs, "mono_internvl")
    chunked = engine(remote, max_num_batched_tokens=8, enable_chunked_prefill=True)
    check_engine_matches_hf(chunked, cases[:1], refs[:1], "mono_internvl chunked")


def test_refuses_half_mono(mono, tmp_path):
    """A patch vision_config without InternLM2VE, InternLM2VE without the patch model, and
    select_layer other than -1: ValueError naming the field, from the reader and the engine."""
    remote = mono[0]
    good = json.loads((remote / "config.json").read_text())
    llm, vision = good["llm_config"], good["vision_config"]
    plain_llm = {**llm, "architectures": ["InternLM2ForCausalLM"]}
    vit = {**vision, "model_type": "intern_vit_6b", "num_hidden_layers": 1}
    bad = [
        ({"llm_config": plain_llm}, "vision_config.model_type"),
        ({"vision_config": vit}, "llm_config.architectures"),
        ({"select_layer": -4}, "select_layer"),
    ]
    for change, match in bad:
        with pytest.raises(ValueError, match=match):
            internvl_config({**good, **change}, 7)
    check_config_refused(remote, tmp_path / "half", {**good, "llm_config": plain_llm}, "Mono")
