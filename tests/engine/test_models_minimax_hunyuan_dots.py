"""MiniMax-M2, Hunyuan (dense and MoE) and dots.llm1 against HF transformers.

`LLM.generate` on tiny random models whose special features bite (MiniMax-M2's whole-projection
q / k norms, partial rotary and sigmoid router with a random correction bias; Hunyuan's q / k
norms after RoPE, NTK-alpha rope, biases, per-layer top-k and shared MLP; dots.llm1's Qwen3
attention with a sliding layer around DeepSeek-V3's grouped, scaled router and shared expert)
must give HF `generate`'s greedy tokens and the same top-5 logprobs (1e-3, float32), each also
in a config variant; MiniMax-M2 also at TP=2 (its whole-projection norms summed over ranks, the
single k head replicated). The checkpoints are as save_pretrained writes them (per-expert
matrices, MiniMax's `block_sparse_moe`); the MoE models also load the names and layouts
transformers 5 holds in memory (fused experts, MiniMax's `mlp.e_score_correction_bias`).
"""

from __future__ import annotations

import random

import pytest
from hf_reference import (
    assert_hf_names_load_like_checkpoint,
    assert_tiny_case_matches_hf,
    assert_tp_matches_one_process,
)
from safetensors import safe_open

from paged_engine.testing import write_tiny_model

transformers = pytest.importorskip("transformers")

MAX_TOKENS = 8
CASES = {
    "minimax_m2": ("minimax_m2", {}),
    # full rotary, 3 experts a token, one k / v head
    "minimax_m2_full_rotary": (
        "minimax_m2",
        {"rotary_dim": 32, "num_experts_per_tok": 3, "num_key_value_heads": 1},
    ),
    "hunyuan_v1_dense": ("hunyuan_v1_dense", {}),
    # the plain rope, no biases, tied embeddings (the small models')
    "hunyuan_v1_dense_plain": (
        "hunyuan_v1_dense",
        {
            "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0},
            "attention_bias": False,
            "tie_word_embeddings": True,
        },
    ),
    "hunyuan_v1_moe": ("hunyuan_v1_moe", {}),
    # one k for every layer, q / k / v / o biases
    "hunyuan_v1_moe_topk2": ("hunyuan_v1_moe", {"moe_topk": 2, "attention_bias": True}),
    "dots1": ("dots1", {}),
    # no groups, no renormalization or scaling, no sliding layer, q / k / v / o biases
    "dots1_plain": (
        "dots1",
        {
            "n_group": 1,
            "topk_group": 1,
            "norm_topk_prob": False,
            "routed_scaling_factor": 1.0,
            "sliding_window": None,
            "attention_bias": True,
        },
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_and_logprobs_match_hf(case, tmp_path):
    assert_tiny_case_matches_hf(case, *CASES[case], tmp_path, num_prompts=2, max_tokens=MAX_TOKENS)


def test_minimax_m2_tensor_parallel_matches_one_process(tmp_path):
    """TP=2 (gloo): the q norm over the whole projection from both ranks' halves, the k norm
    over a k head both ranks hold, the experts split over the ranks."""
    path = write_tiny_model(tmp_path, "minimax_m2", seed=3, num_key_value_heads=1)
    prompt = [random.Random(5).randrange(3, 512) for _ in range(24)]
    assert_tp_matches_one_process(path, [prompt], MAX_TOKENS, 64)


# A name save_pretrained writes (the released checkpoints' layout) for each MoE model.
SAVED_NAMES = {
    "minimax_m2": "model.layers.1.block_sparse_moe.experts.7.w3.weight",
    "hunyuan_v1_moe": "model.layers.1.mlp.gate.wg.weight",
    "dots1": "model.layers.2.mlp.experts.7.up_proj.weight",
}


@pytest.mark.parametrize("arch", list(SAVED_NAMES))
def test_transformers5_names_load_like_the_checkpoint(arch, tmp_path):
    """HF's in-memory state dict (experts fused as `experts.gate_up_proj` / `down_proj`,
    MiniMax's `mlp.e_score_correction_bias`) loads the values the saved checkpoint gave."""
    path = write_tiny_model(tmp_path, arch, seed=2)
    with safe_open(path / "model.safetensors", "pt") as f:
        saved = set(f.keys())
    assert SAVED_NAMES[arch] in saved
    assert_hf_names_load_like_checkpoint(path, ".experts.gate_up_proj")
