"""Worker ranks die with their engine: after a normal exit, `del llm`, SIGINT, SIGTERM or SIGKILL
of the engine's process (and the forkserver they forked from dies with the process); and a rank
killed mid-run fails the engine's calls with a clear `EngineDeadError` instead of hanging.

One owner process (tp_owner.py) serves the cases that leave it running, each with an engine of
its own; a case that ends the process (exit, a signal) leaves the next one a fresh process."""

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
    def __init__(self, model: str) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, str(OWNER), model],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.lines: list[str] = []
        self.idle = True  # waiting for a mode: another case may use it
        self.all_pids: list[int] = []  # every rank of every engine it built
        self.pids: list[int] = []
        self.forkserver = 0

    def engine(self, mode: str) -> None:
        """A fresh engine in this process running `mode`; its ranks in `pids`."""
        assert self.idle
        self.idle = False
        self.proc.stdin.write(mode + "\n")
        self.proc.stdin.flush()
        self.pids = json.loads(self.wait_for("PIDS").split(" ", 1)[1])
        self.forkserver = int(self.wait_for("FORKSERVER").split()[1])
        self.all_pids += self.pids
        assert self.pids and all(pid_running(p) for p in [*self.pids, self.forkserver])

    def done(self) -> None:
        self.wait_for("DONE")
        self.idle = True

    def wait_for(self, prefix: str) -> str:
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith(prefix):
                return line.strip()
            if line.startswith("DONE"):  # the mode ended without it: fail, not wait for more
                break
        raise AssertionError(f"no {prefix!r} line:\n" + "".join(self.lines[-40:]))

    def finish(self, timeout: float = 120.0) -> int:
        self.idle = False
        try:
            out, _ = self.proc.communicate(timeout=timeout)  # closes stdin: the owner returns
        except subprocess.TimeoutExpired as e:
            self.proc.send_signal(signal.SIGUSR1)  # tp_owner.py dumps every thread's stack
            time.sleep(2.0)
            self.proc.kill()
            out, _ = self.proc.communicate()
            hung = "the engine's process hung:\n" + "".join(self.lines) + out
            raise AssertionError(hung) from e
        self.lines.append(out)
        return self.proc.returncode


@pytest.fixture(scope="module")
def owners(model):
    """owners() -> an idle owner process: the last one while it waits for a mode, else a new
    one. At the end, an owner still up exits 0 when its stdin closes (after engines that were
    deleted or died), and no rank of its engines, nor its forkserver, outlives it."""
    started: list[Owner] = []

    def get() -> Owner:
        if not started or not started[-1].idle:
            if started and started[-1].proc.poll() is None:  # a failed case left it busy
                started[-1].proc.kill()
                started[-1].finish()
            started.append(Owner(model))
        return started[-1]

    yield get
    last = started[-1] if started else None
    if last is not None and last.idle:
        assert last.finish() == 0, "".join(last.lines[-40:])
        assert wait_gone([*last.all_pids, last.forkserver]) == []


def test_del_llm_stops_the_workers(owners):
    owner = owners()
    owner.engine("del")
    owner.wait_for("DELETED")
    assert wait_gone(owner.pids) == []
    owner.done()  # the owner itself goes on
    assert owner.proc.poll() is None


def test_a_killed_worker_fails_the_engine_instead_of_hanging(owners):
    owner = owners()
    owner.engine("kill-worker")
    health = owner.wait_for("HEALTH")
    assert "paged-worker-1" in health and "exited with -9" in health, health
    first = owner.wait_for("DEAD1")
    second = owner.wait_for("DEAD2")
    assert "paged-worker-1" in first and "exited with -9" in first, first
    assert "exited with -9" in second
    owner.done()
    assert wait_gone(owner.pids) == []


def test_an_exception_in_the_workers_fails_the_engine_and_ends_them(owners):
    owner = owners()
    owner.engine("worker-error")
    first = owner.wait_for("DEAD1")
    assert "no_such_method" in first or "exited with" in first, first
    assert "cannot continue" in owner.wait_for("DEAD2")
    owner.done()
    assert wait_gone(owner.pids) == []


def test_normal_exit_without_shutdown_stops_the_workers(owners):
    owner = owners()
    owner.engine("exit")
    assert owner.finish() == 0, "".join(owner.lines[-40:])
    assert wait_gone([*owner.all_pids, owner.forkserver]) == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_workers_die_with_a_signalled_engine(owners, sig):
    owner = owners()
    owner.engine("loop")
    owner.wait_for("STEP")  # looping: the next generate has begun
    owner.proc.send_signal(sig)
    owner.finish()
    assert wait_gone([*owner.pids, owner.forkserver]) == [], "".join(owner.lines[-40:])
