"""Completions and chat answers: the whole JSON body from each prompt's FINAL_ONLY output, or
the SSE stream from DELTA outputs (choice `pi * n + i` is sequence i of prompt pi). The routes
in app.py check and submit the request; these build what goes back."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from paged_server.openai_protocol import GenerationRequest
from paged_server.openai_responses import (
    StreamChoice,
    chat_logprobs,
    completion_logprobs,
    envelope,
    prompt_logprobs_json,
    usage,
)
from paged_server.reasoning import ReasoningOutput, ReasoningRequest, split_reasoning
from paged_server.request_group import RequestGroup
from paged_server.tools import ToolOutput, make_parser

if TYPE_CHECKING:
    from paged_server.app import OpenAIApp
    from paged_server.http import Handler


def prompt_lengths(req: GenerationRequest, ids: list[list[int] | None]) -> list[int]:
    """Each prompt's length: its prompt_embeds rows (those come first), then its ids."""
    rows = [int(t.shape[0]) if t.dim() else 0 for t in req.prompt_embeds]
    return rows + [len(i) for i in ids[len(rows) :] if i is not None]


def prompt_tokens(out: Any, chat: bool) -> int:
    """One prompt's usage.prompt_tokens, as vLLM 0.10 counted them: its (decoder) prompt's
    tokens, plus a text encoder-decoder's encoder prompt in a chat answer only (vLLM's
    completions counted the decoder prompt alone)."""
    if chat and out.encoder_prompt_token_ids is not None:
        return out.num_prompt_tokens + len(out.encoder_prompt_token_ids)
    return out.num_prompt_tokens


def final_body(
    app: OpenAIApp,
    h: Handler,
    req: GenerationRequest,
    model: str,
    rid: str,
    group: RequestGroup,
    texts: list[str | None],
    ids: list[list[int] | None],
    chat: bool,
    reasoning: ReasoningRequest | None = None,
) -> dict[str, Any]:
    """The JSON answer from one FINAL_ONLY output per prompt: its best n sequences, ranked
    by the engine."""
    choices, n_prompt = [], 0
    scoring = req.max_tokens == 0  # the prompt only: what the engine generated is dropped
    for pi, out in enumerate(group.latest):
        n_prompt += prompt_tokens(out, chat)
        for seq in out.outputs:
            choice: dict[str, Any] = {"index": len(choices)}
            lp = reason = None
            if chat:
                if req.logprobs is not None:
                    lp = chat_logprobs(
                        seq.token_ids, seq.logprobs or [], req.logprobs, app._decoder(req)
                    )
                thought, answer = None, seq.text
                if reasoning is not None:
                    thought, answer = split_reasoning(
                        reasoning.parser, seq.text, reasoning.tool_markup
                    )
                content = answer if thought is None or answer else None
                if req.echo:
                    content = app._echo(req, texts[pi], ids[pi], chat) + (content or "")
                choice["message"] = {"role": app.response_role, "content": content}
                if req.tools is not None and req.tools.choice != "none":
                    tool_out = ToolOutput(req.tools, make_parser(app.tool_call_parser))
                    choice["message"], reason = tool_out.message(answer, seq.finish_reason)
                if thought is not None and reasoning is not None:
                    choice["message"].update(reasoning.fields(thought))
                    choice["message"]["content"] = choice["message"]["content"] or None
            else:
                prefix = app._echo(req, texts[pi], ids[pi], chat) if req.echo else ""
                text, tids, lps = seq.text, seq.token_ids, list(seq.logprobs or [])
                if scoring:
                    text, tids, lps = "", [], []
                if req.logprobs is not None:
                    if req.echo:
                        p_lps = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
                        tids, lps = out.prompt_token_ids + tids, list(p_lps) + lps
                    lp = completion_logprobs(tids, lps, req.logprobs, app._decoder(req), 0)
                choice["text"] = prefix + text
            if req.return_token_ids:
                choice["token_ids"] = [] if scoring else list(seq.token_ids)
                if not chat:
                    choice["prompt_token_ids"] = out.prompt_token_ids
            if req.prompt_logprobs is not None and not chat:
                choice["prompt_logprobs"] = prompt_logprobs_json(
                    out.prompt_token_ids, out.prompt_logprobs, req.prompt_logprobs
                )
            choice.update(
                logprobs=lp,
                finish_reason="length" if scoring else (reason or seq.finish_reason),
                stop_reason=None if scoring else seq.stop_reason,
            )
            choices.append(choice)
    n_gen = 0 if scoring else group.num_generated_tokens
    body = envelope(rid, "chat.completion" if chat else "text_completion", model)
    body.update(choices=choices, usage=usage(n_prompt, n_gen, app._cached(group)))
    if req.return_token_ids and chat:
        body["prompt_token_ids"] = group.latest[0].prompt_token_ids
    if req.prompt_logprobs is not None and chat:  # vLLM: one prompt, at the top level
        out = group.latest[0]
        body["prompt_logprobs"] = prompt_logprobs_json(
            out.prompt_token_ids, out.prompt_logprobs, req.prompt_logprobs
        )
    h.log_extra = f" prompt_tokens={n_prompt} gen_tokens={n_gen}"
    return body


def stream_final(h: Handler, req: GenerationRequest, body: dict[str, Any]) -> None:
    """A finished completions answer as a stream (prompt scoring: `echo` with
    `max_tokens` 0 streams the prompt, as vLLM does): one event holding every choice, the
    usage event when asked for, [DONE]."""
    h.start_stream()
    event = {k: v for k, v in body.items() if k != "usage"}
    if req.include_usage:
        event["usage"] = body["usage"] if req.continuous_usage else None
    h.send_event(event)
    if req.include_usage:
        h.send_event({**event, "choices": [], "usage": body["usage"]})
    h.end_stream()


def stream(
    app: OpenAIApp,
    h: Handler,
    req: GenerationRequest,
    model: str,
    rid: str,
    group: RequestGroup,
    texts: list[str | None],
    ids: list[list[int] | None],
    chat: bool,
    reasoning: ReasoningRequest | None = None,
) -> None:
    """Events from DELTA outputs, one choice per chunk (as vLLM and OpenAI send them: clients
    such as LiteLLM's stream wrapper read `choices[0]` only); choice `pi * n + i` is sequence
    i of prompt pi."""
    n = req.n
    obj = "chat.completion.chunk" if chat else "text_completion"
    created = int(time.time())
    choices = [StreamChoice() for _ in range(n * len(ids))]
    tool_outs = None
    if chat and req.tools is not None and req.tools.choice != "none":
        parser = app.tool_call_parser
        tool_outs = [ToolOutput(req.tools, make_parser(parser)) for _ in choices]
    thinks = None if reasoning is None else [ReasoningOutput(reasoning) for _ in choices]
    h.start_stream()

    lengths = prompt_lengths(req, ids)

    def chunk(entries: list[dict[str, Any]], ci: int) -> dict[str, Any]:
        """A chunk of choice `ci`; with continuous usage, vLLM's: that choice's prompt and the
        tokens it generated so far."""
        body = envelope(rid, obj, model, created)
        body["choices"] = entries
        if req.include_usage:
            body["usage"] = None
            if req.continuous_usage:
                out = group.latest[ci // n]
                n_prompt = lengths[ci // n]
                if app.encoder_decoder and out is not None:  # the ids were the encoder's
                    n_prompt = prompt_tokens(out, chat)
                body["usage"] = usage(n_prompt, choices[ci].num_tokens)
        return body

    for i in range(len(choices) if chat else 0):  # the role comes first, once per choice
        first = chunk(
            [
                {
                    "index": i,
                    "delta": {"role": app.response_role, "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
            i,
        )
        if req.return_token_ids and i == 0:  # vLLM: the prompt's ids in the first chunk
            first["prompt_token_ids"] = ids[0]
        h.send_event(first)
    for arrived in app.arrivals(h, group):
        updated = set()
        for pi, out in arrived:
            for seq in out.outputs:
                ci = pi * n + seq.index
                if choices[ci].add(seq, out.finished):
                    updated.add(ci)
        for ci in sorted(updated):
            st, pi = choices[ci], ci // n
            echo = req.echo and not st.started
            prefix = app._echo(req, texts[pi], ids[pi], chat) if echo else ""
            new_ids, first = list(st.token_ids), not st.started
            echo_lps = None
            if echo and not chat and req.logprobs is not None:  # as without a stream
                out = group.latest[pi]
                p_lps = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
                echo_lps = (list(out.prompt_token_ids), list(p_lps))
            entry = st.chunk(ci, prefix, req.logprobs, app._decoder(req), chat, echo_lps)
            if entry is not None and req.return_token_ids:  # this chunk's new ids
                entry["token_ids"] = new_ids
                if first and not chat:
                    entry["prompt_token_ids"] = ids[pi]
            if entry is not None and thinks is not None:  # tool calls: the content only
                entry = thinks[ci].rewrite(entry)
            if entry is not None and tool_outs is not None:
                entry = tool_outs[ci].rewrite(entry)
            if entry is not None:
                for part in _finish_apart(entry):
                    h.send_event(chunk([part], ci))
    n_prompt = sum(prompt_tokens(out, chat) for out in group.latest)
    n_gen = group.num_generated_tokens
    h.log_extra = f" prompt_tokens={n_prompt} gen_tokens={n_gen} stream"
    if req.include_usage:
        body = envelope(rid, obj, model, created)
        body.update(choices=[], usage=usage(n_prompt, n_gen, app._cached(group)))
        h.send_event(body)
    h.end_stream()


def _finish_apart(entry: dict[str, Any]) -> list[dict[str, Any]]:
    """The entries carrying one choice's `entry`, a chunk each: itself, unless it finishes in
    the entry that carries tool calls; then its finish comes in a chunk of its own with an
    empty delta, as OpenAI sends it (the openai SDK's stream helper announces a call's
    arguments.done only at a finish that follows the call's first chunk)."""
    if not (entry.get("finish_reason") and entry.get("delta", {}).get("tool_calls")):
        return [entry]
    ends = {"finish_reason": None, "stop_reason": None}
    finish = {"index": entry["index"], "delta": {}, "logprobs": None}
    return [{**entry, **ends}, finish | {k: v for k, v in entry.items() if k in ends}]
