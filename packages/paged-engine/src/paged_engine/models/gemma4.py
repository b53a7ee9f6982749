"""Gemma 4 text models (`Gemma4ForCausalLM`, and the language model of
`Gemma4ForConditionalGeneration`, models/multimodal_text.py): E2B / E4B, the dense ones and the
MoE (26B-A4B).

Gemma 3's layer (four norms, sliding and full layers by `layer_types`, q / k norms before RoPE,
a tanh-GELU gated MLP, the embedding scaled by sqrt(hidden_size), tied head, final soft-cap),
with these differences, each as transformers runs it:

    norms      RMSNorm scales by `weight` (not 1 + weight), the product in float32, rounded once;
               values get a norm without weight; attention is not scaled (scale 1)
    geometry   full layers have their own head size and KV head count (`per_layer_config`:
               `global_head_dim`, `num_global_key_value_heads`), so the KV cache holds two
               shapes of layer (`kv_cache_layout`); with `attention_k_eq_v` a full layer's
               values are its key projection (before the k norm and RoPE)
    rope       per layer type: sliding layers the default rope, full layers "proportional" RoPE,
               its first partial_rotary_factor * head_dim / 2 frequencies 1 / theta^(2i / D)
               (over the whole head's D) and the rest 0, i.e. those dims not rotated
    KV sharing the last `num_kv_shared_layers` layers compute no K / V: each attends over the
               cache of the last earlier layer of its type (`Attention.set_kv_source`), and
               (`use_double_wide_mlp`) has an MLP twice as wide
    PLE        per-layer inputs (`hidden_size_per_layer_input` P): a second embedding
               [V, L * P] scaled by sqrt(P) plus a projection of the scaled embedding
               (x 1 / sqrt(hidden), RMSNorm over P), their sum x 1 / sqrt(2); after its MLP each
               layer adds norm(proj(gelu(gate(x)) * input_l))
    MoE        (`enable_moe_block`) beside the dense MLP: the router reads the residual stream
               (weightless norm, x scale x hidden^-0.5, softmax, top-k renormalized, times a
               per-expert scale); tanh-GELU gated experts on their own pre-norm; the two outputs
               post-normed and added, then the layer's post-feedforward norm
    scalar     each layer's output times its `layer_scalar`
    images     (multimodal/gemma4.py) an image's two-way rows (`md.key_ends`, with
               use_bidirectional_attention="vision") reach the sliding layers only, the full
               ones stay causal; image rows read the pad token's per-layer embedding

Not supported, refused by name: `use_bidirectional_attention="all"`, pipeline parallelism with
KV-shared layers (a layer and the layer whose cache it reads must share a stage), an fp8 KV
cache with KV-shared layers (worker/kv_scales.py).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable

import torch
from torch import nn

from paged_engine.distributed.communication import tp_all_reduce
from paged_engine.distributed.parallel_state import get_parallel_state
from paged_engine.layers.activation import get_act_fn
from paged_engine.layers.attention import Attention, AttentionMetadata
from paged_engine.layers.embedding import VocabParallelEmbedding
from paged_engine.layers.fused_moe import FusedMoE
from paged_engine.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from paged_engine.layers.norm import UnitRMSNorm
from paged_engine.layers.rotary import RotaryEmbedding, plain_rope, rope_config
from paged_engine.models.gemma2 import GemmaMLP, gemma_layer_types
from paged_engine.models.olmo2 import Olmo2RMSNorm
from paged_engine.models.utils import (
    QKV_PROJ_RULES,
    CausalLMBase,
    cfg_get,
    layer_index,
    make_layers,
    soft_cap,
)
from paged_kernels import MoeActivation

GELU_TANH = MoeActivation("gelu_tanh")


def _override(config, layer: int, key: str):
    """A dict `per_layer_config`'s value of `key` for `layer` (keyed by the index or its
    string), None when the layer keeps the global value."""
    table = getattr(config, "per_layer_config", None) or {}
    entry = table.get(layer, table.get(str(layer)))
    return None if entry is None else entry.get(key)


def layer_geometry(config) -> list[tuple[int, int]]:
    """(head_dim, num_kv_heads) of every layer: transformers' per-layer config views where the
    config has them, else the global values with `per_layer_config`'s overrides (a dict)."""
    n = config.num_hidden_layers
    table = getattr(config, "per_layer_config", None)
    if table is not None and not isinstance(table, dict):
        return [(int(table[i].head_dim), int(table[i].num_key_value_heads)) for i in range(n)]
    head_dim = int(config.head_dim)
    kv_heads = int(cfg_get(config, "num_key_value_heads", config.num_attention_heads))
    out = []
    for i in range(n):
        d, h = _override(config, i, "head_dim"), _override(config, i, "num_key_value_heads")
        out.append((int(d or head_dim), int(h or kv_heads)))
    return out


def kv_sources(config, every: int = 6) -> list[int]:
    """For every layer, the layer whose KV it attends over: itself, or for the last
    `num_kv_shared_layers` layers the last earlier non-shared layer of the same type (layer
    types by `gemma_layer_types(config, every)`)."""
    types = gemma_layer_types(config, every)
    n = config.num_hidden_layers
    first_shared = n - int(cfg_get(config, "num_kv_shared_layers", 0))
    if first_shared <= 0 and n > 0:
        raise ValueError("num_kv_shared_layers must leave a layer that computes its own KV")
    sources = list(range(n))
    for i in range(first_shared, n):
        earlier = [j for j in range(first_shared) if types[j] == types[i]]
        if not earlier:
            raise ValueError(f"layer {i} ({types[i]}) shares KV, but no earlier layer is one")
        sources[i] = earlier[-1]
    return sources


def _rope(config, layer_type: str, head_dim: int) -> RotaryEmbedding:
    """The rope of one layer type: "default" or "proportional" (see the module doc)."""
    theta, scaling, partial = rope_config(config, layer_type)
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    max_position = int(config.max_position_embeddings)
    if kind == "default":
        return plain_rope(head_dim, head_dim, max_position, theta, is_neox_style=True)
    if kind != "proportional":
        raise ValueError(f"{layer_type} layers: unsupported rope_type {kind!r}")
    assert scaling is not None
    angles = int(partial * head_dim // 2)
    factor = float(scaling.get("factor") or 1.0)
    # RotaryEmbedding's frequencies are 1 / theta^(2i / D); a divisor of inf makes one 0.
    divisors = [factor] * angles + [float("inf")] * (head_dim // 2 - angles)
    return plain_rope(
        head_dim, head_dim, max_position, theta, is_neox_style=True, freq_factors=divisors
    )


class Gemma4Attention(nn.Module):
    def __init__(
        self,
        config,
        head_dim: int,
        kv_heads: int,
        rope: RotaryEmbedding,
        sliding_window: int | None,
        kv_shared: bool,
    ) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        bias = bool(getattr(config, "attention_bias", False))
        eps = float(cfg_get(config, "rms_norm_eps", 1e-6))
        self.head_dim, self.kv_shared = head_dim, kv_shared
        self.rotary_emb = rope
        self.q_norm = Olmo2RMSNorm(head_dim, eps)
        if kv_shared:  # queries only: keys and values are another layer's
            self.q_heads = ColumnParallelLinear(hidden, heads * head_dim, bias=bias)
            local_heads = self.q_heads.weight.shape[0] // head_dim
            local_kv = max(1, kv_heads // self.q_heads.tp_size)  # as QKVParallelLinear splits
        else:
            # k_eq_v layers: no v_proj; the checkpoint's k_proj loads into k and v
            self.qkv_proj = QKVParallelLinear(hidden, head_dim, heads, kv_heads, bias=bias)
            local_heads, local_kv = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
            self.k_norm = Olmo2RMSNorm(head_dim, eps)
            self.v_norm = UnitRMSNorm(eps)
        self.q_size, self.kv_size = local_heads * head_dim, local_kv * head_dim
        self.o_proj = RowParallelLinear(heads * head_dim, hidden, bias=bias)
        self.attn = Attention(local_heads, head_dim, local_kv, 1.0, sliding_window=sliding_window)

    def forward(self, positions, x, kv_cache, md: AttentionMetadata) -> torch.Tensor:  # [T, D]
        t, d = x.shape[0], self.head_dim
        if self.kv_shared:
            q = self.q_norm(self.q_heads(x).view(t, -1, d)).view(t, -1)
            q = self.rotary_emb(positions, q, q[:, :0])[0]
            return self.o_proj(self.attn(q, q, q, kv_cache, md))  # k, v unread: shared
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(t, -1, d)).reshape(t, -1)
        v = self.v_norm(v.reshape(t, -1, d)).reshape(t, -1)  # the raw projection, normed
        k = self.k_norm(k.reshape(t, -1, d)).reshape(t, -1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, md))


class Gemma4Router(nn.Module):
    """Top-k experts and their weights from the residual stream x [T, H]."""

    def __init__(self, config) -> None:
        super().__init__()
        h, e = config.hidden_size, int(config.num_experts)
        self.top_k = int(config.top_k_experts)
        self.norm = UnitRMSNorm(float(cfg_get(config, "rms_norm_eps", 1e-6)))
        self.proj = nn.Linear(h, e, bias=False)  # replicated: every rank routes alike
        self.scale = nn.Parameter(torch.ones(h))
        self.per_expert_scale = nn.Parameter(torch.ones(e))
        self.root = h**-0.5

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.norm(x) * self.scale * self.root
        probs = torch.softmax(self.proj(h).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[ids].float(), ids


class Gemma4Layer(nn.Module):
    def __init__(self, config, attn: Gemma4Attention, double_mlp: bool) -> None:
        super().__init__()
        d, eps = config.hidden_size, float(cfg_get(config, "rms_norm_eps", 1e-6))
        self.self_attn = attn
        mlp_config = config
        if double_mlp:
            mlp_config = copy.copy(config)
            mlp_config.intermediate_size = 2 * config.intermediate_size
        self.mlp = GemmaMLP(mlp_config)
        for name in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
            setattr(self, f"{name}_layernorm", Olmo2RMSNorm(d, eps))
        self.layer_scalar = nn.Parameter(torch.ones(1))
        self.moe = bool(getattr(config, "enable_moe_block", False))
        if self.moe:
            self.router = Gemma4Router(config)
            self.experts = FusedMoE(
                int(config.num_experts), d, int(config.moe_intermediate_size),
                activation=GELU_TANH,
            )  # fmt: skip
            for name in ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
                         "pre_feedforward_layernorm_2"):  # fmt: skip
                setattr(self, name, Olmo2RMSNorm(d, eps))
        ple = int(cfg_get(config, "hidden_size_per_layer_input", 0))
        self.ple = ple > 0
        if self.ple:
            self.per_layer_input_gate = nn.Linear(d, ple, bias=False)
            self.per_layer_projection = nn.Linear(ple, d, bias=False)
            self.post_per_layer_input_norm = Olmo2RMSNorm(d, eps)
            self.ple_act = get_act_fn(cfg_get(config, "hidden_activation", "gelu_pytorch_tanh"))

    def forward(self, positions, x, kv_cache, md, ple_input) -> torch.Tensor:  # x: [T, D]
        h = self.self_attn(positions, self.input_layernorm(x), kv_cache, md)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        if self.moe:
            weights, ids = self.router(x)
            moe = self.experts(self.pre_feedforward_layernorm_2(x), weights, ids)
            if self.experts.tp_size > 1:
                moe = tp_all_reduce(moe)
            moe = self.post_feedforward_layernorm_2(moe)
            h = self.post_feedforward_layernorm_1(h) + moe
        x = x + self.post_feedforward_layernorm(h)
        if self.ple:
            h = self.ple_act(self.per_layer_input_gate(x)) * ple_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(h))
        return x * self.layer_scalar


class Gemma4Model(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        d, eps = config.hidden_size, float(cfg_get(config, "rms_norm_eps", 1e-6))
        n = config.num_hidden_layers
        types = gemma_layer_types(config, 6)
        geometry = layer_geometry(config)
        sources = kv_sources(config)
        if any(s != i for i, s in enumerate(sources)) and get_parallel_state().pp_size > 1:
            raise ValueError(
                "Gemma 4 with num_kv_shared_layers > 0 does not support pipeline parallelism "
                "(a layer and the layer whose KV cache it reads must run on one stage)"
            )
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, d)
        # HF multiplies by sqrt(d) rounded to the weights' dtype (bf16: sqrt(3072) -> 55.5).
        self.register_buffer("embed_scale", torch.tensor(d**0.5), persistent=False)
        ropes: dict[tuple[str, int], RotaryEmbedding] = {}
        window = cfg_get(config, "sliding_window", None)
        double = bool(getattr(config, "use_double_wide_mlp", False))

        def build(i: int) -> Gemma4Layer:
            kind, (head_dim, kv_heads) = types[i], geometry[i]
            key = (kind, head_dim)
            if key not in ropes:
                ropes[key] = _rope(config, kind, head_dim)
            shared = sources[i] != i
            attn = Gemma4Attention(
                config,
                head_dim,
                kv_heads,
                ropes[key],
                window if kind == "sliding_attention" else None,
                kv_shared=shared,
            )
            return Gemma4Layer(config, attn, double and shared)

        self.layers, self.stage = make_layers(n, build)
        self.ropes = nn.ModuleList(ropes.values())  # registered once; the layers share them
        self.sources = sources
        for i, source in enumerate(sources):
            if source != i and self.stage.start <= i < self.stage.end:
                self.layers[i].self_attn.attn.set_kv_source(self.layers[source].self_attn.attn)
        self.norm = Olmo2RMSNorm(d, eps)
        self.ple_dim = int(cfg_get(config, "hidden_size_per_layer_input", 0))
        if self.ple_dim:
            p = self.ple_dim
            self.embed_tokens_per_layer = VocabParallelEmbedding(
                int(cfg_get(config, "vocab_size_per_layer_input", config.vocab_size)), n * p
            )
            self.register_buffer("ple_embed_scale", torch.tensor(p**0.5), persistent=False)
            self.per_layer_model_projection = nn.Linear(d, n * p, bias=False)
            self.per_layer_projection_norm = Olmo2RMSNorm(p, eps)
            self.pad_id = int(cfg_get(config, "pad_token_id", 0) or 0)  # images' per-layer rows

    def _ple_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[T, L, P]: the token's per-layer embedding and the projected embedding x."""
        t, p = x.shape[0], self.ple_dim
        tok = self.embed_tokens_per_layer(input_ids)
        tok = (tok * self.ple_embed_scale.to(tok.dtype)).view(t, -1, p)
        proj = self.per_layer_model_projection(x) * x.shape[-1] ** -0.5
        proj = self.per_layer_projection_norm(proj.view(t, -1, p))
        return (proj + tok) * 2**-0.5

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, D]
        """The scaled token embedding (HF's input embedding: prompt_embeds rows go after it)."""
        x = self.embed_tokens(input_ids)
        return x * self.embed_scale.to(x.dtype)

    def forward(self, input_ids, positions, kv_caches, md, hidden=None) -> torch.Tensor:
        # kv_caches: this stage's layers that compute their own KV, in layer order. A KV-shared
        # model has one stage (it refuses more), so a layer's source indexes it from 0.
        ple, x = None, hidden
        if hidden is None or self.ple_dim:  # every stage needs the per-layer inputs
            embedded = self.embed_input_ids(input_ids)
            if self.ple_dim and hidden is not None and self.stage.start == 0:
                ple = self._media_ple_inputs(input_ids, embedded, hidden)
            elif self.ple_dim:
                ple = self._ple_inputs(input_ids, embedded)
            x = embedded if hidden is None else hidden
        # Images' two-way rows (md.key_ends) apply to the sliding layers only: full ones causal
        causal = md if md.key_ends is None else dataclasses.replace(md, key_ends=None, plan=None)
        start = self.stage.start
        for i in range(start, self.stage.end):
            layer_ple = None if ple is None else ple[:, i]
            kv = kv_caches[self.sources[i] - start]
            layer_md = md if self.layers[i].self_attn.attn.sliding_window else causal
            x = self.layers[i](positions, x, kv, layer_md, layer_ple)
        return self.norm(x) if self.stage.is_last else x

    def _media_ple_inputs(
        self, input_ids: torch.Tensor, embedded: torch.Tensor, hidden: torch.Tensor
    ) -> torch.Tensor:
        """Per-layer inputs of a first stage given its input rows with image or audio features
        in (multimodal/gemma4.py, gemma4_audio.py; prompt_embeds never reach a model with
        per-layer inputs): as HF, a feature row (one that is not its token's embedding) takes
        the pad token's per-layer embedding, and every row projects the rows as given."""
        media = (hidden != embedded).any(-1)
        ids = torch.where(media, self.pad_id, input_ids)
        return self._ple_inputs(ids, hidden)


class Gemma4ForCausalLM(CausalLMBase):
    tie_default = True
    stacked_params = (
        *QKV_PROJ_RULES,
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    )
    ignored_weights = ("rotary_emb.inv_freq",)
    global_every = 6  # without config.layer_types, every 6th layer is a full one
    model_cls: type[Gemma4Model] = Gemma4Model  # the decoder stack (Gemma 4 Unified's differs)

    def __init__(self, config):
        if getattr(config, "use_bidirectional_attention", None) == "all":
            raise ValueError(
                "Gemma 4 with use_bidirectional_attention='all' (an encoder) is not supported"
            )
        super().__init__(config, type(self).model_cls(config))
        self.final_soft_cap = cfg_get(config, "final_logit_softcapping", None)
        # layers whose values are their key projection: k_eq_v's full layers
        k_eq_v = bool(getattr(config, "attention_k_eq_v", False))
        types = gemma_layer_types(config, 6)
        self.values_from_keys = {i for i, t in enumerate(types) if k_eq_v and t == "full_attention"}

    @classmethod
    def kv_cache_layout(cls, config) -> list[tuple[int, int]]:
        """(num_kv_heads, head_dim) of each layer that computes its own KV, in layer order."""
        sources = kv_sources(config, cls.global_every)
        return [(h, d) for i, (d, h) in enumerate(layer_geometry(config)) if sources[i] == i]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, V] fp32
        return soft_cap(super().compute_logits(hidden), self.final_soft_cap)

    def convert_weight(self, name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        layer = layer_index(name)
        if layer is None or ".self_attn." not in name:
            yield name, w
            return
        if self.model.sources[layer] != layer:  # KV-shared: queries only (HF ignores the rest)
            if ".self_attn.q_proj." in name:
                yield name.replace(".q_proj.", ".q_heads."), w
            elif ".self_attn.q_norm." in name or ".self_attn.o_proj." in name:
                yield name, w
            return
        yield name, w
        if layer in self.values_from_keys and ".k_proj." in name:
            yield name.replace(".k_proj.", ".v_proj."), w  # values are the key projection
