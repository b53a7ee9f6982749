"""StarCoder2 (`Starcoder2ForCausalLM`: StarCoder2-3B / 7B / 15B).

Mistral's decoder (grouped-query attention, full NeoX RoPE, every layer windowed by
`config.sliding_window`) with three changes: LayerNorms (weight and bias) instead of RMSNorms, a
non-gated MLP c_proj(act(c_fc(x))) (gelu_pytorch_tanh), and biases on q / k / v / o and on both
MLP projections when `use_bias` (the default). The LM head is tied by default.

The LayerNorm decoder layer and stack here also serve StableLM and Phi (models/stablelm.py,
models/phi.py): the Llama stack with LayerNorms, its MLP on the post-attention norm of the
residual, or (`parallel`) on the input norm beside attention.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from paged_engine.layers.activation import get_act_fn
from paged_engine.layers.attention import AttentionMetadata
from paged_engine.layers.linear import ColumnParallelLinear, RowParallelLinear
from paged_engine.layers.norm import LayerNorm
from paged_engine.layers.rotary import RotaryEmbedding
from paged_engine.models.llama import LlamaAttention, LlamaModel
from paged_engine.models.utils import QKV_PROJ_RULES, CausalLMBase, cfg_get


class Starcoder2MLP(nn.Module):
    """c_proj(act(c_fc(x))): column- then row-parallel, like GPT-2's MLP."""

    def __init__(self, config, bias: bool):
        super().__init__()
        d, inter = config.hidden_size, config.intermediate_size
        self.c_fc = ColumnParallelLinear(d, inter, bias=bias)
        self.c_proj = RowParallelLinear(inter, d, bias=bias)
        self.act = get_act_fn(cfg_get(config, "hidden_act", "gelu_pytorch_tanh"), "hidden_act")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, D] -> [T, D]
        return self.c_proj(self.act(self.c_fc(x)))


class LayerNormDecoderLayer(nn.Module):
    """Pre-LayerNorm decoder layer around any attention / MLP pair (HF's module names).

    sequential: x += attn(ln1(x)); x += mlp(ln2(x)).
    parallel:   x += attn(ln1(x)) + mlp(ln1(x)) (GPT-J style: no second norm).
    """

    def __init__(
        self, hidden: int, eps: float, self_attn: nn.Module, mlp: nn.Module, parallel: bool
    ):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = LayerNorm(hidden, eps=eps)
        self.post_attention_layernorm = None if parallel else LayerNorm(hidden, eps=eps)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,  # [T, D]
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        md: AttentionMetadata,
    ) -> torch.Tensor:
        h = self.input_layernorm(x)
        attn = self.self_attn(positions, h, kv_cache, md)
        if self.post_attention_layernorm is None:
            return x + attn + self.mlp(h)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x))


class LayerNormLlamaModel(LlamaModel):
    """The Llama stack (embed_tokens, layers, norm) with a LayerNorm as its final norm."""

    def __init__(
        self, config, eps: float, build_layer: Callable[[int, RotaryEmbedding], nn.Module]
    ):
        super().__init__(config, {}, build_layer)
        self.norm = LayerNorm(config.hidden_size, eps=eps)  # replaces Llama's RMSNorm


class Starcoder2ForCausalLM(CausalLMBase):
    tie_default = True
    stacked_params = QKV_PROJ_RULES
    ignored_weights = ("rotary_emb.inv_freq",)

    def __init__(self, config):
        bias = bool(cfg_get(config, "use_bias", True))
        eps = float(cfg_get(config, "norm_epsilon", 1e-5))
        flags = {"qkv_bias": bias, "o_bias": bias, "qk_norm": False, "sliding": True}

        def build(i: int, rope: RotaryEmbedding) -> nn.Module:
            attn = LlamaAttention(config, i, flags, rope)
            return LayerNormDecoderLayer(
                config.hidden_size, eps, attn, Starcoder2MLP(config, bias), parallel=False
            )

        super().__init__(config, LayerNormLlamaModel(config, eps, build))
