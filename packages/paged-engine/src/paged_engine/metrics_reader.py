"""`LLM.get_metrics()`: the engine's metrics as vLLM's reader records (`vllm.v1.metrics.reader`
-> `paged_engine.metrics_reader`), named as vLLM names them (`vllm:...`), so a script that
reads them ports by changing the import.

Counters, gauges and tokens per engine step come from `EngineStats`; the latency histograms
(time to first token, between tokens, end to end, in the queue) and the finished-request
counter from the requests `LLM`'s calls ran (engine/request_latency.py). Every record is
labelled with the model name and engine "0", as vLLM's one-engine metrics are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from paged_engine.engine.request_latency import (
    FINISH_REASONS,
    ITERATION_TOKENS_BUCKETS,
    RequestLatency,
    go_float,
)
from paged_engine.engine.stats import PROMPT_TOKEN_SOURCES, waiting_by_reason


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Vector(Metric):
    """Counters per index (vLLM's spec_decode_num_accepted_tokens_per_pos)."""

    values: list[int]


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Histogram(Metric):
    """`buckets`: upper bound (as text, "+Inf" last) -> observations at or below it."""

    count: int
    sum: float
    buckets: dict[str, int]


# (vLLM's name, EngineStats field)
_GAUGES = (
    ("vllm:num_requests_running", "num_running"),
    ("vllm:num_requests_waiting", "num_waiting"),
    ("vllm:kv_cache_usage_perc", "kv_cache_usage"),
)
_COUNTERS = (
    ("vllm:num_preemptions", "num_preemptions"),
    ("vllm:prompt_tokens", "prompt_tokens_total"),
    ("vllm:generation_tokens", "generation_tokens_total"),
    ("vllm:prefix_cache_queries", "prefix_cache_queries"),
    ("vllm:prefix_cache_hits", "prefix_cache_hits"),
    ("vllm:external_prefix_cache_queries", "external_prefix_cache_queries"),  # kv_transfer
    ("vllm:external_prefix_cache_hits", "external_prefix_cache_hits"),
    ("vllm:spec_decode_num_drafts", "spec_decode_num_drafts"),
    ("vllm:spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens"),
    ("vllm:spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens"),
    ("vllm:prompt_tokens_cached", "prompt_tokens_cached"),
    ("vllm:prompt_tokens_recomputed", "prompt_tokens_recomputed"),
)


def snapshot(stats: Any, latency: RequestLatency, model_name: str) -> list[Metric]:
    labels = {"model_name": model_name, "engine": "0"}
    out: list[Metric] = [
        Gauge(name, dict(labels), float(getattr(stats, field))) for name, field in _GAUGES
    ]
    out += [
        Gauge("vllm:num_requests_waiting_by_reason", {**labels, "reason": reason}, float(n))
        for reason, n in waiting_by_reason(stats)
    ]
    out += [Counter(name, dict(labels), int(getattr(stats, field))) for name, field in _COUNTERS]
    out += [
        Counter("vllm:prompt_tokens_by_source", {**labels, "source": src}, getattr(stats, field))
        for src, field in PROMPT_TOKEN_SOURCES
    ]
    if stats.corrupted_requests is not None:  # PAGED_COMPUTE_NANS_IN_LOGITS
        out.append(Counter("vllm:corrupted_requests", dict(labels), stats.corrupted_requests))
    if stats.mm_cache_queries is not None:  # an image processor cache
        out.append(Counter("vllm:mm_cache_queries", dict(labels), stats.mm_cache_queries))
        out.append(Counter("vllm:mm_cache_hits", dict(labels), stats.mm_cache_hits))
    per_pos = stats.spec_decode_num_accepted_tokens_per_pos
    if per_pos:
        out.append(
            Vector("vllm:spec_decode_num_accepted_tokens_per_pos", dict(labels), list(per_pos))
        )
    finished = {reason: 0 for reason in FINISH_REASONS} | dict(latency.finished)
    for reason, n in sorted(finished.items()):
        out.append(Counter("vllm:request_success", {**labels, "finished_reason": reason}, int(n)))
    histograms = [(h.name, h.buckets, h.snapshot()) for h in latency.histograms]
    steps = stats.iteration_tokens
    if steps is not None:
        histograms.append(("iteration_tokens_total", ITERATION_TOKENS_BUCKETS, steps))
    for name, buckets, (cumulative, total, count) in histograms:
        bounds = [go_float(float(b)) for b in buckets] + ["+Inf"]  # vLLM's `le` labels
        out.append(
            Histogram("vllm:" + name, dict(labels), count, total, dict(zip(bounds, cumulative)))
        )
    return out
