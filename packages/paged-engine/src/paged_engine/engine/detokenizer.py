"""Incremental, streaming-safe detokenization and stop strings.

Token ids are decoded a small window at a time (offsets into the detokenizer's `_ids`, which
start with up to 5 prompt tokens of context):

    | older (dropped) | last emitted chunk | held back + new tokens |
                      ^ prefix_offset      ^ read_offset
    delta = decode(_ids[prefix_offset:]) minus decode(_ids[prefix_offset:read_offset])

Decoding with context before the first new token keeps leading spaces right (SentencePiece drops
the space of the first token it decodes; byte-level BPE splits a character over several tokens),
and the window stays a few tokens long, so each step costs O(1) amortized, never a decode of the
whole output. Nothing is emitted while the window's text ends in U+FFFD (an incomplete UTF-8
sequence) or, for byte-fallback vocabularies, in a run of <0xXX> tokens (the decoder turns a
whole invalid run into U+FFFDs, so a later byte token could change text already emitted).

Per step, the output processor does:
    delta = detok.add_tokens(new_ids)            # or detok.finalize() once finished
    if hit := stop_checker.check(detok.output_text, len(delta)):
        detok.truncate(hit[0])                   # finish_reason "stop", stop_reason hit[1]
    streamable = len(detok.output_text) - stop_checker.holdback(detok.output_text)  # unless done
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

# Tokens of prompt context decoded with the first output tokens (vLLM and TGI use 5 too).
_PROMPT_CONTEXT = 5
_REPLACEMENT_CHAR = "\ufffd"


def make_decode_fn(
    tokenizer: Any, *, skip_special_tokens: bool, spaces_between_special_tokens: bool
) -> Callable[[list[int]], str]:
    """ids -> text for an HF tokenizer or a raw `tokenizers.Tokenizer`, with no clean-up of
    tokenization spaces (clean-up depends on context, so it would break incremental deltas)."""
    if not hasattr(tokenizer, "convert_ids_to_tokens"):  # tokenizers.Tokenizer
        return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    kwargs: dict[str, Any] = {
        "skip_special_tokens": skip_special_tokens,
        "clean_up_tokenization_spaces": False,
    }
    if not getattr(tokenizer, "is_fast", True):  # only slow tokenizers honour this flag
        kwargs["spaces_between_special_tokens"] = spaces_between_special_tokens
        return lambda ids: tokenizer.decode(ids, **kwargs)
    # A fast tokenizer's decode without clean-up is its Rust backend's decode; calling it directly
    # skips transformers' argument normalisation (most of the per-token cost).
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, **kwargs)


def make_id_to_token_fn(tokenizer: Any) -> Callable[[int], str | None]:
    """id -> the token's vocabulary string (e.g. "▁the", "Ġthe", "<0xE4>")."""
    if hasattr(tokenizer, "convert_ids_to_tokens"):
        return tokenizer.convert_ids_to_tokens
    return tokenizer.id_to_token


def added_token_texts(tokenizer: Any) -> dict[int, str]:
    """id -> content of every added token (special or not) of an HF fast or raw tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    get = getattr(backend, "get_added_tokens_decoder", None)
    added = get() if callable(get) else {}
    return {i: t.content for i, t in added.items()}


def has_byte_fallback(tokenizer: Any) -> bool:
    """Whether the vocabulary has SentencePiece byte-fallback tokens (<0x00> ... <0xFF>)."""
    if hasattr(tokenizer, "convert_tokens_to_ids"):
        token_id = tokenizer.convert_tokens_to_ids("<0x0A>")
        return token_id is not None and token_id != tokenizer.unk_token_id
    return tokenizer.token_to_id("<0x0A>") is not None


def _is_byte_piece(piece: str | None) -> bool:
    return piece is not None and len(piece) == 6 and piece.startswith("<0x") and piece[5] == ">"


def append_text(detok: Any, delta: str) -> str:
    """`detok.output_text + delta`, resized in place when nothing else holds the text.

    `self.output_text += delta` copies the whole text on every call (CPython appends in place
    only to a local variable whose string has no other reference): O(n^2) over an output,
    ~40 us a token at 80,000 tokens. Taking the text into a local and clearing the attribute
    first makes the append amortized O(len(delta)), as long as the caller dropped its own
    reference (the output stage does)."""
    text = detok.output_text
    detok.output_text = ""
    text += delta
    return text


class IncrementalDetokenizer:
    """Turns the output token ids of one sequence into text, one delta at a time.

    Invariant: `output_text` is the concatenation of every delta returned; once `finalize()` has
    run it equals decode(prompt + output) minus decode(prompt) (when the prompt ends on a
    character boundary). No delta ends inside a UTF-8 sequence.
    """

    __slots__ = (
        "_added",
        "_byte_fallback",
        "_decode",
        "_id_to_token",
        "_ids",
        "_last_added",
        "_skip_special_tokens",
        "num_prompt_tokens",
        "output_text",
        "prefix_offset",
        "read_offset",
    )

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self._decode = make_decode_fn(
            tokenizer,
            skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=spaces_between_special_tokens,
        )
        self._id_to_token = make_id_to_token_fn(tokenizer)
        self._byte_fallback = has_byte_fallback(tokenizer)
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT:])  # context, then output
        self.num_prompt_tokens = len(prompt_token_ids)
        self.prefix_offset = 0
        self.read_offset = len(self._ids)
        self.output_text = ""
        # vLLM's fast detokenizer with spaces_between_special_tokens=False (and specials kept):
        # an added token right after another added output token is its bare content, without
        # the separator a decoder such as WordPiece puts between tokens. Slow tokenizers get
        # the flag through decode() instead.
        self._added: dict[int, str] | None = None
        self._last_added = False
        fast = getattr(tokenizer, "is_fast", True)
        if fast and not (skip_special_tokens or spaces_between_special_tokens):
            self._added = added_token_texts(tokenizer) or None

    @property
    def num_held_tokens(self) -> int:
        """Output tokens whose text has not been emitted yet (an unfinished character)."""
        return len(self._ids) - self.read_offset

    def add_tokens(self, new_token_ids: Sequence[int]) -> str:
        """Append tokens; return the newly stable text (possibly "") and extend output_text."""
        if self._added is None:
            self._ids.extend(new_token_ids)
            return self._advance(final=False)
        delta = ""
        for token_id in new_token_ids:  # one at a time: each may follow an added token
            self._ids.append(token_id)
            content = self._added.get(token_id)
            bare = content if self._last_added else None
            delta += self._advance(final=False, bare=bare)
            self._last_added = content is not None
        return delta

    def finalize(self) -> str:
        """Emit whatever is held back (an unfinished character decodes to U+FFFD, as a full
        decode would). Call once the sequence is finished."""
        return self._advance(final=True)

    def _advance(self, *, final: bool, bare: str | None = None) -> str:
        if self.read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self._ids[self.prefix_offset :])
        # A run of byte-fallback tokens (<0xE4>) decodes as one group, and a later byte token
        # can turn the whole run into U+FFFDs: text is stable only once the run has ended.
        partial = new_text.endswith(_REPLACEMENT_CHAR) or self._ends_in_byte_run()
        if not final and (partial or len(new_text) <= len(prefix_text)):
            # Nothing stable yet: hold the tokens. Tokens that decode to nothing at all (skipped
            # special tokens) are consumed, so they are never held back.
            if new_text == prefix_text and not partial:
                self.read_offset = len(self._ids)
            return ""
        # `bare`: the new token's own text. The token before it was an added token, which
        # decodes whole and so left nothing held: the new text is this token's alone.
        delta = new_text[len(prefix_text) :] if bare is None else bare
        self.prefix_offset, self.read_offset = self.read_offset, len(self._ids)
        self._trim()
        self.output_text = append_text(self, delta)
        return delta

    def _trim(self) -> None:
        # Drop ids before the window so `ids` stays short (O(1) memory and slicing).
        if self.prefix_offset > 64:
            del self._ids[: self.prefix_offset]
            self.read_offset -= self.prefix_offset
            self.prefix_offset = 0

    def _ends_in_byte_run(self) -> bool:
        """Whether the last visible token of the window is a byte-fallback token."""
        if not self._byte_fallback:
            return False
        for token_id in reversed(self._ids[self.prefix_offset :]):
            if _is_byte_piece(self._id_to_token(token_id)):
                return True
            # Skipped special tokens are invisible to the decoder: the run continues past them.
            if not self._skip_special_tokens or self._decode([token_id]):
                return False
        return False

    def fork(self) -> IncrementalDetokenizer:
        """An independent copy (same tokenizer, copied state) for a forked sequence."""
        child = copy.copy(self)
        child._ids = self._ids.copy()
        return child

    def truncate(self, length: int) -> None:
        """Cut output_text to `length` characters (after a stop string matched)."""
        self.output_text = self.output_text[:length]

    def decode_token(self, token_id: int) -> str:
        """The text of one token on its own (for Logprob.decoded_token)."""
        return self._decode([token_id])


def find_stop(
    output_text: str, num_new_chars: int, stops: Sequence[str], include_stop_str_in_output: bool
) -> tuple[int, str] | None:
    """Look for a stop string that ends in the last `num_new_chars` characters.

    Only the tail that can hold a new match is searched, per stop string (the text before it
    was checked on earlier steps, or skipped under min_tokens: a short stop there is no match
    however long the other stops are). The stop strings are tried in their list order and the
    first one found wins, at its first match in that tail (vLLM's `check_stop_strings`): with
    stop=["b", "a"] and new text "ab" the stop is "b" and the text is cut to "a". Returns
    (length to truncate output_text to, the stop string), or None. The stop string is kept
    only with include_stop_str_in_output.
    """
    if not stops or num_new_chars <= 0:
        return None
    for stop in stops:
        pos = output_text.find(stop, max(0, len(output_text) - num_new_chars - len(stop) + 1))
        if pos != -1:
            return (pos + len(stop) if include_stop_str_in_output else pos), stop
    return None


def stop_holdback(output_text: str, stops: Sequence[str]) -> int:
    """How many trailing characters a stream must hold back: the longest suffix of output_text
    that is a proper prefix of some stop string (it may become a stop the server must not
    have sent)."""
    best = 0
    for stop in stops:
        # a held suffix starts where stop[0] does: try those starts from the longest down, each
        # a C-speed comparison (the naive loop over every length was quadratic in the stop)
        tail = output_text[len(output_text) - min(len(stop) - 1, len(output_text)) :]
        i = tail.find(stop[0])
        while i != -1 and len(tail) - i > best:
            if stop.startswith(tail[i:]):
                best = len(tail) - i
                break
            i = tail.find(stop[0], i + 1)
    return best


class StopChecker:
    """find_stop / stop_holdback bound to one request's stop strings."""

    __slots__ = ("include_stop_str_in_output", "stops")

    def __init__(self, stops: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        self.stops = list(stops)
        self.include_stop_str_in_output = include_stop_str_in_output

    def check(self, output_text: str, num_new_chars: int) -> tuple[int, str] | None:
        return find_stop(output_text, num_new_chars, self.stops, self.include_stop_str_in_output)

    def holdback(self, output_text: str) -> int:
        return stop_holdback(output_text, self.stops)
