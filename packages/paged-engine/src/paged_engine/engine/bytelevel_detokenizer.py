"""Fast incremental detokenization for byte-level BPE tokenizers (GPT-2, Llama 3, Qwen, SmolLM2).

With a `ByteLevel` decoder, decoding is a concatenation: every token maps to a fixed byte
string (each character of the token through GPT-2's byte table; a token with a character outside
the table, such as an added token, keeps its own UTF-8 bytes) and the text is those bytes read as
UTF-8 with invalid sequences replaced. So one dictionary lookup per token and an incremental UTF-8
decoder (which holds back an unfinished character) give exactly the full decode, with no windowed
re-decoding. `make_detokenizer` picks this class when it applies, `IncrementalDetokenizer` else.
"""

from __future__ import annotations

import codecs
import contextlib
from collections.abc import Sequence
from typing import Any

from paged_engine.engine.detokenizer import IncrementalDetokenizer, append_text


def _byte_table() -> dict[str, int]:
    """GPT-2's printable stand-in character -> the byte it encodes (the ByteLevel alphabet)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_CHAR_TO_BYTE = _byte_table()


class ByteLevelVocab:
    """token id -> bytes for one tokenizer, which ids are special (skippable), and the text of
    every token whose bytes are whole UTF-8 characters (most of them)."""

    def __init__(self, backend: Any) -> None:
        vocab = backend.get_vocab(with_added_tokens=True)
        self.bytes: dict[int, bytes] = {}
        self.text: dict[int, str] = {}
        for token, token_id in vocab.items():
            try:
                data = bytes(_CHAR_TO_BYTE[c] for c in token)
            except KeyError:  # e.g. an added token: decoded as its own text
                data = token.encode("utf-8")
            self.bytes[token_id] = data
            # part of a character: left to the incremental decoder
            with contextlib.suppress(UnicodeDecodeError):
                self.text[token_id] = data.decode("utf-8")
        added = backend.get_added_tokens_decoder()
        self.special = frozenset(i for i, tok in added.items() if tok.special)


def byte_level_vocab(tokenizer: Any) -> ByteLevelVocab | None:
    """The byte table of a fast tokenizer whose decoder is exactly ByteLevel, else None.

    Built anew on each call (a pass over the vocabulary): its owner, the output processor, keeps
    it for its tokenizer's lifetime. No global cache: one keyed by `id()` handed a dead
    tokenizer's table to a new tokenizer allocated at the same address.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None and type(tokenizer).__name__ == "Tokenizer":
        backend = tokenizer  # a raw tokenizers.Tokenizer
    if backend is None or type(backend.decoder).__name__ != "ByteLevel":
        return None
    return ByteLevelVocab(backend)


class ByteLevelDetokenizer:
    """Same interface as `IncrementalDetokenizer`; output equals the full decode of the output."""

    __slots__ = ("_decoder", "_partial", "_skip", "_vocab", "output_text")

    def __init__(self, vocab: ByteLevelVocab, *, skip_special_tokens: bool) -> None:
        self._vocab = vocab
        self._skip = vocab.special if skip_special_tokens else frozenset()
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._partial = False  # the decoder holds bytes of an unfinished character
        self.output_text = ""

    @property
    def num_held_tokens(self) -> int:
        return 1 if self._decoder.getstate()[0] else 0  # bytes of an unfinished character

    def add_tokens(self, new_token_ids: Sequence[int]) -> str:
        if len(new_token_ids) == 1 and not self._partial:
            # The common step: one token of whole characters after whole characters; its text
            # is what the incremental decoder would give, without the decoder.
            t = new_token_ids[0]
            delta = "" if t in self._skip else self._vocab.text.get(t)
            if delta is not None:
                if delta:  # append_text, inlined
                    text = self.output_text
                    self.output_text = ""
                    text += delta
                    self.output_text = text
                return delta
        table, skip = self._vocab.bytes, self._skip
        data = b"".join(table.get(t, b"") for t in new_token_ids if t not in skip)
        delta = self._decoder.decode(data)
        self._partial = bool(self._decoder.getstate()[0])
        self.output_text = append_text(self, delta)
        return delta

    def finalize(self) -> str:
        delta = self._decoder.decode(b"", final=True)  # an unfinished character -> U+FFFD
        self._partial = False
        self.output_text = append_text(self, delta)
        return delta

    def fork(self) -> ByteLevelDetokenizer:
        child = ByteLevelDetokenizer.__new__(ByteLevelDetokenizer)
        child._vocab, child._skip, child.output_text = self._vocab, self._skip, self.output_text
        child._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        child._decoder.setstate(self._decoder.getstate())
        child._partial = self._partial
        return child

    def truncate(self, length: int) -> None:
        self.output_text = self.output_text[:length]

    def decode_token(self, token_id: int) -> str:
        return self._vocab.bytes.get(token_id, b"").decode("utf-8", errors="replace")


def make_detokenizer(
    tokenizer: Any,
    prompt_token_ids: Sequence[int],
    *,
    skip_special_tokens: bool = True,
    spaces_between_special_tokens: bool = True,
    vocab: ByteLevelVocab | None = None,
) -> ByteLevelDetokenizer | IncrementalDetokenizer:
    """The fast path when `tokenizer` is byte-level, the general one else. `vocab` is
    `byte_level_vocab(tokenizer)` computed once by the caller (built here when omitted)."""
    if vocab is None:
        vocab = byte_level_vocab(tokenizer)
    if vocab is not None:
        return ByteLevelDetokenizer(vocab, skip_special_tokens=skip_special_tokens)
    return IncrementalDetokenizer(
        tokenizer,
        prompt_token_ids,
        skip_special_tokens=skip_special_tokens,
        spaces_between_special_tokens=spaces_between_special_tokens,
    )
