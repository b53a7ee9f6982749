"""`SamplingMetadata`: the sampling settings of one step's rows as device tensors.

The worker keeps every live sequence's settings in preallocated per-row arrays (`InputBatch`);
a step gathers the rows it samples into one `SamplingMetadata`. A field is None when it is off
for every row, so the common cases (all greedy, plain temperature) skip whole passes over the
[N, V] logits. Flags are decided on the host from the arrays, never by reading the device.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import Tensor

from paged_engine.sampling_params import SamplingParams
from paged_engine.structured_output.bitmask import bitmask_width

# Token id that pads history rows; the penalty passes scatter it into a discarded column.
PAD = -1


@dataclass(slots=True)
class Penalties:
    """Repetition penalty over prompt + output tokens; frequency / presence over outputs."""

    rows: Tensor  # [P] int64 rows of the logits that use any penalty
    repetition: Tensor  # [P, 1] float32, 1.0 = off
    frequency: Tensor  # [P, 1] float32
    presence: Tensor  # [P, 1] float32
    prompt_ids: Tensor  # [P, Lp] int64, padded with PAD
    output_ids: Tensor  # [P, Lo] int64, padded with PAD


@dataclass(slots=True)
class SamplingMetadata:
    num_rows: int
    all_greedy: bool
    greedy: Tensor | None  # [N] bool; None unless greedy and random rows mix
    temperature: Tensor | None  # [N, 1] float32 (1.0 for greedy rows); None when all 1.0
    top_k_top_p: tuple[Tensor, Tensor, Tensor] | None  # (rows, top_k [R, 1], top_p [R, 1])
    top_k_only: bool  # every filtered row has top_p == 1: a topk serves, no full sort
    max_top_k: int  # the largest top_k of the filtered rows (vocab when off)
    min_p: tuple[Tensor, Tensor] | None  # (rows, min_p [R, 1])
    penalties: Penalties | None
    banned: tuple[Tensor, Tensor] | None  # (rows, token ids) masked to -inf: min_tokens
    seeds: list[tuple[int, int]]  # (row, seed of this draw) for seeded rows
    num_logprobs: list[int | None]  # per row: top-k logprobs to return (None: not reported)
    need_logprobs: bool  # any row reports logprobs or ranks its samples by them
    # Token rules (SamplingParams.allowed_token_ids / logit_bias; structured outputs): applied
    # first, each as one batched op over its rows.
    allowed: tuple[Tensor, Tensor] | None = None  # (rows [A], bitmask [A, W] int32)
    logit_bias: tuple[Tensor, Tensor, Tensor] | None = None  # (rows, token ids, biases) [B]
    token_bitmask: tuple[Tensor, Tensor] | None = None  # this step's grammar masks (rows, bitmask)
    # logprob_token_ids rows: (rows [E], ids [E, M]), each row's ids padded with its first
    logprob_ids: tuple[Tensor, Tensor] | None = None
    # custom logits processors (LLM(logits_processors=...)) bound to this step's rows:
    # `.run(x, argmax_invariant)` (worker/logits_processors.py)
    custom: Any = None

    @property
    def max_num_logprobs(self) -> int:
        return max((k for k in self.num_logprobs if k), default=0)


def _dev(values: np.ndarray | Sequence, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Host values on `device`; through pinned memory on CUDA so the copy does not wait."""
    t = torch.as_tensor(np.asarray(values)).to(dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


def _padded(rows: list[list[int]]) -> np.ndarray:
    width = max((len(r) for r in rows), default=0)
    out = np.full((len(rows), max(width, 1)), PAD, dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def build_sampling_metadata(
    *,
    device: torch.device,
    vocab_size: int,
    temperature: np.ndarray,  # [N] float; < SAMPLING_EPS means greedy
    top_k: np.ndarray,  # [N] int, 0 = off
    top_p: np.ndarray,  # [N] float, 1.0 = off
    min_p: np.ndarray,  # [N] float, 0.0 = off
    repetition: np.ndarray,  # [N] float, 1.0 = off
    frequency: np.ndarray,  # [N] float, 0.0 = off
    presence: np.ndarray,  # [N] float, 0.0 = off
    history: Sequence[tuple[list[int], list[int]] | None],  # (prompt, outputs) of penalty rows
    banned: Sequence[Collection[int]],  # [N] token ids banned this step (min_tokens)
    seeds: list[tuple[int, int]],
    num_logprobs: list[int | None],
    need_logprobs: bool,
    output_history: Tensor | None = None,  # [P, Lo] int64 on device, overrides history outputs
    prompt_history: Tensor | None = None,  # [P, Lp] int64 on device, overrides history prompts
    token_rules: Sequence[tuple[int, SamplingParams]] = (),  # rows with allowed ids / logit bias
    logprob_ids: Sequence[tuple[int, Sequence[int]]] = (),  # (row, logprob_token_ids)
) -> SamplingMetadata:
    """Everything host-side is numpy over the N rows: no per-row Python except for the rare
    rows that use penalties or min_tokens."""
    n = len(temperature)
    greedy = temperature < 1e-5
    all_greedy = bool(greedy.all())
    temps = np.where(greedy, 1.0, temperature)
    k = np.where((top_k > 0) & (top_k < vocab_size), top_k, vocab_size)
    filtered = np.flatnonzero((k < vocab_size) | (top_p < 1.0))
    top_k_top_p = None
    if filtered.size:
        top_k_top_p = (
            _dev(filtered, torch.long, device),
            _dev(k[filtered, None], torch.long, device),
            _dev(top_p[filtered, None], torch.float32, device),
        )
    min_p_rows = np.flatnonzero(min_p > 0.0)
    penalty_rows = np.flatnonzero((repetition != 1.0) | (frequency != 0.0) | (presence != 0.0))
    penalties = None
    if penalty_rows.size:
        hist = [history[i] for i in penalty_rows]
        if output_history is None or prompt_history is None:
            assert all(h is not None for h in hist), "penalty rows need their token history"
        outputs = (
            output_history
            if output_history is not None
            else _dev(_padded([h[1] for h in hist]), torch.long, device)
        )
        prompts = (
            prompt_history
            if prompt_history is not None
            else _dev(_padded([h[0] for h in hist]), torch.long, device)
        )
        penalties = Penalties(
            rows=_dev(penalty_rows, torch.long, device),
            repetition=_dev(repetition[penalty_rows, None], torch.float32, device),
            frequency=_dev(frequency[penalty_rows, None], torch.float32, device),
            presence=_dev(presence[penalty_rows, None], torch.float32, device),
            prompt_ids=prompts,
            output_ids=outputs,
        )
    ban_rows: list[int] = []
    ban_ids: list[int] = []
    for i, ids in enumerate(banned):
        for t in ids:
            if 0 <= t < vocab_size:
                ban_rows.append(i)
                ban_ids.append(t)
    return SamplingMetadata(
        num_rows=n,
        all_greedy=all_greedy,
        greedy=_dev(greedy, torch.bool, device) if greedy.any() and not all_greedy else None,
        temperature=None if (temps == 1.0).all() else _dev(temps[:, None], torch.float32, device),
        top_k_top_p=top_k_top_p,
        top_k_only=bool((top_p[filtered] >= 1.0).all()),
        max_top_k=int(k[filtered].max()) if filtered.size else vocab_size,
        min_p=(
            (
                _dev(min_p_rows, torch.long, device),
                _dev(min_p[min_p_rows, None], torch.float32, device),
            )
            if min_p_rows.size
            else None
        ),
        penalties=penalties,
        banned=(
            (_dev(ban_rows, torch.long, device), _dev(ban_ids, torch.long, device))
            if ban_rows
            else None
        ),
        seeds=seeds,
        num_logprobs=num_logprobs,
        need_logprobs=need_logprobs,
        logprob_ids=_explicit_ids(logprob_ids, device),
        **_token_rules(token_rules, vocab_size, device),
    )


def _explicit_ids(
    rows: Sequence[tuple[int, Sequence[int]]], device: torch.device
) -> tuple[Tensor, Tensor] | None:
    """(rows, ids [E, M]) of the logprob_token_ids rows; a shorter row repeats its first id
    (the host keeps only its own count of columns)."""
    if not rows:
        return None
    width = max(len(ids) for _, ids in rows)
    ids = np.array([[*ids, *[ids[0]] * (width - len(ids))] for _, ids in rows], dtype=np.int64)
    return _dev([r for r, _ in rows], torch.long, device), _dev(ids, torch.long, device)


def _token_rules(
    rules: Sequence[tuple[int, SamplingParams]], vocab_size: int, device: torch.device
) -> dict:
    """allowed_token_ids as bitmask rows and logit_bias as flat (row, id, bias) triples."""
    if not rules:
        return {}
    allowed_rows, masks, bias_rows, bias_ids, biases = [], [], [], [], []
    for row, p in rules:
        if p.allowed_token_ids:
            bits = np.zeros(bitmask_width(vocab_size) * 32, dtype=np.uint8)
            bits[p.allowed_token_ids] = 1
            masks.append(np.packbits(bits, bitorder="little").view(np.int32))
            allowed_rows.append(row)
        for token, bias in (p.logit_bias or {}).items():
            bias_rows.append(row)
            bias_ids.append(token)
            biases.append(bias)
    out: dict = {}
    if allowed_rows:
        out["allowed"] = (
            _dev(allowed_rows, torch.long, device),
            _dev(np.stack(masks), torch.int32, device),
        )
    if bias_rows:
        out["logit_bias"] = (
            _dev(bias_rows, torch.long, device),
            _dev(bias_ids, torch.long, device),
            _dev(biases, torch.float32, device),
        )
    return out


def with_token_bitmask(
    md: SamplingMetadata,
    token_bitmask: tuple[list[int], np.ndarray],
    row_seq_ids: Sequence[int],
    device: torch.device,
) -> SamplingMetadata:
    """`md` plus this step's grammar masks: (seq ids, [R, W] bitmask) from the engine core,
    matched to the logits rows by sequence: a sequence's rows in order take its masks in order
    (a speculative row's d + 1 positions), and a sequence with one mask gives it to each of its
    rows (a fan-out's samples)."""
    index: dict[int, tuple[int, int]] = {}  # seq id -> (first mask row, masks)
    for i, seq_id in enumerate(token_bitmask[0]):
        first, count = index.get(seq_id, (i, 0))
        index[seq_id] = (first, count + 1)
    seen: dict[int, int] = {}
    rows, picks = [], []
    for k, seq_id in enumerate(row_seq_ids):
        entry = index.get(seq_id)
        if entry is not None:
            nth = seen.get(seq_id, 0)
            seen[seq_id] = nth + 1
            rows.append(k)
            picks.append(entry[0] + min(nth, entry[1] - 1))
    if not rows:
        return md
    bitmask = _dev(token_bitmask[1][picks], torch.int32, device)
    return replace(md, token_bitmask=(_dev(rows, torch.long, device), bitmask))


def banned_tokens(
    params: SamplingParams, num_outputs: int, eos_token_ids: Collection[int]
) -> set[int]:
    """Token ids masked while the row has fewer than min_tokens outputs: eos (unless ignored) and
    the stop token ids."""
    if num_outputs >= params.min_tokens:
        return set()
    banned = set(params.all_stop_token_ids).union(params.stop_token_ids)
    if not params.ignore_eos:
        banned.update(eos_token_ids)
    return banned


def draw_seed(seed: int, index: int, position: int) -> int:
    """The generator seed of one seeded draw: a function of the request's seed, the sample's
    index and its output position only, so the draw is the same whatever else runs in the batch,
    whether the step was scheduled ahead (async) and whether the sequence was preempted."""
    x = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + position) & (2**64 - 1)
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & (2**64 - 1)
    return (x ^ (x >> 31)) & (2**63 - 1)


def metadata_from_params(
    params: Sequence[SamplingParams],
    device: torch.device,
    vocab_size: int,
    *,
    prompts: Sequence[list[int]] | None = None,
    outputs: Sequence[list[int]] | None = None,
    eos_token_ids: Sequence[Collection[int]] | None = None,
    indices: Sequence[int] | None = None,
) -> SamplingMetadata:
    """One row per params (tests and one-off callers; the worker fills arrays in place)."""
    n = len(params)
    prompts = prompts or [[] for _ in range(n)]
    outputs = outputs or [[] for _ in range(n)]
    eos = eos_token_ids or [() for _ in range(n)]
    indices = indices or [0] * n

    def arr(name: str, dtype) -> np.ndarray:
        return np.array([getattr(p, name) for p in params], dtype=dtype).reshape(n)

    return build_sampling_metadata(
        device=device,
        vocab_size=vocab_size,
        temperature=arr("temperature", np.float64),
        top_k=arr("top_k", np.int64),
        top_p=arr("top_p", np.float64),
        min_p=arr("min_p", np.float64),
        repetition=arr("repetition_penalty", np.float64),
        frequency=arr("frequency_penalty", np.float64),
        presence=arr("presence_penalty", np.float64),
        history=list(zip(prompts, outputs)),
        banned=[banned_tokens(p, len(o), e) for p, o, e in zip(params, outputs, eos)],
        seeds=[
            (i, draw_seed(p.seed, indices[i], len(outputs[i])))
            for i, p in enumerate(params)
            if p.seed is not None and not p.is_greedy
        ],
        num_logprobs=[p.num_top_logprobs for p in params],
        need_logprobs=any(p.logprobs is not None or (p.best_of or 0) > p.n for p in params),
        token_rules=[(i, p) for i, p in enumerate(params) if p.logit_bias or p.allowed_token_ids],
        logprob_ids=[(i, p.logprob_token_ids) for i, p in enumerate(params) if p.logprob_token_ids],
    )
