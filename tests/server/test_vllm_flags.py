"""vLLM's server flags that launch scripts carry: --enable-prompt-tokens-details (usage's cached
prompt tokens, from the prefix cache), --return-tokens-as-token-ids, --response-role,
--enable-log-requests / --enable-log-outputs / --max-log-len, and the engine ones
(--no-enable-chunked-prefill, --max-logprobs); accepted as the defaults they are:
--disable-log-requests, --disable-log-stats."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest
from server_proc import COMMON_ARGS, ServerProc, serve_in_process

import paged_engine
from paged_server.cli import build_engine, parse_args

FLAGS = [
    "--enable-prompt-tokens-details",
    "--return-tokens-as-token-ids",
    "--response-role",
    "bot",
    "--enable-log-requests",
    "--enable-log-outputs",
    "--enable-tokenizer-info-endpoint",
    "--max-log-len",
    "6",
    "--disable-log-requests",
    "--disable-log-stats",
]


@pytest.fixture(scope="module")
def flagged(tiny_model: str) -> Iterator[ServerProc]:
    """A real tiny engine in this process behind a server started with FLAGS."""
    engine = paged_engine.LLMEngine(model=tiny_model, dtype="float32", max_model_len=128)
    with serve_in_process([*COMMON_ARGS, *FLAGS], engine) as (http, _app):
        yield http
    engine.shutdown()


def post(server: ServerProc, path: str, body: dict) -> dict:
    status, _, payload = server.request("POST", path, body)
    assert status == 200, payload
    return payload


def test_cached_tokens_role_token_ids_and_request_log(flagged, caplog) -> None:
    prompt = list(range(10, 60))  # 50 tokens: three full 16-token blocks to cache
    body = {"prompt": prompt, "max_tokens": 2, "logprobs": 0}
    with caplog.at_level(logging.INFO, logger="paged_server"):
        first = post(flagged, "/v1/completions", body)
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert any("prompt [10, 11, 12, 13, 14, 15], params" in r.message for r in caplog.records)
    second = post(flagged, "/v1/completions", body)
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 48}
    assert all(t.startswith("token_id:") for t in second["choices"][0]["logprobs"]["tokens"])
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert post(flagged, "/v1/chat/completions", chat)["choices"][0]["message"]["role"] == "bot"
    events = flagged.stream(
        {**chat, "stream_options": {"include_usage": True}}, "/v1/chat/completions"
    )
    assert events[0]["choices"][0]["delta"]["role"] == "bot"
    assert "prompt_tokens_details" in events[-1]["usage"]


def engine_config(monkeypatch: pytest.MonkeyPatch, argv: list[str]):
    seen = {}
    monkeypatch.setattr(paged_engine, "LLMEngine", lambda config: seen.setdefault("c", config))
    build_engine(parse_args(["m", *argv]))
    return seen["c"]


def test_engine_flags(monkeypatch) -> None:
    config = engine_config(monkeypatch, [])
    assert (config.enable_chunked_prefill, config.max_logprobs) == (True, 20)
    config = engine_config(monkeypatch, ["--no-enable-chunked-prefill", "--max-logprobs", "5"])
    assert (config.enable_chunked_prefill, config.max_logprobs) == (False, 5)
    assert engine_config(monkeypatch, ["--max-logprobs", "-1"]).max_logprobs == -1  # vocabulary
    with pytest.raises(ValueError, match="max_logprobs"):
        engine_config(monkeypatch, ["--max-logprobs", "-2"])
    config = engine_config(monkeypatch, ["--reasoning-parser", "qwen3", "--stream-interval", "4"])
    assert config.reasoning_config == {"think_start_str": "<think>", "think_end_str": "</think>"}
    assert config.stream_interval == 4
    # accepted as what paged does; refused where paged cannot
    engine_config(monkeypatch, ["--distributed-executor-backend", "mp", "--tokenizer-mode", "auto"])
    engine_config(monkeypatch, ["--distributed-executor-backend", "uni"])
    with pytest.raises(ValueError, match="uni runs one process"):
        engine_config(monkeypatch, ["--distributed-executor-backend", "uni", "-tp", "2"])
    assert engine_config(monkeypatch, ["--model-impl", "vllm"]).model_impl == "vllm"
    assert engine_config(monkeypatch, ["--model-impl", "transformers"]).model_impl == "transformers"
    # vLLM's older spelling of --mm-processor-cache-gb 0
    assert (
        engine_config(monkeypatch, ["--disable-mm-preprocessor-cache"]).mm_processor_cache_gb == 0
    )
    assert engine_config(monkeypatch, []).mm_processor_cache_gb == 4.0


@pytest.mark.parametrize(
    "argv",
    [
        ["--distributed-executor-backend", "ray"],
        ["--tokenizer-mode", "slow"],
    ],
)
def test_what_paged_cannot_do_is_refused_naming_the_flag(argv, capsys) -> None:
    with pytest.raises(SystemExit):
        parse_args(["m", *argv])
    assert argv[0] in capsys.readouterr().err


def test_log_outputs_logs_each_answer_once_whole_or_streamed(flagged, caplog) -> None:
    """--enable-log-outputs: one line per completion when it finishes, its text and ids cut to
    --max-log-len (6), for whole answers (n = 2) and streams alike."""
    body = {"prompt": "hello there", "max_tokens": 5, "n": 2, "ignore_eos": True}
    with caplog.at_level(logging.INFO, logger="paged_server"):
        whole = post(flagged, "/v1/completions", {**body, "temperature": 0.0})
        events = flagged.stream({**body, "n": 1, "seed": 3})
    lines = [r.getMessage() for r in caplog.records if ": output " in r.getMessage()]
    assert len(lines) == 3, lines
    streamed = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    for line, text in zip(lines, [c["text"] for c in whole["choices"]] + [streamed]):
        assert f"{text[:6]!r}, output_token_ids [" in line and line.endswith("length"), line
        assert len(line.split("output_token_ids [")[1].split("]")[0].split(",")) == 5


def test_tokenizer_info_only_when_enabled(flagged, real_server, tiny_model) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    status, _, info = flagged.request("GET", "/tokenizer_info")
    assert status == 200, info
    assert info["tokenizer_class"] == type(tok).__name__
    assert info["chat_template"] == tok.chat_template
    assert info["eos_token"] == str(tok.eos_token) and "vocab_file" not in info
    json.dumps(info)  # every value is JSON's
    assert real_server.request("GET", "/tokenizer_info")[0] == 404  # without the flag
