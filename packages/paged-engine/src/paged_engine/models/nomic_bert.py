"""Nomic BERT (`NomicBertModel`, transformers' `NomicBertForSequenceClassification`):
nomic-embed-text-v1 / v1.5 and nomic-bert-2048. GTE's post-norm rotary stack (models/gte.py:
`RopeBertModel`) with no biases and a SwiGLU MLP:

    h = LN(word[ids] + token_type[0])
    per layer: h = norm1(h + out_proj attn(rope(q), rope(k), v))        [q | k | v] = Wqkv h
               h = norm2(h + fc2(silu(fc12 h) * fc11 h))

Checkpoint names are the release's (`emb_ln`, `encoder.layers.N.attn.Wqkv`, `norm1`, `fc11`...),
which transformers' `save_pretrained` writes too; a task model's backbone sits under
`nomic_bert.`. The release's config.json has GPT-2's field names (`n_embd`, `n_head`, `n_layer`,
`n_inner`, `n_positions`, `layer_norm_epsilon`, `rotary_emb_base`, `activation_function`...),
translated by `nomic_config` (transformers' own NomicBertConfig, with `hidden_size`, is read as
it is). As vLLM, it runs the non-interleaved rope over the whole head without the dynamic NTK
(`rotary_scaling_factor`); the release variants this stack does not run (interleaved or
partial rope, biases, pre-norm, parallel blocks, RMSNorm, MoE layers of nomic-embed-text-v2)
are refused by config field name. `is_matryoshka` / `matryoshka_dimensions` carry over for
pooling.py's Matryoshka sizes (v1.5 is trained for them: pass them through `hf_overrides`).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from transformers import NomicBertConfig, PretrainedConfig

from paged_engine.models.gte import BertClassifierHead, RopeBertModel
from paged_engine.models.remote_aliases import common_fields, field

# release name piece -> ours (GTE's Hub names), applied in order
_RENAMES = (
    ("emb_ln.", "embeddings.LayerNorm."),
    ("encoder.layers.", "encoder.layer."),
    (".attn.Wqkv.", ".attention.qkv_proj."),
    (".attn.out_proj.", ".attention.o_proj."),
    (".norm1.", ".attn_ln."),
    (".norm2.", ".mlp_ln."),
    (".mlp.fc11.", ".mlp.up_proj."),
    (".mlp.fc12.", ".mlp.gate_proj."),
    (".mlp.fc2.", ".mlp.down_proj."),
)


class NomicBertModel(RopeBertModel):
    """Nomic BERT's encoder: embeddings pooled from its final hidden states."""

    prefix = "nomic_bert"
    prefixes = ("nomic_bert.",)
    bias = False

    def rename_weight(self, name: str) -> str:
        name = super().rename_weight(name)
        for old, new in _RENAMES:
            name = name.replace(old, new)
        return name


class NomicBertForSequenceClassification(BertClassifierHead, NomicBertModel):
    """Nomic BERT with BERT's head: classifier(tanh(pooler.dense(h[CLS])))."""


# the release's switches and the value this stack runs
_FIXED: dict[str, Any] = {
    "rotary_emb_fraction": 1.0,
    "rotary_emb_interleaved": False,
    "rotary_emb_scale_base": None,
    "rotary_scaling_factor": None,
    "qkv_proj_bias": False,
    "mlp_fc1_bias": False,
    "mlp_fc2_bias": False,
    "prenorm": False,
    "parallel_block": False,
    "use_rms_norm": False,
    "causal": False,
    "moe_every_n_layers": 0,
    "activation_function": "swiglu",
}


def nomic_config(raw: dict[str, Any]) -> PretrainedConfig | None:
    """The release's GPT-2-named config.json as transformers' NomicBertConfig; None for one
    already in transformers' names (transformers reads it)."""
    if "n_embd" not in raw:
        return None
    for name, want in _FIXED.items():
        got = raw.get(name, want)
        if got != want and not (name == "rotary_emb_fraction" and got == 1):
            raise ValueError(
                f"config.json field {name!r}={got!r} is not supported for Nomic BERT ({want!r})"
            )
    hidden = field(raw, "n_embd", int)
    multiple = field(raw, "pad_vocab_size_multiple", int, 1)  # the release pads its table
    vocab = -(-field(raw, "vocab_size", int) // multiple) * multiple
    fields = {
        **common_fields(raw),
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": field(raw, "n_layer", int),
        "num_attention_heads": field(raw, "n_head", int),
        "intermediate_size": field(raw, "n_inner", int, 4 * hidden),
        "hidden_act": "silu",
        "max_position_embeddings": field(raw, "n_positions", int, 2048),
        "type_vocab_size": field(raw, "type_vocab_size", int, 2),
        "layer_norm_eps": field(raw, "layer_norm_epsilon", float, 1e-12),
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": field(raw, "rotary_emb_base", float, 1000.0),
        },
    }
    config = NomicBertConfig(**fields)
    for name in ("is_matryoshka", "matryoshka_dimensions"):
        if raw.get(name) is not None:
            setattr(config, name, raw[name])
    return config


NOMIC_BERT: dict[str, type[nn.Module]] = {
    "NomicBertModel": NomicBertModel,
    "NomicBertForSequenceClassification": NomicBertForSequenceClassification,
}
