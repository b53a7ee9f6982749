"""Host memory a prompt-logprobs request takes: its logits in bounded slices against all at once.

    python -m benchmarks.prompt_logprobs_memory [--tokens 2048] [--repeats 2]
        [--out docs/benchmarks/cpu/prompt_logprobs_memory.json]

The default model (SmolLM2-135M, 49,152-token vocabulary) on the CPU, one prompt of `--tokens`
tokens prefilled in one step with `prompt_logprobs=5`. The worker makes a step's prompt rows'
logits a slice at a time (model_runner.PROMPT_LOGPROBS_ELEMENTS: 2^25 values); the "whole" mode
sets the slice past the step, as before slicing, on the same engine. "none" asks no prompt
logprobs: the forward's own peak. Each run reads the process's peak resident memory (VmHWM,
reset before the run through /proc/self/clear_refs) above its resident memory before it; the
modes alternate `--repeats` times. Linux only.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from benchmarks.common import environment, write_result
from benchmarks.models import default_model


def _status(field: str) -> int:
    """MiB of a /proc/self/status field (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) // 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    import paged_engine.worker.model_runner as model_runner
    from paged_engine import LLM, SamplingParams

    spec = default_model("cpu")
    n = args.tokens
    llm = LLM(model=str(spec.path), max_model_len=n + 64, max_num_batched_tokens=n, seed=0)
    prompt = {"prompt_token_ids": [(i * 7919) % 40000 + 100 for i in range(n)]}
    sliced = model_runner.PROMPT_LOGPROBS_ELEMENTS
    modes = {"sliced": (sliced, 5), "whole": (n * spec.vocab_size, 5), "none": (sliced, None)}
    llm.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=5), use_tqdm=False)  # warm
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for _ in range(args.repeats):
        for mode, (elements, k) in modes.items():
            model_runner.PROMPT_LOGPROBS_ELEMENTS = elements
            llm.reset_prefix_cache()
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM := VmRSS
            before = _status("VmRSS")
            t0 = time.perf_counter()
            llm.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=k), use_tqdm=False)
            wall = time.perf_counter() - t0
            runs[mode].append({"peak_mib_above": _status("VmHWM") - before, "s": round(wall, 2)})
            print(mode, runs[mode][-1], flush=True)
    model_runner.PROMPT_LOGPROBS_ELEMENTS = sliced
    median = {m: statistics.median(r["peak_mib_above"] for r in rs) for m, rs in runs.items()}
    result = {
        "benchmark": "prompt_logprobs_memory",
        "command": f"python -m benchmarks.prompt_logprobs_memory --tokens {n} "
        f"--repeats {args.repeats}",
        "workload": f"one {n}-token prompt in one step, prompt_logprobs=5, max_tokens=1",
        "model": f"{spec.origin}, vocabulary {spec.vocab_size}",
        "slice_elements": sliced,
        "env": environment("cpu"),
        "runs": runs,
        "median_peak_mib_above": median,
    }
    print(median)
    if args.out:
        write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
