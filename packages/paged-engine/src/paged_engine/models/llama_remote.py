"""Remote-code releases that are Llama's decoder with scalars, a bias switch or other tensor
names, served by models/llama.py as vLLM's registry serves them (its teleflm.py,
openpangu.py and fairseq2_llama.py):

    TeleFLMForCausalLM         Tele-FLM / FLM-2 (CofeAI): muP multipliers when `use_mup`, the
                               embedding times `input_mult`, the logits times
                               output_mult / mup_scale_factor (HF Granite's embedding_multiplier
                               and 1 / logits_scaling, with attention_multiplier head_dim^-0.5
                               and residual_multiplier 1)
    PanguEmbeddedForCausalLM   openPangu-Embedded-1B / 7B: Llama with q / k / v / o biases from
                               `bias` (HF Llama's attention_bias; `qkv_bias` apart, as vLLM
                               reads it); the other openPangu switches vLLM's file serves (MLA,
                               sinks, sandwich norms, mHC, MoE) are refused by name
    Fairseq2LlamaForCausalLM   Llama trained in fairseq2: a `model.pt` holding
                               {"model_key": k, k: state dict} (unwrapped by loader.py's
                               `_iter_pt`), fairseq2's tensor names, and q / k rows in the
                               interleaved-pair rotary order, permuted at load into NeoX halves

Tele-FLM's and openPangu's config.json (model types transformers does not know) are translated
into a LlamaConfig here, through remote_aliases; Fairseq2Llama's config.json is Llama's own.

Where we differ from vLLM: its teleflm.py scales the embedding on a model class it never builds
(newer copies dropped that class), so vLLM runs Tele-FLM without `input_mult`; we apply it, as
the release's description (and vLLM's PR: "an input(output)-mult operation") says it runs.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, PretrainedConfig

from paged_engine.models.llama import LlamaForCausalLM, LlamaModel, llama_head_dim
from paged_engine.models.remote_aliases import common_fields, field
from paged_engine.models.utils import CausalLMBase, cfg_get


def llama_config(raw: dict[str, Any], **fields: Any) -> PretrainedConfig:
    """A LlamaConfig from a release's config.json that uses Llama's field names, plus
    `fields` (our translated ones)."""
    out: dict[str, Any] = {**common_fields(raw)}
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"):
        out[name] = field(raw, name, int)
    heads = field(raw, "num_attention_heads", int)
    out["num_attention_heads"] = heads
    out["num_key_value_heads"] = field(raw, "num_key_value_heads", int, heads)
    if raw.get("head_dim") is not None:
        out["head_dim"] = field(raw, "head_dim", int)
    out["hidden_act"] = field(raw, "hidden_act", str, "silu")
    out["max_position_embeddings"] = field(raw, "max_position_embeddings", int, 2048)
    out["rms_norm_eps"] = field(raw, "rms_norm_eps", float, 1e-6)
    if raw.get("rope_parameters") is not None:  # transformers 5's spelling of both below
        out["rope_parameters"] = field(raw, "rope_parameters", dict)
    else:
        out["rope_theta"] = field(raw, "rope_theta", float, 10000.0)
        if raw.get("rope_scaling") is not None:
            out["rope_scaling"] = field(raw, "rope_scaling", dict)
    out["tie_word_embeddings"] = field(raw, "tie_word_embeddings", bool, False)
    out["mlp_bias"] = field(raw, "mlp_bias", bool, False)
    if heads % out["num_key_value_heads"]:
        raise ValueError(
            f"config.json field 'num_key_value_heads' ({out['num_key_value_heads']}) must "
            f"divide num_attention_heads ({heads})"
        )
    return LlamaConfig(**out, **fields)


def teleflm_config(raw: dict[str, Any]) -> PretrainedConfig:
    """Tele-FLM's config.json: Llama's fields (`attention_bias` too), and `use_mup` with its
    three scalars."""
    use_mup = field(raw, "use_mup", bool, False)
    mup: dict[str, Any] = {
        "use_mup": use_mup,
        "attention_bias": field(raw, "attention_bias", bool, False),
    }
    if use_mup:
        for name in ("input_mult", "output_mult", "mup_scale_factor"):
            mup[name] = field(raw, name, float)
            if mup[name] <= 0:
                raise ValueError(f"config.json field {name!r} must be positive, got {raw[name]}")
    return llama_config(raw, **mup)


# openPangu's switches (vLLM's openpangu.py) beyond the dense Embedded models: MLA, sink
# attention, sandwich / block-post norms, mHC streams, MoE, windows, bidirectional attention
_PANGU_REFUSED = (
    "kv_lora_rank",
    "q_lora_rank",
    "param_sink_number",
    "sandwich_norm",
    "use_mhc",
    "block_post_layernorm_idx",
    "n_routed_experts",
    "interleaved_sliding_window",
    "num_nextn_predict_layers",
)


def pangu_embedded_config(raw: dict[str, Any]) -> PretrainedConfig:
    """openPangu-Embedded's config.json: Llama's fields; `bias` (True when absent, as the
    release's config class) on q / k / v / o."""
    for name in _PANGU_REFUSED:
        if raw.get(name):
            raise ValueError(
                f"config.json field {name!r} is not supported for PanguEmbeddedForCausalLM "
                "(only the dense Llama-like openPangu-Embedded models are)"
            )
    if raw.get("is_causal") is False:
        raise ValueError("config.json field 'is_causal' false is not supported")
    bias = field(raw, "bias", bool, True) or field(raw, "attention_bias", bool, False)
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if isinstance(rope, dict) and rope.get("mrope_interleaved"):
        raise ValueError("config.json field 'rope_parameters.mrope_interleaved' is not supported")
    # `qkv_bias`, where given, switches the q / k / v biases alone (vLLM's reading)
    return llama_config(raw, attention_bias=bias, qkv_bias=field(raw, "qkv_bias", bool, bias))


class TeleFLMForCausalLM(LlamaForCausalLM):
    def __init__(self, config) -> None:
        use_mup = bool(getattr(config, "use_mup", False))
        inner = LlamaModel(
            config,
            self.layer_flags(config),
            embedding_multiplier=float(config.input_mult) if use_mup else None,
        )
        CausalLMBase.__init__(self, config, inner)
        self.logit_scale = config.output_mult / config.mup_scale_factor if use_mup else 1.0

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, V] fp32
        logits = super().compute_logits(hidden)
        return logits if self.logit_scale == 1.0 else logits * self.logit_scale


class PanguEmbeddedForCausalLM(LlamaForCausalLM):
    """Llama with the translated config's bias switches: `attention_bias` on o_proj, and on
    q / k / v unless `qkv_bias` says otherwise."""

    @classmethod
    def layer_flags(cls, config) -> dict[str, bool]:
        flags = super().layer_flags(config)
        return {**flags, "qkv_bias": bool(getattr(config, "qkv_bias", flags["qkv_bias"]))}


class Fairseq2LlamaForCausalLM(LlamaForCausalLM):
    renames = (
        ("decoder_frontend.embed.", "model.embed_tokens."),
        ("final_proj.", "lm_head."),
        ("decoder.", "model."),
        (".self_attn_layer_norm.", ".input_layernorm."),
        (".ffn_layer_norm.", ".post_attention_layernorm."),
        (".self_attn.output_proj.", ".self_attn.o_proj."),
        (".ffn.gate_proj.", ".mlp.gate_proj."),
        (".ffn.inner_proj.", ".mlp.up_proj."),
        (".ffn.output_proj.", ".mlp.down_proj."),
        ("model.layer_norm.", "model.norm."),
    )

    def convert_weight(self, name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """q / k rows from fairseq2's rotary order (per head: pairs (2i, 2i + 1) rotated
        together) into HF's (i, i + d / 2)."""
        if ".self_attn.q_proj." in name:
            heads = self.config.num_attention_heads
        elif ".self_attn.k_proj." in name:
            heads = cfg_get(self.config, "num_key_value_heads", self.config.num_attention_heads)
        else:
            return ((name, w),)
        d = llama_head_dim(self.config)
        if w.shape[0] != heads * d:
            raise ValueError(f"{name}: {w.shape[0]} rows, expected {heads} x {d}")
        rows = w.reshape(heads, d // 2, 2, *w.shape[1:]).transpose(1, 2)
        return ((name, rows.reshape(w.shape)),)


def fairseq2_files(path: Path) -> list[Path]:
    """fairseq2's whole-model checkpoint in `path` (`model.pt`), or [] where there is none;
    ValueError for its tensor-parallel shards (`model.<rank>.pt`) alone."""
    whole = path / "model.pt"
    if whole.is_file():
        return [whole]
    shards = sorted(p.name for p in path.glob("model.*.pt"))
    if shards:
        raise ValueError(
            f"{path}: fairseq2 tensor-parallel shards {shards} are not supported; "
            "save the whole model as model.pt"
        )
    return []
