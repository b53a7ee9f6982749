"""vLLM's `LLM(...)` / `EngineArgs` options that paged has no field for, so ported code starts.

Each is one of three kinds (`translate`):
- a knob of something paged does not have or does one way only, changing no answer: accepted,
  one warning naming it and why;
- one whose value paged serves only as its default: accepted at that value, any other refused
  with a ValueError naming the option (never silently dropped);
- an older name of an option paged has: renamed.
Options that would change answers and that paged lacks are not here: `EngineConfig.from_kwargs`
refuses them as unknown.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

# name -> why it changes nothing here
IGNORED: dict[str, str] = {
    "disable_custom_all_reduce": "tensor parallelism all-reduces through NCCL / gloo",
    "max_seq_len_to_capture": "CUDA graphs are captured at fixed batch-size buckets",
    "cuda_graph_sizes": "CUDA graphs are captured at fixed batch-size buckets",
    "max_parallel_loading_workers": "weights stream from one reader",
    "disable_async_output_proc": "outputs are processed once each step's tokens are known",
    "use_v2_block_manager": "there is one block manager",
    "prefix_caching_hash_algo": "prefix-cache keys compare whole token blocks",
    "long_prefill_token_threshold": "chunked prefill shares one token budget",
    "tokenizer_pool_size": "prompts are tokenized on the engine's thread",
    "disable_cascade_attn": "there is no cascade attention",
    "enable_expert_parallel": "MoE experts are split by tensor parallelism",
    "guided_decoding_backend": "structured outputs have one grammar engine (llguidance)",
}

# name -> (accepts(value), what is accepted)
ONLY_DEFAULT: dict[str, tuple[Callable[[Any], bool], str]] = {
    # 'mistral': vLLM's mistral_common mode; paged reads a tekken-only repo itself (tekken.py);
    # 'grok2': vLLM's Grok2Tokenizer; paged reads a tokenizer.tok.json-only repo itself
    "tokenizer_mode": (
        lambda v: v in ("auto", "hf", "mistral", "grok2"),
        "'auto', 'hf', 'mistral' or 'grok2' (the fast tokenizer, or tekken.json's or "
        "tokenizer.tok.json's)",
    ),
    "distributed_executor_backend": (
        lambda v: v in (None, "mp", "uni"),
        "None, 'mp' or 'uni' (a process per rank; 'uni' with one rank)",
    ),
    "logprobs_mode": (
        lambda v: v in (None, "raw_logprobs"),
        "'raw_logprobs' (logprobs are the raw model's)",
    ),
    "num_scheduler_steps": (lambda v: v == 1, "1 (multi-step scheduling is gone from vLLM too)"),
    "data_parallel_size": (
        lambda v: v == 1,
        "1 (offline: one LLM per process; paged-server --data-parallel-size serves replicas)",
    ),
    "skip_tokenizer_init": (lambda v: v is False, "False (the engine detokenizes)"),
    "calculate_kv_scales": (lambda v: v is False, "False (fp8 caches keep fixed scales)"),
    "cpu_offload_gb": (lambda v: v in (0, 0.0, None), "0 (weights stay on the device)"),
    "enable_return_routed_experts": (lambda v: v is False, "False"),
}

RENAMED: dict[str, str] = {"override_pooler_config": "pooler_config"}


def translate(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` without vLLM's options paged has no field for (see the module docstring)."""
    out = dict(kwargs)
    ignored = []
    for name in list(out):
        if name in IGNORED:
            out.pop(name)
            ignored.append(f"{name} ({IGNORED[name]})")
        elif name in ONLY_DEFAULT:
            value = out.pop(name)
            accepts, expected = ONLY_DEFAULT[name]
            if not accepts(value):
                raise ValueError(f"{name}={value!r} is not supported: expected {expected}")
            ranks = out.get("tensor_parallel_size", 1) * out.get("pipeline_parallel_size", 1)
            if value == "uni" and ranks != 1:
                raise ValueError(
                    "distributed_executor_backend='uni' runs one process: tensor / pipeline "
                    "parallelism needs 'mp'"
                )
        elif name in RENAMED:
            new = RENAMED[name]
            if new in out:
                raise ValueError(f"{name} and {new} both given: {name} is vLLM's older name")
            out[new] = out.pop(name)
    if ignored:
        logger.warning("vLLM options that change nothing here, ignored: %s", "; ".join(ignored))
    return out
