"""From `StructuredOutputsParams` to a checked llguidance grammar (no tokenizer, no torch).

llguidance backs structured outputs: on our workload it compiles a schema in ~1 ms where
xgrammar takes up to 100-400 ms, and fills a batch-32 mask faster (benchmarks/
structured_backends.py, docs/benchmarks/cpu/structured_backends.json). `grammar_text` turns the
parameters into llguidance's grammar and validates it, raising a ValueError that names the
field; results are cached per constraint, so the server's HTTP thread and the engine's input
processor checking the same request pay once.

JSON spacing: by default as `json.dumps` writes it (", " and ": ", no newlines). vLLM's default
lets whitespace go anywhere JSON allows it, and small models then pad with newlines until
max_tokens (SmolLM2 does, on 11 of our 12 schemas); `whitespace_pattern` opts into that,
`disable_any_whitespace` removes the spaces too.

Hostile grammars: llguidance builds a grammar by recursing over its rules in Rust, so a chain of
a few thousand rules (a Lark grammar, or a JSON schema's `$ref` chain) overflowed an 8 MB
thread stack and killed the whole process (SIGSEGV). Every llguidance build and check runs on
a thread with a `STACK_BYTES` stack (`on_big_stack`), and a `grammar` text is at most
`MAX_GRAMMAR_CHARS` long (deep enough for any chain that fits) with at most `MAX_GBNF_RULES`
GBNF rules (llguidance's GBNF-to-Lark conversion is quadratic in them: 2000 rules took 2 s).
JSON schemas are bounded by llguidance's own size limit ("schema too large"). A cached grammar
starts no thread (the server checks every structured request: a thread's start cost ~0.3 ms),
and at most `MAX_BIG_STACKS` such threads live at once (64 concurrent requests reserved 16 GB of
address space, and failed "can't start new thread" under a 3 GB `ulimit -v`); llguidance's GBNF
conversion holds the GIL (8 threads took as long as 8 in a row): more would not be faster.
Threads the rest of the process starts meanwhile keep their own stack size (`_run_on_big_stack`).
"""

from __future__ import annotations

import _thread
import contextlib
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

from paged_engine.structured_output.grammar_rules import check_grammar_rules, gbnf_names
from paged_engine.structured_output.params import StructuredOutputsParams
from paged_engine.structured_output.schema_refs import check_ref_cycles
from paged_engine.structured_output.structural_tag import structural_tag_lark
from paged_engine.structured_output.work_bounds import (
    check_regex,
    check_rule_repeats,
    check_spec,
    check_structural_tag,
)

EXTRA_HINT = "install it with: pip install 'paged-engine[structured]'"
# llguidance takes ~3 KB of stack a chained rule (8 MB overflowed near 2800 rules; 25k fit
# here); the stack is reserved address space, resident only as deep as a build goes.
STACK_BYTES = 256 << 20
MAX_GRAMMAR_CHARS = 100_000  # at most ~17k chained rules ("ab:ac\n" each): fits STACK_BYTES
MAX_GBNF_RULES = 1000  # llguidance's conversion to Lark takes ~0.5 s for 1000
_GBNF_RULE = re.compile(r"::=")
_STACK_LOCK = threading.Lock()
MAX_BIG_STACKS = 4
_BIG_STACKS = threading.BoundedSemaphore(MAX_BIG_STACKS)
T = TypeVar("T")


class GrammarBusyError(RuntimeError):
    """No thread could start to build a grammar (the process is out of threads or address
    space): the server's state, not the request's fault; the same request may pass later."""


def on_big_stack(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on a fresh thread with a STACK_BYTES stack (its exception re-raised here);
    at most MAX_BIG_STACKS at once, the others wait. `fn` must not call on_big_stack itself."""
    with _BIG_STACKS:
        return _run_on_big_stack(fn, *args)


def _run_on_big_stack(fn: Callable[..., T], *args: Any) -> T:
    result: list[Any] = []
    done = threading.Event()

    def run() -> None:
        try:
            result.append((True, fn(*args)))
        except BaseException as e:  # handed to the caller's thread
            result.append((False, e))
        finally:
            done.set()

    # threading.stack_size is process-wide: any thread started while it is set gets the big
    # stack too. `_thread.start_new_thread` returns once the thread exists, without waiting for
    # it to run (threading.Thread.start waits, letting other threads start theirs meanwhile:
    # every thread the server started during a build got 256 MB).
    with _STACK_LOCK:
        old = threading.stack_size(STACK_BYTES)
        try:
            _thread.start_new_thread(run, ())
        except (RuntimeError, MemoryError) as e:  # "can't start new thread"
            raise GrammarBusyError(
                f"no thread could start to check the grammar ({e}): the server is out of "
                "threads or memory, try again later"
            ) from e
        finally:
            threading.stack_size(old)
    done.wait()
    ok, value = result[0]
    if not ok:
        raise value
    return value


def import_llguidance() -> Any:
    try:
        import llguidance
    except ImportError as e:
        raise ImportError(
            f"structured outputs need the optional dependency llguidance ({EXTRA_HINT})"
        ) from e
    return llguidance


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of `params`; ValueError (naming the field) if it is invalid."""
    if params.grammar is not None:
        _check_grammar_size(params.grammar)
    return _grammar_text(params.key())


def _check_grammar_size(text: str) -> None:
    if len(text) > MAX_GRAMMAR_CHARS:
        raise ValueError(
            f"structured_outputs.grammar is at most {MAX_GRAMMAR_CHARS} characters, got {len(text)}"
        )
    rules = len(_GBNF_RULE.findall(text))  # an upper bound: `::=` may sit in a literal too
    if rules > MAX_GBNF_RULES:
        raise ValueError(
            f"structured_outputs.grammar has at most {MAX_GBNF_RULES} GBNF rules, got {rules}"
        )


class _TextCache:
    """key -> grammar text, least recently used dropped first past `size` entries or `chars`
    characters of keys and texts (a key holds the whole constraint: a count alone let 512
    half-megabyte schemas keep ~0.5 GB). A text alone past `chars` is still kept. Thread-safe
    (HTTP threads and the compile thread share it); a failed build is not cached."""

    def __init__(self, size: int, chars: int) -> None:
        self.size, self.chars = size, chars
        self._lock = threading.Lock()
        self._texts: OrderedDict[str, str] = OrderedDict()
        self.held = 0  # characters of the keys and texts held

    def __call__(self, key: str) -> str:
        with self._lock:
            text = self._texts.get(key)
            if text is not None:
                self._texts.move_to_end(key)
                return text
        # built without the lock (other keys are served meanwhile); a hit starts no thread
        text = on_big_stack(_build_grammar_text, key)
        with self._lock:
            if key not in self._texts:
                self._texts[key] = text
                self.held += len(key) + len(text)
                while len(self._texts) > 1 and (
                    len(self._texts) > self.size or self.held > self.chars
                ):
                    old_key, old_text = self._texts.popitem(last=False)
                    self.held -= len(old_key) + len(old_text)
        return text

    def __len__(self) -> int:
        return len(self._texts)

    def cache_clear(self) -> None:
        with self._lock:
            self._texts.clear()
            self.held = 0


_grammar_text = _TextCache(size=512, chars=12_000_000)


def _build_grammar_text(key: str) -> str:
    kind, spec, no_whitespace, no_extra_props, whitespace = json.loads(key)
    llg = import_llguidance()
    matcher = llg.LLMatcher
    field = f"structured_outputs.{kind}"
    if kind == "json" and isinstance(spec, bool):  # JSON Schema's boolean schemas
        if not spec:
            raise ValueError(f"{field} is invalid: the schema `false` matches no JSON value")
        spec = {}  # `true`: any JSON value (llguidance takes options with an object schema only)
    _check_work(kind, spec, field)
    try:
        if kind in ("json", "json_object"):
            if no_extra_props and isinstance(spec, dict):
                spec = _close_objects(spec)
            options = _json_options(no_whitespace, whitespace)
            grammar = matcher.grammar_from_json_schema(spec, overrides=options)
        elif kind == "regex":
            grammar = matcher.grammar_from_regex(spec)
        elif kind == "choice":  # one lexeme: the parser follows at most 2000 alternatives
            choices = " | ".join(json.dumps(c) for c in spec)
            grammar = matcher.grammar_from_lark(f"start: CHOICE\nCHOICE: {choices}")
        elif kind == "structural_tag":
            options = _json_options(no_whitespace, whitespace)
            grammar = matcher.grammar_from_lark(structural_tag_lark(spec, field, options))
        else:  # GBNF / EBNF or Lark
            grammar = llg.grammar_from("grammar", spec)
    except (ValueError, TypeError, RuntimeError) as e:
        why = str(e)  # (a structural tag's errors name their path already)
        raise ValueError(why if why.startswith(field) else f"{field} is invalid: {why}") from None
    error = matcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"{field} is invalid: {error.strip()}")
    if kind == "json" and '"$ref"' in key:  # no $ref, no loop (the walk costs ~4 us a node)
        check_ref_cycles(spec, field)  # llguidance builds a loop, then fails to fill a mask
    if kind == "grammar":  # repeats nested through rules (before llguidance builds them)
        check_rule_repeats(grammar, field, gbnf_names(spec))
        # a rule with no way out: llguidance admits it, then ends quietly
        check_grammar_rules(grammar, spec, field)
    return grammar


def _check_work(kind: str, spec: Any, field: str) -> None:
    """The bounds llguidance does not apply itself (work_bounds.py), before it runs."""
    if kind in ("regex", "grammar"):  # (Lark / GBNF: `x{n}` repeats a rule or a terminal)
        check_regex(spec, field)
    elif kind == "json":
        check_spec(spec, field)
    elif kind == "structural_tag":
        with contextlib.suppress(ValueError, RecursionError):  # structural_tag_lark says why
            spec = json.loads(spec) if isinstance(spec, str) else spec
        check_structural_tag(spec, field)


def _json_options(no_whitespace: bool, whitespace: str | None) -> dict[str, Any]:
    """llguidance's JSON options for the spacing the parameters ask for."""
    if whitespace is not None:  # whitespace where JSON allows it, matching the pattern
        return {"whitespace_flexible": True, "whitespace_pattern": whitespace}
    if no_whitespace:  # no whitespace at all: {"a":1,"b":[2,3]}
        return {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
    # json.dumps spacing: {"a": 1, "b": [2, 3]}
    return {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _close_objects(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on every object that does not say."""
    if isinstance(schema, list):
        return [_close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _close_objects(v) for k, v in schema.items()}
    if out.get("type") == "object" or "properties" in out:
        out.setdefault("additionalProperties", False)
    return out
