"""`paged-server -tp 2` (and `-pp 2`): two ranks behind the HTTP front answer the official
`openai` client with what the single-process server answers; stopping the server stops them."""

from __future__ import annotations

import pytest
from procs import wait_gone
from server_proc import REAL_ARGS, ServerProc, launch

openai = pytest.importorskip("openai")

PROMPTS = ["Hello, my name is", "The capital of France is", "one two three"]


def _answers(server: ServerProc) -> tuple[list[str], str, list[str]]:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="EMPTY", max_retries=0)
    comp = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=8, temperature=0)
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=8,
        temperature=0,
    )
    stream = client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0, stream=True
    )
    pieces = [c.choices[0].text for c in stream if c.choices]
    return [c.text for c in comp.choices], chat.choices[0].message.content, pieces


def _worker_pids(server: ServerProc) -> list[int]:
    """The server's child processes (its worker ranks)."""
    with open(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children") as f:
        return [int(p) for p in f.read().split()]


@pytest.mark.parametrize("flag", ["-tp", "-pp"])
def test_parallel_server_answers_like_one_process(real_server, tiny_model, flag):
    want = _answers(real_server)
    server = launch(["--model", tiny_model, flag, "2", *REAL_ARGS], fake=False)
    try:
        workers = _worker_pids(server)
        assert workers, "no worker rank was started"
        assert _answers(server) == want
        status, _, body = server.request("GET", "/health")
        assert status == 200, body
    finally:
        assert server.stop() == 0, "".join(server.lines[-30:])
    assert wait_gone(workers, timeout=10) == []
