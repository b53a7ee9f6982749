"""What constrained decoding costs per engine step at batch 32, against the same batch without.

    python -m benchmarks.structured_overhead [--batch 32] [--steps 24] [--repeats 2]
        [--cpu-threads 1] [--out docs/benchmarks/cpu/structured_overhead.json]

One engine (the default SmolLM2-135M, greedy), `--batch` requests at once, three workloads run
in turn, `--repeats` times each, interleaved (the machine is shared: a drift shows as repeats
that disagree):
- unconstrained: ignore_eos, so every row decodes through the window;
- json: each row a schema of `structured_schemas.SCHEMAS` (in turn) wrapped in an array of
  exactly 16 items, so no row can finish inside the window;
- regex: `[a-z]+( [a-z]+){80}`, the cheapest kind of grammar.
Timed: the wall time of each `LLMEngine.step()` once every row has its first token (so prefill
and grammar compilation are excluded) while all `--batch` rows still run: pure decode steps.
The overhead is the constrained median minus the unconstrained median, in ms and relative.
On a shared machine a forward varies by more than the overhead, so the constrained parts are
also timed inside those same steps (`parts_ms_per_step`): the engine core filling the batch's
bitmask (llguidance), the matchers accepting the sampled tokens, the runner picking its rows'
masks, and the sampler applying them to the logits.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks.structured_schemas import SCHEMAS

ROOT = Path(__file__).resolve().parents[1]
REGEX = r"[a-z]+( [a-z]+){80}"


def workload_params(name: str, batch: int, max_tokens: int) -> list:
    from paged_engine import SamplingParams, StructuredOutputsParams

    base = dict(temperature=0.0, max_tokens=max_tokens)
    if name == "unconstrained":
        return [SamplingParams(**base, ignore_eos=True) for _ in range(batch)]
    if name == "regex":
        so = StructuredOutputsParams(regex=REGEX)
        return [SamplingParams(**base, structured_outputs=so) for _ in range(batch)]
    schemas = [s for s, _ in SCHEMAS.values()]
    out = []
    for i in range(batch):
        items = dict(schemas[i % len(schemas)])
        wrapped = {"type": "array", "items": items, "minItems": 16, "maxItems": 16}
        if "$defs" in items:  # "#/$defs/..." pointers resolve from the root
            wrapped["$defs"] = items.pop("$defs")
        out.append(SamplingParams(**base, structured_outputs=StructuredOutputsParams(json=wrapped)))
    return out


class PartTimers:
    """Wall time spent in the constrained-decoding functions, patched in place."""

    TARGETS = (
        ("fill_bitmask", "paged_engine.core.engine_core", "EngineCore", "_fill_token_bitmask"),
        (
            "accept",
            "paged_engine.structured_output.request_constraint",
            "RequestConstraint",
            "accept",
        ),
        ("pick_rows", "paged_engine.worker.step_sampling", None, "with_token_bitmask"),
        ("apply", "paged_engine.sample.sampler", None, "apply_token_bitmask"),
        # the whole sampler (apply included; unconstrained rows too): what its slower path for
        # masked rows costs shows as the difference between workloads
        ("sampler_total", "paged_engine.sample.sampler", "Sampler", "__call__"),
    )

    def __init__(self) -> None:
        import importlib

        self.total = dict.fromkeys((t[0] for t in self.TARGETS), 0.0)
        self.originals = []
        for name, module, cls, attr in self.TARGETS:
            owner = importlib.import_module(module)
            owner = getattr(owner, cls) if cls else owner
            self.originals.append((owner, attr, getattr(owner, attr)))
            setattr(owner, attr, self._timed(name, getattr(owner, attr)))

    def close(self) -> None:
        for owner, attr, fn in self.originals:
            setattr(owner, attr, fn)

    def _timed(self, name, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[name] += time.perf_counter() - t0

        return timed

    def snapshot(self) -> dict[str, float]:
        return dict(self.total)


def run(llm, name: str, batch: int, steps: int, tag: str, parts: PartTimers) -> dict:
    """Median / mean wall ms of the pure-decode steps with every row running, and the
    constrained parts' ms per such step."""
    engine = llm.llm_engine
    part_ms = dict.fromkeys(parts.total, 0.0)
    # A row starts once its grammar is compiled (off the engine thread, one at a time): the margin
    # keeps a cached grammar's row from ending before a slower row starts (the loop stops after
    # `steps` timed steps and aborts the rest).
    params = workload_params(name, batch, max_tokens=steps + 64)
    tok = llm.get_tokenizer()
    for i, sp in enumerate(params):
        prompt = f"Request {i}: write the answer as JSON, please."
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": tok.encode(prompt)}, sp)
    ids = [f"{tag}-{i}" for i in range(batch)]
    started: set[str] = set()
    times: list[float] = []
    while engine.has_unfinished_requests() and len(times) < steps:
        all_running = len(started) == batch
        before = parts.snapshot()
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        if any(o.finished for o in outs):
            break  # a row ended: the batch is no longer full
        if all_running:
            times.append(dt * 1e3)
            for k, v in parts.snapshot().items():
                part_ms[k] += (v - before[k]) * 1e3
        started.update(o.request_id for o in outs if o.outputs and o.outputs[0].token_ids)
    engine.abort_request(ids)
    if not times:
        raise RuntimeError(f"{name}: no step ran with all {batch} rows")
    return {
        "workload": name,
        "steps_timed": len(times),
        "step_ms_median": round(statistics.median(times), 2),
        "step_ms_mean": round(statistics.fmean(times), 2),
        "step_ms_min": round(min(times), 2),
        "parts_ms_per_step": {k: round(v / len(times), 3) for k, v in part_ms.items()},
    }


def main(argv: list[str] | None = None) -> None:
    from paged_engine import LLM

    p = argparse.ArgumentParser(
        prog="python -m benchmarks.structured_overhead", description=__doc__
    )
    p.add_argument("--model", default=None, help="default: the built-in SmolLM2-135M GGUF")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=24, help="decode steps timed per run")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--cpu-threads", type=int, default=1)
    p.add_argument(
        "--out", type=Path, default=ROOT / "docs/benchmarks/cpu/structured_overhead.json"
    )
    args = p.parse_args(argv)
    llm = LLM(
        model=args.model,
        max_model_len=1024,
        max_num_seqs=args.batch,
        cpu_num_threads=args.cpu_threads,
        enable_prefix_caching=False,
    )
    load_before = _loadavg()
    names = ("unconstrained", "json", "regex")
    parts = PartTimers()
    try:
        # Every grammar compiled before timing (each row waits for its own; cached after).
        llm.generate(
            ["warm up"] * args.batch, workload_params("json", args.batch, 1), use_tqdm=False
        )
        records = []
        for r in range(args.repeats):
            for name in names:
                rec = run(llm, name, args.batch, args.steps, f"{name}-{r}", parts)
                records.append({**rec, "repeat": r})
                print(records[-1], flush=True)
    finally:
        parts.close()
    base = statistics.median(
        x["step_ms_median"] for x in records if x["workload"] == "unconstrained"
    )
    sampler_base = statistics.fmean(
        x["parts_ms_per_step"]["sampler_total"] for x in records if x["workload"] == "unconstrained"
    )
    summary = {}
    for name in names[1:]:
        med = statistics.median(x["step_ms_median"] for x in records if x["workload"] == name)
        mine = [x for x in records if x["workload"] == name]
        summary[name] = {
            "step_ms_median": round(med, 2),
            "parts_ms_per_step": {
                k: round(statistics.fmean(x["parts_ms_per_step"][k] for x in mine), 3)
                for k in parts.total
            },
            "overhead_ms_per_step": round(med - base, 2),
            "parts_ms_per_step_total": round(
                sum(
                    statistics.fmean(x["parts_ms_per_step"][k] for x in mine)
                    for k in parts.total
                    if k not in ("apply", "sampler_total")
                )
                + statistics.fmean(x["parts_ms_per_step"]["sampler_total"] for x in mine)
                - sampler_base,
                3,
            ),
            "overhead_ratio": round(med / base, 3),
        }
    summary["unconstrained"] = {"step_ms_median": round(base, 2)}
    result = {
        "command": "python -m benchmarks.structured_overhead "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": f"{os.uname().machine}, {os.cpu_count()} cores, "
        f"torch threads {args.cpu_threads}",
        "loadavg_1min_before_after": [load_before, _loadavg()],
        "model": llm.llm_engine.config.model,
        "batch": args.batch,
        "summary": summary,
        "runs": records,
    }
    print(json.dumps(summary, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


def _loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


if __name__ == "__main__":
    main()
