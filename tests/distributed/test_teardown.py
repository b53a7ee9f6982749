"""Worker ranks die with their engine: after a normal exit, `del llm`, SIGINT, SIGTERM or SIGKILL
of the engine's process (and the forkserver they forked from dies with the process); and a rank
killed mid-run fails the engine's calls with a clear `EngineDeadError` instead of hanging."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from procs import pid_running, wait_gone

from paged_engine.testing import write_tiny_model

OWNER = Path(__file__).with_name("tp_owner.py")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny"), "llama"))


class Owner:
    def __init__(self, model: str, mode: str) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, str(OWNER), model, mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.lines: list[str] = []
        self.pids = json.loads(self.wait_for("PIDS").split(" ", 1)[1])
        self.forkserver = int(self.wait_for("FORKSERVER").split()[1])
        assert self.pids and all(pid_running(p) for p in [*self.pids, self.forkserver])

    def wait_for(self, prefix: str) -> str:
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith(prefix):
                return line.strip()
        raise AssertionError(f"no {prefix!r} line:\n" + "".join(self.lines[-40:]))

    def finish(self, timeout: float = 120.0) -> int:
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as e:
            self.proc.send_signal(signal.SIGUSR1)  # tp_owner.py dumps every thread's stack
            time.sleep(2.0)
            self.proc.kill()
            out, _ = self.proc.communicate()
            hung = "the engine's process hung:\n" + "".join(self.lines) + out
            raise AssertionError(hung) from e
        self.lines.append(out)
        return self.proc.returncode


def test_normal_exit_without_shutdown_stops_the_workers(model):
    owner = Owner(model, "exit")
    assert owner.finish() == 0, "".join(owner.lines[-40:])
    assert wait_gone([*owner.pids, owner.forkserver]) == []


def test_del_llm_stops_the_workers(model):
    owner = Owner(model, "del")
    owner.wait_for("DELETED")
    try:
        assert wait_gone(owner.pids) == []
        assert owner.proc.poll() is None  # the owner itself goes on
    finally:
        owner.proc.kill()
        owner.finish()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_workers_die_with_a_signalled_engine(model, sig):
    owner = Owner(model, "loop")
    owner.wait_for("STEP")  # looping: the next generate has begun
    owner.proc.send_signal(sig)
    owner.finish()
    assert wait_gone([*owner.pids, owner.forkserver]) == [], "".join(owner.lines[-40:])


def test_a_killed_worker_fails_the_engine_instead_of_hanging(model):
    owner = Owner(model, "kill-worker")
    health = owner.wait_for("HEALTH")
    assert "paged-worker-1" in health and "exited with -9" in health, health
    first = owner.wait_for("DEAD1")
    second = owner.wait_for("DEAD2")
    assert "paged-worker-1" in first and "exited with -9" in first, first
    assert "exited with -9" in second
    assert owner.finish() == 0
    assert wait_gone(owner.pids) == []


def test_an_exception_in_the_workers_fails_the_engine_and_ends_them(model):
    owner = Owner(model, "worker-error")
    first = owner.wait_for("DEAD1")
    assert "no_such_method" in first or "exited with" in first, first
    assert "cannot continue" in owner.wait_for("DEAD2")
    assert owner.finish() == 0
    assert wait_gone(owner.pids) == []
