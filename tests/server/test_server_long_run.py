"""Long-run bounds of the server's own bookkeeping: state kept per event (an adapter unload, a
stored response) stays bounded however many events a long-lived server sees. (The per-request
structures and the engine under mixed traffic: test_soak.py.)"""

from __future__ import annotations

import pytest
from fake_engine import FakeEngine

from paged_engine.lora.request import LoRARequest
from paged_server import engine_client
from paged_server.engine_client import EngineClient
from paged_server.errors import APIError


def test_runtime_lora_unloads_are_remembered_within_a_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each unload remembers its id (a request resolved before it must get a 404, not reload
    the adapter): only the newest MAX_UNLOADED_LORAS are kept, not one per unload forever."""
    monkeypatch.setattr(engine_client, "MAX_UNLOADED_LORAS", 8)
    engine = FakeEngine(step_time=0.001, enable_lora=True)
    client = EngineClient(engine)
    client.start()
    try:
        for lora_id in range(1, 41):  # ids only grow: each runtime load gets the next one
            client.remove_lora(lora_id)
        assert list(client._unloaded_loras) == list(range(33, 41))
        params = client.make_params({"max_tokens": 2}, beam=False, stream=False)
        for i, lora_id in enumerate((33, 40)):  # the newest unloads are still refused
            lora = LoRARequest(f"gone{lora_id}", lora_id, "/unloaded/adapter")
            group = client.add([f"r{i}"], [{"prompt_token_ids": [5]}], params, lora)
            with pytest.raises(APIError) as e:
                group.wait_added(5)
            assert e.value.status == 404
        assert not engine.params  # neither reached the engine
    finally:
        client.stop()
