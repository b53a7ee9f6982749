"""What `LLM.generate` and `LLMEngine.step` return (vLLM's names and meanings)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
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

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class CompletionOutput:
    """One output sequence of a request; vLLM's fields in vLLM's positional order.

    finish_reason: None while running, then "stop" (eos, stop token or stop string), "length"
    (max_tokens or max_model_len) or "abort". stop_reason: the stop token id or stop string that
    ended it, None for eos or length. routed_experts: vLLM's per-token expert ids, returned
    only with its enable_return_routed_experts, which paged does not run: always None here.
    lora_request: vLLM keeps the field but its V1 engine leaves it None, as paged does (the
    request's adapter is `RequestOutput.lora_request`). kv_transfer_params: vLLM's
    per-sequence parameters for a remote KV transfer; None here (paged's connectors share a
    store and exchange none).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    routed_experts: Any = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    lora_request: Any = None
    kv_transfer_params: dict[str, Any] | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (
            f"CompletionOutput(index={self.index}, text={self.text!r}, "
            f"token_ids={self.token_ids}, routed_experts={self.routed_experts}, "
            f"cumulative_logprob={self.cumulative_logprob}, logprobs={self.logprobs}, "
            f"finish_reason={self.finish_reason}, stop_reason={self.stop_reason}, "
            f"kv_transfer_params={self.kv_transfer_params})"
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


@dataclass(slots=True, init=False)
class RequestOutput:
    """The state of one request after an engine step (or at the end of `generate`).

    The constructor takes vLLM's arguments in vLLM's order (code that builds outputs
    positionally, e.g. test doubles, ports unchanged); like vLLM's it ignores, with a warning,
    keywords it does not know (those of other vLLM versions: multi_modal_placeholders,
    kv_transfer_params, which is read from the sequences).

    prompt_logprobs: one entry per prompt token, None for the first; None if not requested.
    metrics: paged's timestamps of the request (vLLM's offline LLM leaves it None).
    num_cached_tokens: prompt tokens served from the prefix cache (and, as vLLM counts them,
        those a kv_transfer_config connector loaded); 0 by default where vLLM's is None, as
        the servers read it as a count.
    encoder_prompt / encoder_prompt_token_ids: a text encoder-decoder's (BART, Florence-2:
        engine/encoder_prompt.py) encoder prompt, as vLLM 0.10 filled them: its text when
        given as text, and its ids; None for other models (Whisper's too, as vLLM's V1).
    num_prompt_tokens (paged's, keyword only): the prompt's length, tokens or prompt_embeds
        rows; -1 takes that of prompt_token_ids.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None  # None for a prompt given as prompt_embeds (as vLLM)
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None
    lora_request: Any  # the LoRARequest it ran with
    encoder_prompt: str | None
    encoder_prompt_token_ids: list[int] | None
    num_cached_tokens: int
    num_prompt_tokens: int

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int] | None,
        prompt_logprobs: PromptLogprobs | None,
        outputs: list[CompletionOutput],
        finished: bool,
        metrics: RequestMetrics | None = None,
        lora_request: Any = None,
        encoder_prompt: str | None = None,
        encoder_prompt_token_ids: list[int] | None = None,
        num_cached_tokens: int = 0,
        *,
        num_prompt_tokens: int = -1,
        **kwargs: Any,
    ) -> None:
        if kwargs:
            _warn_ignored(sorted(kwargs))
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.prompt_logprobs = prompt_logprobs
        self.outputs = outputs
        self.finished = finished
        self.metrics = metrics
        self.lora_request = lora_request
        self.encoder_prompt = encoder_prompt
        self.encoder_prompt_token_ids = encoder_prompt_token_ids
        self.num_cached_tokens = num_cached_tokens
        if num_prompt_tokens < 0:
            num_prompt_tokens = len(prompt_token_ids or ())
        self.num_prompt_tokens = num_prompt_tokens

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
            f"encoder_prompt={self.encoder_prompt!r}, "
            f"encoder_prompt_token_ids={self.encoder_prompt_token_ids}, "
            f"prompt_logprobs={self.prompt_logprobs}, outputs={self.outputs}, "
            f"finished={self.finished}, metrics={self.metrics}, "
            f"lora_request={self.lora_request}, num_cached_tokens={self.num_cached_tokens}, "
            f"kv_transfer_params={self.kv_transfer_params})"
        )


_warned: set[str] = set()


def _warn_ignored(names: list[str]) -> None:
    """Warn once per set of names (vLLM warns once too: test doubles build many outputs)."""
    key = ",".join(names)
    if key not in _warned:
        _warned.add(key)
        logger.warning("RequestOutput: ignoring unknown arguments %s", names)
