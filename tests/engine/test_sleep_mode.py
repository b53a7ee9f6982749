"""Sleep mode and pausing (engine/sleep_mode.py, worker/sleep.py), vLLM's names: `sleep` gives
the device memory of the weights and the KV cache back, `wake_up` takes it again, and the engine
then generates exactly what it generated before; level 2 and the "weights" tag discard the
weights, which `reload_weights` / `update_weights` fill again. The requests in flight when a
pause comes are aborted (their tokens so far kept), waited for, or kept and finished later
with the tokens an undisturbed engine gives them."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from paged_engine import LLM, SamplingParams
from paged_engine.engine.llm_engine import LLMEngine
from paged_engine.sampling_params import RequestOutputKind
from paged_engine.testing import write_tiny_model
from paged_engine.worker import host_memory
from paged_engine.worker.sleep import module_tensors
from paged_engine.worker.worker import RpcError

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
DELTA = SamplingParams(
    temperature=0, max_tokens=10, ignore_eos=True, output_kind=RequestOutputKind.DELTA
)
PROMPTS = [[5, 17, 33, 80, 9] * 4, [7, 7, 100, 3], [12, 40, 41, 42, 43, 44]]
# int8 weights and torch.compile run on the CPU only (CUDA refuses them with a clear error)
CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-only engine option")
SMALL = dict(dtype="float32", max_model_len=64, num_gpu_blocks_override=64)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("sleep") / "llama", "llama", seed=0)


@pytest.fixture(scope="module")
def want(model) -> list[list[int]]:
    return _tokens(LLM(str(model), **SMALL))


def _tokens(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _held_bytes(llm: LLM, weights_only: bool = False) -> tuple[int, int]:
    """(bytes the model's tensors hold, bytes the KV cache holds) on the device; the weights'
    alone (parameters, quantized weights) with `weights_only`."""
    runner = llm.llm_engine.model_runner
    weights = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
               for t, w in module_tensors(runner.model) if w or not weights_only}  # fmt: skip
    kv = {
        t.untyped_storage().data_ptr(): _kv_held(t.untyped_storage()) for t in runner.kv_tensors()
    }
    return sum(weights.values()), sum(kv.values())


def _kv_held(storage) -> int:
    """A host KV cache's pages are committed as they are written and given back by madvise
    while asleep (worker/host_memory.py): count what is resident; a device cache: its size."""
    return host_memory.resident_bytes(storage) if host_memory.is_lazy(storage) else storage.nbytes()


def _kv_capacity(llm: LLM) -> int:
    tensors = llm.llm_engine.model_runner.kv_tensors()
    return sum(
        {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values()
    )


def _scramble_weights(llm: LLM) -> None:
    """What discarded weights may hold after a wake-up: anything (here: ones)."""
    for t, weight in module_tensors(llm.llm_engine.model_runner.model):
        if weight:
            t.data.fill_(1)


def test_level_1_gives_memory_back_and_wakes_to_the_same_tokens(model, want):
    llm = LLM(str(model), enable_sleep_mode=True, **SMALL)
    assert _tokens(llm) == want  # and fills the prefix cache
    weights, kv = _held_bytes(llm)
    params, capacity = _held_bytes(llm, weights_only=True)[0], _kv_capacity(llm)
    assert weights > 0 and kv > 0 and not llm.is_sleeping()
    llm.sleep(level=1)
    asleep = _held_bytes(llm)
    # All but a view of the last step's host positions (the rotary's, a few bytes) is gone.
    assert llm.is_sleeping() and asleep[0] < weights // 1000 and asleep[1] == 0
    with pytest.raises(RuntimeError, match="asleep"):
        llm.generate(PROMPTS, GREEDY)
    llm.wake_up()
    assert not llm.is_sleeping() and _kv_capacity(llm) == capacity
    # Every tensor is back: the weights byte for byte; tensors a forward leaves on modules may
    # differ a little (on the H200, 848 of 625,072 bytes once the CUDA graphs were captured again).
    assert _held_bytes(llm, weights_only=True)[0] == params
    assert weights <= _held_bytes(llm)[0] < weights + weights // 100
    hits = llm.get_stats().prefix_cache_hits
    assert _tokens(llm) == want
    assert llm.get_stats().prefix_cache_hits == hits  # the cache was reset: nothing stale served
    llm.sleep(level=1)
    llm.sleep(level=1)  # asleep already: a no-op
    llm.wake_up(tags=["kv_cache"])
    assert llm.is_sleeping()  # the weights still sleep
    llm.wake_up(tags=["weights"])
    assert _tokens(llm) == want


@pytest.mark.parametrize(
    "quantization, compilation_config",
    [(None, 0), *(pytest.param("int8", c, marks=CPU_ONLY) for c in (0, 3))],
)  # compiled (3): int8 weights reordered (use_words)
def test_level_2_discards_the_weights_and_reload_weights_restores_them(
    model, want, quantization, compilation_config
):
    # Compiled: one sequence at a time, so decode runs the one-token graph, whose int8 GEMV
    # is traced over the reordered words; the batched decode graph (int8 layers through the
    # opaque operator, as in the general one) would only add a third inductor compile.
    one = {"max_num_seqs": 1} if compilation_config else {}
    llm = LLM(
        str(model),
        enable_sleep_mode=True,
        quantization=quantization,
        compilation_config=compilation_config,
        **SMALL,
        **one,
    )
    compiled = llm.llm_engine.model_runner.compiled
    assert not compilation_config or (compiled is not None and compiled.single is not None)
    want_q = _tokens(llm)
    if quantization is None:
        assert want_q == want
    llm.sleep(level=2)
    slept = llm.llm_engine.executor.worker.memory.asleep["weights"]
    # Only the buffers (rope tables) have a host copy: the weights are gone.
    assert any(s.backup is None for s in slept) and any(s.backup is not None for s in slept)
    llm.wake_up(tags=["weights"])  # RL order: weights, update, then the KV cache
    _scramble_weights(llm)
    assert llm.collective_rpc("reload_weights")[0] > 0
    llm.wake_up(tags=["kv_cache"])
    assert _tokens(llm) == want_q


def test_the_weights_tag_then_update_weights(model, want, tmp_path):
    other = write_tiny_model(tmp_path / "other", "llama", seed=1)
    llm = LLM(str(model), enable_sleep_mode=True, **SMALL)
    llm.sleep(tags=["kv_cache"])  # the weights stay
    assert _held_bytes(llm)[1] == 0 and _held_bytes(llm)[0] > 0
    llm.wake_up()
    assert _tokens(llm) == want
    update = list(load_file(other / "model.safetensors").items())
    llm.sleep(tags=["weights"])
    with pytest.raises(RpcError, match="asleep"):
        llm.collective_rpc("update_weights", args=(update,))
    llm.wake_up(tags=["weights"])
    _scramble_weights(llm)
    llm.collective_rpc("update_weights", args=(update,))
    assert _tokens(llm) == _tokens(LLM(str(other), **SMALL))


def _start(engine: LLMEngine, tag: str) -> dict[str, list[int]]:
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"{tag}{i}", {"prompt_token_ids": p}, DELTA)
    got: dict[str, list[int]] = {f"{tag}{i}": [] for i in range(len(PROMPTS))}
    for _ in range(3):
        _collect(engine.step(), got, {})
    return got


def _collect(outputs, got: dict[str, list[int]], reasons: dict[str, str]) -> None:
    for o in outputs:
        got[o.request_id] += o.outputs[0].token_ids
        if o.finished:
            reasons[o.request_id] = o.outputs[0].finish_reason


def _finish(engine: LLMEngine, got, reasons) -> None:
    while engine.has_unfinished_requests() or engine.can_step():
        _collect(engine.step(), got, reasons)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_requests_in_flight_are_aborted_waited_for_or_kept(model, want, async_scheduling):
    engine = LLMEngine(
        model=str(model), enable_sleep_mode=True, async_scheduling=async_scheduling, **SMALL
    )
    preemptions = engine.get_stats().num_preemptions
    for mode in ("abort", "wait", "keep"):
        got, reasons = _start(engine, mode), {}
        engine.sleep(level=1, mode=mode)
        _collect(engine.step(), got, reasons)  # the outputs the pause made
        assert engine.step() == [] and engine.is_sleeping()
        engine.add_request(f"{mode}-late", {"prompt_token_ids": PROMPTS[0]}, DELTA)
        got[f"{mode}-late"] = []
        assert engine.step() == []  # it waits for the wake-up
        engine.wake_up()
        _finish(engine, got, reasons)
        assert got[f"{mode}-late"] == want[0]
        for i, tokens in enumerate(want):
            rid = f"{mode}{i}"
            if mode == "abort":
                assert reasons[rid] == "abort" and 0 < len(got[rid]) < len(tokens)
                assert got[rid] == tokens[: len(got[rid])]
            else:
                assert reasons[rid] == "length" and got[rid] == tokens
    # "keep" recomputed the requests it froze: they lost their KV blocks with the cache.
    assert engine.get_stats().num_preemptions == preemptions + len(PROMPTS)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_pause_and_resume_keep_requests_without_sleeping(model, want, async_scheduling):
    # pausing needs no sleep mode
    engine = LLMEngine(model=str(model), async_scheduling=async_scheduling, **SMALL)
    got, reasons = _start(engine, "p"), {}
    engine.pause_generation(mode="keep")
    _collect(engine.step(), got, reasons)  # the steps in flight at the pause (async)
    assert engine.is_paused() and engine.is_sleeping() and engine.step() == []
    engine.resume_generation()
    _finish(engine, got, reasons)
    assert [got[f"p{i}"] for i in range(len(PROMPTS))] == want
    assert engine.get_stats().num_preemptions == 0  # kept in place: their KV stayed
    engine.sleep(level=0)  # a pause too
    assert engine.is_paused()
    engine.wake_up()
    assert not engine.is_paused()


def test_bad_arguments_name_their_parameter(model):
    llm = LLM(str(model), **SMALL)
    with pytest.raises(ValueError, match="enable_sleep_mode"):
        llm.sleep(level=1)
    engine = LLMEngine(model=str(model), enable_sleep_mode=True, **SMALL)
    for kwargs, param in [
        ({"level": 3}, "level"),
        ({"level": True}, "level"),
        ({"tags": ["weights", "gpu"]}, "tags"),
        ({"tags": "weights"}, "tags"),
        ({"mode": "later"}, "mode"),
    ]:
        with pytest.raises(ValueError, match=param):
            engine.sleep(**kwargs)
    with pytest.raises(ValueError, match="tags"):
        engine.wake_up(tags=["cpu"])
    with pytest.raises(ValueError, match="mode"):
        engine.pause_generation(mode="nope")
    assert not engine.is_sleeping()  # nothing happened
    engine.sleep(level=1)
    with pytest.raises(RuntimeError, match="wake_up"):
        engine.resume_generation()
    with pytest.raises(RpcError, match="asleep"):
        engine.collective_rpc("reload_weights")
    engine.wake_up(tags=[])  # nothing named: nothing wakes
    assert engine.is_sleeping()
    engine.wake_up()
    engine.wake_up()  # awake already: a no-op
    assert not engine.is_sleeping()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_abort_ends_every_sample_and_beam_with_its_tokens_so_far(model, async_scheduling):
    from paged_engine import BeamSearchParams

    engine = LLMEngine(model=str(model), async_scheduling=async_scheduling, **SMALL)
    beams = BeamSearchParams(beam_width=3, max_tokens=10, ignore_eos=True)
    engine.add_request("beam", {"prompt_token_ids": PROMPTS[0]}, beams)
    n3 = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=10, ignore_eos=True)
    engine.add_request("n3", {"prompt_token_ids": PROMPTS[1]}, n3)
    seen = {"beam": 0, "n3": 0}  # tokens each completion had in the last output before
    for _ in range(3):
        for o in engine.step():
            seen[o.request_id] = len(o.outputs[0].token_ids)
    engine.pause_generation(mode="abort")
    outs = {}
    for o in engine.step():  # the steps in flight at the pause (async), then the aborts
        if not o.finished:
            seen[o.request_id] = len(o.outputs[0].token_ids)
        outs[o.request_id] = o
    assert not engine.has_unfinished_requests()
    for rid in ("beam", "n3"):
        assert outs[rid].finished and len(outs[rid].outputs) == 3 and seen[rid] >= 2
        assert all(
            c.finish_reason == "abort" and len(c.token_ids) == seen[rid] for c in outs[rid].outputs
        )


def test_an_embedding_aborted_mid_prefill_has_no_output(model):
    from paged_engine import PoolingParams

    engine = LLMEngine(
        model=str(model), runner="pooling", max_num_batched_tokens=8, max_num_seqs=8, **SMALL
    )
    engine.add_request("e", {"prompt_token_ids": list(range(1, 40))}, PoolingParams())
    assert engine.process_outputs(engine.step_core()).request_outputs == []  # 8 of 39 tokens
    engine.pause_generation(mode="abort")
    processed = engine.process_outputs(engine.step_core())
    assert processed.aborted == ["e"] and processed.request_outputs == []
    assert not engine.has_unfinished_requests()


def test_reset_prefix_cache_with_running_requests(model, want):
    engine = LLMEngine(model=str(model), **SMALL)
    got, reasons = _start(engine, "r"), {}
    assert not engine.reset_prefix_cache()
    assert engine.reset_prefix_cache(reset_running_requests=True)
    _finish(engine, got, reasons)
    assert [got[f"r{i}"] for i in range(len(PROMPTS))] == want


def test_hybrid_recurrent_state_sleeps_with_the_kv_cache(tmp_path):
    path = write_tiny_model(tmp_path / "jamba", "jamba", seed=0)
    kw = dict(dtype="float32", max_model_len=64)
    want = _tokens(LLM(str(path), **kw))
    engine = LLMEngine(model=str(path), enable_sleep_mode=True, **kw)
    got, reasons = _start(engine, "h"), {}
    engine.sleep(level=1, mode="keep")
    runner = engine.model_runner
    assert all(_kv_held(t.untyped_storage()) == 0 for t in runner.kv_tensors())
    engine.wake_up()
    _finish(engine, got, reasons)
    assert [got[f"h{i}"] for i in range(len(PROMPTS))] == want


@pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="needs two GPUs"
)
def test_sleep_under_tensor_parallelism(model, want):
    llm = LLM(str(model), enable_sleep_mode=True, tensor_parallel_size=2, **SMALL)
    try:
        llm.sleep(level=2)
        llm.wake_up(tags=["weights"])
        assert len(llm.collective_rpc("reload_weights")) == 2
        llm.wake_up()
        assert _tokens(llm) == want
        llm.sleep(level=1)
        llm.wake_up()
        assert _tokens(llm) == want
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("level", [1, 2])
def test_the_vision_tower_sleeps_with_the_weights(tmp_path, level):
    """A LLaVA's tower and projector give their memory back with the weights (kept on the host
    at both levels: reload_weights reads the text model only) and answer the same after."""
    pytest.importorskip("PIL")
    from image_checks import noise_image

    from paged_engine.testing import write_tiny_llava

    path = write_tiny_llava(tmp_path, vision="clip", seed=0)
    llm = LLM(str(path), enable_sleep_mode=True, dtype="float32", max_model_len=256)
    prompt = {
        "prompt": "USER: <image>\nWhat? ASSISTANT:",
        "multi_modal_data": {"image": noise_image(0, (30, 40))},
    }
    want = [o.outputs[0].token_ids for o in llm.generate([prompt], GREEDY, use_tqdm=False)]
    tower = llm.llm_engine.model_runner.images.encoder
    held = sum(p.untyped_storage().nbytes() for p in tower.parameters())
    llm.sleep(level=level)
    assert sum(p.untyped_storage().nbytes() for p in tower.parameters()) == 0 < held
    llm.wake_up(tags=["weights"])
    if level == 2:
        _scramble_weights(llm)
        llm.collective_rpc("reload_weights")
    llm.wake_up(tags=["kv_cache"])
    assert [o.outputs[0].token_ids for o in llm.generate([prompt], GREEDY, use_tqdm=False)] == want
