"""What a draft head costs when it never lands: plain decoding against speculation with a random
EAGLE-3 and a random EAGLE-1 head, side by side, on one random-weight target (CPU).

    python -m benchmarks.spec_heads                  # batch 1 and 8, k = 3, 3 rounds
    python -m benchmarks.spec_heads --batch 1 --rounds 5

A random head's drafts are almost never accepted, so this is the cost side alone: the head's
first pass over every verified position of a row (kept so the row can draft again after the
planner's backoff pauses it), its draft passes while a row drafts, and the longer verification
steps. A trained head's gain is for a run with one (none is offline here). The target: a
Llama of 8 layers, width 256, 512 tokens, float32; greedy, 128 tokens a request from random
64-token prompts, requests in groups of `batch`. The engines run interleaved in one process,
each round in the same order; medians are reported.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import environment, write_result

ROOT = Path(__file__).resolve().parent.parent


def _models(root: Path) -> dict[str, Path]:
    from paged_engine.testing import write_tiny_eagle3_head, write_tiny_eagle_head, write_tiny_model

    target = write_tiny_model(
        root / "target",
        "llama",
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
    )
    return {
        "target": target,
        "eagle3": write_tiny_eagle3_head(root / "eagle3", target, seed=1),
        "eagle": write_tiny_eagle_head(root / "eagle", target, seed=1),
    }


def _generate(llm, prompts: list, batch: int, max_tokens: int) -> tuple[float, int]:
    from paged_engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start, tokens = time.perf_counter(), 0
    for i in range(0, len(prompts), batch):
        for out in llm.generate(prompts[i : i + batch], params, use_tqdm=False):
            tokens += len(out.outputs[0].token_ids)
    return time.perf_counter() - start, tokens


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.spec_heads", description=__doc__)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=ROOT / "docs/benchmarks/cpu/spec_heads.json")
    args = p.parse_args()

    from paged_engine import LLM

    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(3, 500) for _ in range(64)]}
        for _ in range(args.requests)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        paths = _models(Path(tmp))
        configs = {
            "plain": None,
            "eagle3": {"method": "eagle3", "model": str(paths["eagle3"])},
            "eagle": {"method": "eagle", "model": str(paths["eagle"])},
        }
        engines = {}
        for name, spec in configs.items():
            extra = (
                {}
                if spec is None
                else {"speculative_config": {**spec, "num_speculative_tokens": args.k}}
            )
            engines[name] = LLM(str(paths["target"]), max_model_len=512, seed=0, **extra)
            _generate(engines[name], prompts[:2], 2, 16)  # warm up
        rows = []
        for batch in args.batch:
            times: dict[str, list[float]] = {name: [] for name in engines}
            tokens = {}
            for _ in range(args.rounds):
                for name, llm in engines.items():
                    wall, tokens[name] = _generate(llm, prompts, batch, args.max_tokens)
                    times[name].append(wall)
            plain = statistics.median(times["plain"])
            for name, llm in engines.items():
                wall = statistics.median(times[name])
                stats = llm.get_stats()
                row = {
                    "system": name,
                    "batch": batch,
                    "k": 0 if name == "plain" else args.k,
                    "output_tokens": tokens[name],
                    "wall_s": round(wall, 3),
                    "output_tok_s": round(tokens[name] / wall, 1),
                    "vs_plain": round(plain / wall, 3),
                    "acceptance_rate": stats.spec_decode_acceptance_rate,
                    "runs_s": [round(t, 3) for t in times[name]],
                }
                rows.append(row)
                print(row)
    write_result(
        args.out,
        {
            "benchmark": "spec_heads",
            "command": "python -m benchmarks.spec_heads "
            + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
            "environment": environment("cpu"),
            "workload": f"{args.requests} requests of 64 random tokens, {args.max_tokens} greedy "
            "tokens each, groups of `batch`; target Llama 8 layers x 256, vocab 512, float32; "
            "random heads (acceptance ~0: the cost side only)",
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
