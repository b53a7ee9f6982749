"""`*ForSequenceClassification`: a causal LM's decoder with HF's `score` head in place of the LM
head (paged_engine/classification.py says how requests use it).

HF saves such a model as its causal sibling's decoder (the same names) plus `score.weight`
[num_labels, hidden] (and `score.bias` where the class has one), with no LM head. The engine
still samples one throwaway token per pooling request: `ZeroLogits` gives it all-zero logits
without a [vocab, hidden] weight. The head is replicated on every tensor-parallel rank (the final
hidden states are whole there) and runs in the model dtype, as HF's.
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


@functools.cache
def sequence_classifier(base: type[nn.Module]) -> type[nn.Module]:
    """The classification model class over `base` (a CausalLMBase subclass)."""

    class SequenceClassifier(base):  # type: ignore[misc, valid-type]
        def __init__(self, config) -> None:
            super().__init__(config)
            width = self.get_submodule(self.embed_path).weight.shape[1]
            setattr(self, self.head_name, ZeroLogits(config.vocab_size))
            self.tie_word_embeddings = False  # no head to tie, nor a copy of it to skip
            # a bias is added when the checkpoint carries one (load_weights)
            self.score = nn.Linear(width, int(config.num_labels), bias=False)

        def rename_weight(self, name: str) -> str:
            # the head sits at the top level, outside every decoder prefix a base may add
            return name if name.startswith("score.") else super().rename_weight(name)

        def classify(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, num_labels]
            return self.score(hidden)

        def load_weights(
            self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True
        ) -> set[str]:
            loaded = super().load_weights(self._take_score_bias(weights), strict)
            return loaded | ({"score.bias"} if self.score.bias is not None else set())

        def _take_score_bias(
            self, weights: Iterable[tuple[str, torch.Tensor]]
        ) -> Iterable[tuple[str, torch.Tensor]]:
            for name, w in weights:
                if name != "score.bias":
                    yield name, w
                    continue
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
