"""Structured-output grammars are validated when the request is added (vLLM's frontend check,
`validate_guidance_grammar`): llguidance's own validation, and for a grammar naming special
tokens, against the engine's tokenizer; a rejected one is a ValueError naming the field, nothing
is queued and the engine serves on. A grammar that still fails to compile after admission fails
its request (`RequestFailedError`, its ValueError the cause), never a silent empty "abort"
output, and the other requests finish."""

from __future__ import annotations

import re
import threading
from concurrent.futures import wait

import pytest

from paged_engine import LLM, SamplingParams, StructuredOutputsParams
from paged_engine.core.step_isolation import RequestFailedError

pytest.importorskip("llguidance")


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(model=str(tiny_llama_dir), dtype="float32", max_model_len=128)


def _params(max_tokens: int = 4, **so) -> SamplingParams:
    so_params = StructuredOutputsParams(**so)
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=so_params)


def fail_compiling_bombs(manager, monkeypatch) -> None:
    """The structured-output `manager` fails to compile any grammar holding "bomb" (ValueError
    "grammar rejected for this tokenizer: too big"), as only compiling can reveal; it compiles
    the others as before."""
    compile_now = manager._compile_now

    def compile_or_fail(text):
        if "bomb" in text:
            raise ValueError("grammar rejected for this tokenizer: too big")
        return compile_now(text)

    monkeypatch.setattr(manager, "_compile_now", compile_or_fail)


def _serves_on(llm: LLM) -> None:
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and engine.engine_core.num_compiling == 0
    out = llm.generate(["x"], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 2


@pytest.mark.parametrize(
    ("so", "message"),
    [
        # only the tokenizer can say: llguidance's tokenizer-free validation passes them
        ({"grammar": 'start: <|nonexistent|> "a"'}, "unknown special token"),
        ({"grammar": 'start: "a" <think>'}, "unknown special token"),
        ({"grammar": "start: <[5000]>"}, "5000"),  # the tiny vocabulary has 512 ids
        # syntax, caught without the tokenizer
        ({"grammar": 'start: ("a"'}, "structured_outputs.grammar is invalid"),
        ({"regex": "(ab"}, "structured_outputs.regex is invalid"),
        ({"json": {"type": "integer", "minimum": 5, "maximum": 1}}, "Unsatisfiable"),
    ],
)
def test_rejected_on_add_naming_the_field(llm, so, message):
    field = f"structured_outputs.{next(iter(so))}"
    with pytest.raises(ValueError, match=re.escape(field)) as e:
        llm.generate(["x", "y"], _params(**so), use_tqdm=False)
    assert message in str(e.value)
    _serves_on(llm)


def test_special_tokens_the_tokenizer_has_are_accepted(llm):
    """Token ids in range and a special token the tokenizer has pass the tokenizer check."""
    outs = llm.generate(["x"], _params(grammar="start: <[7]> <[9]> <|pad|>"), use_tqdm=False)
    pad = llm.get_tokenizer().convert_tokens_to_ids("<|pad|>")
    assert outs[0].outputs[0].token_ids[:3] == [7, 9, pad]


def test_compile_failure_after_admission_fails_that_request_only(llm, monkeypatch):
    """What validation cannot catch fails at compile time: step() raises RequestFailedError
    naming the request (the server answers 400 with the cause); the other request finishes."""
    fail_compiling_bombs(llm.llm_engine.engine_core.structured, monkeypatch)
    engine = llm.llm_engine
    engine.add_request("bad1", "x", _params(regex="bomb1"), final_only=True)
    engine.add_request("good", "x", _params(max_tokens=3, regex="[ab]+"), final_only=True)
    engine.add_request("bad2", "x", _params(grammar='start: "bomb2"'), final_only=True)
    wait([r.constraint.grammar for r in engine.engine_core._compiling])  # both fail at once
    finished, failures = {}, []
    while engine.has_unfinished_requests():
        try:
            finished.update({o.request_id: o for o in engine.step() if o.finished})
        except RequestFailedError as e:
            failures.append(e)
    assert [f.request_ids for f in failures] == [["bad1"], ["bad2"]]  # each with its own cause
    assert all(isinstance(f.cause, ValueError) for f in failures)
    assert str(failures[0].cause).startswith("structured_outputs.regex: grammar rejected")
    assert str(failures[1].cause).startswith("structured_outputs.grammar: grammar rejected")
    assert list(finished) == ["good"] and re.fullmatch("[ab]+", finished["good"].outputs[0].text)
    # LLM.generate raises it (the call's other requests are aborted, nothing stays queued)
    with pytest.raises(RequestFailedError, match=r"structured_outputs\.regex"):
        llm.generate(["z"], _params(regex="bomb"), use_tqdm=False)
    _serves_on(llm)


def test_the_backend_is_built_off_the_calling_thread(tiny_llama_dir, monkeypatch):
    """The grammar backend (llguidance's tokenizer, built from a copy of the engine's) is made
    on the compile thread: by `warm_structured_outputs` (paged-server calls it once serving),
    never on the thread that adds requests (the step thread in the server: a 0.3 s copy and a
    ~1 s build stalled every stream at the first constrained request)."""
    import copy

    from paged_engine.structured_output import manager as manager_module

    llm = LLM(model=str(tiny_llama_dir), dtype="float32", max_model_len=128)
    engine = llm.llm_engine
    structured = engine.engine_core.structured
    copied_on: list[str] = []
    deepcopy = copy.deepcopy

    def recorded(x, *a):
        copied_on.append(threading.current_thread().name)
        return deepcopy(x, *a)

    monkeypatch.setattr(manager_module.copy, "deepcopy", recorded)
    engine.warm_structured_outputs()
    structured._thread().submit(lambda: None).result()  # the warm-up ran before it
    assert structured._backend is not None
    assert copied_on and all(name.startswith("paged-grammar") for name in copied_on), copied_on
    outs = llm.generate(["x"], _params(grammar="start: <[7]> <[9]>"), use_tqdm=False)
    assert outs[0].outputs[0].token_ids[:2] == [7, 9]
    assert all(name.startswith("paged-grammar") for name in copied_on), copied_on
    engine.shutdown()
