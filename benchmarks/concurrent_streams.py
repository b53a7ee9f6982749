"""Streaming throughput under a burst: N concurrent streaming /v1/completions against a
`paged-server` subprocess (the default model unless --model), output tokens per second and
time to first token (TTFT) p50 / p99.

    python -m benchmarks.concurrent_streams [--streams 64] [--max-tokens 64] [--rounds 2]
        [--out results.json] [--server-arg=--dtype=bfloat16 ...]

One warm-up round, then `--rounds` timed ones; each stream asks for `max_tokens` with
ignore_eos and its own seed, and counts the completion tokens its final usage chunk reports.
A stream's TTFT runs from just before it sends its request to the first chunk that carries
text; all streams start together, so TTFT includes the queueing of the burst.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path


def _one(port: int, i: int, max_tokens: int, tokens: list[int], ttft: list[float]) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = {
        "prompt": f"Story number {i}: once upon a time",
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "seed": i,
        "stream_options": {"include_usage": True},
    }
    t0 = time.monotonic()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    for line in resp:
        if not line.startswith(b"data: {"):
            continue
        chunk = json.loads(line[6:])
        if ttft[i] < 0 and any(c.get("text") for c in chunk.get("choices", ())):
            ttft[i] = time.monotonic() - t0
        usage = chunk.get("usage")
        if usage:
            tokens[i] = usage["completion_tokens"]
    conn.close()


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


def burst(port: int, streams: int, max_tokens: int) -> dict:
    """Completion tokens, wall seconds and TTFTs (seconds, one per stream) of one burst."""
    tokens, ttft = [0] * streams, [-1.0] * streams
    threads = [
        threading.Thread(target=_one, args=(port, i, max_tokens, tokens, ttft))
        for i in range(streams)
    ]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    got = [t for t in ttft if t >= 0]
    return {
        "streams": streams,
        "completion_tokens": sum(tokens),
        "wall_s": round(wall, 3),
        "output_tokens_per_s": round(sum(tokens) / wall, 2),
        "ttft_p50_ms": round(1000 * percentile(got, 50), 1) if got else None,
        "ttft_p99_ms": round(1000 * percentile(got, 99), 1) if got else None,
        "ttft_max_ms": round(1000 * max(got), 1) if got else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.concurrent_streams", description=__doc__)
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--model", default=None, help="paged-server --model (default: built-in)")
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="an extra paged-server argument (repeat; e.g. --server-arg=--dtype=bfloat16)",
    )
    p.add_argument("--out", type=Path, default=None, help="write the rounds as JSON here")
    args = p.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "paged_server", "--port", str(port), "--log-level", "warning"]
    if args.model:
        cmd += ["--model", args.model]
    cmd += args.server_arg
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    rounds = []
    try:
        for line in proc.stdout:
            if "serving on" in line:
                break
        else:
            raise RuntimeError("paged-server exited before serving")
        threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
        burst(port, args.streams, args.max_tokens)  # warm-up
        for k in range(args.rounds):
            load = os.getloadavg()[0]
            rec = burst(port, args.streams, args.max_tokens)
            rec["load_avg_1m"] = [round(load, 2), round(os.getloadavg()[0], 2)]
            rounds.append(rec)
            print(
                f"round {k}: {args.streams} streams, {rec['completion_tokens']} tokens in "
                f"{rec['wall_s']:.2f}s = {rec['output_tokens_per_s']:.1f} output tok/s, "
                f"TTFT p50 {rec['ttft_p50_ms']} ms, p99 {rec['ttft_p99_ms']} ms",
                flush=True,
            )
    finally:
        proc.terminate()
        proc.wait(30)
    if args.out is not None:
        result = {
            "command": "python -m benchmarks.concurrent_streams "
            + " ".join(argv if argv is not None else sys.argv[1:]),
            "server": cmd[1:3] + cmd[7:],
            "max_tokens": args.max_tokens,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "rounds": rounds,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
