"""Engine structures keyed by request content stay bounded in memory, not only in count
(the server's: tests/server/test_unbounded_growth.py).

The compiled-grammar cache (`StructuredOutputManager._cache`) held 256 entries whatever their
size: a compiled grammar takes ~40 bytes of native memory per character of its text (19 MB for
a 500k-character JSON schema), so 256 large schemas from clients held ~5 GB. It is now bounded
by the characters of grammar text it keeps too; here that bound is lowered so that a few dozen
distinct ~15k-character schemas pass it.
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

pytest.importorskip("llguidance")

from paged_engine.structured_output import grammar
from paged_engine.structured_output import manager as manager_module
from paged_engine.structured_output.manager import StructuredOutputManager
from paged_engine.structured_output.params import StructuredOutputsParams

BOUND = 200_000  # characters of grammar text kept (the test's; the module's is 12M)


def _schema(i: int) -> dict:
    """A distinct JSON schema of ~15k characters (its grammar text about as long)."""
    props = {
        f"key_{i}_{j}_" + "x" * 40: {"type": "string", "pattern": f"[a-z]{{1,{j % 9 + 1}}}"}
        for j in range(150)
    }
    return {"type": "object", "properties": props}


def test_compiled_grammars_kept_are_bounded_by_their_text(tiny_llama_dir, monkeypatch) -> None:
    monkeypatch.setattr(manager_module, "_CACHE_CHARS", BOUND, raising=False)
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    manager = StructuredOutputManager(tok, len(tok), [tok.eos_token_id])
    try:
        kept_chars = []
        for i in range(40):  # ~600k characters in all, 3x the bound
            manager.new_constraint(StructuredOutputsParams(json=_schema(i)), [])
            # what the cache holds, measured apart from its own bookkeeping
            kept_chars.append(sum(len(grammar._grammar_text(k)) for k in manager._cache))
        newest = len(grammar._grammar_text(StructuredOutputsParams(json=_schema(39)).key()))
        assert newest > 10_000
        assert max(kept_chars) <= BOUND, kept_chars[-3:]
        assert len(manager._cache) >= BOUND // (2 * newest)  # the newest are kept, not none
        # the newest schema is still a cache hit: the same future, no second compile
        params = StructuredOutputsParams(json=_schema(39))
        assert manager._compile(params) is manager._cache[params.key()]
        # an entry alone past the bound is kept (the request compiling it shares it)
        monkeypatch.setattr(manager_module, "_CACHE_CHARS", 1_000)
        big = StructuredOutputsParams(json=_schema(1000))
        fut = manager._compile(big)
        assert list(manager._cache) == [big.key()] and manager._cache[big.key()] is fut
        assert manager.cached_chars == len(grammar._grammar_text(big.key()))
        fut.result(timeout=60)
    finally:
        manager.shutdown()


def test_grammar_texts_kept_are_bounded_by_their_size(monkeypatch) -> None:
    """The text cache in front of the compile (`grammar._grammar_text`, which the server's
    validation and the engine share) held 512 entries whatever their size; each keeps its key
    (the whole constraint) and its text."""
    builds: list[str] = []
    build = grammar._build_grammar_text

    def counted(key: str) -> str:
        builds.append(key)
        return build(key)

    monkeypatch.setattr(grammar, "_build_grammar_text", counted)
    monkeypatch.setattr(grammar._grammar_text, "chars", BOUND, raising=False)
    grammar._grammar_text.cache_clear()
    try:
        keys = [StructuredOutputsParams(json=_schema(i)).key() for i in range(40)]
        for key in keys:  # ~1.2M characters of keys and texts in all, 6x the bound
            grammar._grammar_text(key)
        assert len(builds) == 40
        per_entry = len(keys[-1]) + len(grammar._grammar_text(keys[-1]))
        assert len(builds) == 40  # the newest is kept: a hit
        grammar._grammar_text(keys[0])  # the oldest was dropped: built again
        assert len(builds) == 41
        assert len(grammar._grammar_text) * per_entry <= BOUND + per_entry
        assert grammar._grammar_text.held <= BOUND
    finally:
        grammar._grammar_text.cache_clear()
