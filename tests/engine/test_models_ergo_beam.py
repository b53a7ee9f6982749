"""Reflection Beam and Amazon Ergo against HF transformers.

`LLM.generate` on tiny random models whose special features bite (testing.py "beam" / "ergo")
gives HF `generate`'s greedy tokens and top-5 logprobs (1e-3, float32). Beam: depth-scaled
residual adds around sandwich norms, sliding layers (window 8, shorter than every prompt)
rotating with their own base beside NoPE full layers with the scalable-softmax query scale,
output gates with a bias per head, a dense layer before grouped sigmoid routing scaled by 2.5,
soft-capped logits; also with a rope on the full layers too (no query scale there), ungrouped
unnormalized routing and a tied head. Ergo: learned residual gates, a fused qkv, interleaved
rope on sliding layers beside NoPE full ones whose logits are scaled, relu^2 dense / routed /
shared experts with per-expert output norms and a normalized shared expert; also without the
logit scale and with dense / sparse layers interleaved. The scalable-softmax scale matches HF's
at long positions; TP=2 gives the one-process results; Ergo checkpoints in the released layout
(`tok_embeddings`, `attention.wqkv`, transposed `gate_kernel` / shared projections) load to the
same outputs; a non-SiLU Beam is refused by name.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from hf_reference import (
    assert_matches,
    assert_same_greedy,
    assert_tp_matches_one_process,
    engine_greedy,
    hf_greedy,
    load_hf_model,
)

from paged_engine import LLM, SamplingParams
from paged_engine.testing import write_tiny_model

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.beam")
pytest.importorskip("transformers.models.ergo")
safetensors_torch = pytest.importorskip("safetensors.torch")

MAX_TOKENS, TOP = 8, 5
# name -> (arch, config overrides)
CASES: dict[str, tuple[str, dict]] = {
    "beam": ("beam", {}),
    # both layer types rotate (the full ones with their own base, so no query scale); all 8
    # experts one group, weights not renormalized; a tied head, no soft cap; an eps of 0.5,
    # without which the norms would absorb the depth-scaled adds and routed_scaling_factor
    "beam-rope-ungrouped-tied": (
        "beam",
        {
            "rms_norm_eps": 0.5,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 20000.0},
            },
            "n_group": 1,
            "topk_group": 1,
            "norm_topk_prob": False,
            "final_logit_softcapping": None,
            "tie_word_embeddings": True,
        },
    ),
    "ergo": ("ergo", {}),
    # no logit scale on the full layers; sparse / dense layers interleaved; top-2
    "ergo-unscaled-interleaved": (
        "ergo",
        {
            "global_attention_scale": None,
            "mlp_layer_types": ["sparse", "dense", "sparse", "dense"],
            "num_experts_per_tok": 2,
        },
    ),
}


def _prompts(seed: int | str, n: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(12, 40))] for _ in range(n)]


def _generate(llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_tokens_and_logprobs_match_hf(name, tmp_path):
    arch, overrides = CASES[name]
    path = write_tiny_model(tmp_path, arch, seed=1, **overrides)
    hf = load_hf_model(path)
    prompts = _prompts(name)
    refs = [hf_greedy(hf, p, MAX_TOKENS, TOP) for p in prompts]
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, block_size=16)
    assert type(llm.llm_engine.model_runner.model).__name__ == type(hf).__name__
    for out, ref in zip(_generate(llm, prompts), refs, strict=True):
        assert_matches(name, out, ref)
    assert llm.get_stats().num_used_blocks == 0


def test_beam_query_scale_matches_hf_at_long_positions():
    """The NoPE layers' (1 + (p + 1) / 2048) ** 0.1, where it is far from 1."""
    from transformers.models.beam.modeling_beam import compute_attention_scaling

    from paged_engine.models.beam import ssmax_query_scale

    positions = torch.tensor([0, 7, 2047, 30000, 500000])
    want = compute_attention_scaling(positions[None])[0, 0, :, 0]
    assert torch.equal(ssmax_query_scale(positions)[:, 0], want)
    assert want[-1] > 1.7


@pytest.mark.parametrize("arch", ["beam", "ergo"])
def test_tensor_parallel_matches_one_process(arch, tmp_path):
    """TP=2 (gloo): heads, their norms, Beam's per-head gate biases and Ergo's fused qkv split
    over the ranks; routed experts split, Ergo's routes all-reduced before their norms."""
    path = write_tiny_model(tmp_path, arch, seed=3)
    assert_tp_matches_one_process(path, _prompts(1, 2), max_tokens=MAX_TOKENS, max_model_len=128)


# transformers' names -> the released Ergo layout's (its conversion mapping read backwards)
_RELEASE = [
    (".input_layernorm.", ".attention_norm."),
    (".post_attention_layernorm.", ".post_attention_norm."),
    (".pre_feedforward_layernorm.", ".ffn_norm."),
    (".post_feedforward_layernorm.", ".post_ffn_norm."),
    (".attention_residual_gate.weight", ".post_attention_residual.scale"),
    (".feedforward_residual_gate.weight", ".post_ffn_residual.scale"),
    (".self_attn.qkv_proj.", ".attention.wqkv."),
    (".self_attn.o_proj.", ".attention.wo."),
    (".self_attn.q_norm.", ".attention.q_norm."),
    (".self_attn.k_norm.", ".attention.k_norm."),
    (".mlp.up_proj.", ".feed_forward.up."),
    (".mlp.down_proj.", ".feed_forward.down."),
    (".mlp.gate.e_score_correction_bias", ".feed_forward.router_bias"),
    (".mlp.experts.post_expert_norm.weight", ".feed_forward.expert_output_norm.scale"),
    (".mlp.experts.up_proj", ".feed_forward.up_proj"),
    (".mlp.experts.down_proj", ".feed_forward.down_proj"),
    (".mlp.shared_experts.norm.weight", ".feed_forward.shared_expert_output_norm.scale"),
]
_RELEASE_TRANSPOSED = {
    ".mlp.gate.linear.weight": ".feed_forward.gate_kernel",
    ".mlp.shared_experts.up_proj.weight": ".feed_forward.shared_up_proj",
    ".mlp.shared_experts.down_proj.weight": ".feed_forward.shared_down_proj",
}


def _release_name(name: str, w: torch.Tensor) -> tuple[str, torch.Tensor]:
    for prefix, theirs in (
        ("model.embed_tokens.", "tok_embeddings."),
        ("model.norm.", "norm."),
        ("lm_head.", "output."),
        ("model.layers.", "layers."),
    ):
        if name.startswith(prefix):
            name = theirs + name[len(prefix) :]
    for ours, theirs in _RELEASE_TRANSPOSED.items():
        if name.endswith(ours):
            return name.replace(ours, theirs), w.t().contiguous()
    for ours, theirs in _RELEASE:
        name = name.replace(ours, theirs)
    return name, w


def test_ergo_released_layout_loads_like_transformers_names(tmp_path):
    """A checkpoint in the layout Ergo is released in gives the outputs of the same weights
    under transformers' names."""
    path = write_tiny_model(tmp_path / "hf", "ergo", seed=2)
    release = tmp_path / "release"
    release.mkdir()
    for f in path.iterdir():
        if f.name != "model.safetensors":
            (release / f.name).write_bytes(f.read_bytes())
    tensors = safetensors_torch.load_file(path / "model.safetensors")
    renamed = dict(_release_name(n, w) for n, w in tensors.items())
    assert len(renamed) == len(tensors) and not any("self_attn" in n for n in renamed)
    assert "layers.1.feed_forward.gate_kernel" in renamed
    safetensors_torch.save_file(renamed, release / "model.safetensors")
    prompts = _prompts(2, 2)
    want = engine_greedy(prompts, MAX_TOKENS, model=str(path), max_model_len=128)
    got = engine_greedy(prompts, MAX_TOKENS, model=str(release), max_model_len=128)
    assert_same_greedy(want, got, abs_tol=0.0)


def test_beam_refuses_a_non_silu_activation(tmp_path):
    path = write_tiny_model(tmp_path, "beam", seed=0)
    config = json.loads((path / "config.json").read_text())
    config["hidden_act"] = "gelu"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="hidden_act"):
        LLM(model=str(path), dtype="float32", max_model_len=128, block_size=16)
