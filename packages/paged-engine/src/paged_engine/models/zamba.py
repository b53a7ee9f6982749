"""Zyphra Zamba (v1) (`ZambaForCausalLM`: Zamba-7B-v1): a stack of Mamba (v1) layers with
heads (layers/zamba_mamba.py), some of which (`config.layers_block_type` / `layer_types`:
"hybrid" among "linear_attention", "mamba" in older configs; HF's ZambaConfig puts one at layer
2, then one every `attn_layer_period` layers from `attn_layer_offset` past the first three)
first run the one transformer block all of them share. With e the token embeddings:

    mamba layer:   x += mamba(rmsnorm(x))
    hybrid layer:  t = mlp(rmsnorm(attn(rmsnorm([x | e]))))           (the block: no residual)
                   x += mamba(rmsnorm(x + linear(t)))                  (t not in the residual)

`linear` is the hybrid layer's own [D, D] projection and mamba its own mixer; then the final
norm; embeddings tied by default. The block's attention reads the 2D-wide [x | e]
(`attention_hidden_size` = 2 * hidden_size), has no positional encoding and no biases, heads
of `attention_head_dim` (2D / num_attention_heads by default) scaled by (head_dim / 2)^-0.5;
its MLP is down(act(gate) * up) (`hidden_act`, GELU by default). Zamba2 (models/zamba2.py)
is this design with Mamba2 mixers, several blocks, adapters and rope.

Shared weights: the block is ONE module, registered at every hybrid layer, so its parameters
are named and loaded under the first hybrid layer (model.layers.L.shared_transf, as HF saves it
tied). A checkpoint that also holds the later layers' copies loads them into the same module
and is refused if they differ (HF would untie them). transformers 5 ties the copies only along
with the embeddings: with tie_word_embeddings=False (`per_layer_blocks`) each hybrid layer has
a block of its own, loaded from its own copy, as here. Each hybrid layer has its own paged
attention (`attn`, no parameters) and so its own KV cache entry (HF's cache by layer index):
its layer type "hybrid" holds KV and a mixer state (models/hybrid.py), a mamba layer a state
only; prefix caching, chunked prefill, forks and preemption go through the hybrid machinery
(worker/recurrent_state.py) as for Jamba and Zamba2. Tensor parallelism splits the attention
heads, the MLP and the mixer heads; `linear` is replicated. Refused by name:
attention_hidden_size != 2 * hidden_size (HF cannot run it either) and a mixer activation
(hidden_mamba_act) other than SiLU.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from paged_engine.attention.backend import AttentionMetadata
from paged_engine.layers.attention import Attention
from paged_engine.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from paged_engine.layers.norm import RMSNorm
from paged_engine.layers.zamba_mamba import ZambaMambaMixer, ZambaMambaSpec
from paged_engine.models.hybrid import PARALLEL_LAYER_TYPES, HybridModel, layer_types
from paged_engine.models.llama import LlamaForCausalLM, LlamaMLP
from paged_engine.models.utils import CausalLMBase, cfg_get

HYBRID = PARALLEL_LAYER_TYPES[0]  # "hybrid": the shared block, then the layer's mixer


def per_layer_blocks(config) -> bool:
    """Whether each hybrid layer runs a block of its own: transformers 5 ties the layers' copies
    of a shared block only when it ties the embeddings (tie_word_embeddings, default True)."""
    return not bool(getattr(config, "tie_word_embeddings", True))


def zamba_mamba_spec(config) -> ZambaMambaSpec:
    hidden = int(config.hidden_size)
    rank = cfg_get(config, "mamba_dt_rank", "auto")
    return ZambaMambaSpec(
        hidden_size=hidden,
        num_heads=int(cfg_get(config, "n_mamba_heads", 2)),
        intermediate_size=int(cfg_get(config, "mamba_expand", 2) * hidden),
        state_size=int(cfg_get(config, "mamba_d_state", 16)),
        time_step_rank=-(-hidden // 16) if rank == "auto" else int(rank),
        conv_kernel=int(cfg_get(config, "mamba_d_conv", 4)),
        conv_bias=bool(cfg_get(config, "mamba_conv_bias", True)),
        proj_bias=bool(cfg_get(config, "mamba_proj_bias", False)),
        activation=cfg_get(config, "hidden_mamba_act", "silu"),
    )


class ZambaAttention(nn.Module):
    """q / k / v of the [T, 2D] normed input, the application's paged attention (no rope),
    o_proj to [T, D]."""

    def __init__(self, config) -> None:
        super().__init__()
        width = 2 * int(config.hidden_size)
        heads = int(config.num_attention_heads)
        kv_heads = int(cfg_get(config, "num_key_value_heads", heads))
        self.head_dim = int(cfg_get(config, "attention_head_dim", None) or width // heads)
        self.qkv_proj = QKVParallelLinear(width, self.head_dim, heads, kv_heads, bias=False)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(heads * self.head_dim, int(config.hidden_size), False)
        self.scale = (self.head_dim / 2) ** -0.5  # HF's: the input is two states wide

    def forward(self, h: torch.Tensor, attn: Attention, kv_cache, md) -> torch.Tensor:
        q, k, v = self.qkv_proj(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.o_proj(attn(q, k, v, kv_cache, md))


class ZambaSharedBlock(nn.Module):
    """HF's ZambaAttentionDecoderLayer: [T, 2D] -> [T, D] through the application's own
    paged attention (`attn`: the KV cache of the layer running it)."""

    def __init__(self, config) -> None:
        super().__init__()
        hidden = int(config.hidden_size)
        eps = float(cfg_get(config, "rms_norm_eps", 1e-5))
        self.input_layernorm = RMSNorm(2 * hidden, eps)
        self.self_attn = ZambaAttention(config)
        self.pre_ff_layernorm = RMSNorm(hidden, eps)
        self.feed_forward = LlamaMLP(config, bias=False)  # act from hidden_act (GELU)

    def forward(self, x, embeds, attn: Attention, kv_cache, md: AttentionMetadata):
        h = self.input_layernorm(torch.cat([x, embeds], dim=-1))  # [T, 2D]
        h = self.self_attn(h, attn, kv_cache, md)
        return self.feed_forward(self.pre_ff_layernorm(h))


class ZambaMambaLayer(nn.Module):
    """x + mamba(rmsnorm(x + t)), t the hybrid layer's projected block output (None: a mamba
    layer)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.mamba = ZambaMambaMixer(zamba_mamba_spec(config))
        self.input_layernorm = RMSNorm(config.hidden_size, cfg_get(config, "rms_norm_eps", 1e-5))

    def forward(self, x, embeds, kv_cache, md, t=None) -> torch.Tensor:
        h = x if t is None else x + t
        return x + self.mamba(self.input_layernorm(h), md)


class ZambaHybridLayer(nn.Module):
    """The shared block with this layer's KV, its `linear`, then its Mamba layer."""

    def __init__(self, config, block: ZambaSharedBlock) -> None:
        super().__init__()
        self.shared_transf = block  # the same module at every hybrid layer unless untied
        a = block.self_attn
        self.attn = Attention(a.num_heads, a.head_dim, a.num_kv_heads, a.scale)
        hidden = int(config.hidden_size)
        self.linear = ColumnParallelLinear(hidden, hidden, False, 0, 1)  # replicated
        self.mamba_decoder = ZambaMambaLayer(config)

    def forward(self, x, embeds, kv_cache, md) -> torch.Tensor:
        t = self.shared_transf(x, embeds, self.attn, kv_cache, md)
        return self.mamba_decoder(x, embeds, None, md, self.linear(t))


class ZambaModel(HybridModel):
    """HybridModel's stack, each layer also handed the token embeddings (the block's input)."""

    def forward(self, input_ids, positions, kv_caches, md, hidden=None) -> torch.Tensor:
        if hidden is not None:  # the block needs the embeddings; hybrids refuse pipelines
            raise ValueError("Zamba does not support pipeline parallelism")
        x = self.embed_tokens(input_ids)  # [T, D]
        embeds = x
        for layer, i in zip(self.layers, self.kv_index, strict=True):
            x = layer(x, embeds, kv_caches[i] if i >= 0 else None, md)
        return self.norm(x)


class SharedBlockLM(CausalLMBase):
    """A model whose hybrid layers run shared transformer blocks (Zamba, Zamba2), loaded as
    HF's: `final_layernorm` named `norm`, each layer's copy of a block's weights (a name
    `_SHARED` matches) named where the block's one module is (`block_prefix`; None: the layer
    has a block of its own, `per_layer_blocks`) and checked equal to the first copy. ValueError
    naming both where they differ: the config ties the copies (tie_word_embeddings), so one
    module serves them all, while HF would untie the differing tensors. A family sets
    `_SHARED`, `family`, `block_why` (which block two copies belong to) and `block_prefix`."""

    _SHARED: ClassVar[re.Pattern[str]]
    family: ClassVar[str]
    block_why: ClassVar[str]

    def block_prefix(self, layer: int) -> str | None:
        """Where the parameters of the block that hybrid layer `layer` runs are named."""
        raise NotImplementedError

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True
    ) -> set[str]:
        first: dict[str, tuple[str, torch.Tensor]] = {}

        def checked(stream: Iterable[tuple[str, torch.Tensor]]):
            for name, w in stream:
                if self._SHARED.match(name) is not None:
                    seen = first.setdefault(self.rename_weight(name), (name, w))
                    if seen[1] is not w:
                        if not torch.equal(seen[1], w):
                            raise ValueError(
                                f"{self.family}: checkpoint weights {seen[0]!r} and {name!r} "
                                f"differ, but both belong to {self.block_why} under "
                                "tie_word_embeddings=True; set tie_word_embeddings=False in the "
                                "config to serve a block per layer (as transformers 5 builds then)"
                            )
                        continue  # an equal copy: the first one loads the module
                yield name, w

        return super().load_weights(checked(weights), strict)

    def rename_weight(self, name: str) -> str:
        if name.startswith("model.final_layernorm."):
            return "model.norm." + name[len("model.final_layernorm.") :]
        match = self._SHARED.match(name)
        if match is not None:
            prefix = self.block_prefix(int(match.group(1)))
            if prefix is not None:
                return prefix + name[match.end() :]
        return name


class ZambaForCausalLM(SharedBlockLM):
    # q / k / v into the block's qkv_proj, gate / up into its MLP's gate_up_proj
    stacked_params = LlamaForCausalLM.stacked_params
    tie_default = True

    _SHARED = re.compile(r"^model\.layers\.(\d+)\.shared_transf\.")
    family = "Zamba"
    block_why = "the shared block (every hybrid layer runs the same one)"

    def __init__(self, config) -> None:
        types = layer_types(config)
        allowed = ("linear_attention", "mamba", HYBRID)
        if any(t not in allowed for t in types):
            raise ValueError(f"Zamba layer types must be among {allowed}, got {types!r}")
        hidden = int(config.hidden_size)
        width = int(cfg_get(config, "attention_hidden_size", None) or 2 * hidden)
        if width != 2 * hidden:
            raise ValueError(
                f"Zamba: attention_hidden_size={width} must be 2 * hidden_size = {2 * hidden} "
                "(the shared block reads [hidden | embeddings])"
            )
        hybrid = [i for i, t in enumerate(types) if t == HYBRID]
        own = per_layer_blocks(config)
        shared = None if own else ZambaSharedBlock(config)

        def build(i: int) -> nn.Module:
            if i not in hybrid:
                return ZambaMambaLayer(config)
            return ZambaHybridLayer(config, ZambaSharedBlock(config) if shared is None else shared)

        eps = cfg_get(config, "rms_norm_eps", 1e-5)
        super().__init__(config, ZambaModel(config, build, RMSNorm(hidden, eps), None))
        # where the one block's parameters are named: the first hybrid layer's
        self._block_prefix = None if own else f"model.layers.{hybrid[0]}.shared_transf."

    def block_prefix(self, layer: int) -> str | None:
        return self._block_prefix  # one block: every hybrid layer's; None: each layer's own
