"""OLMo (v1), GLM, Helium, Ministral, VaultGemma and nanochat against HF transformers.

`LLM.generate` on tiny random models, saved as HF saves them, must give HF `generate`'s greedy
tokens and the same top-5 logprobs (1e-3, float32): OLMo's parameter-free LayerNorms with q / k /
v clamped to a small `clip_qkv` (0.5: most entries of random projections are clamped) and
without it; GLM's interleaved partial rope (half of each head), q / k / v biases and fused
`gate_up_proj` on Llama's two norms a layer; Helium's interleaved rope over the whole head;
Ministral's sliding and full layers (window 8, shorter than every prompt); VaultGemma's Gemma 2
attention (soft-caps that bite, sliding layers) on two norms a layer; nanochat's weightless
norms (the embedding's too, q / k after RoPE), its rope turning the other way, relu^2 MLP and
logits soft-capped at 5.
"""

from __future__ import annotations

import pytest
from hf_reference import assert_tiny_case_matches_hf

transformers = pytest.importorskip("transformers")

CASES = {
    "olmo_clip": ("olmo", {}),
    "olmo": ("olmo", {"clip_qkv": None}),
    "glm": ("glm", {}),
    "helium": ("helium", {}),
    "ministral": ("ministral", {}),
    "vaultgemma": ("vaultgemma", {}),
    "nanochat": ("nanochat", {}),
}


@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_and_logprobs_match_hf(case, tmp_path):
    assert_tiny_case_matches_hf(case, *CASES[case], tmp_path)
