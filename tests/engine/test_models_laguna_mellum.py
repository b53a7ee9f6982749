"""Poolside Laguna and JetBrains Mellum 2 against HF transformers.

`LLM.generate` on tiny random models whose special features bite gives HF `generate`'s greedy
tokens and top-5 logprobs (1e-3, float32). Laguna (testing.py's "laguna"): a different number of
query heads on each layer, full layers rotating half of each head beside sliding ones (window 8,
shorter than every prompt) with a rope base of their own, softplus output gates per head, dense
and sparse layers interleaved, sigmoid routing over a random balance bias with soft-capped logits,
scaled by 2.5, and a shared expert of its own width; also gates per channel, YaRN on the full
layers, no soft-cap and a tied head. Mellum ("mellum"): Qwen3-MoE's layers, sliding and full,
each type with its rope base, a dense layer then softmax top-3 experts; also unnormalized
routing weights, YaRN on the full layers, every layer sparse and a tied head. Checkpoints are
save_pretrained's (Laguna's release names: per-expert matrices,
`mlp.experts.e_score_correction_bias`, `mlp.shared_expert.*`); Laguna also loads the names
transformers 5 holds in memory, and Mellum skips a checkpoint's `mtp.*` layer (and refuses MTP
speculation by name). TP=2 gives the one-process results. Refused by name: Laguna's
moe_apply_router_weight_on_input, a Mellum partial rotary factor.
"""

from __future__ import annotations

import random

import pytest
import torch
from hf_reference import (
    assert_hf_names_load_like_checkpoint,
    assert_matches,
    assert_tp_matches_one_process,
    hf_greedy,
    load_hf_model,
)

from paged_engine import LLM, SamplingParams
from paged_engine.models.laguna import LagunaForCausalLM, MellumForCausalLM
from paged_engine.testing import tiny_config, write_tiny_model

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

MAX_TOKENS = 8
TOP = 5


def _yarn(theta: float, partial: float = 1.0) -> dict:
    return {
        "rope_type": "yarn",
        "rope_theta": theta,
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "partial_rotary_factor": partial,
    }


# name -> (arch, config overrides)
CASES: dict[str, tuple[str, dict]] = {
    "laguna": ("laguna", {}),
    # one gate a channel, YaRN on the partially rotating full layers, no soft-cap, tied head
    "laguna-per-element-yarn-tied": (
        "laguna",
        {
            "gating": "per-element",
            "rope_parameters": {
                "full_attention": _yarn(10000.0, 0.5),
                "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
            },
            "moe_router_logit_softcapping": 0.0,
            "tie_word_embeddings": True,
        },
    ),
    "mellum": ("mellum", {}),
    # routing weights not renormalized, YaRN on the full layers, every layer sparse, tied head
    "mellum-unnormalized-yarn-tied": (
        "mellum",
        {
            "norm_topk_prob": False,
            "rope_parameters": {
                "full_attention": _yarn(10000.0),
                "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
            },
            "mlp_layer_types": None,
            "tie_word_embeddings": True,
        },
    ),
}


def _skip_without(arch: str) -> None:
    pytest.importorskip(f"transformers.models.{arch}")


def _write(tmp_path, name: str, seed: int):
    arch, overrides = CASES[name]
    _skip_without(arch)
    return write_tiny_model(tmp_path, arch, seed=seed, **overrides)


def _prompts(seed: str | int, lengths: tuple[int, ...] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = lengths or tuple(rng.randint(12, 40) for _ in range(3))
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


def _generate(llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _assert_matches_hf(name: str, path) -> None:
    hf = load_hf_model(path)
    prompts = _prompts(name)
    refs = [hf_greedy(hf, p, MAX_TOKENS, TOP) for p in prompts]
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, block_size=16)
    assert type(llm.llm_engine.model_runner.model).__name__ == type(hf).__name__
    for out, ref in zip(_generate(llm, prompts), refs, strict=True):
        assert_matches(name, out, ref)
    assert llm.get_stats().num_used_blocks == 0


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_tokens_and_logprobs_match_hf(name, tmp_path):
    _assert_matches_hf(name, _write(tmp_path, name, seed=1))


@pytest.mark.parametrize("name", ["laguna", "mellum"])
def test_tensor_parallel_matches_one_process(name, tmp_path):
    """TP=2 (gloo): each layer's query heads and their gates split over the ranks (Laguna's
    head counts differ by layer), the routed and shared experts too."""
    path = _write(tmp_path, name, seed=3)
    prompts = _prompts(1, (30, 50))
    assert_tp_matches_one_process(path, prompts, max_tokens=MAX_TOKENS, max_model_len=128)


def test_laguna_transformers5_names_load_like_the_checkpoint(tmp_path):
    """HF's in-memory state dict (experts fused, `mlp.gate.e_score_correction_bias`,
    `mlp.shared_experts.*`) loads the values the release's names gave."""
    path = _write(tmp_path, "laguna", seed=2)
    saved = safetensors_torch.load_file(str(path / "model.safetensors"))
    assert any(n.endswith(".mlp.experts.e_score_correction_bias") for n in saved)
    assert any(".mlp.shared_expert." in n for n in saved)
    assert_hf_names_load_like_checkpoint(
        path, ".experts.gate_up_proj", ".mlp.gate.e_score_correction_bias"
    )


def test_mellum_skips_the_mtp_layer_and_refuses_mtp_speculation(tmp_path):
    """A checkpoint with an MTP layer (`mtp.*`, which HF ignores too) serves as without it;
    speculative method "mtp" is refused by name."""
    path = _write(tmp_path, "mellum", seed=1)
    file = path / "model.safetensors"
    weights = safetensors_torch.load_file(str(file))
    weights["mtp.layers.0.self_attn.q_proj.weight"] = torch.randn(64, 64)
    weights["mtp.norm.weight"] = torch.ones(64)
    safetensors_torch.save_file(weights, str(file), metadata={"format": "pt"})
    _assert_matches_hf("mellum-mtp", path)
    with pytest.raises(ValueError, match=r"MTP layers of .* MellumForCausalLM is not one"):
        LLM(
            model=str(path),
            dtype="float32",
            max_model_len=128,
            speculative_config={"method": "mtp", "num_speculative_tokens": 1},
        )


def test_unsupported_configs_are_refused_by_name():
    _skip_without("laguna")
    _skip_without("mellum")
    config = tiny_config("laguna")
    config.moe_apply_router_weight_on_input = True  # (transformers' config refuses it)
    with pytest.raises(ValueError, match="moe_apply_router_weight_on_input"):
        LagunaForCausalLM(config)
    full = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    sliding = {"rope_type": "default", "rope_theta": 500.0}
    rope = {"full_attention": full, "sliding_attention": sliding}
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        MellumForCausalLM(tiny_config("mellum", rope_parameters=rope))
