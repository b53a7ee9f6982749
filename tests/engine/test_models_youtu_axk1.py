"""Youtu-LLM and A.X K1 (DeepSeek-V3's multi-head latent attention in other stacks) against HF
transformers.

Tiny random models through `LLM.generate` give HF `generate`'s greedy tokens and top-5 logprobs
(1e-3, float32). Youtu-LLM: the q bottleneck, YaRN with mscale_all_dim, interleaved rope, dense
MLPs, a tied head; and without the bottleneck, NeoX rope, attention biases, a GELU MLP, an untied
head. A.X K1: a dense layer between MoE layers by `mlp_layer_types` (biased sigmoid routing over
groups, a shared expert), each MoE output through `post_mlp_layernorm`; NeoX rope with
attention biases; the release's checkpoint layout (the norm beside the layer's norms, a dense
layer's unused copy, no correction biases: zeros, as HF fills them; HF's in-memory
`mlp.post_mlp_layernorm` names load the same); TP=2 (gloo) as one process; the legacy
first_k_dense_replace / moe_layer_freq derivation as HF's; refusals by name.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hf_reference import (
    assert_matches,
    assert_same_greedy,
    assert_tiny_case_matches_hf,
    assert_tp_matches_one_process,
    hf_greedy,
    load_hf_model,
    random_token_prompts,
)

from paged_engine import LLM, SamplingParams
from paged_engine.testing import tiny_config, write_tiny_model

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

CONFIG_CLASSES = {"youtu": "YoutuConfig", "axk1": "AXK1Config"}
CASES = {
    "youtu": ("youtu", {}),
    "youtu-no-q-lora-neox-gelu": (
        "youtu",
        {
            "q_lora_rank": None,
            "rope_interleave": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0},
            "attention_bias": True,
            "hidden_act": "gelu_pytorch_tanh",
            "tie_word_embeddings": False,
        },
    ),
    "axk1": ("axk1", {}),
    "axk1-neox-bias": ("axk1", {"rope_interleave": False, "attention_bias": True}),
}
MAX_TOKENS, TOP = 8, 5


def _need(arch: str) -> None:
    if not hasattr(transformers, CONFIG_CLASSES[arch]):
        pytest.skip(f"this transformers has no {CONFIG_CLASSES[arch]}")


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_tokens_and_logprobs_match_hf(case, tmp_path):
    arch, overrides = CASES[case]
    _need(arch)
    assert_tiny_case_matches_hf(case, arch, overrides, tmp_path)


def _release_layout(src: Path, dst: Path, *, hf_names: bool = False) -> None:
    """`src` (a tiny A.X K1 as HF saves it) in the release's layout: no correction biases,
    every layer's `post_mlp_layernorm` (the dense layer's a random, unused one); `hf_names`: the
    sparse layers' norms under `mlp.` as transformers holds them in memory."""
    shutil.copytree(src, dst)
    weights = safetensors_torch.load_file(src / "model.safetensors")
    weights = {n: w for n, w in weights.items() if not n.endswith("e_score_correction_bias")}
    gen = torch.Generator().manual_seed(0)
    for i, kind in enumerate(json.loads((src / "config.json").read_text())["mlp_layer_types"]):
        name = f"model.layers.{i}.post_mlp_layernorm.weight"
        if kind == "dense":
            shape = weights["model.norm.weight"].shape
            weights[name] = 1.0 + 0.5 * torch.randn(shape, generator=gen)
        elif hf_names:
            weights[name.replace(".post_mlp", ".mlp.post_mlp")] = weights.pop(name)
    safetensors_torch.save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})


def test_axk1_release_layout_matches_hf(tmp_path):
    """Without correction biases HF routes over the bare sigmoid scores (its zeros) and ignores
    the dense layer's norm: so do we. HF's in-memory names give the same results."""
    _need("axk1")
    src = write_tiny_model(tmp_path / "saved", "axk1", seed=2)
    release, renamed = tmp_path / "release", tmp_path / "renamed"
    _release_layout(src, release)
    _release_layout(src, renamed, hf_names=True)
    hf = load_hf_model(release)
    assert not any(torch.any(b) for n, b in hf.named_buffers() if n.endswith("correction_bias"))
    prompts = random_token_prompts(3, 3)
    refs = [hf_greedy(hf, p, MAX_TOKENS, TOP) for p in prompts]
    ours = _generate(release, prompts)
    for out, ref in zip(ours, refs, strict=True):
        assert_matches("axk1 release", out, ref)
    assert_same_greedy(
        [o.outputs[0] for o in ours], [o.outputs[0] for o in _generate(renamed, prompts)]
    )


def _generate(path: Path, prompts: list[list[int]]) -> list:
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP)
    try:
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()


def test_axk1_tensor_parallel_matches_one_process(tmp_path):
    """TP=2: half the heads and expert columns a rank; the post-MoE norm after the all-reduce."""
    _need("axk1")
    path = write_tiny_model(tmp_path, "axk1", seed=3)
    assert_tp_matches_one_process(path, random_token_prompts(5, 2), MAX_TOKENS, 128)


def test_axk1_legacy_mlp_fields_derive_as_hf():
    """A config without mlp_layer_types (the release's remote code): sparse where
    i >= first_k_dense_replace and i % moe_layer_freq == 0, as AXK1Config derives it."""
    _need("axk1")
    from paged_engine.models.axk1 import axk1_mlp_layer_types

    fields = ({}, {"first_k_dense_replace": 3}, {"moe_layer_freq": 2})
    fields += ({"first_k_dense_replace": 0, "moe_layer_freq": 3},)
    for legacy in fields:  # defaults where a field is absent
        hf = transformers.AXK1Config(num_hidden_layers=7, **legacy)
        ours = axk1_mlp_layer_types(SimpleNamespace(num_hidden_layers=7, **legacy))
        assert ours == hf.mlp_layer_types, legacy
    with pytest.raises(ValueError, match="mlp_layer_types"):
        axk1_mlp_layer_types(SimpleNamespace(num_hidden_layers=2, mlp_layer_types=["moe"] * 2))


@pytest.mark.parametrize(
    ("overrides", "field"),
    [({"q_lora_rank": None}, "q_lora_rank"), ({"topk_method": "greedy"}, "topk_method")],
)
def test_axk1_refusals_name_the_field(overrides, field):
    _need("axk1")
    from paged_engine.models.axk1 import AXK1ForCausalLM

    # a remote-code config (AXK1Config itself holds q_lora_rank an int)
    config = SimpleNamespace(**{**tiny_config("axk1").to_dict(), **overrides})
    with pytest.raises(ValueError, match=field):
        AXK1ForCausalLM(config)
