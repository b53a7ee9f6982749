"""The KV cache tensors of every layer and the batched block copies that copy-on-write needs."""

from __future__ import annotations

import torch

from paged_engine.attention import AttentionBackend
from paged_engine.distributed.parallel_state import get_parallel_state, stage_layers


def kv_shape(hf_config) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) this rank caches, for any supported architecture:
    its pipeline stage's layers and its tensor-parallel share of the KV heads (one replicated
    head when there are more TP ranks than KV heads)."""
    num_layers = getattr(hf_config, "num_hidden_layers", None) or hf_config.n_layer
    num_heads = getattr(hf_config, "num_attention_heads", None) or hf_config.n_head
    hidden = getattr(hf_config, "hidden_size", None) or hf_config.n_embd
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // num_heads
    state = get_parallel_state()
    start, end = stage_layers(num_layers, state.pp_rank, state.pp_size)
    return end - start, max(1, num_kv_heads // state.tp_size), head_dim


class CacheEngine:
    """Per layer: key and value caches of shape [num_blocks, block_size, num_kv_heads, head_dim].

    Block 0 is the null block: block tables are padded with it and nothing real lives there.
    """

    def __init__(
        self,
        hf_config,
        num_blocks: int,
        block_size: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        backend: AttentionBackend,
    ) -> None:
        num_layers, num_kv_heads, head_dim = kv_shape(hf_config)
        shape = backend.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
        self.num_blocks = num_blocks
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = [
            (
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
            )
            for _ in range(num_layers)
        ]
        self.device = device
        self.backend = backend

    @staticmethod
    def bytes_per_block(hf_config, block_size: int, dtype: torch.dtype) -> int:
        num_layers, num_kv_heads, head_dim = kv_shape(hf_config)
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * elem

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """All (src, dst) copies of one step, over every layer's K and V, in one launch."""
        mapping = torch.tensor(pairs, dtype=torch.int64).to(self.device)
        keys = [k for k, _ in self.kv_caches]
        values = [v for _, v in self.kv_caches]
        self.backend.copy_blocks(keys, values, mapping)
