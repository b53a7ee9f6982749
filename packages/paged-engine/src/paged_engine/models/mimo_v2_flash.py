"""Xiaomi MiMo-V2-Flash (`MiMoV2FlashForCausalLM`, model_type "mimo_v2_flash").

K-EXAONE's MoE decoder (models/exaone_moe.py: Llama's pre-norm layers, a dense gated SiLU MLP
or DeepSeek-V3's MoE per `mlp_layer_types`) with an attention of its own. Each piece as
transformers runs it:

    layers     `layer_types`: "sliding_attention" layers see the last `sliding_window` keys
               (themselves included), "full_attention" layers everything
    attention  GQA whose q / k heads are `head_dim` wide (192) and value heads `v_head_dim`
               (128); sliding layers have twice num_key_value_heads KV heads and one learned
               sink logit per query head (the softmax also runs over exp(sink_h), whose mass
               multiplies no value), full layers neither; values times `attention_value_scale`
               as they are projected; scores scaled by head_dim^-0.5; q / k / v biases when
               `attention_bias`, none on o_proj
    rope       one per layer type, from that type's entry of `rope_parameters` (its own
               rope_theta: 5M full, 10k sliding), NeoX halves of the first
               int(head_dim * partial_rotary_factor) dims of each head; a default-type entry
               without a factor means 0.334 (a scaled one 1.0), as HF reads it
    mlp        "dense": intermediate_size; "sparse": sigmoid scores with a correction bias,
               group-limited top-k, renormalized (norm_topk_prob), times routed_scaling_factor,
               experts of moe_intermediate_size, no shared experts

The attention kernels take one head size, max(head_dim, v_head_dim), and the KV cache holds
heads that wide: the narrower of values or queries / keys padded with zeros (at 192 / 128 a
fifth more cache than exact values). Zero value columns add zeros to each output, which keeps
its first v_head_dim columns; zero query / key columns add nothing to a score, scaled by
head_dim^-0.5 whatever the width. Layers cache different KV head counts (`kv_cache_layout`).
Checkpoints name the sinks `self_attn.attention_sink_bias`; their multi-token-prediction layers
(`model.mtp.*`, unused by HF) are skipped. Refused by name: speculative_config method "mtp", a
scaled `rope_parameters` entry without a partial_rotary_factor of its own beside a top-level
one that differs (HF ignores the top-level one), hidden_act other than SiLU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.distributed.parallel_state import get_tp_rank, get_tp_size
from paged_engine.layers.attention import Attention, AttentionMetadata
from paged_engine.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    copy_checked,
)
from paged_engine.layers.rotary import RotaryEmbedding, get_rope, plain_rope, rope_config
from paged_engine.models.exaone_moe import ExaoneMoeForCausalLM
from paged_engine.models.laguna import LayerTypeRopeModel
from paged_engine.models.llama import llama_head_dim
from paged_engine.models.mixtral import MoeDecoderLayer, check_silu, expert_rules, num_experts
from paged_engine.models.utils import CausalLMBase, cfg_get, layer_sliding_window

_LAYER_TYPES = ("full_attention", "sliding_attention")


def mimo_layer_types(config) -> list[str]:
    """config.layer_types, checked: one "full_attention" / "sliding_attention" a layer."""
    types = list(getattr(config, "layer_types", None) or [])
    if len(types) != config.num_hidden_layers or any(t not in _LAYER_TYPES for t in types):
        raise ValueError(f"config.layer_types needs {_LAYER_TYPES} entries, one a layer: {types}")
    return types


def layer_kv_heads(config, layer_type: str) -> int:
    """KV heads of a layer: sliding layers have twice num_key_value_heads."""
    return int(config.num_key_value_heads) * (2 if layer_type == "sliding_attention" else 1)


def layer_rope(config, layer_type: str, head_dim: int) -> RotaryEmbedding:
    """The rope of one layer type, its rotary dims as HF counts them (module docstring)."""
    entry = (getattr(config, "rope_parameters", None) or {}).get(layer_type)
    if not isinstance(entry, dict):
        raise ValueError(f"config.rope_parameters needs an entry for {layer_type!r}")
    theta, scaling, _ = rope_config(config, layer_type)
    if scaling is None:
        partial = float(entry.get("partial_rotary_factor", 0.334))
        max_position = int(config.max_position_embeddings)
        return plain_rope(head_dim, int(head_dim * partial), max_position, theta)
    rope = get_rope(config, head_dim, layer_type=layer_type)
    want = int(head_dim * float(entry.get("partial_rotary_factor", 1.0)))
    if rope.rotary_dim != want:  # get_rope fell back to a top-level partial_rotary_factor
        raise ValueError(
            f"config.rope_parameters[{layer_type!r}] needs its own partial_rotary_factor "
            "(transformers ignores the top-level one)"
        )
    return rope


class AsymmetricQKVLinear(QKVParallelLinear):
    """QKVParallelLinear with value heads `v_head_dim` wide (q and k heads head_dim): this
    rank's rows [q (H/tp * D) | k (Hkv/tp * D) | v (Hkv/tp * Dv)], the heads split (KV heads
    replicated past num_kv_heads ranks) as QKVParallelLinear splits them."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        v_head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
    ) -> None:
        tp_rank, tp_size = get_tp_rank(), get_tp_size()
        if num_heads % tp_size or max(tp_size, num_kv_heads) % min(tp_size, num_kv_heads):
            raise ValueError(
                f"{num_heads} heads / {num_kv_heads} KV heads do not split over "
                f"tensor_parallel_size={tp_size}"
            )
        self.head_dim, self.v_head_dim = head_dim, v_head_dim
        self.num_heads = num_heads // tp_size
        self.num_kv_heads = max(1, num_kv_heads // tp_size)
        self.kv_replicas = max(1, tp_size // num_kv_heads)
        local = (self.num_heads + self.num_kv_heads) * head_dim + self.num_kv_heads * v_head_dim
        ColumnParallelLinear.__init__(self, hidden_size, local * tp_size, bias, tp_rank, tp_size)
        # LoRA B rows per part (lora/model.py): the whole q, k and v projections'
        kv = num_kv_heads
        self.lora_segments = {
            "q": (0, num_heads * head_dim),
            "k": (1, kv * head_dim),
            "v": (2, kv * v_head_dim),
        }

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        if shard_id != "v":  # q and k sit where QKVParallelLinear puts them
            super().weight_loader(param, loaded_weight, shard_id)
            return
        offset = (self.num_heads + self.num_kv_heads) * self.head_dim
        size = self.num_kv_heads * self.v_head_dim
        src = loaded_weight.narrow(0, (self.tp_rank // self.kv_replicas) * size, size)
        copy_checked(param.data.narrow(0, offset, size), src, "qkv shard v")


class MiMoV2FlashAttention(nn.Module):
    def __init__(self, config, layer_idx: int, layer_type: str, rope: RotaryEmbedding) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.head_dim, self.v_head_dim = llama_head_dim(config), int(config.v_head_dim)
        self.cache_head_dim = max(self.head_dim, self.v_head_dim)  # the kernels' one head size
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = AsymmetricQKVLinear(
            hidden, self.head_dim, self.v_head_dim, heads, layer_kv_heads(config, layer_type), bias
        )
        local_heads, local_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = local_heads * self.head_dim
        self.kv_size = local_kv_heads * self.head_dim
        self.v_size = local_kv_heads * self.v_head_dim
        self.o_proj = RowParallelLinear(heads * self.v_head_dim, hidden, bias=False)
        self.rotary_emb = rope  # shared by the layers of its type
        self.v_scale = float(cfg_get(config, "attention_value_scale", 1.0))
        self.sinks = None
        if layer_type == "sliding_attention":  # float32 whatever the model dtype
            self.sinks = nn.Parameter(torch.empty(local_heads, dtype=torch.float32))
            self.sinks.weight_loader = self._load_sinks
        self.attn = Attention(
            local_heads,
            self.cache_head_dim,
            local_kv_heads,
            self.head_dim**-0.5,
            sliding_window=layer_sliding_window(config, layer_idx),
            sinks=self.sinks,
        )

    def _load_sinks(self, param: nn.Parameter, w: torch.Tensor) -> None:
        heads = param.shape[0]
        begin = self.qkv_proj.tp_rank * heads
        if w.shape != (heads * self.qkv_proj.tp_size,):
            raise ValueError(f"sinks: {tuple(w.shape)}, expected one a query head")
        param.data.copy_(w[begin : begin + heads])

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        x: torch.Tensor,  # [T, D]
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        md: AttentionMetadata,
    ) -> torch.Tensor:
        t, d, dv, w = x.shape[0], self.head_dim, self.v_head_dim, self.cache_head_dim
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.v_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        v = v * self.v_scale  # before the cache, as HF scales the projected values
        # zero columns up to the cache's head size w (module docstring)
        q, k, v = _pad_heads(q, d, w), _pad_heads(k, d, w), _pad_heads(v, dv, w)
        out = self.attn(q, k, v, kv_cache, md)  # [T, H * w]
        if dv < w:
            out = out.view(t, -1, w)[..., :dv].reshape(t, -1)
        return self.o_proj(out)  # [T, D]


def _pad_heads(x: torch.Tensor, size: int, width: int) -> torch.Tensor:
    """[T, n * size] -> [T, n * width]: each head's columns, then zeros."""
    if size == width:
        return x
    return F.pad(x.reshape(x.shape[0], -1, size), (0, width - size)).reshape(x.shape[0], -1)


def mimo_model(config, build_mlp: Callable[[object, int], nn.Module]) -> LayerTypeRopeModel:
    """Embedding, pre-norm decoder layers (the MLP of `build_mlp(config, i)`) and final norm,
    each layer type's rope (`layer_rope`) shared by its layers."""
    types, head_dim = mimo_layer_types(config), llama_head_dim(config)

    def build(i: int, rope: RotaryEmbedding) -> MoeDecoderLayer:
        attention = MiMoV2FlashAttention(config, i, types[i], rope)
        return MoeDecoderLayer(config, i, {}, None, build_mlp(config, i), attention)

    return LayerTypeRopeModel(config, build, lambda t: layer_rope(config, t, head_dim))


class MiMoV2FlashForCausalLM(ExaoneMoeForCausalLM):
    """K-EXAONE's MLPs (build_mlp: dense or DeepSeek-V3's MoE by mlp_layer_types, scaled by
    routed_scaling_factor), expert names and `mtp.` skipping, over Laguna's stack with a rope
    per layer type (`mimo_model`)."""

    def __init__(self, config) -> None:
        check_silu(config, type(self).__name__)
        cls = type(self)
        CausalLMBase.__init__(self, config, mimo_model(config, cls.build_mlp))
        # Expert rules first: the dense rules' ".gate_proj" would also match an expert's name.
        rules = expert_rules(num_experts(config), *self.expert_names)
        self.stacked_params = (*rules, *cls.stacked_params)

    @classmethod
    def kv_cache_layout(cls, config) -> list[tuple[int, int]]:
        """(num_kv_heads, head size) of each layer: sliding layers cache twice the KV heads, all
        heads max(head_dim, v_head_dim) wide."""
        d = max(llama_head_dim(config), int(config.v_head_dim))
        return [(layer_kv_heads(config, t), d) for t in mimo_layer_types(config)]

    def rename_weight(self, name: str) -> str:
        name = name.replace(".self_attn.attention_sink_bias", ".self_attn.sinks")
        return super().rename_weight(name)
