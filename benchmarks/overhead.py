"""Engine overhead: one `LLMEngine.step` with 256 running sequences, the model forward stubbed.

The stub returns zeros for the hidden states and one fixed random logits row per sampled
sequence, so what is left is the engine itself: scheduling, block bookkeeping, input
preparation (host tensors, copy to the device), sampling, output processing (append, stop checks,
detokenize, RequestOutput). Target: under 1 ms per step. Each phase is timed by wrapping the
engine's own methods; the rest of `step` is reported as "other".
"""

from __future__ import annotations

import random
import statistics
import time
from collections import defaultdict

import torch

from benchmarks.common import sync
from benchmarks.models import ModelSpec
from benchmarks.throughput import engine_kwargs


class StubModel:
    """Stands in for the model: no compute, fixed logits."""

    def __init__(self, vocab_size: int, max_rows: int, device, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        # contiguous like real logits (an expanded view makes index_select crawl)
        self.logits = torch.randn(max_rows, vocab_size, generator=g).to(device)
        self.device = device

    def __call__(self, input_ids, positions, kv_caches, attn_metadata):
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


def run(
    spec: ModelSpec,
    device: str,
    *,
    num_seqs: int = 256,
    prompt_len: int = 32,
    steps: int = 50,
    log=print,
) -> dict:
    from paged_engine import LLM, SamplingParams

    mml = prompt_len + steps + 64
    kw = engine_kwargs(
        spec, device, mml, load_format="dummy", max_num_seqs=num_seqs, enforce_eager=True
    )
    kw["max_num_batched_tokens"] = max(num_seqs * prompt_len, 8192)
    llm = LLM(**kw)
    engine = llm.llm_engine
    runner = engine.model_runner
    runner.model = StubModel(spec.vocab_size, num_seqs, runner.device)
    if getattr(runner, "graphs", None) is not None:
        runner.graphs = None
    rng = random.Random(0)
    # On a GPU the sampler is device work; on a CPU a top-p sort of [256, 151936] costs seconds
    # per step, so the CPU run samples greedily (argmax over the same logits).
    sampling = dict(temperature=0.8, top_p=0.95) if device == "cuda" else dict(temperature=0.0)
    params = SamplingParams(**sampling, ignore_eos=True, max_tokens=steps + 32)
    for i in range(num_seqs):
        prompt = [rng.randint(0, min(spec.vocab_size, 10000) - 1) for _ in range(prompt_len)]
        engine.add_request(f"ovh-{i}", {"prompt_token_ids": prompt}, params)
    while engine.get_stats().num_running < num_seqs or engine.get_stats().num_waiting:
        engine.step()  # prefill until every sequence is decoding
    for _ in range(3):
        engine.step()  # warm-up

    acc: dict = defaultdict(float)
    phases = {
        "schedule": (engine.scheduler, "schedule"),
        "prepare_inputs": (runner, "prepare"),
        "forward_stub": (runner, "model"),
        "update_after_step": (engine.scheduler, "update_after_step"),
        "sample": (engine.output_processor, "sampler"),
        "process_outputs": (engine.output_processor, "process"),
    }
    for name, (obj, attr) in phases.items():
        setattr(obj, attr, _Timed(getattr(obj, attr), name, acc, device))
    runner.model.compute_logits = runner.model.fn.compute_logits  # the wrapper hides it
    per_step: dict[str, list[float]] = defaultdict(list)
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
    # process_outputs includes sample: report it exclusive of sampling
    per_step["process_outputs"] = [
        p - s for p, s in zip(per_step["process_outputs"], per_step["sample"])
    ]
    named = [sum(per_step[n][i] for n in phases) for i in range(steps)]
    per_step["other"] = [t - n for t, n in zip(per_step["total"], named)]
    ms = {
        name: {
            "mean_ms": round(1e3 * statistics.fmean(v), 3),
            "p50_ms": round(1e3 * statistics.median(v), 3),
        }
        for name, v in per_step.items()
    }
    total = ms["total"]["mean_ms"] - ms["forward_stub"]["mean_ms"]
    engine_only = total - ms["sample"]["mean_ms"]
    rec = {
        "num_running_seqs": num_seqs,
        "steps_timed": steps,
        "model": spec.origin,
        "vocab_size": spec.vocab_size,
        "engine_device": str(runner.device),
        "sampling": ", ".join(f"{k} {v}" for k, v in sampling.items()),
        "phases": ms,
        "step_ms_without_forward": round(total, 3),
        # the target covers scheduling, bookkeeping, input preparation and output processing
        "step_ms_without_forward_and_sampling": round(engine_only, 3),
        "target_ms": 1.0,
        "meets_target": engine_only < 1.0,
    }
    log(
        f"    -> {engine_only:.3f} ms per step without forward and sampling, {total:.3f} ms with "
        f"sampling ({num_seqs} sequences)"
    )
    return rec
