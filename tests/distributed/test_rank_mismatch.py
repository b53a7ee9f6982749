"""Ranks launched the torchrun way (each process parses its own arguments) with different
arguments: both ranks refuse to start, naming what differs, instead of serving rank 1's other
model or sizes silently (world size 2, gloo, the environment torchrun sets)."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest

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


def test_ranks_with_other_arguments_refuse_by_name(tmp_path) -> None:
    """Rank 1 gets another model (same config, other weights), max_model_len and seed: both
    ranks exit with a ValueError naming the three, and soon (no collective waits forever)."""
    models = [str(write_tiny_model(tmp_path / f"m{s}", "gpt_neox", seed=s)) for s in (4, 5)]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    env.update(WORLD_SIZE="2", LOCAL_WORLD_SIZE="1", LOCAL_RANK="0", OMP_NUM_THREADS="1")
    args = [(models[0], "128", "0"), (models[1], "64", "1")]
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK, *args[rank]],
            env={**env, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        logs = [r.communicate(timeout=150)[0] for r in ranks]
    finally:
        for r in ranks:
            r.kill()
    assert [r.returncode for r in ranks] == [1, 1], "\n---\n".join(logs)
    for log in logs:
        error = next((ln for ln in log.splitlines() if "ValueError: " in ln), log[-3000:])
        assert "launched with different arguments" in error, error
        assert "model (rank 0: " in error and "max_model_len (rank 0: 128, rank 1: 64)" in error
        assert "seed (rank 0: 0, rank 1: 1)" in error
        assert "dtype" not in error  # only what differs


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


def test_a_rank_that_never_joins_is_an_error_not_a_hang(tmp_path) -> None:
    """Rank 1 died at start (never launched here): rank 0 gives up joining after
    PAGED_DIST_JOIN_TIMEOUT_S and names the wait (it used to wait for a year)."""
    model = str(write_tiny_model(tmp_path / "m", "gpt_neox", seed=4))
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    env.update(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    env.update(OMP_NUM_THREADS="1", PAGED_DIST_JOIN_TIMEOUT_S="3")
    rank0 = subprocess.Popen(
        [sys.executable, "-c", _RANK, model, "128", "0"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        log = rank0.communicate(timeout=90)[0]
    finally:
        rank0.kill()
    assert rank0.returncode == 1, log
    assert "rank 0 of 2: the other ranks did not join the world (env://) within 3s" in log, log
