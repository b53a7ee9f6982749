"""Every request field of vLLM's request models is served at its default value: a client
written for vLLM sends them (often at their defaults, or as nulls), and the server answers 200,
not "Unrecognized request argument". A made-up field is still a 400. Fields implemented here
(pooling `request_id`, `use_activation` on /v1/embeddings, the transcription `vllm_xargs`) have
a test of their effect; fields accepted only at their defaults answer a 400 naming them at any
other value.

The field tables are read off vLLM's request models (main branch, December 2026):
  vllm/entrypoints/openai/chat_completion/protocol.py  ChatCompletionRequest
  vllm/entrypoints/openai/completion/protocol.py       CompletionRequest
  vllm/entrypoints/openai/responses/protocol.py        ResponsesRequest
  vllm/entrypoints/openai/speech_to_text/protocol.py   TranscriptionRequest, TranslationRequest
  vllm/entrypoints/serve/tokenize/protocol.py          Tokenize{Completion,Chat}Request,
                                                       DetokenizeRequest
  vllm/entrypoints/pooling/base/protocol.py            PoolingBasicRequestMixin and the mixins
  vllm/entrypoints/pooling/embed/protocol.py           EmbeddingCompletionRequest
  vllm/entrypoints/pooling/classify/protocol.py        ClassificationCompletionRequest
  vllm/entrypoints/pooling/scoring/protocol.py         ScoreQueriesDocumentsRequest,
                                                       RerankRequest
Each entry is (field, its default as JSON, or a value that asks for nothing more). Nothing is
fetched at test time.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fake_engine import FakeEngine
from server_proc import COMMON_ARGS, MAX_MODEL_LEN, ServerProc, serve_in_process

from paged_server.classify import parse_classify
from paged_server.embeddings import parse_embedding
from paged_server.errors import APIError
from paged_server.multipart import Part
from paged_server.scores import parse_rerank, parse_score
from paged_server.transcriptions import parse_speech

# Fields both generation models define (chat and completion), at their defaults.
_GENERATION_COMMON: list[tuple[str, Any]] = [
    ("model", None),
    ("frequency_penalty", 0.0),
    ("logit_bias", None),
    ("n", 1),
    ("presence_penalty", 0.0),
    ("response_format", None),
    ("seed", None),
    ("stop", []),
    ("stream", False),
    ("stream_options", None),
    ("temperature", None),
    ("top_p", None),
    ("user", None),
    ("use_beam_search", False),
    ("top_k", None),
    ("min_p", None),
    ("repetition_penalty", None),
    ("length_penalty", 1.0),
    ("stop_token_ids", []),
    ("include_stop_str_in_output", False),
    ("ignore_eos", False),
    ("min_tokens", 0),
    ("skip_special_tokens", True),
    ("spaces_between_special_tokens", True),
    ("truncate_prompt_tokens", None),
    ("truncation_side", None),
    ("allowed_token_ids", None),
    ("prompt_logprobs", None),
    ("logprob_token_ids", None),
    ("bad_words", []),
    ("structured_outputs", None),
    ("priority", 0),
    ("request_id", "req-abc"),  # (a random id by default)
    ("return_tokens_as_token_ids", None),
    ("return_token_ids", None),
    ("return_token_offsets", False),
    ("cache_salt", None),
    ("kv_transfer_params", None),
    ("ec_transfer_params", None),
    ("vllm_xargs", None),
    ("repetition_detection", None),
    ("thinking_token_budget", None),
]
CHAT_FIELDS = _GENERATION_COMMON + [
    ("logprobs", False),
    ("top_logprobs", 0),
    ("max_tokens", None),
    ("max_completion_tokens", None),
    ("tools", None),
    ("tool_choice", "none"),
    ("reasoning_effort", None),
    ("include_reasoning", True),
    ("parallel_tool_calls", True),
    ("echo", False),
    ("add_generation_prompt", True),
    ("continue_final_message", False),
    ("add_special_tokens", False),
    ("documents", None),
    ("chat_template", None),
    ("chat_template_kwargs", None),
    ("mm_processor_kwargs", None),
    ("media_io_kwargs", None),
    ("logits_processors", None),
    ("max_repetition_pattern_size", 0),  # the older spelling of repetition_detection
    ("min_repetition_pattern_size", 0),
    ("repetition_min_count", 0),
]
COMPLETION_FIELDS = _GENERATION_COMMON + [
    ("echo", False),
    ("logprobs", None),
    ("max_tokens", 16),
    ("suffix", None),
    ("prompt_embeds", None),
    ("add_special_tokens", True),
]
RESPONSES_FIELDS: list[tuple[str, Any]] = [
    ("background", False),
    ("include", None),
    ("instructions", None),
    ("max_output_tokens", None),
    ("max_tool_calls", None),
    ("metadata", None),
    ("model", None),
    ("logit_bias", None),
    ("parallel_tool_calls", True),
    ("previous_response_id", None),
    ("prompt", None),
    ("reasoning", None),
    ("service_tier", "auto"),
    ("store", True),
    ("stream", False),
    ("temperature", None),
    ("text", None),
    ("tool_choice", "auto"),
    ("tools", []),
    ("top_logprobs", 0),
    ("top_p", None),
    ("top_k", None),
    ("truncation", "disabled"),
    ("user", None),
    ("skip_special_tokens", True),
    ("include_stop_str_in_output", False),
    ("prompt_cache_key", None),
    ("request_id", "resp_abc"),  # (a random id by default)
    ("media_io_kwargs", None),
    ("mm_processor_kwargs", None),
    ("priority", 0),
    ("cache_salt", None),
    ("kv_transfer_params", None),
    ("enable_response_messages", False),
    ("chat_template_kwargs", None),
    ("previous_input_messages", None),
    ("structured_outputs", None),
    ("repetition_penalty", None),
    ("seed", None),
    ("stop", []),
    ("ignore_eos", False),
    ("vllm_xargs", None),
]
TOKENIZE_PROMPT_FIELDS: list[tuple[str, Any]] = [
    ("model", None),
    ("add_special_tokens", True),
    ("return_token_strs", False),
]
TOKENIZE_CHAT_FIELDS: list[tuple[str, Any]] = [
    ("model", None),
    ("add_generation_prompt", True),
    ("return_token_strs", False),
    ("continue_final_message", False),
    ("add_special_tokens", False),
    ("chat_template", None),
    ("chat_template_kwargs", None),
    ("mm_processor_kwargs", None),
    ("tools", None),
]
DETOKENIZE_FIELDS: list[tuple[str, Any]] = [("model", None)]
# PoolingBasicRequestMixin
_POOLING_BASIC: list[tuple[str, Any]] = [
    ("model", None),
    ("user", None),
    ("truncate_prompt_tokens", None),
    ("padding", None),
    ("truncation_side", None),
    ("request_id", "req-abc"),
    ("priority", 0),
    ("mm_processor_kwargs", None),
    ("cache_salt", None),
]
EMBEDDING_FIELDS = _POOLING_BASIC + [
    ("add_special_tokens", True),
    ("encoding_format", "float"),
    ("dimensions", None),
    ("normalize", None),  # (older vLLM's name of use_activation here)
    ("use_activation", None),
    ("embed_dtype", "float32"),
    ("endianness", "native"),
]
EMBEDDING_CHAT_FIELDS: list[tuple[str, Any]] = [
    ("add_generation_prompt", False),
    ("continue_final_message", False),
    ("add_special_tokens", False),
    ("chat_template", None),
    ("chat_template_kwargs", None),
    ("media_io_kwargs", None),
    ("mm_processor_kwargs", None),
]
CLASSIFY_FIELDS = _POOLING_BASIC + [("add_special_tokens", True), ("use_activation", None)]
_SCORING = _POOLING_BASIC + [
    ("use_activation", None),
    ("max_tokens_per_query", 0),
    ("max_tokens_per_doc", 0),
]
SCORE_FIELDS = _SCORING
RERANK_FIELDS = _SCORING + [("top_n", 0)]
TRANSCRIPTION_FIELDS: list[tuple[str, str]] = [  # form fields: text values
    ("model", "tiny"),
    ("language", "en"),
    ("prompt", ""),
    ("response_format", "json"),
    ("stream", "false"),
    ("stream_include_usage", "false"),
    ("stream_continuous_usage_stats", "false"),
    ("vllm_xargs", "{}"),
    ("temperature", "0.0"),
    ("top_p", "1.0"),
    ("top_k", "0"),
    ("min_p", "0.0"),
    ("seed", "1"),
    ("frequency_penalty", "0.0"),
    ("repetition_penalty", "1.0"),
    ("presence_penalty", "0.0"),
    ("max_completion_tokens", "4"),
]
# TranslationRequest: the same as a transcription's, less the sampling extras, plus to_language
TRANSLATION_FIELDS = [
    f for f in TRANSCRIPTION_FIELDS if f[0] not in ("top_p", "top_k", "min_p", "vllm_xargs")
] + [("to_language", "en")]

MADE_UP = "frobnicate_level"  # a field no vLLM model defines
CHAT = [{"role": "user", "content": "hi"}]


def _ids(fields: list[tuple[str, Any]]) -> list[str]:
    return [name for name, _ in fields]


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[ServerProc, FakeEngine]]:
    engine = FakeEngine(max_model_len=MAX_MODEL_LEN, step_time=0.001)
    with serve_in_process(COMMON_ARGS, engine) as (http, _app):
        yield http, engine


@pytest.fixture(scope="module")
def fake(served) -> ServerProc:
    return served[0]


def post(server: ServerProc, path: str, body: dict, status: int = 200) -> dict:
    got, _, payload = server.request("POST", path, body)
    assert got == status, payload
    return payload


@pytest.mark.parametrize(("name", "value"), CHAT_FIELDS, ids=_ids(CHAT_FIELDS))
def test_chat_serves_vllm_field_at_default(fake, name, value) -> None:
    post(fake, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, name: value})


@pytest.mark.parametrize(("name", "value"), COMPLETION_FIELDS, ids=_ids(COMPLETION_FIELDS))
def test_completion_serves_vllm_field_at_default(fake, name, value) -> None:
    body = {"prompt": "hi", "max_tokens": 1, name: value}
    post(fake, "/v1/completions", body)


def test_generation_fields_all_at_once(fake) -> None:
    """One request carrying every field (as a pydantic client dumping its defaults sends)."""
    chat = {**dict(CHAT_FIELDS), "messages": CHAT, "max_tokens": 1}
    assert post(fake, "/v1/chat/completions", chat)["id"] == "chatcmpl-req-abc"
    done = {**dict(COMPLETION_FIELDS), "prompt": "hi", "max_tokens": 1}
    assert post(fake, "/v1/completions", done)["id"] == "cmpl-req-abc"


@pytest.mark.parametrize(("name", "value"), RESPONSES_FIELDS, ids=_ids(RESPONSES_FIELDS))
def test_responses_serves_vllm_field_at_default(fake, name, value) -> None:
    post(fake, "/v1/responses", {"input": "hi", "max_output_tokens": 1, name: value})


def test_tokenize_and_detokenize_serve_vllm_fields(fake) -> None:
    body = {**dict(TOKENIZE_PROMPT_FIELDS), "prompt": "hi"}
    assert post(fake, "/tokenize", body)["count"] > 0
    body = {**dict(TOKENIZE_CHAT_FIELDS), "messages": CHAT}
    assert post(fake, "/tokenize", body)["count"] > 0
    body = {**dict(DETOKENIZE_FIELDS), "tokens": [104, 105]}
    assert isinstance(post(fake, "/detokenize", body)["prompt"], str)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 1}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 1}),
    ],
)
def test_made_up_field_is_still_unrecognized(fake, path, body) -> None:
    r = post(fake, path, {**body, MADE_UP: 1}, 400)
    assert r["error"]["param"] == MADE_UP
    assert "Unrecognized request argument supplied" in r["error"]["message"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": CHAT, "truncation_side": "right"}),
        ("/v1/completions", {"prompt": "hi", "truncation_side": "right"}),
        ("/v1/completions", {"prompt": "hi", "ec_transfer_params": {"x": 1}}),
        ("/v1/completions", {"prompt": "hi", "return_token_offsets": True}),
        ("/v1/responses", {"input": "hi", "enable_response_messages": True}),
        ("/v1/responses", {"input": "hi", "previous_input_messages": [{"role": "user"}]}),
        ("/v1/responses", {"input": "hi", "kv_transfer_params": {"x": 1}}),
    ],
)
def test_unimplemented_fields_refused_off_their_defaults(fake, path, body) -> None:
    name = next(k for k in body if k not in ("messages", "prompt", "input"))
    r = post(fake, path, {**body, "max_tokens": 1} if "input" not in body else body, 400)
    assert r["error"]["param"] == name
    assert "not supported by this server" in r["error"]["message"]


def test_truncation_side_left_is_what_truncation_does(fake) -> None:
    """The generation routes keep a prompt's last k tokens: vLLM's "left" side."""
    body = {"prompt": "abcdef", "max_tokens": 1, "truncate_prompt_tokens": 2, "echo": True}
    r = post(fake, "/v1/completions", {**body, "truncation_side": "left"})
    assert r["choices"][0]["text"].startswith("ef")


def test_responses_passes_vllm_extras_to_the_chat(served) -> None:
    """structured_outputs and vllm_xargs reach the engine's SamplingParams as a chat's do."""
    fake, engine = served
    body = {
        "input": "hi",
        "max_output_tokens": 1,
        "structured_outputs": {"choice": ["yes", "no"]},
        "vllm_xargs": {"k": 1},
    }
    before = set(engine.params)
    post(fake, "/v1/responses", body)
    (rid,) = set(engine.params) - before
    params = engine.params[rid]
    assert params.structured_outputs.choice == ["yes", "no"]
    assert params.extra_args == {"k": 1}
    bad = {"input": "hi", "structured_outputs": {"choice": "yes"}}  # checked by the chat path
    assert post(fake, "/v1/responses", bad, 400)["error"]["param"] == "structured_outputs"


def test_responses_request_id_is_the_response_id(fake) -> None:
    """vLLM's: the body's request_id names the response (and its stored copy), as given."""
    body = {"input": "hi", "max_output_tokens": 1, "request_id": "resp_mine-7"}
    assert post(fake, "/v1/responses", body)["id"] == "resp_mine-7"
    got, _, stored = fake.request("GET", "/v1/responses/resp_mine-7")
    assert got == 200 and stored["id"] == "resp_mine-7"
    plain = post(fake, "/v1/responses", {"input": "hi", "max_output_tokens": 1})["id"]
    assert plain.startswith("resp_") and plain != "resp_mine-7"
    bad = {"input": "hi", "request_id": 7}
    assert post(fake, "/v1/responses", bad, 400)["error"]["param"] == "request_id"


# ---- pooling routes: parsed here (their serving needs a pooling model) ----


def _pooling_cases() -> list[tuple[str, Any, str, Any]]:
    cases = []
    for name, value in EMBEDDING_FIELDS:
        cases.append(("embeddings", {"input": "hi"}, name, value))
    for name, value in EMBEDDING_CHAT_FIELDS:
        cases.append(("embeddings", {"messages": CHAT}, name, value))
    for name, value in CLASSIFY_FIELDS:
        cases.append(("classify", {"input": "hi"}, name, value))
    for name, value in SCORE_FIELDS:
        cases.append(("score", {"queries": "q", "documents": ["d"]}, name, value))
    for name, value in RERANK_FIELDS:
        cases.append(("rerank", {"query": "q", "documents": ["d"]}, name, value))
    return cases


_PARSERS = {
    "embeddings": parse_embedding,
    "classify": parse_classify,
    "score": parse_score,
    "rerank": parse_rerank,
}


@pytest.mark.parametrize(
    ("route", "base", "name", "value"),
    _pooling_cases(),
    ids=[f"{c[0]}-{c[2]}" for c in _pooling_cases()],
)
def test_pooling_routes_take_vllm_field_at_default(route, base, name, value) -> None:
    _PARSERS[route]({**base, name: value})


@pytest.mark.parametrize("route", sorted(_PARSERS))
def test_pooling_made_up_field_is_refused(route) -> None:
    base = {
        "embeddings": {"input": "hi"},
        "classify": {"input": "hi"},
        "score": {"queries": "q", "documents": ["d"]},
        "rerank": {"query": "q", "documents": ["d"]},
    }[route]
    with pytest.raises(APIError) as e:
        _PARSERS[route]({**base, MADE_UP: 1})
    assert e.value.status == 400 and e.value.param == MADE_UP


@pytest.mark.parametrize(
    ("route", "base", "name", "value"),
    [
        ("embeddings", {"input": "hi"}, "padding", "max_length"),
        ("embeddings", {"input": "hi"}, "embed_dtype", "float16"),
        ("embeddings", {"input": "hi"}, "endianness", "big"),
        ("embeddings", {"input": "hi"}, "cache_salt", "s"),
        ("classify", {"input": "hi"}, "truncation_side", "right"),
        ("score", {"queries": "q", "documents": ["d"]}, "max_tokens_per_doc", 8),
        ("rerank", {"query": "q", "documents": ["d"]}, "max_tokens_per_query", 8),
        ("rerank", {"query": "q", "documents": ["d"]}, "mm_processor_kwargs", {"a": 1}),
    ],
)
def test_pooling_unimplemented_fields_refused_off_default(route, base, name, value) -> None:
    with pytest.raises(APIError) as e:
        _PARSERS[route]({**base, name: value})
    assert e.value.status == 400 and e.value.param == name
    assert "not supported by this server" in str(e.value.message)


def test_pooling_request_id_names_the_answer() -> None:
    assert parse_embedding({"input": "x", "request_id": "r1"}).request_id == "r1"
    assert parse_classify({"input": "x", "request_id": "r2"})["request_id"] == "r2"
    assert parse_score({"queries": "q", "documents": "d", "request_id": "r3"}).request_id == "r3"
    assert parse_rerank({"query": "q", "documents": "d", "request_id": "r4"}).request_id == "r4"
    with pytest.raises(APIError) as e:
        parse_embedding({"input": "x", "request_id": ""})
    assert e.value.param == "request_id"


def test_embeddings_use_activation_is_normalize() -> None:
    """vLLM's newer embeddings spell normalize as use_activation."""
    assert parse_embedding({"input": "x", "use_activation": False}).params.normalize is False
    assert parse_embedding({"input": "x", "normalize": False}).params.normalize is False
    assert parse_embedding({"input": "x"}).params.normalize is None
    with pytest.raises(APIError) as e:
        parse_embedding({"input": "x", "normalize": True, "use_activation": False})
    assert e.value.param == "use_activation"
    # /pooling keeps use_activation for a classifier's activation
    pooled = parse_embedding({"input": "x", "use_activation": False}, "/pooling")
    assert pooled.params.use_activation is False and pooled.params.normalize is None


# ---- transcriptions / translations: multipart form fields ----


def _form(fields: list[tuple[str, str]]) -> dict[str, list[Part]]:
    form = {"file": [Part("file", b"RIFF", "a.wav")]}
    for name, value in fields:
        form[name] = [Part(name, value.encode())]
    return form


@pytest.mark.parametrize(("name", "value"), TRANSCRIPTION_FIELDS, ids=_ids(TRANSCRIPTION_FIELDS))
def test_transcription_takes_vllm_field(name, value) -> None:
    parse_speech(_form([(name, value)]), "transcribe")


def test_transcription_and_translation_take_all_fields_at_once() -> None:
    parse_speech(_form(TRANSCRIPTION_FIELDS), "transcribe")
    parse_speech(_form(TRANSLATION_FIELDS), "translate")
    with pytest.raises(APIError) as e:
        parse_speech(_form([(MADE_UP, "1")]), "transcribe")
    assert "Unrecognized" in e.value.message and e.value.param == MADE_UP


def test_transcription_vllm_xargs_reach_sampling() -> None:
    req = parse_speech(_form([("vllm_xargs", '{"k": 2, "s": "v"}')]), "transcribe")
    assert req.sampling["extra_args"] == {"k": 2, "s": "v"}
    assert "extra_args" not in parse_speech(_form([("vllm_xargs", "{}")]), "transcribe").sampling
    # checked as the JSON bodies' vllm_xargs (lists of strings / numbers are values too)
    lists = parse_speech(_form([("vllm_xargs", '{"k": [1, "a"]}')]), "transcribe")
    assert lists.sampling["extra_args"] == {"k": [1, "a"]}
    for bad in ("[1]", "{bad", '{"k": {"n": 1}}', '{"k": [[1]]}'):
        with pytest.raises(APIError) as e:
            parse_speech(_form([("vllm_xargs", bad)]), "transcribe")
        assert e.value.param == "vllm_xargs"


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory) -> Iterator[ServerProc]:
    """A tiny one-label `*ForSequenceClassification` model: it classifies, scores and reranks."""
    from paged_engine import EngineConfig, LLMEngine
    from paged_engine.testing import write_tiny_classifier

    path = write_tiny_classifier(tmp_path_factory.mktemp("ce"), "llama", num_labels=1)
    engine = LLMEngine(
        EngineConfig.from_kwargs(
            model=str(path),
            dtype="float32",
            device="cpu",
            num_gpu_blocks_override=32,
            max_model_len=MAX_MODEL_LEN,
        )
    )
    with serve_in_process(COMMON_ARGS, engine) as (http, _app):
        yield http
    engine.shutdown()


def test_pooling_answers_are_named_by_request_id(cross_encoder) -> None:
    """vLLM's pooling request_id: the answer's id is the route's prefix plus it."""
    for path, body, prefix in [
        ("/classify", {"input": "a b"}, "classify-"),
        ("/score", {"queries": "a", "documents": ["b"]}, "score-"),
        ("/rerank", {"query": "a", "documents": ["b"]}, "rerank-"),
    ]:
        r = post(cross_encoder, path, {**body, "request_id": "mine-1", **dict(_POOLING_BASIC[:2])})
        assert r["id"] == prefix + "mine-1", (path, r)
