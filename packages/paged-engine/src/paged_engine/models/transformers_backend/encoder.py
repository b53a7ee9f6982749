"""Encoder-only models through the Transformers modeling backend: HF's own modeling code of a
bidirectional encoder (BERT, RoBERTa, ELECTRA, ERNIE, CamemBERT, X-MOD, ...) run on paged's
encoder path (engine/encoder.py), for embeddings and sequence classification.

vLLM's `TransformersEmbeddingModel` / `TransformersForSequenceClassification` (its
vllm/model_executor/models/transformers/) serve these: a text-only model with an attention
module whose `is_causal` is False is an encoder, and its layers get vLLM's encoder-only attention
(no KV cache); pooling defaults to CLS. paged does the same here:

- Detection (`is_encoder_only`, vLLM's rule): HF's base model of the config, built on the meta
  device, has a module with `is_causal=False`; the config is text-only, not an encoder-decoder,
  and its architecture is no causal LM.
- Served architectures: a base `<Stem>Model` (or vLLM's embedding names) embeds,
  `TransformersEncoderModel`; a `*ForSequenceClassification` (or vLLM's classifier names)
  classifies and scores pairs, `TransformersEncoderForSequenceClassification`, with HF's own
  head module on the [CLS] row (BERT: the backbone's `pooler` then `classifier`; RoBERTa /
  ELECTRA: `classifier`, dense + out_proj, reading position 0 of the sequence it is given). Token
  classifiers, masked-LM / pre-training heads, QA and multiple-choice heads are refused by name,
  as is a classifier whose HF class holds weights outside its backbone and its head.
- Attention: the model is built with `attn_implementation="paged_encoder"`, a function that runs
  torch SDPA over each sequence's own keys (bidirectional; keys past a sequence's length masked
  out). The step's sequences (each whole, engine/encoder.py) run as padded HF batches
  [B, L], longest first, each of at most the step's own tokens (`padded_groups`): HF's
  embeddings compute their own positions per row (BERT 0..n-1, RoBERTa's from
  `pad_token_id + 1`) as HF does for an unpadded sequence, and the real rows are scattered back
  to the step's flat [T, D]. BERT-style token types are 1 after a sequence's first [SEP]
  (what a tokenizer gives a text pair: models/bert.py's `pair_token_types`); RoBERTa's family
  takes none. No KV memory.
- Pooling: engine/encoder.py's (sentence-transformers files, else CLS normalized), as for the
  native encoders; vLLM's defaults are the same.

Checkpoint names are HF's: the backbone sits under the HF class's `base_model_prefix`, added to a
base checkpoint's names (saved without it)."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.classification import SUFFIX
from paged_engine.layers.attention import AttentionMetadata
from paged_engine.models.bert import EncoderShell, pair_token_types, sequence_bounds
from paged_engine.models.transformers_backend.causal import STEP_KWARG
from paged_engine.models.transformers_backend.selection import HEAD_NAMES, _refuse, architectures
from paged_engine.models.utils import load_named_weights

ENCODER_IMPL = "paged_encoder"  # the attention function's name in transformers' interface
_MEMO = "paged_encoder_only"  # is_encoder_only's answer, kept on the config
_EMBED_NAMES = ("TransformersEmbeddingModel", "TransformersMoEEmbeddingModel")
_CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")
# architecture suffix -> what it is: heads this backend does not run on an encoder
_REFUSED_HEADS = {
    "ForTokenClassification": "token classification",
    "ForMaskedLM": "masked-LM heads",
    "ForPreTraining": "pre-training heads",
    "ForQuestionAnswering": "question answering",
    "ForMultipleChoice": "multiple choice",
    "ForNextSentencePrediction": "next-sentence prediction",
}


def _meta_backbone(hf_config) -> nn.Module | None:
    """HF's base model of the config on the meta device; None where transformers has none."""
    from transformers import AutoModel

    try:
        with torch.device("meta"):
            return AutoModel.from_config(copy.deepcopy(hf_config))
    except (ValueError, KeyError, TypeError, AttributeError, ImportError, RuntimeError):
        return None


def is_encoder_only(hf_config) -> bool:
    """Whether HF's model of this config is a bidirectional encoder (see the module docstring)."""
    memo = getattr(hf_config, _MEMO, None)
    if memo is not None:
        return bool(memo)
    archs = architectures(hf_config)
    found = not (
        getattr(hf_config, "is_encoder_decoder", False)
        or hf_config.get_text_config() is not hf_config
        or any(
            a.endswith(_CAUSAL_SUFFIXES) or a.startswith("TransformersMultiModal") for a in archs
        )
        or any(a in ("TransformersForCausalLM", "TransformersMoEForCausalLM") for a in archs)
    )
    if found:
        backbone = _meta_backbone(hf_config)
        found = backbone is not None and any(
            not getattr(m, "is_causal", True) for m in backbone.modules()
        )
    setattr(hf_config, _MEMO, found)
    return found


def encoder_kind(hf_config) -> str:
    """An encoder architecture's kind, "embed" or "classify"; ValueError naming one refused."""
    for arch in architectures(hf_config):
        if arch in _EMBED_NAMES:
            return "embed"
        if arch.endswith(SUFFIX):  # vLLM's classifier names included
            return "classify"
        what = next((w for s, w in _REFUSED_HEADS.items() if arch.endswith(s)), None)
        if what is not None:
            raise _refuse(
                f"architecture {arch}: {what} is not supported for encoder-only models (only "
                f"a base <Stem>Model and *{SUFFIX})"
            )
        if arch.endswith("Model"):
            return "embed"
    archs = ", ".join(architectures(hf_config)) or "none"
    raise _refuse(f"architectures {archs}: no encoder-only architecture this backend serves")


def check_encoder_config(hf_config) -> type:
    """HF's class of the encoder's served architecture (its AutoModel, or its
    AutoModelForSequenceClassification), or ValueError naming what is refused."""
    from transformers.models.auto import modeling_auto

    kind = encoder_kind(hf_config)
    model_type = getattr(hf_config, "model_type", None)
    if kind == "classify":
        cls = modeling_auto.AutoModelForSequenceClassification._model_mapping.get(
            type(hf_config), None
        )
    else:
        cls = modeling_auto.AutoModel._model_mapping.get(type(hf_config), None)
    if cls is None:
        raise _refuse(f"transformers has no {kind} model of encoder model_type {model_type!r}")
    if not getattr(cls, "_supports_attention_backend", False):
        raise _refuse(
            f"{cls.__name__} does not support custom attention (_supports_attention_backend)"
        )
    for name in ("sliding_window", "attention_window"):
        if getattr(hf_config, name, None):
            raise _refuse(
                f"config.{name}={getattr(hf_config, name)!r}: windowed encoders are not supported"
            )
    return cls


def _encoder_attention(
    module: nn.Module,
    query: torch.Tensor,  # [B, H, L, D]
    key: torch.Tensor,  # [B, Hkv, L, D]
    value: torch.Tensor,  # [B, Hkv, L, D]
    attention_mask: torch.Tensor | None,  # None: transformers builds none for this function
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: [B, L, H, D], no weights. Row b attends to its
    first lengths[b] keys only (the padded batch of `TransformersEncoderModel.forward`)."""
    lengths = kwargs.get(STEP_KWARG)
    if lengths is None:
        raise RuntimeError(f"attn_implementation={ENCODER_IMPL!r} runs only inside paged's engine")
    if attention_mask is not None:  # a bias or mask of the model's own: not expressible here
        raise RuntimeError(
            f"{type(module).__name__}: an attention mask of its own is not supported"
        )
    if kwargs.get("sliding_window") or kwargs.get("softcap"):  # (refused at build where seen)
        raise RuntimeError(f"{type(module).__name__}: windowed or soft-capped attention")
    if key.shape[1] != query.shape[1]:
        rep = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
    keys = torch.arange(query.shape[2], device=query.device)
    mask = (keys[None, :] < lengths[:, None])[:, None, None, :]  # [B, 1, 1, L]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def padded_groups(lengths: list[int]) -> list[list[int]]:
    """The step's sequences (their lengths) in groups, longest first, each a padded HF batch of
    at most sum(lengths) rows (its count x its longest): padding one long sequence's length onto
    many short ones costs no more than the step's own tokens (one [B, max L] batch of a
    max_model_len prompt and max_num_seqs - 1 one-token ones held max_num_seqs x max_model_len
    rows through every layer)."""
    budget = sum(lengths)
    groups: list[list[int]] = []
    for b in sorted(range(len(lengths)), key=lambda b: -lengths[b]):
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= budget:
            groups[-1].append(b)
        else:
            groups.append([b])
    return groups


def register_encoder_attention() -> None:
    """Register the "paged_encoder" attention function with transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ENCODER_IMPL, _encoder_attention)


class TransformersEncoderModel(EncoderShell):
    """HF's encoder with per-sequence bidirectional attention, pooled by the engine."""

    def __init__(self, config) -> None:
        super().__init__(config)
        hf_class = check_encoder_config(config)
        register_encoder_attention()
        self.inner_name = hf_class.base_model_prefix or "model"
        setattr(self, self.inner_name, self._build(hf_class, config))
        backbone = getattr(self, self.inner_name)
        self.backbone_children: set[str] = {n for n, _ in backbone.named_children()}
        self.backbone_children |= {n for n, _ in backbone.named_parameters(recurse=False)}
        self.pad_id = int(getattr(config, "pad_token_id", None) or 0)
        embeddings = getattr(backbone, "embeddings", None)
        # BERT-style token types; not for RoBERTa's family (positions counted from a
        # `padding_idx`), whose tokenizers give none, as models/bert.py's RobertaModel
        self.token_types = (
            isinstance(getattr(embeddings, "token_type_embeddings", None), nn.Embedding)
            and int(getattr(config, "type_vocab_size", 1) or 1) > 1
            and getattr(embeddings, "padding_idx", None) is None
        )

    def _build(self, hf_class: type, config) -> nn.Module:
        from transformers import AutoModel

        return AutoModel.from_config(
            copy.deepcopy(config), attn_implementation=ENCODER_IMPL, dtype=torch.get_default_dtype()
        ).eval()

    @staticmethod
    def max_positions(config) -> int:
        """RoBERTa-style embeddings (a `padding_idx` they count positions from) lose the first
        pad_token_id + 1 positions, as models/bert.py's RobertaModel."""
        limit = int(config.max_position_embeddings)
        backbone = _meta_backbone(config)
        pad = getattr(getattr(backbone, "embeddings", None), "padding_idx", None)
        return limit - int(pad) - 1 if isinstance(pad, int) else limit

    def rename_weight(self, name: str) -> str:
        """A base checkpoint's names (no prefix) under the backbone's attribute."""
        if name.split(".", 1)[0] in self.backbone_children:
            return f"{self.inner_name}.{name}"
        return name

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True
    ) -> set[str]:
        owned = tuple(f"{n}." for n, _ in self.named_children())
        # another task's head weights (a masked-LM checkpoint's `cls.`, a classifier's head)
        return load_named_weights(
            self,
            weights,
            rename=self.rename_weight,
            skip=lambda n: not n.startswith(owned) or n.endswith(".position_ids"),
            strict=strict,
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T] (HF's embeddings compute each row's own)
        kv_caches: list,
        attn_metadata: AttentionMetadata,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [T, D]
        if hidden is not None:
            raise _refuse("prompt embeddings are not supported for encoder-only models")
        bounds = sequence_bounds(attn_metadata)
        flat: torch.Tensor | None = None
        for group in padded_groups([hi - lo for lo, hi in bounds]):
            rows = self._padded([bounds[b] for b in group], input_ids)  # [B, L, D]
            if flat is None:  # padding rows stay zero
                flat = rows.new_zeros(input_ids.shape[0], rows.shape[-1])
            for row, b in enumerate(group):
                lo, hi = bounds[b]
                flat[lo:hi] = rows[row, : hi - lo]
        assert flat is not None, "an encoder step has at least one sequence"
        return flat

    def _padded(self, bounds: list[tuple[int, int]], input_ids: torch.Tensor) -> torch.Tensor:
        """These sequences as one padded HF batch -> its last hidden state [B, L, D]."""
        lengths = [hi - lo for lo, hi in bounds]
        # padded batch: row b holds sequence b at [0, lengths[b]), pad_token_id after it
        ids = input_ids.new_full((len(bounds), max(lengths)), self.pad_id)
        for b, (lo, hi) in enumerate(bounds):
            ids[b, : hi - lo] = input_ids[lo:hi]
        kwargs: dict[str, Any] = {STEP_KWARG: torch.tensor(lengths, device=input_ids.device)}
        sep = getattr(self.config, "sep_token_id", None)
        if self.token_types and sep is not None:  # 1 after the first [SEP] (a text pair)
            kwargs["token_type_ids"] = pair_token_types(ids, sep)
        out = getattr(self, self.inner_name)(input_ids=ids, use_cache=False, **kwargs)
        return out.last_hidden_state


class TransformersEncoderForSequenceClassification(TransformersEncoderModel):
    """HF's `*ForSequenceClassification` of an encoder: its backbone, and its own head on the
    pooled [CLS] row (`classify`)."""

    def _build(self, hf_class: type, config) -> nn.Module:
        hf = hf_class._from_config(
            copy.deepcopy(config), attn_implementation=ENCODER_IMPL, dtype=torch.get_default_dtype()
        ).eval()  # (built whole: its head and backbone are kept, the rest is param-free)
        self.head_name = next((n for n in HEAD_NAMES if hasattr(hf, n)), None)
        if self.head_name is None:
            raise _refuse(f"{hf_class.__name__} has no `classifier` / `score` head")
        prefix = hf_class.base_model_prefix or "model"
        extra = [
            n
            for n, m in hf.named_children()
            if n not in (prefix, self.head_name) and any(True for _ in m.parameters())
        ]
        if extra:
            raise _refuse(f"{hf_class.__name__} has weights outside its backbone and head: {extra}")
        setattr(self, self.head_name, getattr(hf, self.head_name))
        backbone = getattr(hf, prefix)
        # the head's input: BERT's pooler (dense + tanh of position 0) where the backbone has one
        self.pooler_first = isinstance(getattr(backbone, "pooler", None), nn.Module)
        num_labels = int(config.num_labels)
        with torch.no_grad():  # HF's head on two [CLS] rows gives [2, num_labels], or it is refused
            weight = next(backbone.parameters())
            probe = weight.new_zeros(2, int(config.hidden_size))
            got = self._head(backbone, probe).shape
        if tuple(got) != (2, num_labels):
            raise _refuse(
                f"{hf_class.__name__}'s head gives {tuple(got)} for two rows, not (2, {num_labels})"
            )
        return backbone

    def _head(self, backbone: nn.Module, rows: torch.Tensor) -> torch.Tensor:
        x = rows[:, None, :]  # [N, 1, D]: each [CLS] row as a one-token sequence
        if self.pooler_first:
            x = backbone.pooler(x)  # [N, D]
        return getattr(self, self.head_name)(x)

    def classify(self, cls_rows: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, labels]
        return self._head(getattr(self, self.inner_name), cls_rows)


def encoder_model_class(hf_config) -> type[nn.Module]:
    """The class for an encoder config `select_model_impl` marked."""
    if encoder_kind(hf_config) == "classify":
        return TransformersEncoderForSequenceClassification
    return TransformersEncoderModel


__all__ = [
    "TransformersEncoderForSequenceClassification",
    "TransformersEncoderModel",
    "check_encoder_config",
    "encoder_kind",
    "encoder_model_class",
    "is_encoder_only",
]
