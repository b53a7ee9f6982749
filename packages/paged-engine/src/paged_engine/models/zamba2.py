"""Zyphra Zamba2 (`Zamba2ForCausalLM`: Zamba2-1.2B / 2.7B / 7B): a stack of Mamba2 layers
(layers/mamba2.py), some of which (`config.layer_types`, HF's `layers_block_type`: "hybrid"
among "linear_attention", "mamba" in older configs) first run a transformer block whose
weights are shared across the stack: `num_mem_blocks` blocks, the j-th hybrid layer running
block j % num_mem_blocks with adapters of its own. With e the token embeddings:

    mamba layer:   x += mamba(rmsnorm(x))
    hybrid layer:  t = mlp_j(rmsnorm(attn_j(rmsnorm([x | e]))))      (the block: no residual)
                   x += mamba(rmsnorm(x + linear(t)))                   (t not in the residual)

`linear` is the layer's own [D, D] projection and mamba its own mixer; then the final norm;
embeddings tied by default. The block's attention reads the 2D-wide [x | e]: its heads are
2D / num_attention_heads wide, scaled by (head_dim / 2)^-0.5, rotated whole only when
`use_mem_rope` (`use_long_context` only extends max_position_embeddings to 16384, as
transformers does); q / k / v / o carry no bias. Its MLP is down(act(gate) * up) (`hidden_act`,
GELU by default; `add_bias_linear` biases) from a fused `gate_up_proj`. Application j adds a
low-rank adapter of its own (rank `adapter_rank`, held by the block it runs as
`gate_up_proj_adapter_list.j` and, with `use_shared_attention_adapter`,
`linear_{q,k,v}_adapter_list.j`) to the block's projections: gate_up(h) + B_j A_j h, the same
for q, k and v. The mixer is Mamba2's: width `mamba_expand * hidden_size` over `n_mamba_heads`
heads and `mamba_ngroups` groups, a conv bias always (HF builds one whatever `use_conv_bias`
says), `add_bias_linear` on in_proj and out_proj, dt >= `time_step_min` for prompt tokens
(HF's time_step_limit, applied in its prefill scan), and the gated RMSNorm (eps 1e-5, groups
of width / ngroups) of y * silu(z).

Shared weights: each block is ONE module, registered at every hybrid layer that runs it, so its
parameters are named, and loaded, under the first of them (model.layers.L.shared_transformer,
as HF saves them). A checkpoint that also holds the later layers' copies loads them into the
same module and is refused if they differ (HF would untie them). transformers 5 ties the blocks
only along with the embeddings: with tie_word_embeddings=False (zamba.py `per_layer_blocks`)
each hybrid layer has a block of its own (application j's copy of block j % num_mem_blocks,
with that block's adapters), loaded from its own copy, as here. Each hybrid layer has its own
paged attention (`attn`, no parameters) and so its own KV cache entry: its layer type "hybrid"
holds KV and a mixer state (models/hybrid.py), a mamba layer a state only. Tensor parallelism
splits the attention heads (the q / k / v adapters' B rows with them, their A replicated), the
MLP (each of gate | up, the adapter's B too) and the mixer as the other hybrids do; `linear` is
replicated.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from paged_engine.attention.backend import AttentionMetadata
from paged_engine.layers.activation import get_act_fn
from paged_engine.layers.attention import Attention
from paged_engine.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    copy_checked,
    shard_segments,
)
from paged_engine.layers.mamba2 import Mamba2Mixer, Mamba2Spec
from paged_engine.layers.norm import RMSNorm
from paged_engine.layers.rotary import RotaryEmbedding, get_rope
from paged_engine.models.hybrid import PARALLEL_LAYER_TYPES, HybridModel, layer_types
from paged_engine.models.utils import QKV_PROJ_RULES, cfg_get
from paged_engine.models.zamba import SharedBlockLM, per_layer_blocks

HYBRID = PARALLEL_LAYER_TYPES[0]  # "hybrid": a shared block, then the layer's Mamba2


def hybrid_layer_ids(config) -> list[int]:
    """The hybrid layers, in order: the j-th runs shared block j % num_mem_blocks."""
    return [i for i, t in enumerate(layer_types(config)) if t == HYBRID]


def zamba2_mamba2(config) -> Mamba2Spec:
    hidden = int(config.hidden_size)
    inner = int(cfg_get(config, "mamba_expand", 2) * hidden)
    heads = int(cfg_get(config, "n_mamba_heads", 8))
    if inner % heads:
        raise ValueError(
            f"Zamba2: n_mamba_heads={heads} does not divide the mixer's width {inner} "
            "(mamba_expand * hidden_size)"
        )
    return Mamba2Spec(
        hidden_size=hidden,
        num_heads=heads,
        head_dim=inner // heads,
        num_groups=int(cfg_get(config, "mamba_ngroups", 1)),
        state_size=int(cfg_get(config, "mamba_d_state", 64)),
        conv_kernel=int(cfg_get(config, "mamba_d_conv", 4)),
        conv_bias=True,  # HF's Zamba2MambaMixer: bias=True whatever use_conv_bias says
        proj_bias=bool(getattr(config, "add_bias_linear", False)),
        eps=1e-5,  # HF's gated norm: fixed, not rms_norm_eps
        dt_limit=(float(cfg_get(config, "time_step_min", 0.001)), float("inf")),
    )


class SplitColumnLinear(MergedColumnParallelLinear):
    """Column-parallel segments (gate | up) stacked, whose checkpoint tensor is the whole
    stack: each rank takes its rows of every segment (LoRA's B the same way)."""

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        if shard_id is not None:
            super().weight_loader(param, loaded_weight, shard_id)
            return
        rows = shard_segments(loaded_weight, self.output_sizes, self.tp_rank, self.tp_size)
        copy_checked(param.data, rows, "gate_up shard")


def _low_rank(in_size: int, rank: int, out: nn.Module) -> nn.Sequential:
    """HF's adapter nn.Sequential(A, B) (names `.0`, `.1`): A [rank, in] replicated on every
    rank, B the given column-parallel layer (split as the projection it adds to)."""
    return nn.Sequential(ColumnParallelLinear(in_size, rank, False, 0, 1), out)


def _adapter_list(count: int, used: list[int], build) -> nn.ModuleList:
    """HF's per-application list: an adapter at the indices `used`, nn.Identity elsewhere."""
    return nn.ModuleList(build() if j in used else nn.Identity() for j in range(count))


class Zamba2SharedAttention(nn.Module):
    """q / k / v of the [T, 2D] normed input (plus application j's adapters), RoPE when
    use_mem_rope, the application's own paged attention, o_proj to [T, D]."""

    def __init__(
        self, config, uses: list[int], num_uses: int, rope: RotaryEmbedding | None
    ) -> None:
        super().__init__()
        width = 2 * int(config.hidden_size)
        heads = int(config.num_attention_heads)
        kv_heads = int(cfg_get(config, "num_key_value_heads", heads))
        head_dim = width // heads
        self.head_dim = head_dim
        self.qkv_proj = QKVParallelLinear(width, head_dim, heads, kv_heads, bias=False)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.o_proj = RowParallelLinear(heads * head_dim, int(config.hidden_size), bias=False)
        self.scale = (head_dim / 2) ** -0.5
        self.rotary_emb = rope
        self.use_adapters = bool(getattr(config, "use_shared_attention_adapter", False))
        if self.use_adapters:
            if kv_heads != heads:
                raise ValueError(
                    "Zamba2: use_shared_attention_adapter needs num_key_value_heads == "
                    f"num_attention_heads (its k / v adapters are {width} wide), got "
                    f"{kv_heads} and {heads}"
                )
            rank = int(config.adapter_rank)

            def build() -> nn.Sequential:
                return _low_rank(width, rank, ColumnParallelLinear(rank, width, False))

            self.linear_q_adapter_list = _adapter_list(num_uses, uses, build)
            self.linear_k_adapter_list = _adapter_list(num_uses, uses, build)
            self.linear_v_adapter_list = _adapter_list(num_uses, uses, build)

    def forward(
        self,
        positions: torch.Tensor,
        h: torch.Tensor,  # [T, 2D]
        use: int,
        attn: Attention,
        kv_cache,
        md: AttentionMetadata,
    ) -> torch.Tensor:  # [T, D]
        q, k, v = self.qkv_proj(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.use_adapters:
            q = q + self.linear_q_adapter_list[use](h)
            k = k + self.linear_k_adapter_list[use](h)
            v = v + self.linear_v_adapter_list[use](h)
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(attn(q, k, v, kv_cache, md))


class Zamba2SharedMLP(nn.Module):
    """down(act(gate) * up), gate | up = gate_up_proj(h) + application j's adapter: [T, D]."""

    def __init__(self, config, uses: list[int], num_uses: int) -> None:
        super().__init__()
        hidden, inter = int(config.hidden_size), int(config.intermediate_size)
        bias = bool(getattr(config, "add_bias_linear", False))
        self.gate_up_proj = SplitColumnLinear(hidden, [inter, inter], bias)
        self.down_proj = RowParallelLinear(inter, hidden, bias)
        self.act_fn = get_act_fn(cfg_get(config, "hidden_act", "gelu"))
        rank = int(config.adapter_rank)

        def build() -> nn.Sequential:
            return _low_rank(hidden, rank, SplitColumnLinear(rank, [inter, inter], False))

        self.gate_up_proj_adapter_list = _adapter_list(num_uses, uses, build)

    def forward(self, h: torch.Tensor, use: int) -> torch.Tensor:
        gate_up = self.gate_up_proj(h) + self.gate_up_proj_adapter_list[use](h)
        gate, up = gate_up.chunk(2, dim=-1)  # this rank's halves
        return self.down_proj(self.act_fn(gate) * up)


class Zamba2SharedBlock(nn.Module):
    """One shared transformer block (HF's Zamba2AttentionDecoderLayer) with the adapters of
    the applications `uses` (indices among the hybrid layers) that run it."""

    def __init__(
        self, config, uses: list[int], num_uses: int, rope: RotaryEmbedding | None
    ) -> None:
        super().__init__()
        hidden = int(config.hidden_size)
        eps = float(cfg_get(config, "rms_norm_eps", 1e-5))
        self.input_layernorm = RMSNorm(2 * hidden, eps)
        self.self_attn = Zamba2SharedAttention(config, uses, num_uses, rope)
        self.pre_ff_layernorm = RMSNorm(hidden, eps)
        self.feed_forward = Zamba2SharedMLP(config, uses, num_uses)

    def forward(self, positions, x, embeds, use: int, attn, kv_cache, md) -> torch.Tensor:
        h = self.input_layernorm(torch.cat([x, embeds], dim=-1))
        h = self.self_attn(positions, h, use, attn, kv_cache, md)
        return self.feed_forward(self.pre_ff_layernorm(h), use)


class Zamba2MambaLayer(nn.Module):
    """x + mamba(rmsnorm(x + t)), t the hybrid layer's block output (None: a mamba layer)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.mamba = Mamba2Mixer(zamba2_mamba2(config))
        self.input_layernorm = RMSNorm(config.hidden_size, cfg_get(config, "rms_norm_eps", 1e-5))

    def forward(self, positions, x, embeds, kv_cache, md, t=None) -> torch.Tensor:
        h = x if t is None else x + t
        return x + self.mamba(self.input_layernorm(h), md)


class Zamba2HybridLayer(nn.Module):
    """Shared block `use % num_mem_blocks` with application `use`'s adapters and KV, the
    layer's linear, then its Mamba2 layer."""

    def __init__(self, config, block: Zamba2SharedBlock, use: int) -> None:
        super().__init__()
        self.use = use
        self.shared_transformer = block  # the same module at each layer that runs it
        attn = block.self_attn
        # this application's paged attention: its own KV cache (and fp8 scales)
        self.attn = Attention(attn.num_heads, attn.head_dim, attn.num_kv_heads, attn.scale)
        hidden = int(config.hidden_size)
        self.linear = ColumnParallelLinear(hidden, hidden, False, 0, 1)  # replicated
        self.mamba_decoder = Zamba2MambaLayer(config)

    def forward(self, positions, x, embeds, kv_cache, md) -> torch.Tensor:
        t = self.shared_transformer(positions, x, embeds, self.use, self.attn, kv_cache, md)
        return self.mamba_decoder(positions, x, embeds, None, md, self.linear(t))


class Zamba2Model(HybridModel):
    """HybridModel's stack, each layer also handed the token embeddings (the blocks' input)."""

    def forward(self, input_ids, positions, kv_caches, md, hidden=None) -> torch.Tensor:
        if hidden is not None:  # the blocks need the embeddings; hybrids refuse pipelines
            raise ValueError("Zamba2 does not support pipeline parallelism")
        x = self.embed_tokens(input_ids)
        embeds = x
        if self.rotary_emb is not None:
            self.rotary_emb.begin_forward(positions)
        for layer, i in zip(self.layers, self.kv_index, strict=True):
            x = layer(positions, x, embeds, kv_caches[i] if i >= 0 else None, md)
        return self.norm(x)


class Zamba2ForCausalLM(SharedBlockLM):
    stacked_params = QKV_PROJ_RULES
    ignored_weights = ("rotary_emb.inv_freq",)
    tie_default = True

    def __init__(self, config) -> None:
        types = layer_types(config)
        allowed = ("linear_attention", "mamba", HYBRID)
        if any(t not in allowed for t in types):
            raise ValueError(f"Zamba2 layer types must be among {allowed}, got {types!r}")
        hybrid = hybrid_layer_ids(config)
        num_blocks = int(cfg_get(config, "num_mem_blocks", 1))
        if num_blocks < 1:
            raise ValueError(f"Zamba2: num_mem_blocks must be >= 1, got {num_blocks}")
        hidden, heads = int(config.hidden_size), int(config.num_attention_heads)
        head_dim = 2 * hidden // heads
        if head_dim * heads != 2 * hidden:
            raise ValueError(
                f"Zamba2: num_attention_heads={heads} does not divide the attention's width "
                f"{2 * hidden} (2 * hidden_size)"
            )
        rope = get_rope(config, head_dim) if getattr(config, "use_mem_rope", False) else None
        own = per_layer_blocks(config)

        def block(j: int) -> Zamba2SharedBlock:
            # block b runs at applications b, b + num_blocks, ...: its adapters are theirs
            b = j % num_blocks
            return Zamba2SharedBlock(
                config, list(range(b, len(hybrid), num_blocks)), len(hybrid), rope
            )

        # one module per block, or (untied) per application
        blocks = [block(j) for j in range(len(hybrid) if own else min(num_blocks, len(hybrid)))]
        use_of = {layer: j for j, layer in enumerate(hybrid)}

        def build(i: int) -> nn.Module:
            if i in use_of:
                j = use_of[i]
                return Zamba2HybridLayer(config, blocks[j if own else j % num_blocks], j)
            return Zamba2MambaLayer(config)

        eps = cfg_get(config, "rms_norm_eps", 1e-5)
        super().__init__(config, Zamba2Model(config, build, RMSNorm(hidden, eps), rope))
        # a hybrid layer's checkpoint prefix -> its block's first layer's (where it is named)
        self._block_prefix = {
            layer: f"model.layers.{hybrid[j % num_blocks]}.shared_transformer."
            for layer, j in use_of.items()
            if not own  # untied: each layer's copy is its own block's
        }

    _SHARED = re.compile(r"^model\.layers\.(\d+)\.shared_transformer\.")
    family = "Zamba2"
    block_why = (
        "one shared block (hybrid layers running block j % num_mem_blocks share its weights)"
    )

    def block_prefix(self, layer: int) -> str | None:
        return self._block_prefix.get(layer)
