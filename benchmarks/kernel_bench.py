"""Decode paged-attention benchmark: time, bandwidth vs a device copy, ratio vs torch SDPA; the
batch-invariant kernels' cost (attention in that mode; matmul against cuBLAS); and on CUDA the
MoE kernels (fused_moe) against the engine's grouped torch path.

    python -m benchmarks.kernel_bench --smoke --out DIR

Realistic shapes (CUDA): 32 query heads, 8 KV heads, head size 128, bf16, block size 16,
batch 1..256, context 512..32k, K/V blocks scattered over a random permutation of the pool.
Bandwidth = K/V bytes the kernel must read / time, reported as a fraction of the bandwidth of a
device-to-device copy measured in the same run ((read + written bytes) / time). SDPA runs on the
same K/V stored contiguously ([batch, kv_heads, context, head_dim], GQA via enable_gqa).
Without CUDA the smoke mode runs tiny shapes in the Triton interpreter: it only proves the code
path works, and the JSON says its numbers are not meaningful.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

HAS_CUDA = torch.cuda.is_available()
# Triton reads TRITON_INTERPRET when its modules are defined: imported earlier without it (by
# run_all's other sections), its own library functions are compiled ones, and the kernels must
# run in a fresh process instead.
_INTERPRETER_TOO_LATE = (
    not HAS_CUDA and "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
)
if not HAS_CUDA:  # must precede the first @triton.jit definition (import of paged_kernels)
    os.environ.setdefault("TRITON_INTERPRET", "1")

MAX_TOKENS_IN_POOL = 1 << 21  # batch * context cap: 8.6 GB of bf16 K/V at these head sizes


def _shapes(smoke: bool) -> dict:
    if not HAS_CUDA:
        tiny = dict(heads=4, kv_heads=1, head_dim=64, block_size=16, dtype=torch.float32)
        return {**tiny, "batches": [1, 2], "contexts": [64, 192]}
    batches = [1, 64] if smoke else [1, 4, 16, 64, 256]
    contexts = [512, 4096] if smoke else [512, 2048, 8192, 32768]
    real = dict(heads=32, kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16)
    return {**real, "batches": batches, "contexts": contexts}


# How each CUDA timing was taken: "graph" (replays of a captured CUDA graph: device time alone,
# as in the engine's decode step) or "eager" (back-to-back launches: the host's launch cost
# shows whenever it exceeds the kernel's time; the H200 run saw a ~0.04 ms floor for one Triton
# launch and ~0.15 ms for split-KV's two, so small shapes timed the host, not the kernel).
TIMERS: dict[str, int] = {"graph": 0, "eager": 0}


def _time_ms(fn, eager: bool = False) -> float:
    if HAS_CUDA:
        import triton.testing

        if not eager:
            try:
                ms = float(triton.testing.do_bench_cudagraph(fn, rep=100))
                TIMERS["graph"] += 1
                return ms
            except Exception:  # not capturable (a host sync inside): time it eagerly
                torch.cuda.synchronize()
        TIMERS["eager"] += 1
        return float(triton.testing.do_bench(fn, warmup=25, rep=100))
    fn()  # compile / warm the interpreter
    samples = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def _copy_bandwidth_gbps(device: torch.device) -> float:
    """(bytes read + bytes written) / time of one large device-to-device copy."""
    numel = (1 << 28) if HAS_CUDA else (1 << 22)  # 1 GiB / 16 MiB of fp32
    src = torch.empty(numel, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    ms = _time_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9


def _sdpa(q, k, v, scale):
    # q: [B, H, 1, D]; k, v: [B, H_kv, S, D]
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    try:
        return sdpa(q, k, v, scale=scale, enable_gqa=True)
    except TypeError:  # torch without enable_gqa
        group = q.shape[1] // k.shape[1]
        return sdpa(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), scale=scale)


def _time_paged(paged_attention, args: tuple, kw: dict, splits: int) -> tuple[float, float]:
    """(ms with the heuristic's choice, ms with split-KV off)."""
    auto_ms = _time_ms(lambda: paged_attention(*args, **kw))
    if splits == 1:
        return auto_ms, auto_ms
    return auto_ms, _time_ms(lambda: paged_attention(*args, num_splits=1, **kw))


def _decode_inputs(batch: int, ctx: int, cfg: dict, device: torch.device) -> tuple:
    """paged_attention's (args, kwargs) for `batch` decode rows of `ctx` keys each, their K/V
    blocks scattered over a random permutation of the pool, and the K/V bytes a call must read."""
    h, hk, d = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    bs, dtype = cfg["block_size"], cfg["dtype"]
    blocks_per_seq = -(-ctx // bs)
    num_blocks = batch * blocks_per_seq
    perm = torch.randperm(num_blocks, device=device).to(torch.int32)
    block_tables = perm.view(batch, blocks_per_seq)
    k_cache = torch.randn(num_blocks, bs, hk, d, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(batch, h, d, device=device, dtype=dtype)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=device)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    kw = dict(max_seqlen_q=1, max_seqlen_k=ctx, out=torch.empty_like(q))
    kv_bytes = 2 * batch * ctx * hk * d * torch.finfo(dtype).bits // 8
    return (q, k_cache, v_cache, block_tables, cu, seq_lens, d**-0.5), kw, kv_bytes


def _bench_one(batch: int, ctx: int, cfg: dict, device: torch.device, copy_gbps: float) -> dict:
    from paged_kernels import choose_num_splits, paged_attention
    from paged_kernels._utils import device_sms

    hk, d, bs = cfg["kv_heads"], cfg["head_dim"], cfg["block_size"]
    args, kw, kv_bytes = _decode_inputs(batch, ctx, cfg, device)
    q, k_cache, v_cache, block_tables, _, _, scale = args
    out = kw["out"]
    blocks_per_seq = block_tables.shape[1]
    splits = choose_num_splits(batch, hk, 1, ctx, device_sms(device))
    paged_ms, nosplit_ms = _time_paged(paged_attention, args, kw, splits)
    invariant_ms = _time_ms(lambda: paged_attention(*args, batch_invariant=True, **kw))

    # The same K/V, contiguous per sequence: [B, H_kv, S, D].
    def contiguous(cache):
        flat = cache[block_tables.long()].reshape(batch, blocks_per_seq * bs, hk, d)
        return flat[:, :ctx].transpose(1, 2).contiguous()

    k, v = contiguous(k_cache), contiguous(v_cache)
    del k_cache, v_cache  # room for SDPA backends that expand K/V to every query head
    q4 = q.unsqueeze(2)  # [B, H, 1, D]
    try:
        sdpa_ms = _time_ms(lambda: _sdpa(q4, k, v, scale))
        diff = (_sdpa(q4, k, v, scale).squeeze(2).float() - out.float()).abs().max().item()
    except torch.OutOfMemoryError:
        sdpa_ms = diff = None
    gbps = kv_bytes / (paged_ms * 1e-3) / 1e9
    return {
        "batch": batch,
        "context": ctx,
        "num_splits": splits,
        "paged_ms": round(paged_ms, 5),
        "paged_nosplit_ms": round(nosplit_ms, 5),
        "paged_batch_invariant_ms": round(invariant_ms, 5),  # prefill tiles, no split-KV
        "sdpa_ms": None if sdpa_ms is None else round(sdpa_ms, 5),
        "speedup_vs_sdpa": None if sdpa_ms is None else round(sdpa_ms / paged_ms, 3),
        "kv_bytes": kv_bytes,
        "achieved_gbps": round(gbps, 2),
        "fraction_of_copy_bw": round(gbps / copy_gbps, 3),
        "max_abs_diff_vs_sdpa": diff,
    }


def split_sweep(device: torch.device, copy_gbps: float, smoke: bool = False) -> list[dict]:
    """Decode attention at forced num_splits (1, 2, 4, 8) for mid-size batches, the shapes the
    split heuristic decides: time and fraction of copy bandwidth of each, and the heuristic's
    pick. The real shapes on CUDA; tiny ones in the interpreter."""
    from paged_kernels import choose_num_splits, paged_attention
    from paged_kernels._utils import device_sms

    cfg = _shapes(smoke)
    grid = [(32, 2048), (64, 2048), (64, 8192), (128, 2048)]
    grid = grid if HAS_CUDA and not smoke else [(2, 64)]
    out = []
    for batch, ctx in grid:
        args, kw, kv_bytes = _decode_inputs(batch, ctx, cfg, device)
        row = {"batch": batch, "context": ctx}
        row["heuristic"] = choose_num_splits(batch, cfg["kv_heads"], 1, ctx, device_sms(device))
        for splits in (1, 2, 4, 8):
            ms = _time_ms(lambda a=args, k=kw, s=splits: paged_attention(*a, num_splits=s, **k))
            row[f"splits_{splits}_ms"] = round(ms, 5)
            row[f"splits_{splits}_of_copy_bw"] = round(kv_bytes / (ms * 1e-3) / 1e9 / copy_gbps, 3)
        out.append(row)
        del args, kw  # the pool, before the next shape's
    return out


def tile_sweep(device: torch.device, copy_gbps: float, smoke: bool = False) -> list[dict]:
    """Decode attention under every (BLOCK_N, warps, pipeline stages) of a small grid, at the
    shapes issue 14's goal names (batch 32-256, 2k and 8k keys; the split heuristic's pick):
    time and fraction of copy bandwidth of each, beside the default tile. Each config replaces
    paged_kernels.attention's `_tile_config` for the call (the same BLOCK_Q). Real shapes on
    CUDA; a tiny one and two configs in the interpreter."""
    from paged_kernels import attention

    cfg = _shapes(smoke)
    real = HAS_CUDA and not smoke
    grid = [(32, 2048), (64, 8192), (256, 2048), (256, 8192)] if real else [(2, 64)]
    configs = [(n, w, st) for n in (32, 64, 128) for w in (4, 8) for st in (2, 3, 4)]
    configs = configs if real else [(16, 4, 2), (32, 4, 3)]
    out = []
    for batch, ctx in grid:
        args, kw, kv_bytes = _decode_inputs(batch, ctx, cfg, device)
        row: dict = {"batch": batch, "context": ctx, "configs": []}
        group_p2 = 1 << (cfg["heads"] // cfg["kv_heads"] - 1).bit_length()
        block_q, *rest = attention._tile_config(group_p2, max(16, cfg["head_dim"]), True)
        row["default"] = dict(zip(("block_n", "num_warps", "num_stages"), rest))
        for block_n, warps, stages in configs:
            tile = attention.TileConfig(block_q, block_n, warps, stages)
            entry: dict = {"block_n": block_n, "num_warps": warps, "num_stages": stages}
            with _replaced(attention, "_tile_config", lambda *a, t=tile, **k: t):
                call = lambda a=args, k=kw: attention.paged_attention(*a, **k)
                row["configs"].append(_timed(entry, call, kv_bytes, copy_gbps))
        row["best"] = _best(row["configs"])
        out.append(row)
        del args, kw  # the pool, before the next shape's
    return out


@contextlib.contextmanager
def _replaced(module: object, name: str, value: object) -> Iterator[None]:
    """`module.name` is `value` inside the block (a sweep's config), the original after it."""
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


def _timed(entry: dict, fn: Callable[[], object], nbytes: int, copy_gbps: float) -> dict:
    """A sweep entry with fn's time and `nbytes` read against the copy bandwidth, or the error
    that stopped it (e.g. out of shared memory at launch)."""
    try:
        ms = _time_ms(fn)
        entry["ms"] = round(ms, 5)
        entry["of_copy_bw"] = round(nbytes / (ms * 1e-3) / 1e9 / copy_gbps, 3)
    except Exception as exc:
        entry["error"] = str(exc)[:200]
    return entry


def _best(configs: list[dict]) -> dict | None:
    timed = [c for c in configs if "ms" in c]
    return min(timed, key=lambda c: c["ms"]) if timed else None


def _mla_inputs(batch: int, ctx: int, heads: int, device: torch.device) -> tuple[tuple, int]:
    """mla_attention's decode args over DeepSeek's 512 + 64 latent cache (bf16, 16-token blocks
    in a random order) and the latent bytes a call reads."""
    block, width = 16, 576
    blocks = batch * ctx // block
    cache = torch.randn(blocks + 1, block, 1, width, device=device, dtype=torch.bfloat16)
    tables = torch.randperm(blocks, device=device).view(batch, -1).int() + 1
    q = torch.randn(batch, heads, width, device=device, dtype=torch.bfloat16)
    cu = torch.arange(batch + 1, device=device, dtype=torch.int32)
    lens = torch.full((batch,), ctx, device=device, dtype=torch.int32)
    return (q, cache, tables, cu, lens, width**-0.5), batch * ctx * width * 2


def mla_sweep(device: torch.device, copy_gbps: float, smoke: bool = False) -> list[dict]:
    """MLA decode under (query heads a program, BLOCK_N, warps) and forced split counts, at
    128 heads (DeepSeek-V3 at TP=1: eight 16-head programs each read a sequence's whole latent
    cache) and 16 (V2-Lite): time and latent bytes read against the copy bandwidth, beside the
    default (`mla._tiles`, the split heuristic). Each config replaces `mla._tiles` for the call.
    Real shapes on CUDA; a tiny one and two configs in the interpreter."""
    from paged_kernels import mla

    real = HAS_CUDA and not smoke
    grid = [(128, 64, 4096), (128, 256, 1024), (16, 32, 2048)] if real else [(4, 2, 64)]
    tiles = [(h, n, w) for h in (16, 32, 64) for n in (16, 32) for w in (4, 8)]
    tiles = tiles if real else [(16, 16, 4), (32, 16, 4)]
    out = []
    for heads, batch, ctx in grid:
        args, nbytes = _mla_inputs(batch, ctx, heads, device)
        row: dict = {"heads": heads, "batch": batch, "context": ctx, "configs": []}
        for per, block_n, warps, splits in [
            (None, None, None, None),  # the defaults
            *((h, n, w, 1) for h, n, w in tiles),
            *((None, None, None, s) for s in (2, 4, 8)),
        ]:
            entry: dict = {"heads_per_program": per, "block_n": block_n}
            entry |= {"num_warps": warps, "num_splits": splits}
            tiles_of = mla._tiles
            if per is not None:
                tiles_of = lambda *a, t=(per, 1, block_n, warps), **k: t
            kw = {"latent_dim": 512, "max_seqlen_q": 1, "max_seqlen_k": ctx, "num_splits": splits}
            with _replaced(mla, "_tiles", tiles_of):
                call = lambda a=args, k=kw: mla.mla_attention(*a, **k)
                row["configs"].append(_timed(entry, call, nbytes, copy_gbps))
        row["best"] = _best(row["configs"])
        out.append(row)
        del args
    return out


def _plot(results: list[dict], out_dir: Path, title: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for batch in sorted({r["batch"] for r in results}):
        rows = [r for r in results if r["batch"] == batch]
        ctx = [r["context"] for r in rows]
        ax1.plot(ctx, [r["fraction_of_copy_bw"] for r in rows], marker="o", label=f"batch {batch}")
        rows = [r for r in rows if r["speedup_vs_sdpa"] is not None]
        ctx = [r["context"] for r in rows]
        ax2.plot(ctx, [r["speedup_vs_sdpa"] for r in rows], marker="o", label=f"batch {batch}")
    for ax, label in ((ax1, "K/V read bandwidth / copy bandwidth"), (ax2, "SDPA time / paged")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    path = out_dir / "kernel_bench.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path.name


def _bench_matmul(smoke: bool, device: torch.device) -> list[dict]:
    """paged_kernels.matmul (batch_invariant=True's linear layers) against F.linear (cuBLAS on
    CUDA) on Qwen3-0.6B's weight shapes (qkv, down projection, LM head), bf16, over rows M."""
    from paged_kernels import matmul

    if HAS_CUDA:
        shapes = {"qkv": (4096, 1024), "down": (1024, 3072), "lm_head": (151936, 1024)}
        rows, dtype = ([1, 256] if smoke else [1, 16, 64, 256, 1024, 4096]), torch.bfloat16
    else:
        shapes, rows, dtype = {"tiny": (96, 64)}, [1, 70], torch.float32
    out = []
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device=device, dtype=dtype) / k**0.5
        for m in rows:
            x = torch.randn(m, k, device=device, dtype=dtype)
            ours = _time_ms(lambda x=x, w=w: matmul(x, w))
            ref = _time_ms(lambda x=x, w=w: torch.nn.functional.linear(x, w))
            out.append(
                {
                    "weight": name,
                    "n": n,
                    "k": k,
                    "m": m,
                    "invariant_ms": round(ours, 5),
                    "torch_linear_ms": round(ref, 5),
                    "invariant_over_torch_linear": round(ours / ref, 3),
                }
            )
    return out


def _bench_sampler(smoke: bool, device: torch.device, copy_gbps: float) -> list[dict]:
    """The sampler's race over Qwen3's vocabulary (151,936), float32 logits (compute_logits'
    dtype) at temperature 0.6, as the engine samples them: `Sampler` with
    paged_kernels.gumbel_race (one pass, its seeds uploaded) against `Sampler` with torch's race
    (divide, softmax, uniform noise, its log, the quotient, argmin), over rows. Without CUDA a
    2,048-token vocabulary in the interpreter: the numbers only prove the code runs."""
    from paged_engine.sample.metadata import metadata_from_params
    from paged_engine.sample.sampler import Sampler
    from paged_engine.sampling_params import SamplingParams
    from paged_kernels import gumbel_race

    vocab, out = (151936 if HAS_CUDA else 2048), []
    sizes = ([1, 256] if smoke else [1, 16, 64, 256]) if HAS_CUDA else [1, 4]
    ours, torch_race = Sampler(race=gumbel_race), Sampler()
    for rows in sizes:
        x = torch.randn(rows, vocab, device=device) * 4
        md = metadata_from_params([SamplingParams(temperature=0.6)] * rows, device, vocab)
        race_ms = _time_ms(lambda x=x, md=md: ours(x, md))
        ref_ms = _time_ms(lambda x=x, md=md: torch_race(x, md))
        # the engine samples outside its CUDA graphs: the launches' host cost is paid too
        race_eager = _time_ms(lambda x=x, md=md: ours(x, md), eager=True)
        ref_eager = _time_ms(lambda x=x, md=md: torch_race(x, md), eager=True)
        read_gbps = x.numel() * x.element_size() / (race_ms * 1e-3) / 1e9
        out.append(
            {
                "rows": rows,
                "vocab": vocab,
                "logits_dtype": str(x.dtype),
                "gumbel_race_ms": round(race_ms, 5),
                "torch_race_ms": round(ref_ms, 5),
                "speedup_vs_torch": round(ref_ms / race_ms, 3),
                "gumbel_race_eager_ms": round(race_eager, 5),
                "torch_race_eager_ms": round(ref_eager, 5),
                # the logits read once, against a copy's read + write bandwidth
                "fraction_of_copy_bw": round(read_gbps / copy_gbps, 3),
            }
        )
    return out


def _bench_moe(smoke: bool, device: torch.device) -> list[dict]:
    """paged_kernels.fused_moe (the engine's CUDA MoE path) against the grouped torch path (one
    matmul pair per used expert, its group sizes read on the host) at Qwen3-30B-A3B's expert
    shapes (H 2048, I 768, 128 experts, top-8), bf16, over token counts. CUDA only: the
    interpreter's timings would say nothing."""
    if not HAS_CUDA:
        return []
    from paged_engine.layers.fused_moe import grouped_experts, route
    from paged_kernels import fused_moe

    hid, inter, experts, top_k = 2048, 768, 128, 8
    dtype = torch.bfloat16
    gate_up = (torch.randn(experts, 2 * inter, hid, device=device) * hid**-0.5).to(dtype)
    down = (torch.randn(experts, hid, inter, device=device) * inter**-0.5).to(dtype)
    out = []
    for tokens in [1, 256] if smoke else [1, 16, 64, 256, 1024, 4096]:
        x = torch.randn(tokens, hid, device=device, dtype=dtype)
        weights, ids = route(torch.randn(tokens, experts, device=device), top_k, True)
        args = (x, gate_up, down, weights, ids)
        ours = _time_ms(lambda args=args: fused_moe(*args))
        ref = _time_ms(lambda args=args: grouped_experts(*args))
        diff = (fused_moe(*args).float() - grouped_experts(*args).float()).abs().max().item()
        out.append(
            {
                "tokens": tokens,
                "hidden": hid,
                "intermediate": inter,
                "experts": experts,
                "top_k": top_k,
                "fused_moe_ms": round(ours, 5),
                "grouped_torch_ms": round(ref, 5),
                "speedup_vs_grouped_torch": round(ref / ours, 3),
                "max_abs_diff": diff,
            }
        )
    return out


def _bench_mla(smoke: bool, device: torch.device, copy_gbps: float) -> list[dict]:
    """paged_kernels.mla_attention (DeepSeek's latent cache: 512 + 64 entries a token, one KV
    head) in decode: bytes of latent read per ms against the copy bandwidth, at 16 heads
    (V2-Lite, Moonlight) and 128 (V3 / R1 at TP=1), bf16. CUDA only."""
    if not HAS_CUDA:
        return []
    from paged_kernels import mla_attention

    out = []
    for heads in (16, 128):
        for batch, ctx in [(32, 2048)] if smoke else [(32, 2048), (64, 4096), (256, 1024)]:
            args, read = _mla_inputs(batch, ctx, heads, device)
            kw = dict(latent_dim=512, max_seqlen_q=1, max_seqlen_k=ctx)
            ms = _time_ms(lambda args=args, kw=kw: mla_attention(*args, **kw))
            gbps = read / ms / 1e6
            out.append(
                {
                    "heads": heads,
                    "batch": batch,
                    "context": ctx,
                    "mla_ms": round(ms, 5),
                    "latent_bytes": read,
                    "achieved_gbps": round(gbps, 1),
                    "fraction_of_copy_bw": round(gbps / copy_gbps, 3),
                }
            )
    return out


def _run_in_interpreter(smoke: bool, out_dir: Path) -> dict:
    """triton was imported before TRITON_INTERPRET was set: rerun in a fresh process."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "benchmarks.kernel_bench", "--out", str(out_dir)]
    root = Path(__file__).resolve().parent.parent
    subprocess.run(cmd + (["--smoke"] if smoke else []), env=env, cwd=root, check=True)
    return json.loads((out_dir / "kernel_bench.json").read_text())


def run(smoke: bool, out_dir: Path) -> dict:
    """Benchmark decode paged attention; write kernel_bench.json (+ .png) into out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if _INTERPRETER_TOO_LATE or (not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1"):
        return _run_in_interpreter(smoke, out_dir)
    attention = sys.modules.get("paged_kernels.attention")
    kernel_kind = type(getattr(attention, "_paged_attention_kernel", None)).__name__
    if not HAS_CUDA and attention is not None and kernel_kind != "InterpretedFunction":
        return _run_in_interpreter(smoke, out_dir)
    device = torch.device("cuda" if HAS_CUDA else "cpu")
    cfg = _shapes(smoke)
    copy_gbps = _copy_bandwidth_gbps(device)
    results = []
    for batch in cfg["batches"]:
        for ctx in cfg["contexts"]:
            if batch * ctx > MAX_TOKENS_IN_POOL:
                continue
            results.append(_bench_one(batch, ctx, cfg, device, copy_gbps))
            if HAS_CUDA:
                torch.cuda.empty_cache()
    name = torch.cuda.get_device_name() if HAS_CUDA else "cpu (Triton interpreter)"
    report = {
        "benchmark": "decode paged_attention",
        "device": name,
        "meaningful": HAS_CUDA,
        "note": "CUDA timings from CUDA-graph replays (triton.testing.do_bench_cudagraph: device "
        "time, no launch cost), eager do_bench where a call cannot be captured or *_eager_ms"
        if HAS_CUDA
        else "CPU / Triton interpreter: numbers only prove the code runs; not meaningful",
        "smoke": smoke,
        "prefill_included": False,
        "cuda_graphs": HAS_CUDA,
        "config": {**{k: v for k, v in cfg.items() if k != "dtype"}, "dtype": str(cfg["dtype"])},
        "torch": torch.__version__,
        "copy_bandwidth_gbps": round(copy_gbps, 2),
        "bandwidth_definition": "K+V bytes read / paged time; copy = (read + written) / time",
        "results": results,
        "batch_invariant_matmul": _bench_matmul(smoke, device),
        "fused_moe": _bench_moe(smoke, device),  # empty without CUDA
        "mla_decode": _bench_mla(smoke, device, copy_gbps),  # empty without CUDA
        "sampler_race": _bench_sampler(smoke, device, copy_gbps),
    }
    report["timers"] = dict(TIMERS)  # CUDA timings by graph replay / eagerly (see TIMERS)
    report["plot"] = _plot(results, out_dir, f"paged decode attention, {name}")
    (out_dir / "kernel_bench.json").write_text(json.dumps(report, indent=2))
    return report


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kernel_bench", description=__doc__)
    p.add_argument("--smoke", action="store_true", help="few, small shapes")
    p.add_argument("--out", type=Path, default=Path("kernel-bench-out"))
    p.add_argument(
        "--split-sweep",
        action="store_true",
        help="only the split-KV sweep (forced num_splits 1..8 at batch 32..128): split_sweep.json",
    )
    p.add_argument(
        "--tile-sweep",
        action="store_true",
        help="only the decode tile sweep (BLOCK_N x warps x stages at batch 32..256): "
        "tile_sweep.json",
    )
    p.add_argument(
        "--mla-sweep",
        action="store_true",
        help="only MLA decode's sweep (heads a program x BLOCK_N x warps, split counts; 16 and "
        "128 heads): mla_sweep.json",
    )
    args = p.parse_args(argv)
    sweeps = {"tile_sweep": tile_sweep, "split_sweep": split_sweep, "mla_sweep": mla_sweep}
    for name, sweep in sweeps.items():
        if getattr(args, name):  # one sweep alone: its rows to <name>.json
            device = torch.device("cuda" if HAS_CUDA else "cpu")
            rows = sweep(device, _copy_bandwidth_gbps(device), args.smoke)
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"{name}.json").write_text(json.dumps(rows, indent=1))
            for r in rows:
                print({k: v for k, v in r.items() if k != "configs"})
            return
    report = run(args.smoke, args.out)
    for r in report["results"]:
        print(
            f"batch {r['batch']:>4} ctx {r['context']:>6} splits {r['num_splits']:>2}: "
            f"{r['paged_ms']:.4f} ms, {r['fraction_of_copy_bw']:.2f} of copy bw, "
            f"{r['speedup_vs_sdpa']}x vs SDPA"
        )
    for r in report["batch_invariant_matmul"]:
        print(
            f"matmul {r['weight']} M={r['m']}: {r['invariant_ms']:.4f} ms batch-invariant, "
            f"{r['torch_linear_ms']:.4f} ms F.linear ({r['invariant_over_torch_linear']}x)"
        )
    for r in report["fused_moe"]:
        print(
            f"fused_moe T={r['tokens']}: {r['fused_moe_ms']:.4f} ms, grouped torch "
            f"{r['grouped_torch_ms']:.4f} ms ({r['speedup_vs_grouped_torch']}x)"
        )
    for r in report["sampler_race"]:
        print(
            f"sampler race rows={r['rows']}: {r['gumbel_race_ms']:.4f} ms gumbel_race, torch "
            f"{r['torch_race_ms']:.4f} ms ({r['speedup_vs_torch']}x)"
        )
    print(f"wrote {args.out / 'kernel_bench.json'}")


if __name__ == "__main__":
    main()
