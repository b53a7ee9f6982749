"""fp8 -> float on CPU: the ways to read an fp8 KV tile, side by side in one run.

    python -m benchmarks.fp8_dequant      # writes docs/benchmarks/cpu/fp8_dequant.json

One decode step's gather of one layer's keys as the CPU backend does it (`index_select` of
`--seqs` sequences x `--context` slots from head planes [Hkv, slots, D]), then each conversion
to fp32 (times a scale): torch's fp8 cast, a 256-entry lookup table indexed by the byte
(`table[bytes.long()]`, `index_select`, `take`), and the bit conversion the backend uses
(`paged_kernels.fp8_to_float`: sign-extend, shift, one multiply). Also the fp32 and bf16 cache
gathers, for scale. ns per element of the gathered tile, median of `--iters`, on
`--threads` torch threads.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common import environment
from paged_kernels import fp8_to_float

ROOT = Path(__file__).resolve().parent.parent


def _time(fn: Callable[[], torch.Tensor], iters: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(dtype: torch.dtype, heads: int, slots: int, head_dim: int, seqs: int, context: int,
            iters: int) -> dict:  # fmt: skip
    scale = 0.03125
    cache32 = torch.randn(heads, slots, head_dim)
    cache8 = (cache32 / scale).to(dtype)
    bytes_ = cache8.view(torch.uint8)
    index = torch.randint(0, slots, (seqs * context,))
    table = torch.arange(256, dtype=torch.uint8).view(dtype).float() * scale
    table[~table.isfinite()] = 0.0  # NaN / inf codes: never written
    cache16 = cache32.to(torch.bfloat16)
    ways: dict[str, Callable[[], torch.Tensor]] = {
        "gather fp32 cache": lambda: cache32.index_select(1, index),
        "gather bf16 cache -> fp32": lambda: cache16.index_select(1, index).float(),
        "gather fp8 bytes only": lambda: bytes_.index_select(1, index),
        "torch cast (x.float() * scale)": lambda: cache8.index_select(1, index).float() * scale,
        "lookup table[bytes.long()]": lambda: table[bytes_.index_select(1, index).long()],
        "lookup index_select": lambda: table.index_select(
            0, bytes_.index_select(1, index).view(-1).long()
        ),
        "lookup take": lambda: table.take(bytes_.index_select(1, index).long()),
        "bits (fp8_to_float)": lambda: fp8_to_float(cache8.index_select(1, index), scale),
    }
    want = ways["torch cast (x.float() * scale)"]()
    out = {}
    for name, fn in ways.items():
        out[name] = {"ns_per_element": round(_time(fn, iters) / want.numel() * 1e9, 3)}
        if name.startswith(("lookup", "bits")):  # the same values as torch's cast?
            out[name]["exact"] = bool(torch.equal(fn().reshape(want.shape), want))
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--slots", type=int, default=16384, help="cache slots per head plane")
    p.add_argument("--seqs", type=int, default=16)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--out", default=str(ROOT / "docs/benchmarks/cpu/fp8_dequant.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    shape = (args.heads, args.slots, args.head_dim, args.seqs, args.context, args.iters)
    result = {
        "command": "python -m benchmarks.fp8_dequant " + " ".join(argv or []),
        "environment": environment("cpu"),
        "load_average_1min_before": float(Path("/proc/loadavg").read_text().split()[0]),
        "threads": args.threads,
        "tile": f"[{args.heads}, {args.seqs} x {args.context}, {args.head_dim}] gathered from "
        f"[{args.heads}, {args.slots}, {args.head_dim}]",
        "float8_e4m3fn": measure(torch.float8_e4m3fn, *shape),
        "float8_e5m2": measure(torch.float8_e5m2, *shape),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("float8_e4m3fn", "float8_e5m2")}, indent=2))
    return result


if __name__ == "__main__":
    main()
