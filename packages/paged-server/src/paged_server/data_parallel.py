"""`paged-server --data-parallel-size K`: K engine replicas behind one HTTP front.

Each replica is a complete `paged-server` child process (its own engine, its own tensor-/pipeline-
parallel group, its own devices) on a loopback port; this process only routes. A request goes to
the replica with the fewest tokens in flight (its prompt's estimate plus `max_tokens` times `n`,
counted from when it is sent until its response ends), so long requests do not pile up on one
replica. Responses pass through unchanged: an SSE stream byte for byte (`event:` lines, `data:
[DONE]` where the route sends one), ended when the replica's stream ends (a replica that breaks
off mid-stream: an in-band 502); a client that disconnects closes its replica connection, which
aborts the request there (asked every 0.25 s while the front waits on the replica, as a
single server asks while it waits on its engine: not only at the next write). A replica's whole
answer must arrive within the front's timeout, a stream's each event within it of the one
before (replica_connection.py: every receive counts, so a replica dribbling bytes is cut too):
else a 504. Connections to a replica are HTTP/1.1 keep-alive, pooled (`ReplicaPool`): one goes
back only once its answer was read to the end; an abandoned, failed or timed-out one is closed.
A pooled connection the replica closed while idle (nothing of the answer came) is retried once
on a new one.

Stored Responses API responses live in the replica that answered them, and the front keeps no
state of its own: `GET` / `DELETE /v1/responses/{id}` (and its `input_items` and `cancel`) ask
the replicas in turn until one holds it (a background response's events, `?stream=true`, are
relayed from it as they come), and a `POST /v1/responses` (or `/input_tokens`) with
`previous_response_id` first asks them (`GET`) which holds that response and runs there, load
or not (a conversation stays on its replica, with its prefix cache). A follow-up costs at most K
loopback requests; replicas are the one source of truth.

Why child servers and not K engines inside this process: each replica keeps its own GIL, its
own engine loop on its main thread and its own failure domain (a replica whose worker dies
fails alone: it exits, the front routes around it and `/health` reports it); the router adds
one loopback hop.

    /health   200 when every replica is healthy, else 503 naming the unhealthy ones
    /metrics  every replica's metrics, each sample labelled replica="i"
    /v1/load_lora_adapter, /v1/unload_lora_adapter   to every replica (they serve one set)
    /start_profile, /stop_profile   to every replica (each writes its own traces); the stop
                                    answers every replica's trace files
    /sleep, /wake_up, /pause, /resume, /reset_prefix_cache, /collective_rpc (dev mode)
                                    to every replica; /is_sleeping, /is_paused: any replica's
"""

from __future__ import annotations

import contextlib
import ctypes
import http.client
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple
from urllib.parse import parse_qs, urlsplit

from paged_server import profiling
from paged_server.anthropic_api import anthropic_errors, wants_anthropic_errors
from paged_server.dev_routes import ROUTES as DEV_ROUTES
from paged_server.errors import APIError
from paged_server.exposition import (
    CONTENT_TYPE,
    OPENMETRICS_CONTENT_TYPE,
    merge_expositions,
    to_openmetrics,
    wants_openmetrics,
)
from paged_server.http import Handler
from paged_server.replica_connection import POOL_SIZE, ClientGone, ReplicaConnection, ReplicaPool

log = logging.getLogger("paged_server")

# Hop-by-hop headers and those the router sets itself (the body goes on whole, with its length).
_SKIP_HEADERS = frozenset({"host", "content-length", "connection", "transfer-encoding", "expect"})
_PASS_RESPONSE_HEADERS = ("Retry-After", "WWW-Authenticate")
_LOAD_LORA, _UNLOAD_LORA = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
_RESPONSES, _RESPONSE_ROUTE = "/v1/responses", "/v1/responses/"
# Bodies that may continue a stored response (`previous_response_id`): sent to its holder.
_NEW_RESPONSE = (_RESPONSES, _RESPONSES + "/input_tokens")
_RESPONSE_ID = re.compile(r"[A-Za-z0-9_-]+")  # what a replica's response ids are made of


class _Unreached(Exception):
    """A replica's connection failed before any byte of the request was sent."""


class Answer(NamedTuple):
    """One replica's whole answer, as the front passes it on."""

    status: int
    content_type: str
    body: bytes
    headers: dict[str, str]  # the response headers the client gets too (_PASS_RESPONSE_HEADERS)


@dataclass
class Replica:
    index: int
    proc: subprocess.Popen
    host: str = ""
    port: int = 0
    tokens_in_flight: int = 0
    lines: list[str] = field(default_factory=list)

    def connect(self, timeout: float) -> ReplicaConnection:
        return ReplicaConnection(self.host, self.port, timeout=timeout)


class ReplicaRouter:
    """The front's `App`: routes each request to the least-loaded replica."""

    def __init__(
        self,
        replicas: list[Replica],
        *,
        timeout: float = 600.0,
        keep_alive: float = 5.0,
        pool_size: int = POOL_SIZE,
    ) -> None:
        """`keep_alive`: the replicas' --timeout-keep-alive (an idle pooled connection is
        dropped before the replica would close it); `pool_size`: idle connections kept per
        replica."""
        self.replicas = replicas
        self.timeout = timeout
        self.pools = {
            r.index: ReplicaPool(r.connect, size=pool_size, idle_timeout=0.8 * keep_alive)
            for r in replicas
        }
        self._lock = threading.Lock()
        self._lora_lock = threading.Lock()  # one runtime LoRA update at a time, on all replicas

    # ---- App protocol ----------------------------------------------------------------------
    def record(self, path: str, status: int) -> None:
        pass  # each replica counts its own requests

    def dispatch(self, handler: Handler, method: str, path: str) -> None:
        if wants_anthropic_errors(path, handler.headers):
            with anthropic_errors():  # the front's own errors in the replicas' shape there
                return self._dispatch(handler, method, path)
        return self._dispatch(handler, method, path)

    def _dispatch(self, handler: Handler, method: str, path: str) -> None:
        route = path.rstrip("/")
        if route and route != path:  # a replica would redirect (app.py), its Location unrelayed
            return handler.redirect(route)
        if path == "/health":
            return self._health(handler)
        if path == "/metrics":
            return self._metrics(handler)
        if route.startswith(_RESPONSE_ROUTE) and method == "GET" and _streamed(handler.path):
            holder = self._holder(handler, route[len(_RESPONSE_ROUTE) :])
            if holder is not None:  # a background response's events, relayed as they come
                return self._forward(handler, holder, method, None)
        if route.startswith(_RESPONSE_ROUTE) and (
            method in ("GET", "HEAD", "DELETE") or route.endswith("/cancel")
        ):
            return self._stored_response(handler, method)
        if method == "POST" and route in (profiling.START, profiling.STOP):  # no body, as vLLM's
            return self._profile(handler, route)
        if route in DEV_ROUTES:
            return self._dev(handler, method, route)
        body, cost, holder = None, 1, None
        if method == "POST" and route in _UPLOAD_ROUTES:  # multipart: forwarded as it came
            body, cost = handler.read_body(), _AUDIO_TOKENS
        elif method in ("POST", "PUT", "PATCH"):
            parsed = handler.read_json()  # size limit, JSON and Unicode checks, as a replica
            body = json.dumps(parsed).encode()
            cost = _estimate_tokens(parsed, len(body))
            if method == "POST" and route in (_LOAD_LORA, _UNLOAD_LORA):
                return self._update_loras(handler, route, body, parsed)
            if method == "POST" and route in _NEW_RESPONSE and isinstance(parsed, dict):
                holder = self._holder(handler, parsed.get("previous_response_id"))
        tried: set[int] = set()
        while True:
            replica = self._pick(cost, holder, tried)
            try:
                return self._forward(handler, replica, method, body)
            except _Unreached as e:  # nothing sent: another replica may take it
                tried.add(replica.index)
                if holder is not None or len(tried) == len(self.replicas):
                    raise APIError(502, str(e)) from e
                log.warning("%s; trying another replica", e)
            finally:
                with self._lock:
                    replica.tokens_in_flight -= cost

    # ---- routing ---------------------------------------------------------------------------
    def _live(self) -> list[Replica]:
        live = [r for r in self.replicas if r.proc.poll() is None]
        if not live:
            raise APIError(503, "no engine replica is running")
        return live

    def _pick(
        self, cost: int, holder: Replica | None = None, tried: set[int] | frozenset = frozenset()
    ) -> Replica:
        """`holder` when it is given and running, else the least-loaded replica not in
        `tried` (those that refused this request's connection)."""
        with self._lock:
            if holder is not None and holder.proc.poll() is None:
                best = holder
            else:
                live = [r for r in self._live() if r.index not in tried]
                if not live:
                    raise APIError(503, "no engine replica is running")
                best = min(live, key=lambda r: (r.tokens_in_flight, r.index))
            best.tokens_in_flight += cost
            return best

    def _forward(self, h: Handler, replica: Replica, method: str, body: bytes | None) -> None:
        """The request to `replica`, its answer to the client. A replica that cannot be
        reached raises `_Unreached` (nothing was sent); one that answers garbage or breaks off
        is a 502, one whose answer is not whole within `timeout` of the request (a stream: its
        headers, then each event within `timeout` of the one before) a 504, each logged as the
        replica's failure (the client's own socket errors pass through). A client gone closes
        the replica's connection, which aborts the request there."""
        try:
            conn, resp = self._send(
                replica, method, h.path, body, _headers(h), self.timeout, h.client_gone
            )
        except (ClientGone, _Unreached):
            raise
        except (OSError, http.client.HTTPException) as e:
            raise _failed(replica.index, "did not answer", e, self.timeout) from e
        pool, kept = self.pools[replica.index], False
        try:
            ctype = resp.getheader("Content-Type", "application/json")
            if resp.status == 200 and ctype.startswith("text/event-stream"):
                h.start_stream()
                tail = _relay(h, resp, conn, replica.index, self.timeout)
                kept = True  # read whole: the pool's before the client has the stream's end
                pool.release(conn, resp)
                if tail:  # a stream that ended mid-event ends so here too
                    h.send_chunk(tail)
                return h.end_stream(done=False)  # a [DONE] the replica sent went through
            extra = {k: v for k in _PASS_RESPONSE_HEADERS if (v := resp.getheader(k))}
            try:
                data = resp.read()
            except ClientGone:
                raise
            except (OSError, http.client.HTTPException) as e:
                raise _failed(replica.index, "broke off", e, self.timeout) from e
            kept = True  # read whole: the pool's before the client has it
            pool.release(conn, resp)
            h.send_bytes(resp.status, data, ctype, extra)
        finally:
            if not kept:  # abandoned, failed or timed out: never reused
                conn.done()

    def _send(
        self,
        replica: Replica,
        method: str,
        path: str,
        body: bytes | None,
        headers: dict[str, str],
        timeout: float,
        client_gone: Callable[[], bool] | None = None,
    ) -> tuple[ReplicaConnection, http.client.HTTPResponse]:
        """The request on a pooled connection to `replica` (else a new one), and its answer's
        head, every read of the answer due within `timeout` (and ended by `ClientGone` once
        `client_gone()`). A pooled connection that fails before any byte of the answer came (the
        replica closed it while idle: a broken pipe, a reset, an EOF) is retried once on a new
        connection. Raises `_Unreached` when no connection opens; on any error the connection
        is closed. The caller reads the answer, then `release`s the connection to its pool."""
        pool = self.pools[replica.index]
        conn = pool.get(timeout)
        while True:
            if conn.sock is None:
                try:
                    conn.connect()
                except OSError as e:
                    raise _Unreached(
                        f"engine replica {replica.index} refused the request: {e}"
                    ) from e
            conn.expect(timeout)
            if client_gone is not None:
                conn.watch(client_gone)  # a client gone: the caller's `done` aborts it there
            try:
                conn.request(method, path, body=body, headers=headers)
                return conn, conn.getresponse()
            except BaseException as e:
                conn.done()
                assert conn.reads is not None
                stale = conn.answers and not conn.reads.received and not isinstance(e, ClientGone)
                if not (stale and isinstance(e, ConnectionError)):
                    raise
                log.debug("engine replica %d closed an idle connection (%r)", replica.index, e)
            conn = pool.get(timeout, fresh=True)

    def close(self) -> None:
        """Close every idle pooled connection."""
        for pool in self.pools.values():
            pool.close()

    # ---- stored responses (the Responses API) ----------------------------------------------
    def _stored_response(self, h: Handler, method: str) -> None:
        """GET / DELETE /v1/responses/{id} (and its input_items, cancel): asked of each replica
        in turn. The holder's answer (2xx, or 400 to a cancel) or any answer every replica would
        give (401, 405, ...) ends the search; else a replica that did not answer (502: it may
        hold it) is reported before the 404."""
        answers = []
        for r in self._live():
            a = self._request(r, method, h.path, None, _headers(h))
            if a.status not in (404, 502):
                break
            answers.append(a)
        else:
            a = min(answers, key=lambda a: a.status != 502)
        h.send_bytes(a.status, a.body, a.content_type, a.headers)

    def _holder(self, h: Handler, rid: Any) -> Replica | None:
        """The replica that stores response `rid` (`previous_response_id`), or None (then any
        replica answers the 400 of an unknown id)."""
        if not isinstance(rid, str) or not _RESPONSE_ID.fullmatch(rid):
            return None  # no replica made this id
        for r in self._live():
            if self._request(r, "GET", _RESPONSE_ROUTE + rid, None, _headers(h)).status == 200:
                return r
        return None

    # ---- runtime LoRA updates --------------------------------------------------------------
    def _update_loras(self, h: Handler, route: str, body: bytes, parsed: Any) -> None:
        """Send the update to every live replica in turn and answer the first failure, else the
        first success. A load that some replicas took and another refused is undone on those
        that took it, so every replica keeps serving the same adapters. With the runtime-update
        variable unset each replica answers 404, and so does this."""
        headers = _headers(h)
        with self._lora_lock:
            live = self._live()
            answers = [(r, self._request(r, "POST", route, body, headers)) for r in live]
            failed = [a for _, a in answers if a.status != 200]
            if failed and route == _LOAD_LORA and isinstance(parsed, dict):
                undo = json.dumps({"lora_name": parsed.get("lora_name")}).encode()
                for r, a in answers:
                    if a.status == 200:
                        self._request(r, "POST", _UNLOAD_LORA, undo, headers)
        a = (failed or [a for _, a in answers])[0]
        h.send_bytes(a.status, a.body, a.content_type, a.headers)

    # ---- profiling ---------------------------------------------------------------------------
    def _profile(self, h: Handler, route: str) -> None:
        """Start or stop every live replica's profiler; the first failure, else the stop's
        trace files of all replicas (a start's first answer)."""
        headers = _headers(h)
        answers = [self._request(r, "POST", route, None, headers) for r in self._live()]
        failed = [a for a in answers if a.status != 200]
        if failed or route == profiling.START:
            a = (failed or answers)[0]
            return h.send_bytes(a.status, a.body, a.content_type, a.headers)
        traces = [path for a in answers for path in json.loads(a.body)["traces"]]
        h.send_json(200, {"traces": traces})

    # ---- sleep mode (dev_routes.py) ----------------------------------------------------------
    def _dev(self, h: Handler, method: str, route: str) -> None:
        """To every live replica in turn (they sleep, pause and wake together); the first
        failure answers, else: /is_sleeping and /is_paused true when any replica's is,
        /collective_rpc every replica's results in replica order, the rest the first answer."""
        body = json.dumps(h.read_json()).encode() if route == "/collective_rpc" else None
        headers = _headers(h)
        answers = [self._request(r, method, h.path, body, headers) for r in self._live()]
        failed = [a for a in answers if a.status != 200]
        if failed or route not in ("/is_sleeping", "/is_paused", "/collective_rpc"):
            a = (failed or answers)[0]
            return h.send_bytes(a.status, a.body, a.content_type, a.headers)
        bodies = [json.loads(a.body) for a in answers]
        if route == "/collective_rpc":
            return h.send_json(200, {"results": [x for b in bodies for x in b["results"]]})
        key = route[1:]
        h.send_json(200, {key: any(b[key] for b in bodies)})

    def _request(
        self,
        replica: Replica,
        method: str,
        path: str,
        body: bytes | None,
        headers: dict[str, str],
    ) -> Answer:
        """One whole request to a replica; a 502 when it does not answer."""
        try:
            return self._whole(replica, method, path, body, headers, self.timeout, "text/plain")
        except (_Unreached, OSError, http.client.HTTPException) as e:
            cause = e.__cause__ if isinstance(e, _Unreached) else e
            err = _failed(replica.index, "did not answer", cause or e, self.timeout)
            return Answer(err.status, "application/json", err.body(), {})

    def _whole(
        self,
        replica: Replica,
        method: str,
        path: str,
        body: bytes | None,
        headers: dict[str, str],
        timeout: float,
        default_type: str,
    ) -> Answer:
        """A replica's whole answer to a request the front makes itself; errors as `_send`'s,
        the connection pooled after."""
        conn, resp = self._send(replica, method, path, body, headers, timeout)
        try:
            extra = {k: v for k in _PASS_RESPONSE_HEADERS if (v := resp.getheader(k))}
            ctype = resp.getheader("Content-Type", default_type)
            data = resp.read()
        except BaseException:
            conn.done()
            raise
        self.pools[replica.index].release(conn, resp)
        return Answer(resp.status, ctype, data, extra)

    # ---- aggregated routes -----------------------------------------------------------------
    def _ask(self, replica: Replica, path: str) -> tuple[int, bytes]:
        """GET `path` of a replica (its /health, /metrics), whole within 10 s; (0, b"")
        when it does not answer so."""
        try:
            answer = self._whole(replica, "GET", path, None, {}, _ASK_TIMEOUT, "")
        except (_Unreached, OSError, http.client.HTTPException):
            return 0, b""
        return answer.status, answer.body

    def _ask_all(self, path: str) -> list[tuple[int, bytes]]:
        """GET `path` of every replica at once, (status, body) each in replica order: a
        stalled replica costs one `_ASK_TIMEOUT`, not one per replica."""
        if len(self.replicas) == 1:
            return [self._ask(self.replicas[0], path)]
        with ThreadPoolExecutor(len(self.replicas), thread_name_prefix="ask") as pool:
            return list(pool.map(lambda r: self._ask(r, path), self.replicas))

    def _health(self, h: Handler) -> None:
        answers = zip(self.replicas, self._ask_all("/health"))
        bad = [r.index for r, (status, _) in answers if status != 200]
        if bad:
            raise APIError(503, f"engine replica(s) {bad} unhealthy")
        h.send_json(200, {"status": "ok", "replicas": len(self.replicas)})

    def _metrics(self, h: Handler) -> None:
        """Every answering replica's metrics as one exposition, each sample labelled with its
        replica (families kept whole: a parser reads samples after another family's as a new
        untyped family), in the format the scraper asks for."""
        scrapes = [
            (str(r.index), text.decode(errors="replace"))
            for r, (status, text) in zip(self.replicas, self._ask_all("/metrics"))
            if status == 200
        ]
        body = merge_expositions(scrapes)
        if wants_openmetrics(h.headers.get("Accept", "")):
            h.send_bytes(200, to_openmetrics(body).encode(), OPENMETRICS_CONTENT_TYPE)
        else:
            h.send_bytes(200, body.encode(), CONTENT_TYPE)


def _streamed(path: str) -> bool:
    """A `GET /v1/responses/{id}` that asks for a background response's events."""
    return parse_qs(urlsplit(path).query).get("stream", [""])[-1].lower() == "true"


def _headers(h: Handler) -> dict[str, str]:
    """The client's request headers a replica gets (its API key among them)."""
    return {k: v for k, v in h.headers.items() if k.lower() not in _SKIP_HEADERS}


def _failed(index: int, what: str, e: Exception, timeout: float) -> APIError:
    """A replica's failure to answer as the client gets it: a 504 when it ran past the
    front's deadline, else a 502; logged, so the replica's trouble shows where it is served."""
    if isinstance(e, TimeoutError):
        err = APIError(504, f"engine replica {index} timed out: no whole answer within {timeout} s")
    else:
        err = APIError(502, f"engine replica {index} {what}: {e!r}")
    log.warning("%s", err.message)
    return err


def _relay(
    h: Handler, resp: http.client.HTTPResponse, conn: ReplicaConnection, index: int, gap: float
) -> bytes:
    """A replica's SSE stream to the client byte for byte, each event as soon as it is whole (a
    replica sends one event per chunk, and `read1` returns at most one chunk), until the
    replica's stream ends: the bytes after its last whole event are returned (the caller ends
    the client's stream, its replica connection free by then). Each event must be whole within
    `gap` seconds of the one before (no total bound: a long stream is fine, a replica dribbling
    bytes is not). A replica that breaks off (its last chunk missing: `read1` raises where line
    iteration would end quietly) is reported in-band, a 502; one past the gap a 504. The bytes
    of an event not yet whole are held back, so such an error event never runs into a cut
    one."""
    pending = b""
    while True:
        try:
            data = resp.read1(1 << 16)
        except ClientGone:
            raise
        except (OSError, http.client.HTTPException) as e:
            raise _failed(index, "broke off its stream", e, gap) from e
        if not data:
            break
        pending += data
        end = pending.rfind(b"\n\n") + 2
        if end >= 2:  # whole events: out, and the next one's gap starts
            h.send_chunk(pending[:end])  # OSError when the client left: closes the replica's
            pending = pending[end:]
            conn.expect(gap)
    return pending


def _estimate_tokens(body: Any, body_bytes: int) -> int:
    """What a request will cost its replica, in tokens: about 4 bytes of prompt per token, a
    nominal count per image, video or clip (whose URL's bytes are no prompt text), plus every token
    it may generate."""
    if not isinstance(body, dict):
        return 1
    max_tokens = next(
        (
            body[k]
            for k in ("max_completion_tokens", "max_tokens", "max_output_tokens")
            if k in body
        ),
        None,
    )
    n = body.get("n")
    gen = max_tokens if isinstance(max_tokens, int) and max_tokens > 0 else 256
    media, url_bytes = _media_parts(body)
    prompt = max(body_bytes - url_bytes, 0) // 4 + media
    return prompt + gen * (n if isinstance(n, int) and n > 0 else 1)


_ASK_TIMEOUT = 10.0  # seconds for a replica's whole /health or /metrics answer
_IMAGE_TOKENS = 576  # LLaVA-1.5's 24 x 24 patches: the front does not know the model's count
_VIDEO_TOKENS = 4096  # 32 frames in 16 temporal groups of 256 merged patches (Qwen2-VL)
_AUDIO_TOKENS = 750  # a 30-second window of Whisper's encoder, pooled (Qwen2-Audio)
# speech-to-text uploads (multipart/form-data): the body goes to a replica byte for byte
_UPLOAD_ROUTES = ("/v1/audio/transcriptions", "/v1/audio/translations")
# part type -> (the key holding its URL or data, nominal tokens)
_MEDIA = {
    "image_url": ("image_url", _IMAGE_TOKENS),
    "input_image": ("image_url", _IMAGE_TOKENS),
    "video_url": ("video_url", _VIDEO_TOKENS),
    "input_audio": ("input_audio", _AUDIO_TOKENS),
    "audio_url": ("audio_url", _AUDIO_TOKENS),
}


def _media_parts(body: dict[str, Any]) -> tuple[int, int]:
    """(nominal tokens of the image, video and audio parts, bytes of their URLs or base64
    data) of a chat or Responses body."""
    tokens = size = 0
    for key in ("messages", "input"):
        items = body.get(key)
        for item in items if isinstance(items, list) else ():
            content = item.get("content") if isinstance(item, dict) else None
            for part in content if isinstance(content, list) else ():
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "image_embeds":
                    data = part.get("image_embeds")
                    texts = list(data.values()) if isinstance(data, dict) else [data]
                    tokens += _IMAGE_TOKENS
                elif kind in _MEDIA:
                    key, nominal = _MEDIA[kind]
                    url = part.get(key)
                    field = "data" if kind == "input_audio" else "url"
                    texts = [url.get(field) if isinstance(url, dict) else url]
                    tokens += nominal
                else:
                    continue
                size += sum(len(t) for t in texts if isinstance(t, str))
    return tokens, size


# ---- replica processes ---------------------------------------------------------------------
# The router's own flags: replicas listen on loopback, in plain HTTP.
_ROUTER_FLAGS = {
    "--data-parallel-size",
    "-dp",
    "--host",
    "--port",
    "--uds",
    "--ssl-keyfile",
    "--ssl-certfile",
    "--ssl-ca-certs",
    "--ssl-cert-reqs",
    "--ssl-ciphers",
}
_ROUTER_SWITCHES = {"--enable-ssl-refresh"}  # flags without a value


def replica_argv(argv: list[str]) -> list[str]:
    """The command line without the router's flags (its address and HTTPS)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in _ROUTER_FLAGS:
            skip = "=" not in arg
            continue
        if name in _ROUTER_SWITCHES:
            continue
        out.append(arg)
    return out


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the router dies (Linux; elsewhere a no-op)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def start_replicas(
    argv: list[str], count: int, devices_per_replica: int, timeout: float = 600.0
) -> list[Replica]:
    """Start `count` replica servers on free loopback ports and wait until each serves. On a
    GPU machine replica i gets GPUs [i * devices_per_replica, (i + 1) * devices_per_replica)."""
    gpus = _visible_gpus()
    if gpus and len(gpus) < count * devices_per_replica:
        raise ValueError(
            f"--data-parallel-size {count} x {devices_per_replica} GPU(s) per replica needs "
            f"{count * devices_per_replica} GPUs, {len(gpus)} are visible"
        )
    replicas = []
    for i in range(count):
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if gpus:
            mine = gpus[i * devices_per_replica : (i + 1) * devices_per_replica]
            env["CUDA_VISIBLE_DEVICES"] = ",".join(mine)
        cmd = [sys.executable, "-m", "paged_server", *argv, "--host", "127.0.0.1", "--port", "0"]
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            # every replica starts before any thread of ours (preexec_fn and threads do not mix)
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
        replicas.append(Replica(i, proc))
    try:
        for r in replicas:
            _wait_serving(r, timeout)
    except BaseException:
        stop_replicas(replicas)
        raise
    return replicas


def _wait_serving(r: Replica, timeout: float) -> None:
    ready = threading.Event()

    def pump() -> None:  # forward the replica's output, tagged, and never let its pipe fill
        assert r.proc.stdout is not None
        for line in r.proc.stdout:
            if len(r.lines) < 200:
                r.lines.append(line)
            # "serving on" is the front's line alone: scripts wait for it to find the server.
            sys.stderr.write(f"[replica {r.index}] " + line.replace("serving on ", "listening on "))
            if not ready.is_set() and "serving on http://" in line:
                url = urlsplit(line.split("serving on ")[1].split()[0])
                r.host, r.port = url.hostname or "127.0.0.1", url.port or 0
                ready.set()
        ready.set()

    threading.Thread(target=pump, name=f"replica-{r.index}-log", daemon=True).start()
    if not ready.wait(timeout) or not r.port:
        raise RuntimeError(
            f"engine replica {r.index} did not start (exit code {r.proc.poll()}):\n"
            + "".join(r.lines[-30:])
        )


def stop_replicas(replicas: list[Replica], timeout: float = 30.0) -> None:
    for r in replicas:
        if r.proc.poll() is None:
            r.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for r in replicas:
        try:
            r.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            r.proc.kill()
            r.proc.wait()


def _visible_gpus() -> list[str]:
    """GPU ids this process may use, without importing torch: CUDA_VISIBLE_DEVICES, or the
    device nodes."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d for d in visible.split(",") if d.strip()]
    count = 0
    while os.path.exists(f"/dev/nvidia{count}"):
        count += 1
    return [str(i) for i in range(count)]
