"""Per-request histograms (vLLM's names and buckets): time to first token, between tokens, end to
end, in the queue, prefilling, decoding, running and per output token; with `max_model_len`
also prompt / generated / prefill-computed tokens, `n` and `max_tokens` (1-2-5 buckets up to
max_model_len, as vLLM's); and finished requests by reason. paged-server renders them on
/metrics; `LLM.get_metrics()` returns them as vLLM's reader records.

`observe` takes the engine's token times (one monotonic clock for the engine and the server).
One output may cover several steps (FINAL_ONLY, or beams): the span from its first (or the
previous output's last) token to its last is observed as that many equal gaps, so the
inter-token sum and count are those of per-step observation. Thread-safe: a lock per histogram
keeps a snapshot consistent (bucket counts never exceed the count).
"""

from __future__ import annotations

import bisect
import math
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
N_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0)
# vLLM's iteration_tokens_total buckets (tokens per engine step)
ITERATION_TOKENS_BUCKETS = (
    1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0,
)  # fmt: skip


# vLLM's finish reasons: each request_success series exists (at 0) from the start, so rate()
# sees its first increase
FINISH_REASONS = ("abort", "error", "length", "repetition", "stop")


def go_float(v: float) -> str:
    """A float as prometheus_client writes values and `le` bounds (Go's shortest form, so
    vLLM's): repr's digits, with an exponent from 1e6 on ("1e+06": Prometheus 2 keeps `le` as
    sent, so another spelling of a bound is another series), +Inf / -Inf / NaN."""
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    text = repr(v)
    sign, digits = ("-", text[1:]) if v < 0 else ("", text)
    dot = digits.find(".")
    if dot > 6:  # repr writes 1e6 <= |v| < 1e16 as digits ("1234567.0"), Go as d.ddde+XX
        mantissa = f"{digits[0]}.{digits[1:dot]}{digits[dot + 1 :]}".rstrip("0").rstrip(".")
        return f"{sign}{mantissa}e+{dot - 1:02d}"
    return text


def build_1_2_5_buckets(max_value: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's token-count buckets)."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(float(m * scale))
        scale *= 10


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]) -> None:
        self.name, self.help, self.buckets = name, help_text, buckets  # name without a prefix
        self._counts = [0] * (len(buckets) + 1)  # last slot: +Inf
        self._sum = 0.0
        self._count = 0
        self._lock = threading.Lock()

    def observe(self, value: float, count: int = 1) -> None:
        with self._lock:
            self._counts[bisect.bisect_left(self.buckets, value)] += count
            self._sum += value * count
            self._count += count

    def snapshot(self) -> tuple[list[int], float, int]:
        """(cumulative count per bucket, +Inf last; sum; count), consistent with each other."""
        with self._lock:
            counts, total, count = list(self._counts), self._sum, self._count
        cumulative, running = [], 0
        for c in counts:
            running += c
            cumulative.append(running)
        return cumulative, total, count


@dataclass(slots=True)
class RequestClock:
    """One request's latency bookkeeping between its outputs."""

    arrival: float  # monotonic, the engine's clock
    last_token: float | None = None  # None until the first token arrived
    # (sequence index, finish reason) of the lowest-index sequence that finished so far: the
    # request's reason in the finished counter, which counts requests, not sequences.
    finished_seq: tuple[int, str] | None = None
    # the request's max_tokens (None: not known here, request_params_max_tokens not observed)
    max_tokens: int | None = None
    # generated tokens per sequence index so far (outputs carry new tokens: DELTA / FINAL_ONLY)
    seq_tokens: dict[int, int] = field(default_factory=dict)


def request_clock(arrival: float, params: Any) -> RequestClock:
    """A request's clock from its arrival; `params`' max_tokens when it has one (a pooling
    request has none: request_params_max_tokens is not observed)."""
    value = getattr(params, "max_tokens", None)
    return RequestClock(arrival, max_tokens=value if isinstance(value, int) else None)


class RequestLatency:
    def __init__(self, max_model_len: int | None = None) -> None:
        self.ttft = Histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = Histogram(
            "inter_token_latency_seconds", "Time between output tokens.", ITL_BUCKETS
        )
        self.e2e = Histogram("e2e_request_latency_seconds", "Arrival to last token.", E2E_BUCKETS)
        self.queue_time = Histogram(
            "request_queue_time_seconds", "Arrival to first scheduling.", E2E_BUCKETS
        )
        # At a request's finish, from the engine's times (phases as vLLM splits them)
        self.prefill_time = Histogram(
            "request_prefill_time_seconds", "First scheduling to first token.", E2E_BUCKETS
        )
        self.decode_time = Histogram(
            "request_decode_time_seconds", "First token to last token.", E2E_BUCKETS
        )
        self.inference_time = Histogram(
            "request_inference_time_seconds", "First scheduling to last token.", E2E_BUCKETS
        )
        self.tpot = Histogram(
            "request_time_per_output_token_seconds",
            "Per request: decode time / (output tokens - 1) of its longest sequence.",
            ITL_BUCKETS,
        )
        self.finished: Counter[str] = Counter()  # requests by finish reason
        self.token_histograms: tuple[Histogram, ...] = ()
        if max_model_len is not None:
            self.set_max_model_len(max_model_len)

    def set_max_model_len(self, max_model_len: int) -> None:
        """The token-count histograms, bucketed 1-2-5 up to `max_model_len`; before any
        observation (they start empty)."""
        tokens = build_1_2_5_buckets(max_model_len)
        self.prompt_tokens = Histogram("request_prompt_tokens", "Prompt tokens.", tokens)
        self.generation_tokens = Histogram(
            "request_generation_tokens", "Generated tokens, all sequences.", tokens
        )
        self.max_generation_tokens = Histogram(
            "request_max_num_generation_tokens", "Generated tokens of the longest sequence.", tokens
        )
        self.prefill_computed = Histogram(
            "request_prefill_kv_computed_tokens",
            "Prompt tokens computed, prefix-cache hits excluded.",
            tokens,
        )
        self.params_n = Histogram("request_params_n", "The n request parameter.", N_BUCKETS)
        self.params_max_tokens = Histogram(
            "request_params_max_tokens", "The max_tokens request parameter.", tokens
        )
        self.token_histograms = (
            self.prompt_tokens,
            self.generation_tokens,
            self.max_generation_tokens,
            self.prefill_computed,
            self.params_n,
            self.params_max_tokens,
        )

    @property
    def histograms(self) -> tuple[Histogram, ...]:
        timing = (self.ttft, self.itl, self.e2e, self.queue_time, self.prefill_time)
        timing += (self.decode_time, self.inference_time, self.tpot)
        return timing + self.token_histograms

    def observe(self, clock: RequestClock, out: Any, now: float) -> None:
        """One output of a request (a RequestOutput, or a pooling output) delivered at `now`."""
        rm = getattr(out, "metrics", None)  # a pooling output has none
        seqs = out.outputs if isinstance(out.outputs, list) else []  # [] for an embedding
        steps = max((len(o.token_ids) for o in seqs), default=0)
        if steps:
            first, last = (now, now) if rm is None else (rm.first_token_time, rm.last_token_time)
            if clock.last_token is None:
                self.ttft.observe(first - clock.arrival)
                if rm is not None and rm.first_scheduled_time is not None:
                    self.queue_time.observe(max(0.0, rm.first_scheduled_time - rm.arrival_time))
                start, gaps = first, steps - 1
            else:
                start, gaps = clock.last_token, steps
            if gaps:
                self.itl.observe((last - start) / gaps, count=gaps)
            clock.last_token = last
        for s in seqs:  # DELTA outputs may carry a sequence's finish before the end
            clock.seq_tokens[s.index] = clock.seq_tokens.get(s.index, 0) + len(s.token_ids)
            if s.finish_reason is not None and (
                clock.finished_seq is None or s.index < clock.finished_seq[0]
            ):
                clock.finished_seq = (s.index, s.finish_reason)
        if out.finished:
            self.e2e.observe(now - clock.arrival)
            reason = clock.finished_seq[1] if clock.finished_seq else "unknown"
            self.finished["stop" if out.outputs is not seqs else reason] += 1  # embeddings: stop
            self._observe_finished(clock, out, rm)

    def _observe_finished(self, clock: RequestClock, out: Any, rm: Any) -> None:
        longest = max(clock.seq_tokens.values(), default=0)
        sched = None if rm is None else rm.first_scheduled_time
        first = None if rm is None else rm.first_token_time
        if sched is not None and first is not None and rm.last_token_time is not None:
            decode = max(0.0, rm.last_token_time - first)
            self.prefill_time.observe(max(0.0, first - sched))
            self.decode_time.observe(decode)
            self.inference_time.observe(max(0.0, rm.last_token_time - sched))
            self.tpot.observe(decode / (longest - 1) if longest > 1 else 0.0)
        if not self.token_histograms:
            return
        prompt = getattr(out, "num_prompt_tokens", None)  # token ids or prompt_embeds rows
        if prompt is None and (ids := getattr(out, "prompt_token_ids", None)) is not None:
            prompt = len(ids)
        if prompt is not None:
            self.prompt_tokens.observe(prompt)
            cached = max(getattr(out, "num_cached_tokens", 0) or 0, 0)
            self.prefill_computed.observe(max(prompt - cached, 0))
        if clock.seq_tokens:  # a generation request (a pooling one has no sequences)
            self.generation_tokens.observe(sum(clock.seq_tokens.values()))
            self.max_generation_tokens.observe(longest)
            self.params_n.observe(len(clock.seq_tokens))
        if clock.max_tokens:
            self.params_max_tokens.observe(clock.max_tokens)
