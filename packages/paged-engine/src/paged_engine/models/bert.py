"""Encoder-only models for embeddings, cross-encoder scores and token labels: BERT (`BertModel`,
`BertForSequenceClassification`, `BertForTokenClassification`) and RoBERTa / XLM-RoBERTa
(`RobertaModel`, `XLMRobertaModel` and their `*ForSequenceClassification` /
`*ForTokenClassification`; `RobertaForMaskedLM` served as its encoder, as vLLM does): bge, e5,
gte, MiniLM sentence embedders, bge-m3, bge-reranker, ms-marco cross-encoders, NER taggers.
A token classifier's head runs on every token's row (the worker's "ALL" pooling, task
"token_classify"), as vLLM pools it; a sequence classifier's on the [CLS] row.

Every token attends to every token of its own sequence (bidirectional), so a sequence runs
whole in one step: the engine turns chunked prefill and prefix caching off for these models
(engine/encoder.py) and they never decode. They keep no KV cache: attention runs per sequence
over this step's keys and values (torch SDPA), and the engine allocates no KV memory for
them (`kv_cache_layout` is empty: its blocks only count tokens). The names of every module
are transformers', so checkpoints load by name (with or without the `bert.` / `roberta.`
prefix a task head adds).

    h = LayerNorm(word[ids] + position[pos] + token_type[types])
    per layer: h = LN(h + Wo attn(h)); h = LN(h + W2 act(W1 h))          (post-norm)

BERT positions are 0..n-1; RoBERTa's count non-padding tokens from `pad_token_id + 1` (as
transformers' `create_position_ids_from_input_ids`). A BERT token's type is 1 after the first
`[SEP]` of its sequence, else 0: what the tokenizer gives `[CLS] a [SEP] b [SEP]` (a text pair)
and `[CLS] a [SEP]` (one text).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.layers.attention import AttentionMetadata
from paged_engine.models.sequence_classifier import ZeroLogits
from paged_engine.models.utils import load_named_weights

_ACTS = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}


def activation(name: str, field: str = "hidden_act"):
    """An encoder's activation by its transformers name; ValueError naming `field`."""
    if name not in _ACTS:
        raise ValueError(f"{field}={name!r} is not supported for encoder models: {list(_ACTS)}")
    return _ACTS[name]


class BertEmbeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        h = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, h)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, h)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, h)
        self.LayerNorm = nn.LayerNorm(h, eps=config.layer_norm_eps)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(ids) + self.token_type_embeddings(types)
        return self.LayerNorm(x + self.position_embeddings(pos))


def sequence_bounds(attn_metadata: AttentionMetadata) -> list[tuple[int, int]]:
    """[lo, hi) token rows of each non-empty sequence of the step (rows past the last: padding)."""
    cu = attn_metadata.cu_seqlens_q.tolist()
    return [(lo, hi) for lo, hi in itertools.pairwise(cu) if hi > lo]


def pair_token_types(ids: torch.Tensor, sep_id: int) -> torch.Tensor:
    """BERT's token types of sequences of `ids` along the last dim: 1 after a sequence's first
    [SEP] (a text pair's second segment, as its tokenizer gives it), else 0."""
    sep = (ids == sep_id).long()
    return ((torch.cumsum(sep, -1) - sep) > 0).long()


def encoder_attention(
    q: torch.Tensor,  # [heads, T, d], as k and v
    k: torch.Tensor,
    v: torch.Tensor,
    bounds: list[tuple[int, int]],
    window: int | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Bidirectional attention of each sequence over itself (within `window` positions either
    side when given; scores scaled by `scale`, default d^-0.5): [heads, T, d], padding rows
    zero."""
    out = torch.zeros_like(q)
    for lo, hi in bounds:
        mask = None
        if window is not None:
            idx = torch.arange(hi - lo, device=q.device)
            mask = (idx[:, None] - idx[None, :]).abs() <= window
        out[:, lo:hi] = F.scaled_dot_product_attention(
            q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], attn_mask=mask, scale=scale
        )
    return out


def rope_tables(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX rope's cos / sin [T, 1, d] for `positions` [T], in float32 then cast to `dtype`."""
    freqs = positions[:, None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotary_encoder_attention(
    qkv: torch.Tensor,  # [T, 3 * hidden]: q | k | v, each heads x d
    num_heads: int,
    cos: torch.Tensor,  # [T, 1, d]
    sin: torch.Tensor,
    bounds: list[tuple[int, int]],
    window: int | None = None,
) -> torch.Tensor:
    """`encoder_attention` of a fused qkv projection with NeoX rope on q and k (the rotary
    encoders: ModernBERT, GTE / Nomic / Jina v3); returns [T, hidden], before the output
    projection."""
    t = qkv.shape[0]
    q, k, v = qkv.view(t, 3, num_heads, -1).unbind(1)  # [T, heads, d]
    q, k = _rotate_half(q, cos, sin), _rotate_half(k, cos, sin)
    q, k, v = (y.transpose(0, 1) for y in (q, k, v))  # [heads, T, d]
    return encoder_attention(q, k, v, bounds, window).transpose(0, 1).reshape(t, -1)


def _rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class EncoderShell(nn.Module):
    """What every encoder-only model class shares: the engine's view of it (`is_encoder`, no
    cached layers, its position limit), zero logits for a pooling request's throwaway token,
    and checkpoint names under `prefix` (transformers' attribute of a task model)."""

    is_encoder: ClassVar[bool] = True
    prefix: ClassVar[str] = "bert"

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.logits = ZeroLogits(config.vocab_size)

    @staticmethod
    def max_positions(config) -> int:
        """The longest sequence the model takes."""
        return int(config.max_position_embeddings)

    @staticmethod
    def kv_cache_layout(config) -> list[tuple[int, int]]:
        """No layer caches keys or values: the engine's blocks only count tokens."""
        return []

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits(hidden)

    def rename_weight(self, name: str) -> str:
        return name.removeprefix(f"{self.prefix}.")


class BertSelfAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        h = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.query, self.key, self.value = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)

    def forward(self, x: torch.Tensor, bounds: list[tuple[int, int]]) -> torch.Tensor:
        t, h = x.shape
        q, k, v = (
            p(x).view(t, self.num_heads, -1).transpose(0, 1)
            for p in (self.query, self.key, self.value)
        )
        return encoder_attention(q, k, v, bounds).transpose(0, 1).reshape(t, h)


class BertSelfOutput(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


class BertAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config)

    def forward(self, x: torch.Tensor, bounds: list[tuple[int, int]]) -> torch.Tensor:
        return self.output.LayerNorm(x + self.output.dense(self.self(x, bounds)))


class BertIntermediate(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)


class BertOutput(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


class BertLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config)
        self.act = activation(getattr(config, "hidden_act", "gelu"))

    def forward(self, x: torch.Tensor, bounds: list[tuple[int, int]]) -> torch.Tensor:
        x = self.attention(x, bounds)
        y = self.output.dense(self.act(self.intermediate.dense(x)))
        return self.output.LayerNorm(x + y)


class BertEncoder(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))


class BertPooler(nn.Module):
    """The [CLS] token's hidden state through dense + tanh (BERT's classification input)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)


class EncoderBase(EncoderShell):
    """BERT's and RoBERTa's stack, loading by transformers' names."""

    roberta_positions: ClassVar[bool] = False
    pooler: ClassVar[bool] = False  # the stack keeps BERT's pooler (a task head reads it)

    def __init__(self, config) -> None:
        super().__init__(config)
        kind = getattr(config, "position_embedding_type", "absolute")
        if kind not in (None, "absolute"):
            raise ValueError(
                f"position_embedding_type={kind!r} is not supported (absolute positions only)"
            )
        if self.roberta_positions and getattr(config, "pad_token_id", None) is None:
            raise ValueError("pad_token_id is required: RoBERTa's positions count from it")
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        if self.pooler:
            self.pooler_head = BertPooler(config)
        self.pad_id = getattr(config, "pad_token_id", None)
        self.sep_id = getattr(config, "sep_token_id", None)  # set by the engine for BERT pairs

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list,
        attn_metadata: AttentionMetadata,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        bounds = sequence_bounds(attn_metadata)
        types = torch.zeros_like(input_ids)
        pos = positions
        if self.roberta_positions:
            pos = torch.zeros_like(input_ids)
        for lo, hi in bounds:
            ids = input_ids[lo:hi]
            if self.roberta_positions:  # count real tokens from pad_token_id + 1
                real = (ids != self.pad_id).long()
                pos[lo:hi] = torch.cumsum(real, 0) * real + self.pad_id
            elif self.sep_id is not None and self.config.type_vocab_size > 1:
                types[lo:hi] = pair_token_types(ids, self.sep_id)
        x = self.embeddings(input_ids, pos, types)
        for layer in self.encoder.layer:
            x = layer(x, bounds)
        return x

    def rename_weight(self, name: str) -> str:
        name = super().rename_weight(name)
        return "pooler_head." + name.removeprefix("pooler.") if name.startswith("pooler.") else name

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True
    ) -> set[str]:
        ignored = ("embeddings.position_ids", "embeddings.token_type_ids")
        # a checkpoint's pooler that no head of this class reads (an embedding model's)
        drop = () if self.pooler else ("pooler_head.",)
        return load_named_weights(
            self,
            weights,
            rename=self.rename_weight,
            skip=lambda n: n.startswith(ignored + drop) or n.startswith(("cls.", "lm_head.")),
            strict=strict,
        )


class BertModel(EncoderBase):
    """BERT's encoder: embeddings pooled from its final hidden states."""


class RobertaModel(EncoderBase):
    """RoBERTa / XLM-RoBERTa's encoder (bge-m3, e5-multilingual)."""

    prefix = "roberta"
    roberta_positions = True

    @staticmethod
    def max_positions(config) -> int:
        return int(config.max_position_embeddings) - int(config.pad_token_id) - 1


class BertForSequenceClassification(BertModel):
    """BERT with transformers' head: classifier(tanh(pooler(h[CLS])))."""

    pooler = True

    def __init__(self, config) -> None:
        super().__init__(config)
        self.classifier = nn.Linear(config.hidden_size, int(config.num_labels))

    def rename_weight(self, name: str) -> str:
        return name if name.startswith("classifier.") else super().rename_weight(name)

    def classify(self, cls_rows: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, labels]
        return self.classifier(torch.tanh(self.pooler_head.dense(cls_rows)))


class RobertaClassificationHead(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.out_proj = nn.Linear(config.hidden_size, int(config.num_labels))


class RobertaForSequenceClassification(RobertaModel):
    """RoBERTa with transformers' head: out_proj(tanh(dense(h[CLS]))) (bge-reranker)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.classifier = RobertaClassificationHead(config)

    def rename_weight(self, name: str) -> str:
        return name if name.startswith("classifier.") else super().rename_weight(name)

    def classify(self, cls_rows: torch.Tensor) -> torch.Tensor:
        head = self.classifier
        return head.out_proj(torch.tanh(head.dense(cls_rows)))


class TokenClassifierHead:
    """Mixin (before BertModel / RobertaModel) for transformers' `*ForTokenClassification` head:
    `classifier` (a linear layer; the dropout before it is identity at inference) on every
    token's final hidden state, served as task "token_classify" (dslim/bert-base-NER,
    xlm-roberta-large-finetuned-conll03). The stack has no pooler (`add_pooling_layer=False`):
    an older checkpoint's pooler weights are skipped."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.classifier = nn.Linear(config.hidden_size, int(config.num_labels))

    def rename_weight(self, name: str) -> str:
        return name if name.startswith("classifier.") else super().rename_weight(name)

    def classify(self, rows: torch.Tensor) -> torch.Tensor:  # [T, D] -> [T, labels]
        return self.classifier(rows)


class BertForTokenClassification(TokenClassifierHead, BertModel):
    """BERT labelling each token: classifier(h)."""


class RobertaForTokenClassification(TokenClassifierHead, RobertaModel):
    """RoBERTa / XLM-RoBERTa labelling each token: classifier(h)."""


ENCODERS: dict[str, type[nn.Module]] = {
    "BertModel": BertModel,
    "BertForSequenceClassification": BertForSequenceClassification,
    "RobertaModel": RobertaModel,
    "XLMRobertaModel": RobertaModel,
    # a masked-LM checkpoint served as its encoder, the LM head's weights skipped (as vLLM)
    "RobertaForMaskedLM": RobertaModel,
    "RobertaForSequenceClassification": RobertaForSequenceClassification,
    "XLMRobertaForSequenceClassification": RobertaForSequenceClassification,
    "BertForTokenClassification": BertForTokenClassification,
    "RobertaForTokenClassification": RobertaForTokenClassification,
    "XLMRobertaForTokenClassification": RobertaForTokenClassification,
}
