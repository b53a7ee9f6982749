"""Long runs of the offline API: waves of mixed requests through one `LLM` (n > 1, best_of,
beams, stop strings, logprobs and prompt logprobs, grammars, prefix-cache hits, chunked prefill
and preemption on a tiny KV pool, aborts, DELTA outputs). Once idle after each wave, the engine
holds nothing of them (tests/engine_state.py), every KV block is free again, and live Python
objects, threads and file descriptors stay where the first wave left them."""

from __future__ import annotations

import gc
import os
import random
import threading
from collections.abc import Iterator

import pytest
from engine_state import leftovers

from paged_engine import LLM, SamplingParams
from paged_engine.sampling_params import BeamSearchParams, RequestOutputKind
from paged_engine.structured_output.params import StructuredOutputsParams

pytest.importorskip("llguidance")

PREFIXES = [  # shared heads: prefix-cache hits, longer than the step's token budget
    "The quick brown fox jumps over the lazy dog. " * 2,
    "Once upon a time there was a king with three sons. " * 2,
]
SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}},
    "required": ["a"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> Iterator[LLM]:
    llm = LLM(
        model=str(tiny_llama_dir),
        dtype="float32",
        max_model_len=128,
        num_gpu_blocks_override=12,  # 176 token slots for up to 16 sequences: preemption
        max_num_batched_tokens=32,  # a prefix alone is longer: chunked prefill
        max_num_seqs=16,
        swap_space=0.01,  # preemption by swap or by recompute
    )
    yield llm
    llm.llm_engine.shutdown()


def _params(i: int, rng: random.Random) -> SamplingParams:
    kind = i % 7
    if kind == 1:
        return SamplingParams(max_tokens=4, n=3, temperature=1.0, seed=i)
    if kind == 2:
        return SamplingParams(max_tokens=8, stop=["e", "o "], include_stop_str_in_output=i % 2 == 0)
    if kind == 3:
        return SamplingParams(max_tokens=3, logprobs=3, prompt_logprobs=2)
    if kind == 4:
        return SamplingParams(max_tokens=6, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    if kind == 5:
        regex = f"[a-c]{{1,{1 + i % 4}}}"
        return SamplingParams(max_tokens=6, structured_outputs=StructuredOutputsParams(regex=regex))
    if kind == 6:
        return SamplingParams(max_tokens=4, n=2, best_of=3, temperature=1.0, seed=i)
    return SamplingParams(max_tokens=rng.randint(1, 5), temperature=rng.choice([0.0, 1.0]))


def _wave(llm: LLM, seed: int) -> None:
    rng = random.Random(seed)
    prompts = [rng.choice(PREFIXES) + rng.choice(["a", "b c", "d e f"]) for _ in range(14)]
    llm.generate(prompts, [_params(i, rng) for i in range(len(prompts))], use_tqdm=False)
    llm.beam_search([PREFIXES[0] + "x", PREFIXES[1]], BeamSearchParams(beam_width=2, max_tokens=3))
    engine = llm.llm_engine
    ids = [f"w{seed}-{j}" for j in range(6)]  # running when half of them are aborted
    for j, rid in enumerate(ids):
        params = SamplingParams(
            max_tokens=20, ignore_eos=True, n=1 + j % 2, output_kind=RequestOutputKind.DELTA
        )
        engine.add_request(rid, PREFIXES[j % 2] + str(j), params)
    for _ in range(3):
        engine.step()
    engine.abort_request(ids[::2])
    while engine.has_unfinished_requests():
        engine.step()


def _idle(llm: LLM) -> None:
    """Step until the engine has nothing to do: the sequences that finished in the last step
    leave the worker with the next one (LLM.generate returns before it)."""
    engine = llm.llm_engine
    while engine.engine_core.can_step():
        engine.step()


def test_waves_of_mixed_requests_leave_the_engine_as_they_found_it(llm: LLM) -> None:
    engine = llm.llm_engine
    pool = engine.block_manager.pool
    free = pool.num_free_blocks
    _wave(llm, 0)  # the first wave builds what every later one reuses (grammars, caches)
    _idle(llm)
    gc.collect()
    objects, threads = len(gc.get_objects()), threading.active_count()
    fds = len(os.listdir("/proc/self/fd"))
    for seed in (1, 2):
        _wave(llm, seed)
        _idle(llm)
        assert leftovers(engine) == {}
        assert pool.num_free_blocks == free
    sched = engine.scheduler
    assert sched.num_preemptions > 0, "the KV pool is too large to preempt"
    assert engine.block_manager.prefix_cache_hits > 0
    gc.collect()
    grown = len(gc.get_objects()) - objects
    assert grown < 100, f"{grown} more live objects after two more waves"
    assert threading.active_count() <= threads
    assert len(os.listdir("/proc/self/fd")) <= fds
