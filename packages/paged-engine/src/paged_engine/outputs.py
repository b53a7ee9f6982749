"""What `LLM.generate` and `LLMEngine.step` return (vLLM's names and meanings)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from paged_engine.logprobs import Logprob, PromptLogprobs, SampleLogprobs

__all__ = [
    "CompletionOutput",
    "Logprob",
    "PromptLogprobs",
    "RequestMetrics",
    "RequestOutput",
    "SampleLogprobs",
]


@dataclass(slots=True)
class CompletionOutput:
    """One output sequence of a request.

    finish_reason: None while running, then "stop" (eos, stop token or stop string), "length"
    (max_tokens or max_model_len) or "abort". stop_reason: the stop token id or stop string that
    ended it, None for eos or length. kv_transfer_params: vLLM's per-sequence parameters for a
    remote KV transfer; None here (paged's connectors share a store and exchange none).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    kv_transfer_params: dict[str, Any] | None = field(default=None, repr=False)

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (
            f"CompletionOutput(index={self.index}, text={self.text!r}, "
            f"token_ids={self.token_ids}, cumulative_logprob={self.cumulative_logprob}, "
            f"logprobs={self.logprobs}, finish_reason={self.finish_reason}, "
            f"stop_reason={self.stop_reason})"
        )


@dataclass(slots=True)
class RequestMetrics:
    """Timestamps (`time.monotonic()`, one clock for the engine and the server) of one request's
    life; None until reached."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_in_queue(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    """The state of one request after an engine step (or at the end of `generate`).

    prompt_logprobs: one entry per prompt token, None for the first; None if not requested.
    num_cached_tokens: prompt tokens served from the prefix cache (and, as vLLM counts them,
        those a kv_transfer_config connector loaded).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None  # None for a prompt given as prompt_embeds (as vLLM)
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    lora_request: Any = field(default=None, repr=False)  # the LoRARequest it ran with
    # the prompt's length, tokens or prompt_embeds rows (-1: that of prompt_token_ids)
    num_prompt_tokens: int = field(default=-1, repr=False)
    # A text encoder-decoder's (BART, Florence-2: engine/encoder_prompt.py) encoder prompt, as
    # vLLM 0.10 filled them: its text when given as text, and its ids; None for other models
    # (Whisper's included, as vLLM's V1 engine).
    encoder_prompt: str | None = field(default=None, repr=False)
    encoder_prompt_token_ids: list[int] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 0:
            self.num_prompt_tokens = len(self.prompt_token_ids or ())

    @property
    def kv_transfer_params(self) -> dict[str, Any] | list[dict[str, Any]] | None:
        """vLLM's: the sequences' kv_transfer_params; one sequence's as a dict, several as a
        list, None when none has any."""
        found = [c.kv_transfer_params for c in self.outputs if c.kv_transfer_params]
        if not found:
            return None
        return found[0] if len(found) == 1 else found

    def add(self, next_output: RequestOutput, aggregate: bool) -> None:
        """vLLM's: merge a later output of this request into this one. `aggregate` (DELTA
        outputs): a sequence's new text, token ids and logprobs are appended to the one of the
        same index; otherwise (CUMULATIVE) the later sequence replaces it. A sequence not seen
        yet is appended."""
        self.finished |= next_output.finished
        for new in next_output.outputs:
            i = next((k for k, c in enumerate(self.outputs) if c.index == new.index), None)
            if i is None:
                self.outputs.append(new)
                continue
            if not aggregate:
                self.outputs[i] = new
                continue
            cur = self.outputs[i]  # copies, never the lists the engine handed out extended
            cur.text += new.text
            cur.token_ids = [*cur.token_ids, *new.token_ids]
            if new.logprobs:
                merged = cur.logprobs.copy() if cur.logprobs is not None else new.logprobs[:0]
                merged.extend(new.logprobs)
                cur.logprobs = merged
            cur.cumulative_logprob = new.cumulative_logprob
            cur.finish_reason, cur.stop_reason = new.finish_reason, new.stop_reason
            cur.kv_transfer_params = new.kv_transfer_params

    def __repr__(self) -> str:
        return (
            f"RequestOutput(request_id={self.request_id}, prompt={self.prompt!r}, "
            f"prompt_token_ids={self.prompt_token_ids}, "
            f"prompt_logprobs={self.prompt_logprobs}, outputs={self.outputs}, "
            f"finished={self.finished}, metrics={self.metrics}, "
            f"num_cached_tokens={self.num_cached_tokens})"
        )
