"""The Responses API's `truncation: "auto"`: a conversation whose prompt does not fit the context
loses its oldest turns, whole, until it fits.

    messages   | kept: instructions, opening system / developer | turn | turn | ... | last turn |
    cuts                                                       ^0     ^1     ^2          ^last

A cut keeps the opening messages and every turn from a user message on. A turn is a user
message and what follows it up to the next one, so a function call stays with its output (a
cut that would part a call from its output, by call_id, is never offered) and the kept
conversation starts as templates expect, with a user message. The prompt fits as the chat path
checks it (`check_context`): shorter than max_model_len, and with `max_output_tokens` set, the
two together no longer than it. The cut is the earliest one that fits, found by bisection: a
prompt that fits is rendered once, one that does not at most about log2(turns) + 3 times.

A cut conversation is also what the response stores for `previous_response_id`: the turns it
dropped did not fit, and a next turn only adds to the conversation, so under the same
max_output_tokens its cut falls there or later. Kept whole, a long chain would grow its stored
context (and the work of rendering it, every turn) without end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from paged_server.errors import APIError
from paged_server.openai_protocol import check_context

if TYPE_CHECKING:
    from paged_server.app import OpenAIApp
    from paged_server.openai_protocol import GenerationRequest
    from paged_server.reasoning import ReasoningRequest
    from paged_server.responses_request import ResponsesRequest

    Prompt = tuple[str, list[int], ReasoningRequest | None]

_MEDIA_PARTS = frozenset({"image", "video", "audio"})  # a part that took one of media_refs


@dataclass(slots=True)
class TurnCuts:
    keep: int  # the leading chat messages every cut keeps
    starts: list[int]  # the message where each cut's kept tail starts, ascending; [0]: all
    media: list[int]  # media[m]: media_refs taken by the chat messages before message m
    pinned: int  # the leading items (system / developer messages) every cut keeps
    items: list[int]  # the item where each cut's kept tail starts (items[0] == pinned: all)


def turn_cuts(
    items: list[dict[str, Any]],
    starts: list[int],
    messages: list[dict[str, Any]],
    instructions: bool,
) -> TurnCuts:
    """Where the conversation of normalized `items` (item i opens or joins chat message
    `starts[i]`; `messages`: the parsed chat messages) may be cut."""
    pinned = 0  # the system / developer messages that open the conversation
    while (
        pinned < len(items)
        and items[pinned]["type"] == "message"
        and items[pinned]["role"] in ("system", "developer")
    ):
        pinned += 1
    keep = starts[pinned] if pinned < len(items) else int(instructions) + pinned
    # a cut before item u parts a call at c from its output at o when c < u <= o; an output
    # pairs with the latest call of its call_id before it (clients may reuse ids across turns)
    calls: dict[str, int] = {}
    parted = [0] * (len(items) + 1)
    for i, it in enumerate(items):
        if it["type"] == "function_call":
            calls[it["call_id"]] = i
        elif it["type"] == "function_call_output" and it["call_id"] in calls:
            parted[calls[it["call_id"]] + 1] += 1
            parted[i + 1] -= 1
    cuts, at, open_spans = [keep], [pinned], 0
    for u in range(len(items)):
        open_spans += parted[u]
        it = items[u]
        if u > pinned and not open_spans and it["type"] == "message" and it["role"] == "user":
            cuts.append(starts[u])
            at.append(u)
    media = [0]
    for m in messages:
        parts = m["content"] if isinstance(m["content"], list) else ()
        media.append(media[-1] + sum(p.get("type") in _MEDIA_PARTS for p in parts))
    return TurnCuts(keep, cuts, media, pinned, at)


def _misfit(chat: GenerationRequest, n: int, max_model_len: int) -> APIError | None:
    """The 400 a prompt of `n` tokens gets under `chat`'s max_tokens, None when it fits."""
    try:
        check_context(n, chat.max_tokens, max_model_len, "messages")
    except APIError as e:
        return e
    return None


def _fits(chat: GenerationRequest, n: int, max_model_len: int) -> bool:
    return _misfit(chat, n, max_model_len) is None


def fit_prompt(app: OpenAIApp, req: ResponsesRequest) -> Prompt:
    """The request's rendered prompt (`app._chat_prompt`), its oldest turns dropped under
    truncation "auto" until it fits; `req.chat` is left holding the messages rendered and
    `req.context` the items kept (what a stored response continues). A 400 when even the last
    turn alone does not fit (naming `input`, or `max_output_tokens` when the prompt fits
    without it)."""
    chat, cuts = req.chat, req.cuts
    full = app._chat_prompt(chat)
    if cuts is None or _fits(chat, len(full[1]), app.max_model_len):
        return full
    messages, refs = chat.messages, chat.media_refs

    def render(j: int) -> Prompt:
        start = cuts.starts[j]
        chat.messages = messages[: cuts.keep] + messages[start:]
        chat.media_refs = refs[: cuts.media[cuts.keep]] + refs[cuts.media[start] :]
        chat.processed_media = None  # processed again for the media kept (if it was)
        return app._chat_prompt(chat)

    hi = shown = len(cuts.starts) - 1
    best = render(hi) if hi else full
    error = _misfit(chat, len(best[1]), app.max_model_len)
    if error is not None:
        error.message = (
            "even with truncation 'auto' (every turn before the last one dropped) the input "
            f"does not fit: {error.message}"
        )
        raise error
    lo = 0  # invariant: the cut lo does not fit, the cut hi does
    while hi - lo > 1:
        shown = mid = (lo + hi) // 2
        got = render(mid)
        if _fits(chat, len(got[1]), app.max_model_len):
            hi, best = mid, got
        else:
            lo = mid
    # hi >= 1 here (cut 0 is the whole conversation, which did not fit)
    req.context = req.context[: cuts.pinned] + req.context[cuts.items[hi] :]
    return best if shown == hi else render(hi)
