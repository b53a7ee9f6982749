"""Sequence classification (vLLM's `LLM.classify`; `LLM.score` with a cross-encoder) by an HF
`*ForSequenceClassification` decoder: the decoder, then a linear `score` head instead of the LM
head (models/sequence_classifier.py).

    logits = score(h)            h: the final normed hidden state of the last prompt token
                                 (pooler_config "MEAN": score(h) averaged over the prompt,
                                 the same as score(mean h): the head is linear)
    probs  = activation(logits)  per the config, as vLLM chooses (below)

A classification request is a pooling request (pooling.py) whose pooled vector is the head's
logits, so it batches, chunks and prefix-caches like an embedding. This module holds no torch:
paged-server imports it.

Activations (vLLM's rules, which follow transformers' training losses):
    classify: problem_type "regression" -> identity, "multi_label_classification" -> sigmoid,
              otherwise softmax over the labels, or sigmoid when there is a single label
    score:    the cross-encoder's own activation when the config names one (sentence-transformers'
              `activation_fn`, or `sbert_ce_default_activation_function`): Identity or Sigmoid /
              Softmax (torch.nn); otherwise classify's default
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from paged_engine.pooling import PoolingRequestOutput

SUFFIX = "ForSequenceClassification"
TOKEN_SUFFIX = "ForTokenClassification"  # the same head on every token (task token_classify)
ACTIVATIONS = ("softmax", "sigmoid", "identity")


def causal_names(arch: str) -> tuple[str, ...]:
    """The `*ForCausalLM` architectures whose decoder a `*ForSequenceClassification` may share
    (the same checkpoint names below the head), in the order to try; () for any other
    architecture. A text-only classifier of a multimodal family (Gemma3TextFor...,
    Qwen3_5TextFor...) shares its text model's."""
    suffix = next((s for s in (SUFFIX, TOKEN_SUFFIX) if arch.endswith(s)), None)
    if suffix is None:
        return ()
    stem = arch.removesuffix(suffix)
    if stem == "GPT2":
        return ("GPT2LMHeadModel",)
    names = (stem + "ForCausalLM",)
    return names + (stem.removesuffix("Text") + "ForCausalLM",) if stem.endswith("Text") else names


# A causal LM served as a classifier from its LM head's rows (vLLM's names): the config names the
# tokens (`classifier_from_token`) and the method (`method`; Qwen3-Reranker's
# `is_original_qwen3_reranker` means "from_2_way_softmax").
#   from_2_way_softmax  tokens [false, true]: one label, score = head[true] - head[false] (so its
#                       sigmoid is the softmax probability of `true` between the two)
#   no_post_processing  one label per token, score = head[token]
FROM_TOKEN_METHODS = ("from_2_way_softmax", "no_post_processing")


def resolve_from_token(hf_config: Any, tokenizer: Any) -> None:
    """For a config that builds its classifier from LM-head rows: `num_labels` set by the method
    and `classifier_from_token_ids` (the tokens' ids, what the loader reads) added. ValueError
    naming the field when the method or a token is unknown."""
    method = getattr(hf_config, "method", None)
    if method is None and getattr(hf_config, "is_original_qwen3_reranker", False):
        method = "from_2_way_softmax"
    tokens = getattr(hf_config, "classifier_from_token", None)
    if method is None:
        if tokens is not None:
            raise ValueError(
                f"classifier_from_token needs a method: {FROM_TOKEN_METHODS} (set 'method')"
            )
        return
    if method not in FROM_TOKEN_METHODS:
        raise ValueError(f"method={method!r} is not supported: use one of {FROM_TOKEN_METHODS}")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ValueError(
            f"classifier_from_token must be a non-empty list of tokens, got {tokens!r}"
        )
    if method == "from_2_way_softmax" and len(tokens) != 2:
        raise ValueError(
            f"classifier_from_token: from_2_way_softmax takes [false, true] tokens, got {tokens!r}"
        )
    ids = []
    for token in tokens:
        tid = tokenizer.convert_tokens_to_ids(token)
        if not isinstance(tid, int) or tid == getattr(tokenizer, "unk_token_id", None):
            raise ValueError(f"classifier_from_token: {token!r} is not a token of this tokenizer")
        ids.append(tid)
    hf_config.method = method
    hf_config.num_labels = 1 if method == "from_2_way_softmax" else len(ids)
    hf_config.classifier_from_token_ids = ids


# vLLM's reward models: architecture -> (num_labels, activation, STEP pooling's default step tag
# id, the config's `step_tag_id` overriding it; 0: every token), served as token classifiers.
REWARD_MODELS = {
    "Qwen2ForRewardModel": (1, "identity", 0),
    "Qwen2ForProcessRewardModel": (2, "softmax", 151651),  # Qwen2.5-Math-PRM's `<extra_0>`
    "InternLM2ForRewardModel": (1, "sigmoid", 0),  # vLLM's default on one column: no override
}


@dataclass(frozen=True, slots=True)
class ClassifierInfo:
    """What the engine and paged-server need to know of a classification model."""

    architecture: str
    num_labels: int
    labels: tuple[str, ...]  # label names in index order (config.id2label)
    activation: str  # LLM.classify's, one of ACTIVATIONS
    score_activation: str  # LLM.score's (a single-label cross-encoder)
    # The head is not linear and reads the mean over the prompt (ModernBERT's mean-pooled
    # classifiers): the worker pools first, then runs the head (an encoder's sequences are
    # whole in their step), instead of pooling the head's per-position logits.
    head_after_pooling: bool = False
    # A *ForTokenClassification: it labels every token (task "token_classify") and nothing else.
    per_token: bool = False
    # STEP pooling (a process reward model): only the rows of this prompt token's positions
    step_tag_id: int | None = None

    @property
    def scores(self) -> bool:
        """A single-label classifier scores text pairs (a cross-encoder / reranker)."""
        return self.num_labels == 1


def classifier_info(hf_config: Any) -> ClassifierInfo | None:
    """The model's classifier facts, or None when it is not a sequence classifier."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    reward = next((a for a in archs if a in REWARD_MODELS), None)
    if reward is not None:  # per-token heads of a fixed width (models/reward_model.py)
        num, act, step = REWARD_MODELS[reward]
        step = (getattr(hf_config, "step_tag_id", None) or step) if step else None
        labels = tuple(f"LABEL_{i}" for i in range(num))
        return ClassifierInfo(reward, num, labels, act, act, per_token=True, step_tag_id=step)
    arch = next((a for a in archs if causal_names(a)), None)
    if arch is None:
        return None
    id2label = dict(getattr(hf_config, "id2label", None) or {})
    num_labels = int(getattr(hf_config, "num_labels", None) or len(id2label) or 0)
    if num_labels < 1:
        raise ValueError(f"{arch}: num_labels must be >= 1, got {num_labels}")
    labels = tuple(
        str(id2label.get(i, id2label.get(str(i), f"LABEL_{i}"))) for i in range(num_labels)
    )
    default = "sigmoid" if num_labels == 1 else "softmax"
    problem = getattr(hf_config, "problem_type", None)
    activation = {"regression": "identity", "multi_label_classification": "sigmoid"}.get(
        problem, default
    )
    return ClassifierInfo(
        arch,
        num_labels,
        labels,
        activation,
        _score_activation(hf_config, default),
        per_token=arch.endswith(TOKEN_SUFFIX),
    )


def _score_activation(hf_config: Any, default: str) -> str:
    st = getattr(hf_config, "sentence_transformers", None)
    name = st.get("activation_fn") if isinstance(st, dict) else None
    name = name or getattr(hf_config, "sbert_ce_default_activation_function", None)
    if not name:
        return default
    cls = str(name).rsplit(".", 1)[-1]
    if not str(name).startswith("torch.nn.modules.") or cls not in (
        "Identity",
        "Sigmoid",
        "Softmax",
    ):
        raise ValueError(
            f"the cross-encoder's activation {name!r} is not supported: use "
            "torch.nn.modules.activation.Sigmoid, ...Softmax or torch.nn.modules.linear.Identity"
        )
    return "identity" if cls == "Identity" else default


def activate(logits: list[float], activation: str) -> list[float]:
    """One pooled row of logits through `activation` (float64 on the host)."""
    if activation == "identity":
        return list(logits)
    if activation == "sigmoid":
        return [_sigmoid(v) for v in logits]
    top = max(logits)
    exps = [math.exp(v - top) for v in logits]
    total = sum(exps)
    return [e / total for e in exps]


def _sigmoid(v: float) -> float:
    if v >= 0:
        return 1.0 / (1.0 + math.exp(-v))
    e = math.exp(v)
    return e / (1.0 + e)


@dataclass(slots=True)
class ClassificationOutput:
    probs: list[float]  # one per label (the raw logits when activation is off)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass(slots=True)
class ClassificationRequestOutput:
    """vLLM's `ClassificationRequestOutput` (`LLM.classify`): `outputs.probs`, one per label."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None
    num_cached_tokens: int = 0

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> ClassificationRequestOutput:
        probs = ClassificationOutput(out.outputs.data.tolist())
        return cls(
            out.request_id,
            probs,
            out.prompt_token_ids,
            out.finished,
            out.prompt,
            out.num_cached_tokens,
        )
