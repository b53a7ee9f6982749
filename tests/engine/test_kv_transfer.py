"""KV transfer through shared storage (kv_transfer/, vLLM's kv_transfer_config): a producer
engine prefills prompts (max_tokens=1) and saves their full prompt blocks; a consumer engine
over the same directory loads them instead of computing them and generates exactly what one
plain engine does (greedy tokens identical, logprobs within float noise). A missing, truncated
or foreign file is a miss (computed again), and bad options are refused by name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest

from paged_engine import LLM, SamplingParams
from paged_engine.kv_transfer.config import KVTransferConfig
from paged_engine.kv_transfer.connector import KVConnector

BS = 16
# lengths: 2 full blocks, 48 = 3 full blocks (the last token is computed: 2 load), 3 full
PROMPTS = [[(7 * i + 11 * j) % 480 + 3 for j in range(n)] for i, n in enumerate((40, 48, 61))]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
PREFILL = SamplingParams(temperature=0, max_tokens=1)


def _kv(role: str, path) -> dict:
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": str(path)},
    }


def _llm(model_dir, **kw) -> LLM:
    kw.setdefault("max_model_len", 128)
    kw.setdefault("num_gpu_blocks_override", 64)
    return LLM(model=str(model_dir), dtype="float32", **kw)


def _generate(llm: LLM, prompts, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [
        [(list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
         for c in o.outputs]
        for o in outs
    ]  # fmt: skip


def _assert_same(got, want) -> None:
    assert [[ids for ids, _ in o] for o in got] == [[ids for ids, _ in o] for o in want]
    for g, w in zip(got, want):
        for (_, g_lp), (_, w_lp) in zip(g, w):
            assert g_lp == pytest.approx(w_lp, abs=1e-4)


def _loadable(prompts) -> int:
    """Tokens of full prompt blocks a consumer loads (the last token is always computed)."""
    return sum((len(p) - 1) // BS * BS for p in prompts)


_PRODUCER = """
import json, sys
from paged_engine import LLM, SamplingParams
model, kv, prompts = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
llm = LLM(model=model, dtype="float32", max_model_len=128, num_gpu_blocks_override=64,
          kv_transfer_config=kv)
llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=1),
             use_tqdm=False)
llm.llm_engine.shutdown()
"""


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def want(model_dir):
    llm = _llm(model_dir)
    try:
        return _generate(llm, PROMPTS)
    finally:
        llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def store(model_dir, tmp_path_factory):
    """Storage filled by a producer in a second process (another str hash seed: keys must
    not depend on it)."""
    path = tmp_path_factory.mktemp("kv_store")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    args = [str(model_dir), json.dumps(_kv("kv_producer", path)), json.dumps(PROMPTS)]
    subprocess.run([sys.executable, "-c", _PRODUCER, *args], check=True, env=env, timeout=120)
    files = sorted(os.listdir(path))
    assert len(files) == sum(len(p) // BS for p in PROMPTS)  # every full prompt block
    assert all(f.endswith(".tp0of1.kv") for f in files)
    return path


def test_consumer_loads_what_another_process_stored(model_dir, store, want):
    llm = _llm(model_dir, kv_transfer_config=_kv("kv_consumer", store))
    sched, ran = llm.llm_engine.scheduler, []
    schedule = sched.schedule
    sched.schedule = lambda: ran.append(schedule()) or ran[-1]
    try:
        got = _generate(llm, PROMPTS)
        stats = llm.get_stats()
        metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
        steps = list(ran)  # (the steps of the run above)
        # vLLM's num_cached_tokens counts the loaded tokens too (the local cache cleared)
        assert llm.llm_engine.reset_prefix_cache()
        again = llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)[0]
    finally:
        llm.llm_engine.shutdown()
    _assert_same(got, want)
    assert again.num_cached_tokens == _loadable(PROMPTS[:1]) > 0
    assert metrics["vllm:external_prefix_cache_hits"] == _loadable(PROMPTS)  # vLLM's names
    assert metrics["vllm:external_prefix_cache_queries"] == sum(map(len, PROMPTS))
    # tokens run: each prompt's remainder past its loaded blocks, then the decodes
    decodes = len(PROMPTS) * (GREEDY.max_tokens - 1)
    computed = sum(o.num_batched_tokens for o in steps)
    assert computed == sum(map(len, PROMPTS)) - _loadable(PROMPTS) + decodes
    assert sum(len(o.kv_loads) for o in steps) * BS == _loadable(PROMPTS)
    assert not any(o.kv_saves for o in ran)
    assert stats.external_prefix_cache_hits == _loadable(PROMPTS)
    assert stats.external_prefix_cache_queries == sum(map(len, PROMPTS))
    assert stats.prefix_cache_hits == 0  # computed locally: each prompt's remainder only
    assert len(os.listdir(store)) == sum(len(p) // BS for p in PROMPTS)  # a consumer saves none


def test_local_cache_then_storage_then_new_tokens_in_chunks(model_dir, store):
    """A prompt partly in the local prefix cache, partly in storage, partly new, run in
    16-token chunks."""
    longer = PROMPTS[2] + [5, 6, 7, 8, 9, 10, 11]  # 3 stored blocks' tokens, then new ones
    warm = PROMPTS[2][:35]  # its first 2 blocks: loaded, then in the local cache
    plain = _llm(model_dir, max_num_batched_tokens=16)
    try:
        want_warm, want_longer = _generate(plain, [warm]), _generate(plain, [longer])
    finally:
        plain.llm_engine.shutdown()
    kv = _kv("kv_consumer", store)
    llm = _llm(model_dir, max_num_batched_tokens=16, kv_transfer_config=kv)
    try:
        _assert_same(_generate(llm, [warm]), want_warm)
        warm_stats = llm.get_stats()
        got = _generate(llm, [longer])
        stats = llm.get_stats()
    finally:
        llm.llm_engine.shutdown()
    assert (warm_stats.external_prefix_cache_hits, warm_stats.prefix_cache_hits) == (2 * BS, 0)
    _assert_same(got, want_longer)
    assert stats.prefix_cache_hits == 2 * BS  # blocks 0-1, local
    assert stats.external_prefix_cache_hits == 3 * BS  # + block 2, from storage (3: new)


def test_preemption_and_n_load_again(model_dir, store):
    """A pool small enough to preempt (recompute: the blocks are loaded again, the local prefix
    cache being off), and n = 2 sampled with a seed (a forked request recomputed after
    preemption shares its prefix again: no load)."""
    prompts = [*PROMPTS, PROMPTS[2] + [5, 6, 7, 8, 9, 10, 11]]
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1)
    forked = SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=8, ignore_eos=True, logprobs=1)
    params = [forked, forked, greedy, greedy]  # the greedy ones are preempted
    kw = {"num_gpu_blocks_override": 14, "enable_prefix_caching": False}
    plain = _llm(model_dir, **kw)
    try:
        want = _generate(plain, prompts, params)
    finally:
        plain.llm_engine.shutdown()
    llm = _llm(model_dir, kv_transfer_config=_kv("kv_consumer", store), **kw)
    try:
        got = _generate(llm, prompts, params)
        stats = llm.get_stats()
    finally:
        llm.llm_engine.shutdown()
    _assert_same(got, want)
    assert stats.num_preemptions > 0
    # every admission loads its stored blocks (the longer prompt: PROMPTS[2]'s 3), and a
    # readmission after preemption loads them again
    once = _loadable(PROMPTS) + 3 * BS
    assert stats.external_prefix_cache_queries > sum(map(len, prompts))
    assert stats.external_prefix_cache_hits >= once + 3 * BS


def test_files_are_independent_of_the_attention_backend_layout(model_dir, store, want):
    """The store's files came from the CPU backend's [heads, blocks, block_size, dim] cache;
    the torch backend's cache is [blocks, block_size, heads, dim]: both read the canonical
    [block_size, heads, dim] files."""
    kv = _kv("kv_consumer", store)
    llm = _llm(model_dir, attention_backend="torch", kv_transfer_config=kv)
    try:
        got = _generate(llm, PROMPTS)
        stats = llm.get_stats()
    finally:
        llm.llm_engine.shutdown()
    _assert_same(got, want)
    assert stats.external_prefix_cache_hits == _loadable(PROMPTS)


def test_kv_both_after_reset_prefix_cache(model_dir, tmp_path, want):
    stats = _twice_across_a_reset(
        _llm(model_dir, kv_transfer_config=_kv("kv_both", tmp_path)), want
    )
    assert stats.prefix_cache_hits == 0


def _twice_across_a_reset(llm, want):
    """kv_both: PROMPTS, the local prefix cache cleared, PROMPTS again: both runs give `want`,
    the second loads every full prompt block from storage; its stats."""
    try:
        first = _generate(llm, PROMPTS)
        assert llm.get_stats().external_prefix_cache_hits == 0  # nothing stored yet
        assert llm.llm_engine.reset_prefix_cache()
        second = _generate(llm, PROMPTS)
        stats = llm.get_stats()
    finally:
        llm.llm_engine.shutdown()
    _assert_same(first, want)
    _assert_same(second, want)
    assert stats.external_prefix_cache_hits == _loadable(PROMPTS)
    return stats


def test_truncated_or_foreign_files_are_computed(model_dir, store, want, tmp_path):
    """A copy of the store with one prompt's first block truncated and another's replaced by
    a file of another key: those prompts load nothing (the chain stops), tokens unchanged."""
    import shutil

    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    llm = _llm(model_dir, kv_transfer_config=_kv("kv_consumer", copy))
    try:
        connector = llm.llm_engine.scheduler.kv_connector
        keys = [connector.block_keys(_request(p, i)) for i, p in enumerate(PROMPTS)]
        first0 = copy / f"{keys[0][0]}.tp0of1.kv"
        first1 = copy / f"{keys[1][0]}.tp0of1.kv"
        first0.write_bytes(first0.read_bytes()[:-5])
        shutil.copyfile(copy / f"{keys[2][0]}.tp0of1.kv", first1)  # right size, other key
        got = _generate(llm, PROMPTS)
        stats = llm.get_stats()
    finally:
        llm.llm_engine.shutdown()
    _assert_same(got, want)
    assert stats.external_prefix_cache_hits == _loadable(PROMPTS[2:])


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_file_gone_after_the_lookup_is_recomputed(
    model_dir, store, want, tmp_path, async_scheduling
):
    """kv_both over a copy of the store: one block file is deleted between the scheduler's
    lookup and the worker's load. That request is sent back and recomputed (its tokens from the
    stale step, and from a step already scheduled behind it, are dropped), the others go on;
    outputs unchanged, nothing stale saved under the deleted key (a fresh consumer of the
    store still generates `want`), and the key is not looked up again."""
    import shutil

    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    kv = _kv("kv_both", copy)
    llm = _llm(model_dir, kv_transfer_config=kv, async_scheduling=async_scheduling)
    try:
        connector = llm.llm_engine.scheduler.kv_connector
        gone = copy / f"{connector.block_keys(_request(PROMPTS[1], 1))[1]}.tp0of1.kv"
        match, deleted = connector.match, []

        def match_then_delete(bm, seq):  # once: the first lookup that found the file
            match(bm, seq)
            if not deleted and seq.token_ids == PROMPTS[1]:
                assert seq.num_external_tokens == 2 * BS
                gone.unlink()
                deleted.append(seq)

        connector.match = match_then_delete
        got = _generate(llm, PROMPTS)
        stats = llm.get_stats()
    finally:
        llm.llm_engine.shutdown()
    _assert_same(got, want)
    assert stats.num_preemptions == 1  # the recompute
    # prompt 1 loaded blocks 0 and 1 (1 failed: un-counted), then block 0 again
    assert stats.external_prefix_cache_hits == _loadable(PROMPTS)
    assert not gone.exists()  # its blocks of the stale step were not saved
    fresh = _llm(model_dir, kv_transfer_config=_kv("kv_consumer", copy))
    try:
        _assert_same(_generate(fresh, PROMPTS), want)
    finally:
        fresh.llm_engine.shutdown()


def _request(prompt: list[int], i: int):
    from paged_engine.core.request import Request

    return Request(f"probe{i}", list(prompt), GREEDY)


def test_other_block_size_or_kv_cache_dtype_never_reads_the_files(model_dir, store):
    llm = _llm(model_dir, block_size=8, kv_transfer_config=_kv("kv_consumer", store))
    try:
        _generate(llm, PROMPTS[:1])
        assert llm.get_stats().external_prefix_cache_hits == 0
    finally:
        llm.llm_engine.shutdown()
    cfg = KVTransferConfig.parse(_kv("kv_consumer", store))
    ident = {"model": "m", "kv_cache_dtype": "torch.float32", "tensor_parallel_size": 1}
    fp8 = {**ident, "kv_cache_dtype": "torch.float8_e4m3fn"}
    req = _request(PROMPTS[0], 0)
    a, b = (KVConnector(cfg, i, BS, []).block_keys(req) for i in (ident, fp8))
    assert len(a) == len(b) == 2 and not set(a) & set(b)


@pytest.mark.parametrize(
    ("value", "names"),
    [
        (
            {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
            ["kv_connector", "ExampleConnector"],
        ),
        ({"kv_connector": "SharedStorageConnector", "kv_role": "prefill"}, ["kv_role", "kv_both"]),
        ({"kv_connector": "ExampleConnector", "kv_role": "kv_both", "kv_port": 1}, ["kv_port"]),
        (
            {
                "kv_connector": "ExampleConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"path": "x"},
            },
            ["kv_connector_extra_config", "path"],
        ),
        (
            {
                "kv_connector": "ExampleConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": ""},
            },
            ["shared_storage_path"],
        ),
        ("ExampleConnector", ["kv_transfer_config"]),
    ],
)
def test_bad_options_are_refused_by_name(value, names):
    with pytest.raises(ValueError) as e:
        KVTransferConfig.parse(value)
    assert all(n in str(e.value) for n in names)


def test_vllm_object_form_and_refused_combinations(model_dir, tmp_path, tiny_model_factory):
    obj = types.SimpleNamespace(
        kv_connector="SharedStorageConnector",
        kv_role="kv_producer",
        kv_connector_extra_config={"shared_storage_path": str(tmp_path)},
    )
    cfg = KVTransferConfig.parse(obj)
    assert (cfg.saves, cfg.loads, cfg.shared_storage_path) == (True, False, str(tmp_path))
    assert (
        KVTransferConfig.parse(
            {"kv_connector": "ExampleConnector", "kv_role": "kv_consumer"}
        ).shared_storage_path
        == "local_storage"
    )
    kv = _kv("kv_both", tmp_path)
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        LLM(model=str(model_dir), kv_transfer_config=kv, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="speculative_config"):
        LLM(
            model=str(model_dir),
            kv_transfer_config=kv,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        )
    with pytest.raises(ValueError, match=r"kv_transfer_config is not supported for .*recurrent"):
        _llm(tiny_model_factory("jamba"), kv_transfer_config=kv)


def test_tensor_parallel_ranks_save_and_load_their_shards(model_dir, tmp_path, want):
    """TP = 2 (gloo on the CPU), kv_both: each rank writes its own file per block and loads it
    back after the local prefix cache is cleared."""
    kv = _kv("kv_both", tmp_path)
    _twice_across_a_reset(_llm(model_dir, tensor_parallel_size=2, kv_transfer_config=kv), want)
    files = os.listdir(tmp_path)
    blocks = sum(len(p) // BS for p in PROMPTS)
    assert sum(f.endswith(".tp0of2.kv") for f in files) == blocks
    assert sum(f.endswith(".tp1of2.kv") for f in files) == blocks


def test_one_rank_missing_its_file_recomputes_on_both(model_dir, tmp_path, want):
    """TP = 2, kv_both: after the local cache is cleared, rank 1's file of one block is deleted
    after the lookup. Rank 0 loads its shard, rank 1 cannot: both report the block (their
    outputs agree) and the request is recomputed."""
    llm = _llm(model_dir, tensor_parallel_size=2, kv_transfer_config=_kv("kv_both", tmp_path))
    try:
        _generate(llm, PROMPTS)  # both ranks store every full prompt block
        assert llm.llm_engine.reset_prefix_cache()
        connector = llm.llm_engine.scheduler.kv_connector
        gone = tmp_path / f"{connector.block_keys(_request(PROMPTS[1], 1))[1]}.tp1of2.kv"
        match, deleted = connector.match, []

        def match_then_delete(bm, seq):
            match(bm, seq)
            if not deleted and seq.token_ids == PROMPTS[1]:
                gone.unlink()
                deleted.append(seq)

        connector.match = match_then_delete
        got = _generate(llm, PROMPTS)
        stats = llm.get_stats()
    finally:
        llm.llm_engine.shutdown()
    _assert_same(got, want)
    assert deleted and stats.num_preemptions == 1


def test_server_flag_builds_the_connector(model_dir, store):
    """`paged-server --kv-transfer-config JSON` (vLLM's flag) reaches the engine; bad JSON is
    an argument error."""
    from paged_server.cli import build_engine
    from paged_server.cli_args import parse_args

    kv = json.dumps(_kv("kv_consumer", store))
    argv = ["--model", str(model_dir), "--dtype", "float32", "--max-model-len", "128"]
    engine = build_engine(parse_args([*argv, "--kv-transfer-config", kv]))
    try:
        connector = engine.scheduler.kv_connector
        assert (connector.cfg.kv_role, connector.cfg.shared_storage_path) == (
            "kv_consumer",
            str(store),
        )
    finally:
        engine.shutdown()
    with pytest.raises(SystemExit):
        parse_args([*argv, "--kv-transfer-config", "{not json"])
