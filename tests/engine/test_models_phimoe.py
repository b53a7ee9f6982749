"""Phi-3.5-MoE against HF transformers.

`LLM.generate` on a tiny random model must give HF `generate`'s greedy tokens and the same top-5
logprobs (1e-3, float32): LayerNorms, attention and LM-head biases, SparseMixer's top-2 routing
(a router jitter of 0.1, so its near-top masks drop experts); again with Phi-MoE's longrope, whose
short factors and short mscale (1.1, beside a long one of 1.3) serve sequences within the
original context. The routing alone against transformers' `sparsemixer` on random logits,
ties and masks included; a top-k other than 2 is refused by name.
"""

from __future__ import annotations

import pytest
import torch
from hf_reference import assert_tiny_case_matches_hf

from paged_engine.models.phimoe import PhimoeForCausalLM, sparsemixer_top2
from paged_engine.testing import tiny_config

transformers = pytest.importorskip("transformers")
phimoe_hf = pytest.importorskip("transformers.models.phimoe.modeling_phimoe")

LONGROPE = {
    "rope_parameters": {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0],
        "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0],
        "short_mscale": 1.1,
        "long_mscale": 1.3,
        "original_max_position_embeddings": 128,
    },
    "max_position_embeddings": 1024,
}
CASES = {"phimoe": ("phimoe", {}), "phimoe_longrope": ("phimoe", LONGROPE)}


@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_and_logprobs_match_hf(case, tmp_path):
    assert_tiny_case_matches_hf(case, *CASES[case], tmp_path)


@pytest.mark.parametrize("eps", [0.01, 0.3])
def test_sparsemixer_matches_transformers(eps):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 8, generator=gen)
    logits[0, :2] = 1.5  # a tie at the top
    logits[1] = -torch.rand(8, generator=gen)  # all negative
    want_w, want_ids = phimoe_hf.sparsemixer(logits, jitter_eps=eps, training=False, top_k=2)
    got_w, got_ids = sparsemixer_top2(logits, eps)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=0, atol=1e-6)


def test_top_k_other_than_two_is_refused():
    with pytest.raises(ValueError, match="num_experts_per_tok=3"):
        PhimoeForCausalLM(tiny_config("phimoe", num_experts_per_tok=3))
