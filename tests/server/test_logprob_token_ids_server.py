"""vLLM's OpenAI server for `logprob_token_ids` (its protocols' `to_sampling_params`): the
logprobs count is not sent beside the ids, so the ids decide what each position reports and
--max-logprobs holds neither; at most 128 ids (MAX_LOGPROB_TOKEN_IDS). The engine's rules:
tests/engine/test_logprob_token_ids_parity.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from server_proc import COMMON_ARGS, MAX_MODEL_LEN, serve_in_process

from paged_engine import LLM

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llm(tiny_model: str) -> Iterator[LLM]:
    llm = LLM(model=tiny_model, dtype="float32", max_model_len=MAX_MODEL_LEN, max_logprobs=2)
    yield llm
    llm.llm_engine.shutdown()


def test_the_server_does_not_send_the_count_beside_the_ids(llm):
    """As vLLM's server: the ids decide what each position reports, whatever logprobs /
    top_logprobs say, and --max-logprobs (2 here) holds neither; an echoed prompt's logprobs
    count is still held to it."""
    wanted = list(range(10, 35))  # 25 ids
    keys = {"return_tokens_as_token_ids": True, "temperature": 0, "max_tokens": 2}
    with serve_in_process(COMMON_ARGS, llm.llm_engine) as (http, _):
        body = {"model": "tiny", "prompt": [5, 6, 7], **keys}
        for logprobs in (0, 1, 40):
            status, _, answer = http.request(
                "POST",
                "/v1/completions",
                {**body, "logprobs": logprobs, "logprob_token_ids": wanted},
            )
            assert status == 200, answer
            for top in answer["choices"][0]["logprobs"]["top_logprobs"]:
                assert {f"token_id:{t}" for t in wanted} <= set(top) and len(top) <= 26
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **keys}
        chat |= {"logprobs": True, "top_logprobs": 1, "logprob_token_ids": wanted}
        status, _, answer = http.request("POST", "/v1/chat/completions", chat)
        assert status == 200, answer
        for entry in answer["choices"][0]["logprobs"]["content"]:
            shown = {t["token"] for t in entry["top_logprobs"]}
            assert {f"token_id:{t}" for t in wanted} <= shown
        echoed = {**body, "echo": True, "logprobs": 3, "logprob_token_ids": wanted}
        status, _, bad = http.request("POST", "/v1/completions", echoed)
        assert status == 400 and bad["error"]["param"] == "logprobs", bad
        too_many = {**body, "logprobs": 1, "logprob_token_ids": [1] * 129}
        status, _, bad = http.request("POST", "/v1/completions", too_many)
        assert status == 400 and bad["error"]["param"] == "logprob_token_ids", bad
        assert "at most 128" in bad["error"]["message"], bad
