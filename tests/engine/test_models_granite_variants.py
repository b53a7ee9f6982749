"""GraniteMoeSWA and HyperCLOVA X (Granite's decoder variants) against HF transformers.

`LLM.generate` on tiny random models whose special features bite (GraniteMoeSWA: per-head
sinks, a window of 8 on 3 of 4 layers in a non-default pattern, per-layer rope bases with a NoPE
layer, a top-k-then-softmax MoE with and without the ungated shared MLP, Granite's four
multipliers away from 1; HyperCLOVA X: Peri-LN post norms inside the residual multiplier, the
logits multiplied by logits_scaling, an attention scale that is neither 1 nor head_dim^-0.5, an
explicit head_dim, q / k / v / o and MLP biases, and the model without post norms) must give HF
`generate`'s greedy tokens and top-5 logprobs (1e-3, float32); both also at TP=2 against one
process. A HyperCLOVA X config whose attention_multiplier is None scales by head_dim^-0.5.
"""

from __future__ import annotations

import pytest
import torch
from hf_reference import (
    assert_tiny_case_matches_hf,
    assert_tp_matches_one_process,
    random_token_prompts,
)

from paged_engine.loader import load_hf_config, load_model, resolve_model
from paged_engine.testing import write_tiny_model

transformers = pytest.importorskip("transformers")

# arch -> the transformers config class it needs (CI may run an older transformers)
_CONFIGS = {"granitemoe_swa": "GraniteMoeSWAConfig", "hyperclovax": "HyperCLOVAXConfig"}
CASES = {
    "granitemoe_swa": ("granitemoe_swa", {}),
    "granitemoe_swa without a shared MLP": ("granitemoe_swa", {"shared_intermediate_size": 0}),
    "hyperclovax": ("hyperclovax", {}),
    "hyperclovax without post norms": ("hyperclovax", {"use_post_norm": False}),
}


def _need(arch: str) -> None:
    if not hasattr(transformers, _CONFIGS[arch]):
        pytest.skip(f"this transformers has no {_CONFIGS[arch]}")


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_and_logprobs_match_hf(case, tmp_path):
    arch, overrides = CASES[case]
    _need(arch)
    assert_tiny_case_matches_hf(case, arch, overrides, tmp_path, max_tokens=8)


@pytest.mark.parametrize("arch", list(_CONFIGS))
def test_tensor_parallel_matches_one_process(arch, tmp_path):
    """TP=2 (gloo): GraniteMoeSWA's sinks split with their heads, the experts' and shared MLP's
    partial sums reduced once; HyperCLOVA X's post norms over the reduced sublayer outputs."""
    _need(arch)
    path = write_tiny_model(tmp_path, arch, seed=3)
    assert_tp_matches_one_process(path, random_token_prompts(arch, 2), 6, 64)


def test_hyperclovax_attention_scale_defaults_to_head_dim(tmp_path):
    """attention_multiplier None (HF's config resolves it to head_dim^-0.5 on load; a config
    that skips that resolution): head_dim^-0.5 with head_dim 32, not Granite's 1."""
    _need("hyperclovax")
    resolved = resolve_model(str(write_tiny_model(tmp_path, "hyperclovax", seed=2)))
    config = load_hf_config(resolved)
    config.attention_multiplier = None
    model = load_model(resolved, config, dtype=torch.float32, device="cpu")
    scales = {layer.self_attn.attn.scale for layer in model.model.layers}
    assert scales == {32**-0.5}
