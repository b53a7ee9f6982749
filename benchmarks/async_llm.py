"""`AsyncLLM` against `LLM.generate` on the same requests: does the asyncio front cost
throughput? Each setup runs in a process of its own (two engines in one process are not a fair
A/B on a small VM), in alternating rounds; each process reports the best of 3 timed runs.

    python -m benchmarks.async_llm [--rounds 2] [--requests 32] [--tokens 64]

Workload: `requests` greedy prompts, `tokens` output tokens each (ignore_eos), the default
model (SmolLM2-135M-Instruct), submitted at once (`LLM.generate`, or `asyncio.gather` of
`AsyncLLM.generate` calls).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time

MODES = ("llm", "FINAL_ONLY", "CUMULATIVE", "DELTA")


def _one(mode: str, requests: int, tokens: int) -> float:
    from paged_engine import LLM, AsyncLLM, RequestOutputKind, SamplingParams

    prompts = [f"Tell me a story about number {i}." for i in range(requests)]
    kind = RequestOutputKind.FINAL_ONLY if mode == "llm" else RequestOutputKind[mode]
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, output_kind=kind)
    total = requests * tokens
    if mode == "llm":
        llm = LLM()
        llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
        best = 0.0
        for _ in range(3):
            t = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            best = max(best, total / (time.perf_counter() - t))
        return best
    engine = AsyncLLM()

    async def consume(i: int, tag: str) -> None:
        async for _ in engine.generate(prompts[i], params, f"{tag}-{i}"):
            pass

    async def timed() -> float:
        await asyncio.gather(*(consume(i, "warm") for i in range(2)))
        best = 0.0
        for r in range(3):
            t = time.perf_counter()
            await asyncio.gather(*(consume(i, f"run{r}") for i in range(requests)))
            best = max(best, total / (time.perf_counter() - t))
        return best

    try:
        return asyncio.run(timed())
    finally:
        engine.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)  # a child process's setup
    args = p.parse_args()
    if args.one:
        print(json.dumps(_one(args.one, args.requests, args.tokens)))
        return
    results: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            cmd = [sys.executable, "-m", "benchmarks.async_llm", "--one", mode]
            cmd += ["--requests", str(args.requests), "--tokens", str(args.tokens)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            results[mode].append(round(json.loads(out.strip().splitlines()[-1])))
    for mode, values in results.items():
        print(f"{mode:>10}: {values} output tok/s")


if __name__ == "__main__":
    main()
