"""vLLM's `--tool-parser-plugin FILE` and `--reasoning-parser-plugin FILE`: a Python file of
the user's, run at start, that registers parsers under names `--tool-call-parser` and
`--reasoning-parser` then take, for a model whose format no built-in parser reads.

    # my_parsers.py
    from paged_server.parser_plugins import register_reasoning_parser, register_tool_parser
    from paged_server.reasoning import ThinkFormat
    from paged_server.tool_parsers import ParsedCall, ToolParser

    @register_tool_parser("my_calls")
    class MyCalls(ToolParser):
        start_markers = ("<call>",)
        def parse(self, text):  # the whole answer -> (content or None, calls)
            ...
        def partial_calls(self, text):  # streaming: streaming.PartialCall per call begun
            ...

    register_reasoning_parser("my_think", ThinkFormat(("<reason>",), ("</reason>",)))

    paged-server MODEL --tool-parser-plugin my_parsers.py --tool-call-parser my_calls \
        --reasoning-parser-plugin my_parsers.py --reasoning-parser my_think

A vLLM plugin file does not load as it is: its classes subclass vLLM's parser base classes;
port them onto `ToolParser` (tool_parsers/base.py) and `ThinkFormat` (reasoning.py). A name
already taken (built in, or by another plugin) is refused.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from paged_server.reasoning import HARMONY, THINK_FORMATS, ThinkFormat
from paged_server.tool_parsers import TOOL_PARSERS, ToolParser

P = TypeVar("P", bound=type[ToolParser])


def register_tool_parser(name: str) -> Callable[[P], P]:
    """Class decorator: serve `cls` as `--tool-call-parser name`."""

    def add(cls: P) -> P:
        if not (isinstance(cls, type) and issubclass(cls, ToolParser)):
            raise TypeError(f"tool parser {name!r}: {cls!r} is not a ToolParser subclass")
        _check_new(name, TOOL_PARSERS)
        TOOL_PARSERS[name] = cls
        return cls

    return add


def register_reasoning_parser(name: str, fmt: ThinkFormat) -> ThinkFormat:
    """Serve `fmt` (the reasoning block's markers) as `--reasoning-parser name`."""
    if not isinstance(fmt, ThinkFormat):
        raise TypeError(f"reasoning parser {name!r}: {fmt!r} is not a ThinkFormat")
    _check_new(name, {**THINK_FORMATS, HARMONY: None})
    THINK_FORMATS[name] = fmt
    return fmt


def reasoning_parsers() -> list[str]:
    """Every --reasoning-parser name, plugins' included."""
    return [*THINK_FORMATS, HARMONY]


def load_plugin(path: str) -> None:
    """Run the plugin file once (a file named twice, for both flags, runs once); ValueError
    saying why it could not be run."""
    file = Path(path).expanduser().resolve()
    name = f"paged_parser_plugin_{abs(hash(str(file)))}"
    if name in sys.modules:
        return
    if not file.is_file():
        raise ValueError(f"{path}: no such file")
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ValueError(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise ValueError(f"{path}: {type(e).__name__}: {e}") from e


def _check_new(name: str, taken: dict) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"a parser name must be a non-empty string, got {name!r}")
    if name in taken:
        raise ValueError(f"parser name {name!r} is taken; register under another name")
