"""Top-p on a CPU: the nucleus from a row's most likely tokens against a whole-row sort.

    python -m benchmarks.top_p [--vocab 49152] [--repeats 5]
        [--out docs/benchmarks/cpu/top_p.json]

`Sampler.process_logits` over [rows, vocab] float32 logits (temperature 0.8; top_p 0.9 alone,
then top_k 20 with top_p 0.95, Qwen3's generation defaults), best of `--repeats`, the two ways
side by side on the same logits: the default (sampler.NUCLEUS_CANDIDATES: a row's 128, then
1,024 most likely tokens decide its nucleus where they hold top_p of the mass) and with no
candidates (every row's whole vocabulary sorted). Both give the same bits
(tests/engine/test_sampler.py). The logits are a standard normal times 4 (peaked rows, as a
trained model's), and times 0.5 (flat rows, where the whole row is sorted after all).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import environment, write_result


def _metadata(n: int, vocab: int, top_k: int, top_p: float):
    from paged_engine.sample.metadata import build_sampling_metadata

    def full(value: float) -> np.ndarray:
        return np.full(n, value)

    return build_sampling_metadata(
        device=torch.device("cpu"),
        vocab_size=vocab,
        temperature=full(0.8),
        top_k=full(top_k).astype(np.int64),
        top_p=full(top_p),
        min_p=full(0.0),
        repetition=full(1.0),
        frequency=full(0.0),
        presence=full(0.0),
        history=[None] * n,
        banned=[()] * n,
        seeds=[],
        num_logprobs=[None] * n,
        need_logprobs=False,
    )


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    import paged_engine.sample.sampler as sampler_module

    candidates = sampler_module.NUCLEUS_CANDIDATES
    g = torch.Generator().manual_seed(0)
    rows_out = []
    for scale in (4.0, 0.5):
        for n in (1, 16, 64):
            x = torch.randn(n, args.vocab, generator=g) * scale
            for top_k, top_p in ((0, 0.9), (20, 0.95)):
                md = _metadata(n, args.vocab, top_k, top_p)
                ms = {}
                for name, cands in (("candidates", candidates), ("whole_row", ())):
                    sampler_module.NUCLEUS_CANDIDATES = cands
                    sampler = sampler_module.Sampler(0)
                    sampler.process_logits(x.clone(), md)
                    best = float("inf")
                    for _ in range(args.repeats):
                        t0 = time.perf_counter()
                        sampler.process_logits(x.clone(), md)
                        best = min(best, time.perf_counter() - t0)
                    ms[name] = round(best * 1e3, 2)
                sampler_module.NUCLEUS_CANDIDATES = candidates
                row = {"logit_scale": scale, "rows": n, "top_k": top_k, "top_p": top_p, **ms}
                row["speedup"] = round(ms["whole_row"] / ms["candidates"], 2)
                rows_out.append(row)
                print(row, flush=True)
    result = {
        "benchmark": "top_p",
        "command": f"python -m benchmarks.top_p --vocab {args.vocab} --repeats {args.repeats}",
        "what": "Sampler.process_logits ms (best of repeats), float32 logits, temperature 0.8",
        "torch_threads": torch.get_num_threads(),
        "env": environment("cpu"),
        "results": rows_out,
    }
    if args.out:
        write_result(args.out, result)
    return result


if __name__ == "__main__":
    main()
