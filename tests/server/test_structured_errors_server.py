"""A structured-output grammar that fails only when the engine compiles it (after the request
was accepted) fails that request with a 400 naming the field, not a 200 with empty text; the
engine client over a real engine on a tiny llama, in this process. (The 400s of grammars
refused on add, with `param` the field the client used: test_structured_server.py.)"""

from __future__ import annotations

import re
import time

import pytest

from paged_server.engine_client import EngineClient
from paged_server.errors import APIError

pytest.importorskip("llguidance")


def test_a_grammar_failing_to_compile_is_a_400_and_others_finish(tiny_model, monkeypatch):
    from test_structured_validation import fail_compiling_bombs

    from paged_engine import LLMEngine, StructuredOutputsParams

    engine = LLMEngine(model=tiny_model, dtype="float32", max_model_len=128)
    fail_compiling_bombs(engine.engine_core.structured, monkeypatch)
    client = EngineClient(engine)
    client.start()
    try:
        groups = {}
        for name, regex in (("bad", "bomb"), ("good", "[ab]+")):
            so = StructuredOutputsParams(regex=regex)
            params = client.make_params(
                {"max_tokens": 3, "temperature": 0.0, "structured_outputs": so},
                beam=False,
                stream=False,
            )
            groups[name] = client.add([name], [{"prompt_token_ids": [1, 5]}], params)
        with pytest.raises(APIError) as e:
            deadline = time.monotonic() + 10
            while not groups["bad"].done and time.monotonic() < deadline:
                groups["bad"].next(0.1)
        assert e.value.status == 400
        assert "structured_outputs.regex: grammar rejected" in e.value.message
        good = groups["good"]
        deadline = time.monotonic() + 10
        last = None
        while not good.done and time.monotonic() < deadline:
            for _, out in good.next(0.1):
                last = out
        assert last is not None and last.finished
        assert re.fullmatch("[ab]+", last.outputs[0].text)
    finally:
        client.stop()
        engine.shutdown()
