"""`paged-server --logits-processors MODULE:CLASS`: a custom processor behind the OpenAI API,
its per-request arguments in `vllm_xargs`; arguments it refuses are a 400 naming them, and the
server serves on."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from server_proc import REAL_ARGS, launch

openai = pytest.importorskip("openai")

ENGINE_TESTS = Path(__file__).resolve().parents[1] / "engine"  # custom_logits_processors.py


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_custom_processor_behind_the_server(tiny_model):
    path = os.pathsep.join([str(ENGINE_TESTS), os.environ.get("PYTHONPATH", "")])
    args = ["--model", tiny_model, "--logits-processors", "custom_logits_processors:ForceToken"]
    server = launch([*args, *REAL_ARGS], fake=False, env={"PYTHONPATH": path})
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="EMPTY", max_retries=0)
        r = client.completions.create(
            model="tiny",
            prompt="Hello",
            max_tokens=5,
            temperature=0.7,
            logprobs=0,
            extra_body={"vllm_xargs": {"target_token": 65}, "ignore_eos": True},
        )
        tokenizer_ids = r.choices[0].logprobs.tokens
        assert len(tokenizer_ids) == 5 and len(set(tokenizer_ids)) == 1
        plain = client.completions.create(model="tiny", prompt="Hello", max_tokens=5)
        assert plain.choices[0].text != r.choices[0].text
        status, body = _post(
            server.url + "/v1/completions",
            {"model": "tiny", "prompt": "Hi", "max_tokens": 3, "vllm_xargs": {"target_token": -1}},
        )
        assert status == 400 and "target_token" in body["error"]["message"]
        again = client.completions.create(
            model="tiny", prompt="Hi", max_tokens=3, extra_body={"vllm_xargs": {"target_token": 9}}
        )
        assert again.choices[0].finish_reason == "length"
    finally:
        assert server.stop() == 0, "".join(server.lines[-30:])
