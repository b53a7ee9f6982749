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
    "cudagraph_capture_sizes": "CUDA graphs are captured at fixed batch-size buckets",
    "max_cudagraph_capture_size": "CUDA graphs are captured up to max_num_seqs",
    "max_num_partial_prefills": "chunked prefill shares one token budget",
    "max_long_partial_prefills": "chunked prefill shares one token budget",
    "safetensors_load_strategy": "safetensors files are memory-mapped",
    "ignore_patterns": "the weights are the files load_format names, nothing else",
    "use_tqdm_on_load": "a progress bar while weights load; nothing else",
    "pt_load_map_location": ".pt / .bin weights load to the host, then the device",
    "allow_deprecated_quantization": "no quantization method is deprecated here",
    "attention_config": "attention runs in paged's own kernels",
    "enable_dbo": "no dual-batch overlap: tensor parallelism all-reduces in line",
    "enable_eplb": "MoE experts are split by tensor parallelism, not rebalanced",
    "all2all_backend": "MoE experts are split by tensor parallelism: no all-to-all",
    "mm_encoder_tp_mode": "a vision tower is split like the language model",
    "mm_processor_cache_type": "processed images stay in one in-process LRU cache",
    "skip_mm_profiling": "start-up memory profiling only; no answer depends on it",
    "disable_chunked_mm_input": "images whose tokens attend to each other are kept whole",
    "disable_hybrid_kv_cache_manager": "hybrid models' caches have one layout here",
    "kv_sharing_fast_prefill": "no KV-sharing prefill shortcut (layers all run)",
    "num_lookahead_slots": "speculative decoding sizes its own slots",
    "show_hidden_metrics_for_version": "every metric is shown; none was hidden",
    "otlp_traces_endpoint": "no OpenTelemetry traces are exported",
    "collect_detailed_traces": "no OpenTelemetry traces are exported",
    "aggregate_engine_logging": "no periodic stats log",
    "performance_mode": "batch limits are max_num_seqs / max_num_batched_tokens",
    "fully_sharded_loras": "LoRA weights are split like the layers they adapt",
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
    "kv_offloading_backend": (
        lambda v: v in (None, "native"),
        "'native' (kv_offloading_size GiB of host memory: the prefix cache's CPU tier)",
    ),
    "mamba_cache_dtype": (lambda v: v == "auto", "'auto' (mamba_ssm_cache_dtype sets the state's)"),
    "decode_context_parallel_size": (lambda v: v == 1, "1 (no context parallelism)"),
    "prefill_context_parallel_size": (lambda v: v == 1, "1 (no context parallelism)"),
    "worker_cls": (lambda v: v == "auto", "'auto' (paged's own worker)"),
}

RENAMED: dict[str, str] = {
    "override_pooler_config": "pooler_config",
    "kv_offloading_size": "cpu_offload_gib",  # vLLM's native CPU offload: the prefix-cache tier
}


def translate(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` without vLLM's options paged has no field for (see the module docstring)."""
    out = _vllm_values(dict(kwargs))
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


def _vllm_values(out: dict[str, Any]) -> dict[str, Any]:
    """vLLM's forms of options paged has: max_model_len -1 / 'auto' (the model's own length),
    optimization_level (compilation_config's level where that is not given),
    disable_mm_preprocessor_cache (mm_processor_cache_gb 0), structured_outputs_config with a
    backend only (one grammar engine), language_model_only (no multimodal input), an
    attention_backend of vLLM's (paged's kernels)."""
    if out.get("max_model_len") in (-1, "auto"):
        out["max_model_len"] = None
    level = out.pop("optimization_level", None)
    if level is not None and out.get("compilation_config") is None:
        out["compilation_config"] = level
    if out.pop("disable_mm_preprocessor_cache", False):
        out["mm_processor_cache_gb"] = 0.0
    so = out.get("structured_outputs_config")
    if isinstance(so, dict) and set(so) <= {"backend"}:  # one grammar engine, as above
        logger.warning("structured_outputs_config=%r ignored: grammars compile with llguidance", so)
        out.pop("structured_outputs_config")
    if out.pop("language_model_only", False):
        out["limit_mm_per_prompt"] = dict.fromkeys(("image", "video", "audio"), 0)
    backend = out.get("attention_backend")
    if isinstance(backend, str) and backend.isupper():  # vLLM's enum names: FLASH_ATTN, ...
        logger.warning("attention_backend=%r ignored: attention runs in paged's kernels", backend)
        out.pop("attention_backend")
    return out
