"""Llama 4 (Scout 17B-16E, Maverick 17B-128E): `Llama4ForCausalLM`, and the text model of
`Llama4ForConditionalGeneration` (models/multimodal_text.py).

Llama's pre-norm decoder (RMSNorms, GQA, gated SiLU MLPs) with two kinds of attention layer and
two kinds of MLP:

    rope layers   config.no_rope_layers[i] == 1 (three of every four by default): rope over
                  interleaved pairs (Meta's complex form; llama3 frequency scaling in Scout),
                  then, with `use_qk_norm`, q and k heads scaled to unit RMS (no weight, eps
                  rms_norm_eps); chunked local attention when layer_types[i] is
                  "chunked_attention": a query at position p sees keys p - p % C .. p
                  (C = attention_chunk_size, 8192)
    NoPE layers   no rope, no q/k norm, the whole context; with `attn_temperature_tuning` the
                  queries are scaled by 1 + attn_scale * log(1 + floor((p + 1) / floor_scale))
                  (1 below position floor_scale - 1)
    MoE MLP       layers in `moe_layers` (every interleave_moe_layer_step-th): the router's top-k
                  logits (k = num_experts_per_tok, 1 in the released models) through a sigmoid
                  scale each token's *input* to its expert, y = sum_j expert_j(s_j * x), plus a
                  shared expert every token goes through; experts of `intermediate_size`
    dense MLP     the other layers (Maverick's odd ones): `intermediate_size_mlp`

Which layer is which follows HF's config defaults where a field is missing: no_rope_layers from
`no_rope_layer_interval`, moe_layers from `interleave_moe_layer_step`, layer_types chunked on
rope layers when attention_chunk_size is set.

Checkpoints hold the experts as x @ W: `feed_forward.experts.gate_up_proj` [E, H, 2I] (gate
columns, then up) and `down_proj` [E, I, H], transposed here into FusedMoE's [E, 2I, H] and
[E, H, I]; or one matrix each, `feed_forward.experts.M.{gate,up,down}_proj.weight` (HF Linear
layout, as quantized checkpoints hold them with their scales); `feed_forward.router` is the
router, `feed_forward.shared_expert` the shared expert.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from paged_engine.distributed.communication import tp_all_reduce
from paged_engine.layers.attention import Attention, AttentionMetadata
from paged_engine.layers.deepseek_moe import SharedExpertsMLP
from paged_engine.layers.fused_moe import SparseMoeBlock
from paged_engine.layers.linear import QKVParallelLinear, RowParallelLinear
from paged_engine.layers.norm import UnitRMSNorm
from paged_engine.layers.rotary import RotaryEmbedding
from paged_engine.models.llama import LlamaForCausalLM, LlamaMLP, LlamaModel, llama_head_dim
from paged_engine.models.mixtral import MoeDecoderLayer, check_silu, expert_rules, num_experts
from paged_engine.models.utils import CausalLMBase, cfg_get

_RENAMES = ((".feed_forward.", ".mlp."), (".mlp.router.", ".mlp.gate."))


def rope_layers(config) -> list[bool]:
    """Whether each layer applies rope (HF's `no_rope_layers`: 1 = rope, 0 = NoPE)."""
    n = config.num_hidden_layers
    flags = getattr(config, "no_rope_layers", None)
    if not flags:
        interval = int(cfg_get(config, "no_rope_layer_interval", 4))
        flags = [int((i + 1) % interval != 0) for i in range(n)]
    if len(flags) < n:
        raise ValueError(f"no_rope_layers has {len(flags)} entries for {n} layers")
    return [bool(f) for f in flags[:n]]


def moe_layers(config) -> set[int]:
    layers = getattr(config, "moe_layers", None)
    if layers is None:
        step = int(cfg_get(config, "interleave_moe_layer_step", 1))
        if step < 1:
            raise ValueError(f"interleave_moe_layer_step must be >= 1, got {step}")
        layers = range(step - 1, config.num_hidden_layers, step)
    return set(layers)


def chunked_layers(config) -> list[bool]:
    """Whether each layer attends within its attention chunk (HF's layer_types)."""
    chunk = getattr(config, "attention_chunk_size", None)
    types = getattr(config, "layer_types", None)
    if types is None:
        return [bool(chunk) and rope for rope in rope_layers(config)]
    known = {"chunked_attention", "full_attention"}
    if unknown := set(types) - known:
        raise ValueError(f"Llama 4 layer_types must be {sorted(known)}, got {sorted(unknown)}")
    chunked = [t == "chunked_attention" for t in types[: config.num_hidden_layers]]
    if any(chunked) and not chunk:
        raise ValueError("chunked_attention layers need attention_chunk_size")
    return chunked


class Llama4Attention(nn.Module):
    """`rope` None: a NoPE layer; `chunk`: its attention chunk size, None for the whole
    context."""

    def __init__(self, config, rope: RotaryEmbedding | None, chunk: int | None) -> None:
        super().__init__()
        num_heads = config.num_attention_heads
        num_kv_heads = cfg_get(config, "num_key_value_heads", num_heads)
        head_dim = llama_head_dim(config)
        bias = bool(cfg_get(config, "attention_bias", False))
        self.head_dim = head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, head_dim, num_heads, num_kv_heads, bias
        )
        local_heads, local_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = local_heads * head_dim, local_kv_heads * head_dim
        self.o_proj = RowParallelLinear(num_heads * head_dim, config.hidden_size, bias)
        self.rotary_emb = rope
        use_qk_norm = rope is not None and bool(cfg_get(config, "use_qk_norm", True))
        self.qk_norm = UnitRMSNorm(cfg_get(config, "rms_norm_eps", 1e-5)) if use_qk_norm else None
        # NoPE layers' query temperature: (floor_scale, attn_scale), or None
        self.temperature: tuple[float, float] | None = None
        if rope is None and cfg_get(config, "attn_temperature_tuning", True):
            floor_scale = float(cfg_get(config, "floor_scale", 8192))
            self.temperature = (floor_scale, float(cfg_get(config, "attn_scale", 0.1)))
        self.attn = Attention(
            local_heads, head_dim, local_kv_heads, head_dim**-0.5, attention_chunk_size=chunk
        )

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        md: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(positions, q, k)
            if self.qk_norm is not None:
                q = self.qk_norm(q.reshape(t, -1, self.head_dim)).reshape(t, -1)
                k = self.qk_norm(k.reshape(t, -1, self.head_dim)).reshape(t, -1)
        elif self.temperature is not None:
            floor_scale, attn_scale = self.temperature
            scale = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale))
            q = (q.float() * (scale * attn_scale + 1.0)[:, None]).to(q.dtype)
        return self.o_proj(self.attn(q, k, v, kv_cache, md))


class Llama4MoeBlock(SparseMoeBlock):
    """Routed experts on router-scaled inputs plus a shared expert, one all-reduce for both.
    [T, H] -> [T, H]. Each of a token's k choices runs its expert on x * sigmoid(logit): the
    (token, choice) pairs become k*T rows with routing weight 1."""

    def __init__(self, config) -> None:
        inter = config.intermediate_size
        top_k, hidden = config.num_experts_per_tok, config.hidden_size
        super().__init__(num_experts(config), top_k, hidden, inter, renormalize=False)
        self.shared_expert = SharedExpertsMLP(hidden, inter)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits, ids = torch.topk(self.gate(x), self.top_k, dim=-1)  # [T, k]
        scores = torch.sigmoid(logits.float()).to(x.dtype)
        rows = (x[:, None, :] * scores[:, :, None]).reshape(-1, x.shape[-1])  # [T*k, H]
        ones = torch.ones(rows.shape[0], 1, dtype=torch.float32, device=x.device)
        routed = self.experts(rows, ones, ids.reshape(-1, 1)).view(x.shape[0], self.top_k, -1)
        out = self.shared_expert(x) + routed.sum(dim=1)  # both this rank's partial sums
        return tp_all_reduce(out) if self.experts.tp_size > 1 else out


class Llama4ForCausalLM(CausalLMBase):
    renames = _RENAMES
    stacked_params = LlamaForCausalLM.stacked_params
    ignored_weights = ("rotary_emb.inv_freq",)

    def __init__(self, config) -> None:
        check_silu(config, type(self).__name__)
        uses_rope, chunked, sparse = rope_layers(config), chunked_layers(config), moe_layers(config)
        dense_inter = int(cfg_get(config, "intermediate_size_mlp", config.intermediate_size))

        def build_layer(i: int, rope: RotaryEmbedding) -> nn.Module:
            chunk = config.attention_chunk_size if chunked[i] else None
            attention = Llama4Attention(config, rope if uses_rope[i] else None, chunk)
            if i in sparse:
                mlp: nn.Module = Llama4MoeBlock(config)
            else:
                mlp = LlamaMLP(config, bias=False, intermediate_size=dense_inter)
            return MoeDecoderLayer(config, i, {}, rope, mlp, attention)

        inner = LlamaModel(config, {}, build_layer, is_neox_style=False)
        super().__init__(config, inner)
        # Per-expert matrices (`experts.M.{gate,up,down}_proj.weight`, as quantized checkpoints
        # hold them) first: the dense rules' ".gate_proj" is in their names too.
        rules = expert_rules(num_experts(config), "gate_proj", "up_proj", "down_proj")
        self.stacked_params = (*rules, *type(self).stacked_params)

    def convert_weight(self, name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        # fused experts as x @ W: [E, H, 2I] / [E, I, H] -> ours, [E, 2I, H] / [E, H, I]
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            return ((name, w.transpose(1, 2)),)
        return ((name, w),)
