"""What a worker step returns: `ModelRunnerOutput` (plain host data) and the handle that
produces it once the device results have reached the host.

    flat sample list, one entry per sampled token (a fan-out sequence appears k times):
    sampled_seq_ids [i] -> sampled_token_ids [i], logprobs row i (when any row asked)

Beam rows are not sampled: they return their top-k raw logprobs (`beam_topk`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from paged_engine.core.core_output import LogprobsLists, PromptLogprobsChunk
from paged_engine.sample.logprobs import unpack

# vLLM's switch for its corrupted_requests counter: the runner checks each step's logits for NaN
NANS_IN_LOGITS_ENV = ("PAGED_COMPUTE_NANS_IN_LOGITS", "VLLM_COMPUTE_NANS_IN_LOGITS")


def counts_nans_in_logits() -> bool:
    """Whether PAGED_COMPUTE_NANS_IN_LOGITS (or vLLM's name) is set to a true value."""
    value = next((os.environ[k] for k in NANS_IN_LOGITS_ENV if k in os.environ), "0")
    return value.strip().lower() not in ("", "0", "false", "no", "off")


@dataclass(slots=True)
class ModelRunnerOutput:
    step_id: int
    sampled_seq_ids: list[int] = field(default_factory=list)
    sampled_token_ids: list[int] = field(default_factory=list)
    logprobs: LogprobsLists | None = None  # aligned with the sampled tokens
    beam_topk: dict[int, tuple[list[float], list[int]]] = field(default_factory=dict)
    prompt_logprobs: dict[int, PromptLogprobsChunk] = field(default_factory=dict)
    # Embedding requests: seq id -> (first prompt position, positions, pooled vector)
    pooled: dict[int, tuple[int, int, list[float]]] = field(default_factory=dict)
    # kv_transfer_config: blocks the step should have loaded from storage and could not (their
    # sequences ran on stale KV: the engine core drops their results and recomputes them)
    invalid_block_ids: list[int] = field(default_factory=list)
    # counts_nans_in_logits(): the sequences whose logits held a NaN this step
    nan_seq_ids: list[int] = field(default_factory=list)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """Start a device -> host copy that does not block the host (pinned memory on CUDA)."""
    if t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


class AsyncRunnerOutput:
    """A step's results on their way to the host. Created right after the step's kernels are
    queued; `get()` waits for the copies (an event on CUDA; nothing on CPU) and unpacks."""

    def __init__(
        self,
        step_id: int,
        seq_ids: list[int],
        token_ids: torch.Tensor | None,  # [N] int64
        logprobs: torch.Tensor | None,  # [N, 3 + 3k] float64 packed (sample/logprobs.py)
        num_logprobs: list[int | None],
        beam: tuple[list[int], list[int], torch.Tensor, torch.Tensor] | None,
        prompt: list[tuple[int, int, int, torch.Tensor]],  # (seq_id, start, k, packed)
        pooled: list[tuple[int, int, int, torch.Tensor]] | None = None,  # worker/pooler.py
        nans: list[tuple[list[int], torch.Tensor]] | None = None,  # (seq ids, [rows] bool)
    ) -> None:
        self.step_id = step_id
        self._seq_ids = seq_ids
        self._num_logprobs = num_logprobs
        self._tokens = None if token_ids is None else _to_host(token_ids)
        self._logprobs = None if logprobs is None else _to_host(logprobs)
        self._beam = None
        if beam is not None:
            beam_ids, ks, lps, ids = beam
            self._beam = (beam_ids, ks, _to_host(lps), _to_host(ids))
        self._prompt = [(sid, start, k, _to_host(p)) for sid, start, k, p in prompt]
        self._pooled = [(sid, start, n, _to_host(v)) for sid, start, n, v in pooled or ()]
        self._nans = [(ids, _to_host(flags)) for ids, flags in nans or ()]
        self._event = None
        device = next(
            (t.device for t in (token_ids, logprobs) if t is not None), torch.device("cpu")
        )
        if device.type == "cuda" or (beam is not None and beam[2].device.type == "cuda"):
            self._event = torch.cuda.Event()
            self._event.record()
        self._result: ModelRunnerOutput | None = None
        self.invalid_block_ids: list[int] = []  # (ModelRunnerOutput's; set by the runner)

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def token_ids(self) -> list[int]:
        """The sampled ids alone (the worker's own history bookkeeping); waits like get()."""
        if self._event is not None:
            self._event.synchronize()
        return [] if self._tokens is None else self._tokens.tolist()

    def get(self) -> ModelRunnerOutput:
        if self._result is not None:
            return self._result
        if self._event is not None:
            self._event.synchronize()
        out = ModelRunnerOutput(self.step_id, self._seq_ids)
        out.invalid_block_ids = self.invalid_block_ids
        if self._tokens is not None:
            out.sampled_token_ids = self._tokens.tolist()
        if self._logprobs is not None:
            out.logprobs = unpack(self._logprobs, self._num_logprobs)
        if self._beam is not None:
            beam_ids, ks, lps, ids = self._beam
            for i, (sid, k) in enumerate(zip(beam_ids, ks)):
                out.beam_topk[sid] = (lps[i, :k].tolist(), ids[i, :k].tolist())
        for sid, start, k, packed in self._prompt:
            out.prompt_logprobs[sid] = PromptLogprobsChunk(
                start, unpack(packed, [k] * packed.shape[0])
            )
        for sid, start, n, vec in self._pooled:
            out.pooled[sid] = (start, n, vec.tolist())
        nan = {sid for ids, flags in self._nans for sid, f in zip(ids, flags.tolist()) if f}
        out.nan_seq_ids = sorted(nan)
        self._result = out
        return out
