"""vLLM's `VLLM_PP_LAYER_PARTITION` ("1,3": the decoder layers of each pipeline stage): every
caller splits by it (the stacks built, the weights loaded, each stage's KV caches, LongCat's two
caches a layer), a malformed one is refused by name before any rank starts, and a world of two
gloo ranks split "1,3" gives the single-process engine's outputs."""

from __future__ import annotations

import pytest
from test_world_sizes import _assert_same, _built_layers, _outputs

from paged_engine import LLM
from paged_engine.distributed import parallel_state
from paged_engine.distributed.parallel_state import (
    ParallelState,
    check_model_parallelism,
    decoder_layer_count,
    stage_layers,
    stage_sizes,
)
from paged_engine.engine import llm_engine
from paged_engine.testing import tiny_config, write_tiny_model
from paged_engine.worker.cache_engine import kv_layers

pytest.importorskip("transformers")

ENV = "VLLM_PP_LAYER_PARTITION"


def test_the_partition_replaces_the_default_split(monkeypatch):
    assert stage_sizes(4, 2) == [2, 2]
    monkeypatch.setenv(ENV, "1,3")
    assert stage_sizes(4, 2) == [1, 3]
    assert [stage_layers(4, r, 2) for r in range(2)] == [(0, 1), (1, 4)]
    monkeypatch.setenv(ENV, " 3, 1")  # int() takes the spaces, as in vLLM
    assert [stage_layers(4, r, 2) for r in range(2)] == [(0, 3), (3, 4)]
    monkeypatch.setenv(ENV, "2,1,3")
    assert [stage_layers(6, r, 3) for r in range(3)] == [(0, 2), (2, 3), (3, 6)]
    # one stage holds every layer whatever the variable says
    monkeypatch.setenv(ENV, "1,3")
    assert stage_sizes(4, 1) == [4]
    check_model_parallelism(tiny_config("llama", num_hidden_layers=4), 2, 1)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("2,2,1", r"VLLM_PP_LAYER_PARTITION='2,2,1' names 3 stages, pipeline_parallel_size=2"),
        ("4", r"VLLM_PP_LAYER_PARTITION='4' names 1 stages, pipeline_parallel_size=2"),
        ("1,2", r"VLLM_PP_LAYER_PARTITION='1,2' sums to 3 layers; the model has 4 decoder"),
        ("3,3", r"VLLM_PP_LAYER_PARTITION='3,3' sums to 6 layers; the model has 4 decoder"),
        ("a,b", r"VLLM_PP_LAYER_PARTITION='a,b' must be the decoder layers of each pipeline"),
        ("1,3,", r"VLLM_PP_LAYER_PARTITION='1,3,' must be the decoder layers"),
        ("", r"VLLM_PP_LAYER_PARTITION='' must be the decoder layers"),
        ("1.5,2.5", r"VLLM_PP_LAYER_PARTITION='1.5,2.5' must be the decoder layers"),
        ("0,4", r"VLLM_PP_LAYER_PARTITION='0,4': every pipeline stage must hold at least one"),
        ("-1,5", r"VLLM_PP_LAYER_PARTITION='-1,5': every pipeline stage must hold at least one"),
    ],
)
def test_a_bad_partition_is_refused_by_name(monkeypatch, value, message):
    monkeypatch.setenv(ENV, value)
    llama = tiny_config("llama", num_hidden_layers=4)
    with pytest.raises(ValueError, match=message):
        check_model_parallelism(llama, 1, 2)
    with pytest.raises(ValueError, match=message):  # and by every caller of the split
        stage_layers(4, 0, 2)


def _stage_kv_layers(monkeypatch, hf_config, pp_size: int) -> list[int]:
    """How many KV cache entries each stage's rank allocates (TP 1)."""
    counts = []
    for rank in range(pp_size):
        state = ParallelState(rank, pp_size, 1, pp_size, None, None, None)
        monkeypatch.setattr(parallel_state, "_state", state)
        counts.append(len(kv_layers(hf_config)))
    monkeypatch.setattr(parallel_state, "_state", parallel_state._SINGLE)
    return counts


def test_each_stage_caches_the_layers_it_builds(monkeypatch):
    llama = tiny_config("llama", num_hidden_layers=4)
    monkeypatch.setenv(ENV, "1,3")
    assert _stage_kv_layers(monkeypatch, llama, 2) == [1, 3]
    # LongCat-Flash: two caches a layer (HF's num_hidden_layers counts them); the partition
    # and the stages count its num_layers, and a layer's two caches stay on its stage
    arch = {"architectures": ["LongcatFlashForCausalLM"]}
    longcat = tiny_config("longcat_flash", num_layers=3, **arch)
    assert longcat.num_hidden_layers == 6 and decoder_layer_count(longcat) == 3
    monkeypatch.setenv(ENV, "1,2")
    check_model_parallelism(longcat, 1, 2)
    assert _stage_kv_layers(monkeypatch, longcat, 2) == [2, 4]
    monkeypatch.setenv(ENV, "2,4")
    with pytest.raises(ValueError, match="sums to 6 layers; the model has 3 decoder layers"):
        check_model_parallelism(longcat, 1, 2)
    monkeypatch.delenv(ENV)
    assert _stage_kv_layers(monkeypatch, longcat, 2) == [4, 2]  # the default [2, 1], paired


def _kv_cache_layers(worker) -> int:
    return len(worker.model_runner.cache.kv_caches)


PROBES = (_built_layers, _kv_cache_layers)  # each rank's built decoder layers and KV caches


@pytest.mark.slow
def test_pp2_split_one_and_three_matches_one_process(tmp_path, monkeypatch):
    path = write_tiny_model(tmp_path, "llama", seed=3, num_hidden_layers=4)
    want, _ = _outputs(path)
    monkeypatch.setenv(ENV, "1,3")  # the spawned workers inherit it
    got, (built, cached) = _outputs(path, PROBES, pipeline_parallel_size=2)
    _assert_same(got, want)
    assert built == [[0], [1, 2, 3]]
    assert cached == [1, 3]


def test_the_engine_refuses_a_bad_partition_before_starting_a_rank(tmp_path, monkeypatch):
    path = write_tiny_model(tmp_path, "llama", seed=3, num_hidden_layers=4)

    def no_ranks(*args, **kwargs):
        raise AssertionError("the engine started its ranks")

    monkeypatch.setattr(llm_engine, "MultiprocExecutor", no_ranks)
    monkeypatch.setenv(ENV, "1,2")
    with pytest.raises(ValueError, match="sums to 3 layers; the model has 4 decoder layers"):
        LLM(model=str(path), dtype="float32", max_model_len=128, pipeline_parallel_size=2)


@pytest.mark.slow
def test_longcat_stages_keep_each_layers_two_caches(tmp_path, monkeypatch):
    """3 layers (6 caches) over 2 stages, the default [2, 1] and the partition "1,2": the
    stages split layers, not caches, so no stage gets half of a layer's pair."""
    path = write_tiny_model(tmp_path, "longcat_flash", seed=3, num_layers=3)
    want, _ = _outputs(path)
    got, (_, cached) = _outputs(path, PROBES, pipeline_parallel_size=2)
    _assert_same(got, want)
    assert cached == [4, 2]
    monkeypatch.setenv(ENV, "1,2")
    got, (built, cached) = _outputs(path, PROBES, pipeline_parallel_size=2)
    _assert_same(got, want)
    assert (built, cached) == ([[0], [1, 2]], [2, 4])
