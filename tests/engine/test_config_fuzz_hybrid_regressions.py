"""Regressions the hybrid / state-space config fuzz (config_draws_hybrid.py through
config_fuzz.py) found: each a tiny model of the drawn config, served by `LLM` against HF
transformers in float32 (greedy tokens, top-5 logprobs within 1e-3)."""

from __future__ import annotations

import pytest
from hf_reference import assert_tiny_case_matches_hf

pytest.importorskip("transformers")


@pytest.mark.parametrize("arch", ["nemotron_h", "kimi_linear"])
def test_a_head_hf_never_ties_ignores_tie_word_embeddings(arch, tmp_path):
    """Nemotron-H and Kimi Linear keep lm_head apart even under tie_word_embeddings=True (HF's
    _tied_weights_keys is empty; the checkpoint holds lm_head.weight): the flag tied paged's
    head to the embeddings, every token wrong."""
    assert_tiny_case_matches_hf(
        f"{arch} tie flag", arch, {"tie_word_embeddings": True}, tmp_path, max_tokens=4
    )


def test_nemotron_h_biases_as_hf_places_them(tmp_path):
    """HF's (and vLLM's) Nemotron-H: no attention biases whatever attention_bias says, and the
    latent MoE's fc2_latent_proj takes mlp_bias as fc1 does. paged expected q / k / v / o
    biases and no fc2 bias: unnamed refusals at load, the checkpoint not matching."""
    overrides = {
        "attention_bias": True,
        "use_bias": True,
        "mlp_bias": True,
        "layers_block_type": ["mamba", "moe", "attention"],
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "moe_shared_expert_intermediate_size": 16,
        "moe_latent_size": 16,
    }
    assert_tiny_case_matches_hf(
        "nemotron_h biases", "nemotron_h", overrides, tmp_path, max_tokens=4
    )
