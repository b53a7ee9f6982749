"""Server fixtures: real servers over a tiny random llama, fake servers over fake_engine.py.

The helpers live in server_proc.py (a uniquely named module: tests import it directly, which a
`conftest` module would not allow once several test folders each have one).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from server_proc import API_KEY, COMMON_ARGS, REAL_ARGS, ServerProc, launch


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from paged_engine.testing import write_tiny_model

    path = tmp_path_factory.mktemp("tiny-llama")
    write_tiny_model(path, "llama")
    return str(path)


@pytest.fixture(scope="session")
def real_server(tiny_model: str) -> Iterator[ServerProc]:
    server = launch(["--model", tiny_model, *REAL_ARGS], fake=False)
    yield server
    assert server.stop() == 0, "".join(server.lines[-30:])


@pytest.fixture(scope="session")
def guarded_server(tiny_model: str) -> Iterator[ServerProc]:
    """Real engine, an API key, one running sequence and a waiting queue of one."""
    args = [
        "serve",  # vLLM's `vllm serve MODEL` form
        tiny_model,
        *REAL_ARGS,
        "--api-key",
        API_KEY,
        "--max-num-seqs",
        "1",
        "--max-queued-requests",
        "1",
    ]
    server = launch(args, fake=False)
    yield server
    assert server.stop() == 0, "".join(server.lines[-30:])


@pytest.fixture(scope="session")
def fake_server() -> Iterator[ServerProc]:
    server = launch(COMMON_ARGS, fake=True)
    yield server
    assert server.stop() == 0, "".join(server.lines[-30:])


@pytest.fixture(scope="session", params=["fake", "real"])
def server(request: pytest.FixtureRequest) -> ServerProc:
    """Both servers: HTTP behaviour must not depend on which engine is behind it."""
    return request.getfixturevalue(f"{request.param}_server")
