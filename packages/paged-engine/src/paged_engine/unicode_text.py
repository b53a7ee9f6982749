"""Text a tokenizer can take: refuse lone UTF-16 surrogates before they reach one.

A Python `str` may hold a lone surrogate (U+D800..U+DFFF): JSON's `"\\ud800"` escape decodes to
one, and so does `bytes.decode(..., "surrogateescape")`. No UTF-8 codec accepts it, so HF
tokenizers raise a `TypeError`, chat templates a `UnicodeEncodeError`. Rather than make such
text encodable (replacing the surrogate would change what the caller asked for), it is refused
with an error that names the field and the position. Torch-free: the server imports it too.
"""

from __future__ import annotations

from typing import Any


def lone_surrogate(text: str) -> int | None:
    """Index of the first lone surrogate in `text`, or None if it is valid Unicode."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


_NESTED = (str, dict, list, tuple)


def find_lone_surrogate(value: Any, name: str) -> tuple[str, int, str] | None:
    """The first string (or object key) under `value` holding a lone surrogate, as
    (path such as "messages[0].content", index in that string, the surrogate); None if there is
    none. Walks lists, tuples and dicts without recursion (JSON may nest deeply)."""
    stack: list[tuple[Any, str]] = [(value, name)]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            at = lone_surrogate(item)
            if at is not None:
                return path, at, item[at]
        elif isinstance(item, dict):
            for key, sub in reversed(list(item.items())):
                at = lone_surrogate(key) if isinstance(key, str) else None
                if at is not None:
                    return f"a key of {path or 'the body'}", at, key[at]
                if isinstance(sub, _NESTED):
                    stack.append((sub, f"{path}.{key}" if path else str(key)))
        elif isinstance(item, (list, tuple)):
            # Numbers (token ids) are skipped without building their paths.
            nested = [i for i, sub in enumerate(item) if isinstance(sub, _NESTED)]
            stack.extend((item[i], f"{path}[{i}]") for i in reversed(nested))
    return None


def surrogate_message(path: str, at: int, char: str) -> str:
    return (
        f"{path} contains a lone UTF-16 surrogate (U+{ord(char):04X} at index {at}): text must "
        "be valid Unicode (a character outside the BMP is one code point, or in JSON a "
        "high+low surrogate pair such as \\ud83d\\ude00)"
    )


def check_text(value: Any, name: str) -> None:
    """Raise ValueError naming the field if any string under `value` has a lone surrogate."""
    found = find_lone_surrogate(value, name)
    if found is not None:
        raise ValueError(surrogate_message(*found))
