"""`paged-server -tp 2` (and `-pp 2`): two ranks behind the HTTP front answer the official
`openai` client with what the single-process server answers; stopping the server stops them."""

from __future__ import annotations

import os
import signal

import pytest
from procs import wait_gone
from server_proc import REAL_ARGS, ServerProc, greedy_answers, launch

openai = pytest.importorskip("openai")


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def _worker_pids(server: ServerProc) -> list[int]:
    """The server's child processes (the forkserver, or the ranks it spawned) and theirs."""
    children = _children(server.proc.pid)
    return children + [g for c in children for g in _children(c)]


def _rank_pids(server: ServerProc) -> list[int]:
    """Worker ranks: the forkserver's children (a forked rank shares its command line), or
    the server's own children running multiprocessing's spawn main."""
    ranks = []
    for child in _children(server.proc.pid):
        with open(f"/proc/{child}/cmdline", "rb") as f:
            spawned = b"spawn_main" in f.read()
        ranks += [child] if spawned else _children(child)
    return ranks


@pytest.mark.parametrize("flag", ["-tp", "-pp"])
def test_parallel_server_answers_like_one_process(real_server, tiny_model, flag):
    """-pp also loses rank 1 while idle: the server finds it within a second or two, shuts
    down and exits with 1 (vLLM's behaviour; PAGED_KEEP_ALIVE_ON_ENGINE_DEATH=1 keeps it)."""
    want = greedy_answers(real_server)
    server = launch(["--model", tiny_model, flag, "2", *REAL_ARGS], fake=False)
    try:
        workers = _worker_pids(server)
        assert workers, "no worker rank was started"
        assert greedy_answers(server) == want
        status, _, body = server.request("GET", "/health")
        assert status == 200, body
        if flag == "-pp":
            ranks = _rank_pids(server)
            assert len(ranks) == 1, ranks
            os.kill(ranks[0], signal.SIGKILL)
            assert server.proc.wait(30) == 1, "".join(server.lines[-30:])
            log = "".join(server.lines)
            assert f"exited with {-signal.SIGKILL}" in log and "exiting with code 1" in log
    finally:
        code = server.stop()
        assert code == (1 if flag == "-pp" else 0), "".join(server.lines[-30:])
    assert wait_gone(workers) == []  # (30 s: a hang bound; a loaded machine exits slowly)
