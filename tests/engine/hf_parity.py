"""Tiny random checkpoints of a named HF class, and the check that paged serves them as HF
generates: the shared steps of the HF-parity tests whose model is not the tiny
`AutoModelForCausalLM` of `testing.write_tiny_model` (a decoder built from its own config
class, a `*ForConditionalGeneration` wrapper served text-only, a wrapper built in memory).

A checkpoint here is what transformers' `save_pretrained` writes from `model_cls(config)` in
float32 with testing.py's random weights, beside the tiny tokenizer (512 ids) and the tiny
models' generation config; HF's reference is that class loaded back (config.json's
`architectures[0]`). The comparison itself is hf_reference.py's (`hf_greedy`,
`assert_matches`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from hf_reference import assert_matches, hf_greedy

from paged_engine import LLM, SamplingParams
from paged_engine.testing import (
    _COMMON,
    TINY_VOCAB_SIZE,
    _quiet_progress,
    _randomize,
    build_tiny_tokenizer,
)


def save_hf_checkpoint(model: torch.nn.Module, path: Path, seed: int) -> Path:
    """`model` (weights already set) saved by transformers to `path`, with the tiny tokenizer
    (`seed`) and generation config."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    with _quiet_progress():
        model.save_pretrained(path)
    build_tiny_tokenizer(TINY_VOCAB_SIZE, seed).save_pretrained(path)
    transformers.GenerationConfig(**_COMMON).save_pretrained(path)
    return path


def write_hf_checkpoint(
    path: Path,
    model_cls: type,
    config: object,
    seed: int = 1,
    adjust: Callable[[torch.nn.Module], None] | None = None,
) -> Path:
    """`model_cls(config)` in float32 (torch seeded with `seed`) with `_randomize`'s weights,
    then `adjust(model)` where a family wants some weights in another range, saved to `path`
    by `save_hf_checkpoint`."""
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    _randomize(model, seed)
    if adjust is not None:
        adjust(model)
    return save_hf_checkpoint(model, path, seed)


def checkpoint_dirs(tmp_path_factory, write: Callable[[Path, str], Path]) -> Callable[[str], Path]:
    """name -> `write(dir, name)` into a fresh temp dir, written once (a module fixture's
    value: each case's checkpoint shared by the tests that use it)."""
    cache: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in cache:
            cache[name] = write(tmp_path_factory.mktemp(name), name)
        return cache[name]

    return make


def load_hf_as_saved(path: Path):
    """HF's model of `path`, of the class it was saved from (config.json's architectures[0],
    a wrapper included), in float32 and eval mode, generating exactly max_new_tokens."""
    import transformers

    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    model = getattr(transformers, arch).from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def assert_llm_matches(
    name: str, llm: LLM, prompts: list[list[int]], refs: list, top: int = 5
) -> list:
    """`llm`'s greedy continuations of the token `prompts` (as long as each of HF's `refs`,
    EOS ignored) are HF's tokens with the top-`top` logprobs (hf_reference.assert_matches).
    Returns the RequestOutputs."""
    max_tokens = len(refs[0].tokens)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=top)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, ref in zip(outs, refs, strict=True):
        assert_matches(name, out, ref)
    return outs


def assert_serves_like_hf(
    name: str,
    path: Path,
    prompts: list[list[int]],
    max_tokens: int = 8,
    hf=None,
    **engine_kwargs,
) -> LLM:
    """`LLM(model=path)` (float32, max_model_len 128, blocks of 16, `engine_kwargs`) gives
    HF `generate`'s greedy tokens and top-5 logprobs (1e-3) on `prompts`, `max_tokens` each,
    and frees every block afterwards. `hf`: the reference model (by default
    `load_hf_as_saved(path)`). Returns the engine for checks of its own."""
    hf = load_hf_as_saved(path) if hf is None else hf
    refs = [hf_greedy(hf, p, max_tokens, 5) for p in prompts]
    kw = {"dtype": "float32", "max_model_len": 128, "block_size": 16, **engine_kwargs}
    llm = LLM(model=str(path), **kw)
    assert_llm_matches(name, llm, prompts, refs)
    assert llm.get_stats().num_used_blocks == 0
    return llm


def fuse_qkv(state: dict[str, torch.Tensor], fused: str) -> dict[str, torch.Tensor]:
    """`state` (a HF decoder's tensors) with each `.self_attn.q_proj.` tensor (weight, bias)
    replaced by its q, k, v rows stacked on dim 0 under the name with `.self_attn.q_proj.` ->
    `fused` (a remote release's packed projection: Qwen v1's c_attn, Baichuan's W_pack,
    ChatGLM's query_key_value); the k_proj / v_proj tensors dropped, the rest kept, in order."""
    out = {}
    for name, w in state.items():
        if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            continue
        if ".self_attn.q_proj." in name:
            parts = [state[name.replace("q_proj", p)] for p in ("q_proj", "k_proj", "v_proj")]
            name, w = name.replace(".self_attn.q_proj.", fused), torch.cat(parts, dim=0)
        out[name] = w
    return out


# ---- image encoder-decoders taking one image a prompt (Donut, Florence-2) -----------------------
def processor_pixels(path: Path, image) -> torch.Tensor:
    """pixel_values [1, 3, H, W] of `image` from the checkpoint's own image processor
    (transformers' AutoImageProcessor at `path`): what HF's reference reads."""
    import transformers

    processor = transformers.AutoImageProcessor.from_pretrained(path)
    return processor(images=[image], return_tensors="pt")["pixel_values"]


def edited_sub_config(src: Path, dst: Path, section: str, **fields) -> Path:
    """A copy of checkpoint `src` at `dst` whose config.json's sub-config `section` ("decoder",
    "vision_config", ...) has `fields` changed."""
    from hf_reference import edited_checkpoint

    cfg = json.loads((src / "config.json").read_text())
    return edited_checkpoint(src, dst, **{section: {**cfg[section], **fields}})


def one_image_refusals(family: str, image) -> list[tuple[object, str]]:
    """(prompt, match) of the bad input a model taking exactly one image a prompt (vLLM's
    limit) refuses by name, `family` its name in the messages: text alone (a string, a dict),
    two images, a 0 x 0 image, a video, a file name or a float array as the image,
    mm_processor_kwargs, and
    multi_modal_data in the decoder prompt."""
    from image_checks import noise_image

    def hi(data: dict, **more) -> dict:
        return {"prompt": "hi", "multi_modal_data": data, **more}

    need = f"multi_modal_data: {family} prompts need an image"
    return [
        ("a question", need),
        ({"prompt": "hi"}, need),
        (hi({"image": [image, image]}), r"multi_modal_data\['image'\] has 2 images"),
        (hi({"image": noise_image(5, (0, 0))}), r"multi_modal_data\['image'\] is 0x0 pixels"),
        (hi({"video": image}), r"multi_modal_data must be"),
        (hi({"image": "x.png"}), r"must be a PIL.Image"),
        (hi({"image": np.zeros((8, 8, 3), np.float32)}), r"a numpy image must be uint8"),
        (hi({"image": image}, mm_processor_kwargs={}), r"'mm_processor_kwargs' is not supported"),
        (
            {
                "encoder_prompt": hi({"image": image}),
                "decoder_prompt": {"prompt": "x", "multi_modal_data": {"image": image}},
            },
            r"decoder_prompt: multi_modal_data",
        ),
    ]


def assert_numpy_image_same(llm: LLM, prompt: str, image) -> None:
    """A uint8 numpy image (H, W, 3), as vLLM takes it, gives the tokens and logprobs of the
    PIL image it holds."""
    from image_checks import greedy

    forms = (image, np.asarray(image))
    prompts = [{"prompt": prompt, "multi_modal_data": {"image": im}} for im in forms]
    pil, arr = llm.generate(prompts, greedy(), use_tqdm=False)
    assert arr.outputs[0].token_ids == pil.outputs[0].token_ids
    assert arr.outputs[0].logprobs == pil.outputs[0].logprobs


def assert_refused_while_serving(llm: LLM, cases: list[tuple[object, str]], ok: dict) -> None:
    """Each (prompt, match) of `cases` makes `llm.generate` raise a ValueError matching `match`;
    `llm` then still serves `ok` (8 greedy tokens)."""
    from image_checks import greedy

    for prompt, why in cases:
        with pytest.raises(ValueError, match=why):
            llm.generate([prompt], greedy(), use_tqdm=False)
    out = llm.generate([ok], greedy(), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8


def assert_image_limit_refused(path: Path) -> None:
    """limit_mm_per_prompt of 0 or 2 images is refused by name at load (the model takes one)."""
    for limit in (0, 2):
        with pytest.raises(ValueError, match=rf"limit_mm_per_prompt=\{{'image': {limit}\}}"):
            LLM(model=str(path), dtype="float32", limit_mm_per_prompt={"image": limit})
