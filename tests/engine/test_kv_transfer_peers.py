"""KV transfer with misbehaving peers (kv_transfer/): storage that refuses writes, two producers
that collide on a temporary name, a FIFO under a block's name, and vLLM's config fields. The
engine serves on with the no-transfer tokens; bad options are a ValueError naming the field."""

from __future__ import annotations

import contextlib
import os
import threading
import types

import pytest
import torch

from paged_engine import LLM, SamplingParams
from paged_engine.kv_transfer import storage
from paged_engine.kv_transfer.config import KVTransferConfig

BS = 16
PROMPTS = [[(5 * i + 3 * j) % 400 + 7 for j in range(n)] for i, n in enumerate((37, 50))]
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _kv(role: str, path) -> dict:
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": str(path)},
    }


def _tokens(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("llama")


def test_a_producer_whose_storage_refuses_writes_serves_on(model_dir, tmp_path, caplog):
    """The storage directory replaced by a file after start (every write fails, as on a full
    disk or a revoked permission): the requests finish with the tokens they get once storage
    works again, one warning is logged, and nothing is stored until it does."""
    store = tmp_path / "kv"
    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        max_model_len=128,
        num_gpu_blocks_override=32,
        kv_transfer_config=_kv("kv_producer", store),
    )
    try:
        os.rmdir(store)
        store.write_bytes(b"not a directory")
        with caplog.at_level("WARNING", logger="paged_engine.kv_transfer.block_io"):
            broken = _tokens(llm)
        warned = [r for r in caplog.records if "could not be saved" in r.getMessage()]
        store.unlink()
        store.mkdir()
        assert llm.llm_engine.reset_prefix_cache()  # computed (and saved) again
        working = _tokens(llm)
    finally:
        llm.llm_engine.shutdown()
    assert broken == working and all(len(t) == GREEDY.max_tokens for t in broken)
    assert len(warned) == 1
    assert len(os.listdir(store)) == sum(len(p) // BS for p in PROMPTS)


def test_a_storage_path_that_cannot_be_a_directory_is_refused_by_name(model_dir, tmp_path):
    (tmp_path / "file").write_bytes(b"")
    kv = _kv("kv_producer", tmp_path / "file" / "kv")
    with pytest.raises(ValueError, match="shared_storage_path"):
        LLM(model=str(model_dir), dtype="float32", max_model_len=64, kv_transfer_config=kv)


def _block(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(f"k{i}", torch.randn(BS, 2, 8, generator=g)) for i in range(2)]


def test_two_producers_with_the_same_pid_and_thread_do_not_collide(tmp_path, monkeypatch):
    """Producers on two hosts sharing the directory may have the same pid and thread id (each
    in its own container, say): a write of the same key that starts while another is between
    its write and its rename must not share its temporary file. Simulated in one thread: the
    first writer's rename runs a whole second write first."""
    path, key = str(tmp_path / "blk.tp0of1.kv"), "ab" * 32
    first, second = _block(0), _block(1)
    rename, nested = os.replace, []

    def replace_after_another_write(src, dst):
        if not nested:
            nested.append(src)
            storage.write_block(path, key, second)
        rename(src, dst)

    monkeypatch.setattr(storage.os, "replace", replace_after_another_write)
    storage.write_block(path, key, first)  # raised FileNotFoundError with a pid-and-thread name
    spec = [(n, "float32", tuple(t.shape)) for n, t in first]
    got = storage.read_block(path, key, spec)
    assert got is not None and all(torch.equal(g, t) for g, (_, t) in zip(got, first))
    assert sorted(os.listdir(tmp_path)) == ["blk.tp0of1.kv"]  # no temporary file left


def _returns_within(fn, timeout: float):
    box: list = []
    t = threading.Thread(target=lambda: box.append(fn()), daemon=True)
    t.start()
    t.join(timeout)
    assert box, f"{fn} still blocked after {timeout}s"
    return box[0]


def test_a_fifo_under_a_block_name_is_a_miss_not_a_hang(tmp_path):
    """A FIFO (or device) under a block's name: opening it for reading would wait for a
    writer forever; the lookup and the load call it a miss at once."""
    path, key = str(tmp_path / "blk.tp0of1.kv"), "cd" * 32
    os.mkfifo(path)
    spec = [("k0", "float32", (BS, 2, 8))]
    try:
        assert _returns_within(lambda: storage.check_block(path, key, spec), 10) is False
        assert _returns_within(lambda: storage.read_block(path, key, spec), 10) is None
        assert storage.check_block("/dev/zero", key, spec) is False
    finally:  # un-block a reader the old code left waiting (ENXIO when none waits)
        with contextlib.suppress(OSError):
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


@pytest.mark.parametrize("extra", [[], 0, "", False])
def test_extra_config_of_another_type_is_refused(extra):
    value = {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}
    with pytest.raises(ValueError, match="kv_connector_extra_config"):
        KVTransferConfig.parse({**value, "kv_connector_extra_config": extra})


def test_vllm_kv_load_failure_policy():
    """vLLM's field: "recompute" (its default, what paged does) is accepted in both forms;
    "fail" (vLLM: the request ends with an error) and anything else are refused by name."""
    base = {"kv_connector": "ExampleConnector", "kv_role": "kv_consumer"}
    assert KVTransferConfig.parse({**base, "kv_load_failure_policy": "recompute"}).loads
    obj = types.SimpleNamespace(**base, kv_load_failure_policy="recompute")
    assert KVTransferConfig.parse(obj).loads
    for policy in ("fail", "retry", 1):
        with pytest.raises(ValueError, match="kv_load_failure_policy"):
            KVTransferConfig.parse({**base, "kv_load_failure_policy": policy})
    with pytest.raises(ValueError, match="kv_load_failure_policy"):
        KVTransferConfig.parse(types.SimpleNamespace(**base, kv_load_failure_policy="fail"))
