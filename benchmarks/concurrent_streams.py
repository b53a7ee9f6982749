"""Streaming throughput under a burst: N concurrent streaming /v1/completions against a
`paged-server` subprocess (the default model unless --model), output tokens per second.

    python -m benchmarks.concurrent_streams [--streams 64] [--max-tokens 64] [--rounds 2]

One warm-up round, then `--rounds` timed ones; each stream asks for `max_tokens` with
ignore_eos and its own seed, and counts the completion tokens its final usage chunk reports.
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import subprocess
import sys
import threading
import time


def _one(port: int, i: int, max_tokens: int, out: list[int]) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = {
        "prompt": f"Story number {i}: once upon a time",
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "seed": i,
        "stream_options": {"include_usage": True},
    }
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    for line in resp:
        if line.startswith(b"data: {"):
            usage = json.loads(line[6:]).get("usage")
            if usage:
                out[i] = usage["completion_tokens"]
    conn.close()


def burst(port: int, streams: int, max_tokens: int) -> tuple[int, float]:
    """(completion tokens, wall seconds) of `streams` concurrent streams."""
    out = [0] * streams
    threads = [
        threading.Thread(target=_one, args=(port, i, max_tokens, out)) for i in range(streams)
    ]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(out), time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.concurrent_streams", description=__doc__)
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--model", default=None, help="paged-server --model (default: built-in)")
    args = p.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "paged_server", "--port", str(port), "--log-level", "warning"]
    if args.model:
        cmd += ["--model", args.model]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:
            if "serving on" in line:
                break
        else:
            raise RuntimeError("paged-server exited before serving")
        threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
        burst(port, args.streams, args.max_tokens)  # warm-up
        for k in range(args.rounds):
            tokens, wall = burst(port, args.streams, args.max_tokens)
            print(
                f"round {k}: {args.streams} streams, {tokens} tokens in {wall:.2f}s = "
                f"{tokens / wall:.1f} output tok/s",
                flush=True,
            )
    finally:
        proc.terminate()
        proc.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
