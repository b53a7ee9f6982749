"""Persimmon and JetMoE against HF transformers.

`LLM.generate` on tiny random models (float32) gives HF `generate`'s greedy tokens and top-5
logprobs (1e-3). Persimmon (tiny_config "persimmon"): the fused per-head query_key_value split at
load, one q and one k LayerNorm (weight and bias) shared by all heads, rope over half of each
head, a relu^2 MLP, biases everywhere; also without the q / k norms, and at TP=2 against one
process. JetMoE (tiny_config "jetmoe"): 4 attention experts, 2 chosen a token (their queries
making 4 heads over 2 kv heads, repeated whole as HF repeats them), each with its own query and
output projections, shared k / v, the gated outputs summed plus a bias; 4 MLP experts, 2 chosen,
plus a bias; a tied LM head; also at TP=2 (one kv head a rank) against one process.
"""

from __future__ import annotations

import pytest
from hf_reference import (
    assert_tiny_case_matches_hf,
    assert_tp_matches_one_process,
    random_token_prompts,
)

from paged_engine.testing import write_tiny_model

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize(
    ("case", "overrides"),
    [
        ("persimmon", {}),
        ("persimmon no qk norm", {"qk_layernorm": False}),
    ],
)
def test_persimmon_matches_hf(case, overrides, tmp_path):
    pytest.importorskip("transformers.models.persimmon")
    assert_tiny_case_matches_hf(case, "persimmon", overrides, tmp_path)


def test_persimmon_tensor_parallel_matches_one_process(tmp_path):
    """TP=2 (gloo): each rank's q / k / v rows of the split fused projection, the shared norms
    replicated."""
    pytest.importorskip("transformers.models.persimmon")
    path = write_tiny_model(tmp_path, "persimmon", seed=2)
    assert_tp_matches_one_process(path, random_token_prompts(4, 2), 8, max_model_len=64)


def test_jetmoe_matches_hf(tmp_path):
    pytest.importorskip("transformers.models.jetmoe")
    assert_tiny_case_matches_hf("jetmoe", "jetmoe", {}, tmp_path)


def test_jetmoe_tensor_parallel_matches_one_process(tmp_path):
    """TP=2 (gloo): each rank one kv head, its rows of every query expert and its columns of
    every output expert, both blocks' partial sums all-reduced before their biases."""
    pytest.importorskip("transformers.models.jetmoe")
    path = write_tiny_model(tmp_path, "jetmoe", seed=2)
    assert_tp_matches_one_process(path, random_token_prompts(4, 2), 8, max_model_len=64)
