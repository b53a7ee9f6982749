"""Compile every kernel launch of paged_kernels' wrappers for a GPU, on a machine without one.

    python tests/kernels/gpu_compile.py [--arch 90]     (TRITON_INTERPRET must be unset)

Each wrapper (paged_attention in its modes, mla_attention, write_kv_cache, copy_blocks, matmul,
fp8_linear, int4_linear, rms_norm, add_rms_norm, layer_norm, logsumexp, rope_qk_, silu_and_mul,
gumbel_race, uniform_noise, fused_moe, lora_shrink, lora_expand, causal_conv1d, gated_delta_rule (a
gate per head or per key channel), ssd_scan, selective_scan) is called on CPU tensors with its
Triton kernels swapped for recorders: a launch records its arguments instead of running. Every
recorded launch is then compiled by Triton for `cuda:<arch>` down to a cubin (Triton bundles ptxas),
with the wrapper's own constexprs, warps, stages and fp-fusion switch and the launcher's run-time
specialisation of the arguments (16-divisible pointers and ints, ints equal to 1), so type errors,
unsupported ops and shared-memory overflows show here rather than on a rented GPU; `ptxas -v` then
reports the registers each thread spills (`--no-spills` makes a spill an error). A launch that turns
fp fusion off (to round each product as torch does) must hold no fp32 fused multiply-add in its PTX.
Prints one line per launch, "ok" or the error, and exits 1 on any error. What it cannot check:
numerics (the interpreter tests do) and runtime behaviour."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import traceback

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("gpu_compile.py compiles real kernels: unset TRITON_INTERPRET")

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

# Shared memory a block may opt into, per compute capability (CUDA programming guide, "Technical
# Specifications"): a kernel over it compiles but fails at launch.
MAX_SHARED = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448}

_PTR = {
    torch.float32: "*fp32",
    torch.float16: "*fp16",
    torch.bfloat16: "*bf16",
    torch.float8_e4m3fn: "*fp8e4nv",
    torch.float8_e5m2: "*fp8e5",
    torch.int32: "*i32",
    torch.int64: "*i64",
    torch.uint8: "*u8",
}


class Recorder:
    """Stands in for a JITFunction: `kernel[grid](*args, **kw)` records the launch."""

    def __init__(self, fn, launches: list) -> None:
        self.fn, self.launches = fn, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((self.fn, args, kwargs))

        return launch


def _arg_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return _PTR[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def compile_launch(fn, args: tuple, kwargs: dict, arch: int):
    """Compile one recorded launch for cuda:<arch>; returns the compiled kernel.

    Arguments are specialised as Triton's launcher does at run time: an int equal to 1 becomes a
    constant, and pointers (data_ptr) and ints divisible by 16 are marked so, which is what lets
    the GPU build vectorise loads and pipeline them through shared memory (without the marks,
    loads are scalar: more registers, no cp.async). Parameters in the kernel's
    do_not_specialize lists are left unmarked, as at run time."""
    launch_options = ("num_warps", "num_stages", "enable_fp_fusion")
    options = {k: kwargs.pop(k) for k in launch_options if k in kwargs}
    names = [p.name for p in fn.params]
    values = dict(zip(names, args))
    values.update(kwargs)
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        value = values[p.name]
        if p.is_constexpr or (_is_int(value) and value == 1 and not p.do_not_specialize):
            signature[p.name] = "constexpr"
            constexprs[(i,)] = value
            continue
        signature[p.name] = _arg_type(value)
        if p.do_not_specialize or p.do_not_specialize_on_alignment:
            continue
        if isinstance(value, torch.Tensor):
            value = value.data_ptr()
        if _is_int(value) and value % 16 == 0:
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def spilled_bytes(kernel, arch: int) -> int | None:
    """Bytes a thread spills (ptxas -v on the kernel's PTX, with the ptxas Triton uses); None
    where this Triton does not say which ptxas that is."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
    except ImportError:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        suffix = "a" if arch >= 90 else ""
        cmd = [get_ptxas(arch).path, f"-arch=sm_{arch}{suffix}", "-v", ptx, "-o", ptx + ".o"]
        report = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", report))


def record_launches() -> list[tuple[str, object, tuple, dict]]:
    """(label, kernel, args, kwargs) of every launch of a matrix of wrapper calls."""
    import paged_kernels.activation as activation
    import paged_kernels.attention as attention
    import paged_kernels.gemm as gemm
    import paged_kernels.kv_cache as kv_cache
    import paged_kernels.linear_attention as linear_attention
    import paged_kernels.lora as lora
    import paged_kernels.mamba1 as mamba1
    import paged_kernels.mla as mla
    import paged_kernels.moe as moe
    import paged_kernels.norm as norm
    import paged_kernels.rotary as rotary
    import paged_kernels.sampling as sampling
    import paged_kernels.softmax as softmax
    import paged_kernels.ssd as ssd

    modules = (
        activation, attention, gemm, kv_cache, linear_attention, lora, mamba1, mla, moe, norm,
        rotary, sampling, softmax, ssd,
    )  # fmt: skip
    launches: list = []
    for mod in modules:
        for name in dir(mod):
            fn = getattr(mod, name)
            if isinstance(fn, triton.runtime.jit.JITFunction) and name.endswith("_kernel"):
                setattr(mod, name, Recorder(fn, launches))
    out = []

    def call(label: str, wrapper, *args, **kwargs) -> None:
        start = len(launches)
        wrapper(*args, **kwargs)
        out.extend((f"{label} [{fn.__name__}]", fn, a, k) for fn, a, k in launches[start:])

    def batch(dtype, cache_dtype, heads, kv_heads, head_dim, q_lens, ctx, block_size=16):
        seq_lens = [c + q for c, q in zip(ctx, q_lens)]
        blocks = sum(-(-s // block_size) for s in seq_lens) + 1
        q = torch.zeros(sum(q_lens), heads, head_dim, dtype=dtype)
        cache = torch.zeros(blocks, block_size, kv_heads, head_dim, dtype=cache_dtype)
        tables = torch.zeros(len(q_lens), blocks, dtype=torch.int32)
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        lens = torch.tensor(seq_lens, dtype=torch.int32)
        return q, cache, cache.clone(), tables, cu, lens

    decode = ([1] * 4, [700] * 4)
    mixed = ([1, 37, 5], [90, 0, 12])
    attn_cases = [
        ("decode bf16 GQA 4, D=128", torch.bfloat16, torch.bfloat16, 32, 8, 128, decode, {}),
        (
            "decode fp16 MHA, D=64, split",
            torch.float16,
            torch.float16,
            8,
            8,
            64,
            decode,
            {"num_splits": 4},
        ),
        (
            "mixed bf16 GQA 8, D=96, window + soft cap",
            torch.bfloat16,
            torch.bfloat16,
            16,
            2,
            96,
            mixed,
            {"sliding_window": 33, "soft_cap": 30.0},
        ),
        (
            "mixed fp32 D=256 ALiBi",
            torch.float32,
            torch.float32,
            4,
            4,
            256,
            mixed,
            {"alibi_slopes": torch.ones(4)},
        ),
        (
            "mixed bf16, fp8 e4m3 cache, D=128",
            torch.bfloat16,
            torch.float8_e4m3fn,
            32,
            8,
            128,
            mixed,
            {"k_scale": 0.5, "v_scale": 0.25},
        ),
        (
            "mixed bf16 batch_invariant, D=128",
            torch.bfloat16,
            torch.bfloat16,
            32,
            8,
            128,
            mixed,
            {"batch_invariant": True},
        ),
        (
            "decode bf16 batch_invariant, D=64 GQA 2",
            torch.bfloat16,
            torch.bfloat16,
            16,
            8,
            64,
            decode,
            {"batch_invariant": True},
        ),
        (
            "mixed bf16 GQA 8, D=64, sinks",
            torch.bfloat16,
            torch.bfloat16,
            64,
            8,
            64,
            mixed,
            {"sinks": torch.zeros(64)},
        ),
        (  # Gemma 4's full layers
            "decode bf16 GQA 4, D=512, split",
            torch.bfloat16,
            torch.bfloat16,
            8,
            2,
            512,
            decode,
            {"num_splits": 4},
        ),
        ("mixed bf16 GQA 4, D=512", torch.bfloat16, torch.bfloat16, 8, 2, 512, mixed, {}),
        ("mixed fp32 D=512", torch.float32, torch.float32, 4, 4, 512, mixed, {}),
        (  # Llama 4's rope layers: 40 query heads on 8 KV heads
            "decode bf16 GQA 5, D=128, chunk + split",
            torch.bfloat16,
            torch.bfloat16,
            40,
            8,
            128,
            decode,
            {"num_splits": 2, "attention_chunk_size": 256},
        ),
        (
            "mixed bf16 GQA 5, D=128, chunk",
            torch.bfloat16,
            torch.bfloat16,
            40,
            8,
            128,
            mixed,
            {"attention_chunk_size": 32},
        ),
        (
            "decode bf16 GQA 8, D=64, split, window + sinks",
            torch.bfloat16,
            torch.bfloat16,
            64,
            8,
            64,
            decode,
            {"num_splits": 4, "sliding_window": 128, "sinks": torch.zeros(64)},
        ),
        (  # Gemma 3's image prefill: two-way spans (key_ends), on a sliding layer
            "mixed bf16 GQA 2, D=256, window + key_ends",
            torch.bfloat16,
            torch.bfloat16,
            8,
            4,
            256,
            mixed,
            {"sliding_window": 1024, "key_ends": torch.zeros(sum(mixed[0]), dtype=torch.int32)},
        ),
    ]
    for label, dtype, cache_dtype, h, hk, d, (q_lens, ctx), kw in attn_cases:
        q, kc, vc, tables, cu, lens = batch(dtype, cache_dtype, h, hk, d, q_lens, ctx)
        kwargs = {"max_seqlen_q": max(q_lens), "max_seqlen_k": int(lens.max()), **kw}
        call(
            f"paged_attention {label}",
            attention.paged_attention,
            q,
            kc,
            vc,
            tables,
            cu,
            lens,
            0.1,
            **kwargs,
        )
    # MLA's latent cache (models/deepseek_v2.py): one head of 512 + 64, 16 query heads a program
    # (DeepSeek-V2-Lite, Moonlight; V3's 128 in eight head groups), bf16 and an fp8 cache.
    for label, heads, cache_dtype, (q_lens, ctx), scales in (
        ("decode bf16 16 heads", 16, torch.bfloat16, decode, {}),
        ("decode bf16 16 heads, split keys", 16, torch.bfloat16, decode, {"num_splits": 4}),
        ("mixed bf16 16 heads", 16, torch.bfloat16, mixed, {}),
        ("decode bf16 128 heads", 128, torch.bfloat16, decode, {}),
        ("mixed bf16 128 heads, fp8 e4m3 cache", 128, torch.float8_e4m3fn, mixed, {"k_scale": 0.5}),
    ):
        q, cache, _, tables, cu, lens = batch(
            torch.bfloat16, cache_dtype, heads, 1, 576, q_lens, ctx
        )
        call(
            f"mla_attention {label}",
            mla.mla_attention,
            q,
            cache,
            tables,
            cu,
            lens,
            0.1,
            latent_dim=512,
            max_seqlen_q=max(q_lens),
            **scales,
        )
    for dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
        kc = torch.zeros(8, 16, 8, 128, dtype=dtype)
        k = torch.zeros(5, 8, 128, dtype=torch.bfloat16)
        scales = {} if dtype == torch.bfloat16 else {"k_scale": 0.5, "v_scale": 0.5}
        slots = torch.zeros(5, dtype=torch.int64)
        call(
            f"write_kv_cache {dtype}",
            kv_cache.write_kv_cache,
            k,
            k,
            kc,
            kc.clone(),
            slots,
            **scales,
        )
    caches = [torch.zeros(8, 16, 8, 128, dtype=torch.bfloat16) for _ in range(4)]
    call("copy_blocks bf16", kv_cache.copy_blocks, caches[:2], caches[2:], torch.tensor([[0, 1]]))
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x, w = torch.zeros(3, 1024, dtype=dtype), torch.zeros(4096, 1024, dtype=dtype)
        call(f"matmul {dtype}", gemm.matmul, x, w, torch.zeros(4096, dtype=dtype))
        call(f"rms_norm {dtype}", norm.rms_norm, x, w[0], 1e-6, 1.0)
        call(f"layer_norm {dtype}", norm.layer_norm, x, w[0], w[1], 1e-5)
        call(f"logsumexp {dtype}", softmax.logsumexp, torch.zeros(2, 151936, dtype=dtype))
    # the layer epilogues at Qwen3-0.6B's sizes (16 q / 8 kv heads of 128, hidden 1024,
    # intermediate 3072) and Llama-3.1-8B's; GLM-4's GPT-J pairs over half of each head
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = torch.zeros(3, 1024, dtype=dtype)
        call(f"add_rms_norm {dtype}", norm.add_rms_norm, x, x.clone(), x[0], 1e-6)
        call(f"silu_and_mul {dtype}", activation.silu_and_mul, torch.zeros(3, 6144, dtype=dtype))
    # the sampler's race over Qwen3's vocabulary: bf16 logits divided in the kernel, fp32
    # processed ones, split over programs; and its noise written out
    seeds = torch.zeros(3, dtype=torch.int64)
    for dtype, temp in ((torch.bfloat16, torch.ones(3)), (torch.float32, None)):
        call(f"gumbel_race {dtype}", sampling.gumbel_race, torch.zeros(3, 151936, dtype=dtype),
             seeds, temp)  # fmt: skip
    call("uniform_noise", sampling.uniform_noise, seeds, 151936)
    table = torch.zeros(4096, 128)
    for label, dtype, (hq, hk, d), rot, kw in (
        ("Qwen3 bf16, q/k norms", torch.bfloat16, (16, 8, 128), 64, {"norm": True}),
        ("Gemma 3 bf16, its q/k norms", torch.bfloat16, (8, 4, 256), 128, {"gemma": True}),
        ("Llama-3.1-8B bf16", torch.bfloat16, (32, 8, 128), 64, {}),
        ("GLM-4 fp16, GPT-J half rotary", torch.float16, (32, 2, 128), 32, {"neox": False}),
        ("fp32 D=80, partial", torch.float32, (8, 8, 80), 16, {}),
    ):
        qkv = torch.zeros(3, (hq + 2 * hk) * d, dtype=dtype)
        weights: dict = {}
        if kw.get("norm") or kw.get("gemma"):
            weights = {
                "q_weight": torch.zeros(d, dtype=dtype),
                "k_weight": torch.zeros(d, dtype=dtype),
            }
        if kw.get("gemma"):  # 1 + w, the fp32 product rounded once
            weights.update(weight_offset=1.0, round_before_weight=False)
        cs = table[:, :rot].contiguous()
        call(f"rope_qk_ {label}", rotary.rope_qk_, qkv, torch.zeros(3, dtype=torch.int64), cs,
             cs.clone(), hq, hk, d, is_neox_style=kw.get("neox", True), **weights)  # fmt: skip
    call(
        "rms_norm bf16 hidden 8192",
        lambda: norm.rms_norm(
            torch.zeros(2, 8192, dtype=torch.bfloat16),
            torch.zeros(8192, dtype=torch.bfloat16),
            1e-6,
        ),
    )
    # narrow rows share a program ([ROWS, BLOCK] tiles): a head's 128 (16 rows), and 32 (64)
    for width in (128, 32):
        x = torch.zeros(40, width, dtype=torch.bfloat16)
        call(f"rms_norm bf16 width {width}", norm.rms_norm, x, x[0], 1e-6)
        call(f"add_rms_norm bf16 width {width}", norm.add_rms_norm, x, x.clone(), x[0], 1e-6)
        call(f"layer_norm bf16 width {width}", norm.layer_norm, x, x[0], x[1], 1e-5)
    # fused_moe at Qwen3-30B-A3B's expert sizes (H 2048, I 768; 8 of its 128 experts, top-2, to
    # keep the CPU tensors small): decode-, mid- and prefill-size groups pick different tiles
    # (fp32 has two configs; fp16 compiles as bf16 does).
    for dtype, token_counts in ((torch.bfloat16, (4, 128, 512)), (torch.float32, (4, 128))):
        gate_up = torch.zeros(8, 2 * 768, 2048, dtype=dtype)
        down = torch.zeros(8, 2048, 768, dtype=dtype)
        for tokens in token_counts:
            x = torch.zeros(tokens, 2048, dtype=dtype)
            ids = torch.arange(2 * tokens).remainder(8).view(tokens, 2)
            weights = torch.zeros(tokens, 2)
            label = f"fused_moe {dtype} T={tokens}"
            call(label, moe.fused_moe, x, gate_up, down, weights, ids)
    # gpt-oss-20b's experts (H = I = 2880; 8 of its 32 experts, top-4): biases and the clamped
    # SwiGLU, dense bf16 and MXFP4 (bytes decoded in the GEMMs), decode- and prefill-size groups.
    act = moe.MoeActivation("swigluoai", 1.702, 7.0)
    hid = inter = 2880
    gate_up_mx = moe.Mxfp4Weight(
        torch.zeros(8, 2 * inter, hid // 2, dtype=torch.uint8),
        torch.zeros(8, 2 * inter, hid // 32, dtype=torch.uint8),
    )
    down_mx = moe.Mxfp4Weight(
        torch.zeros(8, hid, inter // 2, dtype=torch.uint8),
        torch.zeros(8, hid, inter // 32, dtype=torch.uint8),
    )
    biases = {
        "gate_up_bias": torch.zeros(8, 2 * inter, dtype=torch.bfloat16),
        "down_bias": torch.zeros(8, hid, dtype=torch.bfloat16),
        "activation": act,
    }
    for tokens in (4, 512):
        x = torch.zeros(tokens, hid, dtype=torch.bfloat16)
        ids = torch.arange(4 * tokens).remainder(8).view(tokens, 4)
        weights = torch.zeros(tokens, 4)
        call(f"fused_moe mxfp4 gpt-oss T={tokens}", moe.fused_moe, x, gate_up_mx, down_mx,
             weights, ids, **biases)  # fmt: skip
    # FP8 experts (quantization="fp8"): Qwen3-30B-A3B's sizes, decode and prefill groups.
    fp8_gate_up = moe.Fp8Weight(
        torch.zeros(8, 2 * 768, 2048, dtype=torch.float8_e4m3fn), torch.ones(8, 2 * 768)
    )
    fp8_down = moe.Fp8Weight(
        torch.zeros(8, 2048, 768, dtype=torch.float8_e4m3fn), torch.ones(8, 2048)
    )
    for tokens in (4, 512):
        x = torch.zeros(tokens, 2048, dtype=torch.bfloat16)
        ids = torch.arange(2 * tokens).remainder(8).view(tokens, 2)
        call(f"fused_moe fp8 T={tokens}", moe.fused_moe, x, fp8_gate_up, fp8_down,
             torch.zeros(tokens, 2), ids)  # fmt: skip

    # int4 experts (a GPTQ / AWQ checkpoint's codes, kept): Qwen3-30B-A3B's sizes, bf16 scale
    # and low per 32 inputs, decoded in the GEMMs.
    def int4(n: int, k: int) -> moe.Int4Weight:
        groups = torch.zeros(8, n, k // 32, dtype=torch.bfloat16)
        return moe.Int4Weight(torch.zeros(8, n, k // 2, dtype=torch.uint8), groups, groups.clone())

    for tokens in (4, 512):
        x = torch.zeros(tokens, 2048, dtype=torch.bfloat16)
        ids = torch.arange(2 * tokens).remainder(8).view(tokens, 2)
        call(f"fused_moe int4 T={tokens}", moe.fused_moe, x, int4(2 * 768, 2048),
             int4(2048, 768), torch.zeros(tokens, 2), ids)  # fmt: skip
    # Nemotron 3 Nano's non-gated relu2 experts (H 2688, I 1856; 8 of its 128 experts, top-6):
    # the first GEMM over up [E, I, H] alone, one accumulator; bf16, FP8 and MXFP4 weights.
    relu2, nh, ni = moe.MoeActivation("relu2"), 2688, 1856

    def mxfp4(n: int, k: int) -> moe.Mxfp4Weight:
        blocks = torch.zeros(8, n, k // 2, dtype=torch.uint8)
        return moe.Mxfp4Weight(blocks, torch.zeros(8, n, k // 32, dtype=torch.uint8))

    nemotron = {
        "bf16": (
            torch.zeros(8, ni, nh, dtype=torch.bfloat16),
            torch.zeros(8, nh, ni, dtype=torch.bfloat16),
        ),
        "fp8": (
            moe.Fp8Weight(torch.zeros(8, ni, nh, dtype=torch.float8_e4m3fn), torch.ones(8, ni)),
            moe.Fp8Weight(torch.zeros(8, nh, ni, dtype=torch.float8_e4m3fn), torch.ones(8, nh)),
        ),
        "mxfp4": (mxfp4(ni, nh), mxfp4(nh, ni)),
    }
    for kind, (up, dn) in nemotron.items():
        for tokens in (4, 512) if kind != "mxfp4" else (4,):
            x = torch.zeros(tokens, nh, dtype=torch.bfloat16)
            ids = torch.arange(6 * tokens).remainder(8).view(tokens, 6)
            call(f"fused_moe relu2 {kind} Nemotron-3 T={tokens}", moe.fused_moe, x, up, dn,
                 torch.zeros(tokens, 6), ids, activation=relu2)  # fmt: skip
    x = torch.zeros(4, hid, dtype=torch.bfloat16)
    gate_up = torch.zeros(8, 2 * inter, hid, dtype=torch.bfloat16)
    down = torch.zeros(8, hid, inter, dtype=torch.bfloat16)
    ids, weights = torch.arange(16).remainder(8).view(4, 4), torch.zeros(4, 4)
    call("fused_moe bf16 gpt-oss T=4", moe.fused_moe, x, gate_up, down, weights, ids, **biases)
    # FP8 weights (W8A16) at Llama-3.1-8B's down projection: each tile config, bf16 and fp32.
    w8 = torch.zeros(4096, 14336, dtype=torch.float8_e4m3fn)
    for dtype, token_counts in ((torch.bfloat16, (1, 48, 512)), (torch.float32, (1, 48))):
        for tokens in token_counts:
            x = torch.zeros(tokens, 14336, dtype=dtype)
            call(f"fp8_linear {dtype} T={tokens}", gemm.fp8_linear, x, w8, torch.ones(4096))
    # 4-bit group-quantized weights (W4A16, a scale and low per 32 inputs) at the same shape,
    # bf16 scales: decode and prefill tiles.
    w4 = torch.zeros(4096, 14336 // 2, dtype=torch.uint8)
    groups = torch.zeros(4096, 14336 // 32, dtype=torch.bfloat16)
    for tokens in (1, 512):
        x = torch.zeros(tokens, 14336, dtype=torch.bfloat16)
        call(f"int4_linear bf16 T={tokens}", gemm.int4_linear, x, w4, groups, groups.clone())
    # Multi-LoRA at a 4096 hidden size, rank 48 (q/k/v rank 16 stacked), 4 adapter slots: decode,
    # mid-size and prefill batches pick different tiles (and shrink's split-K).
    slots, rank, hidden = 4, 48, 4096
    lora_a = torch.zeros(slots, rank, hidden, dtype=torch.bfloat16)
    lora_b = torch.zeros(slots, hidden, rank, dtype=torch.bfloat16)
    seg_start = torch.zeros(slots + 1, dtype=torch.int32)
    for tokens in (1, 256, 4096):
        x = torch.zeros(tokens, hidden, dtype=torch.bfloat16)
        token_idx = torch.zeros(tokens, dtype=torch.int32)
        s = torch.zeros(tokens, rank)
        call(f"lora_shrink bf16 T={tokens}", lora.lora_shrink, x, lora_a, token_idx, seg_start)
        call(f"lora_expand bf16 T={tokens}", lora.lora_expand, s, lora_b, token_idx, seg_start, x)
    # Gated DeltaNet (Qwen3-Next-80B-A3B on one GPU: 16 key / 32 value heads of 128, conv over
    # q, k, v = 8192 channels, K = 4): decode and mixed batches; bf16 and fp32 state pools.
    for label, lens in (("decode", [1] * 4), ("mixed", [1, 37, 5])):
        tokens = sum(lens)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        slots = torch.arange(len(lens), dtype=torch.int32)
        init = torch.ones(len(lens), dtype=torch.bool)
        batch = (cu, slots, init)
        x = torch.zeros(tokens, 8192, dtype=torch.bfloat16)
        weight = torch.zeros(8192, 4, dtype=torch.bfloat16)
        conv_state = torch.zeros(8, 8192, 3, dtype=torch.bfloat16)
        call(f"causal_conv1d bf16 C=8192 K=4 {label}", linear_attention.causal_conv1d, x,
             weight, weight[:, 0].contiguous(), conv_state, *batch)  # fmt: skip
        for dim, state_dtype in ((128, torch.float32), (128, torch.bfloat16), (256, torch.float32)):
            q = torch.zeros(tokens, 16, dim, dtype=torch.bfloat16)
            v = torch.zeros(tokens, 32, dim, dtype=torch.bfloat16)
            g, beta = torch.zeros(tokens, 32), torch.zeros(tokens, 32, dtype=torch.bfloat16)
            pool = torch.zeros(8, 32, dim, dim, dtype=state_dtype)
            call(f"gated_delta_rule bf16 D={dim} {state_dtype} state {label}",
                 linear_attention.gated_delta_rule, q, q, v, g, beta, pool, *batch)  # fmt: skip
        # Kimi Delta Attention (Kimi-Linear-48B: 32 heads of 128): a decay per key channel
        q, g = torch.zeros(tokens, 32, 128, dtype=torch.bfloat16), torch.zeros(tokens, 32, 128)
        beta, pool = torch.zeros(tokens, 32, dtype=torch.bfloat16), torch.zeros(8, 32, 128, 128)
        call(f"gated_delta_rule per-channel gate bf16 D=128 {label}",
             linear_attention.gated_delta_rule, q, q, q, g, beta, pool, *batch)  # fmt: skip
        # Mamba2's scan: Granite 4.0-H (128 heads of 64, N = 128, one group), Nemotron-H (8
        # groups), and N = 256 with P = 128 (the largest state tile a program holds per row).
        for heads, dim, groups, d_state, state_dtype in (
            (128, 64, 1, 128, torch.float32),
            (128, 64, 1, 128, torch.bfloat16),
            (128, 64, 8, 128, torch.float32),
            (32, 128, 1, 256, torch.float32),
        ):
            x = torch.zeros(tokens, heads, dim, dtype=torch.bfloat16)
            dt, a = torch.zeros(tokens, heads), torch.zeros(heads)
            bc = torch.zeros(tokens, groups, d_state, dtype=torch.bfloat16)
            pool = torch.zeros(8, heads, dim, d_state, dtype=state_dtype)
            call(f"ssd_scan bf16 H={heads} P={dim} G={groups} N={d_state} {state_dtype} state "
                 f"{label}", ssd.ssd_scan, x, dt, a, bc, bc, pool, *batch)  # fmt: skip
        # Mamba1's scan: Mamba-2.8B (D = 5120, N = 16; B and C slices of x_proj's output),
        # Jamba (D = 8192), and N = 256 (the largest state row).
        for channels, d_state, state_dtype in (
            (5120, 16, torch.float32),
            (5120, 16, torch.bfloat16),
            (8192, 16, torch.float32),
            (1024, 256, torch.float32),
        ):
            x = torch.zeros(tokens, channels, dtype=torch.bfloat16)
            dt, a = torch.zeros(tokens, channels), torch.zeros(channels, d_state)
            proj = torch.zeros(tokens, 160 + 2 * d_state, dtype=torch.bfloat16)
            b, c = proj[:, 160 : 160 + d_state], proj[:, 160 + d_state :]
            pool = torch.zeros(8, channels, d_state, dtype=state_dtype)
            call(f"selective_scan bf16 D={channels} N={d_state} {state_dtype} state {label}",
                 mamba1.selective_scan, x, dt, a, b, c, pool, *batch)  # fmt: skip
    batch = (torch.tensor([0, 5], dtype=torch.int32), torch.zeros(1, dtype=torch.int32), init[:1])
    call("causal_conv1d fp32 K=2, no activation", linear_attention.causal_conv1d,
         torch.zeros(5, 1024), torch.zeros(1024, 2), None, torch.zeros(2, 1024, 1), *batch,
         activation=None)  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80, 89, 90")
    p.add_argument("--no-spills", action="store_true", help="a launch that spills registers fails")
    p.add_argument("--only", default="", help="compile only launches whose label contains this")
    args = p.parse_args(argv)
    failed = 0
    for label, fn, a, kw in record_launches():
        if args.only not in label:
            continue
        try:
            kernel = compile_launch(fn, a, dict(kw), args.arch)
            if kw.get("enable_fp_fusion") is False and "fma.rn.f32" in kernel.asm["ptx"]:
                raise RuntimeError("fp fusion is off, yet the PTX holds fma.rn.f32")
            shared, limit = kernel.metadata.shared, MAX_SHARED.get(args.arch)
            if limit is not None and shared > limit:
                raise RuntimeError(f"{shared} B of shared memory > sm_{args.arch}'s {limit} B")
            spills = spilled_bytes(kernel, args.arch)
            if spills and args.no_spills:
                raise RuntimeError(f"spills {spills} B a thread")
            print(f"ok    sm_{args.arch} {label}: {shared} B shared, spills {spills}", flush=True)
        except Exception:
            failed += 1
            print(f"ERROR sm_{args.arch} {label}:\n{traceback.format_exc()}", flush=True)
    print(f"{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
