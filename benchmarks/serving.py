"""Online serving: `paged-server` in a subprocess, Poisson arrivals over HTTP (stdlib only).

Each request streams (`/v1/completions`, SSE, usage on the last chunk); per request we keep the
time to first token (TTFT), the end-to-end latency and the output length, and derive the time per
output token TPOT = (latency - TTFT) / (output tokens - 1). Per rate: p50 / p99 of both, the
paper's normalized latency (mean over requests of latency / output tokens, in s/token) and the
throughput over the whole rate run. Traffic goes to 127.0.0.1 only and every loop is bounded.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.workloads import Request


@dataclass(slots=True)
class Result:
    ok: bool
    ttft_s: float = 0.0
    latency_s: float = 0.0
    output_tokens: int = 0
    error: str = ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(model: str, port: int, args: list[str]) -> list[str]:
    # `python -m paged_server` is `paged-server`, and works without the console script installed
    return [
        sys.executable,
        "-m",
        "paged_server",
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *args,
    ]


class Server:
    """A paged-server subprocess, waited on until /health answers; killed on exit."""

    def __init__(self, model: str, args: list[str], log_path: Path, timeout_s: float = 600):
        self.port = free_port()
        self.cmd = server_command(model, self.port, args)
        self.log_path = log_path
        self.timeout_s = timeout_s
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Server:
        self.log = open(self.log_path, "w")
        # the server uses as many torch threads as this process
        env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"paged-server exited ({self.proc.returncode}): {self.tail()}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise RuntimeError(f"paged-server did not become healthy in {self.timeout_s}s")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def tail(self, n: int = 2000) -> str:
        self.log.flush()
        return self.log_path.read_text()[-n:]


def send(port: int, body: dict, timeout_s: float) -> Result:
    """One streamed completion; times measured on this side of the socket."""
    t0 = time.perf_counter()
    ttft, chunks, usage = None, 0, None
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        if resp.status != 200:
            return Result(False, error=f"HTTP {resp.status}: {resp.read()[:300]!r}")
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            msg = json.loads(data)
            if msg.get("choices"):
                chunks += 1
                if ttft is None:
                    ttft = time.perf_counter() - t0
            if msg.get("usage"):
                usage = msg["usage"]
        conn.close()
    except (OSError, ValueError) as exc:
        return Result(False, error=f"{type(exc).__name__}: {exc}")
    latency = time.perf_counter() - t0
    tokens = usage["completion_tokens"] if usage else chunks
    if ttft is None or tokens == 0:
        return Result(False, error="no tokens streamed")
    return Result(True, ttft, latency, tokens)


def run_rate(
    port: int, model_name: str, reqs: list[Request], rate: float, seed: int, timeout_s: float
) -> dict:
    """Poisson arrivals at `rate` requests/s; waits for every request (bounded by timeout_s)."""
    rng = random.Random(seed)
    results: list[Result | None] = [None] * len(reqs)

    def worker(i: int, r: Request) -> None:
        body = {
            "model": model_name,
            "prompt": r.prompt_token_ids,
            "max_tokens": r.max_tokens,
            "temperature": 0.8,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        results[i] = send(port, body, timeout_s)

    threads = []
    start = time.perf_counter()
    next_at = 0.0
    for i, r in enumerate(reqs):
        delay = start + next_at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        t = threading.Thread(target=worker, args=(i, r), daemon=True)
        t.start()
        threads.append(t)
        next_at += rng.expovariate(rate)
    for t in threads:
        t.join(timeout=max(1.0, timeout_s - (time.perf_counter() - start)))
    duration = time.perf_counter() - start
    return summarize(rate, [r or Result(False, error="timed out") for r in results], duration)


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


def summarize(rate: float, results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    rec: dict = {"rate": rate, "num_requests": len(results), "num_ok": len(ok)}
    errors = [r.error for r in results if not r.ok]
    if errors:
        rec["errors"] = errors[:3]
    if not ok:
        return rec
    ttft = [r.ttft_s for r in ok]
    tpot = [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    tokens = sum(r.output_tokens for r in ok)
    rec.update(
        duration_s=round(duration, 3),
        ttft_p50_ms=round(1e3 * _pct(ttft, 50), 2),
        ttft_p99_ms=round(1e3 * _pct(ttft, 99), 2),
        tpot_p50_ms=round(1e3 * _pct(tpot, 50), 2) if tpot else None,
        tpot_p99_ms=round(1e3 * _pct(tpot, 99), 2) if tpot else None,
        mean_latency_s=round(statistics.fmean(r.latency_s for r in ok), 3),
        normalized_latency_s_per_token=round(
            statistics.fmean(r.latency_s / r.output_tokens for r in ok), 5
        ),
        output_tokens=tokens,
        output_tokens_per_s=round(tokens / duration, 2),
        requests_per_s=round(len(ok) / duration, 3),
    )
    return rec


def run(
    model: str,
    reqs: list[Request],
    rates: list[float],
    out_dir: Path,
    server_args: list[str],
    *,
    timeout_s: float = 600,
    log=print,
) -> dict:
    """Start the server once, then one Poisson run per rate (same requests each time)."""
    result: dict = {"server_args": server_args, "rates": []}
    with Server(model, server_args, out_dir / "server.log", timeout_s) as srv:
        result["command"] = " ".join(srv.cmd)
        name = _model_name(srv.port)
        # warm-up request (compilation, first allocation)
        send(
            srv.port,
            {
                "model": name,
                "prompt": reqs[0].prompt_token_ids[:8],
                "max_tokens": 4,
                "stream": True,
            },
            timeout_s,
        )
        for i, rate in enumerate(rates):
            log(f"  serving at {rate} req/s, {len(reqs)} requests")
            rec = run_rate(srv.port, name, reqs, rate, seed=i, timeout_s=timeout_s)
            log(f"    -> {rec}")
            result["rates"].append(rec)
    return result


def _model_name(port: int) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/v1/models")
    return json.loads(conn.getresponse().read())["data"][0]["id"]
