"""vLLM's config tree (`llm_engine.vllm_config`, `.model_config`) as read-only views.

Code written for vLLM reads the engine's settings as `llm.llm_engine.model_config.max_model_len`,
`vllm_config.cache_config.block_size`, `vllm_config.scheduler_config.max_num_seqs` and the like.
paged keeps one `EngineConfig` (config.py) plus what loading resolved (the HF config, the torch
dtype, the KV pool size) on the `LLMEngine`; these views read both at access time and hold no
state of their own, so they never disagree with the engine. A name a view does not map falls
back to the `EngineConfig` field of that name (vLLM's options mostly share paged's names).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from paged_engine.engine.llm_engine import LLMEngine

__all__ = ["CacheConfig", "ModelConfig", "ParallelConfig", "SchedulerConfig", "VllmConfig"]


class _View:
    """Reads `engine.config`; `_aliases` maps vLLM's name to paged's where they differ."""

    __slots__ = ("_engine",)
    _aliases: ClassVar[dict[str, str]] = {}

    def __init__(self, engine: LLMEngine) -> None:
        object.__setattr__(self, "_engine", engine)

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("_"):
            config = self._engine.config
            field = self._aliases.get(name, name)
            if hasattr(config, field):
                return getattr(config, field)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"{type(self).__name__} is a read-only view of the engine's settings: pass "
            f"{name} to LLM(...) / LLMEngine(...) instead"
        )

    # A view holds no state: a copy (deep too) is another view of the same engine, never a copy
    # of the engine. (copy's default rebuilds the slot with setattr, which a view refuses.)
    def __copy__(self) -> _View:
        return type(self)(self._engine)

    def __deepcopy__(self, memo: dict[int, Any]) -> _View:
        return type(self)(self._engine)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            f"{type(self).__name__} is a view of a running engine and cannot be pickled: "
            "pickle the values read from it"
        )

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={getattr(self, k)!r}" for k in self._shown)
        return f"{type(self).__name__}({shown})"

    _shown: ClassVar[tuple[str, ...]] = ()


class ModelConfig(_View):
    """vLLM's `ModelConfig`: the model, its HF config and the lengths and dtype it runs with."""

    __slots__ = ()
    _shown = ("model", "tokenizer", "dtype", "max_model_len", "runner_type")

    @property
    def tokenizer(self) -> str:
        """The tokenizer's name or path (the model's when none was given, as vLLM)."""
        config = self._engine.config
        return config.tokenizer or config.model

    @property
    def served_model_name(self) -> str:
        config = self._engine.config
        return config.served_model_name or config.model

    @property
    def dtype(self) -> Any:
        """The resolved torch dtype of the weights (vLLM's; the option may say "auto")."""
        return self._engine.dtype

    @property
    def hf_config(self) -> Any:
        return self._engine.hf_config

    @property
    def hf_text_config(self) -> Any:
        """The language model's config (a multimodal model's text_config)."""
        hf = self._engine.hf_config
        return hf.get_text_config() if hasattr(hf, "get_text_config") else hf

    @property
    def architectures(self) -> list[str]:
        return list(getattr(self._engine.hf_config, "architectures", None) or [])

    @property
    def runner_type(self) -> str:
        """vLLM's "generate" or "pooling" (a model that embeds as it generates: "generate")."""
        return "pooling" if self._engine.serves == "pooling" else "generate"

    def get_vocab_size(self) -> int:
        return int(self.hf_text_config.vocab_size)

    def get_hidden_size(self) -> int:
        return int(self.hf_text_config.hidden_size)

    def get_diff_sampling_param(self) -> dict[str, Any]:
        """The SamplingParams defaults the model's generation config sets (a copy)."""
        return dict(self._engine.generation_defaults)


class CacheConfig(_View):
    """vLLM's `CacheConfig`: the KV cache's block size, element type and pool size."""

    __slots__ = ()
    _aliases: ClassVar[dict[str, str]] = {
        "cache_dtype": "kv_cache_dtype",
        "cpu_offload_gb": "cpu_offload_gib",
    }
    _shown = ("block_size", "cache_dtype", "num_gpu_blocks", "enable_prefix_caching")

    @property
    def num_gpu_blocks(self) -> int:
        """The KV pool's blocks as allocated (the null block included)."""
        return self._engine.num_blocks


class SchedulerConfig(_View):
    """vLLM's `SchedulerConfig`: the per-step sequence and token budgets."""

    __slots__ = ()
    _aliases: ClassVar[dict[str, str]] = {"policy": "scheduling_policy"}
    _shown = ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "policy")


class ParallelConfig(_View):
    """vLLM's `ParallelConfig`: the ranks an engine runs on (one data-parallel rank)."""

    __slots__ = ()
    _shown = ("tensor_parallel_size", "pipeline_parallel_size", "world_size")

    @property
    def world_size(self) -> int:
        config = self._engine.config
        return config.tensor_parallel_size * config.pipeline_parallel_size

    @property
    def data_parallel_size(self) -> int:
        return 1  # an LLMEngine is one replica; paged-server runs data parallelism above it


class VllmConfig(_View):
    """vLLM's `VllmConfig`: the sub-configs above, over one engine."""

    __slots__ = ()
    _shown = ("model_config",)

    @property
    def model_config(self) -> ModelConfig:
        return ModelConfig(self._engine)

    @property
    def cache_config(self) -> CacheConfig:
        return CacheConfig(self._engine)

    @property
    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(self._engine)

    @property
    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(self._engine)
