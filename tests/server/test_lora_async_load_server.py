"""The server's engine client with a real engine: a request naming a LoRA adapter that is not
loaded, and a runtime load, wait in their HTTP thread while the adapter's files are read; the
engine thread keeps stepping the others and never reads a file."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

import paged_engine.lora.manager as lora_manager
from paged_engine.lora.request import LoRARequest
from paged_server.engine_client import EngineClient

WAIT_S = 60  # a bound for what must happen at once: only a broken engine reaches it


def test_adapter_reads_wait_in_the_http_thread(
    tiny_model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from paged_engine import LLM, SamplingParams
    from paged_engine.testing import write_lora_adapter

    adapter = str(write_lora_adapter(tmp_path / "adapter", tiny_model, rank=4, seed=3))
    llm = LLM(
        tiny_model,
        dtype="float32",
        max_model_len=256,
        enable_lora=True,
        max_loras=2,
        num_gpu_blocks_override=64,
    )
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = llm.generate([[5, 6, 7]], greedy, lora_request=LoRARequest("x", 9, adapter))[0]
    assert llm.llm_engine.remove_lora(9)

    threads: list[str] = []
    started, gate = threading.Event(), threading.Event()
    real = lora_manager.read_peft_adapter

    def held_read(path: str, max_rank: int):
        threads.append(threading.current_thread().name)
        started.set()
        assert gate.wait(WAIT_S), "the test never opened the gate"
        return real(path, max_rank)

    monkeypatch.setattr(lora_manager, "read_peft_adapter", held_read)
    client = EngineClient(llm.llm_engine)
    client.start()
    try:
        stream = client.make_params(
            {"max_tokens": 200, "ignore_eos": True}, beam=False, stream=True
        )
        params = client.make_params(
            {"max_tokens": 6, "temperature": 0, "ignore_eos": True}, beam=False, stream=False
        )
        for k, call in enumerate(("add", "add_lora")):
            lora = LoRARequest(f"ad{k}", k + 1, adapter)
            started.clear()
            gate.clear()
            base = client.add([f"base{k}"], [{"prompt_token_ids": [3, 4]}], stream)
            assert base.wait_added(WAIT_S)
            result: list = []

            def http_call(call: str, k: int, lora: LoRARequest, result: list) -> None:
                if call == "add":
                    prompts = [{"prompt_token_ids": [5, 6, 7]}]
                    result.append(client.add([f"ad{k}"], prompts, params, lora))
                else:
                    result.append(client.add_lora(lora))

            http = threading.Thread(target=http_call, args=(call, k, lora, result))
            http.start()
            try:
                assert started.wait(WAIT_S)
                seen = base.num_generated_tokens
                while base.num_generated_tokens < seen + 5:  # the engine steps meanwhile
                    assert base.next(WAIT_S), "no step while the adapter was read"
                assert http.is_alive()  # still waiting for its read
            finally:
                gate.set()
            http.join(WAIT_S)
            if call == "add":
                group = result[0]
                assert group.wait_added(WAIT_S)
                while not group.done:
                    group.next(WAIT_S)
                assert group.latest[0].outputs[0].token_ids == want.outputs[0].token_ids
            else:
                assert result == [True]
            while not base.done:
                base.next(WAIT_S)
        assert [t.startswith("paged-lora-load") for t in threads] == [True, True]
        assert llm.llm_engine.list_loras() == {1, 2}
    finally:
        gate.set()
        client.stop()
        llm.llm_engine.shutdown()
