"""XGLM (`XGLMForCausalLM`: facebook/xglm-564M ... 7.5B, the multilingual fairseq LMs).

BioGPT's decoder (models/biogpt.py `ScaledEmbeddingDecoder`: sqrt(d_model)-scaled token
embeddings, OPT's pre-LN layers, a final LayerNorm, a bias-free LM head tied by default) with a
fixed sinusoidal position table in place of a learned one: row p holds
sin(p * f_0..f_{h-1}) | cos(p * f_0..f_{h-1}) (halves, not interleaved), f_i =
exp(-i * ln(10000) / (h - 1)), h = d_model // 2; a zero column appended for an odd d_model; the
row `pad_token_id` all zeros (fairseq's padding row, which positions reach only when
pad_token_id >= 2, as in HF). Positions read 2 rows in, as BioGPT's and OPT's.

HF computes the table (a non-persistent buffer); the fairseq-converted checkpoints may still
carry `embed_positions._float_tensor` / `.weights`, which are ignored. Cross-attention layers
(`add_cross_attention`) are refused by name: nothing in a decoder-only engine feeds them.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from paged_engine.models.biogpt import ScaledEmbeddingDecoder, opt_view
from paged_engine.models.opt import POSITION_OFFSET
from paged_engine.models.utils import QKV_PROJ_RULES, CausalLMBase


def sinusoidal_table(rows: int, dim: int, padding_idx: int | None) -> torch.Tensor:
    """[rows, dim] fairseq / tensor2tensor sinusoids (HF XGLM's `get_embedding`): computed in
    float32, returned in the default dtype (the model's, while the loader builds it)."""
    half = dim // 2
    freq = torch.exp(torch.arange(half, dtype=torch.float32) * -(math.log(10000) / (half - 1)))
    angles = torch.arange(rows, dtype=torch.float32)[:, None] * freq[None, :]  # [rows, half]
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
    if dim % 2:
        table = torch.cat([table, torch.zeros(rows, 1)], dim=1)
    if padding_idx is not None:
        table[padding_idx] = 0
    return table.to(torch.get_default_dtype())


class SinusoidalPositions(nn.Module):
    """Rows of a fixed sinusoidal table; a buffer, so it follows the model's device and dtype."""

    def __init__(self, rows: int, dim: int, padding_idx: int | None):
        super().__init__()
        self.register_buffer("table", sinusoidal_table(rows, dim, padding_idx), persistent=False)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:  # [T] -> [T, dim]
        return self.table[rows]


class XGLMForCausalLM(CausalLMBase):
    tie_default = True
    stacked_params = QKV_PROJ_RULES
    ignored_weights = ("embed_positions._float_tensor", "embed_positions.weights")

    def __init__(self, config):
        if getattr(config, "add_cross_attention", False):
            raise ValueError(
                "XGLM: add_cross_attention=True is not supported (no encoder feeds it here)"
            )
        view = opt_view(config, config.ffn_dim, config.activation_function)
        rows = config.max_position_embeddings + POSITION_OFFSET
        table = SinusoidalPositions(rows, config.hidden_size, config.pad_token_id)
        super().__init__(config, ScaledEmbeddingDecoder(config, view, table))
