"""Llama 4 against HF transformers.

`LLM.generate` on tiny random models must give HF `generate`'s greedy tokens and the same top-5
logprobs (1e-3, float32). The tiny model (paged_engine.testing "llama4") has chunked rope layers
(chunks of 12 keys: prompts of 12-40 tokens and their continuations cross several), a NoPE layer
whose query temperature grows from position 3 on, MoE layers whose router scales the experts'
inputs, and dense MLPs of their own size; the second case routes each token to two experts
under Scout's llama3 rope scaling. Also: TP=2 equals one process, and the layer kinds follow
HF's config defaults when a config.json omits them.
"""

from __future__ import annotations

import pytest
from hf_reference import (
    assert_tiny_case_matches_hf,
    assert_tp_matches_one_process,
    random_token_prompts,
)

from paged_engine.models.llama4 import Llama4ForCausalLM, chunked_layers, moe_layers, rope_layers
from paged_engine.testing import tiny_config, write_tiny_model

transformers = pytest.importorskip("transformers")

SCOUT_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
CASES = {
    "llama4": {},
    "llama4_top2_llama3_rope": {"num_experts_per_tok": 2, "rope_parameters": SCOUT_ROPE},
}


@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_and_logprobs_match_hf(case, tmp_path):
    assert_tiny_case_matches_hf(case, "llama4", CASES[case], tmp_path)


def test_tensor_parallel_matches_one_process(tmp_path):
    """Heads, the dense MLPs, experts and shared expert split over 2 ranks (top-2 routing)."""
    path = write_tiny_model(tmp_path, "llama4", seed=2, num_experts_per_tok=2)
    assert_tp_matches_one_process(path, random_token_prompts(7, 2), 8, max_model_len=64)


@pytest.mark.parametrize(
    "fields",
    [
        {},  # HF's defaults: NoPE every 4th layer, MoE everywhere, chunked rope layers
        {"no_rope_layer_interval": 2, "interleave_moe_layer_step": 2},
        {"attention_chunk_size": None},  # no chunking at all
        {"no_rope_layers": [1, 0, 0, 1, 1, 1], "moe_layers": [0, 5]},
    ],
)
def test_layer_kinds_follow_hf_defaults(fields):
    """Our reading of a config.json without the derived fields equals HF's __post_init__."""
    hf = transformers.Llama4TextConfig(num_hidden_layers=6, **fields)
    raw = transformers.Llama4TextConfig(num_hidden_layers=6, **fields)
    for derived in ("no_rope_layers", "moe_layers", "layer_types"):
        setattr(raw, derived, fields.get(derived))  # as a config.json that omits them reads
    for config in (hf, raw):
        assert rope_layers(config) == [bool(f) for f in hf.no_rope_layers]
        assert moe_layers(config) == set(hf.moe_layers)
        assert chunked_layers(config) == [t == "chunked_attention" for t in hf.layer_types]


def test_bad_layer_types_are_refused():
    with pytest.raises(ValueError, match="layer_types"):
        Llama4ForCausalLM(tiny_config("llama4", layer_types=["sliding_attention"] * 4))
