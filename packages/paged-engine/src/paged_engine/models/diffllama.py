"""DiffLlama (`DiffLlamaForCausalLM`): Llama with differential attention (arXiv 2410.05258).

Everything but the attention is Llama's (models/llama.py: pre-norm layers, gated MLP, NeoX
RoPE, GQA projections, `attention_bias` on q / k / v / o). Transformers' attention, per layer i
with H query heads, KV kv heads (KV even), head size D, m = KV / 2 and g = H / KV:

    o_h    = softmax(q_h K_{h//g}^T / sqrt(D)) [v_{(h//g) mod m} | v_{m + (h//g) mod m}]   [2D]
    d_h    = o_h - lambda * o_{h + H/2}                   for h < H/2
    lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init,  lambda_init = 0.8 - 0.6 e^(-0.3 i)
    out    = o_proj((1 - lambda_init) * rmsnorm(d_h) over its 2D entries, no weight)

so each query head's attention weights, taken against its own key head, average a pair of
value heads: the first half's and the second half's head at the same offset.

Here as ONE paged attention call over a cache of 2 * KV heads: cache head j < KV holds
(K_j, v_{j mod m}) and cache head KV + j holds (K_j, v_{m + j mod m}); the queries are the H
heads twice, so query head h reads cache head h // g and query head H + h reads cache head
KV + h // g (the same g). Its output [T, 2H, D] is o_h's two halves. Exact, any backend, CUDA
graphs and an fp8 cache included; the cost is a KV cache twice a Llama's of the same shape
(`kv_cache_layout`: every key is stored twice).

Refused by name: num_key_value_heads odd (transformers refuses it too), attention_dropout > 0,
tensor parallelism (a head's differential pairs it with the head H / 2 away, on another rank).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.distributed.parallel_state import get_parallel_state
from paged_engine.layers.attention import Attention, AttentionMetadata
from paged_engine.layers.rotary import RotaryEmbedding
from paged_engine.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    llama_head_dim,
)
from paged_engine.models.utils import cfg_get


def lambda_init(layer_idx: int) -> float:
    """The paper's depth schedule of lambda's offset (transformers' `lambda_init_fn`)."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer_idx)


def _check(config) -> None:
    kv_heads = cfg_get(config, "num_key_value_heads", None) or config.num_attention_heads
    if kv_heads % 2:
        raise ValueError(
            f"DiffLlama needs an even num_key_value_heads (its values split in two halves), "
            f"got {kv_heads}"
        )
    if float(cfg_get(config, "attention_dropout", 0.0) or 0.0) > 0:
        raise ValueError("DiffLlama's attention_dropout must be 0 (transformers refuses it too)")
    if get_parallel_state().tp_size > 1:
        raise ValueError(
            "DiffLlama is not served with tensor parallelism (tensor_parallel_size=1): each "
            "differential pairs a query head with the one num_attention_heads / 2 away"
        )


class DiffLlamaAttention(LlamaAttention):
    """Llama's projections plus lambda_q1 / lambda_k1 / lambda_q2 / lambda_k2 [D]; the paged
    attention runs over 2 * KV cache heads (module docstring)."""

    def __init__(
        self, config, layer_idx: int, flags: dict[str, bool], rope: RotaryEmbedding | None
    ):
        super().__init__(config, layer_idx, flags, rope)
        d = self.head_dim
        self.num_heads, self.num_kv_heads = self.q_size // d, self.kv_size // d
        self.lambda_init = lambda_init(layer_idx)
        self.eps = cfg_get(config, "rms_norm_eps", 1e-6)
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            setattr(self, name, nn.Parameter(torch.zeros(d)))
        self.attn = Attention(2 * self.num_heads, d, 2 * self.num_kv_heads, d**-0.5)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # each [blocks, block_size, 2 * KV, D]
        md: AttentionMetadata,
    ) -> torch.Tensor:
        t, d, h = x.shape[0], self.head_dim, self.num_heads
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        m = self.num_kv_heads // 2
        v = v.view(t, self.num_kv_heads, d)
        first, second = v[:, :m], v[:, m:]
        # cache heads [0, KV): (K_j, v_{j mod m}); [KV, 2 KV): (K_j, v_{m + j mod m})
        values = torch.cat((first, first, second, second), dim=1).reshape(t, -1)
        out = self.attn(torch.cat((q, q), dim=-1), torch.cat((k, k), dim=-1), values, kv_cache, md)
        out = out.view(t, 2, h, d)
        pair = torch.cat((out[:, 0], out[:, 1]), dim=-1)  # [T, H, 2D]: o_h
        lam = (
            torch.exp(torch.sum(self.lambda_q1 * self.lambda_k1, dtype=torch.float32))
            - torch.exp(torch.sum(self.lambda_q2 * self.lambda_k2, dtype=torch.float32))
            + self.lambda_init
        )
        diff = pair[:, : h // 2].float() - lam * pair[:, h // 2 :].float()  # [T, H/2, 2D]
        normed = F.rms_norm(diff, (2 * d,), eps=self.eps) * (1 - self.lambda_init)
        return self.o_proj(normed.to(x.dtype).reshape(t, h * d))


class DiffLlamaForCausalLM(LlamaForCausalLM):
    def __init__(self, config):
        _check(config)
        flags = self.layer_flags(config)

        def build(i: int, rope: RotaryEmbedding) -> nn.Module:
            return LlamaDecoderLayer(config, i, flags, rope, attention_cls=DiffLlamaAttention)

        super(LlamaForCausalLM, self).__init__(config, LlamaModel(config, flags, build))

    @classmethod
    def kv_cache_layout(cls, config) -> list[tuple[int, int]]:
        """Every layer caches 2 * num_key_value_heads heads (each key twice)."""
        kv_heads = cfg_get(config, "num_key_value_heads", None) or config.num_attention_heads
        return [(2 * int(kv_heads), llama_head_dim(config))] * config.num_hidden_layers
