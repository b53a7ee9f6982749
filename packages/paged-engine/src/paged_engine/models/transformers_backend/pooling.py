"""Pooling through the Transformers modeling backend (causal.py): embeddings and
sequence classification on HF's own modeling code with paged attention.

vLLM's classes (vllm/model_executor/models/transformers/pooling.py) and paged's counterparts:

    TransformersEmbeddingModel [MoE]          a base `<Stem>Model` checkpoint (or one of vLLM's
                                              embedding names): HF's backbone, no LM head; it only
                                              pools (paged's native base models: base_model.py)
    TransformersForSequenceClassification     a `*ForSequenceClassification`: HF's backbone and
                              [MoE]           HF's linear head (`score`, or `classifier`: vLLM
                                              looks for both) on the pooled row; it only pools
    TransformersForCausalLM [MoE]             a causal LM pooled by the engine (runner="pooling",
                                              convert="embed"), as paged pools every decoder
    TransformersMultiModalEmbeddingModel      a vision-language checkpoint's text half, no LM
                                              head, images spliced in (multimodal.py)

The backbone is causal.py's in every case: `AutoModel.from_config` by the config's
model type (the backend's checks, refusals and MoE expert stacking included), so a pooling
architecture is served where transformers has a `*ForCausalLM` of that model type supporting
custom attention. The engine pools the final normed hidden states as it does for native classes
(pooling.py, worker/pooler.py): LAST unless `pooler_config` or sentence-transformers' files say
MEAN / CLS, L2-normalized for embeddings as vLLM does; a classifier's head runs on the pooled row
and its activation is classification.py's (softmax over labels, sigmoid for one). vLLM's
Transformers pooling classes default to CLS pooling, which on a causal decoder reads the first
token alone; paged keeps its native default (the last token, which is what HF's
`*ForSequenceClassification` of a decoder pools), and `pooler_config={"pooling_type": "CLS"}`
gives vLLM's.

vLLM's class names are accepted as architectures (`hf_overrides={"architectures":
["TransformersForSequenceClassification"]}`): vLLM's registry maps them to these classes whatever
`model_impl` says, and they build the model of the config's `model_type`; the MoE spellings name
the same classes here (paged runs HF's own experts either way). On a vision-language checkpoint
(multimodal.py) `TransformersMultiModalEmbeddingModel` embeds, images included, as
`runner="pooling"` on `TransformersMultiModalForCausalLM` does; vLLM's
`TransformersMultiModalForSequenceClassification`, a VLM's `convert="classify"`, token
classifiers and reward models through the backend are refused by name.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
from torch import nn

from paged_engine.classification import SUFFIX, TOKEN_SUFFIX, causal_names
from paged_engine.models.base_model import HeadlessLM, causal_candidates
from paged_engine.models.multimodal_text import MARKER
from paged_engine.models.sequence_classifier import sequence_classifier
from paged_engine.models.transformers_backend.causal import TransformersForCausalLM
from paged_engine.models.transformers_backend.selection import HEAD_NAMES, _refuse, architectures

# vLLM's Transformers backend architectures -> what paged serves them as
VLLM_ARCHS: dict[str, str] = {
    "TransformersForCausalLM": "generate",
    "TransformersMoEForCausalLM": "generate",
    "TransformersEmbeddingModel": "embed",
    "TransformersMoEEmbeddingModel": "embed",
    "TransformersForSequenceClassification": "classify",
    "TransformersMoEForSequenceClassification": "classify",
    "TransformersMultiModalForCausalLM": "generate",  # multimodal.py
    "TransformersMultiModalMoEForCausalLM": "generate",
    "TransformersMultiModalEmbeddingModel": "embed",  # multimodal.py
}
_MULTIMODAL_PREFIX = "TransformersMultiModal"  # vLLM's multimodal spellings


def vllm_arch(hf_config) -> str | None:
    """The config's architecture when it is one of vLLM's Transformers backend names (these
    ask for the backend whatever `model_impl` says); ValueError for a multimodal one on a
    checkpoint that is not a vision-language one."""
    for arch in architectures(hf_config):
        if arch.startswith(_MULTIMODAL_PREFIX):  # served on a VLM wrapper's text config only
            from paged_engine.models.transformers_backend.multimodal import VLLM_NAMES

            if arch not in VLLM_NAMES:  # ...ForSequenceClassification: see pooling_kind
                raise _refuse(
                    f"architecture {arch}: multimodal models are not supported here (only "
                    + ", ".join(VLLM_NAMES)
                    + ")"
                )
            if getattr(hf_config, MARKER, None) is None:
                raise _refuse(f"architecture {arch}: multimodal models need a VLM checkpoint")
            return arch
        if arch in VLLM_ARCHS:
            return arch
    return None


def pooling_kind(hf_config) -> str | None:
    """What the config's architecture pools: "embed" (a base `<Stem>Model`, vLLM's embedding
    names), "classify" (a `*ForSequenceClassification`) or None (a causal LM); ValueError naming
    a pooling architecture the backend does not run."""
    named = vllm_arch(hf_config)
    if named is not None:
        return None if VLLM_ARCHS[named] == "generate" else VLLM_ARCHS[named]
    for arch in architectures(hf_config):
        if arch.endswith((TOKEN_SUFFIX, "RewardModel")):
            raise _refuse(
                f"architecture {arch}: token classifiers and reward models are not supported "
                "(only *ForSequenceClassification and base <Stem>Model)"
            )
        if arch.endswith(SUFFIX) and causal_names(arch):
            if getattr(hf_config, MARKER, None) is not None:  # convert="classify" on a VLM
                raise _refuse(
                    f"architecture {arch} of {getattr(hf_config, MARKER)}: sequence classifiers "
                    "of vision-language checkpoints are not supported (only their generation "
                    "and embeddings)"
                )
            return "classify"
        if causal_candidates(arch):
            return "embed"
    return None


def causal_class(hf_config) -> type | None:
    """For a pooling architecture (or one of vLLM's names): HF's `*ForCausalLM` of the config's
    model type, whose backbone and checks the backend takes; None otherwise."""
    import transformers
    from transformers.models.auto import modeling_auto

    kind = pooling_kind(hf_config)
    if kind is None and vllm_arch(hf_config) is None:
        return None
    model_type = getattr(hf_config, "model_type", None)
    if kind == "classify" and model_type not in (
        modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES
    ):
        raise _refuse(f"transformers has no *ForSequenceClassification of {model_type!r}")
    name = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    return getattr(transformers, name, None) if name else None


class TransformersEmbeddingModel(HeadlessLM, TransformersForCausalLM):
    """HF's backbone without an LM head, pooled by the engine. Loads a base checkpoint (names
    without the decoder prefix, as HF saves its `<Stem>Model`) or a causal one (prefixed, its
    LM head skipped), as native base models do (base_model.py's `HeadlessLM`)."""

    def decoder_prefix(self) -> str:
        return self.inner_name  # HF's base_model_prefix of the causal class


class TransformersForSequenceClassification(sequence_classifier(TransformersForCausalLM)):
    """HF's backbone and HF's linear classification head (models/sequence_classifier.py's
    `score`, loaded from HF's `score.*` or `classifier.*`) on the pooled row."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.hf_head = _hf_head_name(config, self.inner_name)

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True
    ) -> set[str]:
        head = f"{self.hf_head}."
        renamed = ((f"score.{n[len(head) :]}" if n.startswith(head) else n, w) for n, w in weights)
        return super().load_weights(renamed, strict)


def _hf_head_name(config, prefix: str) -> str:
    """The name of HF's classification head in its `*ForSequenceClassification` of this model
    type ("classifier" or "score"); ValueError where that class has none of paged's shape (a
    linear layer [num_labels, hidden] at the top, the backbone under the causal LM's prefix)."""
    from transformers import AutoModelForSequenceClassification

    with torch.device("meta"):  # (causal_class refused a model type without one)
        hf = AutoModelForSequenceClassification.from_config(copy.deepcopy(config))
    name = next((n for n in HEAD_NAMES if isinstance(getattr(hf, n, None), nn.Module)), None)
    head = getattr(hf, name, None) if name else None
    if not isinstance(head, nn.Linear) or head.out_features != int(config.num_labels):
        raise _refuse(
            f"{type(hf).__name__}'s classification head is not a linear `score` / `classifier` "
            f"layer of num_labels={config.num_labels} outputs"
        )
    if (hf.base_model_prefix or "model") != prefix:
        raise _refuse(
            f"{type(hf).__name__} keeps its backbone under {hf.base_model_prefix!r}, not {prefix!r}"
        )
    return name


def transformers_model_class(hf_config) -> type[nn.Module]:
    """The backend's class for a config `select_model_impl` marked."""
    from paged_engine.models.transformers_backend.encoder import (
        encoder_model_class,
        is_encoder_only,
    )

    if is_encoder_only(hf_config):  # an encoder's embeddings or classifier
        return encoder_model_class(hf_config)
    kind = pooling_kind(hf_config)
    multimodal = getattr(hf_config, MARKER, None) is not None  # a VLM wrapper's language model
    if kind == "embed" and multimodal:
        from paged_engine.models.transformers_backend.multimodal import (
            TransformersMultiModalEmbeddingModel,
        )

        return TransformersMultiModalEmbeddingModel
    if kind == "embed":
        return TransformersEmbeddingModel
    if kind == "classify":
        return TransformersForSequenceClassification
    if multimodal:
        from paged_engine.models.transformers_backend.multimodal import (
            TransformersMultiModalForCausalLM,
        )

        return TransformersMultiModalForCausalLM
    return TransformersForCausalLM


__all__ = [
    "VLLM_ARCHS",
    "TransformersEmbeddingModel",
    "TransformersForSequenceClassification",
    "causal_class",
    "pooling_kind",
    "transformers_model_class",
    "vllm_arch",
]
