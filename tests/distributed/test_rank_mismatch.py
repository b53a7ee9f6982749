"""Ranks launched the torchrun way (each process parses its own arguments) with different
arguments: both ranks refuse to start, naming what differs, instead of serving rank 1's other
model or sizes silently (world size 2, gloo, the environment torchrun sets)."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import torch.distributed as dist

from paged_engine import LLM, SamplingParams
from paged_engine.distributed.launch import free_port, launch_fingerprint, launch_mismatch
from paged_engine.testing import write_tiny_model

_RANK = """
import sys
from paged_engine import LLM, SamplingParams
model, max_model_len, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = LLM(model=model, dtype="float32", max_model_len=max_model_len, seed=seed,
          tensor_parallel_size=2)
llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
llm.llm_engine.shutdown()
"""


def _torchrun_rank0(monkeypatch, port: int, join_timeout_s: int) -> None:
    """This process as rank 0 of a world of 2 launched the torchrun way (its own arguments)."""
    for name, value in {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": "2",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "PAGED_DIST_JOIN_TIMEOUT_S": str(join_timeout_s),
    }.items():
        monkeypatch.setenv(name, value)


def _assert_names_the_differences(error: str) -> None:
    assert "launched with different arguments" in error, error
    assert "model (rank 0: " in error and "max_model_len (rank 0: 128, rank 1: 64)" in error
    assert "seed (rank 0: 0, rank 1: 1)" in error
    assert "dtype" not in error  # only what differs


def test_ranks_with_other_arguments_refuse_by_name(tmp_path, monkeypatch) -> None:
    """Rank 1 (a process of its own) gets another model (same config, other weights),
    max_model_len and seed than rank 0 (this process): both raise a ValueError naming the
    three, and soon (no collective waits forever; rank 1 exits with code 1)."""
    models = [str(write_tiny_model(tmp_path / f"m{s}", "gpt_neox", seed=s)) for s in (4, 5)]
    port = free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    env.update(WORLD_SIZE="2", RANK="1", LOCAL_WORLD_SIZE="1", LOCAL_RANK="0")
    env.update(OMP_NUM_THREADS="1")
    rank1 = subprocess.Popen(
        [sys.executable, "-c", _RANK, models[1], "64", "1"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        _torchrun_rank0(monkeypatch, port, join_timeout_s=150)  # rank 1 imports meanwhile
        try:
            llm = LLM(
                model=models[0], dtype="float32", max_model_len=128, seed=0, tensor_parallel_size=2
            )
        except ValueError as e:
            rank0_error = str(e)
        else:
            llm.llm_engine.shutdown()
            pytest.fail("rank 0 served rank 1's other arguments")
        log = rank1.communicate(timeout=150)[0]
    finally:
        rank1.kill()
    _assert_names_the_differences(rank0_error)
    assert not dist.is_initialized()  # rank 0 left the world it refused
    assert rank1.returncode == 1, log
    error = next((ln for ln in log.splitlines() if "ValueError: " in ln), log[-3000:])
    _assert_names_the_differences(error)


def _process(x):  # a module-level logits processor
    return x


@pytest.mark.parametrize("same", [True, False])
def test_fingerprints_are_stable_across_processes(same: bool) -> None:
    """Values without JSON (functions, classes) are compared by qualified name, never by a
    repr holding a memory address; unknown fields are ignored."""
    config = types.SimpleNamespace(model="m", max_model_len=64, logits_processors=[_process])
    config.worker_extension_cls = _process if same else launch_mismatch
    other = types.SimpleNamespace(**{**vars(config), "worker_extension_cls": _process})
    prints = [launch_fingerprint(config), launch_fingerprint(other)]
    assert "0x" not in prints[0]["worker_extension_cls"]
    found = launch_mismatch(prints)
    assert (found is None) == same
    if not same:
        assert found is not None and "worker_extension_cls (rank 0: " in found


def test_a_rank_that_never_joins_is_an_error_not_a_hang(tmp_path, monkeypatch) -> None:
    """Rank 1 died at start (never launched here): rank 0 (this process) gives up joining
    after PAGED_DIST_JOIN_TIMEOUT_S and names the wait (it used to wait for a year). The same
    process then starts a parallel engine: torch's default-group name counter, bumped by the
    failed join, is reset (else this rank's group is "1" and its new rank's "0": a hang)."""
    model = str(write_tiny_model(tmp_path / "m", "gpt_neox", seed=4))
    _torchrun_rank0(monkeypatch, free_port(), join_timeout_s=1)
    wait = r"rank 0 of 2: the other ranks did not join the world \(env://\) within 1s"
    with pytest.raises(RuntimeError, match=wait):
        LLM(model=model, dtype="float32", max_model_len=128, tensor_parallel_size=2)
    assert not dist.is_initialized()
    monkeypatch.undo()  # no torchrun environment: rank 1 is started here
    monkeypatch.setenv("PAGED_DIST_JOIN_TIMEOUT_S", "60")  # a hang fails the test in a minute
    llm = LLM(model=model, dtype="float32", max_model_len=128, tensor_parallel_size=2)
    try:
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 2
    finally:
        llm.llm_engine.shutdown()
