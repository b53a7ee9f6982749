"""paged-kernels: JIT Triton kernels for paged attention, with plain-torch references."""

from paged_kernels.attention import choose_num_splits, paged_attention
from paged_kernels.kv_cache import copy_blocks, swap_blocks, write_kv_cache
from paged_kernels.reference import (
    alibi_slopes,
    ref_copy_blocks,
    ref_paged_attention,
    ref_swap_blocks,
    ref_write_kv_cache,
)

__version__ = "0.1.0"

__all__ = [
    "alibi_slopes",
    "choose_num_splits",
    "copy_blocks",
    "paged_attention",
    "ref_copy_blocks",
    "ref_paged_attention",
    "ref_swap_blocks",
    "ref_write_kv_cache",
    "swap_blocks",
    "write_kv_cache",
]
