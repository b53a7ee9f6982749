"""SPLADE sparse embeddings from a BERT masked-LM checkpoint: vLLM's
`BertSpladeSparseEmbeddingModel` (chosen by name, e.g. `hf_overrides={"architectures":
["BertSpladeSparseEmbeddingModel"]}` on a `BertForMaskedLM` release such as naver/splade-v3).

The encoder is paged's BERT (models/bert.py); on top runs transformers' MLM head
(`cls.predictions`: dense, activation, LayerNorm, decoder to the vocabulary, its bias) on every
token, and each sequence pools

    s = max over its tokens t of log(1 + relu(mlm(h_t)))              [vocab_size], >= 0

as vLLM's `SPLADESparsePooler` does with its only reachable mode ("max"). Like vLLM, a leading
`config.cls_token_id` and a trailing `config.sep_token_id` are left out of the max when the
config names them (only the ids config.json itself declares: the engine does not fill them from
the tokenizer for this class, engine/encoder.py); a sequence with no token left pools zeros.

The engine serves it through `LLM.embed` (task "embed", vLLM's only task for this output): the
model's forward writes its sequence's vector into every row of that sequence, so whatever token
the pooler picks (CLS by default) returns it; not normalized by default (vLLM's SPLADE pooler
has no normalize step). The token task ("token_embed") is refused by name: the rows hold the
pooled vector, not per-token states. The forward's output is [step tokens, vocab_size] (the MLM
logits of one sequence at a time on top), where an encoder's is [step tokens, hidden_size].
The decoder's weight is the word embedding when the checkpoint ties them (transformers'
`tie_word_embeddings`, then no `cls.predictions.decoder.weight` is saved), as transformers
loads it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from paged_engine.layers.attention import AttentionMetadata
from paged_engine.models.bert import BertModel, activation, sequence_bounds
from paged_engine.models.utils import load_named_weights


class BertPredictionTransform(nn.Module):
    """transformers' `cls.predictions.transform`: LayerNorm(act(dense(h)))."""

    def __init__(self, config) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.act = activation(getattr(config, "hidden_act", "gelu"))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.act(self.dense(h)))


class BertLMPredictionHead(nn.Module):
    """transformers' `cls.predictions`: [n, hidden] -> MLM logits [n, vocab]."""

    def __init__(self, config) -> None:
        super().__init__()
        self.transform = BertPredictionTransform(config)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.transform(h)) + self.bias


class BertSpladeSparseEmbeddingModel(BertModel):
    """BERT plus its MLM head, pooled into one SPLADE vector [vocab_size] per sequence."""

    default_pooler_config: ClassVar[dict] = {"pooling_type": "CLS", "normalize": False}
    # the tokens left out are the ones config.json names (engine/encoder.py keeps its ids)
    config_token_ids_only: ClassVar[bool] = True
    # every row of a sequence is its pooled vector: no per-token task
    pooled_rows: ClassVar[bool] = True

    def __init__(self, config) -> None:
        super().__init__(config)
        self.cls = nn.Module()
        self.cls.predictions = BertLMPredictionHead(config)
        self.cls_id = getattr(config, "cls_token_id", None)
        self.end_id = getattr(config, "sep_token_id", None)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list,
        attn_metadata: AttentionMetadata,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [T, vocab]: each sequence's rows hold its SPLADE vector, padding zero
        h = super().forward(input_ids, positions, kv_caches, attn_metadata, hidden)
        out = h.new_zeros(h.shape[0], self.config.vocab_size)
        for lo, hi in sequence_bounds(attn_metadata):
            head, tail = int(input_ids[lo]), int(input_ids[hi - 1])
            first = lo + int(self.cls_id is not None and head == self.cls_id)
            last = hi - int(self.end_id is not None and tail == self.end_id)  # exclusive
            if last <= first:
                continue  # nothing left to pool: zeros, as vLLM
            scores = torch.log1p(torch.relu(self.cls.predictions(h[first:last])))
            out[lo:hi] = scores.max(0).values
        return out

    @staticmethod
    def pooled_width(config) -> int:
        """The embedding's width (engine/llm_engine.py: `dimensions`): the vocabulary."""
        return int(config.vocab_size)

    def rename_weight(self, name: str) -> str:
        if name.startswith("cls.predictions.decoder.bias"):  # older saves tie it to .bias
            return "cls.predictions.bias"
        return name if name.startswith("cls.") else super().rename_weight(name)

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True
    ) -> set[str]:
        decoder = "cls.predictions.decoder.weight"
        tied = bool(getattr(self.config, "tie_word_embeddings", True))

        def with_decoder() -> Iterable[tuple[str, torch.Tensor]]:
            seen = False
            for name, w in weights:
                seen = seen or self.rename_weight(name) == decoder
                yield name, w
            if tied and not seen:  # transformers' tie: the word embedding, loaded by now
                yield decoder, self.embeddings.word_embeddings.weight.detach()

        ignored = ("embeddings.position_ids", "embeddings.token_type_ids", "pooler_head.")
        return load_named_weights(
            self,
            with_decoder(),
            rename=self.rename_weight,
            skip=lambda n: n.startswith(ignored),
            strict=strict,
        )


SPLADE: dict[str, type[nn.Module]] = {
    "BertSpladeSparseEmbeddingModel": BertSpladeSparseEmbeddingModel,
}
