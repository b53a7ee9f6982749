"""GET /metrics as its peers read it: prometheus_client's parser (vLLM production-stack's router
uses it), Prometheus (OpenMetrics when it asks, as it does by default), vLLM's Grafana dashboard
and the Gateway API Inference Extension endpoint picker (vllm:num_requests_waiting / _running,
vllm:kv_cache_usage_perc, vllm:lora_requests_info, vllm:cache_config_info labels). The scrapes
are checked by a strict parser of the exposition formats below, not by prometheus_client."""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

from fake_engine import FakeEngine
from server_proc import HEADERS, serve_in_process

from paged_engine.engine.request_latency import RequestClock, RequestLatency
from paged_server.exposition import to_openmetrics
from paged_server.metrics import Metrics

PROMETHEUS_ACCEPT = (  # what Prometheus sends by default
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
    "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)
ODD = 'q"u\\o\nte d}'  # a name with every character a label value must escape, a space, a `}`

# vLLM's buckets (vllm/v1/metrics/loggers.py, PrometheusStatLogger)
VLLM_TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0]
VLLM_TTFT += [7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
VLLM_ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5]
VLLM_ITL += [10.0, 20.0, 40.0, 80.0]
VLLM_LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0]
VLLM_LATENCY += [60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
VLLM_ITERATION = [1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0]
VLLM_ITERATION += [8192.0, 16384.0]

# Every name vLLM's Grafana dashboard (examples/online_serving/prometheus_grafana/grafana.json)
# and the routers query that paged can measure, with vLLM's type and buckets (None: 1-2-5 up to
# max_model_len; "": not a histogram).
PEER_NAMES: dict[str, tuple[str, list[float] | str | None]] = {
    "vllm:num_requests_running": ("gauge", ""),
    "vllm:num_requests_waiting": ("gauge", ""),
    "vllm:num_requests_waiting_by_reason": ("gauge", ""),  # autoscalers, endpoint pickers
    "vllm:kv_cache_usage_perc": ("gauge", ""),
    "vllm:gpu_cache_usage_perc": ("gauge", ""),  # dashboard; production-stack router
    "vllm:gpu_prefix_cache_hits_total": ("counter", ""),  # production-stack router
    "vllm:gpu_prefix_cache_queries_total": ("counter", ""),
    "vllm:prefix_cache_hits_total": ("counter", ""),
    "vllm:prefix_cache_queries_total": ("counter", ""),
    "vllm:num_preemptions_total": ("counter", ""),
    "vllm:prompt_tokens_total": ("counter", ""),
    "vllm:generation_tokens_total": ("counter", ""),
    "vllm:request_success_total": ("counter", ""),
    "vllm:time_to_first_token_seconds": ("histogram", VLLM_TTFT),
    "vllm:inter_token_latency_seconds": ("histogram", VLLM_ITL),
    "vllm:time_per_output_token_seconds": ("histogram", VLLM_ITL),  # dashboard
    "vllm:request_time_per_output_token_seconds": ("histogram", VLLM_ITL),
    "vllm:e2e_request_latency_seconds": ("histogram", VLLM_LATENCY),
    "vllm:request_queue_time_seconds": ("histogram", VLLM_LATENCY),
    "vllm:request_prefill_time_seconds": ("histogram", VLLM_LATENCY),
    "vllm:request_decode_time_seconds": ("histogram", VLLM_LATENCY),
    "vllm:request_inference_time_seconds": ("histogram", VLLM_LATENCY),
    "vllm:request_prompt_tokens": ("histogram", None),
    "vllm:request_generation_tokens": ("histogram", None),
    "vllm:request_max_num_generation_tokens": ("histogram", None),
    "vllm:request_prefill_kv_computed_tokens": ("histogram", None),
    "vllm:request_params_max_tokens": ("histogram", None),
    "vllm:request_params_n": ("histogram", [1.0, 2.0, 5.0, 10.0, 20.0]),
}


# ---- a strict reader of the two exposition formats ------------------------------------------
@dataclass
class Family:
    name: str
    type: str = "untyped"
    help: str | None = None
    samples: list[tuple[str, dict[str, str], float]] = field(default_factory=list)


_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "untyped": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
}
_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}


def _value(text: str) -> float:
    number = r"[+-]?(Inf|NaN|\d+(\.\d*)?([eE][+-]?\d+)?|\.\d+([eE][+-]?\d+)?)"
    assert re.fullmatch(number, text), text
    return float(text)


def _labels(line: str, i: int) -> tuple[dict[str, str], int]:
    """The label set starting at line[i] == '{'; (labels, index after the '}')."""
    labels: dict[str, str] = {}
    i += 1
    while line[i] != "}":
        m = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)=\"").match(line, i)
        assert m, f"bad label at {i}: {line!r}"
        name, i, value = m.group(1), m.end(), []
        while line[i] != '"':
            assert line[i] != "\n"
            if line[i] == "\\":
                assert line[i + 1] in _ESCAPES, f"bad escape in {line!r}"
                value.append(_ESCAPES[line[i + 1]])
                i += 2
            else:
                value.append(line[i])
                i += 1
        assert name not in labels, f"label {name} twice: {line!r}"
        labels[name] = "".join(value)
        i += 1
        if line[i] == ",":
            i += 1
    return labels, i + 1


def parse(text: str, openmetrics: bool = False) -> dict[str, Family]:
    """Families by name; asserts what Prometheus text 0.0.4 (or OpenMetrics 1.0) requires."""
    assert text.endswith("\n")
    lines = text[:-1].split("\n")
    if openmetrics:
        assert lines[-1] == "# EOF" and "# EOF" not in lines[:-1]
        lines = lines[:-1]
    families: dict[str, Family] = {}
    current: Family | None = None
    seen: set[tuple[str, frozenset]] = set()
    for line in lines:
        if m := re.fullmatch(rf"# (HELP|TYPE) ({_NAME}) (.*)", line):
            kind, name, rest = m.groups()
            if current is None or current.name != name:
                assert name not in families, f"family {name} declared again or split"
                current = families[name] = Family(name)
            assert not current.samples, f"{kind} after samples of {name}"
            if kind == "HELP":
                assert current.help is None, f"second HELP for {name}"
                assert not re.search(r"\\[^\\n\"]", rest), f"bad escape in HELP {rest!r}"
                current.help = rest
            else:
                assert current.type == "untyped" and rest in _SUFFIXES, (name, rest)
                current.type = rest
                if rest == "counter":  # 0.0.4: named as its samples; OpenMetrics: without
                    assert name.endswith("_total") != openmetrics, name
            continue
        assert not line.startswith("#") or not openmetrics, line
        if line.startswith("#"):
            continue
        m = re.compile(_NAME).match(line)
        assert m, line
        name = m.group(0)
        labels, i = _labels(line, m.end()) if line[m.end()] == "{" else ({}, m.end())
        assert line[i] == " ", line
        value, *stamp = line[i + 1 :].split(" ")
        assert len(stamp) <= 1, line
        base = current.name if current else None
        if current and current.type == "counter" and not openmetrics:
            base = current.name[: -len("_total")]
        ok = base is not None and any(name == base + s for s in _SUFFIXES[current.type])
        assert ok, f"sample {name} outside its family (after {current and current.name})"
        key = (name, frozenset(labels.items()))
        assert key not in seen, f"duplicate sample {line!r}"
        seen.add(key)
        current.samples.append((name, labels, _value(value)))
    for f in families.values():
        if f.type == "histogram":
            _check_histogram(f)
    return families


def _check_histogram(f: Family) -> None:
    series: dict[frozenset, dict] = {}
    for name, labels, value in f.samples:
        rest = frozenset((k, v) for k, v in labels.items() if k != "le")
        s = series.setdefault(rest, {"buckets": []})
        if name.endswith("_bucket"):
            s["buckets"].append((_value(labels["le"]), value))
        else:
            s[name[len(f.name) :]] = value
    for s in series.values():
        bounds = [b for b, _ in s["buckets"]]
        counts = [c for _, c in s["buckets"]]
        assert bounds == sorted(set(bounds)) and bounds[-1] == math.inf, f.name
        assert counts == sorted(counts), f"{f.name}: buckets not cumulative"
        assert counts[-1] == s["_count"] and "_sum" in s, f.name


def buckets(f: Family) -> list[float]:
    return [_value(labels["le"]) for n, labels, _ in f.samples if n.endswith("_bucket")][:-1]


def one(f: Family, suffix: str = "") -> float:
    (value,) = [v for n, _, v in f.samples if n == f.name + suffix]
    return value


# ---- helpers ---------------------------------------------------------------------------------
def _scrape(server, accept: str | None = None) -> tuple[str, str]:
    status, headers, text = server.request(
        "GET", "/metrics", headers={"Accept": accept} if accept else None
    )
    assert status == 200
    return headers["Content-Type"], text


def _stats(**over: object) -> SimpleNamespace:
    """EngineStats' fields as the engine fills them with spec decode, LoRA and sleep mode on."""
    stats = FakeEngine().get_stats()
    vars(stats).update(
        block_size=16,
        num_cpu_blocks=8,
        spec_decode_num_drafts=3,
        spec_decode_num_draft_tokens=9,
        spec_decode_num_accepted_tokens=5,
        spec_decode_num_accepted_tokens_per_pos=[3, 2, 0],
        spec_decode_acceptance_rate=5 / 9,
        spec_decode_mean_acceptance_length=1 + 5 / 3,
        max_loras=4,
        running_lora_adapters=[ODD, "b"],
        waiting_lora_adapters=["c"],
        sleep_state="weights_offloaded",
        prompt_tokens_local_compute=70,
        prompt_tokens_local_cache_hit=33,
        prompt_tokens_external_kv_transfer=16,
        prompt_tokens_cached=48,
        prompt_tokens_recomputed=1,
        iteration_tokens=([0, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3, 3], 140.0, 3),
        mm_cache_queries=5,
        mm_cache_hits=2,
        **over,
    )
    return stats


# ---- tests -----------------------------------------------------------------------------------
def test_every_state_parses_strictly() -> None:
    """Idle, a request running, after requests (n > 1), in both formats: one HELP / TYPE per
    family, its samples together, no duplicates, cumulative buckets ending in +Inf == _count, a
    served name that needs escaping read back as it is."""
    args = ["--model", "m", "--served-model-name", ODD, "--metrics-prefix", "vllm"]
    with serve_in_process(args, FakeEngine(step_time=0.01)) as (server, _):
        states = [_scrape(server)[1]]
        conn = server.conn()
        body = {"model": ODD, "prompt": "hi", "max_tokens": 40, "stream": True}
        conn.request("POST", "/v1/completions", json.dumps(body), HEADERS)
        stream = conn.getresponse()
        assert stream.status == 200 and stream.readline().startswith(b"data: ")
        states.append(_scrape(server)[1])  # while the request runs
        running = parse(states[-1])["vllm:num_requests_running"]
        assert one(running) == 1 and running.samples[0][1] == {"engine": "0", "model_name": ODD}
        stream.read()
        conn.close()
        for n in (1, 3):
            body = {"model": ODD, "prompt": "a b c", "max_tokens": 4, "n": n, "ignore_eos": True}
            assert server.request("POST", "/v1/completions", body)[0] == 200
        states.append(_scrape(server)[1])
        ctype, om = _scrape(server, PROMETHEUS_ACCEPT)
    # each request's max_tokens, from the server's engine client (40 + 4 + 4)
    max_tokens = parse(states[-1])["vllm:request_params_max_tokens"]
    assert (one(max_tokens, "_count"), one(max_tokens, "_sum")) == (3, 48)
    for text in states:
        families = parse(text)
        assert all(f.type != "untyped" and f.help for f in families.values())
    assert ctype.startswith("application/openmetrics-text; version=1.0.0")
    assert set(parse(om, openmetrics=True)) == {
        n[: -len("_total")] if f.type == "counter" else n for n, f in parse(states[-1]).items()
    }


def test_spec_decode_lora_sleep_and_cache_info_parse_as_routers_read_them() -> None:
    """The labelled families (spec decode positions, LoRA info, sleep state, cache config,
    waiting requests by reason) with adapter names that need escaping; what the endpoint
    picker takes from their labels."""
    before = time.time()
    text = Metrics(ODD, "vllm").render(_stats(num_waiting=3, num_waiting_deferred=1))

    def check(families: dict[str, Family]) -> None:
        lora = families["vllm:lora_requests_info"]
        ((_, labels, value),) = lora.samples
        assert lora.type == "gauge" and before <= value <= time.time()  # the newest wins
        assert labels["running_lora_adapters"].split(",") == [ODD, "b"]
        assert labels["waiting_lora_adapters"] == "c" and int(labels["max_lora"]) == 4
        ((_, info, value),) = families["vllm:cache_config_info"].samples
        assert value == 1 and int(info["block_size"]) == 16 and int(info["num_gpu_blocks"]) > 0
        sleep = {lab["sleep_state"]: v for _, lab, v in families["vllm:engine_sleep_state"].samples}
        assert sleep == {"awake": 0, "weights_offloaded": 1, "discard_all": 0}
        by_reason = families["vllm:num_requests_waiting_by_reason"]
        assert by_reason.type == "gauge"
        assert {lab["reason"]: v for _, lab, v in by_reason.samples} == {
            "capacity": 2,
            "deferred": 1,
        }

    check(parse(text))
    per_pos = parse(text)["vllm:spec_decode_num_accepted_tokens_per_pos_total"].samples
    assert [(lab["position"], v) for _, lab, v in per_pos] == [("0", 3), ("1", 2), ("2", 0)]
    check(parse(to_openmetrics(text), openmetrics=True))


def test_engine_label_and_vllm_v1_counters() -> None:
    """vLLM V1's labels on every engine sample (engine="0" beside model_name, written in
    prometheus_client's sorted order), prompt tokens by source, cached and recomputed prompt
    tokens, multimodal cache counters and tokens per engine step (vLLM's buckets)."""
    text = Metrics(ODD, "vllm", max_model_len=100).render(_stats())
    families = parse(text)
    for name, f in families.items():
        for _, labels, _ in f.samples:
            assert list(labels) == sorted(labels), name  # as prometheus_client writes them
            if name != "vllm:http_requests_total":
                assert labels["engine"] == "0" and labels["model_name"] == ODD, name
    assert 'vllm:request_success_total{engine="0",finished_reason="stop",model_name=' in text
    by_source = families["vllm:prompt_tokens_by_source_total"]
    assert by_source.type == "counter"
    assert [(lab["source"], v) for _, lab, v in by_source.samples] == [
        ("local_compute", 70),
        ("local_cache_hit", 33),
        ("external_kv_transfer", 16),
    ]
    for name, value in [
        ("prompt_tokens_cached_total", 48),
        ("prompt_tokens_recomputed_total", 1),
        ("mm_cache_queries_total", 5),
        ("mm_cache_hits_total", 2),
    ]:
        assert families["vllm:" + name].type == "counter" and one(families["vllm:" + name]) == value
    steps = families["vllm:iteration_tokens_total"]
    assert steps.type == "histogram" and buckets(steps) == VLLM_ITERATION
    assert (one(steps, "_count"), one(steps, "_sum")) == (3, 140)
    om = parse(to_openmetrics(text), openmetrics=True)  # a histogram keeps its _total name
    assert om["vllm:iteration_tokens_total"].type == "histogram"
    assert om["vllm:prompt_tokens_by_source"].type == "counter"


def test_get_metrics_reads_the_new_counters_as_vllms_reader() -> None:
    """LLM.get_metrics() (vllm.v1.metrics.reader's records) carries them too, named as vLLM's
    reader names them (counters without `_total`), labelled engine "0"."""
    import dataclasses

    from paged_engine.engine.stats import EngineStats
    from paged_engine.metrics_reader import Counter, Histogram, snapshot

    required = [  # the fields without a default: counts and gauges at 0
        f.name
        for f in dataclasses.fields(EngineStats)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    stats = EngineStats(**dict.fromkeys(required, 0))
    stats.prompt_tokens_local_compute, stats.prompt_tokens_local_cache_hit = 7, 5
    stats.prompt_tokens_cached, stats.prompt_tokens_recomputed = 4, 1
    stats.iteration_tokens = ([0, 1] + [2] * 12, 9.0, 2)
    stats.mm_cache_queries, stats.mm_cache_hits = 3, 1
    records = snapshot(stats, RequestLatency(), "m")
    by_source = {
        r.labels["source"]: r.value for r in records if r.name == "vllm:prompt_tokens_by_source"
    }
    assert by_source == {"local_compute": 7, "local_cache_hit": 5, "external_kv_transfer": 0}
    named = {r.name: r for r in records if "source" not in r.labels}
    for name, value in [
        ("prompt_tokens_cached", 4),
        ("prompt_tokens_recomputed", 1),
        ("mm_cache_queries", 3),
        ("mm_cache_hits", 1),
    ]:
        record = named["vllm:" + name]
        assert isinstance(record, Counter) and record.value == value, name
        assert record.labels == {"model_name": "m", "engine": "0"}
    steps = named["vllm:iteration_tokens_total"]
    assert isinstance(steps, Histogram) and (steps.count, steps.sum) == (2, 9.0)
    assert list(steps.buckets)[:3] == ["1.0", "8.0", "16.0"] and steps.buckets["8.0"] == 1


def test_prompt_sources_and_step_tokens_measure_the_engine(real_server) -> None:
    """The real engine's counts over two requests of a prompt and of one a block longer than a
    block multiple: the first runs whole, the second finds its full blocks in the prefix cache
    (a hit stops before the last token, which runs: vLLM counts a hit of all but it as one
    recomputed token). Every step's tokens (prompt chunks and decode tokens) add up."""

    def counts() -> dict[str, float]:
        families = parse(_scrape(real_server)[1])
        out = {
            lab["source"]: v
            for _, lab, v in families["paged:prompt_tokens_by_source_total"].samples
        }
        for name in ("prompt_tokens", "prompt_tokens_cached", "prompt_tokens_recomputed"):
            out[name] = one(families[f"paged:{name}_total"])
        out["hits"] = one(families["paged:prefix_cache_hits_total"])
        steps = families["paged:iteration_tokens_total"]
        assert buckets(steps) == VLLM_ITERATION
        out["steps"], out["step_tokens"] = one(steps, "_count"), one(steps, "_sum")
        return out

    ((_, info, _),) = parse(_scrape(real_server)[1])["paged:cache_config_info"].samples
    block = int(info["block_size"])
    before = counts()
    for length, start in ((2 * block + 8, 7), (2 * block + 1, 300)):  # fresh tokens each
        body = {"prompt": list(range(start, start + length)), "max_tokens": 2, "ignore_eos": True}
        for _ in range(2):
            assert real_server.request("POST", "/v1/completions", body)[0] == 200
    after = counts()
    d = {k: after[k] - before[k] for k in after}
    computed = (2 * block + 8) + 8 + (2 * block + 1) + 1  # cold, warm (full blocks cached)
    assert d["local_compute"] == computed and d["external_kv_transfer"] == 0
    assert d["prompt_tokens_cached"] == d["hits"] == 4 * block
    assert d["prompt_tokens_recomputed"] == 1  # the warm 2 * block + 1 prompt's last token
    assert d["local_cache_hit"] == 4 * block + 1
    total = d["local_compute"] + d["local_cache_hit"] + d["external_kv_transfer"]
    assert total - d["prompt_tokens_recomputed"] == d["prompt_tokens"]
    assert d["step_tokens"] == computed + 4  # each request: its prompt chunk, one decode token
    assert d["steps"] == 8


def test_vllm_names_types_and_buckets() -> None:
    """Under --metrics-prefix vllm every name the dashboard and routers query is there, typed
    and bucketed as vLLM's (token counts: 1-2-5 up to max_model_len)."""
    with serve_in_process(["--model", "m", "--metrics-prefix", "vllm"], FakeEngine()) as (s, _):
        families = parse(_scrape(s)[1])
    tokens = [1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0]  # FakeEngine: max_model_len 256
    for name, (kind, bounds) in PEER_NAMES.items():
        assert families[name].type == kind, name
        if kind == "histogram":
            assert buckets(families[name]) == (tokens if bounds is None else bounds), name
    success = families["vllm:request_success_total"].samples
    reasons = {lab["finished_reason"] for _, lab, _ in success}
    assert reasons >= {"stop", "length", "abort"}  # each series there before its first increase


def test_request_histograms_measure_each_request() -> None:
    """One request (n=2, 5 tokens each): its prompt and generated tokens, n, the longest
    sequence, and its phases (prefill + decode == inference, measured from the engine's times)."""
    with serve_in_process(["--model", "m"], FakeEngine(step_time=0.005)) as (server, _):
        body = {"model": "m", "prompt": "a b c", "max_tokens": 5, "n": 2, "ignore_eos": True}
        status, _, out = server.request("POST", "/v1/completions", body)
        assert status == 200
        families = parse(_scrape(server)[1])
    prompt = out["usage"]["prompt_tokens"]
    expect = {
        "request_prompt_tokens": prompt,
        "request_prefill_kv_computed_tokens": prompt,  # no prefix-cache hit
        "request_generation_tokens": 10,
        "request_max_num_generation_tokens": 5,
        "request_params_n": 2,
    }
    for name, total in expect.items():
        f = families["paged:" + name]
        assert (one(f, "_count"), one(f, "_sum")) == (1, total), name

    def total(name: str) -> float:
        f = families[f"paged:request_{name}_seconds"]
        assert one(f, "_count") == 1
        return one(f, "_sum")

    assert total("decode_time") > 0 and total("prefill_time") >= 0
    assert math.isclose(total("prefill_time") + total("decode_time"), total("inference_time"))
    assert math.isclose(total("time_per_output_token"), total("decode_time") / 4)


def test_max_tokens_histogram_takes_the_request_parameter() -> None:
    """request_params_max_tokens observes a request's max_tokens when its clock carries it."""
    from paged_engine.outputs import CompletionOutput, RequestMetrics, RequestOutput

    lat = RequestLatency(max_model_len=1000)
    seq = CompletionOutput(0, "x", [7, 8], None, None, finish_reason="length")
    out = RequestOutput("r", "p", [1, 2, 3], None, [seq], True)
    out.metrics = RequestMetrics(0.0, 0.5, 1.0, 2.0, 2.0)
    lat.observe(RequestClock(0.0, max_tokens=2), out, 2.0)
    assert lat.params_max_tokens.snapshot()[1:] == (2.0, 1)
    assert lat.tpot.snapshot()[1:] == (1.0, 1)  # (2.0 - 1.0) / (2 - 1)


def test_openmetrics_only_when_asked() -> None:
    """prometheus_client's negotiation (so vLLM's): any application/openmetrics-text in Accept
    gets OpenMetrics 1.0 (counter families without `_total`, `# EOF`); anything else gets text
    0.0.4, whose Content-Type says so."""
    with serve_in_process(["--model", "m"], FakeEngine()) as (server, _):
        for accept in (None, "text/plain", "*/*"):
            ctype, text = _scrape(server, accept)
            assert ctype == "text/plain; version=0.0.4; charset=utf-8"
            assert parse(text)["paged:prompt_tokens_total"].type == "counter"
            assert "# TYPE paged:prompt_tokens_total counter" in text and "# EOF" not in text
        for accept in (PROMETHEUS_ACCEPT, "application/openmetrics-text"):
            ctype, text = _scrape(server, accept)
            assert ctype == "application/openmetrics-text; version=1.0.0; charset=utf-8"
            families = parse(text, openmetrics=True)
            assert families["paged:prompt_tokens"].type == "counter"
            assert "# TYPE paged:prompt_tokens counter" in text


def test_merged_replicas_keep_each_family_whole() -> None:
    """The data-parallel front's merge: each family once, every replica's samples under it with
    a replica label, label values with spaces, braces and escapes intact."""
    from paged_server.exposition import merge_expositions, set_label, with_label

    texts = []
    for i in range(2):
        m = Metrics(ODD, "vllm", max_model_len=100)
        m.ttft.observe(0.03 * (i + 1))
        m.count_http("/v1/completions", 200)
        texts.append((str(i), m.render(_stats(num_running=i))))
    merged = parse(merge_expositions(texts))
    assert set(merged) == set(parse(texts[0][1]))
    running = merged["vllm:num_requests_running"].samples
    assert [(lab["replica"], lab["engine"], lab["model_name"], v) for _, lab, v in running] == [
        ("0", "0", ODD, 0),
        ("1", "1", ODD, 1),
    ]
    ttft = merged["vllm:time_to_first_token_seconds"]
    assert {(lab["replica"], lab["engine"]) for _, lab, _ in ttft.samples} == {
        ("0", "0"),
        ("1", "1"),
    }
    # vLLM's data-parallel engine index: every sample with an engine label has the replica's
    for family in merged.values():
        for _, lab, _ in family.samples:
            assert lab.get("engine", lab["replica"]) == lab["replica"], family.name
    http = merged["vllm:http_requests_total"].samples  # the server's own: no engine label
    assert all("engine" not in lab for _, lab, _ in http)
    assert with_label("x 1", "replica", "0") == 'x{replica="0"} 1'
    assert with_label('x{a="}"} 2', "r", "1") == 'x{a="}",r="1"} 2'
    # only the label named engine changes, wherever it is, whatever the values before it hold
    odd = 'x{a="engine=\\"0\\",b",engine="0",z="}"} 3'
    assert set_label(odd, "engine", "2") == 'x{a="engine=\\"0\\",b",engine="2",z="}"} 3'
    assert set_label('x{engine="0"} 1', "engine", "1") == 'x{engine="1"} 1'
    assert set_label('x{a="b"} 1', "engine", "1") == 'x{a="b"} 1'
    assert set_label("x 1", "engine", "1") == "x 1"


def test_real_engine_scrape_parses(real_server) -> None:
    """The real engine's stats (sleep state, block layout, prefix cache) in both formats."""
    body = {"prompt": "Hello", "max_tokens": 3, "n": 2, "ignore_eos": True}
    assert real_server.request("POST", "/v1/completions", body)[0] == 200
    families = parse(_scrape(real_server)[1])
    ((_, info, _),) = families["paged:cache_config_info"].samples
    assert int(info["block_size"]) > 0 and int(info["num_gpu_blocks"]) > 0
    assert one(families["paged:request_params_n"], "_count") >= 1
    ctype, om = _scrape(real_server, PROMETHEUS_ACCEPT)
    assert ctype.startswith("application/openmetrics-text") and parse(om, openmetrics=True)
