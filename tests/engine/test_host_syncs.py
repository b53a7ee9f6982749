"""Host reads of tensors in the worker's step: none while a step is launched (inputs, sampling,
bookkeeping), and one read per result tensor when the core collects the step's output.

Every tensor method that reads device memory on the host (`.tolist()`, `.item()`, `int()`, ...)
is spied on, as in the CUDA-graph tests. On a GPU each would be a host-device sync that stalls
async scheduling; on the CPU they are counted all the same. The model forward is excluded: the
torch reference attention reads lengths on the host by design (the Triton backend does not; the
CUDA-graph tests check that with the same spy). Top-p runs a GPU's way here (a whole-row sort):
the CPU's own (`sampler._nucleus`) reads on the host, which costs a CPU nothing.
"""

from __future__ import annotations

import contextlib
import threading

import pytest
from host_reads import spy_host_reads

from paged_engine import EngineConfig, LLMEngine, SamplingParams


class _Spy:
    """Counts host reads on the thread that activated it (async steps overlap on two threads)."""

    def __init__(self) -> None:
        self._local = threading.local()

    @property
    def active(self) -> bool:
        return getattr(self._local, "active", False)

    @active.setter
    def active(self, value: bool) -> None:
        self._local.active = value

    @property
    def calls(self) -> list[str]:
        return self._local.__dict__.setdefault("calls", [])

    @calls.setter
    def calls(self, value: list[str]) -> None:
        self._local.calls = value

    def record(self, name: str) -> None:
        if self.active:
            self.calls.append(name)

    @contextlib.contextmanager
    def paused(self):
        active, self.active = self.active, False
        try:
            yield
        finally:
            self.active = active


class _Model:
    """The real model, its forward unspied."""

    def __init__(self, model, spy: _Spy) -> None:
        self._model, self._spy = model, spy

    def __call__(self, *args):
        with self._spy.paused():
            return self._model(*args)

    def __getattr__(self, name: str):
        return getattr(self._model, name)


@pytest.fixture(autouse=True)
def _gpu_top_p(monkeypatch: pytest.MonkeyPatch) -> None:
    import paged_engine.sample.sampler as sampler

    gpu_way = sampler._sorted_top_k_top_p
    monkeypatch.setattr(sampler, "_nucleus", lambda sub, k, p, _max_k: gpu_way(sub, k, p))


def _run(model_dir, params: list[SamplingParams], async_scheduling: bool) -> tuple[list, list]:
    """(host reads while launching each step, host reads while collecting each output)."""
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            dtype="float32",
            max_model_len=128,
            max_num_batched_tokens=64,  # long prompts take several chunks
            async_scheduling=async_scheduling,
        )
    )
    spy = _Spy()
    runner = engine.model_runner
    runner.model = _Model(runner.model, spy)
    execute = runner.execute_model
    launches: list[int] = []
    collects: list[int] = []

    def counted_execute(sched):
        spy.active, spy.calls = True, []
        try:
            handle = execute(sched)
        finally:
            spy.active = False
        launches.append(len(spy.calls))
        get = handle.get

        def counted_get():
            spy.active, spy.calls = True, []
            try:
                return get()
            finally:
                spy.active = False
                collects.append(len(spy.calls))

        handle.get = counted_get
        return handle

    runner.execute_model = counted_execute
    with spy_host_reads(spy.record):
        for i, p in enumerate(params):
            engine.add_request(str(i), [5 + i, 7, 9] * (4 + 9 * i), p)
        while engine.has_unfinished_requests():
            engine.step()
    engine.shutdown()
    return launches, collects


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_launching_a_step_reads_nothing_back(tiny_llama_dir, async_scheduling):
    params = [
        SamplingParams(temperature=0.0, max_tokens=12),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_tokens=10),
        SamplingParams(temperature=1.0, seed=7, min_p=0.05, max_tokens=9, n=3),
        SamplingParams(temperature=0.7, logprobs=3, min_tokens=4, stop=["xyz"], max_tokens=8),
        SamplingParams(temperature=0.0, prompt_logprobs=2, max_tokens=5),
    ]
    launches, collects = _run(tiny_llama_dir, params, async_scheduling)
    assert len(launches) > 10
    assert launches == [0] * len(launches)
    # The sampled ids, the packed logprobs (one request asks) and prompt-logprob chunks: one
    # read each, never more than 3 per step.
    assert max(collects) <= 3 and sum(collects) > len(collects)


def test_penalty_rows_read_only_landed_results(tiny_llama_dir):
    """Penalties keep the output history on the host: the worker reads a previous step's ids
    from the host copy (no device sync: that step's copy has landed), at most once a step."""
    params = [
        SamplingParams(temperature=0.9, repetition_penalty=1.3, max_tokens=10),
        SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.3, max_tokens=8),
    ]
    launches, _ = _run(tiny_llama_dir, params, async_scheduling=True)
    assert max(launches) <= 1 and sum(launches) > 0
