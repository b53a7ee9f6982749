"""/v1/completions over BART (models/bart.py, engine/encoder_prompt.py) against `LLM.generate`.

The tiny random BART of tests/engine/test_bart.py behind the server in this process: as vLLM
0.10 maps it, a completion's `prompt` (text or token ids) is the encoder prompt and the decoder
starts from its default prompt; the answer is the engine's greedy output for the same prompt.
A prompt the encoder cannot take is a 400 naming it. Usage as vLLM 0.10 counted it: a
completion's prompt_tokens the decoder prompt's (in every streamed chunk too, while the length
check counts the encoder prompt and says so), a chat answer's the encoder's and the decoder's;
`echo` refused (the echoed tokens' logprobs would be the decoder prompt's, not the text's).
"""

from __future__ import annotations

import pytest
from server_proc import serve_in_process

transformers = pytest.importorskip("transformers")

import test_bart  # noqa: E402  (tests/engine: the tiny checkpoint's builder)

from paged_engine import LLM, SamplingParams  # noqa: E402

ARGS = ["--served-model-name", "tiny", "--max-model-len", "64", "--client-timeout", "3"]


def test_completions_take_the_encoder_prompt(tmp_path) -> None:
    path = test_bart.write_tiny(tmp_path / "bart")
    llm = LLM(str(path), dtype="float32", block_size=16, num_gpu_blocks_override=64)
    text, ids = "the quick brown fox", test_bart.prompt_ids(3, 20)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate([text, ids], params, use_tqdm=False)]
    assert want[0] != want[1]
    with serve_in_process(ARGS, llm.llm_engine) as (server, _app):
        for prompt, tokens in zip([text, ids], want, strict=True):
            body = {
                "model": "tiny",
                "prompt": prompt,
                "max_tokens": 6,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            }
            status, _, got = server.request("POST", "/v1/completions", body)
            assert status == 200, got
            assert got["choices"][0]["token_ids"] == tokens
        body = {"model": "tiny", "prompt": "", "max_tokens": 2}
        status, _, got = server.request("POST", "/v1/completions", body)
        assert status == 400 and "prompt" in got["error"]["message"], got
        check_usage_and_refusals(server, llm, text)


def check_usage_and_refusals(server, llm: LLM, text: str) -> None:
    messages = [{"role": "user", "content": text}]
    tok = llm.get_tokenizer()
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    enc = len(tok.encode(rendered, add_special_tokens=False))  # the chat's encoder prompt
    body = {"model": "tiny", "prompt": text, "max_tokens": 3, "ignore_eos": True}
    status, _, got = server.request("POST", "/v1/completions", body)
    assert status == 200 and got["usage"]["prompt_tokens"] == 2, got  # the decoder prompt's
    opts = {"include_usage": True, "continuous_usage_stats": True}
    events = server.stream({**body, "stream": True, "stream_options": opts})
    assert {e["usage"]["prompt_tokens"] for e in events} == {2}, events
    chat = {"model": "tiny", "messages": messages, "max_tokens": 3}
    status, _, got = server.request("POST", "/v1/chat/completions", chat)
    assert status == 200, got
    assert got["usage"]["prompt_tokens"] == 2 + enc, got  # vLLM's chat: encoder + decoder
    for extra in ({"echo": True}, {"echo": True, "max_tokens": 0, "logprobs": 1}):
        status, _, got = server.request("POST", "/v1/completions", {**body, **extra})
        assert status == 400 and got["error"]["param"] == "echo", got
    long = {"model": "tiny", "prompt": list(range(3, 67)), "max_tokens": 2}
    status, _, got = server.request("POST", "/v1/completions", long)
    assert status == 400 and "your encoder prompt has 64 tokens" in got["error"]["message"], got
