"""LoRARequest equality and hashing go by lora_name, as vLLM's (vllm/lora/request.py): the same
adapter name is the same adapter whatever its id or path; the engine keys loaded adapters by
lora_int_id, so serving is unaffected."""

from __future__ import annotations

from paged_engine import LoRARequest


def test_equal_and_hashed_by_name() -> None:
    a = LoRARequest("sql", 1, "/adapters/sql")
    assert a == LoRARequest("sql", 2, "/elsewhere/sql")  # same name, another id and path
    assert hash(a) == hash(LoRARequest("sql", 2, "/elsewhere/sql")) == hash("sql")
    assert a != LoRARequest("chat", 1, "/adapters/sql")  # same id, another name
    assert a != "sql" and a != ("sql", 1)
    by_name = {a: "first", LoRARequest("sql", 7, "/x"): "second"}
    assert list(by_name.values()) == ["second"]  # one key per name
    assert len({a, LoRARequest("chat", 1, "/adapters/sql")}) == 2
