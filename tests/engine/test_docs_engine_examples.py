"""docs/engine.md does what it says: its main usage examples run, and the names it gives
(`LLM(...)` / `EngineConfig` options and their defaults, `SamplingParams` fields, the keywords
its examples pass) exist, so renaming a parameter or changing a default fails here.

Each example is the doc's fenced python block under its heading, run as written on a tiny
random Llama; only the names of models, adapters and directories a CPU test machine lacks are
replaced (every replaced text must still be in the block, so an edited example is noticed)."""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import inspect
import json
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file

from paged_engine import (
    LLM,
    AsyncEngineArgs,
    EngineConfig,
    LoRARequest,
    PoolingParams,
    SamplingParams,
    StructuredOutputsParams,
)
from paged_engine.testing.lora import write_lora_adapter
from paged_engine.testing.models import write_tiny_classifier

DOC = Path(__file__).resolve().parents[2] / "docs" / "engine.md"


def _doc() -> str:
    return DOC.read_text(encoding="utf-8")


def _python_blocks() -> dict[str, list[str]]:
    """The doc's fenced python blocks by the heading they sit under, in order."""
    blocks: dict[str, list[str]] = {}
    heading, body, inside = "", [], False
    for line in _doc().splitlines():
        stripped = line.strip()
        if not inside and line.startswith("#") and not line.startswith("#!"):
            heading = line.lstrip("#").strip()
        elif stripped == "```python" and not inside:
            inside, body = True, []
        elif stripped == "```" and inside:
            inside = False
            blocks.setdefault(heading, []).append(textwrap.dedent("\n".join(body)))
        elif inside:
            body.append(line)
    return blocks


def _block(heading: str, index: int = 0) -> str:
    blocks = _python_blocks()
    assert heading in blocks, f"docs/engine.md has no python block under {heading!r}"
    return blocks[heading][index]


def _substitute(code: str, replacements: dict[str, str]) -> str:
    """`code` with each text replaced; each must occur, so an edited example is noticed."""
    for old, new in replacements.items():
        assert old in code, f"the example no longer contains {old!r}:\n{code}"
        code = code.replace(old, new)
    return code


# ---------------------------------------------------------------- names and defaults (no model)


def _option_rows() -> dict[str, str]:
    """The Options table: {option: its default column}, `a` / `b` / `c` rows split."""
    lines = _doc().splitlines()
    start = next(i for i, s in enumerate(lines) if s.startswith("## Options"))
    rows: dict[str, str] = {}
    for line in lines[start:]:
        if line.startswith("## Sampling"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        names = re.findall(r"`([a-z_]+)`", cells[0])
        defaults = [d.strip() for d in cells[1].split(" / ")]
        for i, name in enumerate(names):
            rows[name] = defaults[i] if len(defaults) == len(names) else cells[1]
    return rows


def _default_of(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    raise AssertionError(f"EngineConfig.{field.name} has no default")


def test_options_table_names_and_defaults_match_engine_config(monkeypatch) -> None:
    # cpu_kv_cache_gib's default reads these (the suite's conftest sets one)
    monkeypatch.delenv("PAGED_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    rows = _option_rows()
    assert len(rows) > 40, rows  # the table was found and read
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    missing = sorted(set(rows) - set(fields))
    assert not missing, f"options in docs/engine.md that EngineConfig lacks: {missing}"
    wrong = {}
    for name, cell in rows.items():
        literal = cell.strip("`").split(" (")[0].strip()  # "None (auto)" -> "None"
        try:
            doc_default = ast.literal_eval(literal)
        except (ValueError, SyntaxError):
            # prose defaults ("model limit", "max(8192, max_num_seqs)") or bare words ("auto")
            if re.fullmatch(r"[a-z_0-9]+", literal):
                doc_default = literal
            else:
                continue
        code_default = _default_of(fields[name])
        if doc_default != code_default:
            wrong[name] = (cell, code_default)
    assert not wrong, f"docs/engine.md defaults that differ from EngineConfig's: {wrong}"


def test_sampling_params_fields_listed_in_the_doc_exist() -> None:
    text = _doc()
    start = text.index("`SamplingParams` has vLLM's fields:")
    paragraph = text[start : text.index("vLLM's helpers:", start)]
    names = set(re.findall(r"`([a-z][a-z_]*)`", paragraph)) - {"clone"}
    assert len(names) > 30, names
    params = SamplingParams()
    missing = sorted(n for n in names if not hasattr(params, n))
    assert not missing, f"SamplingParams fields docs/engine.md names that do not exist: {missing}"


_CALLEES: dict[str, Any] = {
    "SamplingParams": SamplingParams,
    "PoolingParams": PoolingParams,
    "StructuredOutputsParams": StructuredOutputsParams,
    "LoRARequest": LoRARequest,
}
_ENGINE_CALLEES = ("LLM", "EngineConfig", "AsyncEngineArgs")


def _keywords_in_examples() -> dict[str, set[str]]:
    """{callee: every keyword the doc's python blocks pass to it}."""
    found: dict[str, set[str]] = {}
    for blocks in _python_blocks().values():
        for code in blocks:
            for node in ast.walk(ast.parse(code)):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                    names = {k.arg for k in node.keywords if k.arg is not None}
                    found.setdefault(node.func.id, set()).update(names)
    return found


def test_keywords_the_examples_pass_exist() -> None:
    found = _keywords_in_examples()
    assert {"SamplingParams", "LLM"} <= set(found), found
    for callee, cls in _CALLEES.items():
        accepted = set(inspect.signature(cls).parameters)
        unknown = sorted(found.get(callee, set()) - accepted)
        assert not unknown, f"{callee}(...) keywords in docs/engine.md it does not take: {unknown}"
    # engine options: EngineConfig's fields, and vLLM's names vllm_options.py accepts; an
    # unknown one is a ValueError listing the known options, so a rename fails here
    fields = {f.name for f in dataclasses.fields(EngineConfig)} | {"model"}
    for callee in _ENGINE_CALLEES:
        for name in sorted(found.get(callee, set()) - fields):
            try:
                EngineConfig.from_kwargs(model="unused", **{name: None})
            except ValueError as exc:
                assert "unknown engine option" not in str(exc), (callee, name, exc)


def test_prompt_embeds_beside_a_prompt_text_as_documented(tiny) -> None:
    # the doc said a `prompt` beside `prompt_embeds` is refused; the engine takes it as the
    # output's prompt text (input_processor._prompt_embeds) and refuses ids or media beside
    text = " ".join(_doc().split())
    assert "`prompt_embeds` beside `prompt_token_ids` or `multi_modal_data` in one dict" in text
    assert "kept as the output's `prompt`, never tokenized" in text
    llm = LLM(tiny, enable_prompt_embeds=True, max_model_len=64)
    rows = torch.randn(3, llm.model_config.get_hidden_size())
    out = llm.generate(
        {"prompt_embeds": rows, "prompt": "some text"}, SamplingParams(max_tokens=2), use_tqdm=False
    )
    assert out[0].prompt == "some text" and out[0].prompt_token_ids is None
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate({"prompt_embeds": rows, "prompt_token_ids": [1, 2, 3]}, use_tqdm=False)


# ---------------------------------------------------------------- the examples, run


@pytest.fixture(scope="module")
def tiny(tiny_model_factory) -> str:
    # 4096 positions so the examples' max_model_len=2048 runs as written
    return str(tiny_model_factory("llama", max_position_embeddings=4096))


def _run(code: str, namespace: dict[str, Any]) -> dict[str, Any]:
    exec(compile(code, str(DOC), "exec"), namespace)  # the doc's own example
    return namespace


def test_offline_generation_example(tiny) -> None:
    code = _substitute(
        _block("Offline generation"),
        {'"path/to/hf-model-dir"': repr(tiny), "max_tokens=64": "max_tokens=8"},
    )
    ns = _run(code, {})
    outs = ns["llm"].generate(["x"], ns["params"], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason in ("length", "stop")
    assert ns["out"][0].prompt.endswith("assistant\n")  # the chat template's generation prompt


def test_prompt_embeds_example(tiny) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny)
    ns = _run(
        _block("Prompt embeddings (`prompt_embeds`)"),
        {"path": tiny, "tokenizer": tokenizer, "text": "hello world"},
    )
    out = ns["out"][0]
    assert out.prompt is None and out.prompt_token_ids is None
    assert out.num_prompt_tokens == ns["ids"].shape[1]
    plain = ns["llm"].generate(
        {"prompt_token_ids": ns["ids"][0].tolist()},
        SamplingParams(max_tokens=32),
        use_tqdm=False,
    )[0]
    assert len(out.outputs[0].token_ids) == len(plain.outputs[0].token_ids) == 32


def test_structured_outputs_example(tiny, capsys) -> None:
    pytest.importorskip("llguidance")
    code = _substitute(_block("Structured outputs and token rules"), {"LLM()": f"LLM({tiny!r})"})
    _run(code, {})
    printed = capsys.readouterr().out
    assert printed.startswith('{"name": "'), printed


def test_structural_tag_example(tiny) -> None:
    pytest.importorskip("llguidance")
    schema = {"type": "object", "properties": {"name": {"type": "string"}}}
    ns = _run(
        _block("Structured outputs and token rules", 1),
        {
            "json": json,
            "schema": schema,
            "SamplingParams": SamplingParams,
            "StructuredOutputsParams": StructuredOutputsParams,
        },
    )
    assert ns["fmt"]["format"]["type"] == "triggered_tags"
    llm = LLM(tiny, max_model_len=256)
    params = SamplingParams(
        max_tokens=8,
        structured_outputs=StructuredOutputsParams(structural_tag=json.dumps(ns["fmt"])),
    )
    assert llm.generate("x", params, use_tqdm=False)[0].outputs[0].finish_reason in (
        "length",
        "stop",
    )


def test_custom_logits_processor_example(tiny) -> None:
    code = _substitute(
        _block("Custom logits processors"),
        {
            '"Qwen/Qwen3-0.6B"': repr(tiny),
            '{"target_token": 42})': '{"target_token": 42}), use_tqdm=False',
        },
    )
    ns = _run(code, {"__name__": "docs_engine_example"})
    out = ns["llm"].generate(
        "Hi", SamplingParams(max_tokens=4, extra_args={"target_token": 42}), use_tqdm=False
    )
    assert out[0].outputs[0].token_ids == [42] * 4


def test_embeddings_example(tiny) -> None:
    code = _substitute(_block("Embeddings"), {'"Qwen/Qwen3-0.6B"': repr(tiny)})
    ns = _run(code, {})
    vector = ns["vector"]
    assert isinstance(vector, list) and len(vector) == ns["llm"].model_config.get_hidden_size()
    assert abs(sum(v * v for v in vector) - 1.0) < 1e-4
    # the scores example runs on the same embedding model
    scores = _run(_block("Scores and reranking"), {"llm": ns["llm"]})["outs"]
    assert len(scores) == 2 and all(-1.0 <= o.outputs.score <= 1.0 for o in scores)


def test_classification_example(tmp_path) -> None:
    labels = write_tiny_classifier(tmp_path / "cls", "qwen2", num_labels=2)
    single = write_tiny_classifier(tmp_path / "single", "qwen2", num_labels=1)
    code = _substitute(
        _block("Classification and cross-encoders"),
        {
            '"jason9693/Qwen2.5-1.5B-apeach"': repr(str(labels)),
            '"path/to/a/single-label/*ForSequenceClassification"': repr(str(single)),
        },
    )
    ns = _run(code, {"LLM": LLM})
    probs = ns["out"][0].outputs.probs
    assert len(probs) == 2 and abs(sum(probs) - 1.0) < 1e-5


def test_lora_example(tiny, tmp_path) -> None:
    sql = write_lora_adapter(tmp_path / "sql", tiny, rank=8)
    chat = write_lora_adapter(tmp_path / "chat", tiny, rank=8, seed=1)
    code = _substitute(
        _block("LoRA adapters"),
        {
            '"meta-llama/Llama-3.2-1B"': repr(tiny),
            '"/adapters/sql-lora"': repr(str(sql)),
            '"/adapters/chat-lora"': repr(str(chat)),
        },
    )
    ns = _run(code, {})
    assert [o.lora_request for o in ns["outs"]] == [ns["sql"], ns["chat"], None]
    assert ns["llm"].llm_engine.list_loras() == {2}  # sql removed, chat still loaded


def test_kv_transfer_example(tiny, tmp_path) -> None:
    store = tmp_path / "kv"
    code = _substitute(
        _block("KV transfer (disaggregated prefill)"),
        {'"Qwen/Qwen3-0.6B"': repr(tiny), '"/shared/kv"': repr(str(store))},
    )
    producer_code = code.replace('"kv_role": "kv_consumer"', '"kv_role": "kv_producer"')
    prompt = " ".join(f"w{i}" for i in range(40))
    producer = _run(producer_code, {"LLM": LLM})["llm"]
    producer.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=False)
    consumer = _run(code, {"LLM": LLM})["llm"]
    out = consumer.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert out.num_cached_tokens > 0 and consumer.get_stats().external_prefix_cache_hits > 0


def test_engine_api_example(tiny, capsys) -> None:
    code = _substitute(_block("The engine API (what the server drives)"), {'"path"': repr(tiny)})
    ns = _run(code, {})
    assert not ns["engine"].has_unfinished_requests()
    printed = capsys.readouterr().out.splitlines()
    assert printed and all(line.startswith("req-1 ") for line in printed)


def test_async_llm_example(tiny) -> None:
    code = _substitute(
        _block("From asyncio: `AsyncLLM` (vLLM's `AsyncLLMEngine`)"), {'"path"': repr(tiny)}
    )
    ns = _run(code, {})
    try:
        text = asyncio.run(ns["answer"]("Hello", "r1"))
        assert isinstance(text, str) and text
    finally:
        ns["engine"].shutdown()
    assert isinstance(AsyncEngineArgs(model=tiny), AsyncEngineArgs)


def test_sleep_mode_example(tiny) -> None:
    code = _substitute(
        _block("Sleep mode (`sleep` / `wake_up`) and pausing"), {'"Qwen/Qwen3-0.6B"': repr(tiny)}
    )
    prompts, params = ["hello there"], SamplingParams(max_tokens=6, temperature=0)
    new = load_file(str(Path(tiny) / "model.safetensors"))
    ns = _run(code, {"LLM": LLM, "prompts": prompts, "params": params, "new": new})
    llm = ns["llm"]
    assert not llm.llm_engine.is_sleeping()
    after = llm.generate(prompts, params, use_tqdm=False)
    assert after[0].outputs[0].token_ids == ns["outs"][0].outputs[0].token_ids


def test_profiling_example(tiny, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PAGED_TORCH_PROFILER_DIR", str(tmp_path))
    code = _substitute(
        _block("Profiling (`start_profile` / `stop_profile`)"), {'"Qwen/Qwen3-0.6B"': repr(tiny)}
    )
    ns = _run(code, {"LLM": LLM, "prompts": ["hi"], "params": SamplingParams(max_tokens=2)})
    paths = ns["paths"]
    assert len(paths) == 1 and Path(paths[0]).name.endswith(".pt.trace.json.gz")
    assert Path(paths[0]).exists()


@pytest.mark.parametrize(
    "heading", ["Speculative decoding", "Suffix decoding", "With a draft model"]
)
def test_speculative_examples(tiny, heading) -> None:
    replace = {"model=...": "model=target"}
    if heading == "With a draft model":
        replace = {'"path/or/hub-id-of-a-small-model"': "target"}
    code = _substitute(_block(heading), replace)
    llm = _run(code, {"LLM": LLM, "target": tiny})["llm"]
    params = SamplingParams(max_tokens=12, temperature=0)
    prompt = "a b c a b c a b c a b c"
    spec = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    plain = LLM(tiny, max_model_len=256).generate(prompt, params, use_tqdm=False)[0]
    assert spec == plain.outputs[0].token_ids  # greedy speculation emits plain greedy's tokens
    assert llm.get_stats().spec_decode_num_drafts > 0
