"""GET /metrics: vLLM's metric names under the `paged:` prefix (`--metrics-prefix vllm`: under
vLLM's own, for dashboards, routers and autoscalers written for it), as Prometheus text 0.0.4,
or OpenMetrics 1.0 for a scraper that asks (exposition.py: the formats). Histogram buckets are
cumulative up to `+Inf` == _count. Samples carry vLLM V1's labels, `engine` and `model_name`,
with label names sorted as prometheus_client writes them.

Histograms (paged_engine.engine.request_latency, shared with `LLM.get_metrics`) are observed on
the output thread and rendered on HTTP threads, each from a consistent snapshot.
"""

from __future__ import annotations

import re
import threading
import time
from collections import Counter
from typing import Any

from paged_engine.engine.request_latency import (
    FINISH_REASONS,
    ITERATION_TOKENS_BUCKETS,
    Histogram,
    RequestLatency,
)
from paged_engine.engine.stats import PROMPT_TOKEN_SOURCES, waiting_by_reason
from paged_server.exposition import (
    CONTENT_TYPE,
    OPENMETRICS_CONTENT_TYPE,
    esc,
    help_text,
    num,
    to_openmetrics,
    wants_openmetrics,
)


def label_text(labels: dict[str, str]) -> str:
    """A sample's labels as prometheus_client (so vLLM) writes them: sorted by name, values
    escaped (`engine="0",le="0.5",model_name="m"`)."""
    return ",".join(f'{k}="{esc(v)}"' for k, v in sorted(labels.items()))


def render_histogram(h: Histogram, labels: dict[str, str], name: str | None = None) -> list[str]:
    """`h` as Prometheus text, named `paged:<name>` (`name`: another name for the same data)."""
    return histogram_lines("paged:" + (name or h.name), h.help, h.buckets, h.snapshot(), labels)


def histogram_lines(
    name: str,
    doc: str,
    bounds: tuple[float, ...],
    snapshot: tuple[list[int], float, int],
    labels: dict[str, str],
) -> list[str]:
    """A histogram family from a snapshot (cumulative counts, +Inf last; sum; count)."""
    cumulative, total, count = snapshot
    lab = label_text(labels)
    lines = [f"# HELP {name} {help_text(doc)}", f"# TYPE {name} histogram"]
    les = [num(float(b)) for b in bounds] + ["+Inf"]
    lines += [
        f"{name}_bucket{{{label_text({**labels, 'le': le})}}} {c}" for le, c in zip(les, cumulative)
    ]
    lines.append(f"{name}_sum{{{lab}}} {num(float(total))}")
    lines.append(f"{name}_count{{{lab}}} {count}")
    return lines


# (metric name, EngineStats field, type, help); `kv_cache_usage` is 0..1 like vLLM's `_perc`.
_ENGINE_METRICS = (
    ("paged:num_requests_running", "num_running", "gauge", "Requests in the running batch."),
    ("paged:num_requests_waiting", "num_waiting", "gauge", "Requests waiting to be scheduled."),
    ("paged:kv_cache_usage_perc", "kv_cache_usage", "gauge", "KV-cache usage; 1 means 100%."),
    # vLLM's names before 0.10, still read by routers (production-stack) and dashboards
    (
        "paged:gpu_cache_usage_perc",
        "kv_cache_usage",
        "gauge",
        "KV-cache usage; 1 means 100%. Deprecated: kv_cache_usage_perc.",
    ),
    ("paged:kv_cache_total_blocks", "num_total_blocks", "gauge", "Blocks in the KV pool."),
    ("paged:kv_cache_used_blocks", "num_used_blocks", "gauge", "KV blocks in use."),
    ("paged:kv_cache_free_blocks", "num_free_blocks", "gauge", "KV blocks free."),
    ("paged:kv_cache_cached_blocks", "num_cached_blocks", "gauge", "Free blocks kept for reuse."),
    ("paged:kv_slots_allocated", "kv_slots_allocated", "gauge", "Token slots in used blocks."),
    ("paged:kv_tokens_stored", "kv_tokens_stored", "gauge", "Tokens whose KV is stored."),
    ("paged:kv_cache_waste_perc", "kv_waste_perc", "gauge", "Allocated slots holding no token."),
    (
        "paged:kv_blocks_saved_by_sharing",
        "blocks_saved_by_sharing",
        "gauge",
        "Blocks saved by sharing (n > 1, beams, prefix cache).",
    ),
    (
        "paged:prefix_cache_queries_total",
        "prefix_cache_queries",
        "counter",
        "Prefix-cache queries, in tokens.",
    ),
    (
        "paged:prefix_cache_hits_total",
        "prefix_cache_hits",
        "counter",
        "Prefix-cache hits, in tokens.",
    ),
    (
        "paged:gpu_prefix_cache_queries_total",
        "prefix_cache_queries",
        "counter",
        "Prefix-cache queries, in tokens. Deprecated: prefix_cache_queries_total.",
    ),
    (
        "paged:gpu_prefix_cache_hits_total",
        "prefix_cache_hits",
        "counter",
        "Prefix-cache hits, in tokens. Deprecated: prefix_cache_hits_total.",
    ),
    (
        "paged:external_prefix_cache_queries_total",
        "external_prefix_cache_queries",
        "counter",
        "Prompt tokens of the requests looked up in kv_transfer storage.",
    ),
    (
        "paged:external_prefix_cache_hits_total",
        "external_prefix_cache_hits",
        "counter",
        "Prompt tokens loaded from kv_transfer storage (counted as computed).",
    ),
    ("paged:num_preemptions_total", "num_preemptions", "counter", "Preemptions (recompute)."),
    (
        "paged:corrupted_requests_total",
        "corrupted_requests",
        "counter",
        "Requests whose logits held a NaN (PAGED_COMPUTE_NANS_IN_LOGITS=1 only).",
    ),
    (
        "paged:prompt_tokens_cached_total",
        "prompt_tokens_cached",
        "counter",
        "Prompt tokens not run: prefix-cache hits plus tokens loaded by kv_transfer.",
    ),
    (
        "paged:prompt_tokens_recomputed_total",
        "prompt_tokens_recomputed",
        "counter",
        "Cached prompt tokens run again (the last token of a prompt cached but for it).",
    ),
    (
        "paged:mm_cache_queries_total",
        "mm_cache_queries",
        "counter",
        "Multimodal processor cache queries, in items.",
    ),
    ("paged:mm_cache_hits_total", "mm_cache_hits", "counter", "Multimodal cache hits, in items."),
    (
        "paged:state_snapshots_cached",
        "state_snapshots_cached",
        "gauge",
        "Recurrent-state snapshots kept for the prefix cache (models with a state).",
    ),
    (
        "paged:state_snapshot_hits_total",
        "state_snapshot_hits",
        "counter",
        "Admissions resumed from a recurrent-state snapshot.",
    ),
    (
        "paged:state_decode_snapshots_total",
        "state_decode_snapshots",
        "counter",
        "Recurrent-state snapshots taken after generated tokens.",
    ),
    ("paged:prompt_tokens_total", "prompt_tokens_total", "counter", "Prefill tokens processed."),
    (
        "paged:generation_tokens_total",
        "generation_tokens_total",
        "counter",
        "Generation tokens processed.",
    ),
    (
        "paged:spec_decode_num_drafts_total",
        "spec_decode_num_drafts",
        "counter",
        "Speculative decoding: verified draft proposals.",
    ),
    (
        "paged:spec_decode_num_draft_tokens_total",
        "spec_decode_num_draft_tokens",
        "counter",
        "Speculative decoding: draft tokens proposed.",
    ),
    (
        "paged:spec_decode_num_accepted_tokens_total",
        "spec_decode_num_accepted_tokens",
        "counter",
        "Speculative decoding: draft tokens the target accepted.",
    ),
    # vLLM v0's gauge name; no samples before the first proposal (the rate is undefined).
    (
        "paged:spec_decode_draft_acceptance_rate",
        "spec_decode_acceptance_rate",
        "gauge",
        "Speculative decoding: accepted / draft tokens since start.",
    ),
    (
        "paged:spec_decode_mean_acceptance_length",
        "spec_decode_mean_acceptance_length",
        "gauge",
        "Speculative decoding: 1 + accepted tokens / drafts since start.",
    ),
)
_PER_POS = "paged:spec_decode_num_accepted_tokens_per_pos_total"
_BY_SOURCE = "paged:prompt_tokens_by_source_total"
_BY_REASON = "paged:num_requests_waiting_by_reason"


class Metrics:
    def __init__(self, model_name: str, prefix: str = "paged", max_model_len: int | None = None):
        # vLLM's labels: one engine per server, index 0 (the data-parallel front sets each
        # replica's index: exposition.merge_expositions)
        self.labels = {"engine": "0", "model_name": model_name}
        self.prefix = prefix  # each metric's name is `prefix:...` (check_prefix)
        self.latency = RequestLatency(max_model_len)  # observed on the output thread
        lat = self.latency
        self.ttft, self.itl, self.e2e, self.queue_time = lat.ttft, lat.itl, lat.e2e, lat.queue_time
        self.finished = lat.finished
        self.requests_aborted = 0  # engine thread
        self.http: Counter[tuple[str, int]] = Counter()  # (route, status)
        self._http_lock = threading.Lock()

    def set_max_model_len(self, max_model_len: int) -> None:
        """The token-count histograms' buckets (vLLM's 1-2-5 up to max_model_len); once, before
        the first request."""
        if not self.latency.token_histograms:
            self.latency.set_max_model_len(max_model_len)

    def count_http(self, route: str, status: int) -> None:
        with self._http_lock:
            self.http[(route, status)] += 1

    def exposition(self, stats: Any, accept: str = "") -> tuple[bytes, str]:
        """(body, Content-Type) for a scrape sending `accept`: OpenMetrics 1.0 when it names
        application/openmetrics-text (Prometheus does by default; prometheus_client, so vLLM,
        chooses it on that alone), Prometheus text 0.0.4 otherwise."""
        text = self.render(stats)
        if wants_openmetrics(accept):
            return to_openmetrics(text).encode(), OPENMETRICS_CONTENT_TYPE
        return text.encode(), CONTENT_TYPE

    def render(self, stats: Any) -> str:
        base = self.labels
        lab = label_text(base)

        def labelled(**extra: str) -> str:  # the base labels and `extra`, in sorted order
            return label_text({**base, **extra})

        lines: list[str] = []
        for name, field, kind, doc in _ENGINE_METRICS:
            value = getattr(stats, field, None)
            if value is None:
                continue
            lines += [f"# HELP {name} {help_text(doc)}", f"# TYPE {name} {kind}"]
            lines.append(f"{name}{{{lab}}} {num(value)}")
        if getattr(stats, "num_waiting_deferred", None) is not None:  # vLLM's, one per reason
            lines += [
                f"# HELP {_BY_REASON} Waiting requests by reason: for room in the batch or the "
                "KV cache (capacity), or for a grammar to compile or a LoRA slot (deferred).",
                f"# TYPE {_BY_REASON} gauge",
            ]
            lines += [
                f"{_BY_REASON}{{{labelled(reason=reason)}}} {n}"
                for reason, n in waiting_by_reason(stats)
            ]
        # vLLM's prompt_tokens_by_source: one sample per source
        if getattr(stats, PROMPT_TOKEN_SOURCES[0][1], None) is not None:
            lines += [
                f"# HELP {_BY_SOURCE} Prompt tokens by source: run (local_compute), found in the "
                "prefix cache (local_cache_hit), loaded by kv_transfer (external_kv_transfer).",
                f"# TYPE {_BY_SOURCE} counter",
            ]
            lines += [
                f"{_BY_SOURCE}{{{labelled(source=source)}}} {num(getattr(stats, field))}"
                for source, field in PROMPT_TOKEN_SOURCES
            ]
        per_pos = getattr(stats, "spec_decode_num_accepted_tokens_per_pos", None)
        if per_pos:  # vLLM's labelled counter: one sample per draft position
            lines += [
                f"# HELP {_PER_POS} Speculative decoding: drafts accepted up to each position.",
                f"# TYPE {_PER_POS} counter",
            ]
            lines += [
                f"{_PER_POS}{{{labelled(position=str(j))}}} {n}" for j, n in enumerate(per_pos)
            ]
        if getattr(stats, "max_loras", 0):  # vLLM's info gauge: the value is the time
            info = labelled(
                max_lora=str(stats.max_loras),
                running_lora_adapters=",".join(stats.running_lora_adapters),
                waiting_lora_adapters=",".join(stats.waiting_lora_adapters),
            )
            lines += [
                "# HELP paged:lora_requests_info LoRA adapters of running and waiting requests.",
                "# TYPE paged:lora_requests_info gauge",
                f"paged:lora_requests_info{{{info}}} {num(time.time())}",
            ]
        state = getattr(stats, "sleep_state", None)
        if state is not None:  # vLLM's: one sample per state, 1 for the current one
            lines += [
                "# HELP paged:engine_sleep_state Sleep mode: awake = 1 while nothing sleeps and "
                "scheduling runs; weights_offloaded = 1 after level 1; discard_all = 1 after "
                "level 2.",
                "# TYPE paged:engine_sleep_state gauge",
            ]
            lines += [
                f"paged:engine_sleep_state{{{labelled(sleep_state=s)}}} {int(s == state)}"
                for s in ("awake", "weights_offloaded", "discard_all")
            ]
        block_size = getattr(stats, "block_size", None)
        if block_size is not None:  # vLLM's info gauge; routers read block_size, num_gpu_blocks
            info = labelled(
                block_size=str(block_size),
                num_gpu_blocks=str(stats.num_total_blocks),
                num_cpu_blocks=str(getattr(stats, "num_cpu_blocks", 0)),
            )
            lines += [
                "# HELP paged:cache_config_info KV-cache configuration (labels); the value is 1.",
                "# TYPE paged:cache_config_info gauge",
                f"paged:cache_config_info{{{info}}} 1",
            ]
        steps = getattr(stats, "iteration_tokens", None)
        if steps is not None:  # the engine's, vLLM's buckets
            doc = "Tokens per engine step: prompt chunks, decode tokens and drafts it runs."
            name = "paged:iteration_tokens_total"
            lines += histogram_lines(name, doc, ITERATION_TOKENS_BUCKETS, steps, base)
        for h in self.latency.histograms:
            lines += render_histogram(h, base)
        # vLLM's name for the inter-token histogram before 0.11, still in its Grafana dashboard
        lines += render_histogram(self.itl, base, "time_per_output_token_seconds")
        lines += [
            "# HELP paged:request_success_total Finished requests (one per prompt, whatever its n) "
            "by the finish reason of its first sequence.",
            "# TYPE paged:request_success_total counter",
        ]
        finished = {reason: 0 for reason in FINISH_REASONS} | dict(self.finished)
        for reason, n in sorted(finished.items()):
            lines.append(f"paged:request_success_total{{{labelled(finished_reason=reason)}}} {n}")
        lines += [
            "# HELP paged:request_aborted_total Requests aborted by client disconnects.",
            "# TYPE paged:request_aborted_total counter",
            f"paged:request_aborted_total{{{lab}}} {self.requests_aborted}",
        ]
        lines += [
            "# HELP paged:http_requests_total HTTP requests by route and status.",
            "# TYPE paged:http_requests_total counter",
        ]
        with self._http_lock:
            http = sorted(self.http.items())
        for (route, status), n in http:
            lines.append(f'paged:http_requests_total{{route="{esc(route)}",status="{status}"}} {n}')
        if self.prefix != "paged":
            lines = [_renamed(line, self.prefix) for line in lines]
        return "\n".join(lines) + "\n"


def check_prefix(prefix: str) -> str:
    """A metric-name prefix: a Prometheus name ([a-zA-Z_][a-zA-Z0-9_]*), `:` added after it."""
    if not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", prefix):
        raise ValueError(f"metrics prefix must match [a-zA-Z_][a-zA-Z0-9_]*, got {prefix!r}")
    return prefix


def _renamed(line: str, prefix: str) -> str:
    """One exposition line (a sample, or its # HELP / # TYPE) with `paged:` -> `prefix:` in the
    metric's name; label values keep theirs."""
    for head in ("", "# HELP ", "# TYPE "):
        if line.startswith(head + "paged:"):
            return head + prefix + line[len(head) + len("paged") :]
    return line
