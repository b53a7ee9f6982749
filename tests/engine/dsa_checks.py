"""Checks the DeepSeek Sparse Attention families share (tests/engine/test_models_dsa.py,
test_models_hyv4_axk2.py): the top-k choice bites, and the indexer keys survive chunked prefill,
prefix caching and preemption."""

from __future__ import annotations

import torch
from hf_reference import assert_chunks_prefix_hits_and_preemption_match_plain, random_token_prompts

from paged_engine import LLM, SamplingParams
from paged_engine.testing import write_tiny_model

# 38 and 16 tokens: most rows see more than the tiny configs' index_topk (6) keys
PROMPTS = [list(range(20, 58)), [5, 9, 33, 71, 2, 8, 100, 41, 77, 3, 12, 90, 4, 60, 61, 62]]


def assert_choice_bites(arch: str, tmp_path, monkeypatch, shared: bool) -> None:
    """Queries that see more than index_topk (6) keys keep exactly 6, in prefill rows and in
    single-row decode steps; `shared`: the model has layers reusing a full layer's choice."""
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
    assert {full for full, *_ in seen} == ({True, False} if shared else {True})


def assert_stress_matches_plain(arch: str, tmp_path, seed: str) -> None:
    """Prefill in chunks of 8 over cached prefix blocks, preempted in a small pool: the
    indexer keys come back from the blocks as the plain engine computed them (`seed`: of two
    more random prompts)."""
    path = write_tiny_model(tmp_path, arch, seed=4)
    assert_chunks_prefix_hits_and_preemption_match_plain(path, random_token_prompts(seed, 2))
