"""A checkpoint whose tokenizer_config.json holds a list of named chat templates (a dict once
transformers loads it): the server picks as transformers' apply_chat_template does, "tool_use"
for a request with tools and "default" otherwise; without a fitting one a request is a 400
naming `messages` and the server serves on (it raised a TypeError on the dict before)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from server_proc import COMMON_ARGS, serve_in_process

from paged_engine import LLM

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def _named(model_dir: Path, names: list[str]) -> None:
    (model_dir / "chat_template.jinja").unlink(missing_ok=True)  # the file would win
    path = model_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = [
        {"name": n, "template": f"{n}:{{{{ messages[0]['content'] }}}}"} for n in names
    ]
    path.write_text(json.dumps(config))


def _chat(http, **extra) -> tuple[int, dict]:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    status, _, out = http.request("POST", "/v1/chat/completions", {**body, **extra})
    return status, out


def test_named_templates_are_picked_as_transformers_picks_them(tiny_model: str, tmp_path):
    picked = Path(shutil.copytree(tiny_model, tmp_path / "named"))
    _named(picked, ["default", "tool_use"])
    llm = LLM(str(picked), dtype="float32", max_model_len=64)
    with serve_in_process(COMMON_ARGS, llm.llm_engine) as (http, _):
        tokenizer = llm.get_tokenizer()
        for tools, name in ((None, "default"), (TOOLS, "tool_use")):
            status, out = _chat(http, **({"tools": tools, "tool_choice": "none"} if tools else {}))
            assert status == 200, out
            assert out["usage"]["prompt_tokens"] == len(tokenizer.encode(f"{name}:hi")), name
        messages = [{"role": "user", "content": "hi"}]
        status, _, out = http.request("POST", "/tokenize", {"model": "tiny", "messages": messages})
        assert status == 200 and out["tokens"] == tokenizer.encode("default:hi"), out
    llm.llm_engine.shutdown()
    unfit = Path(shutil.copytree(tiny_model, tmp_path / "unfit"))
    _named(unfit, ["tool_use", "rag"])
    llm = LLM(str(unfit), dtype="float32", max_model_len=64)
    with serve_in_process(COMMON_ARGS, llm.llm_engine) as (http, _):
        status, out = _chat(http)
        assert status == 400 and out["error"]["param"] == "messages", out
        assert "no default" in out["error"]["message"]
        assert _chat(http, tools=TOOLS, tool_choice="none")[0] == 200  # "tool_use" fits it
        status, _, _ = http.request("POST", "/v1/completions", {"model": "tiny", "prompt": "x"})
        assert status == 200
    llm.llm_engine.shutdown()
