"""Checkpoints that are Llama's decoder under other names or with one switch, as vLLM serves
them (its registry maps the same architectures to its Llama):

    ExaoneForCausalLM      LG EXAONE 3.0 / 3.5: Llama under GPT-2-style names (transformer.h.N
                           .attn.attention.*, ln_1 / ln_2, mlp.c_fc_0 / c_fc_1 / c_proj),
                           renamed at load as transformers does for model_type "exaone"
    InternLMForCausalLM    InternLM (v1): q / k / v / o biases from the config's `bias`
    CwmForCausalLM         Meta CWM: no biases, the `sliding_window` on the layers
                           `layer_types` calls "sliding_attention" (HF's CwmForCausalLM)
    MiMoForCausalLM        Xiaomi MiMo: Qwen2's decoder; its multi-token-prediction layers
                           (`model.mtp_layers.*`) are skipped here ({"method": "mtp"} runs the
                           first as a draft head: models/mimo_mtp.py)
    InternLM2ForCausalLM   InternLM2 / 2.5: q, k and v packed per KV head in `wqkv` ([q x group,
                           k, v] a head group), InternLM's own tensor names; biases from `bias`
    MiniCPMForCausalLM     MiniCPM 1 / 2 / 4 (dense): Granite's scalars under MiniCPM's names,
                           the embedding times `scale_emb`, residual adds times
                           scale_depth / sqrt(num_hidden_layers), the logits divided by
                           hidden_size / dim_model_base
    LLaMAForCausalLM, AquilaForCausalLM / AquilaModel, XverseForCausalLM: Llama itself
                           (models/__init__.py maps the names)
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch

from paged_engine.models.granite import GraniteForCausalLM
from paged_engine.models.llama import LlamaForCausalLM, llama_head_dim
from paged_engine.models.minicpm3 import minicpm_scalars
from paged_engine.models.qwen2 import Qwen2ForCausalLM
from paged_engine.models.utils import cfg_get


class ExaoneForCausalLM(LlamaForCausalLM):
    renames = (
        ("transformer.wte.", "model.embed_tokens."),
        ("transformer.h.", "model.layers."),
        ("transformer.ln_f.", "model.norm."),
        (".attn.attention.out_proj.", ".self_attn.o_proj."),
        (".attn.attention.", ".self_attn."),
        (".ln_1.", ".input_layernorm."),
        (".ln_2.", ".post_attention_layernorm."),
        (".mlp.c_fc_0.", ".mlp.gate_proj."),
        (".mlp.c_fc_1.", ".mlp.up_proj."),
        (".mlp.c_proj.", ".mlp.down_proj."),
    )


class InternLMForCausalLM(LlamaForCausalLM):
    @classmethod
    def layer_flags(cls, config) -> dict[str, bool]:
        flags = super().layer_flags(config)
        bias = bool(getattr(config, "bias", False)) or flags["qkv_bias"]
        return {**flags, "qkv_bias": bias, "o_bias": bias}


class CwmForCausalLM(LlamaForCausalLM):
    @classmethod
    def layer_flags(cls, config) -> dict[str, bool]:
        # no attention biases: config_ignored.py sets attention_bias, which HF's CWM never reads
        return {**super().layer_flags(config), "sliding": True}


class MiMoForCausalLM(Qwen2ForCausalLM):
    def convert_weight(self, name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if name.startswith("model.mtp_layers."):
            return ()
        return super().convert_weight(name, w)


class InternLM2ForCausalLM(InternLMForCausalLM):
    renames = (
        ("model.tok_embeddings.", "model.embed_tokens."),
        (".attention.wqkv.", ".self_attn.wqkv."),
        (".attention.wo.", ".self_attn.o_proj."),
        (".feed_forward.w1.", ".mlp.gate_proj."),
        (".feed_forward.w3.", ".mlp.up_proj."),
        (".feed_forward.w2.", ".mlp.down_proj."),
        (".attention_norm.", ".input_layernorm."),
        (".ffn_norm.", ".post_attention_layernorm."),
    )

    def rename_weight(self, name: str) -> str:
        return "lm_head.weight" if name == "output.weight" else super().rename_weight(name)

    def convert_weight(self, name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if ".wqkv." not in name:
            yield name, w
            return
        cfg = self.config
        d, heads = llama_head_dim(cfg), cfg.num_attention_heads
        kv_heads = cfg_get(cfg, "num_key_value_heads", heads)
        group = heads // kv_heads
        if w.shape[0] != kv_heads * (group + 2) * d:
            raise ValueError(
                f"{name}: {w.shape[0]} rows, expected {kv_heads} x ({group} + 2) x {d}"
            )
        packed = w.reshape(kv_heads, group + 2, d, *w.shape[1:])  # per KV head: [q x group, k, v]
        yield name.replace(".wqkv.", ".q_proj."), packed[:, :group].reshape(heads * d, *w.shape[1:])
        yield (
            name.replace(".wqkv.", ".k_proj."),
            packed[:, group].reshape(kv_heads * d, *w.shape[1:]),
        )
        yield (
            name.replace(".wqkv.", ".v_proj."),
            packed[:, group + 1].reshape(kv_heads * d, *w.shape[1:]),
        )


class MiniCPMForCausalLM(GraniteForCausalLM):
    def __init__(self, config) -> None:
        scalars = {
            **minicpm_scalars(config, scale_depth=1.0),
            "attention_multiplier": llama_head_dim(config) ** -0.5,
        }
        config = copy.copy(config)  # the caller's config keeps its own fields
        for name, value in scalars.items():  # Granite's names, read by its layers and stack
            setattr(config, name, value)
        super().__init__(config)
