"""Builders for OpenAI response bodies, stream chunks and logprob objects, and stream deltas."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from paged_server.engine_client import SeqSnapshot

Decode = Callable[[int], str]  # token id -> its text


def _lp(value: float) -> float:
    """JSON has no -inf / nan: clamp like vLLM does."""
    return max(value, -9999.0) if math.isfinite(value) else -9999.0


def _entry_text(tid: int, lp: Any, decode: Decode) -> str:
    text = getattr(lp, "decoded_token", None)
    return text if text is not None else decode(tid)


def _ranked(lp_dict: dict, top_n: int) -> list[tuple[int, Any]]:
    items = sorted(
        lp_dict.items(),
        key=lambda kv: (getattr(kv[1], "rank", None) or 1 << 30, -kv[1].logprob),
    )
    return items[:top_n]


def completion_logprobs(
    token_ids: list[int], logprobs: list[dict | None], top_n: int, decode: Decode, text_offset: int
) -> dict[str, list]:
    """Legacy completions format; a None entry (the first prompt token) has no logprob."""
    out: dict[str, list] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for tid, lp_dict in zip(token_ids, logprobs):
        own = None if lp_dict is None else lp_dict.get(tid)
        token = _entry_text(tid, own, decode)
        out["tokens"].append(token)
        out["token_logprobs"].append(None if own is None else _lp(own.logprob))
        if lp_dict is None:
            out["top_logprobs"].append(None)
        else:
            top = {_entry_text(t, lp, decode): _lp(lp.logprob) for t, lp in _ranked(lp_dict, top_n)}
            if own is not None:
                top.setdefault(token, _lp(own.logprob))
            out["top_logprobs"].append(top)
        out["text_offset"].append(text_offset)
        text_offset += len(token)
    return out


def chat_logprobs(
    token_ids: list[int], logprobs: list[dict], top_n: int, decode: Decode
) -> dict[str, list]:
    content = []
    for tid, lp_dict in zip(token_ids, logprobs):
        own = lp_dict.get(tid)
        token = _entry_text(tid, own, decode)
        top = [
            {
                "token": (s := _entry_text(t, lp, decode)),
                "logprob": _lp(lp.logprob),
                "bytes": list(s.encode("utf-8", "replace")),
            }
            for t, lp in _ranked(lp_dict, top_n)
        ]
        content.append(
            {
                "token": token,
                "logprob": _lp(own.logprob) if own is not None else -9999.0,
                "bytes": list(token.encode("utf-8", "replace")),
                "top_logprobs": top,
            }
        )
    return {"content": content}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def envelope(rid: str, obj: str, model: str, created: int | None = None) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": created or int(time.time()), "model": model}


@dataclass(slots=True)
class DeltaState:
    """What of one choice was already streamed. Text is streamed only once it can no longer be
    retracted: a suffix that could begin a stop string, or a trailing replacement character of
    an incomplete UTF-8 sequence, is held back until more text or the finish arrives."""

    sent_chars: int = 0
    sent_tokens: int = 0
    finished: bool = False
    started: bool = False

    def take(self, seq: SeqSnapshot, holdback: int) -> tuple[str, int, int]:
        """(text delta, first new token, end token) for this snapshot; advances the state."""
        text = seq.text
        end = len(text)
        if seq.finish_reason is None:
            end = max(self.sent_chars, end - holdback)
            while end > self.sent_chars and text[end - 1] == "\ufffd":
                end -= 1
        delta = text[self.sent_chars : end] if end > self.sent_chars else ""
        self.sent_chars = max(self.sent_chars, end)
        t0, t1 = self.sent_tokens, len(seq.token_ids)
        self.sent_tokens = max(t0, t1)
        return delta, t0, t1
