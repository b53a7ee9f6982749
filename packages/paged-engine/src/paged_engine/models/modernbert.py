"""ModernBERT (`ModernBertModel`, `ModernBertForSequenceClassification`,
`ModernBertForTokenClassification`): the encoder behind gte-modernbert, nomic-embed ModernBERT,
ModernBERT rerankers and taggers. An encoder as models/bert.py's (whole sequences in one step,
no KV cache, pooling only), with a pre-norm stack:

    h = LN(embed[ids])
    per layer: h += Wo attn(LN(h))         (layer 0: no norm before its attention)
               h += Wo (act(a) * g)        [a | g] = Wi LN(h)
    out = LN(h)

Attention is bidirectional with NeoX rotary embeddings; `layer_types` says which layers attend
globally and which within a window (|i - j| <= sliding_window = local_attention / 2), each type
with its own rope theta. Older configs (global_attn_every_n_layers, global / local_rope_theta)
are read the same way. The classifiers run `head` (dense, act, norm) then `classifier`: the
sequence classifier on the [CLS] token or the sequence's mean (`classifier_pooling`), the token
classifier (`ModernBertForTokenClassification`, task "token_classify") on every token's row.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from paged_engine.layers.attention import AttentionMetadata
from paged_engine.models.bert import (
    EncoderShell,
    activation,
    rope_tables,
    rotary_encoder_attention,
    sequence_bounds,
)
from paged_engine.models.utils import load_named_weights


def _layer_types(config) -> list[str]:
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    every = int(getattr(config, "global_attn_every_n_layers", 1) or 1)
    return [
        "full_attention" if i % every == 0 else "sliding_attention"
        for i in range(config.num_hidden_layers)
    ]


def _rope_theta(config, kind: str) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    if params.get(kind):
        return float(params[kind]["rope_theta"])
    key = "global_rope_theta" if kind == "full_attention" else "local_rope_theta"
    return float(getattr(config, key))


def _ln(config) -> nn.LayerNorm:
    return nn.LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)


class ModernBertEmbeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.norm = _ln(config)


class ModernBertAttention(nn.Module):
    def __init__(self, config, window: int | None) -> None:
        super().__init__()
        h, bias = config.hidden_size, config.attention_bias
        self.num_heads = config.num_attention_heads
        self.window = window
        self.Wqkv = nn.Linear(h, 3 * h, bias=bias)
        self.Wo = nn.Linear(h, h, bias=bias)

    def forward(self, x, cos, sin, bounds: list[tuple[int, int]]) -> torch.Tensor:
        out = rotary_encoder_attention(self.Wqkv(x), self.num_heads, cos, sin, bounds, self.window)
        return self.Wo(out)


class ModernBertMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        h, inner = config.hidden_size, int(config.intermediate_size)
        self.Wi = nn.Linear(h, 2 * inner, bias=config.mlp_bias)
        self.Wo = nn.Linear(inner, h, bias=config.mlp_bias)
        self.act = activation(config.hidden_activation, "hidden_activation")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, g = self.Wi(x).chunk(2, dim=-1)
        return self.Wo(self.act(a) * g)


class ModernBertLayer(nn.Module):
    def __init__(self, config, i: int, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.attn_norm = nn.Identity() if i == 0 else _ln(config)
        window = int(config.local_attention) // 2 if kind == "sliding_attention" else None
        self.attn = ModernBertAttention(config, window)
        self.mlp_norm = _ln(config)
        self.mlp = ModernBertMLP(config)

    def forward(self, x, cos, sin, bounds) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, bounds)
        return x + self.mlp(self.mlp_norm(x))


class ModernBertModel(EncoderShell):
    """The ModernBERT stack, named as transformers' (`model.` under a task head)."""

    prefix = "model"

    def __init__(self, config) -> None:
        super().__init__(config)
        self.kinds = _layer_types(config)
        self.embeddings = ModernBertEmbeddings(config)
        self.layers = nn.ModuleList(
            ModernBertLayer(config, i, kind) for i, kind in enumerate(self.kinds)
        )
        self.final_norm = _ln(config)
        head_dim = config.hidden_size // config.num_attention_heads
        exps = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
        for kind in sorted(set(self.kinds)):
            inv = 1.0 / (_rope_theta(config, kind) ** exps)
            self.register_buffer(f"inv_freq_{kind}", inv, persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list,
        attn_metadata: AttentionMetadata,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        bounds = sequence_bounds(attn_metadata)
        x = self.embeddings.norm(self.embeddings.tok_embeddings(input_ids))
        rope = {}
        for kind in set(self.kinds):  # cos / sin per layer type
            rope[kind] = rope_tables(positions, getattr(self, f"inv_freq_{kind}"), x.dtype)
        for layer in self.layers:
            x = layer(x, *rope[layer.kind], bounds)
        return self.final_norm(x)

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True
    ) -> set[str]:
        return load_named_weights(
            self,
            weights,
            rename=self.rename_weight,
            skip=lambda n: n.startswith(("head.", "decoder.")),  # an MLM checkpoint's head
            strict=strict,
        )


class ModernBertPredictionHead(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, bias=config.classifier_bias)
        self.act = activation(config.classifier_activation, "classifier_activation")
        self.norm = _ln(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.act(self.dense(x)))


class ModernBertClassifier(ModernBertModel):
    """ModernBERT with transformers' classification head: classifier(head(rows)) on whatever
    rows the worker hands `classify` (the dropout between them is identity at inference)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.head = ModernBertPredictionHead(config)
        self.classifier = nn.Linear(config.hidden_size, int(config.num_labels))

    def rename_weight(self, name: str) -> str:
        return name if name.startswith(("head.", "classifier.")) else super().rename_weight(name)

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True
    ) -> set[str]:
        return load_named_weights(self, weights, rename=self.rename_weight, strict=strict)

    def classify(self, rows: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, labels]
        return self.classifier(self.head(rows))


class ModernBertForSequenceClassification(ModernBertClassifier):
    """The head on one row per sequence: the [CLS] token or the mean over the sequence
    (`classifier_pooling`)."""

    def __init__(self, config) -> None:
        self.classifier_pooling_type(config)  # raises naming classifier_pooling
        super().__init__(config)

    @staticmethod
    def classifier_pooling_type(config) -> str:
        """What the head reads: the [CLS] token, or the mean over the sequence."""
        pooling = getattr(config, "classifier_pooling", "cls")
        if pooling not in ("cls", "mean"):
            raise ValueError(f"classifier_pooling={pooling!r} is not supported: 'cls' or 'mean'")
        return pooling.upper()

    @classmethod
    def head_after_pooling(cls, config) -> bool:
        """The (non-linear) head runs on the pooled mean, not per position."""
        return cls.classifier_pooling_type(config) == "MEAN"


class ModernBertForTokenClassification(ModernBertClassifier):
    """The head on every token's row (task "token_classify"); `classifier_pooling` is not read."""


MODERNBERT: dict[str, type[nn.Module]] = {
    "ModernBertModel": ModernBertModel,
    "ModernBertForSequenceClassification": ModernBertForSequenceClassification,
    "ModernBertForTokenClassification": ModernBertForTokenClassification,
}
