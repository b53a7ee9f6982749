"""`EngineStats`: a snapshot of the engine for metrics and `LLM.get_stats()`, built from the
scheduler, the block manager, the engine core's counters, the draft planner and the adapter
registry."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from paged_engine.spec_decode.planner import DraftPlanner

if TYPE_CHECKING:
    from paged_engine.engine.llm_engine import LLMEngine


@dataclass(slots=True)
class EngineStats:
    """A snapshot of the engine; `kv_*` figures are over the running sequences right now."""

    num_running: int
    num_waiting: int  # all waiting requests, the deferred ones included
    num_total_blocks: int
    num_used_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    kv_cache_usage: float  # used / total blocks, 0..1
    kv_slots_allocated: int  # block slots held by running sequences (shared blocks once)
    kv_tokens_stored: int  # distinct tokens those slots hold
    kv_waste_perc: float  # 100 * (allocated - stored) / allocated
    blocks_saved_by_sharing: int  # table entries minus distinct blocks (fork and prefix sharing)
    prefix_cache_queries: int  # tokens looked up at admission
    prefix_cache_hits: int  # tokens found cached
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    peak_used_blocks: int
    block_size: int
    # Speculative decoding (vLLM's spec_decode_* counters): verified proposals, the draft
    # tokens they held, how many of those the target accepted, and per draft position j (one
    # entry per speculative token) the proposals whose drafts 0..j were all accepted.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    # Derived as vLLM does (None before the first proposal): accepted / draft tokens, and
    # 1 + accepted / drafts (tokens a verified row emits on average, the bonus token included).
    spec_decode_acceptance_rate: float | None = None
    spec_decode_mean_acceptance_length: float | None = None
    # The CPU block pool (swap_space + cpu_offload_gib): its size and free blocks (free ones
    # may hold prefix-cache tier content), preemptions that swapped, and the prefix-cache hits
    # (tokens, part of prefix_cache_hits) served from the CPU tier.
    num_cpu_blocks: int = 0
    num_free_cpu_blocks: int = 0
    num_swap_preemptions: int = 0
    prefix_cache_cpu_hits: int = 0
    # Models with a recurrent state and prefix caching (core/state_slots.py): snapshot rows
    # registered now, admissions resumed from one, decode snapshots copied (None otherwise).
    state_snapshots_cached: int | None = None
    state_snapshot_hits: int | None = None
    state_decode_snapshots: int | None = None
    # enable_lora: max_loras, and the adapters (names) of running and of waiting requests.
    max_loras: int = 0
    running_lora_adapters: list[str] = field(default_factory=list)
    waiting_lora_adapters: list[str] = field(default_factory=list)
    # Sleep mode (engine/sleep_mode.py): "awake", "weights_offloaded", "discard_all", or ""
    # (paused, or only the KV cache sleeps).
    sleep_state: str = "awake"
    # kv_transfer_config (vLLM's external prefix cache): prompt tokens of the requests looked up
    # in storage, and the tokens loaded from it (counted as computed, never run)
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    # Prompt tokens by source at each request's first scheduling (vLLM's
    # prompt_tokens_by_source{source}, prompt_tokens_cached, prompt_tokens_recomputed;
    # core/step_emit.py PromptTokenSources)
    prompt_tokens_local_compute: int = 0
    prompt_tokens_local_cache_hit: int = 0
    prompt_tokens_external_kv_transfer: int = 0
    prompt_tokens_cached: int = 0
    prompt_tokens_recomputed: int = 0
    # Tokens per engine step (vLLM's iteration_tokens_total): cumulative count per bucket of
    # ITERATION_TOKENS_BUCKETS (+Inf last), sum, count (engine_core.iteration_tokens).
    iteration_tokens: tuple[list[int], float, int] | None = None
    # The multimodal processor cache (mm_processor_cache_gb; vLLM's mm_cache_queries /
    # mm_cache_hits): images looked up and found (None without one)
    mm_cache_queries: int | None = None
    mm_cache_hits: int | None = None
    # Waiting requests that could not be admitted even with room (vLLM's `deferred` waiting
    # reason): grammar still compiling, LoRA adapter over max_loras; the rest wait for capacity
    num_waiting_deferred: int = 0
    # Requests whose logits held a NaN (vLLM's corrupted_requests; None unless
    # PAGED_COMPUTE_NANS_IN_LOGITS / VLLM_COMPUTE_NANS_IN_LOGITS is set)
    corrupted_requests: int | None = None


def waiting_by_reason(stats: EngineStats) -> tuple[tuple[str, int], ...]:
    """vLLM's num_requests_waiting_by_reason: (its `reason` label, requests), summing to
    num_waiting."""
    deferred = stats.num_waiting_deferred
    return (("capacity", stats.num_waiting - deferred), ("deferred", deferred))


# vLLM's prompt_tokens_by_source: (its `source` label, the EngineStats field), in vLLM's order
PROMPT_TOKEN_SOURCES = (
    ("local_compute", "prompt_tokens_local_compute"),
    ("local_cache_hit", "prompt_tokens_local_cache_hit"),
    ("external_kv_transfer", "prompt_tokens_external_kv_transfer"),
)


def engine_stats(engine: LLMEngine) -> EngineStats:
    sched, core = engine.scheduler, engine.engine_core
    bm = engine.block_manager.stats(sched.running_seqs())
    allocated = bm.num_slots_allocated
    sources = sched.prompt_sources
    return EngineStats(
        num_running=sched.num_running,
        num_waiting=sched.num_waiting + core.num_compiling,
        num_waiting_deferred=core.num_compiling + sched.num_passed_for_adapters,
        num_total_blocks=bm.num_total_blocks,
        num_used_blocks=bm.num_used_blocks,
        num_free_blocks=bm.num_free_blocks,
        num_cached_blocks=bm.num_cached_blocks,
        kv_cache_usage=bm.usage,
        kv_slots_allocated=allocated,
        kv_tokens_stored=bm.num_tokens_stored,
        kv_waste_perc=100.0 * bm.kv_waste,
        blocks_saved_by_sharing=bm.blocks_saved_by_sharing,
        prefix_cache_queries=bm.prefix_cache_queries,
        prefix_cache_hits=bm.prefix_cache_hits,
        num_preemptions=sched.num_preemptions,
        prompt_tokens_total=core.prompt_tokens_total,
        generation_tokens_total=core.generation_tokens_total,
        peak_used_blocks=core.peak_used_blocks,
        block_size=engine.config.block_size,
        num_cpu_blocks=bm.num_cpu_blocks,
        num_free_cpu_blocks=bm.num_free_cpu_blocks,
        num_swap_preemptions=sched.num_swap_preemptions,
        prefix_cache_cpu_hits=bm.prefix_cache_cpu_hits,
        sleep_state=engine.sleep_mode.state(),
        prompt_tokens_local_compute=sources.computed,
        prompt_tokens_local_cache_hit=sources.local_cache_hit,
        prompt_tokens_external_kv_transfer=sources.external_kv_transfer,
        prompt_tokens_cached=sources.cached,
        prompt_tokens_recomputed=sources.recomputed,
        iteration_tokens=core.iteration_tokens.snapshot(),
        corrupted_requests=core.corrupted_requests if core.counts_nans else None,
        **_mm_cache_stats(engine),
        **_spec_stats(engine.draft_planner),
        **_lora_stats(engine),
        **_state_stats(engine),
        **_kv_transfer_stats(engine),
    )


def _mm_cache_stats(engine: LLMEngine) -> dict[str, Any]:
    images = engine.input_processor.images
    cache = None if images is None else images.cache
    if cache is None:
        return {}
    hits = cache.hits  # read once: queries >= hits while request threads count
    return {"mm_cache_queries": hits + cache.misses, "mm_cache_hits": hits}


def _kv_transfer_stats(engine: LLMEngine) -> dict[str, Any]:
    connector = engine.scheduler.kv_connector
    if connector is None:
        return {}
    return {
        "external_prefix_cache_queries": connector.queries,
        "external_prefix_cache_hits": connector.hits,
    }


def _state_stats(engine: LLMEngine) -> dict[str, Any]:
    slots = engine.scheduler.state_slots
    if slots is None or not slots.num_snapshots:
        return {}
    return {
        "state_snapshots_cached": slots.num_cached_snapshots,
        "state_snapshot_hits": slots.snapshot_hits,
        "state_decode_snapshots": slots.decode_snapshots,
    }


def _lora_stats(engine: LLMEngine) -> dict[str, Any]:
    registry = engine.lora_registry
    if registry is None:
        return {}

    def names(reqs: Iterable) -> list[str]:
        ids = {r.lora_id for r in reqs if r.lora_id}
        known = registry.loaded
        return sorted(known[i].lora_name if i in known else str(i) for i in ids)

    sched = engine.scheduler
    return {
        "max_loras": engine.config.max_loras,
        "running_lora_adapters": names(sched.running),
        "waiting_lora_adapters": names(sched.waiting),
    }


def _spec_stats(planner: DraftPlanner | None) -> dict[str, Any]:
    if planner is None:
        return {}
    drafts, drafted, accepted = (
        planner.num_drafts,
        planner.num_draft_tokens,
        planner.num_accepted_tokens,
    )
    return {
        "spec_decode_num_drafts": drafts,
        "spec_decode_num_draft_tokens": drafted,
        "spec_decode_num_accepted_tokens": accepted,
        "spec_decode_num_accepted_tokens_per_pos": list(planner.num_accepted_tokens_per_pos),
        "spec_decode_acceptance_rate": accepted / drafted if drafted else None,
        "spec_decode_mean_acceptance_length": 1 + accepted / drafts if drafts else None,
    }
