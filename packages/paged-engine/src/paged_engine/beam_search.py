"""What `LLM.beam_search` returns, named and shaped as vLLM's `vllm.beam_search` records."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from paged_engine.outputs import Logprob


@dataclass
class BeamSearchSequence:
    """One finished beam. `tokens` holds the prompt's ids then the generated ones, and `text`
    their decoding, both as in vLLM. `logprobs` has one dict per generated token, as vLLM's:
    the raw logprobs of the 2 x beam_width candidates the beam chose that token from (ranked
    1..), the chosen one among them."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    lora_request: Any = None  # the LoRARequest it ran with
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # the prompt's multimodal inputs, as vLLM's beams carry them
    multi_modal_data: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None


@dataclass
class BeamSearchOutput:
    """The best `beam_width` beams of one prompt, best (highest length-penalized score) first."""

    sequences: list[BeamSearchSequence]
