"""`paged-server -tp 2` (and `-pp 2`): two ranks behind the HTTP front answer the official
`openai` client with what the single-process server answers; stopping the server stops them."""

from __future__ import annotations

import pytest
from procs import wait_gone
from server_proc import REAL_ARGS, ServerProc, greedy_answers, launch

openai = pytest.importorskip("openai")


def _worker_pids(server: ServerProc) -> list[int]:
    """The server's child processes (its worker ranks)."""
    with open(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children") as f:
        return [int(p) for p in f.read().split()]


@pytest.mark.parametrize("flag", ["-tp", "-pp"])
def test_parallel_server_answers_like_one_process(real_server, tiny_model, flag):
    want = greedy_answers(real_server)
    server = launch(["--model", tiny_model, flag, "2", *REAL_ARGS], fake=False)
    try:
        workers = _worker_pids(server)
        assert workers, "no worker rank was started"
        assert greedy_answers(server) == want
        status, _, body = server.request("GET", "/health")
        assert status == 200, body
    finally:
        assert server.stop() == 0, "".join(server.lines[-30:])
    assert wait_gone(workers, timeout=10) == []
