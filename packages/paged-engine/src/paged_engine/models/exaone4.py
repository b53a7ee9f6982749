"""LG AI EXAONE 4.0 (`Exaone4ForCausalLM`: EXAONE-4.0-1.2B / 32B, EXAONE-4.0.1-32B).

The Llama decoder's projections, gated SiLU MLP and GQA, with three changes:

    post-norms   norms after the sublayers instead of before them (OLMo 2's placement):
                 x += post_attention_layernorm(attn(x)); x += post_feedforward_layernorm(mlp(x)),
                 Llama's RMSNorm (the weight multiplies the normalized x rounded to its dtype)
    q/k norms    per-head RMSNorms on q and k after the projection (Qwen3's), in every layer
    hybrid       with a `sliding_window`, the `sliding_attention` layers of config.layer_types
                 (3 of 4 in the 32B model, "LLLG") see only the last sliding_window keys
                 (themselves included) and rotate q and k; the `full_attention` layers see the
                 whole context without any positional encoding (NoPE). Without a window
                 (the 1.2B model) every layer is global and rotates.

One rope for all the rotating layers (Llama 3's scaling in the released checkpoints). Checkpoints
use Llama's names plus `self_attn.{q,k}_norm` and `post_feedforward_layernorm`; the 1.2B model
ties its head to the embedding.
"""

from __future__ import annotations

import torch
from torch import nn

from paged_engine.layers.norm import RMSNorm
from paged_engine.layers.rotary import RotaryEmbedding
from paged_engine.models.gemma2 import gemma_layer_types
from paged_engine.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel
from paged_engine.models.olmo2 import Olmo2DecoderLayer
from paged_engine.models.utils import CausalLMBase, cfg_get


class Exaone4Attention(LlamaAttention):
    """Llama's attention with per-head q/k norms, which a NoPE layer (`rope` None) applies too."""

    def forward(self, positions, x, kv_cache, md) -> torch.Tensor:  # x: [T, D]
        if self.rotary_emb is not None:
            return super().forward(positions, x, kv_cache, md)
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(t, -1, self.head_dim)).reshape(t, -1)
        k = self.k_norm(k.reshape(t, -1, self.head_dim)).reshape(t, -1)
        return self.o_proj(self.attn(q, k, v, kv_cache, md))


class Exaone4DecoderLayer(Olmo2DecoderLayer):
    """OLMo 2's post-norm layer (its forward) around Exaone4Attention, with Llama's RMSNorms.
    `sliding_window` None attends to the whole context."""

    def __init__(
        self,
        config,
        layer_idx: int,
        flags: dict[str, bool],
        rope: RotaryEmbedding | None,
        sliding_window: int | None,
    ) -> None:
        nn.Module.__init__(self)
        eps = cfg_get(config, "rms_norm_eps", 1e-5)
        self.self_attn = Exaone4Attention(config, layer_idx, flags, rope)
        self.self_attn.attn.sliding_window = sliding_window
        self.mlp = LlamaMLP(config, flags["mlp_bias"])
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps)


def exaone4_layers(config) -> list[tuple[int | None, bool]]:
    """Each layer's (sliding window or None, whether it rotates q and k), as HF decides them:
    config.layer_types (transformers fills it from `sliding_window_pattern`), and RoPE on every
    layer without a window, else on the sliding layers only."""
    window = cfg_get(config, "sliding_window", None)
    if window is None:
        return [(None, True)] * config.num_hidden_layers
    pattern = cfg_get(config, "sliding_window_pattern", 4)
    types = gemma_layer_types(config, every=pattern if isinstance(pattern, int) else 4)
    sliding = [t == "sliding_attention" for t in types]
    return [(int(window) if s and window else None, s) for s in sliding]


class Exaone4ForCausalLM(LlamaForCausalLM):
    def __init__(self, config) -> None:
        flags = self.layer_flags(config)
        layers = exaone4_layers(config)

        def build(i: int, rope: RotaryEmbedding) -> Exaone4DecoderLayer:
            window, rotates = layers[i]
            return Exaone4DecoderLayer(config, i, flags, rope if rotates else None, window)

        CausalLMBase.__init__(self, config, LlamaModel(config, flags, build))

    @classmethod
    def layer_flags(cls, config) -> dict[str, bool]:
        # windows per layer from exaone4_layers (set on each layer's attention); no biases:
        # config_ignored.py sets attention_bias / mlp_bias, which HF's EXAONE 4 never reads
        return {**LlamaForCausalLM.layer_flags(config), "qk_norm": True}
