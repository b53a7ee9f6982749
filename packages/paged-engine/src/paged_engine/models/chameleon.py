"""Chameleon's decoder: the language model of `ChameleonForConditionalGeneration` (Meta's
Chameleon-7B / 30B), served as `ChameleonForCausalLM` (models/text_wrappers.py; its config is
flat, the decoder's fields at the top level beside vq_config and vocabulary_map).

Llama's decoder (grouped-query attention, NeoX RoPE, gated SiLU MLP, RMSNorms) with:
    qk-norm   q and k LayerNormed per head before RoPE: statistics over head_dim (eps fixed at
              1e-5), then an affine weight and bias of their own per head ([heads, head_dim]:
              HF's ChameleonLayerNorm; the release's per-shard norms repeated per head)
    swin_norm (config.swin_norm, Chameleon-30B's form) the norms move after each sublayer:
              x += input_layernorm(attn(x)); x += post_attention_layernorm(mlp(x))
    logits    the image tokens (vocabulary_map's "IMGIMG*" names) never come out: their logits
              are float32's lowest, as HF's forward and vLLM's compute_logits set them (the
              begin / end image sentinels stay), so text generation never emits an image code

Images (multimodal/chameleon.py) arrive as rows of this model's token embedding: the VQ-VAE's
codebook indices mapped to those image tokens' ids, looked up in the same table.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.layers.norm import HeadLayerNorm, RMSNorm
from paged_engine.layers.rotary import RotaryEmbedding
from paged_engine.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
)
from paged_engine.models.utils import CausalLMBase, cfg_get

IMAGE_TOKEN_PREFIX = "IMGIMG"  # vocabulary_map names of the image tokens
_QK_EPS = 1e-5  # HF's ChameleonLayerNorm ignores its eps argument
_DIGITS = {chr(ord("A") + i): str(i) for i in range(10)}  # "IMGIMG" names spell digits A-J


def image_token_ids(vocabulary_map: dict[str, int] | None) -> dict[int, int]:
    """VQ codebook index -> the token id of its image token, from the config's vocabulary_map:
    "IMGIMG" + the index's digits as letters A-J + one last character (dropped), as HF's
    ChameleonImageVocabularyMapping reads them; {} without a map."""
    out: dict[int, int] = {}
    for name, token in (vocabulary_map or {}).items():
        if name.startswith(IMAGE_TOKEN_PREFIX):
            digits = "".join(_DIGITS.get(c, c) for c in name[len(IMAGE_TOKEN_PREFIX) : -1])
            out[int(digits)] = int(token)
    return out


class QKHeadNorm(HeadLayerNorm):
    """HeadLayerNorm with a per-head bias too: y = layer_norm(x) * weight + bias over each
    head of x [T, H, D]; both [H_total, D] in the checkpoint, this rank's H rows loaded."""

    def __init__(self, num_heads: int, head_dim: int, shard: int) -> None:
        super().__init__(num_heads, head_dim, _QK_EPS, shard)
        self.bias = nn.Parameter(torch.zeros(num_heads, head_dim))
        self.bias.weight_loader = self._load

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, H, D]
        xf = x.float()
        if self.kernel is not None:
            y = self.kernel(xf, None, None, self.eps)
        else:
            y = F.layer_norm(xf, self.normalized_shape, None, None, self.eps)
        return (y * self.weight.float() + self.bias.float()).to(x.dtype)


class ChameleonAttention(LlamaAttention):
    """Llama's attention with QKHeadNorms on q and k (LlamaAttention's qk-norm path: each head
    normalized, then rotated)."""

    def __init__(self, config, layer_idx: int, flags: dict[str, bool], rope: RotaryEmbedding):
        super().__init__(config, layer_idx, {**flags, "qk_norm": False}, rope)
        proj = self.qkv_proj
        self.qk_norm = True
        self.q_norm = QKHeadNorm(proj.num_heads, self.head_dim, proj.tp_rank)
        kv_shard = proj.tp_rank // proj.kv_replicas  # k heads replicated past num_kv_heads
        self.k_norm = QKHeadNorm(proj.num_kv_heads, self.head_dim, kv_shard)


class ChameleonSwinDecoderLayer(nn.Module):
    """swin_norm's layer: each sublayer's output normalized before its residual add."""

    def __init__(self, config, layer_idx: int, flags: dict[str, bool], rope: RotaryEmbedding):
        super().__init__()
        eps = cfg_get(config, "rms_norm_eps", 1e-6)
        self.self_attn = ChameleonAttention(config, layer_idx, flags, rope)
        self.mlp = LlamaMLP(config, flags["mlp_bias"])
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(self, positions, x, kv_cache, md) -> torch.Tensor:  # x: [T, D]
        x = x + self.input_layernorm(self.self_attn(positions, x, kv_cache, md))
        return x + self.post_attention_layernorm(self.mlp(x))


class ChameleonForCausalLM(LlamaForCausalLM):
    def __init__(self, config: Any) -> None:
        flags = self.layer_flags(config)
        swin = bool(getattr(config, "swin_norm", False))

        def build(i: int, rope: RotaryEmbedding) -> nn.Module:
            if swin:
                return ChameleonSwinDecoderLayer(config, i, flags, rope)
            return LlamaDecoderLayer(config, i, flags, rope, attention_cls=ChameleonAttention)

        CausalLMBase.__init__(self, config, LlamaModel(config, flags, build))
        ids = sorted(image_token_ids(getattr(config, "vocabulary_map", None)).values())
        # the image tokens' ids (sorted): masked out of every logits row
        self.register_buffer("image_ids", torch.tensor(ids, dtype=torch.long), persistent=False)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, V] fp32
        logits = super().compute_logits(hidden)
        if self.image_ids.numel():
            logits.index_fill_(-1, self.image_ids, torch.finfo(logits.dtype).min)
        return logits
