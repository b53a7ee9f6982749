"""DeciLM / Nemotron-NAS (`DeciLMForCausalLM`, model_type "nemotron-nas": NVIDIA
Llama-3.1-Nemotron-51B, Llama-3.3-Nemotron-Super-49B, Llama-3.1-Nemotron-Ultra-253B), a
remote-code release that vLLM's nemotron_nas.py serves.

Llama (models/llama.py: RMSNorms, NeoX rope with Llama 3's scaling, gated MLP, Llama's tensor
names) whose layers differ, each described by `config.block_configs[i]` (a dict, or the release
config's objects with the same fields):

    attention  `n_heads_in_group`: num_attention_heads / n_heads_in_group KV heads in this
               layer; `no_op`: no attention and no input norm (the stream passes through);
               `replace_with_linear`: input norm, then one [D, D] matrix (`self_attn.linear_attn`)
    ffn        `ffn_mult`: a gated MLP of 2 / 3 x ffn_mult x hidden_size rounded up to a
               multiple of 256 (or the block's own `intermediate_size`); `no_op`: no MLP and no
               norm before it; `replace_with_linear`: norm, then `mlp.linear_mlp` [D, D]

Only the layers with attention hold a KV cache, each its own head count (`kv_cache_layout`):
the model's kv_caches list has one entry per such layer, in layer order (`kv_index`).
Tensor parallelism splits each layer's heads and MLP rows (a layer's KV heads replicate where
there are fewer than ranks); the linear replacements are replicated on every rank.

Refused by name: pipeline parallelism with layers that cache nothing (the cache list is not
split by layer then), the blocks' sliding-window / sink / sparse attention fields
(`window_length`, `num_sink_tokens`, `unshifted_sink`, `sparsify`), a block `hidden_act` other
than the config's, and `position_embedding_type` ropes other than Llama's.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from paged_engine.distributed.parallel_state import get_parallel_state
from paged_engine.layers.attention import AttentionMetadata
from paged_engine.layers.embedding import VocabParallelEmbedding
from paged_engine.layers.linear import ColumnParallelLinear
from paged_engine.layers.norm import RMSNorm
from paged_engine.layers.rotary import RotaryEmbedding, get_rope
from paged_engine.models.llama import (
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    llama_head_dim,
    stage_input,
)
from paged_engine.models.utils import CausalLMBase, cfg_get, make_layers

# block fields whose attention variants (windows, sinks, sparsity) are not served
_UNSERVED_ATTENTION = ("window_length", "num_sink_tokens", "unshifted_sink", "sparsify")


@dataclass(frozen=True, slots=True)
class DeciBlock:
    """One layer's parts: attention "attention" | "linear" | "none" with its KV head count (0
    without attention), ffn "mlp" | "linear" | "none" with its MLP width (0 without an MLP)."""

    attention: str
    kv_heads: int
    ffn: str
    ffn_width: int


def _field(part: Any, key: str) -> Any:
    return part.get(key) if isinstance(part, dict) else getattr(part, key, None)


def ffn_mult_width(ffn_mult: float, hidden: int) -> int:
    """The MLP width of a block's `ffn_mult`: int(2 / 3 x mult x hidden) up to a multiple of 256."""
    width = int(2 * ffn_mult * hidden / 3)
    return -(-width // 256) * 256


def deci_blocks(config) -> list[DeciBlock]:
    """Each layer's DeciBlock from config.block_configs; ValueError naming a field not served."""
    blocks = getattr(config, "block_configs", None)
    layers = int(config.num_hidden_layers)
    if not blocks or len(blocks) != layers:
        got = len(blocks) if blocks else 0
        raise ValueError(f"block_configs must describe each of the {layers} layers, got {got}")
    heads, hidden = int(config.num_attention_heads), int(config.hidden_size)
    out = []
    for i, block in enumerate(blocks):
        attn, ffn = _field(block, "attention"), _field(block, "ffn")
        where = f"block_configs[{i}]"
        for key in _UNSERVED_ATTENTION:
            if _field(attn, key):
                raise ValueError(f"DeciLM with {where}.attention.{key} is not supported")
        if _field(ffn, "sparsify"):
            raise ValueError(f"DeciLM with {where}.ffn.sparsify is not supported")
        act = _field(ffn, "hidden_act")
        if act is not None and act != cfg_get(config, "hidden_act", "silu"):
            raise ValueError(f"DeciLM with {where}.ffn.hidden_act={act!r} is not supported")
        if _field(attn, "no_op"):
            kind, kv_heads = "none", 0
        elif _field(attn, "replace_with_linear"):
            kind, kv_heads = "linear", 0
        else:
            group = _field(attn, "n_heads_in_group")
            if not isinstance(group, int) or group <= 0 or heads % group:
                raise ValueError(
                    f"{where}.attention.n_heads_in_group={group!r} must divide "
                    f"num_attention_heads={heads}"
                )
            kind, kv_heads = "attention", heads // group
        if _field(ffn, "no_op"):
            ffn_kind, width = "none", 0
        elif _field(ffn, "replace_with_linear"):
            ffn_kind, width = "linear", 0
        elif _field(ffn, "ffn_mult") is not None:
            ffn_kind, width = "mlp", ffn_mult_width(float(_field(ffn, "ffn_mult")), hidden)
        elif _field(ffn, "intermediate_size") is not None:
            ffn_kind, width = "mlp", int(_field(ffn, "intermediate_size"))
        else:
            raise ValueError(f"{where}.ffn needs ffn_mult or intermediate_size")
        out.append(DeciBlock(kind, kv_heads, ffn_kind, width))
    return out


def _check_parallelism(blocks: list[DeciBlock]) -> None:
    state = get_parallel_state()
    if state.pp_size > 1 and any(b.attention != "attention" for b in blocks):
        raise ValueError(
            "DeciLM with no_op or replace_with_linear attention layers does not support "
            "pipeline parallelism (its KV caches are not one per layer)"
        )
    tp = state.tp_size
    for i, b in enumerate(blocks):
        if b.kv_heads and b.kv_heads % tp and tp % b.kv_heads:
            raise ValueError(
                f"tensor_parallel_size={tp} and block_configs[{i}]'s {b.kv_heads} KV heads "
                "(num_attention_heads / n_heads_in_group): one must divide the other"
            )
        if b.ffn_width % tp:
            raise ValueError(
                f"tensor_parallel_size={tp} must divide block_configs[{i}]'s MLP width "
                f"{b.ffn_width}"
            )


class _Linear(nn.Module):
    """A [D, D] replacement of a sublayer, replicated on every tensor-parallel rank; its weight
    is `<name>.weight` as the checkpoint names it (`linear_attn`, `linear_mlp`)."""

    def __init__(self, name: str, hidden: int) -> None:
        super().__init__()
        self.name = name
        setattr(self, name, ColumnParallelLinear(hidden, hidden, bias=False, tp_rank=0, tp_size=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, D] -> [T, D]
        return getattr(self, self.name)(x)


class DeciLMDecoderLayer(nn.Module):
    """x += sublayer(norm(x)) for the attention and the MLP each, a no_op part skipped whole."""

    def __init__(
        self, config, layer_idx: int, block: DeciBlock, flags: dict[str, bool], rope
    ) -> None:
        super().__init__()
        d, eps = config.hidden_size, cfg_get(config, "rms_norm_eps", 1e-6)
        self.block = block
        if block.attention == "attention":
            layer_config = copy.copy(config)  # this layer's KV heads for LlamaAttention
            layer_config.num_key_value_heads = block.kv_heads
            self.self_attn: nn.Module = LlamaAttention(layer_config, layer_idx, flags, rope)
        elif block.attention == "linear":
            self.self_attn = _Linear("linear_attn", d)
        if block.attention != "none":
            self.input_layernorm = RMSNorm(d, eps)
        if block.ffn == "mlp":
            self.mlp: nn.Module = LlamaMLP(config, flags["mlp_bias"], block.ffn_width)
        elif block.ffn == "linear":
            self.mlp = _Linear("linear_mlp", d)
        if block.ffn != "none":
            self.post_attention_layernorm = RMSNorm(d, eps)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,  # [T, D]
        kv_cache: tuple[torch.Tensor, torch.Tensor] | None,  # None: a layer without attention
        md: AttentionMetadata,
    ) -> torch.Tensor:
        if self.block.attention == "attention":
            x = x + self.self_attn(positions, self.input_layernorm(x), kv_cache, md)
        elif self.block.attention == "linear":
            x = x + self.self_attn(self.input_layernorm(x))
        if self.block.ffn != "none":
            x = x + self.mlp(self.post_attention_layernorm(x))
        return x


class DeciLMModel(nn.Module):
    def __init__(self, config, blocks: list[DeciBlock], flags: dict[str, bool]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.embedding_multiplier = None  # (stage_input reads it)
        self.rotary_emb: RotaryEmbedding = get_rope(config, llama_head_dim(config))
        rope = self.rotary_emb  # one instance shared by the layers
        self.layers, self.stage = make_layers(
            len(blocks), lambda i: DeciLMDecoderLayer(config, i, blocks[i], flags, rope)
        )
        self.norm = RMSNorm(config.hidden_size, cfg_get(config, "rms_norm_eps", 1e-6))
        # Each layer's entry in kv_caches; -1: a layer without attention caches nothing.
        self.kv_index: list[int] = []
        for b in blocks:
            n = sum(i >= 0 for i in self.kv_index)
            self.kv_index.append(n if b.attention == "attention" else -1)

    def forward(self, input_ids, positions, kv_caches, md, hidden=None) -> torch.Tensor:
        x = stage_input(self, input_ids, hidden)
        self.rotary_emb.begin_forward(positions)
        # kv_caches: this stage's cached layers', in order (every layer caches where there are
        # several stages: _check_parallelism)
        first = sum(k >= 0 for k in self.kv_index[: self.stage.start])
        for i in range(self.stage.start, self.stage.end):
            k = self.kv_index[i]
            x = self.layers[i](positions, x, kv_caches[k - first] if k >= 0 else None, md)
        return self.norm(x) if self.stage.is_last else x


class DeciLMForCausalLM(LlamaForCausalLM):
    def __init__(self, config) -> None:
        kind = getattr(config, "position_embedding_type", None)
        if kind not in (None, "rope"):
            raise ValueError(f"DeciLM with position_embedding_type={kind!r} is not supported")
        blocks = deci_blocks(config)
        _check_parallelism(blocks)
        inner = DeciLMModel(config, blocks, self.layer_flags(config))
        CausalLMBase.__init__(self, config, inner)

    @classmethod
    def kv_cache_layout(cls, config) -> list[tuple[int, int]]:
        """(num_kv_heads, head_dim) of each layer with attention, in layer order."""
        d = llama_head_dim(config)
        return [(b.kv_heads, d) for b in deci_blocks(config) if b.attention == "attention"]
