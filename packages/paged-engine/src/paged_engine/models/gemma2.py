"""Gemma 2 (gemma-2-2b / 9b / 27b); its decoder is also Gemma 3's (models/gemma3.py) and, without
the post-norms, Gemma 1's (models/gemma.py).

Differences from Llama: RMSNorm scales by (1 + weight) in float32 (GemmaRMSNorm); the token
embedding is multiplied by sqrt(hidden_size) (in the model dtype, as HF does); four norms a layer
(x += post_attn_norm(attn(pre_norm(x))); x += post_ffw_norm(mlp(pre_ffw_norm(x)))); GeGLU MLP
(gelu tanh); attention scaled by query_pre_attn_scalar^-0.5 with tanh soft-capped scores; sliding
and global layers interleaved (config.layer_types); final logits soft-capped; tied embeddings.
"""

from __future__ import annotations

import torch
from torch import nn

from paged_engine.layers.activation import get_act_fn
from paged_engine.layers.attention import Attention, AttentionMetadata
from paged_engine.layers.embedding import VocabParallelEmbedding
from paged_engine.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from paged_engine.layers.norm import GemmaRMSNorm
from paged_engine.layers.rotary import RotaryEmbedding, get_rope
from paged_engine.models.utils import QKV_PROJ_RULES, CausalLMBase, cfg_get, make_layers, soft_cap


def gemma_layer_types(config, every: int) -> list[str]:
    """config.layer_types, else HF's older pattern: every `every`-th layer global."""
    types = getattr(config, "layer_types", None)
    if types is None:
        types = [
            "full_attention" if (i + 1) % every == 0 else "sliding_attention"
            for i in range(config.num_hidden_layers)
        ]
    if len(types) != config.num_hidden_layers:
        raise ValueError(
            f"config.layer_types has {len(types)} entries for {config.num_hidden_layers} layers"
        )
    bad = sorted(set(types) - {"full_attention", "sliding_attention"})
    if bad:
        raise ValueError(f"config.layer_types: unsupported layer types {bad}")
    return list(types)


def check_sliding_has_window(config, types: list[str], family: str) -> None:
    """Refuse sliding_attention layers without a sliding_window (transformers 5 cannot build
    their mask)."""
    if "sliding_attention" in types and cfg_get(config, "sliding_window", None) is None:
        raise ValueError(
            f"{family} with sliding_attention layers and sliding_window=None is not supported"
        )


def check_gemma_config(config) -> None:
    """Refuse what this decoder does not do (bidirectional attention: EmbeddingGemma)."""
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError(
            "config.use_bidirectional_attention=True (an embedding model) is not supported"
        )


class GemmaAttention(nn.Module):
    def __init__(
        self,
        config,
        sliding_window: int | None,
        rope: RotaryEmbedding,
        qk_norm: bool,
        soft_cap: float | None,
    ):
        super().__init__()
        hidden = config.hidden_size
        num_heads = config.num_attention_heads
        num_kv_heads = cfg_get(config, "num_key_value_heads", num_heads)
        head_dim = cfg_get(config, "head_dim", hidden // num_heads)
        bias = bool(getattr(config, "attention_bias", False))
        self.head_dim = head_dim
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, num_heads, num_kv_heads, bias=bias)
        local_heads, local_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = local_heads * head_dim, local_kv_heads * head_dim
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden, bias=bias)
        self.rotary_emb = rope  # shared by the layers of one rope (its tables are big)
        self.qk_norm = qk_norm
        if qk_norm:  # Gemma 3: per-head norms of q and k before RoPE
            eps = cfg_get(config, "rms_norm_eps", 1e-6)
            self.q_norm = GemmaRMSNorm(head_dim, eps)
            self.k_norm = GemmaRMSNorm(head_dim, eps)
        # Gemma 1 configs have no query_pre_attn_scalar: head_dim^-0.5, as HF's
        scalar = float(cfg_get(config, "query_pre_attn_scalar", head_dim))
        if not scalar > 0:
            raise ValueError(f"config.query_pre_attn_scalar={scalar!r} must be positive")
        self.attn = Attention(
            local_heads,
            head_dim,
            local_kv_heads,
            scalar**-0.5,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
        )

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        x: torch.Tensor,  # [T, D]
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        md: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        heads, kv_heads = self.q_size // self.head_dim, self.kv_size // self.head_dim
        norms = (self.q_norm, self.k_norm) if self.qk_norm else (None, None)
        write = self.attn.fused_kv_write(kv_cache, md)  # (None: the attention writes K/V)
        rotated = self.rotary_emb.rotate_qkv_(positions, qkv, heads, kv_heads, *norms, write)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if not rotated:  # (else one kernel normed and rotated q and k in place, and wrote K/V)
            if self.qk_norm:
                q = self.q_norm(q.reshape(t, -1, self.head_dim)).reshape(t, -1)
                k = self.k_norm(k.reshape(t, -1, self.head_dim)).reshape(t, -1)
            q, k = self.rotary_emb(positions, q, k)
        written = rotated and write is not None
        return self.o_proj(self.attn(q, k, v, kv_cache, md, kv_written=written))


class GemmaMLP(nn.Module):
    """down(act(gate(x)) * up(x)), act from config.hidden_activation (gelu tanh)."""

    def __init__(self, config):
        super().__init__()
        inter = config.intermediate_size
        field = "hidden_activation" if getattr(config, "hidden_activation", None) else "hidden_act"
        act = cfg_get(config, field, "gelu_pytorch_tanh")
        if field == "hidden_act" and act == "gelu":
            # The original Gemma configs' legacy "gelu" means the tanh approximation (what
            # transformers 5 rewrites it to, and what 4.x used without hidden_activation).
            act = "gelu_pytorch_tanh"
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [inter, inter], bias=False
        )
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=False)
        self.act_fn = get_act_fn(act, field)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, D] -> [T, D]
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


class GemmaDecoderLayer(nn.Module):
    """Gemma 2 / 3 (`post_norms`): four norms. Gemma 1: two, Llama's pre-norm layer, where HF's
    `post_attention_layernorm` is the norm before the MLP."""

    def __init__(
        self,
        config,
        sliding_window: int | None,
        rope: RotaryEmbedding,
        qk_norm: bool,
        soft_cap: float | None,
        post_norms: bool = True,
    ):
        super().__init__()
        eps = cfg_get(config, "rms_norm_eps", 1e-6)
        d = config.hidden_size
        self.self_attn = GemmaAttention(config, sliding_window, rope, qk_norm, soft_cap)
        self.mlp = GemmaMLP(config)
        self.input_layernorm = GemmaRMSNorm(d, eps)
        self.post_attention_layernorm = GemmaRMSNorm(d, eps)
        self.post_norms = post_norms
        if post_norms:
            self.pre_feedforward_layernorm = GemmaRMSNorm(d, eps)
            self.post_feedforward_layernorm = GemmaRMSNorm(d, eps)

    def forward(self, positions, x, kv_cache, md) -> torch.Tensor:  # x: [T, D]
        attn = self.self_attn(positions, self.input_layernorm(x), kv_cache, md)
        if not self.post_norms:
            x = x + attn
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.post_attention_layernorm(attn)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaModel(nn.Module):
    """The decoder stack; `ropes` maps each layer type to its rope (one shared instance each)."""

    def __init__(
        self,
        config,
        layer_types: list[str],
        ropes: dict[str, RotaryEmbedding],
        qk_norm: bool,
        soft_cap: float | None,
        post_norms: bool = True,
    ):
        super().__init__()
        d = config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, d)
        # HF multiplies by sqrt(d) rounded to the weights' dtype (bf16: sqrt(3072) -> 55.5).
        self.register_buffer(
            "embed_scale", torch.tensor(d**0.5, dtype=torch.float32), persistent=False
        )
        window = cfg_get(config, "sliding_window", None)

        def build(i: int) -> GemmaDecoderLayer:
            kind = layer_types[i]
            sliding = window if kind == "sliding_attention" else None
            return GemmaDecoderLayer(config, sliding, ropes[kind], qk_norm, soft_cap, post_norms)

        self.layers, self.stage = make_layers(config.num_hidden_layers, build)
        self.norm = GemmaRMSNorm(d, cfg_get(config, "rms_norm_eps", 1e-6))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, D]
        """The scaled token embedding (image rows spliced after it stay unscaled, as in HF)."""
        x = self.embed_tokens(input_ids)
        return x * self.embed_scale.to(x.dtype)

    def forward(self, input_ids, positions, kv_caches, md, hidden=None) -> torch.Tensor:
        # hidden: the previous stage's output or the input embeddings with images spliced in
        x = self.embed_input_ids(input_ids) if hidden is None else hidden
        for layer, kv_cache in zip(self.stage.layers(self.layers), kv_caches, strict=True):
            x = layer(positions, x, kv_cache, md)
        return self.norm(x) if self.stage.is_last else x


class Gemma2ForCausalLM(CausalLMBase):
    tie_default = True
    stacked_params = (
        *QKV_PROJ_RULES,
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    )
    ignored_weights = ("rotary_emb.inv_freq",)
    qk_norm = False
    post_norms = True  # the norms after attention and after the MLP (not Gemma 1's)
    bidirectional = False  # True: EmbeddingGemma's encoder (models/gemma3_encoder.py) runs it

    def __init__(self, config):
        if not self.bidirectional:
            check_gemma_config(config)
        types = self.layer_types(config)
        head_dim = cfg_get(config, "head_dim", config.hidden_size // config.num_attention_heads)
        inner = GemmaModel(
            config,
            types,
            self.make_ropes(config, head_dim, types),
            self.qk_norm,
            self.attn_soft_cap(config),
            self.post_norms,
        )
        super().__init__(config, inner)
        self.final_soft_cap = cfg_get(config, "final_logit_softcapping", None)

    @classmethod
    def layer_types(cls, config) -> list[str]:
        return gemma_layer_types(config, cls.global_layer_period(config))

    @classmethod
    def global_layer_period(cls, config) -> int:
        return 2  # configs without layer_types: every other layer global

    @classmethod
    def make_ropes(cls, config, head_dim: int, types: list[str]) -> dict[str, RotaryEmbedding]:
        rope = get_rope(config, head_dim, is_neox_style=True)
        return dict.fromkeys(set(types), rope)

    @classmethod
    def attn_soft_cap(cls, config) -> float | None:
        return cfg_get(config, "attn_logit_softcapping", None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, V] fp32
        return soft_cap(super().compute_logits(hidden), self.final_soft_cap)
