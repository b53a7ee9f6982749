"""Molmo2's text decoder (transformers' Molmo2TextModel and its lm_head), served inside
Molmo2ForConditionalGeneration (models/text_wrappers.py; images: multimodal/molmo2.py).

    qk_norm_type "qwen3", norm_after False (Molmo2-4B / 8B): Qwen3's decoder (per-head q / k
        RMSNorm before RoPE, pre-norm layers; models/llama.py)
    qk_norm_type "olmo", norm_after True (Molmo2-O): OLMo 2's (q / k normed over the whole
        projection, each sublayer's output normed before its residual add; models/olmo2.py),
        its `input_layernorm` / `post_attention_layernorm` there OLMo 2's post-attention /
        post-feed-forward norms
Both differ from those models in:
    o_proj never has a bias (text_config.attention_bias is q / k / v's only)
    the token table holds additional_vocab_size ids after vocab_size (the image tokens), which
        the head (vocab_size rows) never scores: the config copy's vocab_size counts them
        (`head_vocab_size` keeps the head's), and the logits of those ids are -inf, so
        sampling, greedy and logprobs are those of transformers' vocab_size-wide logits
    RoPE: the layers of rope_scaling_layers (all when unset) rotate with rope_parameters'
        scaling, the others with the plain rope of the same theta
The other two pairings of qk_norm_type and norm_after, and tie_word_embeddings (a table wider
than the head), are refused by name. Norm products are in float32 where the weights are (OLMo
2's norms round once after the weight, transformers' Molmo2 before it: equal in float32).

Weight names: the Hub's (what transformers' save_pretrained writes back:
`model.transformer.blocks.N.self_attn.att_proj` (q | k | v stacked), `attn_out`,
`mlp.ff_proj` (up | gate stacked), `mlp.ff_out`, `attn_norm`, `ff_norm`, `ln_f`, and the token
table as `wte.embedding` then `wte.new_embedding`, stacked), and transformers' in-memory ones
(mapped by models/multimodal_text.py: `model.language_model.X`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F

from paged_engine.layers.embedding import ParallelLMHead
from paged_engine.layers.linear import RowParallelLinear
from paged_engine.layers.rotary import RotaryEmbedding, get_rope, plain_rope, rope_config
from paged_engine.models.llama import LlamaDecoderLayer, LlamaModel, llama_head_dim
from paged_engine.models.olmo2 import Olmo2DecoderLayer, Olmo2Model
from paged_engine.models.qwen3 import Qwen3ForCausalLM
from paged_engine.models.utils import CausalLMBase, cfg_get

_TABLE = "model.transformer.wte."


def is_olmo(config: Any) -> bool:
    return cfg_get(config, "qk_norm_type", "qwen3") == "olmo"


def check_text_config(config: Any) -> None:
    """ValueError naming a text_config field this decoder does not run."""
    kind = cfg_get(config, "qk_norm_type", "qwen3")
    after = bool(cfg_get(config, "norm_after", False))
    if (kind, after) not in (("qwen3", False), ("olmo", True)):
        raise ValueError(
            f"Molmo2 text_config.qk_norm_type={kind!r} with norm_after={after} is not "
            "supported: 'qwen3' with pre-norm layers or 'olmo' with norm_after"
        )
    scaled = cfg_get(config, "rope_scaling_layers", None)
    if scaled is not None and not all(0 <= i < config.num_hidden_layers for i in scaled):
        raise ValueError(f"Molmo2 text_config.rope_scaling_layers={scaled} index no layer")
    if cfg_get(config, "tie_word_embeddings", False):
        raise ValueError("Molmo2 tie_word_embeddings=True is not supported (the table is wider)")


def _ropes(config: Any) -> tuple[RotaryEmbedding, RotaryEmbedding, set[int]]:
    """(the scaled rope, the plain one of the same theta, the layers of the scaled one)."""
    head_dim = llama_head_dim(config)
    scaled = get_rope(config, head_dim, is_neox_style=True)
    theta, _, _ = rope_config(config)
    plain = plain_rope(head_dim, head_dim, int(config.max_position_embeddings), theta)
    layers = cfg_get(config, "rope_scaling_layers", None)
    return scaled, plain, set(range(config.num_hidden_layers) if layers is None else layers)


class _OlmoLayer(Olmo2DecoderLayer):
    """OLMo 2's layer with a bias-free o_proj."""

    def __init__(self, config: Any, rope: RotaryEmbedding) -> None:
        super().__init__(config, rope)
        width = config.num_attention_heads * llama_head_dim(config)
        self.self_attn.o_proj = RowParallelLinear(width, config.hidden_size, bias=False)


class MolmoTableMixin:
    """What Molmo's text decoders (Molmo2's, MolmoE's) share past their base decoder: a token
    table wider than the head (config.vocab_size counts the extra image ids, `head_vocab_size`
    the head's rows; those ids' logits -inf) and the Hub's weight names for it and for att_proj.
    Subclasses call `_init_table` after their base's __init__."""

    config: Any
    lm_head: ParallelLMHead

    def _init_table(self, config: Any) -> None:
        self.head_vocab = int(getattr(config, "head_vocab_size", config.vocab_size))
        self.lm_head = ParallelLMHead(self.head_vocab, config.hidden_size)
        self._table: dict[str, torch.Tensor] = {}  # the Hub's table parts until both are read

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, V + A]
        logits = self.lm_head(hidden)
        extra = self.config.vocab_size - self.head_vocab
        return F.pad(logits, (0, extra), value=float("-inf")) if extra else logits

    def _table_or_qkv(
        self, name: str, w: torch.Tensor
    ) -> tuple[tuple[str, torch.Tensor], ...] | None:
        """The two table parts stacked (nothing until both are read), att_proj (q | k | v
        stacked) split; None for any other weight."""
        if name.startswith(_TABLE):
            self._table[name.removeprefix(_TABLE)] = w
            if len(self._table) < 2:
                return ()
            parts = [self._table.pop(k) for k in ("embedding", "new_embedding")]
            return (("model.embed_tokens.weight", torch.cat(parts)),)
        if ".self_attn.att_proj." in name:
            head_dim = llama_head_dim(self.config)
            heads = self.config.num_attention_heads
            kv = cfg_get(self.config, "num_key_value_heads", heads)
            q, k, v = w.split([heads * head_dim, kv * head_dim, kv * head_dim])
            return tuple(
                (name.replace(".att_proj.", f".{p}_proj."), t)
                for p, t in (("q", q), ("k", k), ("v", v))
            )
        return None


class Molmo2TextForCausalLM(MolmoTableMixin, Qwen3ForCausalLM):
    renames = (
        ("model.transformer.blocks.", "model.layers."),
        ("model.transformer.ln_f.", "model.norm."),
        (".self_attn.attn_out.", ".self_attn.o_proj."),
        (".mlp.ff_out.", ".mlp.down_proj."),
    )
    _PRE_NORMS = ((".attn_norm.", ".input_layernorm."), (".ff_norm.", ".post_attention_layernorm."))
    # transformers' names first (a chain: post-attention before input), then the Hub's
    _POST_NORMS = (
        (".post_attention_layernorm.", ".post_feedforward_layernorm."),
        (".input_layernorm.", ".post_attention_layernorm."),
        (".attn_norm.", ".post_attention_layernorm."),
        (".ff_norm.", ".post_feedforward_layernorm."),
    )

    def __init__(self, config) -> None:
        check_text_config(config)
        scaled, plain, layers = _ropes(config)
        rope = lambda i: scaled if i in layers else plain
        if is_olmo(config):
            inner = Olmo2Model(config, lambda i: _OlmoLayer(config, rope(i)))
            inner.rotary_emb, inner.plain_rope = scaled, plain  # (their tables as buffers)
            CausalLMBase.__init__(self, config, inner)
            self.renames = (*type(self).renames, *self._POST_NORMS)
        else:
            flags = self.layer_flags(config)
            build = lambda i, _: LlamaDecoderLayer(config, i, flags, rope(i))
            CausalLMBase.__init__(self, config, LlamaModel(config, flags, build))
            self.model.rotary_emb, self.model.plain_rope = scaled, plain
            self.renames = (*type(self).renames, *self._PRE_NORMS)
        self._init_table(config)

    @classmethod
    def layer_flags(cls, config) -> dict[str, bool]:
        return {**super().layer_flags(config), "o_bias": False, "sliding": False}

    def convert_weight(self, name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """The Hub's stacked q | k | v and up | gate split; its two table parts stacked."""
        done = self._table_or_qkv(name, w)
        if done is not None:
            return done
        if name.endswith(".mlp.ff_proj.weight"):
            up, gate = w.chunk(2)
            base = name.removesuffix("ff_proj.weight")
            return ((base + "up_proj.weight", up), (base + "gate_proj.weight", gate))
        return ((name, w),)
