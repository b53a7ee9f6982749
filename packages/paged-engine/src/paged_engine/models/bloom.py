"""BLOOM (`BloomForCausalLM`: BLOOM-560m ... 176B, BLOOMZ).

Falcon-RW's decoder (models/falcon.py) before it: multi-head attention on one fused
`query_key_value` with per-head rows [H, q|k|v, D], ALiBi instead of positions, LayerNorms with
biases, biases on every linear layer, a non-gated GELU MLP (tanh approximation, 4 x hidden) and a
sequential pre-norm layer; plus a LayerNorm on the token embedding (`word_embeddings_layernorm`).
HF adds the ALiBi bias after scaling q.k by 1 / sqrt(head_dim), so the slopes are the paper's,
in float32. The LM head is tied. Checkpoints saved from the bare model name weights without the
`transformer.` prefix (bigscience/bloom-560m); both load.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch

from paged_engine.checkpoint_checks import check_heads_divide
from paged_engine.layers.attention import Attention
from paged_engine.layers.norm import LayerNorm
from paged_engine.layers.rotary import RotaryEmbedding
from paged_engine.models.llama import LlamaAttention, run_layers
from paged_engine.models.starcoder2 import (
    LayerNormDecoderLayer,
    LayerNormLlamaModel,
    Starcoder2MLP,
)
from paged_engine.models.utils import QKV_PROJ_RULES, CausalLMBase, cfg_get

# (HF's name fragment, ours), applied in order, after the `transformer.` prefix is made explicit
_RENAMES = (
    ("transformer.word_embeddings_layernorm.", "model.embed_layernorm."),
    ("transformer.word_embeddings.", "model.embed_tokens."),
    ("transformer.h.", "model.layers."),
    ("transformer.ln_f.", "model.norm."),
    (".self_attention.dense.", ".self_attn.o_proj."),
    (".self_attention.", ".self_attn."),
    (".mlp.dense_h_to_4h.", ".mlp.c_fc."),
    (".mlp.dense_4h_to_h.", ".mlp.c_proj."),
)


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """The ALiBi paper's head slopes (BLOOM's, MPT's with max bias 8): a geometric sequence from
    2^(-8/n) for the largest power of two n <= num_heads, then every other slope of 2n's
    sequence for the heads past n. [num_heads] float32."""
    closest = 2 ** (num_heads.bit_length() - 1)
    base = 2.0 ** (-8.0 / closest)
    slopes = [base ** (i + 1) for i in range(closest)]
    extra = 2.0 ** (-4.0 / closest)  # 2n's base: 2^(-8 / 2n)
    slopes += [extra ** (2 * i + 1) for i in range(min(closest, num_heads - closest))]
    return torch.tensor(slopes, dtype=torch.float32)


def use_alibi(
    attn: LlamaAttention, slopes: torch.Tensor, scale: float | None = None
) -> LlamaAttention:
    """`attn` with ALiBi in place of positions: its inner attention biased by this rank's heads'
    `slopes` (of all heads, [num_heads]); scores scaled by `scale` (1 / sqrt(head_dim))."""
    proj, head_dim = attn.qkv_proj, attn.head_dim
    first = proj.tp_rank * proj.num_heads
    attn.attn = Attention(
        proj.num_heads,
        head_dim,
        proj.num_kv_heads,
        head_dim**-0.5 if scale is None else scale,
        alibi_slopes=slopes[first : first + proj.num_heads],
    )
    return attn


def per_head_qkv(w: torch.Tensor, heads: int) -> tuple[torch.Tensor, ...]:
    """A fused multi-head query_key_value weight or bias, rows [H, q|k|v, D] (BLOOM's,
    Falcon-RW's), as (q, k, v), each [H * D, ...]."""
    rows = w.reshape(heads, 3, -1, *w.shape[1:])
    return tuple(rows[:, i].reshape(-1, *w.shape[1:]) for i in range(3))


class BloomModel(LayerNormLlamaModel):
    """The LayerNorm stack without positions (its rotary instance is never used), with BLOOM's
    LayerNorm on the token embedding when `embed_norm` (MPT has none)."""

    def __init__(self, config, eps: float, build_layer, embed_norm: bool = True):
        super().__init__(config, eps, build_layer)
        self.embed_layernorm = LayerNorm(config.hidden_size, eps=eps) if embed_norm else None

    def forward(self, input_ids, positions, kv_caches, md, hidden=None) -> torch.Tensor:
        if hidden is None:  # first pipeline stage
            hidden = self.embed_tokens(input_ids)  # [T, D]
            if self.embed_layernorm is not None:
                hidden = self.embed_layernorm(hidden)
        layers = list(self.stage.layers(self.layers))
        norm = self.norm if self.stage.is_last else None
        return run_layers(layers, self.stream_apart, positions, hidden, kv_caches, md, norm)


class BloomForCausalLM(CausalLMBase):
    renames = _RENAMES
    tie_default = True
    stacked_params = QKV_PROJ_RULES

    def __init__(self, config):
        if cfg_get(config, "apply_residual_connection_post_layernorm", False):
            raise ValueError(
                "BLOOM with apply_residual_connection_post_layernorm=True (the residual taken "
                "after the LayerNorm) is not supported; no released checkpoint sets it"
            )
        check_heads_divide(config.hidden_size, config.num_attention_heads, "hidden_size", "n_head")
        view = copy.copy(config)  # Llama's names for the shared modules
        view.num_key_value_heads = config.num_attention_heads
        view.intermediate_size = 4 * config.hidden_size
        view.hidden_act = "gelu_pytorch_tanh"
        view.max_position_embeddings = 2048  # sizes the unused rotary table only
        eps = float(cfg_get(config, "layer_norm_epsilon", 1e-5))
        flags = {"qkv_bias": True, "o_bias": True, "qk_norm": False, "sliding": False}
        slopes = alibi_slopes(config.num_attention_heads)

        def build(i: int, rope: RotaryEmbedding) -> LayerNormDecoderLayer:
            attn = use_alibi(LlamaAttention(view, i, flags, None), slopes)
            mlp = Starcoder2MLP(view, True)
            return LayerNormDecoderLayer(config.hidden_size, eps, attn, mlp, parallel=False)

        super().__init__(config, BloomModel(view, eps, build))

    def rename_weight(self, name: str) -> str:
        if not name.startswith(("transformer.", "lm_head.")):
            name = "transformer." + name
        return super().rename_weight(name)

    def convert_weight(self, name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if ".self_attn.query_key_value." not in name:
            yield name, w
            return
        q, k, v = per_head_qkv(w, self.config.num_attention_heads)
        for shard, part in zip("qkv", (q, k, v), strict=True):
            yield name.replace(".query_key_value.", f".{shard}_proj."), part
