"""The dev route POST /reset_prefix_cache takes vLLM's query parameters: reset_running_requests
and reset_external (the KV connector's stored blocks too, LLMEngine.reset_prefix_cache's
reset_connector); a bad value is a 400 naming it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from server_proc import COMMON_ARGS, ServerProc, serve_in_process

PROMPT = list(range(100, 140))  # two full 16-token blocks


@pytest.fixture(scope="module")
def dev(tiny_model: str, tmp_path_factory) -> Iterator[ServerProc]:
    from paged_engine import EngineConfig, LLMEngine

    kv = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path_factory.mktemp("kv"))},
    }
    engine = LLMEngine(
        EngineConfig.from_kwargs(
            model=tiny_model,
            dtype="float32",
            device="cpu",
            num_gpu_blocks_override=64,
            max_model_len=64,
            kv_transfer_config=kv,
        )
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGED_SERVER_DEV_MODE", "1")
        args = [*COMMON_ARGS, "--enable-prompt-tokens-details"]
        with serve_in_process(args, engine) as (http, _app):
            yield http
    engine.shutdown()


def cached(dev: ServerProc) -> int:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
    status, _, r = dev.request("POST", "/v1/completions", body)
    assert status == 200, r
    return r["usage"]["prompt_tokens_details"]["cached_tokens"]


def reset(dev: ServerProc, query: str = "", status: int = 200) -> dict:
    got, _, r = dev.request("POST", "/reset_prefix_cache" + query)
    assert got == status, r
    return r


def test_reset_external_resets_the_connector_too(dev: ServerProc) -> None:
    cached(dev)  # stores the prompt's blocks
    assert reset(dev) == {"reset": True}
    assert cached(dev) == 32  # loaded back from the connector's storage
    assert reset(dev, "?reset_external=false&reset_running_requests=true") == {"reset": True}
    assert cached(dev) == 32
    assert reset(dev, "?reset_external=true") == {"reset": True}
    assert cached(dev) == 0  # the stored blocks are not loaded again


def test_bad_values_name_the_parameter(dev: ServerProc) -> None:
    for query, param in [
        ("?reset_external=maybe", "reset_external"),
        ("?reset_external=1&reset_external=0", "reset_external"),
        ("?reset_running_requests=2", "reset_running_requests"),
    ]:
        err = reset(dev, query, status=400)["error"]
        assert err["param"] == param and param in err["message"], (query, err)
