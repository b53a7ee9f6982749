"""Review of session 4's engine changes: regressions found by probing them.

- check_token_ids (input_processor.py) ran an ABC isinstance per id on every prompt (~8x slower
  on a 128k-id prompt): plain ints must take the fast path, numpy's integers still convert.
- config_views.py: copy.copy / copy.deepcopy of a view raised AttributeError (the default copy
  rebuilds the slot with setattr, which a read-only view refuses); pickling named `_engine` as
  an LLM(...) argument.
- kv_transfer/block_io.py: a storage failing some writes of every step (a nearly full disk)
  logged its warning on every step that saved; one per spell of failures now.
- distributed/launch.py: torchrun ranks whose KV-transfer storage is the same shared storage
  mounted at another path per node refused to start (a false launch mismatch); a differing
  path only costs misses, so connector and role are compared, the path is not.
"""

from __future__ import annotations

import copy
import itertools
import logging
import numbers
import os
import pickle
from types import SimpleNamespace

import numpy as np
import pytest

from paged_engine import LLM, SamplingParams
from paged_engine.config_views import CacheConfig, ModelConfig, VllmConfig
from paged_engine.engine import input_processor
from paged_engine.engine.input_processor import check_token_ids
from paged_engine.kv_transfer import block_io


class _CountingMeta(type):
    calls = 0

    def __instancecheck__(cls, obj: object) -> bool:
        _CountingMeta.calls += 1
        return isinstance(obj, numbers.Integral)


class _CountingIntegral(metaclass=_CountingMeta):
    pass


def test_check_token_ids_plain_ints_skip_the_abc_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(input_processor, "numbers", SimpleNamespace(Integral=_CountingIntegral))
    _CountingMeta.calls = 0
    ids = list(range(5000))
    out = check_token_ids(ids, 5000, "prompt")
    assert out == ids and out is not ids
    assert _CountingMeta.calls == 0  # one per id before the fix
    # the slow path still serves numpy's integers and refuses the rest by name
    assert check_token_ids(list(np.arange(3, dtype=np.int64)), 10, "prompt") == [0, 1, 2]
    assert all(type(t) is int for t in check_token_ids(list(np.arange(3)), 10, "prompt"))
    for bad in ([1, True], [1, 2.0], [1, "2"], [1, 10], [-1]):
        with pytest.raises(ValueError, match=r"prompt token ids must be ints in \[0, 10\)"):
            check_token_ids(bad, 10, "prompt")


def _engine() -> SimpleNamespace:
    config = SimpleNamespace(
        model="m", tokenizer=None, max_model_len=64, block_size=16, kv_cache_dtype="auto"
    )
    return SimpleNamespace(config=config, num_blocks=9)


def test_config_views_copy_as_views_of_the_same_engine() -> None:
    engine = _engine()
    for view in (ModelConfig(engine), CacheConfig(engine), VllmConfig(engine)):
        for made in (copy.copy(view), copy.deepcopy(view)):
            assert type(made) is type(view) and made._engine is engine
    assert copy.deepcopy(VllmConfig(engine)).model_config.max_model_len == 64
    assert copy.copy(CacheConfig(engine)).num_gpu_blocks == 9
    engine.config.max_model_len = 32  # still a view: it reads the engine as it is now
    assert copy.deepcopy(ModelConfig(engine)).max_model_len == 32
    with pytest.raises(TypeError, match="ModelConfig is a view of a running engine"):
        pickle.dumps(ModelConfig(engine))


def test_partly_failing_kv_saves_warn_once_per_spell(
    tiny_model_factory, tmp_path, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    real = block_io.write_block
    count = itertools.count()
    failing = [True]

    def nearly_full(path: str, key: str, tensors: list) -> None:  # every other write: ENOSPC
        if failing[0] and next(count) % 2:
            raise OSError(28, "No space left on device")
        real(path, key, tensors)

    monkeypatch.setattr(block_io, "write_block", nearly_full)
    store = tmp_path / "kv"
    llm = LLM(
        model=str(tiny_model_factory("llama")),
        dtype="float32",
        max_model_len=128,
        num_gpu_blocks_override=64,
        kv_transfer_config={
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": str(store)},
        },
    )
    greedy = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

    def run(i: int) -> None:  # a new prompt of 4 blocks
        prompt = [(7 * i + 3 * j) % 400 + 7 for j in range(64)]
        llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)

    try:
        with caplog.at_level(logging.WARNING, logger="paged_engine.kv_transfer.block_io"):
            for i in range(5):
                run(i)
            failing[0] = False
            run(5)  # every save works: the next failure is news again
            failing[0] = True
            run(6)
    finally:
        llm.llm_engine.shutdown()
    warned = [r for r in caplog.records if "could not be saved" in r.getMessage()]
    assert len(warned) == 2  # one a step before the fix (6)
    assert len(os.listdir(store)) == 5 * 2 + 4 + 2


def test_one_token_id_prompt_list_skips_the_abc_check(monkeypatch: pytest.MonkeyPatch) -> None:
    from paged_engine import llm as llm_module

    monkeypatch.setattr(llm_module, "numbers", SimpleNamespace(Integral=_CountingIntegral))
    _CountingMeta.calls = 0
    assert llm_module._as_prompt_list(list(range(5000))) == [list(range(5000))]
    assert _CountingMeta.calls == 0  # one per id before the fix
    assert llm_module._as_prompt_list(list(np.arange(3))) == [[0, 1, 2]]  # numpy's: one prompt


def test_launch_fingerprint_ignores_a_per_node_kv_storage_path() -> None:
    from paged_engine.config import EngineConfig
    from paged_engine.distributed.launch import launch_fingerprint, launch_mismatch

    def rank(path: str, role: str = "kv_both", **kw) -> dict[str, str]:
        kv = {
            "kv_connector": "ExampleConnector",
            "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": path},
        }
        config = EngineConfig.from_kwargs(
            model="/models/m", tensor_parallel_size=2, kv_transfer_config=kv, **kw
        )
        return launch_fingerprint(config)

    assert launch_mismatch([rank("/mnt/node0/kv"), rank("/mnt/node1/kv")]) is None
    role = launch_mismatch([rank("/kv"), rank("/kv", "kv_producer")])
    assert role is not None and "kv_transfer_config" in role  # what shapes the work still must
    assert "max_model_len" in (launch_mismatch([rank("/kv"), rank("/kv", max_model_len=64)]) or "")


def test_cached_tokens_are_the_first_admissions_after_a_recompute(tiny_llama_dir) -> None:
    """num_cached_tokens is vLLM's: the prefix-cache hit at the request's first schedule. It
    was the last admission's: a request preempted (recompute) while its prompt was still in
    chunks hit its own blocks when readmitted and reported them (32 here) as cached."""
    from paged_engine.engine.llm_engine import LLMEngine

    engine = LLMEngine(
        model=str(tiny_llama_dir),
        dtype="float32",
        max_model_len=128,
        num_gpu_blocks_override=32,
        max_num_batched_tokens=16,  # the 40-token prompt runs in chunks of 16
    )
    try:
        prompt = {"prompt_token_ids": list(range(100, 140))}  # two full 16-token blocks
        engine.add_request("a", prompt, SamplingParams(max_tokens=4, temperature=0))
        outs = engine.step() + engine.step()  # two chunks: two full blocks, no token yet
        (req,) = engine.scheduler.requests.values()
        engine.scheduler._preempt(req, [])  # recompute: readmitted, its two blocks cached
        while engine.has_unfinished_requests():
            outs += engine.step()
        assert req.num_preemptions == 1 and req.seqs[0].num_cached_tokens == 32
        assert {o.num_cached_tokens for o in outs} == {0}
    finally:
        engine.shutdown()
