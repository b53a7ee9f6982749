"""Hypothesis strategies for hostile text: any code point, lone surrogates included, mixed with
the pieces that break text handling most often (NUL, direction marks, joiners, 4-byte emoji,
combining sequences, BOM, the last code point)."""

from __future__ import annotations

import json

from hypothesis import strategies as st

TRICKY = [
    "\x00",
    "\u200f",  # right-to-left mark
    "\u202e",  # right-to-left override
    "\u200d",  # zero-width joiner
    "\ufeff",  # BOM
    "\U0001f600",  # 4-byte emoji
    "\U0001f469\u200d\U0001f469\u200d\U0001f467",  # ZWJ family
    "e\u0301\u0302",  # combining accents
    "\u0915\u094d\u0937",  # Devanagari conjunct
    "\U0010ffff",
    "\r\n",
    "<|im_end|>",  # a special token's text
    "{{ 7*7 }}",  # template syntax in content
]
LONE_SURROGATES = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF, categories=["Cs"])


def hostile_text(max_pieces: int = 6) -> st.SearchStrategy[str]:
    piece = st.one_of(
        st.characters(exclude_categories=()),
        st.sampled_from(TRICKY),
        LONE_SURROGATES,
    )
    return st.lists(piece, max_size=max_pieces).map("".join)


def has_lone_surrogate(text: str) -> bool:
    return any(0xD800 <= ord(c) <= 0xDFFF for c in text)


def through_json(text: str) -> str:
    """`text` as a server reads it: JSON joins an escaped high+low surrogate pair into one code
    point, so only surrogates left alone after that are invalid."""
    return json.loads(json.dumps(text))


def any_json(max_leaves: int = 8) -> st.SearchStrategy:
    """Any JSON value (small): what a hostile client puts in a field."""
    scalars = st.none() | st.booleans() | st.integers(-3, 3) | st.floats() | st.text(max_size=6)
    return st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
        max_leaves=max_leaves,
    )
