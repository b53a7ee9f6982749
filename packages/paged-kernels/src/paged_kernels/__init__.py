"""paged-kernels: JIT Triton kernels for paged attention, with plain-torch references.

The torch references load eagerly and need only torch. The Triton kernels resolve lazily
(PEP 562) on first access, so `import paged_kernels` works where triton is not installed
(macOS, Windows, CPU-only Linux); there, touching a kernel raises ImportError.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from paged_kernels._utils import FP8_DTYPES, MAX_HEAD_DIM, check_kv_scales
from paged_kernels.reference import (
    Fp8Weight,
    Int4Weight,
    MoeActivation,
    Mxfp4Weight,
    alibi_slopes,
    dequantize_mxfp4,
    fp8_to_float,
    lora_segments,
    quantize_fp8_per_channel,
    ref_add_rms_norm,
    ref_causal_conv1d,
    ref_copy_blocks,
    ref_fp8_linear,
    ref_fused_moe,
    ref_gated_delta_rule,
    ref_gumbel_race,
    ref_index_topk,
    ref_int4_linear,
    ref_layer_norm,
    ref_logsumexp,
    ref_lora_expand,
    ref_lora_shrink,
    ref_matmul,
    ref_mla_attention,
    ref_paged_attention,
    ref_quantize,
    ref_rms_norm,
    ref_rope_qk,
    ref_selective_scan,
    ref_silu_and_mul,
    ref_sparse_mla_attention,
    ref_ssd_scan,
    ref_swap_blocks,
    ref_write_kv_cache,
)

__version__ = "0.1.0"

_KERNELS = {
    "add_rms_norm": "paged_kernels.norm",
    "choose_num_splits": "paged_kernels.attention",
    "paged_attention": "paged_kernels.attention",
    "align_moe_blocks": "paged_kernels.moe",
    "causal_conv1d": "paged_kernels.linear_attention",
    "gated_delta_rule": "paged_kernels.linear_attention",
    "gumbel_race": "paged_kernels.sampling",
    "index_topk": "paged_kernels.sparse_mla",
    "fused_moe": "paged_kernels.moe",
    "copy_blocks": "paged_kernels.kv_cache",
    "fp8_linear": "paged_kernels.gemm",
    "int4_linear": "paged_kernels.gemm",
    "mla_attention": "paged_kernels.mla",
    "layer_norm": "paged_kernels.norm",
    "logsumexp": "paged_kernels.softmax",
    "lora_expand": "paged_kernels.lora",
    "lora_shrink": "paged_kernels.lora",
    "matmul": "paged_kernels.gemm",
    "rms_norm": "paged_kernels.norm",
    "rope_qk_": "paged_kernels.rotary",
    "selective_scan": "paged_kernels.mamba1",
    "silu_and_mul": "paged_kernels.activation",
    "sparse_mla_attention": "paged_kernels.sparse_mla",
    "ssd_scan": "paged_kernels.ssd",
    "swap_blocks": "paged_kernels.kv_cache",
    "uniform_noise": "paged_kernels.sampling",
    "write_kv_cache": "paged_kernels.kv_cache",
}

__all__ = [
    "FP8_DTYPES",
    "MAX_HEAD_DIM",
    "Fp8Weight",
    "Int4Weight",
    "MoeActivation",
    "Mxfp4Weight",
    "add_rms_norm",
    "alibi_slopes",
    "align_moe_blocks",
    "causal_conv1d",
    "check_kv_scales",
    "choose_num_splits",
    "copy_blocks",
    "dequantize_mxfp4",
    "fp8_linear",
    "fp8_to_float",
    "fused_moe",
    "gated_delta_rule",
    "gumbel_race",
    "index_topk",
    "int4_linear",
    "layer_norm",
    "logsumexp",
    "lora_expand",
    "lora_segments",
    "lora_shrink",
    "matmul",
    "mla_attention",
    "paged_attention",
    "quantize_fp8_per_channel",
    "ref_add_rms_norm",
    "ref_causal_conv1d",
    "ref_copy_blocks",
    "ref_fp8_linear",
    "ref_fused_moe",
    "ref_gated_delta_rule",
    "ref_gumbel_race",
    "ref_index_topk",
    "ref_int4_linear",
    "ref_layer_norm",
    "ref_logsumexp",
    "ref_lora_expand",
    "ref_lora_shrink",
    "ref_matmul",
    "ref_mla_attention",
    "ref_paged_attention",
    "ref_quantize",
    "ref_rms_norm",
    "ref_rope_qk",
    "ref_selective_scan",
    "ref_silu_and_mul",
    "ref_sparse_mla_attention",
    "ref_ssd_scan",
    "ref_swap_blocks",
    "ref_write_kv_cache",
    "rms_norm",
    "rope_qk_",
    "selective_scan",
    "silu_and_mul",
    "sparse_mla_attention",
    "ssd_scan",
    "swap_blocks",
    "triton_available",
    "uniform_noise",
    "write_kv_cache",
]

if TYPE_CHECKING:
    from paged_kernels.activation import silu_and_mul
    from paged_kernels.attention import choose_num_splits, paged_attention
    from paged_kernels.gemm import fp8_linear, int4_linear, matmul
    from paged_kernels.kv_cache import copy_blocks, swap_blocks, write_kv_cache
    from paged_kernels.linear_attention import causal_conv1d, gated_delta_rule
    from paged_kernels.lora import lora_expand, lora_shrink
    from paged_kernels.mamba1 import selective_scan
    from paged_kernels.mla import mla_attention
    from paged_kernels.moe import align_moe_blocks, fused_moe
    from paged_kernels.norm import add_rms_norm, layer_norm, rms_norm
    from paged_kernels.rotary import rope_qk_
    from paged_kernels.sampling import gumbel_race, uniform_noise
    from paged_kernels.softmax import logsumexp
    from paged_kernels.sparse_mla import index_topk, sparse_mla_attention
    from paged_kernels.ssd import ssd_scan


def triton_available() -> bool:
    """True when the import system can find triton; neither triton nor the kernels are imported.

    An installed but broken triton still reports True and fails on first kernel access.
    """
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


def __getattr__(name: str) -> Any:
    module = _KERNELS.get(name)
    if module is None:
        raise AttributeError(f"module 'paged_kernels' has no attribute {name!r}")
    try:
        value = getattr(importlib.import_module(module), name)
    except ImportError as exc:
        if (exc.name or "").partition(".")[0] != "triton":
            raise
        raise ImportError(
            f"paged_kernels.{name} is a Triton kernel and needs the 'triton' package, which is "
            "not installed. Install it with `pip install triton` (wheels: Linux x86_64 and "
            "aarch64), or use the plain-torch references (paged_kernels.ref_*; the engine's "
            "attention_backend='torch').",
            name="triton",
        ) from exc
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_KERNELS})
