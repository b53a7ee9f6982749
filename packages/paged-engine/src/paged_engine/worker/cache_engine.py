"""The KV cache tensors of every layer, the batched block copies that copy-on-write needs, and
the CPU block pool that swapped-out and offloaded blocks live in."""

from __future__ import annotations

import torch

import paged_kernels
from paged_engine.attention import AttentionBackend
from paged_engine.distributed.parallel_state import (
    decoder_layer_count,
    get_parallel_state,
    stage_layers,
)
from paged_engine.models import kv_cache_layout
from paged_engine.models.hybrid import is_hybrid, num_kv_layers, stage_kv_range
from paged_engine.worker import host_memory

_FP8 = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """EngineConfig.kv_cache_dtype -> the cache's element type ("auto": the model's)."""
    return model_dtype if name == "auto" else _FP8[name]


def latent_kv(hf_config) -> bool:
    """Whether the model caches one latent vector a token instead of keys and values (DeepSeek's
    multi-head latent attention, models/deepseek_v2.py): one "KV head" of kv_lora_rank +
    qk_rope_head_dim entries, held by a single tensor that is both the layer's key and value
    cache (the attention reads its values from the keys' first kv_lora_rank entries)."""
    return getattr(hf_config, "kv_lora_rank", None) is not None


def _kv_copies(hf_config) -> int:
    """Tensors a layer's cache holds: 2 (keys, values), 1 for a latent cache."""
    return 1 if latent_kv(hf_config) else 2


def _model_kv_shape(hf_config) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of the whole model; a hybrid model's layers of
    linear attention cache nothing (worker/recurrent_state.py), its others count."""
    num_layers = getattr(hf_config, "num_hidden_layers", None) or hf_config.n_layer
    if is_hybrid(hf_config):
        num_layers = num_kv_layers(hf_config)
        if num_layers == 0:  # a pure state-space model (Mamba): blocks only count tokens
            return 0, 1, 1
    if latent_kv(hf_config):  # replicated on every tensor-parallel rank
        return num_layers, 1, int(hf_config.kv_lora_rank) + int(hf_config.qk_rope_head_dim)
    num_heads = getattr(hf_config, "num_attention_heads", None) or hf_config.n_head
    hidden = getattr(hf_config, "hidden_size", None) or hf_config.n_embd
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // num_heads
    return num_layers, num_kv_heads, head_dim


def _model_kv_layers(hf_config) -> list[tuple[int, int]]:
    """(num_kv_heads, head_dim) of each KV-cached layer of the whole model, in layer order:
    the model's own `kv_cache_layout` where its layers differ (Gemma 4), else one shape."""
    layout = kv_cache_layout(hf_config)
    if layout is not None:
        return list(layout)
    num_layers, num_kv_heads, head_dim = _model_kv_shape(hf_config)
    return [(num_kv_heads, head_dim)] * num_layers


def kv_layers(hf_config) -> list[tuple[int, int]]:
    """(num_kv_heads, head_dim) of each layer this rank caches, for any supported architecture:
    its pipeline stage's layers and its tensor-parallel share of the KV heads (one replicated
    head when there are more TP ranks than KV heads)."""
    layers = _model_kv_layers(hf_config)
    if not layers:
        return []
    state = get_parallel_state()
    if state.pp_size > 1:
        start, end = _stage_slice(hf_config, len(layers), state.pp_rank, state.pp_size)
        layers = layers[start:end]
    return [(max(1, heads // state.tp_size), dim) for heads, dim in layers]


def _stage_slice(hf_config, count: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """The entries of stage `pp_rank` in a per-layer cache list of `count` entries: the stage's
    decoder layers (`stage_layers`) times the entries a layer (one; LongCat-Flash's two, layer
    by layer), so a stage caches exactly the layers it built; a hybrid's list (its attention
    layers only) the KV layers among the stage's (`stage_kv_range`). Another model whose list is
    not a whole multiple of its layers refuses pipeline stages itself."""
    layers = decoder_layer_count(hf_config)
    if layers and is_hybrid(hf_config) and count == num_kv_layers(hf_config):
        return stage_kv_range(hf_config, *stage_layers(layers, pp_rank, pp_size))
    if not layers or count % layers:
        return stage_layers(count, pp_rank, pp_size)
    per_layer = count // layers
    start, end = stage_layers(layers, pp_rank, pp_size)
    return per_layer * start, per_layer * end


def kv_head_dim(hf_config) -> int:
    """The widest KV head any layer caches (what the attention kernels must support)."""
    return max((dim for _, dim in _model_kv_layers(hf_config)), default=1)


def num_cpu_blocks(hf_config, block_size: int, dtype: torch.dtype, gib: float) -> int:
    """Blocks of the CPU pool (swap_space + cpu_offload_gib GiB): sized from the whole model's
    KV, so every rank (and the engine, which manages the pool) gets the same count; each rank
    holds its shard of those blocks. 0 = no CPU pool."""
    elem = torch.empty((), dtype=dtype).element_size()
    width = sum(heads * dim for heads, dim in _model_kv_layers(hf_config))
    per_block = _kv_copies(hf_config) * block_size * width * elem
    return int(gib * (1 << 30)) // per_block if per_block else 0


class CacheEngine:
    """Per layer: key and value caches in the backend's layout (by default
    [num_blocks, block_size, num_kv_heads, head_dim]), of the KV cache dtype.

    A latent cache (`latent_kv`) is one tensor per layer, the same object in both places of its
    (key, value) pair. Block 0 is the null block: block tables are padded with it and nothing
    real lives there.
    With `num_cpu_blocks` a CPU copy of that layout (pinned on CUDA) holds swapped-out and
    offloaded blocks; `swap_out` / `swap_in` move whole blocks of every layer between them.
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
        num_cpu_blocks: int = 0,
    ) -> None:
        layers = kv_layers(hf_config)
        # The block axis of the backend's layout: the one dimension that follows num_blocks.
        two, three = (backend.kv_cache_shape(n, block_size, 1, 1) for n in (2, 3))
        self._block_dim = next(i for i, (a, b) in enumerate(zip(two, three)) if a != b)
        self.num_blocks = num_blocks
        self.shared_kv = latent_kv(hf_config)
        self.kv_caches = [
            self._pair(backend.kv_cache_shape(num_blocks, block_size, *layer), dtype=dtype,
                       device=device)
            for layer in layers
        ]  # fmt: skip
        self.device = device
        self.backend = backend
        self.cpu_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        if num_cpu_blocks:
            pin = device.type == "cuda"
            self.cpu_caches = [
                self._pair(backend.kv_cache_shape(num_cpu_blocks, block_size, *layer),
                           dtype=dtype, pin_memory=pin)
                for layer in layers
            ]  # fmt: skip

    def _pair(self, shape, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's (key, value) caches: two tensors, or one latent tensor twice."""
        key = host_memory.cache_zeros(shape, **kwargs)
        return (key, key) if self.shared_kv else (key, host_memory.cache_zeros(shape, **kwargs))

    def _unique(self, pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return pair[:1] if self.shared_kv else pair

    @staticmethod
    def bytes_per_block(hf_config, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        width = sum(heads * dim for heads, dim in kv_layers(hf_config))
        return _kv_copies(hf_config) * block_size * width * elem

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """All (src, dst) copies of one step, over every layer's K and V: one launch per cache
        shape."""
        if not self.kv_caches:  # a model without KV layers: blocks hold nothing to copy
            return
        mapping = torch.tensor(pairs, dtype=torch.int64).to(self.device)
        # One launch per cache shape (layers of one shape in most models; Gemma 4 has two).
        by_shape: dict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for pair in self.kv_caches:
            by_shape.setdefault(tuple(pair[0].shape), []).append(pair)
        for group in by_shape.values():
            keys = [k for k, _ in group]
            # A latent cache's values are its keys: copy each tensor once (the key and value
            # lists of a launch must not hold one tensor twice, or two programs write one block).
            values = [] if self.shared_kv else [v for _, v in group]
            self.backend.copy_blocks(keys, values, mapping)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, CPU block) copies of every layer's K and V; run before this step's
        swap-ins, copies and forward overwrite any of those device blocks."""
        self._swap(self.kv_caches, self.cpu_caches, pairs)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(CPU block, device block) copies, before this step's copies and forward."""
        self._swap(self.cpu_caches, self.kv_caches, pairs)

    def _swap(self, src_caches, dst_caches, pairs: list[tuple[int, int]]) -> None:
        assert self.cpu_caches, "no CPU block pool (swap_space / cpu_offload_gib are 0)"
        cuda = self.device.type == "cuda"  # the kernel package's non-blocking DMA per pair
        swap = paged_kernels.swap_blocks if cuda else paged_kernels.ref_swap_blocks
        mapping = torch.tensor(pairs, dtype=torch.int64)
        dim = self._block_dim
        for src_layer, dst_layer in zip(src_caches, dst_caches):
            for src, dst in zip(self._unique(src_layer), self._unique(dst_layer)):
                swap(src.movedim(dim, 0), dst.movedim(dim, 0), mapping)
