"""/v1/completions over BART (models/bart.py, engine/encoder_prompt.py) against `LLM.generate`.

The tiny random BART of tests/engine/test_bart.py behind the server in this process: as vLLM
0.10 maps it, a completion's `prompt` (text or token ids) is the encoder prompt and the decoder
starts from its default prompt; the answer is the engine's greedy output for the same prompt.
A prompt the encoder cannot take is a 400 naming it.
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
