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
import torch
from hf_reference import (
    assert_same_greedy,
    assert_tiny_case_matches_hf,
    assert_tp_matches_one_process,
    engine_greedy,
    random_token_prompts,
)

from paged_engine import LLM, SamplingParams
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
PROMPTS = [list(range(20, 58)), [5, 9, 33, 71, 2, 8, 100, 41, 77, 3, 12, 90, 4, 60, 61, 62]]


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
    from paged_engine.models import deepseek_v32

    seen: list[tuple[bool, int, torch.Tensor, torch.Tensor]] = []
    keep = deepseek_v32.SparseLatentAttention._keep

    def record(self, s, row0, index_q, keys, lengths):
        chosen = keep(self, s, row0, index_q, keys, lengths)
        seen.append((self.full, lengths.numel(), lengths.clone(), chosen.sum(-1)))
        return chosen

    monkeypatch.setattr(deepseek_v32.SparseLatentAttention, "_keep", record)
    llm = LLM(model=str(write_tiny_model(tmp_path, arch)), dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for _, _, lengths, kept in seen:
        assert torch.equal(kept, lengths.clamp(max=6))
    assert any(rows > 1 and (lengths > 6).any() for _, rows, lengths, _ in seen)  # prefill
    assert any(rows == 1 and (lengths > 6).all() for _, rows, lengths, _ in seen)  # decode
    assert {full for full, *_ in seen} == ({True, False} if arch == "glm_moe_dsa" else {True})


@pytest.mark.parametrize("arch", CONFIGS)
def test_tensor_parallel_matches_one_process(arch, tmp_path):
    """TP=2 (gloo): MLA heads and experts split, the latent rows and the indexer whole on both
    ranks, which choose alike."""
    _needs(arch)
    path = write_tiny_model(tmp_path, arch, seed=3)
    assert_tp_matches_one_process(path, PROMPTS, 8, max_model_len=128)


def test_chunked_prefill_prefix_cache_and_preemption_match_plain(tmp_path):
    """Prefill in chunks of 8 over cached prefix blocks, preempted in a small pool: the
    indexer keys come back from the blocks as the plain engine computed them."""
    _needs("glm_moe_dsa")
    path = str(write_tiny_model(tmp_path, "glm_moe_dsa", seed=4))
    shared = list(range(7, 26))
    prompts = [shared + [30, 31], shared + [40, 41, 42], *random_token_prompts("dsa", 2)]
    kw = {"model": path, "max_model_len": 64}
    plain = engine_greedy(prompts, 12, enable_prefix_caching=False, **kw)
    stress = {"max_num_batched_tokens": 8, "max_num_seqs": 3, "num_gpu_blocks_override": 20}
    got = engine_greedy(prompts + prompts, 12, block_size=4, **stress, **kw)
    assert_same_greedy(plain + plain, got)


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
