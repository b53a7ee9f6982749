"""Where a paged step's time goes: engine start, kernels by GPU time, host time, GPU idle.

    python -m benchmarks.gpu_profile --model-config qwen3-0.6b --out DIR     # on a GPU
    python -m benchmarks.gpu_profile --smoke --out DIR                       # CPU rehearsal

1. Engine start: the wall time of `LLM(...)` (config, dummy weights, KV sizing, CUDA-graph
   capture); issue 14's goal for Qwen3-0.6B is under 10 s.
2. Steady decode at batch `--batch` (256): that many nano-vllm prompts are admitted and
   prefilled; once every request gets a token each step, `--steps` engine steps run under
   torch.profiler. From the trace (Kineto's chrome-trace JSON, one clock for host and device):
   - kernels by GPU time (top 15, with their share of all GPU time);
   - wall time per step, and host time per step = wall minus the time the host sat in
     `cuda*Synchronize` calls (the host work async scheduling has to hide);
   - GPU idle fraction = 1 - (union of kernel / memcpy / memset intervals) / (wall span of the
     profiled steps); issue 14's goal at batch 256 is under 5%;
   - `idle_gaps`: that idle time by where it falls (the GPU op before and after each gap, and
     the host op that launched the one after), and how much of it the host launched late.
   Without CUDA (the rehearsal) the GPU fields are null and the top host ops are reported.
3. Where the host time goes: the CUDA runtime calls by host time (from the same trace), the
   Python functions of `--steps` more steps under cProfile (by own and by inclusive time), and
   on CUDA the ops that synchronize with the device in 3 steps (torch's sync debug mode: each
   call site with its paged frames). Requests ask for an output every step, as the server's do;
   `--final-only` for the final output alone, as `LLM.generate`'s (less host work a step).
4. `--profile-prefill`: the admission steps (the prompts' prefill) under the profiler too, the
   same summary as `prefill_profile`, with their Python functions under cProfile.
5. `jit_builds`: the Triton kernels built in each phase (engine start, prefill, steady decode),
   counted and timed from Triton's pre- to its post-compile hook: a build is a compile, or a
   load from Triton's on-disk cache (which outlives a process, not a machine). A kernel built
   after the start is one the start's profile forward and graph capture did not cover; its
   first step pays for it.

Writes `gpu_profile.json` (and nothing large: the raw trace stays in the work dir).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from contextlib import nullcontext
from pathlib import Path

import torch

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
STEP = "paged_step"


def _engine_step(engine) -> int:
    """One LLMEngine step; returns how many requests got tokens (core outputs)."""
    core = engine.step_core()
    if core:
        processed = engine.process_outputs(core)
        if processed.stopped:
            engine.finish_seqs(processed.stopped)
    return len(core)


def _union_us(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Total length of the union of [start, end) intervals clipped to [lo, hi)."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted((max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def summarize_trace(trace_path: Path, top: int = 15) -> dict:
    """Kernels by GPU time, per-step wall / host time, GPU idle fraction from a chrome trace."""
    events = json.loads(trace_path.read_text())["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    steps = sorted(
        (e["ts"], e["ts"] + e["dur"])
        for e in spans
        if e.get("cat") == "user_annotation" and e.get("name") == STEP
    )
    if not steps:
        raise RuntimeError(f"no {STEP!r} ranges in {trace_path}")
    lo, hi = steps[0][0], steps[-1][1]
    wall_us = sum(e - s for s, e in steps)
    sync_us = _union_us(
        [
            (e["ts"], e["ts"] + e["dur"])
            for e in spans
            if e.get("cat") in ("cuda_runtime", "cuda_driver") and "Synchronize" in e["name"]
        ],
        lo,
        hi,
    )
    gpu = [e for e in spans if e.get("cat") in GPU_CATS]
    calls: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in spans:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and lo <= e["ts"] <= hi:
            calls[e["name"]][0] += 1
            calls[e["name"]][1] += e["dur"]
    out: dict = {
        "steps": len(steps),
        "wall_ms_per_step": round(wall_us / len(steps) / 1e3, 3),
        "host_ms_per_step": round((wall_us - sync_us) / len(steps) / 1e3, 3),
        "sync_wait_ms_per_step": round(sync_us / len(steps) / 1e3, 3),
        "runtime_calls": [
            {
                "name": n,
                "calls_per_step": round(c / len(steps), 1),
                "ms_per_step": round(us / len(steps) / 1e3, 3),
            }
            for n, (c, us) in sorted(calls.items(), key=lambda kv: -kv[1][1])[:10]
        ],
    }
    if gpu:
        by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        for e in gpu:
            rec = by_name[e["name"]]
            rec[0] += 1
            rec[1] += e["dur"]
        total = sum(v[1] for v in by_name.values())
        busy = _union_us([(e["ts"], e["ts"] + e["dur"]) for e in gpu], lo, hi)
        out["gpu_ms_per_step"] = round(busy / len(steps) / 1e3, 3)
        out["gpu_idle_fraction"] = round(1.0 - busy / (hi - lo), 4)
        out["idle_gaps"] = idle_gaps(spans, lo, hi, len(steps))
        out["top_kernels"] = [
            {
                "name": name[:160],
                "calls": n,
                "total_ms": round(us / 1e3, 3),
                "share": round(us / total, 4),
            }
            for name, (n, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
        ]
    else:  # no device activity: the host ops are what there is to see (inclusive time)
        out["gpu_idle_fraction"] = None
        ops: dict[str, float] = defaultdict(float)
        for e in spans:
            if e.get("cat") == "cpu_op" and lo <= e["ts"] <= hi:
                ops[e["name"]] += e["dur"]
        out["top_host_ops_inclusive"] = [
            {"name": n, "ms_per_step": round(us / len(steps) / 1e3, 3)}
            for n, us in sorted(ops.items(), key=lambda kv: -kv[1])[:top]
        ]
    return out


def idle_gaps(spans: list[dict], lo: float, hi: float, steps: int, top: int = 8) -> dict:
    """Where the GPU sits idle in [lo, hi): each gap between the end of the busy union and the
    next GPU op, by (op before, op after, the host op that launched the one after).

    A gap is "host late" when the launch call of the op after it started after the GPU went
    idle: the host had not yet issued the work (Python, launches, uploads in its way). Otherwise
    the op was queued in time and the gap is on the device's side (a graph launch's latency, a
    stream waiting on an event or a copy). Launches pair with their GPU ops by Kineto's
    correlation id; the host op is the innermost `cpu_op` around the launch on its thread.
    """
    import bisect

    launches = {
        e["args"]["correlation"]: e
        for e in spans
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    ops_by_tid: dict = defaultdict(list)
    for e in spans:
        if e.get("cat") == "cpu_op":
            ops_by_tid[e.get("tid")].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    starts = {}
    for tid, ops in ops_by_tid.items():
        ops.sort()
        starts[tid] = [o[0] for o in ops]

    def host_op(call: dict) -> str:
        ops, t = ops_by_tid.get(call.get("tid"), []), call["ts"]
        i = bisect.bisect_right(starts.get(call.get("tid"), []), t)
        for _, e, name in reversed(ops[max(0, i - 256) : i]):  # the latest start around t
            if e >= t:
                return name
        return "(no op)"

    gpu = sorted((e for e in spans if e.get("cat") in GPU_CATS), key=lambda e: e["ts"])
    pairs: dict[tuple, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    busy_end, before, total, late = None, "(step start)", 0.0, 0.0
    for e in gpu:
        end = e["ts"] + e["dur"]
        if end <= lo or e["ts"] >= hi:
            continue
        start = max(e["ts"], lo)
        if start > (lo if busy_end is None else busy_end):
            idle_from = lo if busy_end is None else busy_end
            gap = start - idle_from
            call = launches.get(e.get("args", {}).get("correlation"))
            launched_late = call is not None and call["ts"] >= idle_from
            via = f"{call['name']} in {host_op(call)}" if call is not None else "(no launch)"
            rec = pairs[(before, e["name"], via)]
            rec[0] += 1
            rec[1] += gap
            rec[2] += gap if launched_late else 0.0
            total += gap
            late += gap if launched_late else 0.0
        if busy_end is None or end > busy_end:
            busy_end, before = end, e["name"]
    if busy_end is not None and busy_end < hi:  # after the last op: the sync at the end
        total += hi - busy_end
    return {
        "idle_ms_per_step": round(total / steps / 1e3, 4),
        "host_late_ms_per_step": round(late / steps / 1e3, 4),
        "gaps_per_step": round(sum(r[0] for r in pairs.values()) / steps, 1),
        "top": [
            {
                "before": b[:100],
                "after": a[:100],
                "launched_by": via[:120],
                "gaps_per_step": round(n / steps, 2),
                "ms_per_step": round(us / steps / 1e3, 4),
                "host_late_share": round(late_us / us, 2) if us else 0.0,
            }
            for (b, a, via), (n, us, late_us) in sorted(pairs.items(), key=lambda kv: -kv[1][1])[
                :top
            ]
        ],
    }


def _layer_kernels(engine) -> dict[str, str]:
    """What the engine's norms, residual adds, ropes and gated SiLUs run on: torch ops or the
    Triton kernels the worker swapped in ("unknown": workers in other processes)."""
    from paged_engine.layers.activation import SiluAndMul
    from paged_engine.layers.norm import RMSNorm
    from paged_engine.layers.rotary import RotaryEmbedding

    parts = {
        "norms": (RMSNorm, "kernel", "paged_kernels.rms_norm"),
        "residual_adds": (RMSNorm, "add_kernel", "paged_kernels.add_rms_norm"),
        "rope": (RotaryEmbedding, "kernel", "paged_kernels.rope_qk_"),
        "gated_silu": (SiluAndMul, "kernel", "paged_kernels.silu_and_mul"),
    }
    worker = getattr(engine.engine_core.executor, "worker", None)  # in-process workers only
    if worker is None:
        return dict.fromkeys([*parts, "sampler_race"], "unknown")
    modules = list(worker.model_runner.model.modules())
    race = worker.model_runner.sampler.race
    return {
        **{
            part: kernel
            if any(isinstance(m, cls) and getattr(m, attr) is not None for m in modules)
            else "torch ops"
            for part, (cls, attr, kernel) in parts.items()
        },
        "sampler_race": f"paged_kernels.{race.__name__}" if race is not None else "torch ops",
    }


def _summarize(prof, trace: Path) -> dict:
    """summarize_trace of a finished profiler session, its chrome trace written to `trace`."""
    prof.export_chrome_trace(str(trace))
    return summarize_trace(trace)


def _unfuse_layers() -> None:
    """Engines built from now on in this process run their norms as paged_kernels.rms_norm
    alone and their residual adds, ropes and gated SiLUs on torch ops (`--unfused`)."""
    from paged_engine.layers.norm import RMSNorm
    from paged_engine.worker import worker

    norms_only = worker.use_triton_norms

    def rms_norm_alone(model) -> int:
        switched = norms_only(model)
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.add_kernel = None
        return switched

    worker.use_triton_norms = rms_norm_alone
    worker.use_triton_rope = lambda model: 0
    worker.use_triton_activations = lambda model: 0


def _host_functions(engine, steps: int, top: int = 25) -> dict:
    """cProfile over `steps` engine steps: the top functions by own and by inclusive time."""
    import cProfile

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        _engine_step(engine)
    prof.disable()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return _top_functions(prof, steps, top)


def _top_functions(prof, steps: int, top: int = 25) -> dict:
    """A finished cProfile session's top functions by own and by inclusive time, per step."""
    import pstats

    stats = pstats.Stats(prof).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, callers)

    def row(key, v) -> dict:
        file, line, name = key
        where = f"{Path(file).name}:{line}({name})" if line else name
        return {
            "function": where,
            "calls_per_step": round(v[1] / steps, 1),
            "own_ms_per_step": round(v[2] / steps * 1e3, 3),
            "incl_ms_per_step": round(v[3] / steps * 1e3, 3),
        }

    items = list(stats.items())
    return {
        "by_own_time": [row(k, v) for k, v in sorted(items, key=lambda kv: -kv[1][2])[:top]],
        "by_inclusive_time": [row(k, v) for k, v in sorted(items, key=lambda kv: -kv[1][3])[:top]],
    }


class JitBuilds:
    """Triton kernel builds by phase, from Triton's jit_cache_hook (called on an in-memory cache
    miss, before the compile or the on-disk cache's load) and jit_post_compile_hook (after it).
    Set `phase` as the run moves on; `summary()` gives each phase's builds, seconds and kernels.
    Without Triton's hooks (the interpreter, or a Triton before `triton.knobs`) nothing is
    counted and `available` is False."""

    def __init__(self) -> None:
        self.phase = "start"
        self.builds: dict[str, list[tuple[str, float]]] = defaultdict(list)
        self.available = False
        self._began = 0.0
        self._saved: tuple | None = None

    def __enter__(self) -> JitBuilds:
        try:
            from triton import knobs

            runtime = knobs.runtime
            self._saved = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
        except (ImportError, AttributeError):
            return self
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = self.before, self.after
        self.available = os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
        return self

    def __exit__(self, *exc) -> None:
        if self._saved is not None:
            from triton import knobs

            knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = self._saved

    def before(self, **_) -> bool:
        self._began = time.perf_counter()
        return False  # True would tell Triton to skip the compile

    def after(self, **kw) -> None:
        full = str(kw.get("repr", "?"))  # "kernel[num_warps=...](specialization)"
        self.builds[self.phase].append((full, time.perf_counter() - self._began))

    def summary(self) -> dict:
        """Per phase: builds, seconds, builds per kernel; after the start, each build's full
        repr too (its constexprs and argument specialization: what a step changed)."""
        out = {}
        for phase, builds in self.builds.items():
            kernels: dict[str, int] = defaultdict(int)
            for full, _ in builds:
                kernels[full.split("[", 1)[0]] += 1
            seconds = round(sum(t for _, t in builds), 3)
            out[phase] = {"builds": len(builds), "seconds": seconds, "kernels": dict(kernels)}
            if phase != "start":
                out[phase]["variants"] = [full[:1500] for full, _ in builds]
        return out


def _sync_points(engine, steps: int) -> list[dict]:
    """Ops that synchronize the host with the device during `steps` engine steps (torch's
    sync debug mode), each call site counted once with its innermost paged frames."""
    import traceback
    import warnings

    sites: dict[str, dict] = {}

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        if str(message).startswith("Synchronization debug mode is a prototype"):
            return  # torch's notice on switching the mode on, not a sync
        frames = [
            f"{Path(f.filename).name}:{f.lineno}({f.name})"
            for f in traceback.extract_stack()[:-1]
            if "paged_" in f.filename or "benchmarks" in f.filename
        ]
        key = " <- ".join(reversed(frames[-4:])) or f"{filename}:{lineno}"
        site = sites.setdefault(key, {"site": key, "what": str(message)[:120], "count": 0})
        site["count"] += 1

    shown = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                _engine_step(engine)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = shown
    return sorted(sites.values(), key=lambda s: -s["count"])


def run(
    model_dir: Path,
    device: str,
    batch: int,
    steps: int,
    work_dir: Path,
    final_only: bool = False,
    profile_prefill: bool = False,
    **engine_kw,
) -> dict:
    with JitBuilds() as jit:
        result = _profile(
            jit, model_dir, device, batch, steps, work_dir, final_only, profile_prefill, **engine_kw
        )
    return {**result, "jit_builds": jit.summary() if jit.available else None}


def _profile(
    jit: JitBuilds,
    model_dir: Path,
    device: str,
    batch: int,
    steps: int,
    work_dir: Path,
    final_only: bool,
    profile_prefill: bool,
    **engine_kw,
) -> dict:
    import cProfile

    from torch.profiler import ProfilerActivity, profile, record_function

    from benchmarks.workloads import nano_vllm
    from paged_engine import LLM, SamplingParams

    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm = LLM(model=str(model_dir), device=device, seed=0, **engine_kw)
    if device == "cuda":
        torch.cuda.synchronize()
    start_s = time.perf_counter() - t0
    engine = llm.llm_engine
    small = device != "cuda"
    wl = nano_vllm(
        batch,
        (16, 64) if small else (100, 1024),
        (steps + 64, steps + 64) if small else (1024, 1024),
        max_token_id=min(10000, vocab - 1),
    )
    for i, r in enumerate(wl.requests):
        params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=r.max_tokens)
        engine.add_request(
            f"p{i}", {"prompt_token_ids": r.prompt_token_ids}, params, final_only=final_only
        )
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    jit.phase = "prefill"
    host_prof = cProfile.Profile() if profile_prefill else None
    t0 = time.perf_counter()
    warm_steps, full = 0, 0
    with profile(activities=activities) if profile_prefill else nullcontext() as prefill_prof:
        if host_prof is not None:
            host_prof.enable()
        while full < 3:  # prefill (chunked or not) done: every request gets a token, 3 steps
            with record_function(STEP):
                got = _engine_step(engine)
            warm_steps += 1
            full = full + 1 if got == batch and engine.scheduler.num_waiting == 0 else 0
            if warm_steps > 10_000:
                raise RuntimeError("the batch never reached a steady decode")
        if device == "cuda":
            torch.cuda.synchronize()
        if host_prof is not None:
            host_prof.disable()
    prefill_s = time.perf_counter() - t0
    jit.phase = "decode"
    prefill_summary = None
    if prefill_prof is not None:
        prefill_summary = _summarize(prefill_prof, work_dir / "gpu_profile_prefill_trace.json")
        prefill_summary["host_functions"] = _top_functions(host_prof, warm_steps)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            with record_function(STEP):
                _engine_step(engine)
        if device == "cuda":
            torch.cuda.synchronize()
    summary = _summarize(prof, work_dir / "gpu_profile_trace.json")
    # The same steps again without the profiler: its own overhead inflates host time.
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        _engine_step(engine)
    if device == "cuda":
        torch.cuda.synchronize()
    summary["unprofiled_wall_ms_per_step"] = round((time.perf_counter() - t0) / steps * 1e3, 3)
    summary["decode_tokens_per_s_unprofiled"] = round(
        batch / (summary["unprofiled_wall_ms_per_step"] / 1e3), 1
    )
    summary["host_functions"] = _host_functions(engine, steps)
    if device == "cuda":
        summary["sync_points"] = _sync_points(engine, 3)
    stats = llm.get_stats()
    engine.abort_request([f"p{i}" for i in range(batch)])
    return {
        "engine_start_s": round(start_s, 2),
        "batch": batch,
        "warmup_steps": warm_steps,
        "prefill_s": round(prefill_s, 2),
        # --profile-prefill: the admission steps' kernels and idle time (prefill_s then includes
        # the profiler's overhead)
        "prefill_profile": prefill_summary,
        "kv_blocks": stats.num_total_blocks,
        "num_preemptions": stats.num_preemptions,
        "async_scheduling": engine.config.async_scheduling,
        "engine": {k: v for k, v in engine_kw.items()},
        **_layer_kernels(engine),
        "outputs": "final only (as LLM.generate)" if final_only else "every step (as served)",
        **summary,
    }


def main(argv: list[str] | None = None) -> int:
    from benchmarks.common import environment
    from benchmarks.models import config_dir

    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_profile", description=__doc__)
    p.add_argument("--model-config", default="qwen3-0.6b", help="a name in benchmarks/configs")
    p.add_argument("--batch", type=int, default=None, help="sequences decoding (256; smoke 8)")
    p.add_argument("--steps", type=int, default=None, help="profiled steps (30; smoke 4)")
    p.add_argument("--smoke", action="store_true", help="tiny layers and batch: CPU rehearsal")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--quantization", default=None, help="the engine's, e.g. fp8 (CUDA)")
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="the engine's (256); hybrid models hold a recurrent state per seat",
    )
    p.add_argument(
        "--override-config",
        type=json.loads,
        default={},
        help='JSON merged into the config, e.g. \'{"quantization_config": {"quant_method": '
        "\"mxfp4\"}}' (gpt-oss's experts kept in MXFP4 on CUDA)",
    )
    p.add_argument(
        "--torch-norms",
        action="store_true",
        help="RMSNorm on torch ops (4 kernels a norm) instead of the Triton kernel: the A/B",
    )
    p.add_argument(
        "--unfused",
        action="store_true",
        help="norms as paged_kernels.rms_norm alone; residual adds, rope and gated SiLU on torch "
        "ops (the engine before its fused layer epilogues): the A/B",
    )
    p.add_argument(
        "--torch-sampler",
        action="store_true",
        help="random rows race on torch ops (softmax, noise, quotient, argmin) instead of "
        "paged_kernels.gumbel_race's one pass: the A/B",
    )
    p.add_argument(
        "--profile-prefill",
        action="store_true",
        help="also profile the prefill steps (kernels by GPU time, idle): prefill_profile",
    )
    p.add_argument(
        "--final-only",
        action="store_true",
        help="requests ask for their final output only, as LLM.generate's do (default: an "
        "output every step, as the server's)",
    )
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/paged-bench"))
    p.add_argument("--out", type=Path, default=Path("."))
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.torch_norms:
        from paged_engine.worker import worker

        worker.use_triton_norms = lambda model: 0  # before the engine captures its graphs
    if args.unfused:
        _unfuse_layers()
    if args.torch_sampler:
        from paged_engine.worker import model_runner

        model_runner.sampling_race = lambda backend_name, device: None
    batch = args.batch or (8 if args.smoke else 256)
    steps = args.steps or (4 if args.smoke else 30)
    overrides = {**({"num_hidden_layers": 2} if args.smoke else {}), **args.override_config}
    args.work_dir.mkdir(parents=True, exist_ok=True)
    tag = "-mxfp4" if "quantization_config" in overrides else ""
    spec = config_dir(
        args.model_config, args.work_dir / f"{args.model_config}{tag}-cfg", device, **overrides
    )
    engine_kw = {
        "load_format": "dummy",
        "dtype": spec.dtype_name,
        "max_model_len": 4096 if device == "cuda" else 256,
        "enforce_eager": args.enforce_eager or device != "cuda",
        "quantization": args.quantization,
        "max_num_seqs": args.max_num_seqs,
    }
    engine_kw = {k: v for k, v in engine_kw.items() if k != "max_num_seqs" or v is not None}
    if device != "cuda":
        engine_kw["num_gpu_blocks_override"] = 256 if args.smoke else None
        engine_kw = {k: v for k, v in engine_kw.items() if v is not None}
    result = {
        "command": "python -m benchmarks.gpu_profile "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "env": environment(device),
        "model": spec.origin,
        "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        **run(
            spec.path,
            device,
            batch,
            steps,
            args.work_dir,
            args.final_only,
            args.profile_prefill,
            **engine_kw,
        ),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_profile.json").write_text(json.dumps(result, indent=1) + "\n")
    print(
        json.dumps(
            {k: v for k, v in result.items() if k not in ("env", "prefill_profile")}, indent=1
        )
    )
    if result.get("prefill_profile"):
        print("prefill:", json.dumps(result["prefill_profile"], indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
