"""JAIS v1 (`JAISLMHeadModel`, model_type "jais", remote code: inceptionai/jais-13b-chat,
jais-30b-chat-v3, jais-family-*): GPT-2's decoder (models/gpt2.py: Conv1D weights stored
[in, out], `c_attn` holding q | k | v, pre-LayerNorms with biases, biases everywhere, the
`transformer.` names) with

- a SwiGLU MLP: c_proj(c_fc(x) * silu(c_fc2(x))), loaded as one gate | up matmul
  (gate = c_fc2, up = c_fc);
- ALiBi (position_embedding_type "alibi": the paper's slopes, as BLOOM's, and no `wpe`) or
  GPT-2's learned positions ("learned");
- muP scalars: the embedding (plus positions) times `embeddings_scale`, q.k scaled by
  1 / head_dim instead of 1 / sqrt(head_dim) when `scale_qk_dot_by_d`, the logits times
  `width_scale`. The jais-family releases spell them mup_embeddings_scale,
  mup_scale_qk_dot_by_d and mup_output_alpha * mup_width_scale; the first releases' names win
  where both are set, as in vLLM's jais.py.

config.json is read here (transformers has no "jais" type; remote_aliases.REMOTE_CONFIGS names
`jais_config`). Where we differ from vLLM: its attention always adds ALiBi, "learned" or not;
we add it only for "alibi", as the release's modeling_jais.py does, and we honour
scale_attn_weights=False (no scaling). Refused by name: another activation_function or
position_embedding_type, alibi_scaling (the release's slope scaling by a factor or by length,
which vLLM ignores), scale_attn_by_inverse_layer_idx, reorder_and_upcast_attn,
add_cross_attention.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from paged_engine.layers.activation import SiluAndMul
from paged_engine.layers.attention import Attention
from paged_engine.layers.embedding import VocabParallelEmbedding
from paged_engine.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from paged_engine.layers.norm import LayerNorm
from paged_engine.models.bloom import alibi_slopes
from paged_engine.models.gpt2 import GPT2Attention, GPT2LMHeadModel
from paged_engine.models.remote_aliases import common_fields, field, refuse_unless
from paged_engine.models.utils import CausalLMBase, make_layers

ARCH = "JAISLMHeadModel"

# HF Conv1D weights ([in, out]), ours the transpose
_CONV1D = (
    "attn.c_attn.weight",
    "attn.c_proj.weight",
    "mlp.c_fc.weight",
    "mlp.c_fc2.weight",
    "mlp.c_proj.weight",
)


def _first(raw: dict[str, Any], names: tuple[str, str], kind: type, default: Any) -> Any:
    """The first of `names` config.json sets (the first release's spelling, then muP's)."""
    name = next((n for n in names if raw.get(n) is not None), names[0])
    return field(raw, name, kind, default)


def jais_config(raw: dict[str, Any]) -> PretrainedConfig:
    """JAIS's config.json (GPT-2's n_* names) as our field names, with the three muP scalars
    resolved; ValueError naming any field outside what models/jais.py serves."""
    act = field(raw, "activation_function", str, "gelu_new")  # the release config's default
    if act != "swiglu":
        raise ValueError(
            f"{ARCH}: config.json field 'activation_function'={act!r} is not "
            "supported (only 'swiglu')"
        )
    refuse_unless(raw, ARCH, "position_embedding_type", ("alibi", "learned", None))
    for name in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        refuse_unless(raw, ARCH, name, (False, None))
    refuse_unless(raw, ARCH, "add_cross_attention", (False, None))
    refuse_unless(raw, ARCH, "alibi_scaling", (None,))
    hidden = field(raw, "n_embd", int)
    heads = field(raw, "n_head", int)
    if hidden % heads:
        raise ValueError(f"config.json field 'n_head' ({heads}) must divide n_embd ({hidden})")
    if raw.get("width_scale") is not None:
        logits_scale = field(raw, "width_scale", float)
    else:
        alpha = field(raw, "mup_output_alpha", float, 1.0)
        logits_scale = alpha * field(raw, "mup_width_scale", float, 1.0)
    fields = {
        **common_fields(raw),
        "vocab_size": field(raw, "vocab_size", int),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_hidden_layers": field(raw, "n_layer", int),
        "intermediate_size": field(raw, "n_inner", int, 4 * hidden),
        "max_position_embeddings": field(raw, "n_positions", int, 1024),
        "layer_norm_epsilon": field(raw, "layer_norm_epsilon", float, 1e-5),
        "tie_word_embeddings": field(raw, "tie_word_embeddings", bool, True),
        "alibi": raw.get("position_embedding_type") == "alibi",
        "scale_attn_weights": field(raw, "scale_attn_weights", bool, True),
        "scale_qk_dot_by_d": _first(
            raw, ("scale_qk_dot_by_d", "mup_scale_qk_dot_by_d"), bool, False
        ),
        "embeddings_scale": _first(raw, ("embeddings_scale", "mup_embeddings_scale"), float, 1.0),
        "logits_scale": logits_scale,
    }
    config = PretrainedConfig(**fields)
    config.model_type = "jais"
    return config


class JaisAttention(GPT2Attention):
    """GPT-2's fused q | k | v attention with JAIS's scale (1 / head_dim under muP, 1 with
    scale_attn_weights off) and, for ALiBi models, this rank's heads' slopes."""

    def __init__(self, config, layer_idx: int, slopes: torch.Tensor | None):
        super().__init__(config, layer_idx)
        proj = self.c_attn
        head_dim = config.hidden_size // config.num_attention_heads
        power = 1.0 if config.scale_qk_dot_by_d else 0.5
        scale = head_dim**-power if config.scale_attn_weights else 1.0
        if slopes is not None:
            first = proj.tp_rank * proj.num_heads
            slopes = slopes[first : first + proj.num_heads]
        self.attn = Attention(
            proj.num_heads, head_dim, proj.num_kv_heads, scale, alibi_slopes=slopes
        )


class JaisMLP(nn.Module):
    """SwiGLU: c_proj(up * silu(gate)), gate | up = c_fc2 | c_fc in one matmul."""

    def __init__(self, config):
        super().__init__()
        d, inner = config.hidden_size, config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(d, [inner, inner], bias=True)
        self.c_proj = RowParallelLinear(inner, d, bias=True)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, D] -> [T, D]
        return self.c_proj(self.act(self.gate_up_proj(x)))


class JaisBlock(nn.Module):
    def __init__(self, config, layer_idx: int, slopes: torch.Tensor | None):
        super().__init__()
        eps = config.layer_norm_epsilon
        self.ln_1 = LayerNorm(config.hidden_size, eps=eps)
        self.attn = JaisAttention(config, layer_idx, slopes)
        self.ln_2 = LayerNorm(config.hidden_size, eps=eps)
        self.mlp = JaisMLP(config)

    def forward(self, x, kv_cache, md) -> torch.Tensor:  # x: [T, D]
        x = x + self.attn(self.ln_1(x), kv_cache, md)
        return x + self.mlp(self.ln_2(x))


class JaisModel(nn.Module):
    """Token embedding (+ learned positions unless ALiBi), times embeddings_scale; the blocks;
    the final LayerNorm."""

    def __init__(self, config):
        super().__init__()
        d = config.hidden_size
        self.wte = VocabParallelEmbedding(config.vocab_size, d)
        self.wpe = None if config.alibi else nn.Embedding(config.max_position_embeddings, d)
        self.embeddings_scale = float(config.embeddings_scale)
        slopes = alibi_slopes(config.num_attention_heads) if config.alibi else None
        self.h, self.stage = make_layers(
            config.num_hidden_layers, lambda i: JaisBlock(config, i, slopes)
        )
        self.ln_f = LayerNorm(d, eps=config.layer_norm_epsilon)

    def forward(self, input_ids, positions, kv_caches, md, hidden=None) -> torch.Tensor:
        # hidden: the previous pipeline stage's output (None on the first stage)
        if hidden is None:
            hidden = self.wte(input_ids)  # [T, D]
            if self.wpe is not None:
                hidden = hidden + self.wpe(positions)
            hidden = hidden * self.embeddings_scale
        for block, kv_cache in zip(self.stage.layers(self.h), kv_caches, strict=True):
            hidden = block(hidden, kv_cache, md)
        return self.ln_f(hidden) if self.stage.is_last else hidden


class JAISLMHeadModel(GPT2LMHeadModel):
    """GPT-2's names, Conv1D transposes and q | k | v split (gpt2.py), plus c_fc2 / c_fc
    routed into the SwiGLU's gate | up and the logits times width_scale."""

    stacked_params = (
        *GPT2LMHeadModel.stacked_params,
        (".mlp.gate_up_proj.", ".mlp.c_fc2.", 0),
        (".mlp.gate_up_proj.", ".mlp.c_fc.", 1),
    )
    # the release's ALiBi slopes buffer, recomputed here
    ignored_weights = (*GPT2LMHeadModel.ignored_weights, ".relative_pe.slopes")

    def __init__(self, config):
        CausalLMBase.__init__(self, config, JaisModel(config))  # not GPT-2's stack
        self.logits_scale = float(config.logits_scale)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, V] fp32
        return super().compute_logits(hidden) * self.logits_scale

    def convert_lora_b(self, name: str, b: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        # a LoRA B is [out, r] on a Conv1D module too: stored the Conv1D way round first
        return self.convert_weight(name, b.t() if name.endswith(_CONV1D) else b)

    def convert_weight(self, name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if name.endswith("mlp.c_fc2.weight"):  # GPT-2's converter knows its other Conv1Ds
            return ((name, w.t()),)
        return super().convert_weight(name, w)
