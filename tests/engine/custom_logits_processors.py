"""Custom logits processors the tests load by class or by name ("custom_logits_processors:X"),
written as vLLM's documentation writes them (only the import differs)."""

from __future__ import annotations

from typing import ClassVar

import torch

from paged_engine import SamplingParams
from paged_engine.sample.logits_processor import (
    AdapterLogitsProcessor,
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
)


class ForceToken(LogitsProcessor):
    """extra_args {"target_token": t}: only t may be sampled (vLLM's DummyLogitsProcessor)."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.req_info: dict[int, int] = {}

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        t = (params.extra_args or {}).get("target_token")
        if t is not None and (not isinstance(t, int) or t < 0):
            raise ValueError(f"extra_args.target_token must be a token id, got {t!r}")

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if not batch_update:
            return
        for index in batch_update.removed:
            self.req_info.pop(index, None)
        for index, params, _, _ in batch_update.added:
            target = (params.extra_args or {}).get("target_token")
            if target is None:
                self.req_info.pop(index, None)
            else:
                self.req_info[index] = target
        for a, b, how in batch_update.moved:
            va, vb = self.req_info.pop(a, None), self.req_info.pop(b, None)
            if va is not None:
                self.req_info[b] = va
            if how == MoveDirectionality.SWAP and vb is not None:
                self.req_info[a] = vb

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.req_info:
            return logits
        rows = torch.tensor(list(self.req_info), dtype=torch.long, device=logits.device)
        cols = torch.tensor(list(self.req_info.values()), dtype=torch.long, device=logits.device)
        keep = logits[rows, cols].clone()
        logits[rows] = float("-inf")
        logits[rows, cols] = keep
        return logits


class NoRepeat(AdapterLogitsProcessor):
    """extra_args {"no_repeat": true}: a token already in the output is not sampled again
    (a per-request callable over the live output ids)."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams):
        if not (params.extra_args or {}).get("no_repeat"):
            return None

        def ban(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            if output_ids:
                logits[output_ids] = float("-inf")
            return logits

        return ban


class NoPromptTokens(AdapterLogitsProcessor):
    """extra_args {"no_prompt_tokens": true}: the prompt's tokens are not sampled (the
    three-argument form: prompt ids, output ids, logits row)."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams):
        if not (params.extra_args or {}).get("no_prompt_tokens"):
            return None

        def ban(prompt_ids: list[int], output_ids: list[int], logits: torch.Tensor):
            out = logits.clone()
            out[prompt_ids or []] = float("-inf")  # (None: a prompt given as embeddings)
            return out  # a new row: written back

        return ban


class TopTwo(LogitsProcessor):
    """Every row keeps its two most likely tokens: argmax-invariant, so it runs on the
    random rows' path only. `calls` counts apply() across instances (one process)."""

    calls = 0

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        pass

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        type(self).calls += 1
        second = logits.topk(2, dim=-1).values[:, 1:]
        return logits.masked_fill(logits < second, float("-inf"))


class NotAProcessor:
    pass


class RecordPrompts(LogitsProcessor):
    """Changes nothing; `seen` keeps the prompt ids each added sequence came with (one
    process), None for a prompt given as embeddings."""

    seen: ClassVar[list[list[int] | None]] = []

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        pass

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        for _, _, prompt_ids, _ in batch_update.added if batch_update else ():
            RecordPrompts.seen.append(None if prompt_ids is None else list(prompt_ids))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits
