"""Multi-LoRA serving: --enable-lora / --lora-modules, adapters in /v1/models, `model` = an
adapter name running with its LoRARequest, runtime load / unload behind the environment
variable, the data-parallel front forwarding updates, and a real tiny engine end to end."""

from __future__ import annotations

import contextlib
import json
import threading
import time
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

from paged_engine.lora.request import LoRARequest
from paged_server.cli import _lora_config, parse_args, serve
from paged_server.cli_args import build_parser
from paged_server.engine_client import EngineClient
from paged_server.errors import APIError
from paged_server.lora import LoRAModule, runtime_updates_allowed

ENV = "PAGED_ALLOW_RUNTIME_LORA_UPDATING"
CHAT = [{"role": "user", "content": "Hi"}]


def _adapter(root: Path, name: str) -> str:
    """A directory the fake engine takes as an adapter (it holds an adapter_config.json)."""
    path = root / name
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"r": 8, "peft_type": "LORA"}))
    return str(path)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: _adapter(root, name) for name in ("sql", "chat", "new", "busy", "dp")}


def _lora_args(adapters: dict[str, str]) -> list[str]:
    chat = {"name": "chat", "path": adapters["chat"], "base_model_name": "tiny-base"}
    return [
        *COMMON_ARGS,
        "--enable-lora",
        "--lora-modules",
        f"sql={adapters['sql']}",
        json.dumps(chat),
    ]


@contextlib.contextmanager
def _serve(args: list[str], runtime: bool, step_time: float = 0.001) -> Iterator[SimpleNamespace]:
    """`paged-server ARGS` over a LoRA-enabled fake engine, in this process; `runtime`: with
    the runtime-update variable set (it is read at startup)."""
    engine = FakeEngine(max_model_len=MAX_MODEL_LEN, step_time=step_time, enable_lora=True)
    with contextlib.ExitStack() as stack:
        with pytest.MonkeyPatch.context() as mp:
            mp.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
            mp.setenv(ENV, "1" if runtime else "0")
            http, app = stack.enter_context(serve_in_process(args, engine))
        yield SimpleNamespace(http=http, engine=engine, app=app)


@pytest.fixture(scope="module")
def srv(adapters: dict[str, str]) -> Iterator[SimpleNamespace]:
    """The fake engine behind --lora-modules sql and chat, runtime updates allowed."""
    with _serve(_lora_args(adapters), runtime=True) as s:
        yield s


def _post(server: ServerProc, path: str, body: dict, status: int = 200):
    got, _, payload = server.request("POST", path, body)
    assert got == status, payload
    return payload


def _lora_of(engine: FakeEngine, rid: str) -> LoRARequest | None:
    return engine.lora_requests[f"{rid}-0"]


# ---- command line --------------------------------------------------------------------------
def test_lora_flags_parse_both_module_forms() -> None:
    chat = '{"name": "chat", "path": "/a/chat", "base_model_name": "base"}'
    args = parse_args(
        ["m", "--enable-lora", "--lora-modules", "sql=/a/sql", chat, "--max-loras", "4"]
    )
    assert args.lora_modules == [
        LoRAModule("sql", "/a/sql"),
        LoRAModule("chat", "/a/chat", "base"),
    ]
    assert _lora_config(args) == {
        "enable_lora": True,
        "max_loras": 4,
        "max_lora_rank": 16,
        "max_cpu_loras": None,
    }
    assert _lora_config(parse_args(["m"])) == {}  # the engine's defaults: LoRA off


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lora-modules", "a=/p"], "--lora-modules needs --enable-lora"),
        (["--enable-lora", "--lora-modules", "a"], "expected name=path"),
        (["--enable-lora", "--lora-modules", "=/p"], "expected name=path"),
        (["--enable-lora", "--lora-modules", '{"name": "a"}'], "'path' must be"),
        (["--enable-lora", "--lora-modules", '{"name": "a", "path": "/p", "x": 1}'], "'x'"),
        (["--enable-lora", "--lora-modules", "{nope"], "not a JSON object"),
        (["--enable-lora", "--lora-modules", "a=/p", "a=/q"], "'a' is given twice"),
        (["--enable-lora", "--lora-modules", "m=/p"], "'m' is a served model name"),
        (
            ["--served-model-name", "x", "--enable-lora", "--lora-modules", "x=/p"],
            "'x' is a served model name",
        ),
    ],
)
def test_bad_lora_flags_are_cli_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture
) -> None:
    with pytest.raises(SystemExit):
        parse_args(["m", *argv])
    assert message in capsys.readouterr().err


def test_runtime_updates_need_a_true_variable() -> None:
    assert not runtime_updates_allowed({})
    assert not runtime_updates_allowed({ENV: "0"}) and not runtime_updates_allowed({ENV: ""})
    for value in ("1", "true", "True"):
        assert runtime_updates_allowed({ENV: value})
        assert runtime_updates_allowed({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": value})


def test_an_invalid_startup_adapter_fails_naming_it(
    adapters: dict[str, str], capsys: pytest.CaptureFixture
) -> None:
    argv = ["--port", "0", "--enable-lora", "--lora-modules", f"ok={adapters['sql']}"]
    args = build_parser().parse_args([*argv, "broken=/no/such/dir"])
    engine = FakeEngine(enable_lora=True)
    assert serve(args, engine) == 2
    err = capsys.readouterr().err
    assert "adapter 'broken' (/no/such/dir)" in err and "not a PEFT adapter" in err


# ---- /v1/models and routing ----------------------------------------------------------------
def test_models_list_adapters_after_the_base_model(
    srv: SimpleNamespace, adapters: dict[str, str]
) -> None:
    status, _, body = srv.http.request("GET", "/v1/models")
    assert status == 200
    cards = {c["id"]: c for c in body["data"]}
    assert [c["id"] for c in body["data"]][:3] == ["tiny", "sql", "chat"]
    assert cards["tiny"]["parent"] is None
    assert (cards["sql"]["root"], cards["sql"]["parent"]) == (adapters["sql"], "tiny")
    assert (cards["chat"]["root"], cards["chat"]["parent"]) == (adapters["chat"], "tiny-base")
    status, _, card = srv.http.request("GET", "/v1/models/sql")
    assert status == 200 and card == cards["sql"]
    status, _, err = srv.http.request("GET", "/v1/models/nope")
    assert status == 404 and err["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("stream", [False, True])
def test_an_adapter_name_runs_with_its_lora_request(
    srv: SimpleNamespace, adapters: dict[str, str], stream: bool
) -> None:
    cases = [
        ("/v1/completions", {"prompt": "hi"}, "sql", 1),
        ("/v1/chat/completions", {"messages": CHAT}, "chat", 2),
    ]
    for path, body, name, lora_id in cases:
        body = {**body, "model": name, "max_tokens": 7}
        if stream:
            events = srv.http.stream(body, path)
            rid = events[0]["id"]
            assert {e["model"] for e in events} == {name}
            text = "".join(
                c["delta"].get("content") or "" if "chat" in path else c["text"]
                for e in events
                for c in e["choices"]
            )
        else:
            answer = _post(srv.http, path, body)
            rid, text = answer["id"], answer["choices"][0]
            text = text["message"]["content"] if "chat" in path else text["text"]
            assert answer["model"] == name
        lora = _lora_of(srv.engine, rid)
        assert (lora.lora_name, lora.lora_int_id, lora.lora_path) == (
            name,
            lora_id,
            adapters[name],
        )
        assert text == (name * 7)[:7]  # the fake writes the adapter's name
        base = _post(srv.http, path, {**body, "model": "tiny"})
        assert _lora_of(srv.engine, base["id"]) is None and base["model"] == "tiny"
        assert name not in json.dumps(base["choices"])


def test_unknown_models_are_404_on_every_route(srv: SimpleNamespace) -> None:
    bodies = {
        "/v1/completions": {"prompt": "hi"},
        "/v1/chat/completions": {"messages": CHAT},
        "/v1/embeddings": {"input": "hi"},
        "/tokenize": {"prompt": "hi"},
        "/detokenize": {"tokens": [40]},
    }
    for path, body in bodies.items():
        err = _post(srv.http, path, {**body, "model": "nope"}, 404)
        assert err["error"]["param"] == "model", path
        if path.startswith("/v1/") and path != "/v1/embeddings":
            assert _post(srv.http, path, {**body, "model": "sql", "max_tokens": 1})
    assert _post(srv.http, "/tokenize", {"prompt": "hi", "model": "sql"})["count"] == 3


# ---- runtime updates -----------------------------------------------------------------------
def test_load_and_unload_at_runtime(srv: SimpleNamespace, adapters: dict[str, str]) -> None:
    http, engine = srv.http, srv.engine
    status, headers, text = http.request(
        "POST", "/v1/load_lora_adapter", {"lora_name": "new", "lora_path": adapters["new"]}
    )
    assert status == 200 and "new" in text and headers["Content-Type"].startswith("text/plain")
    _, _, card = http.request("GET", "/v1/models/new")
    assert (card["root"], card["parent"]) == (adapters["new"], "tiny")
    lora_id = srv.app.lora.get("new").lora_int_id
    assert lora_id > 2 and lora_id in engine.loras  # after the startup modules' 1 and 2
    answer = _post(http, "/v1/completions", {"model": "new", "prompt": "x", "max_tokens": 3})
    assert answer["choices"][0]["text"] == "new"
    assert _lora_of(engine, answer["id"]).lora_int_id == lora_id
    assert engine.threads["add_lora"] - {threading.current_thread().name} == {"engine-loop"}

    _post(http, "/v1/unload_lora_adapter", {"lora_name": "new"})
    assert engine.threads["remove_lora"] == {"engine-loop"} and lora_id not in engine.loras
    err = _post(http, "/v1/completions", {"model": "new", "prompt": "x"}, 404)
    assert err["error"]["code"] == "model_not_found"
    assert _post(http, "/v1/unload_lora_adapter", {"lora_name": "new"}, 404)["error"]["param"]
    status, _, _ = http.request("GET", "/v1/models/new")
    assert status == 404

    # reloaded under the same name: a new id (ids are never reused)
    _post(http, "/v1/load_lora_adapter", {"lora_name": "new", "lora_path": adapters["new"]})
    assert http.request("GET", "/v1/models/new")[0] == 200
    assert srv.app.lora.get("new").lora_int_id == lora_id + 1
    wrong = {"lora_name": "new", "lora_int_id": lora_id}
    assert _post(http, "/v1/unload_lora_adapter", wrong, 400)["error"]["param"] == "lora_int_id"
    assert _post(http, "/v1/unload_lora_adapter", {"lora_int_id": 99}, 404)
    _post(http, "/v1/unload_lora_adapter", {"lora_int_id": lora_id + 1})
    assert http.request("GET", "/v1/models/new")[0] == 404


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"lora_path": "/p"}, 400, "lora_name"),
        ({"lora_name": "x"}, 400, "lora_path"),
        ({"lora_name": "", "lora_path": "/p"}, 400, "lora_name"),
        ({"lora_name": 3, "lora_path": "/p"}, 400, "lora_name"),
        ({"lora_name": "x", "lora_path": "/p", "extra": 1}, 400, "extra"),
        ({"lora_name": "x", "lora_path": "/no/such/dir"}, 400, "lora_path"),  # engine refuses
        ({"lora_name": "sql", "lora_path": "/p"}, 400, "lora_name"),  # loaded already
        ({"lora_name": "tiny", "lora_path": "/p"}, 400, "lora_name"),  # the served name
    ],
)
def test_bad_load_requests_are_400s(
    srv: SimpleNamespace, body: dict, status: int, param: str
) -> None:
    err = _post(srv.http, "/v1/load_lora_adapter", body, status)
    assert err["error"]["param"] == param
    names = [c["id"] for c in srv.http.request("GET", "/v1/models")[2]["data"]]
    assert "x" not in names


def test_bad_unload_requests(srv: SimpleNamespace) -> None:
    for body, param in [({}, "lora_name"), ({"lora_int_id": "1"}, "lora_int_id")]:
        assert _post(srv.http, "/v1/unload_lora_adapter", body, 400)["error"]["param"] == param
    err = _post(srv.http, "/v1/unload_lora_adapter", {"lora_name": "nope"}, 404)
    assert err["error"]["param"] == "lora_name"
    assert _post(srv.http, "/v1/load_lora_adapter", [1], 400)


def test_an_adapter_in_use_is_removed_when_its_request_ends(adapters: dict[str, str]) -> None:
    with _serve(_lora_args(adapters), runtime=True, step_time=0.01) as srv:
        _unload_while_in_use(srv, adapters)


def _unload_while_in_use(srv: SimpleNamespace, adapters: dict[str, str]) -> None:
    http, engine = srv.http, srv.engine
    _post(http, "/v1/load_lora_adapter", {"lora_name": "busy", "lora_path": adapters["busy"]})
    lora_id = srv.app.lora.get("busy").lora_int_id
    conn = http.conn()
    body = {"model": "busy", "prompt": "x", "max_tokens": 60, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")  # it runs
    _post(http, "/v1/unload_lora_adapter", {"lora_name": "busy"})
    assert lora_id in engine.loras  # the engine keeps it for the request that runs with it
    rest = resp.read().decode()
    conn.close()
    assert rest.rstrip().endswith("data: [DONE]") and '"finish_reason": "length"' in rest
    deadline = time.monotonic() + 5
    while lora_id in engine.loras and time.monotonic() < deadline:
        time.sleep(0.01)
    assert lora_id not in engine.loras


def test_runtime_routes_are_unknown_without_the_variable(adapters: dict[str, str]) -> None:
    with _serve(_lora_args(adapters), runtime=False) as s:
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            body = {"lora_name": "new", "lora_path": adapters["new"]}
            assert _post(s.http, path, body, 404)["error"]["code"] == "not_found"
        assert _post(s.http, "/v1/completions", {"model": "sql", "prompt": "x", "max_tokens": 1})


def test_runtime_loads_need_enable_lora(adapters: dict[str, str]) -> None:
    with _serve(COMMON_ARGS, runtime=True) as s:
        body = {"lora_name": "new", "lora_path": adapters["new"]}
        err = _post(s.http, "/v1/load_lora_adapter", body, 400)
        assert "--enable-lora" in err["error"]["message"] and not s.engine.loras


# ---- the engine client ---------------------------------------------------------------------
def test_the_engine_thread_runs_lora_calls_and_refuses_unloaded_adapters(
    adapters: dict[str, str],
) -> None:
    engine = FakeEngine(step_time=0.001, enable_lora=True)
    client = EngineClient(engine)
    client.start()
    try:
        lora = LoRARequest("sql", 1, adapters["sql"])
        assert client.add_lora(lora) is True
        with pytest.raises(ValueError, match="not a PEFT adapter"):
            client.add_lora(LoRARequest("bad", 2, "/no/such/dir"))
        params = client.make_params({"max_tokens": 2}, beam=False, stream=False)
        group = client.add(["r0"], [{"prompt_token_ids": [5]}], params, lora)
        assert group.wait_added(5) and engine.lora_requests["r0"] == lora
        client.remove_lora(1)
        group = client.add(["r1"], [{"prompt_token_ids": [5]}], params, lora)
        with pytest.raises(APIError) as e:  # unloaded before it reached the engine thread
            group.wait_added(5)
        assert e.value.status == 404 and "r1" not in engine.lora_requests
        assert engine.threads["add_lora"] == engine.threads["remove_lora"] == {"engine-loop"}
    finally:
        client.stop()
    with pytest.raises(APIError) as e:
        client.add_lora(lora)
    assert e.value.status == 503


# ---- data parallel -------------------------------------------------------------------------
def test_the_data_parallel_front_updates_every_replica(adapters: dict[str, str]) -> None:
    with (
        _serve(_lora_args(adapters), runtime=True) as r0,
        _serve(_lora_args(adapters), runtime=True) as r1,
        data_parallel_front([r0.http, r1.http]) as http,
    ):
        body = {"lora_name": "dp", "lora_path": adapters["dp"]}
        _post(http, "/v1/load_lora_adapter", body)
        assert [s.app.lora.get("dp") is not None for s in (r0, r1)] == [True, True]
        for _ in range(2):  # least-loaded routing: both replicas answer
            answer = _post(http, "/v1/completions", {"model": "dp", "prompt": "x"})
            assert answer["choices"][0]["text"].startswith("dpdp")
        _post(http, "/v1/unload_lora_adapter", {"lora_name": "dp"})
        assert [s.app.lora.get("dp") for s in (r0, r1)] == [None, None]
        # replica 0 refuses (the name is taken there): replica 1's load is undone
        _post(r0.http, "/v1/load_lora_adapter", body)
        err = _post(http, "/v1/load_lora_adapter", body, 400)
        assert err["error"]["param"] == "lora_name"
        assert r1.app.lora.get("dp") is None and r0.app.lora.get("dp") is not None


# ---- a real engine -------------------------------------------------------------------------
def test_a_real_engine_serves_an_adapter_as_offline_generation(
    tiny_model: str, tmp_path: Path
) -> None:
    """model = the adapter gives what LLM.generate(lora_request=...) gives, not the base model's
    text; the same engine first runs offline, then behind the routes."""
    from paged_engine import LLM, SamplingParams
    from paged_engine.testing import write_lora_adapter

    adapter = str(write_lora_adapter(tmp_path / "adapter", tiny_model, rank=8, seed=0))
    llm = LLM(
        tiny_model,
        dtype="float32",
        enable_lora=True,
        max_model_len=MAX_MODEL_LEN,
        num_gpu_blocks_override=64,
    )
    prompt, params = "Hello, my name is", SamplingParams(temperature=0, max_tokens=8)
    lora = LoRARequest("ad", 1, adapter)
    offline = llm.generate([prompt], params, use_tqdm=False, lora_request=lora)[0]
    base = llm.generate([prompt], params, use_tqdm=False)[0]
    assert offline.outputs[0].token_ids != base.outputs[0].token_ids
    args = [*COMMON_ARGS, "--enable-lora", "--lora-modules", f"ad={adapter}"]
    with serve_in_process(args, llm.llm_engine) as (http, _):
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
        for model, want in (("ad", offline), ("tiny", base)):
            answer = _post(http, "/v1/completions", {**body, "model": model})
            assert answer["choices"][0]["token_ids"] == want.outputs[0].token_ids, model
            assert answer["choices"][0]["text"] == want.outputs[0].text
        events = http.stream({**body, "model": "ad"})
        assert "".join(e["choices"][0]["text"] for e in events) == offline.outputs[0].text
        embedded = [
            _post(http, "/v1/embeddings", {"input": prompt, "model": m})["data"][0]["embedding"]
            for m in ("ad", "tiny")
        ]
        assert embedded[0] != embedded[1]  # pooled with the adapter


def test_lora_requests_info_metric_names_running_and_waiting_adapters():
    from types import SimpleNamespace

    from paged_server.metrics import Metrics

    stats = SimpleNamespace(
        max_loras=2, running_lora_adapters=["a"], waiting_lora_adapters=["b", "c"]
    )
    text = Metrics("m").render(stats)
    line = next(x for x in text.splitlines() if x.startswith("paged:lora_requests_info{"))
    assert 'max_lora="2"' in line and 'running_lora_adapters="a"' in line
    assert 'waiting_lora_adapters="b,c"' in line
    assert "lora_requests_info" not in Metrics("m").render(SimpleNamespace(max_loras=0))
