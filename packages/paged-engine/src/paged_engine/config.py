"""Engine options, with vLLM's names, validated up front with errors that name the option."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

_DTYPES = ("auto", "float16", "half", "bfloat16", "float32", "float")
_LOAD_FORMATS = ("auto", "safetensors", "pt", "gguf", "dummy", "mistral")
_CONFIG_FORMATS = ("auto", "hf", "mistral")
_BACKENDS = ("auto", "cpu", "triton", "torch")
_DEVICES = ("auto", "cuda", "cpu")
# vLLM's names for running a checkpoint as it is quantized (its quant_method: GPTQ / AWQ /
# W4A16 / bitsandbytes, packed_checkpoint.py, bnb_checkpoint.py): accepted, and checked
# against the checkpoint.
CHECKPOINT_QUANTIZATIONS = {
    "gptq": "gptq",
    "gptq_marlin": "gptq",
    "awq": "awq",
    "awq_marlin": "awq",
    "compressed-tensors": "compressed-tensors",
    "bitsandbytes": "bitsandbytes",
}
_QUANTIZATIONS = (None, "fp16", "int8", "int4", "fp8", *CHECKPOINT_QUANTIZATIONS)
_KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
_PREEMPTION_MODES = (None, "recompute", "swap")
_SSM_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16")
_SCHEDULING_POLICIES = ("fcfs", "priority")
_MODALITIES = ("image", "video", "audio")  # what limit_mm_per_prompt may name


def _cpu_kv_cache_gib_default() -> float:
    """GiB of CPU KV cache per rank: `PAGED_CPU_KVCACHE_SPACE`, else vLLM's
    `VLLM_CPU_KVCACHE_SPACE`, else 1.0."""
    for name in ("PAGED_CPU_KVCACHE_SPACE", "VLLM_CPU_KVCACHE_SPACE"):
        raw = os.environ.get(name, "").strip()
        if not raw:
            continue
        try:
            gib = float(raw)
        except ValueError:
            gib = math.nan
        if not 0 < gib < math.inf:
            raise ValueError(f"{name}={raw!r} is invalid: expected GiB, a positive finite number")
        return gib
    return 1.0


@dataclass
class EngineConfig:
    """Everything `LLM(...)`, `LLMEngine(...)` and `paged-server` accept.

    `max_model_len=None` takes the model's own limit (a longrope model's
    original_max_position_embeddings, as vLLM). `max_num_batched_tokens` is the per-step
    token budget shared by prefill chunks and decodes. On CUDA the KV pool is sized from
    `gpu_memory_utilization` after profiling a forward pass; on CPU from `cpu_kv_cache_gib`
    (default: `PAGED_CPU_KVCACHE_SPACE` or vLLM's `VLLM_CPU_KVCACHE_SPACE` from the
    environment, in GiB, else 1 GiB).
    `num_gpu_blocks_override` fixes the pool size (tests use tiny pools to force preemption).
    """

    model: str | None = None
    tokenizer: str | None = None
    # Hub ids (hub.py): branch / tag / commit of the model and of a separate tokenizer, and a
    # cache directory other than huggingface_hub's standard one.
    revision: str | None = None
    tokenizer_revision: str | None = None
    download_dir: str | None = None
    # None: HF_TOKEN / the saved login, as huggingface_hub reads them; never in the repr
    hf_token: str | bool | None = dataclasses.field(default=None, repr=False)
    served_model_name: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gib: float = dataclasses.field(default_factory=_cpu_kv_cache_gib_default)
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    seed: int = 0
    load_format: str = "auto"
    # vLLM's: "hf" config.json, "mistral" params.json (mistral_format.py), "auto" config.json
    # where there is one, else params.json; load_format="mistral" reads consolidated*.safetensors
    config_format: str = "auto"
    enforce_eager: bool = False
    # vLLM's optimization level, an int or {"level": n} ("mode" too): 0 runs the model eagerly;
    # 1-3 run it through torch.compile (CPU only so far; worker/cpu_compile.py).
    compilation_config: int | dict | None = None
    # Ranks = tensor_parallel_size * pipeline_parallel_size processes (one GPU each on CUDA).
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # {"method": "ngram", "num_speculative_tokens": k, ...} (spec_decode/config.py)
    speculative_config: dict | None = None
    # Embeddings (pooling.py): {"pooling_type": "LAST" | "MEAN" | "CLS", "normalize": bool}
    pooler_config: dict | None = None
    # Fields set on the model's HF config after it loads (vLLM's hf_overrides), e.g. the
    # architectures and classifier_from_token that serve a causal LM as a reranker.
    hf_overrides: dict | None = None
    # What the engine serves (runner.py, vLLM's names): "auto" / "generate" / "pooling"; convert
    # "classify" serves a *ForCausalLM as its *ForSequenceClassification; task: vLLM's older
    # spelling of both ("generate", "embed", "classify", "score").
    runner: str = "auto"
    convert: str = "auto"
    task: str | None = None
    chat_template: str | None = None
    num_gpu_blocks_override: int | None = None
    # vLLM's: the KV pool's bytes on each device (rank), in place of gpu_memory_utilization's
    # profile and cpu_kv_cache_gib; num_gpu_blocks_override still wins
    kv_cache_memory_bytes: int | None = None
    device: str = "auto"
    attention_backend: str = "auto"
    trust_remote_code: bool = False
    max_logprobs: int = 20  # -1: the vocabulary size (what logprobs=-1 asks for)
    disable_log_stats: bool = True
    # Schedule step N+1 while step N runs (None: on for CUDA devices, off elsewhere).
    async_scheduling: bool | None = None
    # Custom logits processors (sample/logits_processor.py): classes or "module:Class" names.
    logits_processors: list | None = None
    # vLLM's model_impl: "vllm" this engine's own implementations; "transformers" HF's modeling
    # code with paged attention (models/transformers_backend/); "auto" the own one, else that
    model_impl: str = "auto"
    # vLLM's worker_extension_cls: a class (or "module.Class") whose methods join every rank's
    # Worker, for collective_rpc (worker/extension.py)
    worker_extension_cls: str | type | None = None
    # torch intra-op threads on CPU (None: OMP_NUM_THREADS if set, else the physical cores).
    cpu_num_threads: int | None = None
    # Weight-only linear layers (layers/quantization.py): "fp16" / "int8" on the CPU, "int4"
    # (torch's CPU kernels, or a Triton kernel on CUDA), "fp8" on CUDA (a Triton kernel; on
    # the CPU it runs, slowly, for checks); or a checkpoint's own method
    # (CHECKPOINT_QUANTIZATIONS: "gptq", "awq", ...). batch_invariant:
    # logits of a sequence bit-identical whatever else is in the batch (CPU backend in float32,
    # or the Triton kernels; layers/batch_invariant.py).
    quantization: str | None = None
    batch_invariant: bool = False
    # KV memory (docs/engine.md "Memory"): the cache's element type ("auto": the model dtype;
    # fp8 = fp8_e4m3), preemption by recompute or swap to a CPU pool of swap_space GiB (None:
    # chosen per request by cost), and a CPU tier of cpu_offload_gib GiB for the prefix cache.
    kv_cache_dtype: str = "auto"
    # Hybrid models (worker/recurrent_state.py): the linear-attention layers' recurrent matrices'
    # dtype ("auto": the checkpoint config's mamba_ssm_dtype if it names one, else the model's).
    mamba_ssm_cache_dtype: str = "auto"
    # ... and their prefix caching: state snapshots kept at block boundaries (core/state_slots.py),
    # their memory taken from the KV cache's (None: as many as fit in a tenth of it, at most
    # max_num_seqs; 0: prefix caching off).
    prefix_state_snapshots: int | None = None
    preemption_mode: str | None = None
    swap_space: float = 0.0
    cpu_offload_gib: float = 0.0
    # Multi-LoRA (lora/): adapters per batch, their largest rank, and adapters kept loaded in
    # host memory (None: max_loras). Requests pick one with lora_request=LoRARequest(...).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # Sampling defaults (engine/generation_defaults.py): "auto" takes the model's
    # generation_config.json, "vllm" none, a path that directory's; the override goes on top.
    generation_config: str = "auto"
    override_generation_config: dict | None = None
    # "fcfs": requests run in arrival order; "priority": by (priority, arrival), lower first,
    # and preemption takes the running request that sorts last (core/preemption.py).
    scheduling_policy: str = "fcfs"
    # LLM.sleep / wake_up (engine/sleep_mode.py): give back device memory between rollouts.
    enable_sleep_mode: bool = False
    # Items per prompt by modality ({"image": n}) for checkpoints whose images paged runs
    # (multimodal/): None or a missing key means any number; {"image": 0} serves the text
    # model alone (the vision tower is not loaded).
    limit_mm_per_prompt: dict | None = None
    # Arguments for the checkpoint's image processor on every image (vLLM's; e.g. Qwen2-VL's
    # {"max_pixels": 1280 * 28 * 28}); a prompt's own "mm_processor_kwargs" go on top.
    mm_processor_kwargs: dict | None = None
    # vLLM's processor cache: images processed once are not processed again (a chat resends
    # its images every turn), up to this many GiB of pixel values; 0 turns it off.
    mm_processor_cache_gb: float = 4.0
    # vLLM's switch for image features as input (multi_modal_data={"image": tensor}). The
    # engine takes them either way (their shapes are checked); paged-server takes `image_embeds`
    # chat parts only with it on (--enable-mm-embeds).
    enable_mm_embeds: bool = False
    # vLLM's --stream-interval: streaming outputs carry at least this many new tokens each (the
    # first and the last come at once); SamplingParams.stream_interval may raise it
    stream_interval: int = 1
    # vLLM's reasoning_config: the reasoning block's markers, {"think_start_str": "<think>",
    # "think_end_str": "</think>"}, which SamplingParams.thinking_token_budget counts within
    reasoning_config: dict | None = None
    # vLLM's prompt embeddings input ({"prompt_embeds": tensor [L, D]}, engine/prompt_embeds.py):
    # off by default, as in vLLM; paged-server takes them on /v1/completions with it on.
    enable_prompt_embeds: bool = False
    # vLLM's KV transfer between engines through shared storage (disaggregated prefill,
    # kv_transfer/): {"kv_connector": "ExampleConnector", "kv_role": "kv_producer" |
    # "kv_consumer" | "kv_both", "kv_connector_extra_config": {"shared_storage_path": dir}}
    kv_transfer_config: Any = None

    def __post_init__(self) -> None:
        _check(self.dtype in _DTYPES, "dtype", self.dtype, f"one of {_DTYPES}")
        _check(
            self.load_format in _LOAD_FORMATS, "load_format", self.load_format, str(_LOAD_FORMATS)
        )
        _check(
            self.config_format in _CONFIG_FORMATS,
            "config_format",
            self.config_format,
            str(_CONFIG_FORMATS),
        )
        _check(
            self.attention_backend in _BACKENDS,
            "attention_backend",
            self.attention_backend,
            str(_BACKENDS),
        )
        _check(self.device in _DEVICES, "device", self.device, str(_DEVICES))
        _check(
            self.scheduling_policy in _SCHEDULING_POLICIES,
            "scheduling_policy",
            self.scheduling_policy,
            str(_SCHEDULING_POLICIES),
        )
        from paged_engine.engine.generation_defaults import check_setting

        check_setting(self.generation_config, self.override_generation_config)
        _check(
            self.mamba_ssm_cache_dtype in _SSM_CACHE_DTYPES,
            "mamba_ssm_cache_dtype",
            self.mamba_ssm_cache_dtype,
            str(_SSM_CACHE_DTYPES),
        )
        _check(
            self.kv_cache_dtype in _KV_CACHE_DTYPES,
            "kv_cache_dtype",
            self.kv_cache_dtype,
            str(_KV_CACHE_DTYPES),
        )
        _check(
            self.preemption_mode in _PREEMPTION_MODES,
            "preemption_mode",
            self.preemption_mode,
            "None (by cost), 'recompute' or 'swap'",
        )
        for name in ("swap_space", "cpu_offload_gib"):
            value = getattr(self, name)
            _check(_is_number(value) and 0 <= value < math.inf, name, value, "a finite number >= 0")
        if self.preemption_mode == "swap" and not self.swap_space:
            raise ValueError(
                "preemption_mode='swap' needs swap_space > 0 (GiB of CPU memory for swapped blocks)"
            )
        _check(
            _is_number(self.gpu_memory_utilization) and 0 < self.gpu_memory_utilization <= 1,
            "gpu_memory_utilization",
            self.gpu_memory_utilization,
            "a float in (0, 1]",
        )
        _check(
            _is_number(self.cpu_kv_cache_gib) and 0 < self.cpu_kv_cache_gib < math.inf,
            "cpu_kv_cache_gib",
            self.cpu_kv_cache_gib,
            "a positive finite number",
        )
        for name in (
            "enable_prefix_caching",
            "enable_chunked_prefill",
            "enforce_eager",
            "trust_remote_code",
            "disable_log_stats",
            "enable_lora",
            "enable_sleep_mode",
            "enable_prompt_embeds",
        ):
            value = getattr(self, name)
            _check(isinstance(value, bool), name, value, "a bool")
        _check(
            self.limit_mm_per_prompt is None
            or (
                isinstance(self.limit_mm_per_prompt, dict)
                and all(k in _MODALITIES for k in self.limit_mm_per_prompt)
                and all(_is_int(v) and v >= 0 for v in self.limit_mm_per_prompt.values())
            ),
            "limit_mm_per_prompt",
            self.limit_mm_per_prompt,
            f"None or a dict of modalities {_MODALITIES} to ints >= 0",
        )
        _check(
            _is_number(self.mm_processor_cache_gb) and self.mm_processor_cache_gb >= 0,
            "mm_processor_cache_gb",
            self.mm_processor_cache_gb,
            "a number of GiB >= 0",
        )
        _check(
            self.mm_processor_kwargs is None
            or (
                isinstance(self.mm_processor_kwargs, dict)
                and all(isinstance(k, str) for k in self.mm_processor_kwargs)
            ),
            "mm_processor_kwargs",
            self.mm_processor_kwargs,
            "None or a dict of the image processor's argument names to values",
        )
        _check(
            self.prefix_state_snapshots is None
            or (_is_int(self.prefix_state_snapshots) and self.prefix_state_snapshots >= 0),
            "prefix_state_snapshots",
            self.prefix_state_snapshots,
            "None (auto) or an int >= 0",
        )
        _check(
            self.async_scheduling is None or isinstance(self.async_scheduling, bool),
            "async_scheduling",
            self.async_scheduling,
            "None (auto) or a bool",
        )
        _check(
            self.cpu_num_threads is None
            or (_is_int(self.cpu_num_threads) and self.cpu_num_threads >= 1),
            "cpu_num_threads",
            self.cpu_num_threads,
            "None (physical cores) or an int >= 1",
        )
        _check(
            self.quantization in _QUANTIZATIONS,
            "quantization",
            self.quantization,
            str(_QUANTIZATIONS),
        )
        _check(
            isinstance(self.batch_invariant, bool),
            "batch_invariant",
            self.batch_invariant,
            "a bool",
        )
        if self.batch_invariant and self.quantization not in (None, *CHECKPOINT_QUANTIZATIONS):
            raise ValueError(
                f"batch_invariant=True does not combine with quantization={self.quantization!r}"
            )
        bs = self.block_size
        _check(
            _is_int(bs) and 1 <= bs <= 256 and bs & (bs - 1) == 0,
            "block_size",
            bs,
            "a power of two in [1, 256]",
        )
        _check(
            _is_int(self.max_num_seqs) and self.max_num_seqs >= 1,
            "max_num_seqs",
            self.max_num_seqs,
            "an int >= 1",
        )
        names = ("max_model_len", "max_num_batched_tokens", "num_gpu_blocks_override")
        for name in (*names, "kv_cache_memory_bytes"):
            value = getattr(self, name)
            _check(
                value is None or (_is_int(value) and value >= 1), name, value, "None or an int >= 1"
            )
        _check(_is_int(self.seed), "seed", self.seed, "an int")
        _check(
            self.reasoning_config is None
            or (
                isinstance(self.reasoning_config, dict)
                and set(self.reasoning_config) == {"think_start_str", "think_end_str"}
                and all(isinstance(v, str) and v for v in self.reasoning_config.values())
            ),
            "reasoning_config",
            self.reasoning_config,
            "None or {'think_start_str': str, 'think_end_str': str} (non-empty)",
        )
        _check(
            _is_int(self.stream_interval) and self.stream_interval >= 1,
            "stream_interval",
            self.stream_interval,
            "an int >= 1",
        )
        _check(
            _is_int(self.max_logprobs) and self.max_logprobs >= -1,
            "max_logprobs",
            self.max_logprobs,
            "an int >= 0, or -1 (the whole vocabulary)",
        )
        _check(
            _is_int(self.tensor_parallel_size) and self.tensor_parallel_size >= 1,
            "tensor_parallel_size",
            self.tensor_parallel_size,
            "an int >= 1",
        )
        _check(
            _is_int(self.pipeline_parallel_size) and self.pipeline_parallel_size >= 1,
            "pipeline_parallel_size",
            self.pipeline_parallel_size,
            "an int >= 1",
        )
        from paged_engine.runner import CONVERTS, RUNNERS, TASKS, runner_and_convert

        _check(self.runner in RUNNERS, "runner", self.runner, f"one of {RUNNERS}")
        _check(self.convert in CONVERTS, "convert", self.convert, f"one of {CONVERTS}")
        _check(self.task is None or self.task in TASKS, "task", self.task, f"one of {TASKS}")
        self.runner, self.convert = runner_and_convert(self.runner, self.convert, self.task)
        _check(
            self.hf_overrides is None
            or (isinstance(self.hf_overrides, dict) and all(map(_is_str, self.hf_overrides))),
            "hf_overrides",
            self.hf_overrides,
            "a dict of config field names to values",
        )
        if self.pooler_config is not None:
            from paged_engine.pooling import check_pooler_config

            check_pooler_config(self.pooler_config)  # raises naming the key
        if self.speculative_config is not None:
            from paged_engine.spec_decode.config import SpeculativeConfig

            spec = SpeculativeConfig.from_dict(self.speculative_config)  # raises naming the key
            tp = self.tensor_parallel_size
            if spec.draft_tensor_parallel_size not in (None, 1, tp):
                raise ValueError(
                    f"speculative_config.draft_tensor_parallel_size="
                    f"{spec.draft_tensor_parallel_size} must be 1 or tensor_parallel_size={tp}"
                )
            spec.check_pipeline(self.pipeline_parallel_size)
        _check(
            self.model_impl in ("auto", "vllm", "transformers"),
            "model_impl",
            self.model_impl,
            "'auto', 'vllm' (this engine's own model implementations) or 'transformers' "
            "(transformers' modeling code, models/transformers_backend/)",
        )
        if self.worker_extension_cls is not None:
            from paged_engine.worker.extension import load_extension

            load_extension(self.worker_extension_cls)  # raises naming the option
        if self.logits_processors:
            from paged_engine.sample.logits_processor import load_logits_processors

            _check(
                isinstance(self.logits_processors, list | tuple),
                "logits_processors",
                self.logits_processors,
                "a list of LogitsProcessor classes or 'module:Class' names",
            )
            load_logits_processors(self.logits_processors)  # raises naming the entry
            if self.speculative_config is not None:
                raise ValueError("logits_processors is not supported with speculative_config")
            if self.async_scheduling:
                raise ValueError(
                    "async_scheduling=True is not supported with logits_processors: they read "
                    "every output token on the host before the next step"
                )
        if self.kv_transfer_config is not None:
            from paged_engine.kv_transfer.config import check_engine

            check_engine(self)  # raises naming kv_transfer_config and the field
        if self.pipeline_parallel_size > 1 and self.async_scheduling:
            raise ValueError(
                "async_scheduling=True is not supported with pipeline_parallel_size > 1: the "
                "first stage needs each step's sampled tokens before the next step"
            )
        if self.batch_invariant and self.tensor_parallel_size > 2:
            raise ValueError(
                f"batch_invariant=True supports tensor_parallel_size <= 2 (got "
                f"{self.tensor_parallel_size}): an all-reduce of 3+ partial sums may add them in "
                "an order that depends on the message size, so on the batch; two add exactly"
            )
        level = self.compilation_level  # raises naming compilation_config
        self._check_lora(level)
        if level and self.batch_invariant:
            raise ValueError(
                "compilation_config (torch.compile) does not combine with batch_invariant=True: "
                "compiled kernels fix their own reduction orders"
            )
        if level and (self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1):
            raise ValueError(
                "compilation_config (torch.compile) is not supported with tensor or pipeline "
                "parallelism yet: pass compilation_config=0 there"
            )

    def _check_lora(self, level: int) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            _check(_is_int(value) and value >= 1, name, value, "an int >= 1")
        _check(
            self.max_cpu_loras is None
            or (_is_int(self.max_cpu_loras) and self.max_cpu_loras >= self.max_loras),
            "max_cpu_loras",
            self.max_cpu_loras,
            f"None or an int >= max_loras={self.max_loras}",
        )
        if not self.enable_lora:
            return
        unsupported = {
            "batch_invariant=True": self.batch_invariant,
            "compilation_config (torch.compile)": bool(level),
        }
        for what, on in unsupported.items():
            if on:
                raise ValueError(f"enable_lora=True does not combine with {what} yet")

    @property
    def image_limit(self) -> int | None:
        """Images per prompt (limit_mm_per_prompt["image"]); None: any number."""
        return (self.limit_mm_per_prompt or {}).get("image")

    @property
    def video_limit(self) -> int | None:
        """Videos per prompt (limit_mm_per_prompt["video"]); None: any number."""
        return (self.limit_mm_per_prompt or {}).get("video")

    @property
    def audio_limit(self) -> int | None:
        """Audio clips per prompt (limit_mm_per_prompt["audio"]); None: any number."""
        return (self.limit_mm_per_prompt or {}).get("audio")

    @property
    def compilation_level(self) -> int:
        """0: eager; 1-3: torch.compile. Raises ValueError naming a bad compilation_config."""
        value = self.compilation_config
        if value is None:
            return 0
        if isinstance(value, dict):
            unknown = sorted(set(value) - {"level", "mode"})
            _check(
                not unknown and len(value) == 1,
                "compilation_config",
                value,
                'an int or a dict with one key, "level" or "mode"',
            )
            value = next(iter(value.values()))
        _check(
            _is_int(value) and 0 <= value <= 3,
            "compilation_config",
            self.compilation_config,
            "an optimization level 0-3 (0: eager, 1-3: torch.compile) or {'level': n}",
        )
        return int(value)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from keyword options, rejecting unknown names with the list of known ones
        (vLLM's options paged has no field for are translated first: vllm_options.py)."""
        from paged_engine.vllm_options import translate

        kwargs = translate(kwargs)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine option(s) {unknown}; known options: {sorted(known)}")
        return cls(**kwargs)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_str(value: object) -> bool:
    return isinstance(value, str) and bool(value)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check(ok: bool, name: str, value: object, expected: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is invalid: expected {expected}")
