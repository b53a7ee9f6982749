"""POST /start_profile and /stop_profile (vLLM's profiling routes) on a real tiny engine: only
with the profiler variable set, 409 on a start while running or a stop while stopped (the
engine goes on serving), one trace per replica behind the data-parallel front."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from fake_engine import FakeEngine
from server_proc import (
    COMMON_ARGS,
    MAX_MODEL_LEN,
    ServerProc,
    data_parallel_front,
    serve_in_process,
)

COMPLETION = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0}


@contextlib.contextmanager
def _serve(model: str, trace_dir: Path | None) -> Iterator[ServerProc]:
    """A real engine over `model` behind the routes; the variable as the engine starts."""
    from paged_engine import LLM

    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
        mp.setenv("PAGED_TORCH_PROFILER_WITH_STACK", "0")
        if trace_dir is None:
            mp.delenv("PAGED_TORCH_PROFILER_DIR", raising=False)
        else:
            mp.setenv("PAGED_TORCH_PROFILER_DIR", str(trace_dir))
        llm = LLM(model, dtype="float32", max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=64)
        with serve_in_process(COMMON_ARGS, llm.llm_engine) as (http, _):
            yield http


def _post(http: ServerProc, path: str, body: object = None, status: int = 200):
    got, _, payload = http.request("POST", path, body)
    assert got == status, payload
    return payload


def _text(http: ServerProc) -> str:
    return _post(http, "/v1/completions", COMPLETION)["choices"][0]["text"]


def test_profiling_routes_trace_a_serving_engine(tiny_model: str, tmp_path: Path) -> None:
    with _serve(tiny_model, tmp_path) as http:
        want = _text(http)
        assert _post(http, "/start_profile") == {"status": "profiling"}
        err = _post(http, "/start_profile", status=409)["error"]
        assert "already running" in err["message"]
        assert _text(http) == want
        traces = _post(http, "/stop_profile")["traces"]
        assert len(traces) == 1 and Path(traces[0]).parent == tmp_path
        assert Path(traces[0]).stat().st_size > 0
        err = _post(http, "/stop_profile", status=409)["error"]
        assert "not running" in err["message"]
        assert _text(http) == want


def test_without_the_variable_the_routes_do_not_exist(tiny_model: str) -> None:
    with _serve(tiny_model, None) as http:
        for path in ("/start_profile", "/stop_profile"):
            assert _post(http, path, status=404)["error"]["code"] == "not_found"
        assert _text(http)


@contextlib.contextmanager
def _serve_fake(trace_dir: Path) -> Iterator[SimpleNamespace]:
    """The fake engine behind the routes (torch.profiler records one session per process: two
    real engines here could not both record)."""
    engine = FakeEngine(max_model_len=MAX_MODEL_LEN, step_time=0.001)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGED_TORCH_PROFILER_DIR", str(trace_dir))
        with serve_in_process(COMMON_ARGS, engine) as (http, _):
            yield SimpleNamespace(http=http, engine=engine)


def test_the_data_parallel_front_profiles_every_replica(tmp_path: Path) -> None:
    with (
        _serve_fake(tmp_path) as r0,
        _serve_fake(tmp_path) as r1,
        data_parallel_front([r0.http, r1.http]) as http,
    ):
        _post(http, "/start_profile")
        assert r0.engine.profiling and r1.engine.profiling
        _post(r1.http, "/stop_profile")  # replica 1 alone: the front's stop fails there
        assert "not running" in _post(http, "/stop_profile", status=409)["error"]["message"]
        assert not r0.engine.profiling
        _post(http, "/start_profile")
        traces = _post(http, "/stop_profile")["traces"]
        assert len(traces) == 2 and len(set(traces)) == 2  # one per replica
        assert not r0.engine.profiling and not r1.engine.profiling
        assert r0.engine.threads["start_profile"] == {"engine-loop"}  # the engine thread
