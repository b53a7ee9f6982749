"""Host time of the Triton kernel wrappers an eager (prefill / mixed) step calls once a layer, with
the launches stubbed out: what paged's Python costs around each launch (argument checks, output
allocation, launch options), apart from Triton's own launch path and the GPU. Runs anywhere: the
tensors are CPU tensors of Qwen3-0.6B's shapes (bf16). A step of 512 tokens by default: the
outputs' allocations are CPU ones here (a large one costs its pages), where a GPU's caching
allocator hands back a cached block, so more tokens time the CPU allocator, not the wrapper.

    python -m benchmarks.wrapper_overhead [--tokens 512] [--reps 2000]

Measured on the 2-core development machine (best of 5 x 2000 calls, two runs): a layer's calls
(attention, two add + norm, rope, KV write, gated SiLU) 104-105 us before the wrappers' trim
(0fa5c02) and 56-58 us after it (9d8ccb7); with the rope kernel storing K/V itself (one call
and one launch fewer a layer) 54.5-54.9 us against 57.8-58.2 us for the two calls apart.

The H200's profile (docs/benchmarks/h200) put a prefill step's host time at 39 ms against
22.5 ms of GPU time; these five wrappers run 28 times a step on Qwen3-0.6B.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Callable, Iterator

import torch


class _NoLaunch:
    """Stands in for a @triton.jit kernel: `kernel[grid](...)` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


KERNELS = {
    "attention": ("_paged_attention_kernel", "_merge_splits_kernel"),
    "norm": ("_add_rms_norm_kernel", "_rms_norm_kernel"),
    "rotary": ("_rope_qk_kernel",),
    "kv_cache": ("_write_kv_cache_kernel",),
    "activation": ("_silu_and_mul_kernel",),
}


@contextlib.contextmanager
def launches_stubbed() -> Iterator[None]:
    import importlib

    saved = []
    for module_name, names in KERNELS.items():
        module = importlib.import_module(f"paged_kernels.{module_name}")
        for name in names:
            saved.append((module, name, getattr(module, name)))
            setattr(module, name, _NoLaunch())
    try:
        yield
    finally:
        for module, name, kernel in saved:
            setattr(module, name, kernel)


def calls(tokens: int) -> dict[str, Callable[[], object]]:
    """One layer's wrapper calls at Qwen3-0.6B's sizes (16 q / 8 kv heads of 128, hidden 1024,
    intermediate 3072), a prefill of `tokens` tokens (a multiple of 16) over 16 sequences."""
    from paged_kernels import add_rms_norm, paged_attention, silu_and_mul, write_kv_cache
    from paged_kernels.rotary import rope_qk_

    seqs, h, hk, d, bs, dt = 16, 16, 8, 128, 16, torch.bfloat16
    per = tokens // seqs
    q = torch.randn(tokens, h, d, dtype=dt)
    kc = torch.zeros(seqs * (-(-per // bs)) + 1, bs, hk, d, dtype=dt)
    vc = torch.zeros_like(kc)
    tables = torch.zeros(seqs, -(-per // bs), dtype=torch.int32)
    cu = torch.arange(seqs + 1, dtype=torch.int32) * per
    lens = torch.full((seqs,), per, dtype=torch.int32)
    out = torch.empty_like(q)
    x, w = torch.randn(tokens, 1024, dtype=dt), torch.ones(1024, dtype=dt)
    res = torch.randn_like(x)
    qkv = torch.randn(tokens, (h + 2 * hk) * d, dtype=dt)
    pos = torch.arange(tokens)
    cos, sin = torch.randn(4096, d // 2), torch.randn(4096, d // 2)
    k, v = torch.randn(tokens, hk, d, dtype=dt), torch.randn(tokens, hk, d, dtype=dt)
    slots, nw = torch.arange(tokens), torch.ones(d, dtype=dt)
    gate_up = torch.randn(tokens, 2 * 3072, dtype=dt)
    return {
        "paged_attention": lambda: paged_attention(
            q, kc, vc, tables, cu, lens, d**-0.5, max_seqlen_q=per, max_seqlen_k=per, out=out
        ),
        "add_rms_norm": lambda: add_rms_norm(x, res, w, 1e-6),
        "rope_qk_": lambda: rope_qk_(qkv, pos, cos, sin, h, hk, d, q_weight=nw, k_weight=nw),
        "write_kv_cache": lambda: write_kv_cache(k, v, kc, vc, slots),
        "rope_qk_+kv": lambda: rope_qk_(
            qkv,
            pos,
            cos,
            sin,
            h,
            hk,
            d,
            q_weight=nw,
            k_weight=nw,
            key_cache=kc,
            value_cache=vc,
            slot_mapping=slots,
        ),
        "silu_and_mul": lambda: silu_and_mul(gate_up),
    }


def run(tokens: int = 512, reps: int = 2000) -> dict:
    """Best of five rounds of `reps` calls each: microseconds a call, and a layer's total (two
    add_rms_norm calls, one of each other): the rope kernel storing K/V as the engine runs it
    (rope_qk_+kv), and the rope and the write kernel called apart, as before that fusion."""
    out: dict[str, float] = {}
    with launches_stubbed():
        for name, fn in calls(tokens).items():
            fn()
            best = float("inf")
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(reps):
                    fn()
                best = min(best, (time.perf_counter() - t0) / reps)
            out[name] = round(best * 1e6, 2)
    common = out["paged_attention"] + 2 * out["add_rms_norm"] + out["silu_and_mul"]
    apart = common + out["rope_qk_"] + out["write_kv_cache"]
    return {
        "tokens": tokens,
        "us_per_call": out,
        "us_per_layer": round(common + out["rope_qk_+kv"], 1),
        "us_per_layer_write_apart": round(apart, 1),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.wrapper_overhead", description=__doc__)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--reps", type=int, default=2000)
    args = p.parse_args(argv)
    print(json.dumps(run(args.tokens, args.reps), indent=1))


if __name__ == "__main__":
    main()
