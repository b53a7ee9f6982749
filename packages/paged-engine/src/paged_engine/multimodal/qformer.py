"""BLIP-2's Q-Former (transformers' Blip2QFormerModel, queries only): learned queries that
attend to each other and, every `cross_attention_frequency` layers, to an encoder's rows.

    queries [N, q, D] -> layernorm -> per layer: self-attention (BERT-style: q / k / v with
        biases, dense + residual + LayerNorm), cross-attention to the rows [N, r, E] (layers
        0, f, 2f, ...), the query feed-forward (intermediate_query / output_query) -> [N, q, D]

Its users: BLIP-2's image path (multimodal/blip2.py: the vision tower's rows) and Granite
Speech's projector (multimodal/granite_speech_encoder.py: windows of the conformer's rows).
Weight names are HF's under the user's `qformer.`; the text half of each layer (HF's
`intermediate.` / `output.`, built with use_qformer_text_input) is never built: queries never
run it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.layers.activation import get_act_fn


class QFormerAttention(nn.Module):
    """BERT-style attention (q / k / v with biases), then dense + residual + LayerNorm."""

    def __init__(self, p: Any, kv_dim: int) -> None:
        super().__init__()
        self.heads = p.num_attention_heads
        self.attention = nn.Module()
        self.attention.query = nn.Linear(p.hidden_size, p.hidden_size)
        self.attention.key = nn.Linear(kv_dim, p.hidden_size)
        self.attention.value = nn.Linear(kv_dim, p.hidden_size)
        self.output = nn.Module()
        self.output.dense = nn.Linear(p.hidden_size, p.hidden_size)
        self.output.LayerNorm = nn.LayerNorm(p.hidden_size, eps=p.layer_norm_eps)

    def forward(self, x: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        a = self.attention
        n, q_len, d = x.shape
        q = a.query(x).view(n, q_len, self.heads, -1).transpose(1, 2)
        k = a.key(kv).view(n, kv.shape[1], self.heads, -1).transpose(1, 2)
        v = a.value(kv).view(n, kv.shape[1], self.heads, -1).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, q_len, d)
        return self.output.LayerNorm(self.output.dense(o) + x)


class QFormerLayer(nn.Module):
    def __init__(self, p: Any, cross: bool) -> None:
        super().__init__()
        self.attention = QFormerAttention(p, p.hidden_size)
        self.crossattention = QFormerAttention(p, p.encoder_hidden_size) if cross else None
        self.intermediate_query = nn.Module()
        self.intermediate_query.dense = nn.Linear(p.hidden_size, p.intermediate_size)
        self.output_query = nn.Module()
        self.output_query.dense = nn.Linear(p.intermediate_size, p.hidden_size)
        self.output_query.LayerNorm = nn.LayerNorm(p.hidden_size, eps=p.layer_norm_eps)
        self.act = get_act_fn(p.hidden_act)

    def forward(self, x: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
        x = self.attention(x, x)
        if self.crossattention is not None:
            x = self.crossattention(x, windows)
        h = self.output_query.dense(self.act(self.intermediate_query.dense(x)))
        return self.output_query.LayerNorm(h + x)


class QFormer(nn.Module):
    """`queries` [N, q, D] attending to `windows` [N, r, encoder_hidden_size] -> [N, q, D]."""

    def __init__(self, p: Any) -> None:
        super().__init__()
        self.layernorm = nn.LayerNorm(p.hidden_size, eps=p.layer_norm_eps)
        self.encoder = nn.Module()
        every = p.cross_attention_frequency
        self.encoder.layer = nn.ModuleList(
            QFormerLayer(p, i % every == 0) for i in range(p.num_hidden_layers)
        )

    def forward(self, queries: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
        x = self.layernorm(queries)
        for layer in self.encoder.layer:
            x = layer(x, windows)
        return x
