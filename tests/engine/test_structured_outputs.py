"""Structured outputs (constrained decoding) in the engine: every output parses and validates.

Schemas of 12 shapes (benchmarks/structured_schemas.py) on a tiny random-weight model, in sync
and async scheduling, with n > 1, streaming, stop strings, max_tokens, preemption and prefix
caching; regex, choice, grammar and json_object; invalid constraints raise ValueError naming the
field and the engine keeps serving. The default model (SmolLM2) runs in
test_structured_default_model.py.
"""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest

from benchmarks.structured_schemas import SCHEMAS
from paged_engine import (
    LLM,
    GuidedDecodingParams,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

pytest.importorskip("llguidance")


def _llm(path, **kw) -> LLM:
    kw.setdefault("max_model_len", 512)
    return LLM(model=str(path), dtype="float32", **kw)


@pytest.fixture(scope="module", params=["sync", "async"])
def llm(request, tiny_llama_dir) -> LLM:
    return _llm(tiny_llama_dir, async_scheduling=request.param == "async")


def _json_params(schema, **kw) -> SamplingParams:
    kw.setdefault("temperature", 0.0)
    kw.setdefault("max_tokens", 300)
    so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    return SamplingParams(structured_outputs=so, **kw)


def _valid(text: str, schema) -> None:
    jsonschema.validate(json.loads(text), schema)


def test_every_schema_validates(llm):
    names = list(SCHEMAS)
    params = [_json_params(SCHEMAS[n][0]) for n in names]
    outs = llm.generate(["Answer in JSON:"] * len(names), params, use_tqdm=False)
    for name, out in zip(names, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (name, c.text)
        _valid(c.text, SCHEMAS[name][0])


def test_properties_come_in_the_schemas_order(llm):
    """An object's keys are written in its schema's `properties` order (as vLLM writes them),
    not sorted: {"zeta", "alpha"} stays zeta first."""
    schema = {
        "type": "object",
        "properties": {"zeta": {"enum": [1, 2]}, "alpha": {"enum": ["x", "y"]}},
        "required": ["zeta", "alpha"],
        "additionalProperties": False,
    }
    (out,) = llm.generate(["x"], _json_params(schema), use_tqdm=False)
    assert list(json.loads(out.outputs[0].text)) == ["zeta", "alpha"], out.outputs[0].text


def test_sampled_n_and_seeds_validate(llm):
    schema = SCHEMAS["array_of_objects"][0]
    params = _json_params(schema, temperature=1.0, seed=3, n=3)
    out = llm.generate(["list:"], params, use_tqdm=False)[0]
    assert len(out.outputs) == 3
    for c in out.outputs:
        _valid(c.text, schema)
    again = llm.generate(["list:"], params, use_tqdm=False)[0]
    assert [c.text for c in again.outputs] == [c.text for c in out.outputs]


def test_regex_choice_grammar_json_object(llm):
    cases = [
        StructuredOutputsParams(regex=r"[a-z]{3}-[0-9]{2}"),
        StructuredOutputsParams(choice=["yes", "no", "maybe"]),
        StructuredOutputsParams(grammar='root ::= "ok " ("red" | "green") "!"'),
        StructuredOutputsParams(grammar='start: "n=" /[0-9]{1,3}/'),
        GuidedDecodingParams(choice=["alpha", "beta"]),
    ]
    params = [SamplingParams(temperature=0.7, seed=i, max_tokens=200, structured_outputs=c)
              for i, c in enumerate(cases)]  # fmt: skip
    outs = llm.generate(["x"] * len(cases), params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    assert all(o.outputs[0].finish_reason == "stop" for o in outs), texts
    assert re.fullmatch(r"[a-z]{3}-[0-9]{2}", texts[0])
    assert texts[1] in ("yes", "no", "maybe")
    assert re.fullmatch(r"ok (red|green)!", texts[2])
    assert re.fullmatch(r"n=[0-9]{1,3}", texts[3])
    assert texts[4] in ("alpha", "beta")


def test_json_object_starts_an_object(llm):
    """A random model rarely closes an unconstrained string (the default model's test checks
    whole objects): here only the start and the kind of value."""
    so = StructuredOutputsParams(json_object=True)
    params = SamplingParams(temperature=0, max_tokens=4, structured_outputs=so)
    text = llm.generate(["x"], params, use_tqdm=False)[0].outputs[0].text
    assert text.lstrip().startswith("{")


def test_streaming_deltas_join_to_valid_json(tiny_llama_dir):
    llm = _llm(tiny_llama_dir)
    engine = llm.llm_engine
    schema = SCHEMAS["nested_object"][0]
    params = _json_params(schema, output_kind=RequestOutputKind.DELTA)
    engine.add_request("s", "stream:", params)
    text, last = "", None
    while engine.has_unfinished_requests():
        for out in engine.step():
            text += out.outputs[0].text
            last = out
    assert last is not None and last.finished and last.outputs[0].finish_reason == "stop"
    _valid(text, schema)


def test_max_tokens_truncates_with_length(llm):
    schema = SCHEMAS["const_and_refs"][0]
    out = llm.generate(["x"], _json_params(schema, max_tokens=8), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 8
    with pytest.raises(ValueError):
        json.loads(out.text)


def test_stop_string_inside_constrained_output(llm):
    schema = SCHEMAS["tool_call"][0]
    full = llm.generate(["x"], _json_params(schema), use_tqdm=False)[0].outputs[0].text
    out = llm.generate(["x"], _json_params(schema, stop=['"arguments"', '"name"']),
                       use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert out.finish_reason == "stop" and out.stop_reason in ('"arguments"', '"name"')
    assert full.startswith(out.text) and len(out.text) < len(full)


def test_preemption_and_prefix_cache_keep_outputs(tiny_llama_dir):
    names = list(SCHEMAS)
    prompts = [f"Record {i} in JSON, please, with care:" for i in range(len(names))]
    params = [_json_params(SCHEMAS[n][0]) for n in names]
    expected = _llm(tiny_llama_dir, max_model_len=160).generate(prompts, params, use_tqdm=False)
    tight = _llm(
        tiny_llama_dir,
        max_model_len=160,
        num_gpu_blocks_override=24,
        block_size=8,
        max_num_batched_tokens=32,
    )
    # Compiled before the run: a request waits for its grammar, so on a loaded machine (slow
    # compiles, one after another) they would start apart and never crowd the pool.
    structured = tight.llm_engine.engine_core.structured
    for p in params:
        structured.new_constraint(p.structured_outputs, []).grammar.result()
    got = tight.generate(prompts, params, use_tqdm=False)
    assert tight.get_stats().num_preemptions > 0
    again = tight.generate(prompts, params, use_tqdm=False)  # prompts now prefix-cached
    assert tight.get_stats().prefix_cache_hits > 0
    for e, g, a in zip(expected, got, again):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        assert a.outputs[0].token_ids == e.outputs[0].token_ids


@pytest.mark.parametrize(
    ("so", "field"),
    [
        (StructuredOutputsParams(json={"type": "nonsense"}), "structured_outputs.json"),
        (StructuredOutputsParams(regex="a[b"), "structured_outputs.regex"),
        (StructuredOutputsParams(grammar="root ::= ("), "structured_outputs.grammar"),
    ],
)
def test_invalid_constraint_is_a_value_error_and_engine_serves_on(llm, so, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        llm.generate(["x"], SamplingParams(structured_outputs=so), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate(["x"], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) >= 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one of"),
        ({"regex": "a", "choice": ["a"]}, "exactly one of"),
        ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
        ({"json": "[1, 2]"}, "structured_outputs.json must be a JSON schema"),
        ({"choice": []}, "structured_outputs.choice"),
        ({"choice": ["a", 3]}, "structured_outputs.choice"),
        ({"regex": ""}, "structured_outputs.regex"),
        ({"json_object": "yes"}, "structured_outputs.json_object"),
        ({"regex": "a", "structural_tag": "{}"}, "exactly one of"),
        ({"structural_tag": 3}, "structured_outputs.structural_tag must be JSON text or an object"),
    ],
)
def test_params_shape_errors(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        StructuredOutputsParams(**kwargs)


def test_beam_search_with_constraint_is_refused():
    so = StructuredOutputsParams(choice=["a"])
    with pytest.raises(
        ValueError, match="structured_outputs is not supported with use_beam_search"
    ):
        SamplingParams(use_beam_search=True, n=2, temperature=0, structured_outputs=so)


def test_structured_outputs_from_dict():
    p = SamplingParams(structured_outputs={"regex": "[0-9]+"})
    assert isinstance(p.structured_outputs, StructuredOutputsParams)
    with pytest.raises(ValueError, match=r"unknown fields \['jsn'\]"):
        SamplingParams(structured_outputs={"jsn": {}})


def test_compiles_once_per_schema_off_the_step_thread(tiny_llama_dir, monkeypatch):
    llm = _llm(tiny_llama_dir)
    manager = llm.llm_engine.engine_core.structured
    threads: list[str] = []
    compile_now = manager._compile_now

    def spy(text):
        threads.append(threading.current_thread().name)
        return compile_now(text)

    monkeypatch.setattr(manager, "_compile_now", spy)
    schema = SCHEMAS["enum"][0]
    llm.generate(["a", "b", "c"], _json_params(schema), use_tqdm=False)
    llm.generate(["d"], _json_params(schema), use_tqdm=False)
    assert len(threads) == 1 and threads[0] != threading.current_thread().name


def test_missing_extra_names_it(monkeypatch):
    import sys

    from paged_engine.structured_output import grammar

    grammar._grammar_text.cache_clear()
    monkeypatch.setitem(sys.modules, "llguidance", None)
    with pytest.raises(ImportError, match=re.escape("pip install 'paged-engine[structured]'")):
        grammar.grammar_text(StructuredOutputsParams(regex="x+"))
    grammar._grammar_text.cache_clear()


def test_a_tokenizer_larger_than_the_vocabulary(tiny_model_factory):
    """A tokenizer holding added tokens past the model's vocab_size (the tiny Qwen2's has 513
    ids for 512 rows): masks cover every id the tokenizer has, the sampler reads the model's."""
    path = tiny_model_factory("qwen2")
    llm = _llm(path)
    assert len(llm.get_tokenizer()) > llm.llm_engine.vocab_size
    regex = SamplingParams(
        temperature=0,
        max_tokens=20,
        structured_outputs=StructuredOutputsParams(regex=r"[a-z]{3}-[0-9]{2}"),
    )
    (out,) = llm.generate(["hi"], regex, use_tqdm=False)
    assert re.fullmatch(r"[a-z]{3}-[0-9]{2}", out.outputs[0].text)
    assert out.outputs[0].finish_reason == "stop"
