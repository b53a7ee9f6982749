"""Custom logits processors, vLLM's interface: `LLM(model, logits_processors=[...])`.

vLLM code ports by changing the import (`vllm.v1.sample.logits_processor` ->
`paged_engine.sample.logits_processor`). A processor is a class, or its name as "module:Class"
(or "module.Class"), constructed once in each worker process as `cls(config, device,
is_pin_memory)` (`config`: the engine's `EngineConfig`, where vLLM passes its VllmConfig). Each
step, before sampling, the worker calls `update_state(batch_update)` (None when no sequence
came or went), then `apply(logits)` on the step's logits:

- `logits` is [batch_size, V]: row i is the sequence at batch index i. Indices are dense and
  persistent, as in vLLM's persistent batch: a sequence keeps its index while it runs; a new
  one takes a freed index (the lowest) or the next; indices left free at the end of a step are
  filled by moving the last sequences down (`moved`, one-way). Process a `BatchUpdate` as
  vLLM's contract says: `removed`, then `added` (index, params, prompt ids, output ids), then
  `moved`. The output ids list is the sequence's own: it grows as tokens are sampled.
- Rows of sequences that sample nothing this step (a prompt still being prefilled) are zeros
  and are not read back.
- A processor whose `is_argmax_invariant()` is False runs where vLLM runs it: after the token
  rules (grammar, allowed ids, logit bias, min_tokens' bans), before the penalties and
  temperature. One that is True cannot change a greedy row's token: it runs on the random rows'
  path only, after the temperature, before top-k / top-p / min-p (skipped when every row is
  greedy).
- `validate_params(params)` (a classmethod) checks each request's `SamplingParams` when it is
  added; a `ValueError` refuses the request (HTTP 400) and the engine serves on.

Each sampled sequence of an n > 1 request has its own index (the first sample, which fans out
into n sequences, takes the request's). Beam-search rows rank raw log-probabilities: no
processor sees them. Not supported with speculative decoding, async scheduling (the processors
read every output token on the host before the next step) or pooling-only requests. Loading
vLLM plugins by entry point is not done: name the classes.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum, auto
from functools import partial
from typing import Any

import torch

from paged_engine.named_class import load_named
from paged_engine.sampling_params import SamplingParams


class MoveDirectionality(Enum):
    UNIDIRECTIONAL = auto()  # the sequence at index a moves to index b
    SWAP = auto()  # the sequences at a and b trade places (never emitted here)


RemovedRequest = int  # a batch index freed
# (index, params, prompt token ids (None for a prompt given as embeddings, as in vLLM), output
# token ids: the sequence's live list)
AddedRequest = tuple[int, SamplingParams, list[int] | None, list[int]]
MovedRequest = tuple[int, int, MoveDirectionality]  # (from a, to b, how)


@dataclass(frozen=True)
class BatchUpdate:
    batch_size: int  # sequences in the batch after this update
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


class LogitsProcessor(ABC):
    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Raise ValueError for sampling params this processor cannot serve."""
        return None

    @abstractmethod
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        raise NotImplementedError

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The processed [batch_size, V] logits (in place or a new tensor)."""
        raise NotImplementedError

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True if `apply` never changes a row's argmax (it then skips greedy batches)."""
        raise NotImplementedError

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Called once a step before `apply`; `batch_update` is None when the batch's makeup
        did not change."""
        raise NotImplementedError


# A per-request processor: (output ids, logits row) -> row, or (prompt ids, output ids, row).
RequestLogitsProcessor = Callable[..., torch.Tensor]


class AdapterLogitsProcessor(LogitsProcessor):
    """Per-request processors (vLLM v0's style) as one batch processor: subclass it, implement
    `is_argmax_invariant` and `new_req_logits_processor(params)` (a callable, or None for
    requests it leaves alone). Subclasses that override `__init__` call this one."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.req_info: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {}

    @abstractmethod
    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        raise NotImplementedError

    def _new_state(
        self, params: SamplingParams, prompt_ids: list[int] | None, output_ids: list[int]
    ) -> Callable[[torch.Tensor], torch.Tensor] | None:
        fn = self.new_req_logits_processor(params)
        if fn is None:
            return None
        if len(inspect.signature(fn).parameters) == 3:
            return partial(fn, prompt_ids, output_ids)
        return partial(fn, output_ids)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        apply_batch_update(self.req_info, batch_update, self._new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, fn in self.req_info.items():
            row = logits[index]
            new = fn(row)
            if new is not row:
                logits[index] = new
        return logits


def apply_batch_update(
    states: dict[int, Any],
    batch_update: BatchUpdate | None,
    new_state: Callable[[SamplingParams, list[int] | None, list[int]], Any],
) -> None:
    """Keep a {batch index: per-sequence state} dict in step with `batch_update`:
    `new_state(params, prompt ids, output ids)` for each added sequence (None: no state)."""
    if batch_update is None:
        return
    for index in batch_update.removed:
        states.pop(index, None)
    for index, params, prompt_ids, output_ids in batch_update.added:
        state = new_state(params, prompt_ids, output_ids)
        if state is None:
            states.pop(index, None)
        else:
            states[index] = state
    for a, b, how in batch_update.moved:
        state_a, state_b = states.pop(a, None), states.pop(b, None)
        if state_a is not None:
            states[b] = state_a
        if how is MoveDirectionality.SWAP and state_b is not None:
            states[a] = state_b


def load_logits_processors(specs: Sequence[str | type]) -> list[type[LogitsProcessor]]:
    """The processor classes of `specs` (classes, or "module:Class" / "module.Class" names);
    ValueError naming the entry that is not one."""
    classes = []
    for i, spec in enumerate(specs):
        where = f"logits_processors[{i}]"
        cls = load_named(spec, where) if isinstance(spec, str) else spec
        if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
            raise ValueError(
                f"{where}={spec!r} is not a subclass of "
                "paged_engine.sample.logits_processor.LogitsProcessor"
            )
        classes.append(cls)
    return classes
