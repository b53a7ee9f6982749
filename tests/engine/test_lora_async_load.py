"""LoRA adapters read off the step thread (lora/loader.py): a request or `add_lora` naming an
adapter that is not loaded waits on its caller's side while the engine keeps stepping the
others; what it reads gives the same tokens as a read on the step thread; a read that fails
fails only its own call, with the same ValueError; and after a burst of adapters the engine
unloads the extra ones (past max_cpu_loras) once their requests are gone."""

from __future__ import annotations

import asyncio
import shutil
import threading

import pytest
from hf_reference import hf_greedy, load_hf_model

import paged_engine.lora.manager as lora_manager
from paged_engine import LLM, AsyncLLM, LoRARequest, RequestOutputKind, SamplingParams
from paged_engine.testing import merge_lora_adapter, write_lora_adapter

pytest.importorskip("transformers")

OPTS = {
    "dtype": "float32",
    "max_model_len": 128,
    "enable_lora": True,
    "max_lora_rank": 8,
    "num_gpu_blocks_override": 64,
}
DELTA = RequestOutputKind.DELTA
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, output_kind=DELTA)
PROMPT = [5, 17, 42, 9]
WAIT_S = 60  # a bound for what must happen at once: only a broken engine reaches it


@pytest.fixture(scope="module")
def setup(tiny_model_factory, tmp_path_factory):
    model = tiny_model_factory("llama")
    root = tmp_path_factory.mktemp("lora-async")
    paths = [
        write_lora_adapter(root / f"a{k}", model, rank=2 + 2 * (k % 3), seed=k) for k in range(4)
    ]
    return model, [str(p) for p in paths]


class _SlowReads:
    """Patches the adapter reader: every read records its thread and, while `gate` is clear,
    waits for it (`started` is set once a read waits)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.threads: list[str] = []
        self.started = threading.Event()
        self.gate = threading.Event()
        self.gate.set()
        real = lora_manager.read_peft_adapter

        def read(path: str, max_rank: int):
            self.threads.append(threading.current_thread().name)
            if not self.gate.is_set():
                self.started.set()
                assert self.gate.wait(WAIT_S), "the test never opened the gate"
            return real(path, max_rank)

        monkeypatch.setattr(lora_manager, "read_peft_adapter", read)


def test_read_ahead_gives_the_step_thread_reads_tokens(setup, monkeypatch):
    """Adapters read on the loader thread give HF's tokens with the adapter merged, the same
    as a read on the step thread (LLM.generate, no prefetch); the step thread reads nothing."""
    model, paths = setup
    reads = _SlowReads(monkeypatch)
    llm = LLM(str(model), **OPTS, max_loras=2)
    engine = llm.llm_engine
    try:
        loras = [LoRARequest(f"a{k}", k + 1, p) for k, p in enumerate(paths[:2])]
        sync = llm.generate([PROMPT] * 2, GREEDY, lora_request=loras, use_tqdm=False)
        assert reads.threads == [threading.current_thread().name] * 2
        for lora in loras:
            assert engine.remove_lora(lora.lora_int_id)
        reads.threads.clear()
        futures = [engine.prefetch_lora(lora) for lora in loras]
        assert all(f.result(WAIT_S) is not None for f in futures)
        assert engine.list_loras() == set()  # read, not installed: the step thread does that
        ahead = llm.generate([PROMPT] * 2, GREEDY, lora_request=loras, use_tqdm=False)
        assert reads.threads == ["paged-lora-load_0"] * 2
        assert engine.model_runner.lora.loader.pending() == 0  # both taken by their installs
        assert engine.prefetch_lora(loras[0]) is None  # loaded: nothing to read
        got = [o.outputs[0].token_ids for o in ahead]
        assert got == [o.outputs[0].token_ids for o in sync]
        for lora, tokens in zip(loras, got, strict=True):
            ref = merge_lora_adapter(load_hf_model(model), lora.lora_path)
            assert tokens == hf_greedy(ref, PROMPT, GREEDY.max_tokens).tokens, lora.lora_name
        base = hf_greedy(load_hf_model(model), PROMPT, GREEDY.max_tokens).tokens
        assert got[0] != base  # the adapter changes the tokens (else the test proves nothing)
    finally:
        engine.shutdown()


async def _tokens(agen, sink: list[int] | None = None) -> list[int]:
    """The tokens of a DELTA stream (also appended to `sink` as they come)."""
    tokens: list[int] = []
    async for out in agen:
        tokens += out.outputs[0].token_ids
        if sink is not None:
            sink.extend(out.outputs[0].token_ids)
    return tokens


def test_a_slow_read_stops_no_other_requests_steps(setup, monkeypatch):
    """While an adapter's read is held (a request naming it, then `add_lora`), a streaming
    request without it keeps getting tokens; once the read ends, its request runs with it."""
    model, paths = setup
    reads = _SlowReads(monkeypatch)
    llm = LLM(str(model), **OPTS)
    lora = LoRARequest("a0", 1, paths[0])
    want = llm.generate([PROMPT], GREEDY, lora_request=lora, use_tqdm=False)[0]
    llm.llm_engine.shutdown()
    reads.threads.clear()
    engine = AsyncLLM(str(model), **OPTS, max_loras=2)
    stream = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True, output_kind=DELTA)

    async def progress_while_held(load) -> list[int]:
        """Start `load` with the gate shut; the base stream must advance 5 tokens while the
        read waits; then open the gate and return what `load` returned."""
        reads.gate.clear()
        reads.started.clear()
        seen: list[int] = []
        base = asyncio.create_task(_tokens(engine.generate([3, 4], stream, "base"), seen))
        while not seen:  # the stream runs before the load starts
            await asyncio.sleep(0.01)
        task = asyncio.create_task(load)
        try:
            assert await asyncio.to_thread(reads.started.wait, WAIT_S), "no read started"
            mark = len(seen)
            async with asyncio.timeout(WAIT_S):
                while len(seen) < mark + 5:  # steps go on while the read is held
                    await asyncio.sleep(0.01)
            assert not task.done()
        finally:
            reads.gate.set()
        result = await asyncio.wait_for(task, WAIT_S)
        assert len(await asyncio.wait_for(base, WAIT_S)) == 100
        return result

    async def main():
        got = await progress_while_held(
            _tokens(engine.generate(PROMPT, GREEDY, "a", lora_request=lora))
        )
        assert got == list(want.outputs[0].token_ids)
        assert await progress_while_held(engine.add_lora(LoRARequest("a1", 2, paths[1])))
        assert await engine.list_loras() == {1, 2}

    try:
        asyncio.run(main())
    finally:
        reads.gate.set()
        engine.shutdown()
    assert [t.startswith("paged-lora-load") for t in reads.threads] == [True, True]


def test_a_failing_read_fails_only_its_call(setup, tmp_path):
    """A bad adapter read on the loader thread fails its request (or add_lora) with the
    ValueError a read on the step thread raises; a request running meanwhile finishes."""
    model, paths = setup
    missing = LoRARequest("missing", 7, str(tmp_path / "nowhere"))
    big = LoRARequest("big", 8, str(write_lora_adapter(tmp_path / "big", model, rank=16)))
    sync = LLM(str(model), **OPTS).llm_engine
    messages = {}
    try:
        for lora in (missing, big):
            with pytest.raises(ValueError, match="lora_request") as info:
                sync.add_request("x", {"prompt_token_ids": PROMPT}, GREEDY, lora_request=lora)
            messages[lora.lora_int_id] = str(info.value)
    finally:
        sync.shutdown()
    engine = AsyncLLM(str(model), **OPTS)
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, output_kind=DELTA)

    async def main():
        base = asyncio.create_task(_tokens(engine.generate([3, 4], long, "base")))
        for k, lora in enumerate((missing, big)):
            with pytest.raises(ValueError) as info:
                await _tokens(engine.generate(PROMPT, GREEDY, f"bad{k}", lora_request=lora))
            assert str(info.value) == messages[lora.lora_int_id]
            with pytest.raises(ValueError) as info:
                await engine.add_lora(lora)
            assert str(info.value) == messages[lora.lora_int_id]
        good = LoRARequest("a2", 3, paths[2])
        assert await _tokens(engine.generate(PROMPT, GREEDY, "good", lora_request=good))
        assert await engine.list_loras() == {3}
        return await base

    try:
        assert len(asyncio.run(main())) == 40  # the running request never noticed
        assert engine.engine.model_runner.lora.loader.pending() == 0
    finally:
        engine.shutdown()


def test_the_cache_shrinks_back_to_max_cpu_loras(setup):
    """Four adapters needed at once grow the cache past max_cpu_loras=2; once their requests
    finish (or are aborted) the least recently used idle ones are unloaded, without a new
    load to trigger it."""
    model, paths = setup
    llm = LLM(str(model), **OPTS, max_loras=2, max_cpu_loras=2)
    engine = llm.llm_engine
    loras = [LoRARequest(f"a{k}", k + 1, p) for k, p in enumerate(paths)]
    try:
        for k, lora in enumerate(loras):
            engine.add_request(f"r{k}", {"prompt_token_ids": PROMPT}, GREEDY, lora_request=lora)
        assert engine.list_loras() == {1, 2, 3, 4}  # all pinned by unfinished requests
        sizes = []
        while engine.has_unfinished_requests():
            engine.step()
            sizes.append(len(engine.list_loras()))
        assert sizes[-1] == 2 and engine.list_loras() == {3, 4}  # the most recently used
        assert len(engine.model_runner.lora.packed) == 2  # the worker let go of them too
        # Aborted requests let go of theirs at once.
        for k, lora in enumerate([loras[2], loras[3], loras[0]]):
            engine.add_request(f"b{k}", {"prompt_token_ids": PROMPT}, GREEDY, lora_request=lora)
        assert engine.list_loras() == {1, 3, 4}
        engine.abort_request(["b0", "b1", "b2"])
        assert engine.list_loras() == {4, 1}  # 3 was the least recently used
    finally:
        engine.shutdown()


def test_remove_lora_drops_a_read_no_request_installed(setup, tmp_path):
    """A read ahead whose request never reached the engine (cancelled, refused) waited in the
    loader; `remove_lora` of that id (not loaded: False) left it there, so after the adapter's
    files were rewritten in place, the id's next load installed the old weights."""
    model, paths = setup
    path = tmp_path / "rewritten"
    shutil.copytree(paths[0], path)
    llm = LLM(str(model), **OPTS)
    engine = llm.llm_engine

    def tokens(lora: LoRARequest) -> list[int]:
        out = llm.generate([PROMPT], GREEDY, lora_request=lora, use_tqdm=False)
        return list(out[0].outputs[0].token_ids)

    try:
        lora = LoRARequest("x", 1, str(path))
        assert engine.prefetch_lora(lora).result(WAIT_S) is not None  # read, never installed
        assert not engine.remove_lora(1)  # not loaded
        assert engine.model_runner.lora.loader.pending() == 0
        shutil.rmtree(path)
        shutil.copytree(paths[1], path)  # new weights at the same path
        got = tokens(lora)
        assert engine.remove_lora(1)
        assert got == tokens(LoRARequest("new", 2, paths[1]))
        assert got != tokens(LoRARequest("old", 3, paths[0]))  # else the test proves nothing
    finally:
        engine.shutdown()
