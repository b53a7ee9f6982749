"""Sampling defaults from the model's generation_config.json (vLLM's --generation-config): which
fields are read, "vllm" and path settings, the override, clear errors, and `LLM.generate`
without sampling_params running with them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from paged_engine import LLM, EngineConfig, SamplingParams
from paged_engine.engine.generation_defaults import generation_defaults


def _dir(tmp_path: Path, **fields) -> Path:
    (tmp_path / "generation_config.json").write_text(json.dumps(fields))
    return tmp_path


def test_reads_the_sampling_fields_only(tmp_path):
    model = _dir(
        tmp_path,
        temperature=0.6,
        top_p=0.95,
        top_k=20,
        min_p=0.0,
        repetition_penalty=1.1,
        max_new_tokens=64,
        do_sample=True,  # not a SamplingParams field: ignored, as in vLLM
        eos_token_id=[1, 2],
        length_penalty=None,
    )
    assert generation_defaults(model) == {
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "min_p": 0.0,
        "repetition_penalty": 1.1,
        "max_tokens": 64,
    }
    assert generation_defaults(model, "vllm") == {}
    assert generation_defaults(None) == {}  # a GGUF file carries none
    assert generation_defaults(tmp_path / "missing") == {}


def test_path_setting_and_override(tmp_path):
    other = _dir(tmp_path, top_k=5)
    assert generation_defaults(None, str(other)) == {"top_k": 5}
    assert generation_defaults(None, str(other / "generation_config.json")) == {"top_k": 5}
    # the override goes on top of any setting; None drops a file's value
    override = {"temperature": 0.2, "top_k": None, "max_new_tokens": 8}
    assert generation_defaults(None, str(other), override) == {"temperature": 0.2, "max_tokens": 8}
    assert generation_defaults(None, "vllm", {"top_p": 0.5}) == {"top_p": 0.5}


def test_bad_settings_raise_naming_them(tmp_path):
    with pytest.raises(ValueError, match="generation_config='nowhere'"):
        generation_defaults(None, "nowhere")
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['tmp'\]"):
        generation_defaults(None, "vllm", {"tmp": 1.0})
    with pytest.raises(ValueError, match="override_generation_config"):
        EngineConfig(override_generation_config=[("temperature", 1)])  # type: ignore[arg-type]
    bad = _dir(tmp_path, top_p=0.0)
    with pytest.raises(ValueError, match=r"top_p.*generation_config='vllm'"):
        generation_defaults(bad)
    assert generation_defaults(bad, "vllm") == {}  # the way out the message names
    (tmp_path / "generation_config.json").write_text("{broken")  # auto: warns, no defaults
    assert generation_defaults(tmp_path) == {}


@pytest.fixture(scope="module")
def recommending_llm(tiny_model_factory, tmp_path_factory):
    """A tiny llama whose generation_config.json recommends greedy decoding of 5 tokens, with
    the override shortening that to 3."""
    path = tmp_path_factory.mktemp("gen-defaults") / "llama"
    shutil.copytree(tiny_model_factory("llama"), path)
    gen = json.loads((path / "generation_config.json").read_text())
    gen.update(temperature=0.0, max_new_tokens=5, top_k=7)
    (path / "generation_config.json").write_text(json.dumps(gen))
    return LLM(str(path), override_generation_config={"max_new_tokens": 3})


def test_generate_without_params_uses_the_model_defaults(recommending_llm):
    llm = recommending_llm
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.max_tokens) == (0.0, 3)
    assert llm.get_default_sampling_params() is not params  # a fresh object each call
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    got = llm.generate(prompts, use_tqdm=False)
    want = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert all(len(o.outputs[0].token_ids) == 3 for o in got)
    chat = llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)
    assert len(chat[0].outputs[0].token_ids) == 3
