"""Engine overhead: `LLMEngine.step` with 256 running sequences and the model forward stubbed.

The stub returns zeros for the hidden states and one fixed random logits row per sampled
sequence, so what is left is the engine itself: scheduling, the worker's input preparation
(persistent batch -> flat tensors), sampling, applying results (append, stop checks, block
bookkeeping) and the output stage (detokenize, RequestOutputs). Target: under 1 ms per step
without the forward and sampling. Each phase is timed by wrapping the engine's own methods; the
rest of `step` is reported as "other".

`run_overlap` checks async scheduling: with a forward that sleeps (releasing the GIL, as a
device would), a step should cost the forward alone, the host work hidden behind it.
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from collections import defaultdict

import torch

from benchmarks.common import sync
from benchmarks.models import ModelSpec
from benchmarks.throughput import engine_kwargs
from paged_engine.engine.gc_tuning import freeze_startup_heap


class StubModel:
    """Stands in for the model: no compute (or a sleep, standing for device time), fixed logits."""

    def __init__(self, vocab_size: int, max_rows: int, device, seed: int = 0, sleep_s: float = 0):
        g = torch.Generator().manual_seed(seed)
        # contiguous like real logits (an expanded view makes index_select crawl)
        self.logits = torch.randn(max_rows, vocab_size, generator=g).to(device)
        self.device = device
        self.sleep_s = sleep_s

    def __call__(self, input_ids, positions, kv_caches, attn_metadata):
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return torch.zeros(input_ids.shape[0], 1, device=self.device)  # [T, 1]: width unused

    def compute_logits(self, hidden):
        return self.logits[: hidden.shape[0]]


class _Timed:
    """Wraps a callable and accumulates its wall time per step under `name`."""

    def __init__(self, fn, name: str, acc: dict, device: str):
        self.fn, self.name, self.acc, self.device = fn, name, acc, device

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = self.fn(*args, **kwargs)
        sync(self.device)
        self.acc[self.name] += time.perf_counter() - t0
        return out

    def __getattr__(self, name: str):
        return getattr(self.fn, name)


def _engine(spec: ModelSpec, device: str, num_seqs: int, prompt_len: int, steps: int, **kw):
    from paged_engine import LLM

    mml = prompt_len + steps + 64
    kw = engine_kwargs(
        spec, device, mml, load_format="dummy", max_num_seqs=num_seqs, enforce_eager=True, **kw
    )
    kw["max_num_batched_tokens"] = max(num_seqs * prompt_len, 8192)
    return LLM(**kw).llm_engine


def _fill(engine, spec: ModelSpec, num_seqs: int, prompt_len: int, params) -> None:
    rng = random.Random(0)
    for i in range(num_seqs):
        prompt = [rng.randint(0, min(spec.vocab_size, 10000) - 1) for _ in range(prompt_len)]
        engine.add_request(f"ovh-{i}", {"prompt_token_ids": prompt}, params)
    while engine.get_stats().num_running < num_seqs or engine.get_stats().num_waiting:
        engine.step()  # prefill until every sequence is decoding
    for _ in range(3):
        engine.step()  # warm-up


def _sampling(device: str) -> dict:
    # On a GPU the sampler is device work; on a CPU a top-p sort of [256, 151936] costs seconds
    # per step, so the CPU run samples greedily (argmax over the same logits).
    return dict(temperature=0.8, top_p=0.95) if device == "cuda" else dict(temperature=0.0)


def run(
    spec: ModelSpec,
    device: str,
    *,
    num_seqs: int = 256,
    prompt_len: int = 32,
    steps: int = 50,
    output_kind: str = "DELTA",
    log=print,
) -> dict:
    """Synchronous steps, each phase timed. `output_kind`: what the outputs of every step hold
    (DELTA: a streaming server; CUMULATIVE: the default of LLMEngine)."""
    from paged_engine import RequestOutputKind, SamplingParams

    engine = _engine(spec, device, num_seqs, prompt_len, steps, async_scheduling=False)
    runner = engine.model_runner
    runner.model = StubModel(spec.vocab_size, num_seqs, runner.device)
    sampling = _sampling(device)
    kind = RequestOutputKind[output_kind]
    params = SamplingParams(**sampling, ignore_eos=True, max_tokens=steps + 32, output_kind=kind)
    _fill(engine, spec, num_seqs, prompt_len, params)

    acc: dict = defaultdict(float)
    phases = {
        "schedule": (engine.scheduler, "schedule"),
        "execute_model": (runner, "execute_model"),
        "prepare_inputs": (runner, "prepare"),
        "forward_stub": (runner, "model"),
        "sample": (runner, "sampler"),
        "apply_outputs": (engine.engine_core, "_apply"),
        "process_outputs": (engine.output_processor, "process"),
    }
    for name, (obj, attr) in phases.items():
        setattr(obj, attr, _Timed(getattr(obj, attr), name, acc, device))
    per_step: dict[str, list[float]] = defaultdict(list)
    # As paged-server does once its engine is up: collections skip the startup heap
    # (engine/gc_tuning.py); undone after the timed steps.
    freeze_startup_heap()
    try:
        for _ in range(steps):
            acc.clear()
            t0 = time.perf_counter()
            engine.step()
            sync(device)
            total = time.perf_counter() - t0
            running = engine.scheduler.num_running
            assert running == num_seqs, f"{running} sequences running, expected {num_seqs}"
            per_step["total"].append(total)
            for name in phases:
                per_step[name].append(acc[name])
    finally:
        gc.unfreeze()
    # execute_model contains prepare, forward and sample: report the rest of it on its own
    per_step["worker_other"] = [
        e - p - f - s
        for e, p, f, s in zip(
            per_step.pop("execute_model"),
            per_step["prepare_inputs"],
            per_step["forward_stub"],
            per_step["sample"],
        )
    ]
    named = [sum(v[i] for k, v in per_step.items() if k != "total") for i in range(steps)]
    per_step["other"] = [t - n for t, n in zip(per_step["total"], named)]
    ms = {
        name: {
            "mean_ms": round(1e3 * statistics.fmean(v), 3),
            "p50_ms": round(1e3 * statistics.median(v), 3),
        }
        for name, v in per_step.items()
    }
    total = ms["total"]["p50_ms"] - ms["forward_stub"]["p50_ms"]
    engine_only = total - ms["sample"]["p50_ms"]
    # paged-server runs the output stage on a thread of its own: what its engine thread does
    engine_thread = engine_only - ms["process_outputs"]["p50_ms"]
    # means: collector pauses (rare, long) show there, not in the median
    mean = {k: v["mean_ms"] for k, v in ms.items()}
    mean_engine = mean["total"] - mean["forward_stub"] - mean["sample"]
    rec = {
        "num_running_seqs": num_seqs,
        "steps_timed": steps,
        "model": spec.origin,
        "vocab_size": spec.vocab_size,
        "engine_device": str(runner.device),
        "sampling": ", ".join(f"{k} {v}" for k, v in sampling.items()),
        "output_kind": output_kind,
        "phases": ms,
        "step_ms_without_forward": round(total, 3),
        # the target covers scheduling, bookkeeping, input preparation and output processing
        "step_ms_without_forward_and_sampling": round(engine_only, 3),
        "engine_thread_ms_without_forward_and_sampling": round(engine_thread, 3),
        "mean_step_ms_without_forward_and_sampling": round(mean_engine, 3),
        "mean_engine_thread_ms_without_forward_and_sampling": round(
            mean_engine - mean["process_outputs"], 3
        ),
        "gc": "startup heap frozen (as paged-server)",
        "target_ms": 1.0,
        "meets_target": engine_only < 1.0,
    }
    log(
        f"    -> {engine_only:.3f} ms per step (p50) without forward and sampling, {total:.3f} ms "
        f"with sampling, {engine_thread:.3f} ms on the engine thread ({num_seqs} sequences, "
        f"{output_kind} outputs)"
    )
    return rec


def run_overlap(
    spec: ModelSpec,
    device: str,
    *,
    num_seqs: int = 256,
    prompt_len: int = 32,
    steps: int = 50,
    forward_ms: float = 10.0,
    log=print,
) -> dict:
    """Wall time per step with a forward that sleeps `forward_ms`, async scheduling off and on."""
    from paged_engine import RequestOutputKind, SamplingParams

    rec: dict = {"forward_ms": forward_ms, "num_running_seqs": num_seqs, "steps_timed": steps}
    for mode in (False, True):
        engine = _engine(spec, device, num_seqs, prompt_len, steps, async_scheduling=mode)
        runner = engine.model_runner
        runner.model = StubModel(spec.vocab_size, num_seqs, runner.device)
        params = SamplingParams(
            **_sampling(device),
            ignore_eos=True,
            max_tokens=steps + 32,
            output_kind=RequestOutputKind.DELTA,
        )
        _fill(engine, spec, num_seqs, prompt_len, params)
        runner.model.sleep_s = forward_ms / 1e3
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            sync(device)
            times.append(time.perf_counter() - t0)
        engine.shutdown()
        rec["async" if mode else "sync"] = {
            "step_mean_ms": round(1e3 * statistics.fmean(times), 3),
            "step_p50_ms": round(1e3 * statistics.median(times), 3),
        }
    ratio = rec["async"]["step_p50_ms"] / forward_ms
    rec["async_step_over_forward"] = round(ratio, 3)
    rec["meets_target"] = ratio <= 1.10
    log(
        f"    -> forward {forward_ms:.0f} ms: step {rec['sync']['step_p50_ms']:.2f} ms sync, "
        f"{rec['async']['step_p50_ms']:.2f} ms async ({ratio:.3f}x the forward)"
    )
    return rec
