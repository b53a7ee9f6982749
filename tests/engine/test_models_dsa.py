"""DeepSeek-V3.2 and GLM-5 (DeepSeek Sparse Attention) against HF transformers.

`LLM.generate` on tiny random models whose special features bite must give HF `generate`'s
greedy tokens and the same top-5 logprobs (1e-3, float32): V3's MLA (YaRN, interleaved rope)
and MoE with a dense layer, and on every layer an indexer (8 heads of 16, its rope on the first
8 dims: NeoX halves for V3.2, pairs for GLM-5, a LayerNorm key with bias, float32 head weights)
that keeps each query's best 6 keys, well below the 12-40 token prompts, in the prefill and in
every decode step; GLM-5's shared layers reuse the last full layer's choice. Also: the choice
bites (queries keep 6 of more keys, prefill and decode); TP=2 gives the one-process results
(the replicated indexer chooses alike on both ranks); chunked prefill with prefix caching and
preemption gives the plain engine's; the cache rows hold the indexer key on full layers only;
what the engine does not run is refused by name.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from dsa_checks import PROMPTS, assert_choice_bites, assert_stress_matches_plain
from hf_reference import (
    assert_tiny_case_matches_hf,
    assert_tp_matches_one_process,
)

from paged_engine import LLM
from paged_engine.testing import tiny_config, write_tiny_model

transformers = pytest.importorskip("transformers")

CONFIGS = {"deepseek_v32": "DeepseekV32Config", "glm_moe_dsa": "GlmMoeDsaConfig"}
# name -> (arch, config overrides)
CASES: dict[str, tuple[str, dict]] = {
    "deepseek_v32": ("deepseek_v32", {}),
    # the indexer's head all rotary (no pass-through dims), more keys kept, default rope
    "deepseek_v32-narrow": (
        "deepseek_v32",
        {"index_head_dim": 8, "index_topk": 9, "rope_parameters": None},
    ),
    "glm_moe_dsa": ("glm_moe_dsa", {}),
    # a run of shared layers after the first full one, a dense last layer
    "glm_moe_dsa-layout": (
        "glm_moe_dsa",
        {
            "indexer_types": ["full", "shared", "shared", "full"],
            "mlp_layer_types": ["dense", "sparse", "sparse", "dense"],
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
    single-row decode steps; a shared layer reuses its full layer's choice."""
    _needs(arch)
    assert_choice_bites(arch, tmp_path, monkeypatch, shared=arch == "glm_moe_dsa")


@pytest.mark.parametrize("arch", CONFIGS)
def test_tensor_parallel_matches_one_process(arch, tmp_path):
    """TP=2 (gloo): MLA heads and experts split, the latent rows and the indexer whole on both
    ranks, which choose alike."""
    _needs(arch)
    path = write_tiny_model(tmp_path, arch, seed=3)
    assert_tp_matches_one_process(path, PROMPTS, 8, max_model_len=128)


def test_chunked_prefill_prefix_cache_and_preemption_match_plain(tmp_path):
    _needs("glm_moe_dsa")
    assert_stress_matches_plain("glm_moe_dsa", tmp_path, "dsa")


def test_cache_rows_hold_the_indexer_key_on_full_layers(tmp_path):
    _needs("glm_moe_dsa")
    llm = LLM(model=str(write_tiny_model(tmp_path, "glm_moe_dsa")), dtype="float32")
    caches = llm.llm_engine.model_runner.cache.kv_caches
    assert [k.shape[-1] for k, _ in caches] == [32 + 8 + 16, 32 + 8] * 2
    assert all(k is v for k, v in caches)


def test_refusals(monkeypatch):
    _needs("glm_moe_dsa")
    from paged_engine.models import deepseek_v32

    cfg = tiny_config("deepseek_v32")
    vars(cfg)["q_lora_rank"] = None  # past the config class's check (a raw config.json's)
    with pytest.raises(ValueError, match="q_lora_rank"):
        deepseek_v32.DeepseekV32ForCausalLM(cfg)
    with pytest.raises(ValueError, match="indexer_types"):
        cfg = tiny_config("glm_moe_dsa", indexer_types=["shared", "full", "full", "full"])
        deepseek_v32.GlmMoeDsaForCausalLM(cfg)
    with pytest.raises(ValueError, match="index_head_dim=4"):
        deepseek_v32.DeepseekV32ForCausalLM(tiny_config("deepseek_v32", index_head_dim=4))
    # two stages over 4 layers start on layers 0 and 2; layer 2 shared: its choice is on stage 0
    state = SimpleNamespace(pp_size=2)
    monkeypatch.setattr(deepseek_v32, "get_parallel_state", lambda: state)
    cfg = tiny_config("glm_moe_dsa", indexer_types=["full", "full", "shared", "full"])
    with pytest.raises(ValueError, match="pipeline_parallel_size=2"):
        deepseek_v32.GlmMoeDsaForCausalLM(cfg)


def test_mtp_speculation_is_refused(tmp_path):
    """The MTP draft layer would need the target's sparse attention: refused by name."""
    _needs("deepseek_v32")
    path = write_tiny_model(tmp_path, "deepseek_v32", num_nextn_predict_layers=1)
    spec = {"method": "mtp", "num_speculative_tokens": 1}
    with pytest.raises(ValueError, match="MTP layer of a DeepSeek sparse attention model"):
        LLM(model=str(path), dtype="float32", max_model_len=64, speculative_config=spec)
