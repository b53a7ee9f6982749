"""A soak: a few hundred mixed, partly hostile requests through paged-server over a real tiny
engine, twice; then an audit that the idle engine is back at its baseline state.

The traffic (eight clients at once, over HTTP): completions and chat, plain and streamed; n > 1,
best_of, beam search; logprobs and prompt logprobs; stop strings, min / max tokens, seeds,
penalties, token rules; structured outputs (regex, JSON schema, choice; llguidance); a LoRA
adapter; embeddings; shared prompt prefixes (prefix-cache hits) longer than the step's token
budget (chunked prefill) on a KV pool too small for everyone (preemption by swap and by
recompute) with async scheduling's two steps in flight; streams the client drops after two
events and JSON answers it leaves without reading; and requests the server must refuse with a
4xx (bad fields, prompts past max_model_len, malformed JSON, an unknown model, a bad grammar,
garbage bytes).

Once idle, `leftovers` lists every per-request structure of every layer that still holds
something (the server's streams, the output stage, the engine core, the scheduler, both block
pools, the worker's persistent batch, its row flags and LoRA slots) and `live_request_objects`
every request, sequence or output object still alive: both must be empty. Between the two
rounds, threads, file descriptors and live Python objects must not grow, and RSS only a little.
"""

from __future__ import annotations

import gc
import json
import os
import random
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from engine_state import leftovers as engine_leftovers
from server_proc import COMMON_ARGS, HEADERS, ServerProc, serve_in_process

pytest.importorskip("llguidance")

PREFIXES = [  # shared prompt heads: prefix-cache hits, longer than the step's token budget
    "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat. " * 2,
    "Once upon a time in a land far away there lived a king who had three sons. " * 2,
]
SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}},
    "required": ["a"],
    "additionalProperties": False,
}
CHAT = [{"role": "user", "content": "Say something."}]


# ---- the engine and its server ------------------------------------------------------------------
@pytest.fixture(scope="module")
def soak(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    from paged_engine import LLMEngine
    from paged_engine.testing import write_lora_adapter

    adapter = write_lora_adapter(tmp_path_factory.mktemp("soak-lora"), tiny_model, rank=8)
    engine = LLMEngine(
        model=tiny_model,
        dtype="float32",
        max_model_len=128,
        num_gpu_blocks_override=20,  # 304 token slots for 8 clients of ~80-110 tokens: preemption
        max_num_batched_tokens=40,  # a prefix alone is longer: chunked prefill
        max_num_seqs=16,
        async_scheduling=True,  # two steps in flight, as on a GPU
        swap_space=0.01,  # preemption by swap (forked requests, long ones) or recompute, by cost
        enable_lora=True,
        max_loras=1,
    )
    args = [*COMMON_ARGS, "--enable-lora", "--lora-modules", f"ad={adapter}"]
    try:
        with serve_in_process(args, engine) as (http_, app):
            app.poll_interval = 0.01  # a tiny model answers in less than the 0.25 s default:
            yield engine, app, http_  # the checks for a client gone mid-wait must come sooner
    finally:
        engine.shutdown()


# ---- the traffic --------------------------------------------------------------------------------
def _prompt(rng: random.Random) -> str:
    return rng.choice(PREFIXES) + rng.choice(["alpha", "beta gamma", "delta", "x y z"])


def _valid(rng: random.Random, i: int) -> tuple[str, dict[str, Any], str]:
    """(path, body, how to send it: "plain" | "stream" | "drop" | "gone") of a request that
    must be served."""
    body: dict[str, Any] = {"max_tokens": rng.randint(1, 6), "temperature": rng.choice([0, 1.0])}
    if rng.random() < 0.5:
        body["seed"] = i
    kind = i % 14
    if kind in (0, 1):
        body["prompt"] = _prompt(rng)
    elif kind == 2:
        body.update(prompt=_prompt(rng), n=rng.randint(2, 3), temperature=1.0)
    elif kind == 3:
        body.update(prompt=_prompt(rng), best_of=3, n=1, temperature=1.0)
    elif kind == 4:
        body.update(prompt=_prompt(rng), use_beam_search=True, best_of=2, temperature=0)
    elif kind == 5:
        body.update(prompt=_prompt(rng), logprobs=3, prompt_logprobs=2)
    elif kind == 6:
        body.update(prompt=_prompt(rng), stop=["e", "o "], include_stop_str_in_output=i % 2 == 0)
        body["max_tokens"] = 12
    elif kind == 7:
        body.update(prompt=_prompt(rng), min_tokens=4, max_tokens=6, ignore_eos=True)
        body.update(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2)
    elif kind == 8:
        body.update(prompt=_prompt(rng), logit_bias={"5": 5.0}, allowed_token_ids=[5, 6, 7, 8])
    elif kind == 9:
        guide = [
            {"guided_regex": "[a-c]{1,4}"},
            {"guided_choice": ["yes", "no"]},
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": SCHEMA},
                }
            },
        ][i % 3]
        body.update(messages=CHAT, max_tokens=8, **guide)
        return "/v1/chat/completions", body, "plain"
    elif kind == 10:
        body.update(prompt=_prompt(rng), model="ad")  # the LoRA adapter
    elif kind == 11:
        return "/v1/embeddings", {"input": _prompt(rng)}, "plain"
    elif kind == 12:  # a long stream the client drops after two events, or a JSON answer
        body.update(prompt=_prompt(rng), max_tokens=40, ignore_eos=True)  # it does not wait for
        return "/v1/completions", body, rng.choice(["drop", "gone"])
    else:
        body.update(messages=CHAT, logprobs=True, top_logprobs=2)
        return "/v1/chat/completions", body, rng.choice(["plain", "stream"])
    plain_only = kind in (3, 4, 5)  # best_of > n, beams, prompt logprobs: not streamed
    return "/v1/completions", body, "plain" if plain_only else rng.choice(["plain", "stream"])


_TOO_LONG = list(range(5, 205))  # 200 prompt tokens, max_model_len is 128
INVALID: list[tuple[str, dict[str, Any] | bytes]] = [
    ("/v1/completions", {"prompt": "hi", "temperature": -1}),
    ("/v1/completions", {"prompt": "hi", "n": 0}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -3}),
    ("/v1/completions", {"prompt": "hi", "top_p": 2.0}),
    ("/v1/completions", {"prompt": "hi", "logprobs": 1000}),
    ("/v1/completions", {"prompt": "hi", "n": 100}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}),
    ("/v1/completions", {"prompt": _TOO_LONG, "max_tokens": 4}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4000}),
    ("/v1/completions", {"prompt": "hi", "model": "no-such-model"}),
    ("/v1/completions", {"prompt": "hi", "guided_regex": "(unclosed"}),
    ("/v1/completions", {"prompt": "hi", "guided_json": {"type": 5}}),
    ("/v1/completions", {"prompt": "hi", "stream": True, "n": 0}),
    ("/v1/chat/completions", {"messages": "not a list"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 4'),  # malformed JSON
    ("/v1/completions", b"\xff\xfe not json at all"),
]


def _send(server: ServerProc, path: str, body: dict | bytes, how: str) -> tuple[int, object]:
    """Send one request: its HTTP status (a dropped stream: 200 once its headers came) and
    what an error said."""
    if how == "plain":
        status, _, payload = server.request("POST", path, body)
        return status, payload if status != 200 else None
    if how == "gone":  # the whole request, then the client closes without reading the answer
        data = json.dumps(body).encode()
        head = f"POST {path} HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
        with socket.create_connection((server.host, server.port), timeout=10) as s:
            s.sendall(f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data)
        return 200, None
    conn = server.conn(timeout=60)
    try:
        conn.request("POST", path, json.dumps({**body, "stream": True}), HEADERS)
        r = conn.getresponse()
        if r.status != 200:
            return r.status, r.read()
        events = 0
        for line in r:
            if line.startswith(b"data: "):
                events += 1
                if line.strip() == b"data: [DONE]" or (how == "drop" and events == 2):
                    break
        return r.status, None
    finally:
        conn.close()  # mid-stream for "drop": the server aborts the request


def _garbage(server: ServerProc) -> None:
    """Bytes that are not HTTP, then a request line whose body never comes."""
    for payload in (b"\x16\x03\x01 not http\r\n\r\n", b"POST /v1/completions HTTP/1.1\r\n"):
        with socket.create_connection((server.host, server.port), timeout=10) as s:
            s.sendall(payload)
            if payload.endswith(b"\r\n\r\n"):
                s.recv(4096)


def run_round(server: ServerProc, seed: int, num_valid: int = 140) -> list[str]:
    """One round of traffic from 8 clients; the unexpected answers (an empty list is good)."""
    rng = random.Random(seed)
    jobs: list[tuple[str, dict | bytes, str, bool]] = []
    for i in range(num_valid):
        path, body, how = _valid(rng, i)
        jobs.append((path, body, how, True))
    jobs += [(path, body, "plain", False) for path, body in INVALID * 2]
    rng.shuffle(jobs)
    problems: list[str] = []

    def one(job: tuple[str, dict | bytes, str, bool]) -> None:
        path, body, how, valid = job
        status, error = _send(server, path, body, how)
        if (status == 200) != valid or status >= 500:
            problems.append(f"{status} for {path} {body!r:.300}: {error!r:.300}")

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, jobs))
        pool.submit(_garbage, server).result()
    return problems


# ---- the audit ----------------------------------------------------------------------------------
def leftovers(engine: Any, app: Any) -> dict[str, object]:
    """Every per-request structure of the server and the engine not back at its idle state."""
    client = app.client
    sizes: dict[str, object] = {
        "client._streams": client._streams,
        "client._pending_adds": client._pending_adds,
        "client._idle_calls": client._idle_calls,
        "client._held_adds": client._held_adds,
        "client._lora_removals": client._lora_removals,
    }
    counts = {k: v if isinstance(v, int) else len(v) for k, v in sizes.items()}
    return {k: n for k, n in counts.items() if n} | engine_leftovers(engine)


def request_objects() -> list[Any]:
    """Request-level objects of any layer alive in this process (other tests run in it too)."""
    from paged_engine.core.core_output import EngineCoreOutput
    from paged_engine.core.request import Request, Sequence
    from paged_engine.outputs import RequestOutput

    kinds = {Request, Sequence, RequestOutput, EngineCoreOutput}
    gc.collect()  # (type(), not isinstance: that wakes deprecated proxies such as torch's)
    return [o for o in gc.get_objects() if type(o) in kinds]


def live_request_objects(before: list[Any]) -> dict[str, int]:
    """Request-level objects still alive that were not alive `before` the round (none once
    idle: whoever holds one holds a finished request's tokens, logprobs and text). `before`
    holds its objects, so no new object can take one of their ids."""
    old = {id(o) for o in before}
    return dict(Counter(type(o).__name__ for o in request_objects() if id(o) not in old))


def wait_idle(engine: Any, server: ServerProc, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = server.metrics()
        busy = m["paged:num_requests_running"] or m["paged:num_requests_waiting"]
        if not busy and not engine.has_unfinished_requests():
            break
        time.sleep(0.05)


def settled(find: Callable[[], dict], timeout: float = 5.0) -> dict:
    """find() once it finds nothing (the engine loop's last steps and the output thread
    settle), else what it last found."""
    deadline = time.monotonic() + timeout
    while (found := find()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


def _at_most(read: Callable[[], int], most: int, timeout: float = 10.0) -> int:
    """read() once it is at most `most` (handler threads and sockets closing), else its last
    value."""
    deadline = time.monotonic() + timeout
    while (value := read()) > most and time.monotonic() < deadline:
        time.sleep(0.1)
    return value


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _num_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_long_mixed_run_leaves_the_engine_as_it_found_it(soak: tuple) -> None:
    engine, app, server = soak
    before = request_objects()  # (an earlier test in this process may still hold some)
    problems = run_round(server, seed=1)
    assert not problems, "\n".join(problems)
    wait_idle(engine, server)
    assert settled(lambda: leftovers(engine, app)) == {}
    assert settled(lambda: live_request_objects(before)) == {}
    # the run went through what it means to: preemption, prefix hits, disconnects, grammars
    sched = engine.scheduler
    assert sched.num_preemptions > sched.num_swap_preemptions > 0, "pool too large"
    assert engine.block_manager.prefix_cache_hits > 0
    assert server.metrics()["paged:request_aborted_total"] > 0
    assert len(engine.engine_core.structured._cache) >= 3
    gc.collect()
    threads, fds, rss = threading.active_count(), _num_fds(), _rss()
    objects = len(gc.get_objects())

    problems = run_round(server, seed=1)  # the same traffic again
    assert not problems, "\n".join(problems)
    wait_idle(engine, server)
    assert settled(lambda: leftovers(engine, app)) == {}
    assert settled(lambda: live_request_objects(before)) == {}
    gc.collect()
    names = sorted(t.name for t in threading.enumerate())
    assert _at_most(threading.active_count, threads) <= threads, names
    assert _at_most(_num_fds, fds) <= fds, os.listdir("/proc/self/fd")
    grown = len(gc.get_objects()) - objects
    assert grown < 1000, f"{grown} more live objects after the second round"
    assert _rss() - rss < 32 << 20, f"RSS grew {(_rss() - rss) >> 20} MiB in the second round"
