"""Pipeline micro-batching on the CPU: output tok/s of one PP=2 engine (2 gloo ranks, one torch
thread each) with up to two steps in flight (the default) and with one (the synchronous path),
alternating in the same run.

    python -m benchmarks.pp_microbatch [--rounds 3] [--requests 64] [--prompt-len 128]

A random llama (hidden 1024, intermediate 2816, 8 layers: 4 a stage) large enough that a
step's compute dominates its communication; greedy, ignore_eos. Each mode runs the whole
workload once unmeasured (the first run of new shapes pays one-off costs), then the rounds
alternate which mode goes first. Outputs of the two modes are compared (identical greedy
tokens). Prints one JSON line per run (with `wait_s`: rank 0's time blocked on the last stage's
results, which the overlap removes whatever else shares the cores; `cpu_s`: both ranks' CPU
seconds, Linux), then the medians and their ratio with the load average: the ranks share the
cores with whatever else runs, and overlap pays only while two cores are free for them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    args = ap.parse_args()

    from paged_engine import LLM, SamplingParams
    from paged_engine.testing import write_tiny_model

    path = write_tiny_model(
        tempfile.mkdtemp(prefix="pp_mb_"),
        "llama",
        seed=0,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
    )
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(3, 250) for _ in range(args.prompt_len)]}
        for _ in range(args.requests)
    ]
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm = LLM(
        model=str(path),
        dtype="float32",
        pipeline_parallel_size=2,
        max_model_len=256,
        max_num_seqs=args.requests,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False,  # every run computes its prompts (they repeat)
        seed=0,
    )
    core = llm.llm_engine.engine_core
    depth = core.max_concurrent_batches
    waited = [0.0]
    submit = core.executor.execute_model

    class Timed:  # the handle, timing how long get() blocks
        def __init__(self, handle) -> None:
            self.handle = handle

        def get(self):
            t = time.perf_counter()
            out = self.handle.get()
            waited[0] += time.perf_counter() - t
            return out

    core.executor.execute_model = lambda sched: Timed(submit(sched))
    pids = [os.getpid()] + [p.pid for p in getattr(core.executor, "_procs", [])]
    results: dict[int, list[float]] = {1: [], depth: []}
    tokens: dict[int, list[list[int]]] = {}
    try:
        for d in (depth, 1):  # warm-up: every shape of the workload, in both modes
            core.max_concurrent_batches = d
            llm.generate(prompts, sp, use_tqdm=False)
        for r in range(args.rounds):
            for d in (depth, 1) if r % 2 == 0 else (1, depth):
                core.max_concurrent_batches = d  # 1: each step applied before the next
                waited[0] = 0.0
                cpu0 = _cpu_seconds(pids)
                t0 = time.perf_counter()
                outs = llm.generate(prompts, sp, use_tqdm=False)
                elapsed = time.perf_counter() - t0
                toks = [list(o.outputs[0].token_ids) for o in outs]
                tps = sum(map(len, toks)) / elapsed
                results[d].append(tps)
                tokens.setdefault(d, toks)
                row = {"round": r, "in_flight": d, "tok_s": round(tps, 1)}
                row["wait_s"] = round(waited[0], 2)
                row["cpu_s"] = round(_cpu_seconds(pids) - cpu0, 2)
                print(json.dumps(row), flush=True)
    finally:
        llm.llm_engine.shutdown()
    on, off = statistics.median(results[depth]), statistics.median(results[1])
    summary = {
        "micro_batched_tok_s": round(on, 1),
        "synchronous_tok_s": round(off, 1),
        "ratio": round(on / off, 3),
        "same_tokens": tokens[depth] == tokens[1],
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(summary))


def _cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes so far (/proc; 0 where unreadable)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (clock ticks)
    return total / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    main()
