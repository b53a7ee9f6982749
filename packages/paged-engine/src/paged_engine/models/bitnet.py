"""Microsoft BitNet b1.58 (`BitNetForCausalLM`, model_type "bitnet": bitnet-b1.58-2B-4T).

Llama's decoder (models/llama.py) with two sub-norms and squared ReLU, as transformers runs it:
a Llama RMSNorm (weighted, of rms_norm_eps) on the attention output before o_proj
(`attn_sub_norm`) and on act(gate) * up before down_proj (`ffn_sub_norm`); the MLP's activation
is `hidden_act` ("relu2"). Under tensor parallelism both sub-norms see this rank's slice of
their dimension and add their squares over the ranks.

Without a quantization_config the linear layers are plain (HF's model as built from a config).
With the one the released bf16 master weights carry (microsoft/bitnet-b1.58-2B-4T-bf16:
quant_method "bitnet", linear_class "autobitlinear", quantization_mode "online") transformers
swaps every decoder linear layer for an AutoBitLinear, and so does this model:

    weights      ternarized per tensor (q, k, v, o, gate, up, down each): s = 1 / mean(|W|)
                 (at least 1e-5), W = clamp(round(W * s), -1, 1) / s in float32, rounded to
                 the model dtype; computed once here as the weights load (HF: every forward)
    activations  every linear layer's input per token to 8 bits: s = 127 / max(|x|) (max at
                 least 1e-5), x = clamp(round(x * s), -128, 127) / s in float32 (the max over
                 all ranks where the input is sharded: o_proj's, down_proj's)

The packed release (microsoft/bitnet-b1.58-2B-4T: linear_class "bitlinear", quantization_mode
"offline") stores each of those weights as 2-bit codes four rows a byte with a per-tensor
`weight_scale`; transformers' BitLinear computes (8-bit x) @ codes^T / weight_scale. The loader
unpacks them to codes / weight_scale in the model dtype (quantized_checkpoint.unpack_ternary)
and they run as the online ones do, without the ternarization (they are ternary already).

The LM head and the embedding stay in the model dtype. Refused by name: other linear_class /
quantization_mode pairs, `use_rms_norm`, and `modules_to_not_convert`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from paged_engine.distributed.communication import tp_all_reduce, tp_all_reduce_max
from paged_engine.layers.norm import RMSNorm
from paged_engine.layers.rotary import RotaryEmbedding
from paged_engine.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
)
from paged_engine.models.utils import CausalLMBase, cfg_get, layer_index

# The decoder's linear layers HF's quantizer replaces (all of them: the LM head is its default
# skip), by their checkpoint names.
_BIT_LINEARS = (
    ".self_attn.q_proj.weight",
    ".self_attn.k_proj.weight",
    ".self_attn.v_proj.weight",
    ".self_attn.o_proj.weight",
    ".mlp.gate_proj.weight",
    ".mlp.up_proj.weight",
    ".mlp.down_proj.weight",
)


def _get(obj, key: str, default=None):
    return obj.get(key, default) if isinstance(obj, dict) else getattr(obj, key, default)


def bitnet_mode(config) -> str | None:
    """How the checkpoint's linear layers run: None (plain; no quantization_config), "online"
    (the bf16 masters: ternarized at load) or "packed" (ternary codes with a scale). Raises
    ValueError naming what is refused."""
    quant = getattr(config, "quantization_config", None)
    if quant is None:
        return None
    if _get(quant, "quant_method") != "bitnet":
        raise ValueError(
            f"BitNetForCausalLM: quantization_config.quant_method={_get(quant, 'quant_method')!r}"
            " is not supported (only 'bitnet')"
        )
    linear_class = _get(quant, "linear_class", "bitlinear")
    mode = _get(quant, "quantization_mode", "offline")
    modes = {("autobitlinear", "online"): "online", ("bitlinear", "offline"): "packed"}
    if (linear_class, mode) not in modes:
        raise ValueError(
            f"BitNetForCausalLM: quantization_config linear_class={linear_class!r}, "
            f"quantization_mode={mode!r} is not supported: the packed checkpoints ('bitlinear', "
            "'offline') and the bf16 master weights ('autobitlinear', 'online') are"
        )
    if _get(quant, "use_rms_norm", False):
        raise ValueError(
            "BitNetForCausalLM: quantization_config.use_rms_norm=True is not supported"
        )
    if _get(quant, "modules_to_not_convert") is not None:
        raise ValueError(
            "BitNetForCausalLM: quantization_config.modules_to_not_convert is not supported"
        )
    return modes[(linear_class, mode)]


def ternarize(w: torch.Tensor) -> torch.Tensor:
    """HF's WeightQuant: W's absmean ternary form, float32 (the caller rounds it)."""
    w = w.float()
    scale = 1.0 / w.abs().mean().clamp(min=1e-5)
    return (w * scale).round().clamp(-1, 1) / scale


def quantize_activations(x: torch.Tensor, sharded: bool = False) -> torch.Tensor:  # [T, K]
    """HF's ActQuant: x to 8 bits per token (row), back in x's dtype; `sharded`: x is this
    rank's slice of the row (the row's max runs over every rank)."""
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)
    if sharded:
        amax = tp_all_reduce_max(amax)
    scale = 127 / amax.clamp(min=1e-5)
    return ((xf * scale).round().clamp(-128, 127) / scale).to(x.dtype)


class SubNorm(RMSNorm):
    """A Llama RMSNorm over a dimension that tensor parallelism splits: this rank holds
    [shard * local, (shard + 1) * local) of it and of the weight."""

    def __init__(self, full: int, local: int, eps: float, shard: int) -> None:
        super().__init__(local, eps)
        self.full, self.shard = full, shard
        self.weight.weight_loader = self._load

    def _load(self, param: nn.Parameter, w: torch.Tensor, shard_id=None) -> None:
        n = param.shape[0]
        if tuple(w.shape) != (self.full,):
            raise ValueError(f"expected [{self.full}], got {tuple(w.shape)}")
        param.data.copy_(w[self.shard * n : (self.shard + 1) * n])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, local]
        if x.shape[-1] == self.full:
            return super().forward(x)
        xf = x.float()
        var = tp_all_reduce(xf.pow(2).sum(-1, keepdim=True)) / self.full
        return self.weight * (xf * torch.rsqrt(var + self.eps)).to(x.dtype)


class BitNetAttention(LlamaAttention):
    """Llama's attention with `attn_sub_norm` before o_proj (and, quantized, 8-bit inputs to
    qkv_proj and o_proj)."""

    def __init__(self, config, layer_idx: int, flags: dict[str, bool], rope: RotaryEmbedding):
        super().__init__(config, layer_idx, flags, rope)
        eps = float(cfg_get(config, "rms_norm_eps", 1e-5))
        full = config.num_attention_heads * self.head_dim
        self.attn_sub_norm = SubNorm(full, self.q_size, eps, self.qkv_proj.tp_rank)
        self.quantized = bitnet_mode(config) is not None
        self.sharded = self.qkv_proj.tp_size > 1

    def forward(self, positions, x, kv_cache, md) -> torch.Tensor:  # x: [T, D]
        if self.quantized:
            x = quantize_activations(x)
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn_sub_norm(self.attn(q, k, v, kv_cache, md))
        if self.quantized:
            out = quantize_activations(out, self.sharded)
        return self.o_proj(out)


class BitNetMLP(LlamaMLP):
    """down(ffn_sub_norm(act(gate(x)) * up(x))) (and, quantized, 8-bit inputs)."""

    def __init__(self, config) -> None:
        super().__init__(config, bias=False)
        eps = float(cfg_get(config, "rms_norm_eps", 1e-5))
        local, shard = self.down_proj.in_local, self.down_proj.tp_rank
        self.ffn_sub_norm = SubNorm(config.intermediate_size, local, eps, shard)
        self.quantized = bitnet_mode(config) is not None
        self.sharded = self.down_proj.tp_size > 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, D] -> [T, D]
        if self.quantized:
            x = quantize_activations(x)
        h = self.ffn_sub_norm(self.act_fn(self.gate_up_proj(x)))
        if self.quantized:
            h = quantize_activations(h, self.sharded)
        return self.down_proj(h)


class BitNetDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config, layer_idx: int, flags: dict[str, bool], rope: RotaryEmbedding):
        super().__init__(config, layer_idx, flags, rope, BitNetAttention)
        self.mlp = BitNetMLP(config)


class BitNetForCausalLM(LlamaForCausalLM):
    checkpoint_quantizations = ("bitnet",)

    def __init__(self, config) -> None:
        flags = self.layer_flags(config)
        self.online = bitnet_mode(config) == "online"
        inner = LlamaModel(
            config, flags, lambda i, rope: BitNetDecoderLayer(config, i, flags, rope)
        )
        CausalLMBase.__init__(self, config, inner)

    def convert_weight(self, name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if self.online and layer_index(name) is not None and name.endswith(_BIT_LINEARS):
            # HF ternarizes the weight as loaded into the model dtype
            w = ternarize(w.to(self.model.embed_tokens.weight.dtype))
        return super().convert_weight(name, w)

    def convert_lora_b(self, name: str, b: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        return ((name, b),)  # an adapter's B is not ternarized
