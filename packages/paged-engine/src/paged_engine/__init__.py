"""paged-engine: LLM inference on a paged KV cache, with vLLM's API names.

    from paged_engine import LLM, SamplingParams

Names resolve lazily (PEP 562), so importing one submodule does not load the whole engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "paged_engine.llm",
    "LLMEngine": "paged_engine.engine.llm_engine",
    "AsyncLLM": "paged_engine.engine.async_llm",
    "AsyncLLMEngine": "paged_engine.engine.async_llm",
    "EngineArgs": "paged_engine.engine.async_llm",
    "AsyncEngineArgs": "paged_engine.engine.async_llm",
    "TextPrompt": "paged_engine.inputs",
    "TokensPrompt": "paged_engine.inputs",
    "EmbedsPrompt": "paged_engine.inputs",
    "PromptType": "paged_engine.inputs",
    "EngineStats": "paged_engine.engine.stats",
    "EngineConfig": "paged_engine.config",
    "SamplingParams": "paged_engine.sampling_params",
    "BeamSearchParams": "paged_engine.sampling_params",
    "BeamSearchOutput": "paged_engine.beam_search",
    "BeamSearchSequence": "paged_engine.beam_search",
    "RequestOutputKind": "paged_engine.sampling_params",
    "StructuredOutputsParams": "paged_engine.structured_output.params",
    "GuidedDecodingParams": "paged_engine.structured_output.params",
    "RequestOutput": "paged_engine.outputs",
    "CompletionOutput": "paged_engine.outputs",
    "RequestMetrics": "paged_engine.outputs",
    "Logprob": "paged_engine.logprobs",
    "PoolingParams": "paged_engine.pooling",
    "PoolingOutput": "paged_engine.pooling",
    "PoolingRequestOutput": "paged_engine.pooling",
    "EmbeddingOutput": "paged_engine.pooling",
    "EmbeddingRequestOutput": "paged_engine.pooling",
    "ClassificationOutput": "paged_engine.classification",
    "ClassificationRequestOutput": "paged_engine.classification",
    "ScoringOutput": "paged_engine.scoring",
    "ScoringRequestOutput": "paged_engine.scoring",
    "LoRARequest": "paged_engine.lora.request",
}

__all__ = [
    "LLM",
    "AsyncEngineArgs",
    "AsyncLLM",
    "AsyncLLMEngine",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "ClassificationOutput",
    "ClassificationRequestOutput",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "EmbedsPrompt",
    "EngineArgs",
    "EngineConfig",
    "EngineStats",
    "GuidedDecodingParams",
    "LLMEngine",
    "LoRARequest",
    "Logprob",
    "PoolingOutput",
    "PoolingParams",
    "PoolingRequestOutput",
    "PromptType",
    "RequestMetrics",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "ScoringOutput",
    "ScoringRequestOutput",
    "StructuredOutputsParams",
    "TextPrompt",
    "TokensPrompt",
]

if TYPE_CHECKING:
    from paged_engine.beam_search import BeamSearchOutput, BeamSearchSequence
    from paged_engine.classification import ClassificationOutput, ClassificationRequestOutput
    from paged_engine.config import EngineConfig
    from paged_engine.engine.async_llm import AsyncEngineArgs, AsyncLLM, AsyncLLMEngine, EngineArgs
    from paged_engine.engine.llm_engine import LLMEngine
    from paged_engine.engine.stats import EngineStats
    from paged_engine.inputs import EmbedsPrompt, PromptType, TextPrompt, TokensPrompt
    from paged_engine.llm import LLM
    from paged_engine.logprobs import Logprob
    from paged_engine.lora.request import LoRARequest
    from paged_engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from paged_engine.pooling import (
        EmbeddingOutput,
        EmbeddingRequestOutput,
        PoolingOutput,
        PoolingParams,
        PoolingRequestOutput,
    )
    from paged_engine.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
    from paged_engine.scoring import ScoringOutput, ScoringRequestOutput
    from paged_engine.structured_output.params import (
        GuidedDecodingParams,
        StructuredOutputsParams,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'paged_engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
