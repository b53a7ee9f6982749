"""Builders for OpenAI response bodies, stream chunks and logprob objects; a stream's choices."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Decode = Callable[[int], str]  # token id -> its text


def _lp(value: float) -> float:
    """JSON has no -inf / nan: clamp like vLLM does."""
    return max(value, -9999.0) if math.isfinite(value) else -9999.0


def token_id_text(tid: int) -> str:
    """vLLM's `return_tokens_as_token_ids`: a logprob entry's token as "token_id:{id}", so a
    token whose text is not valid UTF-8 on its own (a byte of a character) stays identifiable."""
    return f"token_id:{tid}"


def _entry_text(tid: int, lp: Any, decode: Decode) -> str:
    if decode is token_id_text:
        return token_id_text(tid)
    text = getattr(lp, "decoded_token", None)
    return text if text is not None else decode(tid)


def _ranked(lp_dict: dict, top_n: int) -> list[tuple[int, Any]]:
    items = sorted(
        lp_dict.items(),
        key=lambda kv: (getattr(kv[1], "rank", None) or 1 << 30, -kv[1].logprob),
    )
    return items[:top_n]


def prompt_logprobs_json(
    token_ids: list[int], logprobs: list[dict | None] | None, top_n: int
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: per prompt token (None for the first) {token id as a string:
    {"logprob", "rank", "decoded_token"}}, the prompt token itself plus the top `top_n`."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for tid, d in zip(token_ids, logprobs or [None] * len(token_ids)):
        if d is None:
            out.append(None)
            continue
        keep = dict(_ranked(d, top_n))
        if tid in d:
            keep[tid] = d[tid]
        out.append(
            {
                str(t): {
                    "logprob": _lp(lp.logprob),
                    "rank": lp.rank,
                    "decoded_token": lp.decoded_token,
                }
                for t, lp in keep.items()
            }
        )
    return out


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


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None
) -> dict[str, Any]:
    """OpenAI's usage; `cached_tokens` (--enable-prompt-tokens-details): prompt tokens the
    prefix cache served, as `prompt_tokens_details`."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def envelope(rid: str, obj: str, model: str, created: int | None = None) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": created or int(time.time()), "model": model}


@dataclass(slots=True)
class StreamChoice:
    """One choice of a stream: the engine's DELTA outputs for it, merged in order until the next
    chunk takes them (a reader that fell behind sends one chunk for several engine steps).

    The engine streams only text no stop string can cut any more, so nothing is held back here.
    """

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_chars: int = 0  # text already streamed (an echo included): the next text_offset
    num_tokens: int = 0  # tokens generated so far (continuous usage counts them per choice)
    started: bool = False  # its first chunk went out (an echoed prompt leads that one)
    finished: bool = False  # its finish_reason went out: nothing follows

    def add(self, seq: Any, request_finished: bool) -> bool:
        """Merge one DELTA `CompletionOutput`; False once the choice finished."""
        if self.finished:
            return False
        self.text += seq.text
        self.token_ids += seq.token_ids
        self.num_tokens += len(seq.token_ids)
        if seq.logprobs is not None:
            self.logprobs = (self.logprobs or []) + seq.logprobs
        self.finish_reason = seq.finish_reason or ("stop" if request_finished else None)
        self.stop_reason = seq.stop_reason
        return True

    def chunk(
        self,
        index: int,
        prefix: str,
        top_n: int | None,
        decode: Decode,
        chat: bool,
        prefix_logprobs: tuple[list[int], list[dict | None]] | None = None,
    ) -> dict[str, Any] | None:
        """This choice's entry in the next chunk (None when nothing is new); it takes what was
        merged. `prefix`, an echoed prompt, leads the first entry; `prefix_logprobs` (its token
        ids and logprobs, completions only) lead that entry's logprobs, as without a stream."""
        text, fin = prefix + self.text, self.finish_reason
        if not text and not self.token_ids and fin is None:
            return None
        lp = None
        if top_n is not None and self.logprobs is not None:
            tids, lps = self.token_ids, self.logprobs
            offset = self.sent_chars + len(prefix)  # where this chunk's new text starts
            if prefix_logprobs is not None:
                tids, lps = prefix_logprobs[0] + tids, prefix_logprobs[1] + lps
                offset = self.sent_chars
            lp = (
                chat_logprobs(tids, lps, top_n, decode)
                if chat
                else completion_logprobs(tids, lps, top_n, decode, offset)
            )
        c: dict[str, Any] = {"index": index}
        if chat:
            c["delta"] = {"content": text} if text or fin is None else {}
        else:
            c["text"] = text
        c.update(logprobs=lp, finish_reason=fin, stop_reason=self.stop_reason if fin else None)
        self.sent_chars += len(text)  # text_offset counts in the choice's whole text, echo included
        self.started, self.finished = True, fin is not None
        self.text, self.token_ids, self.logprobs = "", [], None
        return c
