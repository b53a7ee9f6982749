"""`LlamaBidirectionalModel` (NVIDIA's llama-nemotron-embed / llama-3.2-nv-embedqa releases, vLLM's
`LlamaBidirectionalModel`): Llama's decoder run as an encoder, pooled as its config says.

The release ships remote code: config.json has `model_type="llama_bidirec"`, an `auto_map`, and
Llama's fields plus `pooling` ("avg", "cls" or "last"). `llama_bidirectional_config` reads it
as transformers' `LlamaConfig` without running that code (models/remote_aliases.py), keeping
`pooling`; any other value is refused naming the field, as vLLM refuses it.

The layers, weights and arithmetic are paged's Llama (models/llama.py through the headless
base-model class of models/base_model.py, so names with or without the `model.` prefix load);
each layer's paged `Attention` is swapped for `BidirectionalAttention` (models/gemma3_encoder.py),
which attends each sequence over all of itself: the remote class only drops Llama's causal mask
(rope and everything else as Llama). The engine then treats the model as an encoder
(engine/encoder.py: one step per sequence, no KV cache, pooling only).

Pooling, as vLLM maps `pooling` (its `LlamaBidirectionalConfig` sets it whatever else says so):
avg -> MEAN, cls -> CLS, last -> LAST, normalized by default; a `pooler_config` naming another
pooling type is refused (engine/encoder.py `config_pooling_type`).

`LlamaBidirectionalForSequenceClassification` (llama-nemotron-rerank releases; vLLM's
`as_seq_cls_model(LlamaForCausalLM)` under the same config rule): the same stack and a
bias-free `score` Linear [num_labels, hidden] read at the pooling `pooling` names. The head is
linear, so scoring each position and pooling (the worker's way) equals the remote code's
score(pool(h)). The activation is classification.py's (sigmoid on one label, as vLLM). The
remote code divides the logits by config.json's `temperature`, which vLLM ignores: a value
other than 1.0 is refused by name rather than served two ways.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import LlamaConfig, PretrainedConfig

from paged_engine.models.base_model import headless
from paged_engine.models.gemma3_encoder import BidirectionalDecoder
from paged_engine.models.llama import LlamaForCausalLM
from paged_engine.models.remote_aliases import field

# config.json `pooling` -> the engine's pooling type (vLLM's map)
POOLING = {"avg": "MEAN", "cls": "CLS", "last": "LAST"}
# fields of the remote config that LlamaConfig must not take as its own
_REMOTE_ONLY = ("auto_map", "model_type", "transformers_version", "_name_or_path", "torch_dtype")


def llama_bidirectional_config(raw: dict[str, Any]) -> PretrainedConfig:
    """The release's config.json as transformers' LlamaConfig (with `pooling`, checked)."""
    pooling = field(raw, "pooling", str, "avg")
    if pooling not in POOLING:
        raise ValueError(
            f"config.json field 'pooling'={pooling!r} is not supported for "
            f"LlamaBidirectionalModel: {sorted(POOLING)}"
        )
    fields = {k: v for k, v in raw.items() if k not in _REMOTE_ONLY}
    if raw.get("torch_dtype") is not None and "dtype" not in fields:
        fields["dtype"] = raw["torch_dtype"]
    return LlamaConfig(**{**fields, "pooling": pooling})


class LlamaBidirectionalModel(
    BidirectionalDecoder,
    headless(LlamaForCausalLM, "LlamaForCausalLM"),  # type: ignore[misc]
):
    """Llama's headless stack with bidirectional attention in every layer."""

    @staticmethod
    def config_pooling_type(config) -> str:
        """The pooling config.json's `pooling` names (avg when absent)."""
        pooling = getattr(config, "pooling", None) or "avg"
        if pooling not in POOLING:
            raise ValueError(f"config.pooling={pooling!r} is not supported: {sorted(POOLING)}")
        return POOLING[pooling]


def llama_bidirectional_classifier_config(raw: dict[str, Any]) -> PretrainedConfig:
    """The rerank release's config.json as LlamaConfig; `temperature` other than 1.0 refused."""
    temperature = field(raw, "temperature", (int, float), 1.0)
    if temperature != 1.0:
        raise ValueError(
            f"config.json field 'temperature'={temperature!r} is not supported for "
            "LlamaBidirectionalForSequenceClassification (vLLM ignores it, the remote code "
            "divides the logits by it): only 1.0"
        )
    return llama_bidirectional_config(raw)


class LlamaBidirectionalForSequenceClassification(LlamaBidirectionalModel):
    """The bidirectional stack with a bias-free `score` head on its pooled hidden state."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.score = nn.Linear(config.hidden_size, int(config.num_labels), bias=False)

    @staticmethod
    def classifier_pooling_type(config) -> str:
        """The head reads the pooling config.json's `pooling` names (engine/encoder.py)."""
        return LlamaBidirectionalModel.config_pooling_type(config)

    def rename_weight(self, name: str) -> str:
        # the head sits at the top level, outside the decoder prefix the base puts back
        return name if name.startswith("score.") else super().rename_weight(name)

    def classify(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, num_labels]
        return self.score(hidden)


LLAMA_BIDIRECTIONAL: dict[str, type[nn.Module]] = {
    "LlamaBidirectionalModel": LlamaBidirectionalModel,
    "LlamaBidirectionalForSequenceClassification": LlamaBidirectionalForSequenceClassification,
}
