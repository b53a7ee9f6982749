"""`Gemma3TextModel` with `use_bidirectional_attention=True` (EmbeddingGemma,
google/embeddinggemma-300m): Gemma 3's text decoder run as an encoder.

The layers, weights and arithmetic are paged's causal Gemma 3 (models/gemma3.py through the
headless base-model class of models/base_model.py: scaled token embedding, q / k norms, one rope
per layer type, four norms a layer, GeGLU); only each layer's paged `Attention` is swapped for
`BidirectionalAttention`, which attends each sequence over all of itself, as the BERT encoders
do (models/bert.py `encoder_attention`), so the engine treats the model as an encoder
(engine/encoder.py: one step per sequence, no KV cache, pooling only).

Sliding layers stay windowed, in both directions. transformers' config halves the saved window
(`sliding_window = saved // 2 + 1`, an exclusive bound) and its mask lets position i see j when
|i - j| < sliding_window; vLLM hands the same value to an ENCODER_ONLY attention as the window
(sliding_window - 1, sliding_window - 1). Both: |i - j| <= sliding_window - 1 (= saved // 2).
Full layers see the whole sequence.

Pooling, when the model directory has no sentence-transformers files: the last token,
normalized, as vLLM pools `Gemma3TextModel` (EmbeddingGemma's own files say mean, then its
Dense modules: models/st_modules.py, then normalize).
"""

from __future__ import annotations

import functools
from typing import ClassVar

import torch
from torch import nn

from paged_engine.layers.attention import Attention, AttentionMetadata
from paged_engine.models.bert import encoder_attention, sequence_bounds


class BidirectionalAttention(nn.Module):
    """A drop-in for a Gemma layer's paged `Attention` (the same call) attending each sequence
    of the step over all of itself, within `window` positions either side when windowed. It
    keeps no cache and writes none."""

    def __init__(self, causal: Attention) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = causal.num_heads, causal.num_kv_heads
        self.head_dim, self.scale = causal.head_dim, causal.scale
        # the causal layer's window is HF's exclusive bound: |i - j| < window
        self.window = None if causal.sliding_window is None else int(causal.sliding_window) - 1

    def fused_kv_write(self, kv_cache, attn_metadata: AttentionMetadata) -> None:
        return None  # no cache: the rope kernel only norms and rotates q and k in place

    def forward(
        self,
        q: torch.Tensor,  # [T, heads * d], normed and rotated
        k: torch.Tensor,  # [T, kv_heads * d]
        v: torch.Tensor,
        kv_cache,
        attn_metadata: AttentionMetadata,
        kv_written: bool = False,
    ) -> torch.Tensor:  # [T, heads * d]
        t, group = q.shape[0], self.num_heads // self.num_kv_heads
        q, k, v = (
            x.reshape(t, -1, self.head_dim).transpose(0, 1) for x in (q, k, v)
        )  # [heads, T, d]
        if group > 1:  # each kv head serves `group` consecutive query heads
            k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        bounds = sequence_bounds(attn_metadata)
        out = encoder_attention(q, k, v, bounds, self.window, self.scale)
        return out.transpose(0, 1).reshape(t, -1)


class NoCacheEncoder:
    """Mixin (before the model's base class): the engine runs the model as an encoder
    (engine/encoder.py: one step per sequence, pooling only) and gives its layers no cache."""

    is_encoder: ClassVar[bool] = True

    @staticmethod
    def max_positions(config) -> int:
        return int(config.max_position_embeddings)

    @staticmethod
    def kv_cache_layout(config) -> list[tuple[int, int]]:
        return []  # no layer caches: the engine's blocks only count tokens


class BidirectionalDecoder(NoCacheEncoder):
    """Mixin (before a headless decoder class, models/base_model.py): every layer's paged
    `Attention` (`model.layers[i].self_attn.attn`) swapped for `BidirectionalAttention`, the
    stack run with no caches."""

    def __init__(self, config) -> None:
        super().__init__(config)
        for layer in self.model.layers:
            layer.self_attn.attn = BidirectionalAttention(layer.self_attn.attn)

    def forward(self, input_ids, positions, kv_caches, attn_metadata, hidden=None):
        # the engine hands an encoder no caches; the decoder stack takes one entry a layer
        none = [(None, None)] * len(self.model.layers)
        return super().forward(input_ids, positions, none, attn_metadata, hidden)


@functools.cache
def bidirectional_gemma3(base: type[nn.Module]) -> type[nn.Module]:
    """The encoder class over `base`, the headless Gemma 3 class (models/base_model.py)."""

    class Gemma3TextEncoder(BidirectionalDecoder, base):  # type: ignore[misc, valid-type]
        bidirectional = True  # (Gemma2ForCausalLM then accepts use_bidirectional_attention)
        default_pooler_config: ClassVar[dict] = {"pooling_type": "LAST", "normalize": True}

    Gemma3TextEncoder.__name__ = Gemma3TextEncoder.__qualname__ = "Gemma3TextModel"
    return Gemma3TextEncoder
