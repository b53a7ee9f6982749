"""`paged-server chat` / `paged-server complete`: vLLM's `vllm chat` and `vllm complete`, a
terminal client for a running OpenAI-compatible server (this one, or any other), standard
library only.

Each answer streams as it is generated. `-q MESSAGE` sends one message (or prompt), prints the
answer and exits; otherwise each input line is one turn (chat keeps the conversation) until
end of input. `--stats` prints each answer's time to first token and tokens a second.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TextIO


class ClientError(Exception):
    """The server refused a request or could not be reached: the message says which."""


@dataclass
class Client:
    url: str  # the API root, ".../v1"
    api_key: str
    timeout: float = 600.0

    def _request(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url.rstrip("/") + path,
            data=data,
            method=method,
            headers={
                "Authorization": f"Bearer {self.api_key}",
                "Content-Type": "application/json",
                "Accept": "text/event-stream, application/json",
            },
        )
        try:
            return urllib.request.urlopen(req, timeout=self.timeout)
        except urllib.error.HTTPError as e:
            raise ClientError(f"{e.code} from {self.url}: {_error_message(e.read())}") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise ClientError(f"cannot reach {self.url}: {reason}") from None

    def first_model(self) -> str:
        with self._request("GET", "/models") as resp:
            models = json.load(resp).get("data") or []
        if not models:
            raise ClientError(f"{self.url}/models lists no model")
        return str(models[0]["id"])

    def stream(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The SSE events of one streamed request, until `data: [DONE]`."""
        with self._request("POST", path, {**body, "stream": True}) as resp:
            for raw in resp:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                try:
                    event = json.loads(data)
                except ValueError:
                    raise ClientError(f"not a JSON event from {self.url}: {data[:200]!r}") from None
                if "error" in event:  # a failure after the stream began
                    raise ClientError(_error_message(data.encode()))
                yield event


def _error_message(body: bytes) -> str:
    try:
        err = json.loads(body).get("error")
        return str(err.get("message", err)) if isinstance(err, dict) else str(err)
    except (ValueError, AttributeError):
        return body.decode("utf-8", "replace")[:500]


def print_stream(events: Iterator[dict[str, Any]], piece: str, out: TextIO, stats: bool) -> str:
    """Print each event's text (`piece`: "text" for completions, "content" for chat deltas) as
    it arrives; returns the whole text. `stats`: then TTFT and tokens a second (the usage
    event's count, asked for with stream_options)."""
    start = time.perf_counter()
    ttft = None
    tokens = 0
    text = []
    for event in events:
        usage = event.get("usage")
        if usage:
            tokens = int(usage.get("completion_tokens", 0))
        for choice in event.get("choices") or []:
            part = choice.get("delta", {}).get(piece) if piece == "content" else choice.get(piece)
            if part:
                ttft = ttft if ttft is not None else time.perf_counter() - start
                text.append(part)
                out.write(part)
                out.flush()
    out.write("\n")
    if stats and ttft is not None:
        total = time.perf_counter() - start
        out.write(f"TTFT: {ttft * 1000:.2f} ms\n")
        out.write(f"TPS:  {tokens / total:.2f} tokens/s ({tokens} tokens in {total:.2f}s)\n")
    out.flush()
    return "".join(text)


def build_parser(command: str) -> argparse.ArgumentParser:
    what = "chat completions" if command == "chat" else "text completions of a prompt"
    p = argparse.ArgumentParser(
        prog=f"paged-server {command}",
        description=f"Generate {what} via a running API server (vLLM's `vllm {command}`).",
    )
    p.add_argument(
        "--url",
        default="http://localhost:8000/v1",
        help="the server's OpenAI API root (default http://localhost:8000/v1)",
    )
    p.add_argument(
        "--model-name", default=None, help="the model to ask (default: the first /v1/models)"
    )
    p.add_argument("--api-key", default=None, help="the server's key (default: OPENAI_API_KEY)")
    p.add_argument(
        "-q",
        "--quick",
        default=None,
        metavar="MESSAGE" if command == "chat" else "PROMPT",
        help="send this one message, print the answer, exit",
    )
    p.add_argument(
        "--stats", action="store_true", help="print TTFT and tokens a second after each answer"
    )
    if command == "chat":
        p.add_argument("--system-prompt", default=None, help="a system message opening the chat")
    else:
        p.add_argument("--max-tokens", type=int, default=None, help="tokens per completion")
    return p


def main(command: str, argv: list[str]) -> int:
    """`paged-server chat|complete ...`; 1 when the server cannot be reached or refuses."""
    args = build_parser(command).parse_args(argv)
    key = args.api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
    client = Client(args.url, key)
    out = sys.stdout
    try:
        model = args.model_name or client.first_model()
    except ClientError as e:
        print(f"paged-server {command}: {e}", file=sys.stderr)
        return 1
    print(f"Using model: {model}", flush=True)
    body: dict[str, Any] = {"model": model}
    if args.stats:
        body["stream_options"] = {"include_usage": True}
    if command == "complete" and args.max_tokens is not None:
        body["max_tokens"] = args.max_tokens
    conversation: list[dict[str, str]] = []
    if command == "chat" and args.system_prompt is not None:
        conversation.append({"role": "system", "content": args.system_prompt})

    def turn(text: str) -> None:
        if command == "complete":
            events = client.stream("/completions", {**body, "prompt": text})
            print_stream(events, "text", out, args.stats)
            return
        asked = [*conversation, {"role": "user", "content": text}]
        events = client.stream("/chat/completions", {**body, "messages": asked})
        answer = print_stream(events, "content", out, args.stats)
        conversation[:] = [*asked, {"role": "assistant", "content": answer}]

    if args.quick is not None:
        try:
            turn(args.quick)
        except ClientError as e:
            print(f"paged-server {command}: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130
        return 0
    interactive = sys.stdin.isatty()
    if command == "chat":
        print("Please enter a message for the chat model:", flush=True)
    else:
        print("Please enter prompt to complete:", flush=True)
    while True:
        try:
            line = input("> " if interactive else "")
        except (EOFError, KeyboardInterrupt):  # end of input, or Ctrl-C at the prompt
            if interactive:
                print()  # off the prompt's line
            return 0
        try:
            turn(line)
        except ClientError as e:  # this turn is dropped; the conversation goes on
            print(f"\n[error] {e}", file=sys.stderr, flush=True)
        except KeyboardInterrupt:  # Ctrl-C mid-answer: that answer is dropped
            print("\n[interrupted]", flush=True)
