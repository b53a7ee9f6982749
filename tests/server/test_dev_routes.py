"""vLLM's development routes (dev_routes.py) on real tiny engines: /sleep, /wake_up, /pause,
/resume, /is_sleeping, /is_paused, /reset_prefix_cache and /collective_rpc; only with the
dev-mode variable set; the requests in flight aborted (finish_reason "abort"), waited for or
kept (and then identical to an undisturbed answer); requests that arrive meanwhile wait for the
wake-up; bad input is a 400 naming the parameter; the data-parallel front drives every
replica."""

from __future__ import annotations

import contextlib
import http.client
import json
import threading
from collections.abc import Iterator

import pytest
from fake_engine import FakeEngine
from server_proc import API_KEY, HEADERS, ServerProc, data_parallel_front, serve_in_process

MAX_LEN = 512
ARGS = ["--max-model-len", str(MAX_LEN), "--served-model-name", "tiny", "--client-timeout", "30"]
LONG = {"model": "tiny", "prompt": "Hello", "max_tokens": 300, "temperature": 0, "ignore_eos": True}
SHORT = {**LONG, "max_tokens": 8}


@contextlib.contextmanager
def _serve(model: str, *extra: str, dev: bool = True) -> Iterator[ServerProc]:
    from paged_engine import LLM

    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("VLLM_SERVER_DEV_MODE", raising=False)
        if dev:
            mp.setenv("PAGED_SERVER_DEV_MODE", "1")
        else:
            mp.delenv("PAGED_SERVER_DEV_MODE", raising=False)
        llm = LLM(
            model,
            dtype="float32",
            max_model_len=MAX_LEN,
            num_gpu_blocks_override=128,
            enable_sleep_mode="--enable-sleep-mode" in extra,
        )
        try:
            with serve_in_process([*ARGS, *extra], llm.llm_engine) as (http, _):
                yield http
        finally:
            llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def dev(tiny_model: str) -> Iterator[ServerProc]:
    with _serve(tiny_model, "--enable-sleep-mode") as http:
        yield http


@pytest.fixture(scope="module")
def want(dev: ServerProc) -> dict[str, str]:
    return {"long": _text(dev, LONG), "short": _text(dev, SHORT)}


def _call(http: ServerProc, method: str, path: str, body=None, status: int = 200, **kw):
    got, _, payload = http.request(method, path, body, **kw)
    assert got == status, payload
    return payload


def _text(http: ServerProc, body: dict) -> str:
    choice = _call(http, "POST", "/v1/completions", body)["choices"][0]
    assert choice["finish_reason"] == "length"
    return choice["text"]


class _Stream:
    """A streamed completion read on a thread: `started` once its first event arrived."""

    def __init__(self, http: ServerProc, body: dict) -> None:
        self.started = threading.Event()
        self.events: list[dict] = []
        self.error: BaseException | None = None
        self.conn = http.conn(timeout=60)
        self.conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}), HEADERS)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            resp = self.conn.getresponse()
            for line in resp:
                if line.startswith(b"data: ") and line[6:].strip() != b"[DONE]":
                    self.events.append(json.loads(line[6:]))
                    self.started.set()
        except (OSError, http.client.HTTPException) as e:
            self.error = e
        finally:
            self.started.set()

    def result(self) -> tuple[str, str | None]:
        """(text, finish reason) once the stream ended."""
        self.thread.join(60)
        self.conn.close()
        assert self.error is None and not self.thread.is_alive()
        choices = [c for e in self.events for c in e["choices"]]
        return "".join(c["text"] for c in choices), choices[-1]["finish_reason"]


def _sleep_state(http: ServerProc) -> str:
    """The state paged:engine_sleep_state marks with 1, or "" when none is."""
    text = _call(http, "GET", "/metrics")
    on = [
        line.split('sleep_state="')[1].split('"')[0]
        for line in text.splitlines()
        if line.startswith("paged:engine_sleep_state{") and line.endswith(" 1")
    ]
    assert len(on) <= 1, on
    return on[0] if on else ""


def test_sleep_and_wake_up_answer_the_same(dev: ServerProc, want: dict[str, str]) -> None:
    assert _call(dev, "GET", "/is_sleeping") == {"is_sleeping": False}
    assert _sleep_state(dev) == "awake"
    _call(dev, "POST", "/sleep?level=1")
    assert _call(dev, "GET", "/is_sleeping") == {"is_sleeping": True}
    assert _sleep_state(dev) == "weights_offloaded"
    assert _call(dev, "GET", "/health") is not None  # the server stays up
    late = _Stream(dev, SHORT)  # waits in the queue for the wake-up
    assert not late.started.wait(0.3)
    assert _call(dev, "POST", "/wake_up") == {"is_sleeping": False}
    assert late.result() == (want["short"], "length")
    # Level 2: the weights come back empty; reload them, then the KV cache.
    _call(dev, "POST", "/sleep?level=2")
    assert _sleep_state(dev) == "discard_all"
    _call(dev, "POST", "/wake_up?tags=weights")
    assert _sleep_state(dev) == ""  # the KV cache still sleeps
    assert _call(dev, "GET", "/is_sleeping") == {"is_sleeping": True}
    rpc = _call(dev, "POST", "/collective_rpc", {"method": "reload_weights"})
    assert len(rpc["results"]) == 1 and rpc["results"][0] > 0
    _call(dev, "POST", "/wake_up?tags=kv_cache")
    assert _sleep_state(dev) == "awake"
    assert _text(dev, LONG) == want["long"]
    assert _call(dev, "POST", "/reset_prefix_cache") == {"reset": True}


def test_requests_in_flight_abort_wait_or_keep(dev: ServerProc, want: dict[str, str]) -> None:
    s = _Stream(dev, LONG)
    assert s.started.wait(30)
    assert _call(dev, "POST", "/pause?mode=abort") == {"status": "paused"}
    text, reason = s.result()
    assert reason == "abort" and 0 < len(text) < len(want["long"])
    assert want["long"].startswith(text)
    assert _call(dev, "GET", "/is_paused") == {"is_paused": True}
    _call(dev, "POST", "/resume")
    # keep: frozen by the sleep, recomputed after it, the same text in the end
    s = _Stream(dev, LONG)
    assert s.started.wait(30)
    _call(dev, "POST", "/sleep?level=1&mode=keep")
    _call(dev, "POST", "/wake_up")
    assert s.result() == (want["long"], "length")
    # wait: the sleep answers once the request in flight has finished, whole
    s = _Stream(dev, LONG)
    assert s.started.wait(30)
    _call(dev, "POST", "/sleep?mode=wait")
    assert s.result() == (want["long"], "length")
    _call(dev, "POST", "/wake_up")
    assert _call(dev, "GET", "/is_sleeping") == {"is_sleeping": False}


def test_bad_input_names_the_parameter(dev: ServerProc) -> None:
    for path, param in [
        ("/sleep?level=two", "level"),
        ("/sleep?level=7", "level"),
        ("/sleep?mode=later", "mode"),
        ("/sleep?tags=gpu", "tags"),
        ("/sleep?level=1&level=2", "level"),
        ("/wake_up?tags=weights,disk", "tags"),
        ("/pause?clear_cache=maybe", "clear_cache"),
        ("/reset_prefix_cache?reset_running_requests=2", "reset_running_requests"),
    ]:
        err = _call(dev, "POST", path, status=400)["error"]
        assert err["param"] == param, (path, err)
    for body, param in [
        ({"method": "_check_weights_awake"}, "method"),
        ({"method": "no_such_method"}, "method"),
        ({"method": 3}, "method"),
        ({"method": "reload_weights", "args": "x"}, "args"),
        ({"method": "reload_weights", "kwargs": []}, "kwargs"),
        ({"method": "reload_weights", "timeout": -1}, "timeout"),
        ({"method": "reload_weights", "extra": 1}, "extra"),
    ]:
        err = _call(dev, "POST", "/collective_rpc", body, status=400)["error"]
        assert err["param"] == param, (body, err)
    # a method that fails on the worker: a 500 naming the failure; the engine goes on
    err = _call(dev, "POST", "/collective_rpc", {"method": "stop_profile"}, status=500)["error"]
    assert "profiling is off" in err["message"]
    _call(dev, "POST", "/sleep?level=1")
    err = _call(dev, "POST", "/resume", status=409)["error"]
    assert "wake_up" in err["message"]
    _call(dev, "POST", "/wake_up")
    assert _call(dev, "GET", "/sleep", status=405)["error"]["code"] == "method_not_allowed"
    assert _text(dev, SHORT)


def test_routes_need_dev_mode_sleep_mode_and_the_key(tiny_model: str) -> None:
    with pytest.MonkeyPatch.context() as mp:  # the module's dev server set the variable
        mp.delenv("PAGED_SERVER_DEV_MODE", raising=False)
        mp.delenv("VLLM_SERVER_DEV_MODE", raising=False)
        with serve_in_process(ARGS, FakeEngine(max_model_len=MAX_LEN)) as (http, _):
            assert _call(http, "POST", "/sleep", status=404)["error"]["code"] == "not_found"
    with _serve(tiny_model, "--api-key", API_KEY) as http:
        _call(http, "POST", "/sleep", status=401)
        key = {"Authorization": f"Bearer {API_KEY}"}
        err = _call(http, "POST", "/sleep?level=1", headers=key, status=400)["error"]
        assert "--enable-sleep-mode" in err["message"]
        _call(http, "POST", "/sleep?level=0", headers=key)  # a pause needs no sleep mode
        assert _call(http, "GET", "/is_paused", headers=key) == {"is_paused": True}
        _call(http, "POST", "/wake_up", headers=key)
        assert _call(http, "GET", "/is_paused", headers=key) == {"is_paused": False}


def test_the_data_parallel_front_drives_every_replica(tiny_model: str) -> None:
    with (
        _serve(tiny_model, "--enable-sleep-mode") as a,
        _serve(tiny_model, "--enable-sleep-mode") as b,
        data_parallel_front([a, b]) as front,
    ):
        _call(front, "POST", "/sleep?level=1")
        for http in (a, b, front):
            assert _call(http, "GET", "/is_sleeping") == {"is_sleeping": True}
        _call(a, "POST", "/wake_up")
        assert _call(front, "GET", "/is_sleeping") == {"is_sleeping": True}  # b sleeps
        _call(front, "POST", "/wake_up")
        assert _call(front, "GET", "/is_sleeping") == {"is_sleeping": False}
        rpc = _call(front, "POST", "/collective_rpc", {"method": "reload_weights"})
        assert len(rpc["results"]) == 2
        err = _call(front, "POST", "/sleep?mode=later", status=400)["error"]
        assert err["param"] == "mode"
