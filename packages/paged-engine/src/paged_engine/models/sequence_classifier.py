"""`*ForSequenceClassification`: a causal LM's decoder with HF's `score` head in place of the LM
head (paged_engine/classification.py says how requests use it).

HF saves such a model as its causal sibling's decoder (the same names) plus `score.weight`
[num_labels, hidden] (and `score.bias` where the class has one), with no LM head. The engine
still samples one throwaway token per pooling request: `ZeroLogits` gives it all-zero logits
without a [vocab, hidden] weight. The head is replicated on every tensor-parallel rank (the final
hidden states are whole there) and runs in the model dtype, as HF's.

A causal-LM checkpoint served as a classifier (hf_overrides naming a *ForSequenceClassification
and `classifier_from_token`: Qwen3-Reranker, bge-reranker-v2-gemma) has no `score.weight`: the
head is built from the LM head's rows of those tokens as the weights stream past
(classification.py, `resolve_from_token`), in float32 and then cast, as vLLM builds it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
from torch import nn


class ZeroLogits(nn.Module):
    """An LM head without weights: [N, D] -> zeros [N, vocab] float32."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.new_zeros(hidden.shape[0], self.vocab_size, dtype=torch.float32)


class ScoreHead:
    """Mixin (before a CausalLMBase subclass) for a decoder whose LM head is `ZeroLogits` and
    whose `classify` runs a top-level `score` module; shared by the sequence classifiers here
    and models/reward_model.py."""

    def _drop_lm_head(self, config) -> int:
        """Replaces the LM head by `ZeroLogits`; returns the hidden width for `score`."""
        width = self.get_submodule(self.embed_path).weight.shape[1]
        setattr(self, self.head_name, ZeroLogits(config.vocab_size))
        self.tie_word_embeddings = False  # no head to tie, nor a copy of it to skip
        return width

    def rename_weight(self, name: str) -> str:
        # the head sits at the top level, outside every decoder prefix a base may add
        return name if name.startswith("score.") else super().rename_weight(name)

    def classify(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, num_labels]
        return self.score(hidden)


@functools.cache
def sequence_classifier(base: type[nn.Module]) -> type[nn.Module]:
    """The classification model class over `base` (a CausalLMBase subclass)."""

    class SequenceClassifier(ScoreHead, base):  # type: ignore[misc, valid-type]
        def __init__(self, config) -> None:
            super().__init__(config)
            width = self._drop_lm_head(config)
            # a bias is added when the checkpoint carries one (load_weights)
            self.score = nn.Linear(width, int(config.num_labels), bias=False)

        def load_weights(
            self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True
        ) -> set[str]:
            loaded = super().load_weights(self._head_stream(weights, strict), strict)
            return loaded | ({"score.bias"} if self.score.bias is not None else set())

        def _head_stream(
            self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool
        ) -> Iterable[tuple[str, torch.Tensor]]:
            """The checkpoint less what the base class has no parameter for: `score.bias`
            (becomes the head's bias) and a causal LM's head; with classifier_from_token, then
            the head built from that LM head's (or tied embedding's) token rows."""
            ids = getattr(self.config, "classifier_from_token_ids", None)
            tied = bool(getattr(self.config, "tie_word_embeddings", base.tie_default))
            source = f"{self.embed_path if tied else self.head_name}.weight"
            rows = None
            for name, w in weights:
                if name == "score.bias":
                    self._set_bias(w)
                    continue
                ours = self.rename_weight(name)
                if ids is not None and ours == source:
                    rows = w[ids].float()  # a copy: `w` may map a file closed later
                if ours.startswith(f"{self.head_name}."):
                    continue  # ZeroLogits has no weights: a causal checkpoint's head
                yield name, w
            if ids is None or (rows is None and not strict):  # (an update may leave the head)
                return
            if rows is None:
                raise ValueError(
                    f"{type(self).__name__}: classifier_from_token needs the checkpoint's LM "
                    f"head ({source})"
                )
            if self.config.method == "from_2_way_softmax":
                rows = rows[1:2] - rows[0:1]  # [true] - [false]
            yield "score.weight", rows

        def _set_bias(self, w: torch.Tensor) -> None:
            head = self.score
            if w.shape != (head.out_features,):
                raise ValueError(
                    f"cannot load weight 'score.bias': expected {(head.out_features,)}, "
                    f"got {tuple(w.shape)}"
                )
            head.bias = nn.Parameter(
                w.to(head.weight.dtype, copy=True).to(head.weight.device), requires_grad=False
            )

    SequenceClassifier.__name__ = SequenceClassifier.__qualname__ = (
        base.__name__.removesuffix("ForCausalLM").removesuffix("LMHeadModel")
        + "ForSequenceClassification"
    )
    return SequenceClassifier
