"""Baichuan (remote code): Baichuan-7B (`BaiChuanForCausalLM`), Baichuan-13B and Baichuan2-7B /
13B (`BaichuanForCausalLM`), as vLLM's baichuan.py serves them.

The Llama decoder (RMSNorm, gated SiLU MLP, no biases, one KV head per head) with q, k and v
packed in `self_attn.W_pack` ([q | k | v] rows), split here into q_proj / k_proj / v_proj.
Which position encoding, as vLLM decides it (baichuan_config writes it as `position_embedding`):
- BaiChuanForCausalLM: rotary (NeoX halves, base rope_theta or 10000);
- BaichuanForCausalLM: rotary for hidden_size 4096 (Baichuan2-7B), else ALiBi (the 13B models,
  hidden_size 5120): no positions, the scaled scores biased by slope * (key - query position),
  BLOOM's slopes (models/bloom.py, the same geometric sequence Baichuan's `_get_interleave`
  builds, also for its 40 heads).
Baichuan2's NormHead: the LM head's rows are L2-normalized before the product; vLLM decides
"Baichuan2" by vocab_size 125696 and normalizes the rows at load, and so do we
(`normalized_head`). The context is max_position_embeddings, else model_max_length (the 13B
configs), else 4096.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from paged_engine.layers.rotary import RotaryEmbedding
from paged_engine.models.bloom import alibi_slopes, use_alibi
from paged_engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from paged_engine.models.remote_aliases import common_fields, field
from paged_engine.models.utils import CausalLMBase

BAICHUAN2_VOCAB = 125696  # vLLM's test for Baichuan2 (its NormHead)


def baichuan_config(raw: dict[str, Any]) -> PretrainedConfig:
    """Baichuan's config.json under the names models/llama.py reads, with the position
    encoding and head normalization vLLM derives."""
    hidden = field(raw, "hidden_size", int)
    heads = field(raw, "num_attention_heads", int)
    archs = raw.get("architectures") or []
    rope = "BaiChuanForCausalLM" in archs or hidden == 4096
    if field(raw, "hidden_act", str, "silu") != "silu":
        raise ValueError(f"config.json field 'hidden_act' must be silu, got {raw['hidden_act']!r}")
    vocab = field(raw, "vocab_size", int)
    fields = {
        **common_fields(raw),
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "num_hidden_layers": field(raw, "num_hidden_layers", int),
        "intermediate_size": field(raw, "intermediate_size", int),
        "rms_norm_eps": field(raw, "rms_norm_eps", float, 1e-6),
        "rope_theta": field(raw, "rope_theta", float, 10000.0),
        "max_position_embeddings": field(
            raw, "max_position_embeddings", int, field(raw, "model_max_length", int, 4096)
        ),
        "hidden_act": "silu",
        "tie_word_embeddings": field(raw, "tie_word_embeddings", bool, False),
        "position_embedding": "ROPE" if rope else "ALIBI",
        "normalized_head": vocab == BAICHUAN2_VOCAB,
    }
    config = PretrainedConfig(**fields)
    config.model_type = "baichuan"
    return config


class BaichuanForCausalLM(LlamaForCausalLM):
    def __init__(self, config) -> None:
        alibi = getattr(config, "position_embedding", "ROPE") == "ALIBI"
        if not alibi:
            super().__init__(config)
            return
        flags = self.layer_flags(config)
        slopes = alibi_slopes(config.num_attention_heads)

        def build(i: int, rope: RotaryEmbedding) -> nn.Module:  # ALiBi: the rope is unused
            layer = LlamaDecoderLayer(config, i, flags, None)  # Llama's attention, no positions
            layer.self_attn = use_alibi(layer.self_attn, slopes)
            return layer

        CausalLMBase.__init__(self, config, LlamaModel(config, flags, build))

    def convert_weight(self, name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if name == "lm_head.weight" and getattr(self.config, "normalized_head", False):
            yield name, nn.functional.normalize(w.float(), dim=-1).to(w.dtype)  # NormHead
            return
        if ".self_attn.W_pack." not in name:
            yield name, w
            return
        size = self.config.hidden_size
        if w.shape[0] != 3 * size:
            raise ValueError(f"{name}: {w.shape[0]} rows, expected 3 x {size}")
        for shard, part in zip("qkv", w.split(size), strict=True):
            yield name.replace(".W_pack.", f".{shard}_proj."), part
