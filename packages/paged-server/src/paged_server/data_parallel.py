"""`paged-server --data-parallel-size K`: K engine replicas behind one HTTP front.

Each replica is a complete `paged-server` child process (its own engine, its own tensor-/pipeline-
parallel group, its own devices) on a loopback port; this process only routes. A request goes to
the replica with the fewest tokens in flight (its prompt's estimate plus `max_tokens` times `n`,
counted from when it is sent until its response ends), so long requests do not pile up on one
replica. Responses, SSE streams included, pass through unchanged; a client that disconnects
closes its replica connection, which aborts the request there.

Why child servers and not K engines inside this process: each replica keeps its own GIL, its
own engine loop on its main thread and its own failure domain (a replica whose worker dies
fails alone, and `/health` reports it); the router adds one loopback hop.

    /health   200 when every replica is healthy, else 503 naming the unhealthy ones
    /metrics  every replica's metrics, each sample labelled replica="i"
    /v1/load_lora_adapter, /v1/unload_lora_adapter   to every replica (they serve one set)
"""

from __future__ import annotations

import contextlib
import ctypes
import http.client
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from paged_server.errors import APIError
from paged_server.http import Handler

log = logging.getLogger("paged_server")

# Hop-by-hop headers and those the router sets itself (the body goes on whole, with its length).
_SKIP_HEADERS = frozenset({"host", "content-length", "connection", "transfer-encoding", "expect"})
_PASS_RESPONSE_HEADERS = ("Retry-After", "WWW-Authenticate")
_LOAD_LORA, _UNLOAD_LORA = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


@dataclass
class Replica:
    index: int
    proc: subprocess.Popen
    host: str = ""
    port: int = 0
    tokens_in_flight: int = 0
    lines: list[str] = field(default_factory=list)

    def connect(self, timeout: float) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)


class ReplicaRouter:
    """The front's `App`: routes each request to the least-loaded replica."""

    def __init__(self, replicas: list[Replica], *, timeout: float = 600.0) -> None:
        self.replicas = replicas
        self.timeout = timeout
        self._lock = threading.Lock()
        self._lora_lock = threading.Lock()  # one runtime LoRA update at a time, on all replicas

    # ---- App protocol ----------------------------------------------------------------------
    def record(self, path: str, status: int) -> None:
        pass  # each replica counts its own requests

    def dispatch(self, handler: Handler, method: str, path: str) -> None:
        if path == "/health":
            return self._health(handler)
        if path == "/metrics":
            return self._metrics(handler)
        body, cost = None, 1
        if method in ("POST", "PUT", "PATCH"):
            parsed = handler.read_json()  # size limit, JSON and Unicode checks, as a replica
            body = json.dumps(parsed).encode()
            cost = _estimate_tokens(parsed, len(body))
            if method == "POST" and path.rstrip("/") in (_LOAD_LORA, _UNLOAD_LORA):
                return self._update_loras(handler, path.rstrip("/"), body, parsed)
        replica = self._pick(cost)
        try:
            self._forward(handler, replica, method, body)
        finally:
            with self._lock:
                replica.tokens_in_flight -= cost

    # ---- routing ---------------------------------------------------------------------------
    def _pick(self, cost: int) -> Replica:
        with self._lock:
            live = [r for r in self.replicas if r.proc.poll() is None]
            if not live:
                raise APIError(503, "no engine replica is running")
            best = min(live, key=lambda r: (r.tokens_in_flight, r.index))
            best.tokens_in_flight += cost
            return best

    def _forward(self, h: Handler, replica: Replica, method: str, body: bytes | None) -> None:
        headers = {k: v for k, v in h.headers.items() if k.lower() not in _SKIP_HEADERS}
        conn = replica.connect(self.timeout)
        try:
            try:
                conn.request(method, h.path, body=body, headers=headers)
                resp = conn.getresponse()
            except OSError as e:
                raise APIError(502, f"engine replica {replica.index} did not answer: {e}") from e
            ctype = resp.getheader("Content-Type", "application/json")
            if resp.status == 200 and ctype.startswith("text/event-stream"):
                h.start_stream()
                for line in resp:  # "data: ...\n" and blank separators
                    if not line.startswith(b"data: "):
                        continue
                    payload = line[6:].rstrip(b"\r\n")
                    if payload == b"[DONE]":
                        h.end_stream()
                        return
                    h.send_event(payload)  # OSError when the client left: closes conn below
                return
            extra = {k: v for k in _PASS_RESPONSE_HEADERS if (v := resp.getheader(k))}
            h.send_bytes(resp.status, resp.read(), ctype, extra)
        finally:
            conn.close()

    # ---- runtime LoRA updates --------------------------------------------------------------
    def _update_loras(self, h: Handler, route: str, body: bytes, parsed: Any) -> None:
        """Send the update to every live replica in turn and answer the first failure, else the
        first success. A load that some replicas took and another refused is undone on those
        that took it, so every replica keeps serving the same adapters. With the runtime-update
        variable unset each replica answers 404, and so does this."""
        headers = {k: v for k, v in h.headers.items() if k.lower() not in _SKIP_HEADERS}
        with self._lora_lock:
            live = [r for r in self.replicas if r.proc.poll() is None]
            if not live:
                raise APIError(503, "no engine replica is running")
            answers = [(r, *self._post(r, route, body, headers)) for r in live]
            failed = [a for a in answers if a[1] != 200]
            if failed and route == _LOAD_LORA and isinstance(parsed, dict):
                undo = json.dumps({"lora_name": parsed.get("lora_name")}).encode()
                for r, status, _, _ in answers:
                    if status == 200:
                        self._post(r, _UNLOAD_LORA, undo, headers)
        _, status, ctype, data = (failed or answers)[0]
        h.send_bytes(status, data, ctype)

    def _post(
        self, replica: Replica, path: str, body: bytes, headers: dict[str, str]
    ) -> tuple[int, str, bytes]:
        """(status, content type, body) of one POST to a replica; 502 when it does not answer."""
        conn = replica.connect(self.timeout)
        try:
            conn.request("POST", path, body=body, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.getheader("Content-Type", "text/plain"), resp.read()
        except OSError as e:
            err = APIError(502, f"engine replica {replica.index} did not answer: {e}")
            return err.status, "application/json", err.body()
        finally:
            conn.close()

    # ---- aggregated routes -----------------------------------------------------------------
    def _ask(self, replica: Replica, path: str) -> tuple[int, bytes]:
        conn = replica.connect(10.0)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            return resp.status, resp.read()
        except OSError:
            return 0, b""
        finally:
            conn.close()

    def _health(self, h: Handler) -> None:
        bad = [r.index for r in self.replicas if self._ask(r, "/health")[0] != 200]
        if bad:
            raise APIError(503, f"engine replica(s) {bad} unhealthy")
        h.send_json(200, {"status": "ok", "replicas": len(self.replicas)})

    def _metrics(self, h: Handler) -> None:
        seen: set[str] = set()
        out: list[str] = []
        for r in self.replicas:
            status, text = self._ask(r, "/metrics")
            if status != 200:
                continue
            for line in text.decode().splitlines():
                if line.startswith("#"):
                    if line not in seen:  # HELP / TYPE once per metric
                        seen.add(line)
                        out.append(line)
                elif line:
                    out.append(_label(line, f'replica="{r.index}"'))
        h.send_bytes(200, ("\n".join(out) + "\n").encode(), "text/plain; version=0.0.4")


def _label(sample: str, label: str) -> str:
    """Add `label` to one Prometheus sample line."""
    name, _, rest = sample.partition(" ")
    if name.endswith("}"):
        return f"{name[:-1]},{label}}} {rest}"
    return f"{name}{{{label}}} {rest}"


def _estimate_tokens(body: Any, body_bytes: int) -> int:
    """What a request will cost its replica, in tokens: about 4 bytes of prompt per token plus
    every token it may generate."""
    if not isinstance(body, dict):
        return 1
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    n = body.get("n")
    gen = max_tokens if isinstance(max_tokens, int) and max_tokens > 0 else 256
    return body_bytes // 4 + gen * (n if isinstance(n, int) and n > 0 else 1)


# ---- replica processes ---------------------------------------------------------------------
def replica_argv(argv: list[str]) -> list[str]:
    """The command line without --data-parallel-size, --host and --port (the router's)."""
    drop = {"--data-parallel-size", "-dp", "--host", "--port"}
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in drop:
            skip = "=" not in arg
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
