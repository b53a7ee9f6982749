"""What a request's logprobs cost the host: lists of dicts against `flat_logprobs=True`.

    python -m benchmarks.flat_logprobs [--requests 64] [--tokens 256] [--logprobs 20]
        [--repeats 2] [--out docs/benchmarks/cpu/flat_logprobs.json]

The default model's architecture (dummy weights) with its forward stubbed (benchmarks.overhead):
what is timed is the engine around it, sampling and the output stage, which builds the
logprobs. `--requests` requests of 32 prompt tokens decode `--tokens` tokens each (ignore_eos,
greedy), asking `logprobs=k` and `prompt_logprobs=k`, through `LLM.generate`; the two modes run
alternately `--repeats` times each. Per run: the wall time of `generate`; the Python objects
the collector tracks that its outputs hold (with default lists: a dict and k + 1 `Logprob`s a
position); the time of one full `gc.collect()` while they are alive (every full collection of a
process holding such outputs walks them; the engine's startup heap is frozen first, as
paged-server freezes it).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path

from benchmarks.common import environment, write_result
from benchmarks.models import default_model
from benchmarks.overhead import StubModel
from benchmarks.throughput import engine_kwargs
from paged_engine.engine.gc_tuning import freeze_startup_heap

PROMPT_LEN = 32


def _run(llm, prompts: list, params) -> dict:
    gc.collect()
    before = len(gc.get_objects())
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    gc.collect()
    held = len(gc.get_objects()) - before
    collect = []
    for _ in range(5):
        t1 = time.perf_counter()
        gc.collect()
        collect.append(time.perf_counter() - t1)
    positions = sum(len(o.logprobs or ()) for r in outs for o in r.outputs)
    positions += sum(len(r.prompt_logprobs or ()) for r in outs)
    del outs
    gc.collect()
    return {
        "generate_s": round(wall, 3),
        "positions": positions,
        "objects_held": held,
        "gc_collect_ms": round(1e3 * statistics.median(collect), 2),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--logprobs", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    from paged_engine import LLM, SamplingParams

    spec = default_model("cpu")
    rows = args.requests * PROMPT_LEN  # prompt logprobs: every prompt token's logits in a step
    kw = engine_kwargs(spec, "cpu", PROMPT_LEN + args.tokens + 64, load_format="dummy")
    llm = LLM(**kw, max_num_seqs=args.requests, max_num_batched_tokens=max(rows, 8192))
    runner = llm.llm_engine.model_runner
    runner.model = StubModel(spec.vocab_size, rows, runner.device)
    prompts = [
        {"prompt_token_ids": [(7 * i + j) % 10000 for j in range(PROMPT_LEN)]}
        for i in range(args.requests)
    ]
    k = args.logprobs
    base = dict(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    modes = {
        "lists": SamplingParams(**base, logprobs=k, prompt_logprobs=k),
        "flat": SamplingParams(**base, logprobs=k, prompt_logprobs=k, flat_logprobs=True),
        "none": SamplingParams(**base),
    }
    _run(llm, prompts[:2], modes["flat"])  # warm-up
    freeze_startup_heap()  # as paged-server: full collections walk only what came after
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(args.repeats):
        for mode, params in modes.items():
            runs[mode].append(_run(llm, prompts, params))
            print(f"repeat {r} {mode}: {runs[mode][-1]}", flush=True)
    summary = {
        mode: {
            key: statistics.median(x[key] for x in rs)
            for key in ("generate_s", "objects_held", "gc_collect_ms")
        }
        for mode, rs in runs.items()
    }
    result = {
        "benchmark": "flat_logprobs",
        "command": "python -m benchmarks.flat_logprobs "
        f"--requests {args.requests} --tokens {args.tokens} --logprobs {k} "
        f"--repeats {args.repeats}",
        "workload": f"{args.requests} requests, {PROMPT_LEN} prompt tokens, {args.tokens} "
        f"greedy tokens each, logprobs={k}, prompt_logprobs={k}; 'none' asks no logprobs",
        "model": f"{spec.origin} architecture, dummy weights, forward stubbed",
        "env": environment("cpu"),
        "runs": runs,
        "median": summary,
    }
    print(summary)
    if args.out:
        write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
