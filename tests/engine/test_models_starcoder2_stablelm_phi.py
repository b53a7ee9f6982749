"""StarCoder2, StableLM and Phi against HF transformers.

`LLM.generate` on tiny random models whose special features bite (StarCoder2's LayerNorms,
biases, GELU MLP and a sliding window of 8 under the prompts; StableLM's partial rotary and
q / k / v biases, and in a variant its per-head q / k LayerNorms with a parallel residual; Phi's
parallel layer, partial rotary, shared q / k LayerNorms and LM-head bias) must give HF
`generate`'s greedy tokens and the same top-5 logprobs (1e-3, float32). The StableLM variant
also at TP=2, where each rank holds its heads' norm rows and both share the one k head's.
"""

from __future__ import annotations

import pytest
import torch
from hf_reference import (
    assert_tiny_case_matches_hf,
    assert_tp_matches_one_process,
    random_token_prompts,
)

from paged_engine.layers.embedding import ParallelLMHead
from paged_engine.testing import write_tiny_model

transformers = pytest.importorskip("transformers")

MAX_TOKENS = 10
# StableLM-2 12B's options, with one k head (replicated at TP=2)
STABLELM_12B = {
    "qk_layernorm": True,
    "use_parallel_residual": True,
    "use_qkv_bias": False,
    "num_key_value_heads": 1,
}
CASES = {
    "starcoder2": ("starcoder2", {}),
    "stablelm": ("stablelm", {}),
    "stablelm_12b": ("stablelm", STABLELM_12B),
    "phi": ("phi", {}),
}


@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_and_logprobs_match_hf(case, tmp_path):
    assert_tiny_case_matches_hf(case, *CASES[case], tmp_path)


def test_stablelm_per_head_norms_tensor_parallel(tmp_path):
    """TP=2 (gloo): q norm rows split by head, the single k head's row on both ranks."""
    path = write_tiny_model(tmp_path, "stablelm", seed=2, **STABLELM_12B)
    assert_tp_matches_one_process(path, random_token_prompts(4, 2), MAX_TOKENS, max_model_len=64)


def test_lm_head_bias_splits_with_the_vocabulary():
    """Phi's head bias: each rank's logits get its rows' bias, a padded last shard gets 0."""
    vocab, dim = 7, 3
    weight, bias, hidden = torch.randn(vocab, dim), torch.randn(vocab), torch.randn(2, dim)
    shards = []
    for rank in range(2):
        head = ParallelLMHead(vocab, dim, bias=True, tp_rank=rank, tp_size=2)
        head.weight.weight_loader(head.weight, weight)
        head.bias.weight_loader(head.bias, bias)
        shards.append(torch.nn.functional.linear(hidden, head.weight, head.bias))
    assert shards[1][:, -1].eq(0).all()  # the padded row: zero weight and bias
    torch.testing.assert_close(torch.cat(shards, -1)[:, :vocab], hidden @ weight.T + bias)
    with pytest.raises(ValueError, match="expected"):
        head.bias.weight_loader(head.bias, bias[:5])
