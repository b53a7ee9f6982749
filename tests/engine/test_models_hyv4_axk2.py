"""Tencent Hy-V4 and SK Telecom A.X K2 (DeepSeek Sparse Attention models) against HF
transformers.

`LLM.generate` on tiny random models whose special features bite must give HF `generate`'s
greedy tokens and the same top-5 logprobs (1e-3, float32): 3 hyper-connection streams (post
magnitude 1.5, hc_eps 1e-3, the `hc_head` collapse), gated MLA with a sink logit a head (YaRN),
an indexer (8 heads of 16, rope on the last 8 dims, key LayerNorm at rms_norm_eps) keeping each
query's best 6 keys, well below the 16-38 token prompts, with shared layers reusing a full
layer's choice, a dense layer among MoE layers whose routed experts clamp SwiGLU at 1. A.X
K2: V3.2's DSA (NeoX indexer rope, 6 keys kept) with the fused query / output-gate projection
loaded from the release's `q_b_proj`, gated input norms and gated post norms on sparse layers
only, grouped routing (A.X-K2) and ungrouped (A.X-K2-Light); its grouped router's 0.0 fill is
checked against transformers' router directly. Also: the choice bites in prefill and decode;
TP=2 gives the one-process results; chunked prefill with prefix caching and preemption gives
the plain engine's; what the engine does not run is refused by name.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from dsa_checks import PROMPTS, assert_choice_bites, assert_stress_matches_plain
from hf_reference import (
    assert_tiny_case_matches_hf,
    assert_tp_matches_one_process,
)

from paged_engine import LLM
from paged_engine.testing import tiny_config, write_tiny_model

transformers = pytest.importorskip("transformers")

CONFIGS = {"hy_v4": "HYV4Config", "axk2": "AXK2Config"}
# name -> (arch, config overrides)
CASES: dict[str, tuple[str, dict]] = {
    "hy_v4": ("hy_v4", {}),
    # shared after full layers alternating, a dense last layer, 2 streams, a wider indexer head
    # (16 pass-through dims before the 8 rotated), default rope, a large rms_norm_eps
    "hy_v4-layout": (
        "hy_v4",
        {
            "indexer_types": ["full", "shared", "full", "shared"],
            "mlp_layer_types": ["dense", "sparse", "sparse", "dense"],
            "hc_mult": 2,
            "hc_magnitude": 2.5,
            "index_head_dim": 24,
            "rope_parameters": None,
            "rms_norm_eps": 0.3,  # the indexer key's LayerNorm reads it; MLA's latent norms not
        },
    ),
    "axk2": ("axk2", {}),
    # A.X-K2-Light: no expert groups, the legacy first_k_dense_replace (2 dense layers), an
    # all-rotary indexer head, default rope
    "axk2-light": (
        "axk2",
        {
            "n_group": None,
            "topk_group": None,
            "mlp_layer_types": None,
            "first_k_dense_replace": 2,
            "index_head_dim": 8,
            "rope_parameters": None,
        },
    ),
}


def _needs(arch: str) -> None:
    if not hasattr(transformers, CONFIGS[arch]):
        pytest.skip(f"this transformers has no {CONFIGS[arch]}")


@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_and_logprobs_match_hf(case, tmp_path):
    _needs(CASES[case][0])
    assert_tiny_case_matches_hf(case, *CASES[case], tmp_path)


@pytest.mark.parametrize("arch", CONFIGS)
def test_the_choice_bites_in_prefill_and_decode(arch, tmp_path, monkeypatch):
    """Queries that see more than index_topk (6) keys keep exactly 6, in prefill rows and in
    single-row decode steps; Hy-V4's shared layers reuse their full layer's choice."""
    _needs(arch)
    assert_choice_bites(arch, tmp_path, monkeypatch, shared=arch == "hy_v4")


@pytest.mark.parametrize("arch", CONFIGS)
def test_tensor_parallel_matches_one_process(arch, tmp_path):
    """TP=2 (gloo): MLA heads, their gates (and Hy-V4's sinks), and the experts split; the
    streams, the gated norms, the latent rows and the indexer whole on both ranks."""
    _needs(arch)
    path = write_tiny_model(tmp_path, arch, seed=3)
    assert_tp_matches_one_process(path, PROMPTS, 8, max_model_len=128)


def test_chunked_prefill_prefix_cache_and_preemption_match_plain(tmp_path):
    _needs("hy_v4")
    assert_stress_matches_plain("hy_v4", tmp_path, "hyv4")


def test_cache_rows_hold_the_indexer_key_on_full_layers(tmp_path):
    _needs("hy_v4")
    llm = LLM(model=str(write_tiny_model(tmp_path, "hy_v4")), dtype="float32")
    caches = llm.llm_engine.model_runner.cache.kv_caches
    assert [k.shape[-1] for k, _ in caches] == [32 + 8 + 16] * 2 + [32 + 8] * 2


def test_refusals(monkeypatch):
    _needs("hy_v4")
    from paged_engine.models import hy_v4

    with pytest.raises(ValueError, match="swiglu_limit=0"):
        hy_v4.HYV4ForCausalLM(tiny_config("hy_v4", swiglu_limit=0.0))
    with pytest.raises(ValueError, match="indexer_types"):
        cfg = tiny_config("hy_v4", indexer_types=["shared", "full", "full", "full"])
        hy_v4.HYV4ForCausalLM(cfg)
    monkeypatch.setattr(hy_v4, "get_parallel_state", lambda: SimpleNamespace(pp_size=2))
    with pytest.raises(ValueError, match="pipeline parallelism"):
        hy_v4.HYV4ForCausalLM(tiny_config("hy_v4"))


def test_axk2_grouped_router_matches_transformers():
    """Balance biases that push the kept groups' choice scores below 0 make transformers' 0.0
    fill choose experts of dropped groups; ours chooses the same experts and weights."""
    _needs("axk2")
    from transformers.models.axk2 import modeling_axk2

    from paged_engine.models.axk2 import AXK2ForCausalLM, ZeroFilledGroupRouter

    cfg = tiny_config("axk2")
    theirs = modeling_axk2.AXK2TopkRouter(cfg)
    ours = AXK2ForCausalLM.build_mlp(cfg, 1).gate
    assert isinstance(ours, ZeroFilledGroupRouter)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(theirs.weight.shape, generator=gen))
        theirs.e_score_correction_bias.copy_(-0.4 - torch.rand(8, generator=gen) * 0.5)
        ours.weight.copy_(theirs.weight)
        ours.e_score_correction_bias.copy_(theirs.e_score_correction_bias)
        x = torch.randn(64, cfg.hidden_size, generator=gen)
        _, their_w, their_ids = theirs(x)
        our_w, our_ids = ours(x)
    assert torch.equal(our_ids.sort(-1).values, their_ids.sort(-1).values)
    order_ours, order_theirs = our_ids.argsort(-1), their_ids.argsort(-1)
    torch.testing.assert_close(our_w.gather(1, order_ours), their_w.gather(1, order_theirs))
    # the fill bites: some tokens choose an expert outside their 2 kept groups (of 4 of 2)
    choice = (torch.sigmoid(x @ theirs.weight.T) + theirs.e_score_correction_bias).view(-1, 4, 2)
    kept = choice.topk(2, dim=-1).values.sum(-1).topk(2, dim=-1).indices  # [T, 2]
    outside = ~(their_ids[:, :, None] // 2 == kept[:, None, :]).any(-1)
    assert outside.any()
