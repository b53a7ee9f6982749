"""Newer vLLM request fields over HTTP: `repetition_detection` (and its older top-level
spelling) ends a looping answer with finish_reason "repetition"; `logprobs` / `top_logprobs`
-1 give every token under --max-logprobs -1 and a 400 naming the limit without;
--stream-interval batches streamed tokens; `vllm_xargs` and `skip_reading_prefix_cache` are
taken; bad values are 400s naming the field."""

from __future__ import annotations

import pytest
from server_proc import COMMON_ARGS, MAX_MODEL_LEN, serve_in_process

pytest.importorskip("transformers")

PROMPT = [5, 6, 7]
BODY = {"model": "tiny", "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
RULE = {"max_pattern_size": 4, "min_pattern_size": 1, "min_count": 3}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from paged_engine import LLM
    from paged_engine.testing import write_tiny_model

    path = write_tiny_model(tmp_path_factory.mktemp("llama"), "llama")
    llm = LLM(str(path), dtype="float32", max_model_len=MAX_MODEL_LEN, max_logprobs=-1)
    yield llm.llm_engine
    llm.llm_engine.shutdown()


def _ask(http, path="/v1/completions", **body):
    status, _, answer = http.request("POST", path, {**BODY, **body})
    return status, answer


def test_fields(engine):
    vocab = engine.vocab_size
    with serve_in_process(COMMON_ARGS, engine) as (http, _):
        status, plain = _ask(http, return_token_ids=True)
        assert status == 200, plain
        _, cut = _ask(http, repetition_detection=RULE, return_token_ids=True)
        (choice,) = cut["choices"]
        # the tiny model loops on this prompt: the answer stops early, a prefix of the plain one
        assert choice["finish_reason"] == "repetition"
        assert choice["token_ids"] == plain["choices"][0]["token_ids"][: len(choice["token_ids"])]
        assert len(choice["token_ids"]) < 40
        legacy = {
            "max_repetition_pattern_size": 4,
            "min_repetition_pattern_size": 1,
            "repetition_min_count": 3,
        }
        _, old = _ask(http, return_token_ids=True, **legacy)
        assert old["choices"][0]["token_ids"] == choice["token_ids"]
        status, bad = _ask(http, repetition_detection={"max_pattern_size": 4, "min_count": 1})
        assert status == 400 and bad["error"]["param"] == "repetition_detection", bad
        status, bad = _ask(http, repetition_detection=[4])
        assert status == 400 and bad["error"]["param"] == "repetition_detection", bad
        huge = {"max_pattern_size": 1 << 20, "min_count": 2}  # the per-token check stays small
        status, bad = _ask(http, repetition_detection=huge)
        assert status == 400 and bad["error"]["param"] == "repetition_detection", bad
        # every token's logprob (keyed by id: tokens whose text is alike would merge)
        status, body = _ask(http, max_tokens=2, logprobs=-1, return_tokens_as_token_ids=True)
        assert status == 200, body
        top = body["choices"][0]["logprobs"]["top_logprobs"]
        assert len(top) == 2 and all(len(t) == vocab for t in top)
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        status, _, body = http.request(
            "POST", "/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": -1}
        )
        assert status == 200, body
        assert all(
            len(c["top_logprobs"]) == vocab for c in body["choices"][0]["logprobs"]["content"]
        )
        status, body = _ask(
            http,
            vllm_xargs={"plugin": "x", "k": [1, 2]},
            skip_reading_prefix_cache=True,
            max_tokens=2,
        )
        assert status == 200, body
        status, bad = _ask(http, vllm_xargs={"plugin": {"nested": 1}})
        assert status == 400 and bad["error"]["param"] == "vllm_xargs", bad


def test_logprob_token_ids(engine):
    """vLLM's `logprob_token_ids`: each generated position's logprobs are the sampled token's
    and the asked ids', equal to the whole distribution's, in completions and chat, whole and
    streamed; without the logprobs switch, with beams or with nothing generated: 400s."""
    wanted = [7, 250, 3]
    keys = {"return_tokens_as_token_ids": True}  # (texts alike would merge)
    with serve_in_process(COMMON_ARGS, engine) as (http, _):
        _, every = _ask(http, max_tokens=3, logprobs=-1, **keys)
        ref = every["choices"][0]["logprobs"]
        status, body = _ask(http, max_tokens=3, logprobs=0, logprob_token_ids=wanted, **keys)
        assert status == 200, body
        got = body["choices"][0]["logprobs"]
        assert got["tokens"] == ref["tokens"]
        for token, top, full in zip(got["tokens"], got["top_logprobs"], ref["top_logprobs"]):
            assert set(top) == {token, *(f"token_id:{t}" for t in wanted)}
            for key, value in top.items():
                assert value == pytest.approx(full[key], abs=1e-5)
        streamed = http.stream({**BODY, "max_tokens": 3, "logprobs": 0, **keys,
                                "logprob_token_ids": wanted})  # fmt: skip
        tops = [t for e in streamed for t in e["choices"][0]["logprobs"]["top_logprobs"]]
        assert tops == got["top_logprobs"]

        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        status, _, body = http.request(
            "POST",
            "/v1/chat/completions",
            {**chat, **keys, "logprobs": True, "logprob_token_ids": wanted},
        )
        assert status == 200, body
        for entry in body["choices"][0]["logprobs"]["content"]:
            shown = {t["token"] for t in entry["top_logprobs"]}
            assert shown == {entry["token"], *(f"token_id:{t}" for t in wanted)}

        for extra in (
            {},  # no logprobs switch
            {"logprobs": 0, "use_beam_search": True, "n": 2},
            {"logprobs": 0, "max_tokens": 0, "echo": True},
            {"logprobs": 0, "logprob_token_ids": [engine.vocab_size]},
            {"logprobs": 0, "logprob_token_ids": "7"},
        ):
            status, bad = _ask(http, **{"logprob_token_ids": wanted, **extra})
            assert status == 400 and bad["error"]["param"] == "logprob_token_ids", (extra, bad)
        status, _, bad = http.request(
            "POST", "/v1/chat/completions", {**chat, "logprob_token_ids": wanted}
        )
        assert status == 400 and "'logprobs': true" in bad["error"]["message"], bad


def test_logprobs_are_held_to_max_logprobs(tmp_path):
    """--max-logprobs (the engine's max_logprobs) is the limit, not a fixed 20; -1 asks for
    the vocabulary, which only --max-logprobs -1 allows."""
    from paged_engine import LLM
    from paged_engine.testing import write_tiny_model

    path = write_tiny_model(tmp_path / "m", "llama")
    llm = LLM(str(path), dtype="float32", max_model_len=MAX_MODEL_LEN, max_logprobs=30)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    try:
        with serve_in_process([*COMMON_ARGS, "--max-logprobs", "30"], llm.llm_engine) as (http, _):
            ids = {"return_tokens_as_token_ids": True}  # (texts alike would merge)
            status, body = _ask(http, max_tokens=1, logprobs=25, **ids)
            assert status == 200 and len(body["choices"][0]["logprobs"]["top_logprobs"][0]) >= 25
            for field, value in (("logprobs", -1), ("logprobs", 31), ("prompt_logprobs", 31)):
                status, bad = _ask(http, max_tokens=1, **{field: value})
                assert status == 400 and bad["error"]["param"] == field, bad
                assert "--max-logprobs 30" in bad["error"]["message"], bad
            # vLLM: logprob_token_ids have their own bound (128), and the logprobs count sent
            # beside them is not used, so --max-logprobs holds neither
            wide = {"logprobs": 31, "logprob_token_ids": list(range(31)), **ids}
            status, body = _ask(http, max_tokens=1, **wide)
            assert status == 200 and len(body["choices"][0]["logprobs"]["top_logprobs"][0]) >= 31
            status, bad = _ask(http, max_tokens=1, logprobs=0, logprob_token_ids=[1] * 129)
            assert status == 400 and bad["error"]["param"] == "logprob_token_ids", bad
            assert "at most 128" in bad["error"]["message"], bad
            body = {**chat, "logprobs": True, "top_logprobs": 31}
            status, _, bad = http.request("POST", "/v1/chat/completions", body)
            assert status == 400 and bad["error"]["param"] == "top_logprobs", bad
    finally:
        llm.llm_engine.shutdown()


def test_stream_interval_flag(tmp_path):
    from paged_engine import LLM
    from paged_engine.testing import write_tiny_model

    path = write_tiny_model(tmp_path / "m", "llama")
    llm = LLM(str(path), dtype="float32", max_model_len=MAX_MODEL_LEN, stream_interval=5)
    try:
        with serve_in_process([*COMMON_ARGS, "--stream-interval", "5"], llm.llm_engine) as (
            http,
            _,
        ):
            events = http.stream({**BODY, "max_tokens": 21, "return_token_ids": True})
            sizes = [
                len(c["token_ids"])
                for e in events
                for c in e.get("choices", [])
                if c.get("token_ids")
            ]
            # the first token alone, then whole intervals of 5; a consumer that falls behind
            # gets what piled up in one event (on a loaded machine the first event once held
            # the first token and three intervals: 16)
            assert sizes[0] % 5 == 1 and sum(sizes) == 21 and len(sizes) <= 1 + 4, sizes
            assert all(n % 5 == 0 for n in sizes[1:]), sizes
    finally:
        llm.llm_engine.shutdown()


def test_thinking_token_budget(tmp_path):
    from paged_engine import LLM
    from paged_engine.testing import write_tiny_model
    from paged_server.cli import reasoning_config

    assert reasoning_config(None, "qwen3") == {
        "think_start_str": "<think>",
        "think_end_str": "</think>",
    }
    assert reasoning_config(None, "granite") is None  # two openers: no one marker
    mine = {"think_start_str": "<a>", "think_end_str": "</a>"}
    assert reasoning_config(mine, "qwen3") is mine
    path = write_tiny_model(tmp_path / "m", "llama")
    markers = {"think_start_str": "<|im_start|>", "think_end_str": " the end"}
    llm = LLM(str(path), dtype="float32", max_model_len=MAX_MODEL_LEN, reasoning_config=markers)
    tok = llm.get_tokenizer()
    close = tok.encode(" the end", add_special_tokens=False)
    prompt = [*PROMPT, *tok.encode("<|im_start|>", add_special_tokens=False)]
    try:
        with serve_in_process(COMMON_ARGS, llm.llm_engine) as (http, _):
            status, body = _ask(
                http, prompt=prompt, thinking_token_budget=0, max_tokens=4, return_token_ids=True
            )
            assert status == 200, body
            assert body["choices"][0]["token_ids"][: len(close)] == close
            status, bad = _ask(http, prompt=prompt, thinking_token_budget="x")
            assert status == 400 and bad["error"]["param"] == "thinking_token_budget", bad
    finally:
        llm.llm_engine.shutdown()
