"""Broken or hostile tokenizer-side files of a checkpoint (tokenizer_config.json,
special_tokens_map.json, generation_config.json): a ValueError naming the file and field at
engine start, or a clean refusal of the one request they would break; never a bare
TypeError, a failed step, or an eos id silently dropped."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from paged_engine import LLM, SamplingParams

_GREEDY = SamplingParams(temperature=0, max_tokens=4)


@pytest.fixture
def model_dir(tiny_model_factory, tmp_path) -> Path:
    """A copy of the tiny Llama directory, free to break."""
    return Path(shutil.copytree(tiny_model_factory("llama"), tmp_path / "model"))


def _update(path: Path, **fields) -> None:
    data = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**data, **fields}))


def _llm(model_dir: Path) -> LLM:
    return LLM(model=str(model_dir), max_model_len=64)


_TC, _STM, _GEN = "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"

# file, fields written into it, what the ValueError says
_REFUSED_AT_START = {
    "generation eos a string": (_GEN, {"eos_token_id": "x"}, "eos_token_id must be a token id"),
    "generation eos list holding a string": (
        _GEN,
        {"eos_token_id": [1, "x"]},
        "eos_token_id must be a token id",
    ),
    "generation eos list holding a bool": (
        _GEN,
        {"eos_token_id": [1, True]},
        "eos_token_id must be a token id",
    ),
    "added token content an int": (
        _TC,
        {"added_tokens_decoder": {"300": {"content": 5, "special": True}}},
        r"added_tokens_decoder\['300'\] must be an object with a string 'content'",
    ),
    "added token id not a number": (
        _TC,
        {"added_tokens_decoder": {"abc": {"content": "<q>", "special": True}}},
        "added_tokens_decoder key 'abc' is not a token id",
    ),
    "eos_token an int": (_TC, {"eos_token": 5}, "eos_token must be a string"),
    "special_tokens_map eos an int": (_STM, {"eos_token": 7}, "eos_token must be a string"),
    "special_tokens_map pad a list": (_STM, {"pad_token": ["x"]}, "pad_token must be a string"),
    "model_max_length a string": (_TC, {"model_max_length": "abc"}, "model_max_length must be"),
    "chat_template an int": (_TC, {"chat_template": 5}, "chat_template must be a template"),
    "chat_template a list of ints": (_TC, {"chat_template": [1, 2]}, "chat_template must be"),
}


@pytest.mark.parametrize("name, fields, match", _REFUSED_AT_START.values(), ids=_REFUSED_AT_START)
def test_refused_at_start_naming_file_and_field(model_dir, name, fields, match):
    _update(model_dir / name, **fields)
    with pytest.raises(ValueError, match=match) as err:
        _llm(model_dir)
    assert str(model_dir / name) in str(err.value)


def test_special_token_dict_transformers_refuses_is_a_value_error(model_dir):
    """transformers 5 takes no plain dict for a special token in tokenizer_config.json (a
    TypeError of its own): a ValueError naming the directory."""
    _update(model_dir / _TC, eos_token={"content": "<|eos|>"})
    with pytest.raises(ValueError, match="eos_token") as err:
        _llm(model_dir)
    assert str(model_dir) in str(err.value)


@pytest.mark.parametrize("eos", [1, [1], [], None], ids=["int", "list", "empty", "null"])
def test_valid_generation_eos_ids_load(model_dir, eos):
    _update(model_dir / _GEN, eos_token_id=eos)
    (out,) = _llm(model_dir).generate(["hello"], _GREEDY, use_tqdm=False)
    assert len(out.outputs[0].token_ids) >= 1


@pytest.mark.parametrize(
    "added",
    [
        {"512": {"content": "<zz>", "special": False}},  # in added_tokens_decoder, past the model
        None,  # eos_token naming a token the vocab lacks: transformers appends it as id 512
    ],
    ids=["added token past vocab", "eos_token the vocab lacks"],
)
def test_prompt_tokens_past_the_model_vocab_refused_per_request(model_dir, added):
    """A tokenizer larger than config.json's vocab_size loads (real ones are); a prompt that
    uses an id the model has no embedding row for is refused alone, before any step."""
    if added is None:
        _update(model_dir / _TC, eos_token="<zz>")
    else:
        _update(model_dir / _TC, added_tokens_decoder=added)
    llm = _llm(model_dir)
    assert len(llm.get_tokenizer()) > llm.llm_engine.vocab_size
    with pytest.raises(ValueError, match=re.escape("ids [512] past the model's vocabulary")):
        llm.generate(["hi <zz> there"], _GREEDY, use_tqdm=False)
    (out,) = llm.generate(["hi there"], _GREEDY, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4


def _named_templates(model_dir: Path, names: list[str]) -> None:
    (model_dir / "chat_template.jinja").unlink(missing_ok=True)  # the file would win
    templates = [{"name": n, "template": f"{n}:{{{{ messages[0]['content'] }}}}"} for n in names]
    _update(model_dir / _TC, chat_template=templates)


def test_named_chat_templates_use_the_default(model_dir):
    """tokenizer_config.json's list of named templates (a dict once loaded): "default" serves
    LLM.chat, as transformers' apply_chat_template picks it."""
    _named_templates(model_dir, ["default", "tool_use"])
    llm = _llm(model_dir)
    (out,) = llm.chat([{"role": "user", "content": "hi"}], _GREEDY, use_tqdm=False)
    assert out.prompt == "default:hi"


def test_named_chat_templates_without_a_default_refused_per_request(model_dir):
    _named_templates(model_dir, ["tool_use", "rag"])
    llm = _llm(model_dir)
    with pytest.raises(ValueError, match="multiple chat templates with no default"):
        llm.chat([{"role": "user", "content": "hi"}], _GREEDY, use_tqdm=False)
    (out,) = llm.generate(["hi"], _GREEDY, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4
