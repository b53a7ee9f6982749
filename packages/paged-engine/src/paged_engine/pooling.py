"""Embeddings from a decoder model (vLLM's pooling API: `LLM.embed`, `PoolingParams`).

A pooling request is a generation request that ends at its prefill: it runs through the same
scheduler and step as every other request (chunked prefill, preemption, batching with decodes),
samples one throwaway token greedily and finishes by length. On every step that computes some of
its prompt, the worker pools the final (normed) hidden states of those positions
(worker/pooler.py) and the output processor adds the chunks up:

    LAST: the hidden state of the last prompt token (what vLLM uses for decoder embed models)
    CLS:  the hidden state of the first prompt token (BERT's [CLS]: encoder models)
    MEAN: the mean over every prompt token (prefix caching is off for such requests: cached
          positions never run through the model; likewise for CLS)
    ALL:  every prompt token's own row (vLLM's token tasks, `LLM.encode(pooling_task=
          "token_embed" | "token_classify")`: [num_prompt_tokens, size]; no prefix caching)
    STEP: ALL, keeping the rows of one token id's positions (a process reward model's step tags)

then L2-normalizes (unless `normalize=False`) into `EmbeddingRequestOutput.outputs.embedding`.
A sequence-classification model pools its head's logits instead and puts them through its
activation (classification.py): `LLM.classify`, and `LLM.score` for a cross-encoder.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from paged_engine.classification import activate
from paged_engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from paged_engine.classification import ClassifierInfo

POOLING_TYPES = ("LAST", "MEAN", "CLS")
# What a pooling request computes: an embedding; a classifier's label probabilities; a
# single-label classifier's (cross-encoder's) score of a text pair; and vLLM's token tasks, one
# row per prompt token: its embedding (token_embed), its label probabilities (token_classify).
POOLING_TASKS = ("embed", "classify", "score", "token_embed", "token_classify")
TOKEN_TASKS = ("token_embed", "token_classify")
# rows [n, hidden] -> [n, out]: the Dense modules between pooling and normalizing
Projection = Callable[[list[list[float]]], list[list[float]]]


@dataclass(slots=True)
class PoolingParams:
    """Per-request pooling options (vLLM's names). `dimensions` keeps an embedding's first
    `dimensions` values before it is normalized (Matryoshka truncation): only for a model whose
    config says it was trained for it (`is_matryoshka`, or `matryoshka_dimensions` listing the
    sizes allowed), else only the hidden size itself; `normalize=None` takes the engine's
    `pooler_config` (normalized by default, as vLLM does for embedding models);
    `truncate_prompt_tokens=k` pools only k of the prompt's tokens, cut on the tokenizer's
    truncation_side (vLLM's: the first k on a pooling-only engine, the last k where it also
    generates) (-1: max_model_len of them: a pooling prompt may fill the context, its one token
    is never run). For a
    classifier: `use_activation=False` returns the head's raw logits instead of probabilities
    (None: on). `task` is set by the `LLM` method that runs it
    (None: the model's own, "classify" for a classifier, else "embed")."""

    normalize: bool | None = None
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None
    use_activation: bool | None = None
    task: str | None = None

    def __post_init__(self) -> None:
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a bool or None, got {self.normalize!r}")
        v = self.dimensions
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"dimensions must be a positive int or None, got {v!r}")
        k = self.truncate_prompt_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < -1 or k == 0):
            raise ValueError(f"truncate_prompt_tokens must be an int >= 1, -1 or None, got {k!r}")
        if self.use_activation is not None and not isinstance(self.use_activation, bool):
            raise ValueError(f"use_activation must be a bool or None, got {self.use_activation!r}")
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {POOLING_TASKS} or None, got {self.task!r}")

    def clone(self) -> PoolingParams:
        """vLLM's: a copy sharing nothing with self."""
        return copy.deepcopy(self)


def is_pooling(params: Any) -> bool:
    """A pooling request (pooling.PoolingSamplingParams): its one sampled token is thrown
    away, never fed back, so its prompt may fill max_model_len (vLLM's pooling runner)."""
    return hasattr(params, "pooling_type")


def check_prompt_len(num: int, what: str, max_len: int, pooling: bool) -> None:
    """ValueError naming the length unless `num` prompt positions fit: all max_len of them
    for pooling, max_len - 1 for generation (room for at least one token)."""
    if num > max_len or (num == max_len and not pooling):
        why = "" if pooling else " (the prompt must leave room for at least one generated token)"
        raise ValueError(f"prompt is too long: {num} {what}, but max_model_len is {max_len}{why}")


def check_truncation(keep: int, max_model_len: int) -> None:
    """ValueError naming truncate_prompt_tokens when `keep` exceeds max_model_len (vLLM's
    rule, whatever the prompt's length)."""
    if keep > max_model_len:
        raise ValueError(
            f"truncate_prompt_tokens={keep} is greater than max_model_len ({max_model_len}): "
            "select a smaller truncation size"
        )


def truncation_limit(keep: int | None, max_model_len: int, *, generate: bool = False) -> int | None:
    """How many tokens `truncate_prompt_tokens=keep` keeps, checked (check_truncation): -1 is
    as many as a prompt may hold, max_model_len for pooling (vLLM's pooling runner) and
    max_model_len - 1 when `generate` (room for a token); None: no cut."""
    if keep is None:
        return None
    check_truncation(keep, max_model_len)
    if keep == -1:
        return max_model_len - 1 if generate else max_model_len
    return keep


def truncated(
    token_ids: list[int],
    keep: int | None,
    max_model_len: int,
    *,
    generate: bool = False,
    side: str = "left",
) -> list[int]:
    """`truncate_prompt_tokens`: `truncation_limit(keep)` of the prompt's tokens, its last
    ones when `side` is "left" (the start cut off), its first ones when "right" (vLLM's
    tokenizer truncation_side). `token_ids` itself when nothing is cut."""
    limit = truncation_limit(keep, max_model_len, generate=generate)
    if limit is None or len(token_ids) <= limit:
        return token_ids
    return token_ids[-limit:] if side == "left" else token_ids[:limit]


def encode_truncated(
    tokenizer: Any,
    text: str,
    keep: int | None,
    max_model_len: int,
    *,
    generate: bool = False,
    side: str | None = None,
    add_special_tokens: bool = True,
) -> list[int]:
    """A text prompt's ids with `truncate_prompt_tokens` applied as vLLM's renderer does: the
    tokenizer itself truncates to `keep` (HF's truncation=True, max_length=keep), so the special
    tokens it adds ([CLS] ... [SEP], BOS) stay and the text is cut on `side` (default: the
    tokenizer's truncation_side); `truncated` then slices what still exceeds `keep` (a `keep`
    smaller than the special tokens, which HF leaves uncut). Token-id prompts: `truncated`."""
    limit = truncation_limit(keep, max_model_len, generate=generate)
    if limit is None:
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
    own = getattr(tokenizer, "truncation_side", "left")
    side = side or own
    try:
        if side != own:  # (restored below: the engine's tokenizer keeps its side)
            tokenizer.truncation_side = side
        ids = tokenizer.encode(
            text, add_special_tokens=add_special_tokens, truncation=True, max_length=limit
        )
    except TypeError:  # not an HF tokenizer: no truncation kwargs; slice the ids
        ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    finally:
        if side != own:
            tokenizer.truncation_side = own
    return truncated(list(ids), keep, max_model_len, generate=generate, side=side)


@dataclass(slots=True)
class PoolingSamplingParams(SamplingParams):
    """What the engine runs for a pooling request: one greedy token, never detokenized, plus
    how to pool. Built by `to_sampling_params`; not a user-facing class."""

    pooling_type: str = "LAST"
    normalize: bool = True
    dimensions: int | None = None  # keep the first k values before normalizing (Matryoshka)
    classify: bool = False  # pool the classifier head's logits, not the hidden states
    activation: str = "identity"  # of the pooled logits (classification.ACTIVATIONS)
    head_after_pooling: bool = False  # the worker's MEAN chunk is the head's final logits
    step_tag_id: int | None = None  # ALL keeps only this prompt token's rows (STEP pooling)


def to_sampling_params(
    params: PoolingParams,
    pooler_config: dict | None,
    hidden_size: int,
    classifier: ClassifierInfo | None = None,
    matryoshka: tuple[int, ...] | None = None,
) -> PoolingSamplingParams:
    """The engine's form of a pooling request; ValueError naming the parameter when the model
    cannot run it (a classifier does not embed, an embedding model does not classify, only a
    single-label classifier scores). `matryoshka`: the embedding sizes the model was trained
    for (() = any up to its hidden size; None: it was not)."""
    cfg = check_pooler_config(pooler_config)
    task = params.task or (
        "embed" if classifier is None else "token_classify" if classifier.per_token else "classify"
    )
    if classifier is None:
        if task not in ("embed", "token_embed"):
            raise ValueError(
                f"task={task!r} needs a sequence-classification model "
                "(*ForSequenceClassification); this one embeds"
            )
        dims = params.dimensions
        if dims is not None and dims != hidden_size:
            if matryoshka is None:
                raise ValueError(
                    f"dimensions={dims} is not supported: this model's embeddings have "
                    f"{hidden_size} dimensions and it was not trained for truncated "
                    "(Matryoshka) ones"
                )
            if dims > hidden_size or (matryoshka and dims not in matryoshka):
                sizes = list(matryoshka) if matryoshka else f"1..{hidden_size}"
                raise ValueError(f"dimensions={dims} is not supported: this model's are {sizes}")
        normalize = cfg["normalize"] if params.normalize is None else params.normalize
        truncate = dims if dims is not None and dims < hidden_size else None
        head: dict[str, Any] = {"normalize": normalize, "dimensions": truncate}
    else:
        # (a token classifier first: LLM.classify, named below, refuses it too)
        if classifier.per_token and task != "token_classify":
            raise ValueError(
                f"task={task!r} is not supported: this model ({classifier.architecture}) is a "
                "token classifier, it labels each token; use LLM.encode(..., "
                "pooling_task='token_classify') (HTTP: /pooling)"
            )
        if task in ("embed", "token_embed"):
            raise ValueError(
                f"task={task!r} is not supported: this model ({classifier.architecture}) is a "
                "classifier; use LLM.classify (or LLM.score for a single-label one)"
            )
        if task == "token_classify" and classifier.head_after_pooling:
            raise ValueError(
                f"task='token_classify' is not supported: this model "
                f"({classifier.architecture}) pools its tokens before its head"
            )
        if task == "score" and not classifier.scores:
            raise ValueError(
                f"task='score' needs a single-label classifier (a cross-encoder); this one has "
                f"{classifier.num_labels} labels: use LLM.classify"
            )
        for name in ("normalize", "dimensions"):
            if getattr(params, name) is not None:
                raise ValueError(f"{name} applies to embeddings, not to a classifier's output")
        act = classifier.score_activation if task == "score" else classifier.activation
        act = act if params.use_activation is not False else "identity"
        head = {
            "normalize": False,
            "classify": True,
            "activation": act,
            "head_after_pooling": classifier.head_after_pooling,
            "step_tag_id": classifier.step_tag_id,
        }
    return PoolingSamplingParams(
        temperature=0.0,
        max_tokens=1,
        ignore_eos=True,
        detokenize=False,
        pooling_type="ALL" if task in TOKEN_TASKS else cfg["pooling_type"],
        truncate_prompt_tokens=params.truncate_prompt_tokens,
        **head,
    )


def check_pooler_config(pooler_config: dict | None) -> dict:
    """{"pooling_type": "LAST" | "MEAN" | "CLS", "normalize": bool} with defaults filled in."""
    cfg = {"pooling_type": "LAST", "normalize": True}
    unknown = set(pooler_config or {}) - set(cfg)
    if unknown:
        raise ValueError(f"pooler_config has unknown keys {sorted(unknown)}; use {sorted(cfg)}")
    cfg.update(pooler_config or {})
    cfg["pooling_type"] = str(cfg["pooling_type"]).upper()
    if cfg["pooling_type"] not in POOLING_TYPES:
        raise ValueError(
            f"pooler_config.pooling_type must be one of {POOLING_TYPES}, "
            f"got {pooler_config['pooling_type']!r}"
        )
    if not isinstance(cfg["normalize"], bool):
        raise ValueError(f"pooler_config.normalize must be a bool, got {cfg['normalize']!r}")
    return cfg


@dataclass(slots=True)
class PooledChunks:
    """The worker's pooled pieces of one request, by first prompt position. A recompute after
    a preemption starts again at position 0 and replaces what was there."""

    chunks: dict[int, tuple[int, list[float]]] = field(default_factory=dict)

    def add(self, start: int, count: int, vector: list[float]) -> None:
        if start == 0:
            self.chunks.clear()
        self.chunks[start] = (count, vector)

    def finish(
        self,
        params: PoolingSamplingParams,
        num_prompt_tokens: int,
        prompt_token_ids: Sequence[int] = (),
        project: Projection | None = None,
    ) -> list:
        """The pooled vector, or for ALL one row per prompt token (each normalized, cut to
        `dimensions` or put through the activation as a whole vector would be; with a
        `step_tag_id`, only the rows where `prompt_token_ids` hold it). `project`: the
        model's sentence-transformers Dense modules, run on an embedding's pooled vector (each
        row of ALL) before its cut and normalization (models/st_modules.py)."""
        project = None if params.classify else project
        if params.pooling_type == "ALL":  # the chunks' rows tile [0, num_prompt_tokens)
            rows: list[list[float]] = []
            while len(rows) < num_prompt_tokens:
                rows += self.chunks[len(rows)][1]
            if params.step_tag_id is not None:
                rows = [r for r, t in zip(rows, prompt_token_ids) if t == params.step_tag_id]
            rows = project(rows) if project is not None and rows else rows
            return [_finish_vector(params, row) for row in rows]
        if params.pooling_type == "LAST":  # the worker sends the last position alone
            pooled = list(self.chunks[num_prompt_tokens - 1][1])
        elif params.pooling_type == "CLS" or params.head_after_pooling:  # and the first alone
            pooled = list(self.chunks[0][1])
        else:
            pos, total = 0, None
            while pos < num_prompt_tokens:  # the chunks tile [0, num_prompt_tokens)
                count, vec = self.chunks[pos]
                total = list(vec) if total is None else [a + b for a, b in zip(total, vec)]
                pos += count
            assert total is not None
            pooled = [v / num_prompt_tokens for v in total]
        pooled = project([pooled])[0] if project is not None else pooled
        return _finish_vector(params, pooled)


def row_width(chunks: PooledChunks, params: PoolingSamplingParams) -> int:
    """The width of one finished ALL row (STEP pooling may keep none: vLLM's [0, width])."""
    return len(_finish_vector(params, chunks.chunks[0][1][0]))


def _finish_vector(params: PoolingSamplingParams, pooled: list[float]) -> list[float]:
    """A classifier's activation, or an embedding's Matryoshka cut and normalization."""
    if params.classify:
        return activate(pooled, params.activation)
    if params.dimensions is not None:
        pooled = pooled[: params.dimensions]
    if params.normalize:
        norm = math.sqrt(sum(v * v for v in pooled))
        pooled = [v / max(norm, 1e-12) for v in pooled]
    return pooled


@dataclass(slots=True)
class PoolingOutput:
    data: Any  # torch.Tensor [hidden_size] float32; [num_prompt_tokens, size] for token tasks


@dataclass(slots=True)
class PoolingRequestOutput:
    """vLLM's `PoolingRequestOutput`: what the engine returns for a pooling request."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (vLLM's)


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """vLLM's `EmbeddingRequestOutput` (`LLM.embed`): `outputs.embedding` is a list of floats."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None
    num_cached_tokens: int = 0

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> EmbeddingRequestOutput:
        embedding = EmbeddingOutput(out.outputs.data.tolist())
        return cls(
            out.request_id,
            embedding,
            out.prompt_token_ids,
            out.finished,
            out.prompt,
            out.num_cached_tokens,
        )


def matryoshka_sizes(hf_config: Any) -> tuple[int, ...] | None:
    """The truncated embedding sizes a model was trained for (vLLM's reading of its config):
    `matryoshka_dimensions` listed; () for `is_matryoshka` without a list (any size); None."""
    sizes = getattr(hf_config, "matryoshka_dimensions", None)
    if sizes:
        return tuple(int(d) for d in sizes)
    return () if getattr(hf_config, "is_matryoshka", False) else None
