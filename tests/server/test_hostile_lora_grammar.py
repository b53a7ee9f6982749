"""Hostile grammars over HTTP: the server checks a request's grammar on its HTTP thread
(structured_request.check_structured), so a grammar that crashed llguidance crashed the server.

- A JSON schema whose `$defs` chain 2000 deep, or a Lark grammar chaining 4000 rules, killed
  the server process with SIGSEGV (llguidance recursed past the HTTP thread's 8 MB stack): both
  are served now, and the server goes on serving.
- A grammar past MAX_GRAMMAR_CHARS, or a GBNF grammar past MAX_GBNF_RULES rules, is a 400
  naming the field at once (1000 rules took ~0.5 s of the HTTP thread; 50k rules never ended).
LoRA loading, bad adapters and KV-transfer files: tests/engine/test_hostile_lora_grammar_kv.py.
"""

from __future__ import annotations

import time

import pytest
from server_proc import ServerProc

from paged_engine.structured_output.grammar import MAX_GBNF_RULES, MAX_GRAMMAR_CHARS

pytest.importorskip("llguidance")

CHAT = [{"role": "user", "content": "Hi"}]


def _defs_chain(n: int) -> dict:
    defs = {
        f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}}
        for i in range(n)
    }
    return {"$defs": {**defs, f"d{n}": {"type": "string"}}, "$ref": "#/$defs/d0"}


def _lark_chain(n: int) -> str:
    return "\n".join(["start: r0", *(f"r{i}: r{i + 1}" for i in range(n)), f'r{n}: "y"'])


def _gbnf_rules(n: int) -> str:
    rules = [f'r{i} ::= "x" r{i + 1}' for i in range(1, n)]
    return "\n".join(["root ::= r1", *rules, f'r{n} ::= "y"'])  # n + 1 rules


def _chat(server: ServerProc, extra: dict) -> tuple[int, dict]:
    body = {"messages": CHAT, "max_tokens": 2, **extra}
    status, _, payload = server.request("POST", "/v1/chat/completions", body)
    return status, payload


@pytest.mark.parametrize(
    "extra",
    [
        {"response_format": {"type": "json_schema", "json_schema": {"name": "deep",
                                                                   "schema": _defs_chain(2000)}}},
        {"structured_outputs": {"grammar": _lark_chain(4000)}},
    ],
    ids=["schema-defs-chain", "lark-rule-chain"],
)  # fmt: skip
def test_deep_rule_chains_do_not_kill_the_server(fake_server: ServerProc, extra: dict) -> None:
    status, payload = _chat(fake_server, extra)
    assert fake_server.proc.poll() is None, "".join(fake_server.lines[-20:])
    assert status == 200, payload
    assert _chat(fake_server, {})[0] == 200


@pytest.mark.parametrize(
    ("grammar", "fragment"),
    [
        ('start: "a"\n' + "// pad\n" * (MAX_GRAMMAR_CHARS // 7), "characters"),
        (_gbnf_rules(MAX_GBNF_RULES + 1), "GBNF rules"),
    ],
    ids=["too-long", "too-many-gbnf-rules"],
)
def test_a_grammar_past_the_bounds_is_a_400_at_once(
    fake_server: ServerProc, grammar: str, fragment: str
) -> None:
    t0 = time.monotonic()
    status, payload = _chat(fake_server, {"structured_outputs": {"grammar": grammar}})
    assert status == 400 and payload["error"]["param"] == "structured_outputs", payload
    # at once: a 50k-rule GBNF ran for minutes before the bound (wall time: loose for load)
    assert fragment in payload["error"]["message"] and time.monotonic() - t0 < 10.0
