"""Kolibri 1, Kolibri 1.1 and Flint against HF transformers.

`LLM.generate` on tiny random models whose special features bite must give HF `generate`'s
greedy tokens and the same top-5 logprobs (1e-3, float32):

- Kolibri 1: sliding layers (window 8, shorter than every prompt) with rope beside global NoPE
  layers, per-head q / k norms, four norms a layer, MoE in every layer routed by logits + a
  random balance bias with sigmoid weights (renormalized, and not), an ungated shared expert,
  a tied head;
- Kolibri 1.1: indexed NoPE layers on NVFP4-rounded keys and values that keep 2 sink, 3 local
  and the 4 best keys of a pool (3 blocks of 4) once a query sees more than 9 keys: two
  indexers, a reindexer reading the first indexer's KV and one with its own, a dense layer;
- Flint: per-head sinks, sliding layers with rope beside NoPE layers (q / k still normed), a
  dense layer, sigmoid top-3 routing (renormalized, and not), an ungated shared expert, and
  attention biases.

Kolibri 1.1 runs its prompts one at a time: NVFP4 rounding is discontinuous, and a batch's
GEMMs round some values differently in their last bit than HF's one-row products, which now
and then moves a value across an NVFP4 boundary (a difference no tolerance covers). Also:
transformers' in-memory names load like the saved checkpoints' (the release's names); TP=2
gives the one-process results (Kolibri 1.1's choice made on rank 0 and shared); Kolibri 1.1's
cache holds only the layers with their own KV; what the engine does not do is refused by name.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hf_reference import (
    assert_hf_names_load_like_checkpoint,
    assert_matches,
    assert_tiny_case_matches_hf,
    assert_tp_matches_one_process,
    hf_greedy,
    load_hf_model,
    random_token_prompts,
)

from paged_engine import LLM, SamplingParams
from paged_engine.testing import tiny_config, write_tiny_model

transformers = pytest.importorskip("transformers")

CONFIGS = {"kolibri1": "Kolibri1Config", "kolibri1_1": "Kolibri1_1Config", "flint": "FlintConfig"}
# name -> (arch, config overrides)
CASES: dict[str, tuple[str, dict]] = {
    "kolibri1": ("kolibri1", {}),
    # another layout of the layer types, weights not renormalized, a tied head (transformers
    # cannot run the windowless layout: it builds the sliding mask whatever the layer types)
    "kolibri1-layout": (
        "kolibri1",
        {
            "layer_types": ["full_attention", "sliding_attention", "sliding_attention"]
            + ["full_attention"],
            "norm_topk_prob": False,
            "tie_word_embeddings": True,
        },
    ),
    "flint": ("flint", {}),
    # q / k / v / o biases, weights not renormalized, a dense layer mid-stack
    "flint-bias": (
        "flint",
        {"attention_bias": True, "norm_topk_prob": False, "mlp_only_layers": [2]},
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


@pytest.mark.parametrize("seed", [1, 2])
def test_kolibri1_1_matches_hf_one_prompt_at_a_time(seed, tmp_path):
    _needs("kolibri1_1")
    path = write_tiny_model(tmp_path, "kolibri1_1", seed=seed)
    hf = load_hf_model(path)
    prompts = random_token_prompts(f"kolibri1_1-{seed}", 3)
    refs = [hf_greedy(hf, p, 10, 5) for p in prompts]
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, block_size=16, max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, ref in zip(outs, refs, strict=True):
        assert_matches("kolibri1_1", out, ref)
    assert llm.get_stats().num_used_blocks == 0


def test_kolibri1_1_indexed_layers_choose_among_their_keys(tmp_path, monkeypatch):
    """The tiny config's selection bites: past 9 keys a query keeps fewer than it sees, past
    12 its pool is a strict subset of them, and reindexers reuse their indexer's pools."""
    _needs("kolibri1_1")
    from paged_engine.models import kolibri

    seen: list[tuple[bool, torch.Tensor, torch.Tensor]] = []
    choose = kolibri.KeyIndex.choose

    def record(self, row0, q, keys, lengths):
        keep = choose(self, row0, q, keys, lengths)
        seen.append((self.is_indexer, lengths.clone(), keep.sum(-1), self.pools[row0].sum(-1)))
        return keep

    monkeypatch.setattr(kolibri.KeyIndex, "choose", record)
    llm = LLM(model=str(write_tiny_model(tmp_path, "kolibri1_1")), dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": list(range(20, 50))}], params, use_tqdm=False)
    assert {indexer for indexer, *_ in seen} == {True, False}
    for _, lengths, kept, pooled in seen:
        assert torch.equal(kept[lengths <= 9], lengths[lengths <= 9])
        assert (kept[lengths > 9] == 9).all()  # 2 sinks + 3 local + the top 4
        assert torch.equal(pooled[lengths <= 12], lengths[lengths <= 12])
        assert (pooled[lengths > 12] < lengths[lengths > 12]).all()


@pytest.mark.parametrize("arch", ["kolibri1", "kolibri1_1", "flint"])
def test_transformers_names_load_like_the_checkpoint(arch, tmp_path):
    """HF's in-memory names (fused experts, `mlp.gate.e_score_correction_bias`,
    `post_self_attn_layernorm` / `post_mlp_layernorm`, `self_attn.sinks`) load the values the
    saved checkpoint's (per-expert, `moe.router.expert_bias`, `post_attn_norm` /
    `post_ffn_norm`, `self_attn.softmax_offset`: the release's) gave."""
    _needs(arch)
    path = write_tiny_model(tmp_path, arch, seed=2)
    assert_hf_names_load_like_checkpoint(path, ".experts.gate_up_proj")


@pytest.mark.parametrize("arch", ["kolibri1", "kolibri1_1", "flint"])
def test_tensor_parallel_matches_one_process(arch, tmp_path):
    """TP=2 (gloo): per-head q / k norms on split heads; Kolibri 1.1's keys chosen on rank 0
    (KV head 0, the scoring heads) and all-reduced to rank 1, its KV-sharing layer's query
    heads split; Flint's sinks split with their heads; routed and shared experts split."""
    _needs(arch)
    path = write_tiny_model(tmp_path, arch, seed=3)
    assert_tp_matches_one_process(path, PROMPTS, 8, max_model_len=128)


def test_kolibri1_1_caches_only_the_layers_with_their_own_kv(tmp_path):
    _needs("kolibri1_1")
    llm = LLM(model=str(write_tiny_model(tmp_path, "kolibri1_1")), dtype="float32")
    cache = llm.llm_engine.model_runner.cache
    assert len(cache.kv_caches) == 5  # layer 3 reads layer 1's


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kv_cache_dtype": "fp8"}, "fp8 KV cache is not supported"),
        ({"pipeline_parallel_size": 2}, "does not support pipeline parallelism"),
    ],
)
def test_kolibri1_1_refusals(kwargs, match, tmp_path):
    _needs("kolibri1_1")
    path = write_tiny_model(tmp_path, "kolibri1_1")
    with pytest.raises(ValueError, match=match):
        LLM(model=str(path), dtype="float32", max_model_len=64, **kwargs)


def test_kolibri1_1_refuses_tp_without_the_scoring_heads_on_rank_0(monkeypatch):
    """TP=4 over 4 query heads leaves rank 0 one head; the tiny model scores with two."""
    _needs("kolibri1_1")
    from paged_engine.models import kolibri

    state = SimpleNamespace(tp_rank=0, tp_size=4, pp_size=1)
    monkeypatch.setattr(kolibri, "get_parallel_state", lambda: state)
    with pytest.raises(ValueError, match="index_num_heads=2"):
        kolibri.Kolibri1_1ForCausalLM(tiny_config("kolibri1_1"))
