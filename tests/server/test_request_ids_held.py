"""Request ids of adds a "wait" pause holds back (engine_client.py): two clients' requests of one
id held at once; one client's abort drops only its own, the other is served once the pause ran,
and nothing stays counted as in flight."""

from __future__ import annotations

import threading
import time

from fake_engine import FakeEngine

from paged_server.engine_client import EngineClient
from paged_server.metrics import Metrics


def _wait_for(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def test_an_abort_drops_only_its_own_held_add_of_a_shared_id() -> None:
    engine = FakeEngine(step_time=0.01)
    client = EngineClient(engine, metrics=Metrics("fake"))
    client.start()
    try:
        long = client.make_params({"max_tokens": 100}, beam=False, stream=True)
        busy = client.add(["busy"], [{"prompt_token_ids": [5]}], long)
        assert busy.wait_added(5) and busy.next(5)
        ran: list[bool] = []
        waiter = threading.Thread(
            target=lambda: ran.append(client.call(lambda: True, 10, when_idle=True))
        )
        waiter.start()
        assert _wait_for(lambda: bool(client._idle_calls))
        params = client.make_params({"max_tokens": 3}, beam=False, stream=False)
        a = client.add(["cmpl-x-0"], [{"prompt_token_ids": [5]}], params)
        b = client.add(["cmpl-x-0"], [{"prompt_token_ids": [6]}], params)
        assert _wait_for(lambda: len(client._held_adds) == 2)
        client.abort(["cmpl-x-0"], a)  # client a left: b, of the same id, goes on
        assert a.wait_added(5)
        client.abort(["busy"], busy)  # the engine goes idle: the pause runs, b is added
        waiter.join(10)
        assert ran == [True]
        assert b.wait_added(5)
        assert _wait_for(lambda: [b.next(0.1), b.done][1])  # next() takes b's outputs
        assert b.latest[0].request_id.startswith("cmpl-x-0") and a.num_finished == 0
        assert _wait_for(lambda: client.num_in_flight() == 0)
        assert not engine.has_unfinished_requests()
    finally:
        client.stop()
