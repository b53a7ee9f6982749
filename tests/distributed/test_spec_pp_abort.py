"""Speculative decoding under pipeline parallelism (2 gloo stages on the CPU) with a drafting
request aborted while its step is in flight, its id reused at once, and prompts that hit the
prefix cache: every greedy request's tokens equal one plain process's."""

from __future__ import annotations

import pytest

from paged_engine import LLM, SamplingParams
from paged_engine.testing import write_tiny_model

pytest.importorskip("transformers")

ENGINE = {
    "dtype": "float32",
    "max_model_len": 160,
    "block_size": 16,
    "num_gpu_blocks_override": 24,
    "max_num_batched_tokens": 48,
    "max_num_seqs": 8,
    "enable_prefix_caching": True,
}
ABORTED = "r2"


def _requests() -> list[tuple[str, list[int], SamplingParams]]:
    g = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    units = [[5, 6, 7], [9, 10, 11, 12], [20, 21], [30, 31, 32], [40, 41, 42, 43, 44]]
    reqs = [(f"r{i}", u * 6, g) for i, u in enumerate(units)]
    reqs.append(("fan", [50, 51, 52] * 5, SamplingParams(n=2, temperature=0, max_tokens=10)))
    return reqs


def _plain(path, reqs) -> dict[str, list[list[int]]]:
    llm = LLM(model=str(path), **ENGINE)
    try:
        outs = llm.generate(
            [{"prompt_token_ids": p} for _, p, _ in reqs], [sp for *_, sp in reqs], use_tqdm=False
        )
    finally:
        llm.llm_engine.shutdown()
    return {rid: [list(c.token_ids) for c in o.outputs] for (rid, *_), o in zip(reqs, outs)}


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_abort_and_prefix_hits_with_drafts_in_flight(tmp_path, method):
    path = write_tiny_model(tmp_path / "m", "llama", seed=4)
    spec = (
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}
        if method == "ngram"
        else {"model": str(path), "num_speculative_tokens": 3}
    )
    reqs = _requests()
    want = _plain(path, reqs)
    llm = LLM(model=str(path), pipeline_parallel_size=2, speculative_config=spec, **ENGINE)
    engine = llm.llm_engine
    got: dict[str, list[list[int]]] = {}
    try:
        for rid, prompt, sp in reqs:
            engine.add_request(rid, {"prompt_token_ids": prompt}, sp)
        aborted = False
        readded: list[tuple[str, list[int], SamplingParams]] = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    got[out.request_id] = [list(c.token_ids) for c in out.outputs]
                    if out.request_id == "r0" and not readded:  # a prefix-cache hit
                        readded.append(("again", reqs[0][1], reqs[0][2]))
                        engine.add_request("again", {"prompt_token_ids": reqs[0][1]}, reqs[0][2])
            req = engine.scheduler.get_request(ABORTED)
            done = [] if req is None else list(req.seqs[0].output_token_ids)
            if not aborted and len(done) >= 2 and req in engine.scheduler.busy:
                aborted = True
                engine.abort_request(ABORTED)
                # the id again at once, while the aborted request's step is still in flight
                engine.add_request(ABORTED, {"prompt_token_ids": reqs[2][1]}, reqs[2][2])
        stats = engine.get_stats()
    finally:
        engine.shutdown()
    assert aborted and readded
    assert stats.spec_decode_num_accepted_tokens > 0 and stats.num_used_blocks == 0
    want["again"] = want["r0"]
    assert got == want
