"""The chat template a tokenizer serves: its one template, or of the named ones a checkpoint's
tokenizer_config.json lists (Hermes 2 Pro / 3: "default" and "tool_use"; Command R: "rag" too),
which transformers loads as a dict, the one its apply_chat_template picks. Torch-free: the
server's request threads call it."""

from __future__ import annotations

from typing import Any


def model_chat_template(tokenizer: Any, tools: list | None = None) -> str | None:
    """The tokenizer's chat template (None: it has none); of named ones, "tool_use" when the
    template is given tools, else "default" (transformers' ValueError where none fits)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return tokenizer.get_chat_template(None, tools)
    return template
