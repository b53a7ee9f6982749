"""`VoyageQwen3BidirectionalEmbedModel` (Voyage AI's open embedding releases, e.g.
voyageai/voyage-4-nano; vLLM's models/voyage.py): Qwen3's decoder run as an encoder, with a
linear embedding head.

config.json is transformers' Qwen3 (`model_type="qwen3"`) plus `num_labels`, the width of the
embedding. The layers, weights and arithmetic are paged's Qwen3 (models/qwen3.py through the
headless base-model class of models/base_model.py: q / k norms, SwiGLU, the final norm); each
layer's paged `Attention` is swapped for `BidirectionalAttention` (models/gemma3_encoder.py),
which attends each sequence over all of itself, as vLLM sets `is_causal = False` for this name
whatever config.json says. After the final norm every position goes through the bias-free
`linear` head [num_labels, hidden] (checkpoint name `linear.weight`, top level; the decoder under
`model.`), so the rows pooled are `num_labels` wide (`pooled_width`).

    h = norm(layers(embed(ids)))    # [T, hidden], full attention within each sequence
    rows = h @ linear.T              # [T, num_labels]; then the engine pools

Pooling: sentence-transformers' files when the directory has them (engine/encoder.py), else the
mean over the prompt, normalized: the release's own pooling (SGLang hard-codes it; vLLM's model
card passes `--pooler-config '{"pooling_type": "MEAN"}'`, which paged applies unasked). The head
is linear, so pooling its rows equals the head on the pooled hidden state.

Sliding-window attention (`use_sliding_window: true`) is refused by name: the releases do not use
it and no reference says how a bidirectional window would apply.
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from paged_engine.models.base_model import headless
from paged_engine.models.gemma3_encoder import BidirectionalDecoder
from paged_engine.models.qwen3 import Qwen3ForCausalLM


def check_config(config) -> None:
    """ValueError naming the config.json field paged cannot serve under this name."""
    if getattr(config, "use_sliding_window", False):
        raise ValueError(
            "config.json field 'use_sliding_window'=true is not supported for "
            "VoyageQwen3BidirectionalEmbedModel (bidirectional attention over the whole sequence)"
        )
    labels = getattr(config, "num_labels", None)
    if not isinstance(labels, int) or labels < 1:
        raise ValueError(
            "config.json field 'num_labels' (the embedding width of the `linear` head) must be a "
            f"positive int for VoyageQwen3BidirectionalEmbedModel, got {labels!r}"
        )


class VoyageQwen3BidirectionalEmbedModel(
    BidirectionalDecoder,
    headless(Qwen3ForCausalLM, "Qwen3ForCausalLM"),  # type: ignore[misc]
):
    """Qwen3's headless stack, bidirectional in every layer, then the `linear` head per row."""

    default_pooler_config: ClassVar[dict] = {"pooling_type": "MEAN", "normalize": True}

    def __init__(self, config) -> None:
        check_config(config)
        super().__init__(config)
        self.linear = nn.Linear(config.hidden_size, int(config.num_labels), bias=False)

    @staticmethod
    def pooled_width(config) -> int:
        """The width of the rows pooled (engine/llm_engine.py): `num_labels`, not hidden."""
        return int(config.num_labels)

    def rename_weight(self, name: str) -> str:
        # the head sits at the top level, outside the decoder prefix the base puts back
        return name if name.startswith("linear.") else super().rename_weight(name)

    def forward(self, input_ids, positions, kv_caches, attn_metadata, hidden=None):
        h = super().forward(input_ids, positions, kv_caches, attn_metadata, hidden)
        return self.linear(h)  # [T, hidden] -> [T, num_labels]


VOYAGE: dict[str, type[nn.Module]] = {
    "VoyageQwen3BidirectionalEmbedModel": VoyageQwen3BidirectionalEmbedModel,
}

__all__ = ["VOYAGE", "VoyageQwen3BidirectionalEmbedModel", "check_config"]
