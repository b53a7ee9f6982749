"""The documentation's commands and snippets, run as a reader would run them.

Every `paged-server` command line in the bash blocks of README.md, docs/server.md and
docs/distributed.md parses with the real argument parsers; every `--flag` docs/server.md and
README.md name exists (or, for the ones docs/server.md lists as refused, is refused); the request
fields the endpoint table lists are known to the protocol; and the runnable Python and curl
blocks of README.md and docs/server.md run against a real server over a tiny random llama
served under the default model's name (SmolLM2-135M-Instruct), as do the run-batch and terminal
client examples. A renamed flag, field or route fails here until the docs follow.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from server_proc import ServerProc, launch

from paged_server import client_cli, run_batch
from paged_server.cli_args import build_parser, parse_args
from paged_server.errors import APIError
from paged_server.openai_protocol import parse_chat, parse_completion
from paged_server.vllm_flags import ONLY_DEFAULT

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
SERVER_MD = ROOT / "docs" / "server.md"
DISTRIBUTED_MD = ROOT / "docs" / "distributed.md"
DEFAULT_NAME = "SmolLM2-135M-Instruct"  # what the snippets call the model
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9_-]*[a-z0-9])")
SRC_PATH = os.pathsep.join(
    str(ROOT / "packages" / p / "src") for p in ("paged-engine", "paged-kernels", "paged-server")
)


def fences(path: Path, langs: tuple[str, ...]) -> list[tuple[int, str]]:
    """(first line number, text) of each fenced block in `path` whose language is in `langs`."""
    lines = path.read_text().split("\n")
    out: list[tuple[int, str]] = []
    i = 0
    while i < len(lines):
        m = re.match(r"^(\s*)(`{3,})(\S*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.groups()
        j = i + 1
        while j < len(lines) and not re.match(rf"^\s*{fence}\s*$", lines[j]):
            j += 1
        if lang in langs:
            body = [
                line[len(indent) :] if line.startswith(indent) else line
                for line in lines[i + 1 : j]
            ]
            out.append((i + 2, "\n".join(body)))
        i = j + 1
    return out


def _open_quote(line: str) -> bool:
    try:
        shlex.split(line, comments=True)
    except ValueError:  # a quoted argument (a JSON body) goes on on the next line
        return True
    return False


def shell_commands(block: str) -> list[str]:
    """The block's commands: continuation lines joined, heredoc bodies and comments dropped,
    `a && b` split."""
    out: list[str] = []
    lines = block.split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        while i + 1 < len(lines) and (line.rstrip().endswith("\\") or _open_quote(line)):
            i += 1
            line = line.rstrip().removesuffix("\\") + " " + lines[i].strip()
        heredoc = re.search(r"<<'?(\w+)'?", line)
        if heredoc:  # skip the document up to its end word
            while i + 1 < len(lines) and lines[i + 1].strip() != heredoc.group(1):
                i += 1
            i += 1
        i += 1
        for part in line.split("&&"):
            if part.strip() and not part.strip().startswith("#"):
                out.append(part.strip())
    return out


def paged_server_argv(command: str) -> list[str] | None:
    """The arguments after `paged-server` (or its `python -m` forms) in `command`, with vLLM's
    module paths mapped to the subcommand they run; None when it runs something else."""
    words = shlex.split(command, comments=True)
    for i, w in enumerate(words):
        if w.rstrip(")") == "paged-server":  # also `$(which paged-server)`
            return words[i + 1 :]
        if w == "-m" and i + 1 < len(words) and words[i + 1].startswith("paged_server"):
            rest = words[i + 2 :]
            return ["run-batch", *rest] if words[i + 1].endswith(".run_batch") else rest
    return None


def parse_command_line(argv: list[str]) -> Any:
    """argv as `paged-server` dispatches it (cli.main), parsed without running anything."""
    if argv[:1] == ["run-batch"]:
        parser = build_parser()
        run_batch.add_batch_args(parser)
        return parse_args(argv[1:], parser)
    if argv[:1] in (["chat"], ["complete"]):
        return client_cli.build_parser(argv[0]).parse_args(argv[1:])
    return parse_args(argv)


def documented_command_lines() -> list[tuple[str, list[str]]]:
    out = []
    for path in (README, SERVER_MD, DISTRIBUTED_MD):
        for line, block in fences(path, ("bash",)):
            for command in shell_commands(block):
                argv = paged_server_argv(command)
                if argv is not None:
                    out.append((f"{path.name}:{line}: {command}", argv))
        # inline `paged-server ...` spans of the prose; `[MODEL]` is optional, `K` a count
        prose = " ".join(re.sub(r"```.*?```", "", path.read_text(), flags=re.S).split())
        for span in re.findall(r"`(paged-server [^`]*)`", prose):
            argv = shlex.split(re.sub(r"\[(\w+)\]", r"\1", span))[1:]
            out.append((f"{path.name}: `{span}`", ["2" if a == "K" else a for a in argv]))
    return out


COMMAND_LINES = documented_command_lines()


def test_docs_have_command_lines() -> None:
    """The extraction itself works: the docs' examples of each form are found."""
    forms = {
        argv[0] if argv[:1] in (["run-batch"], ["chat"], ["complete"], ["serve"]) else ""
        for _, argv in COMMAND_LINES
    }
    assert {"", "serve", "run-batch", "chat", "complete"} <= forms, COMMAND_LINES
    assert len(COMMAND_LINES) >= 15


@pytest.mark.parametrize(("where", "argv"), COMMAND_LINES, ids=[w for w, _ in COMMAND_LINES])
def test_documented_command_line_parses(where: str, argv: list[str]) -> None:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parse_command_line(argv)
    except SystemExit as e:
        pytest.fail(f"{where}\n  exit {e.code}: {err.getvalue().strip()}")


def _options() -> set[str]:
    parsers = [build_parser(), client_cli.build_parser("chat"), client_cli.build_parser("complete")]
    batch = build_parser()
    run_batch.add_batch_args(batch)
    parsers.append(batch)
    return {flag for p in parsers for flag in p._option_string_actions}


def _refused_paragraph() -> str:
    text = SERVER_MD.read_text()
    start = text.index("Flags for what paged lacks are refused")
    return text[start : text.index("\n\n", start)]


# `--flag` words in the docs that are not paged-server flags: other programs' options (curl,
# pip, nox, the test and benchmark scripts), `--config` (read before argparse, tested below) and
# the stems of flag families the docs name with a `*` or as `--no-FLAG` / `--flag=value`.
NOT_SERVER_FLAGS = {
    "--unix-socket", "--cacert", "--no-deps", "--no-venv", "--smoke", "--archs", "--modes",
    "--config", "--no", "--flag", "--allowed", "--h11-max", "--eplb", "--dbo", "--cohere",
    "--tokenizer-pool", "--offload",
}  # fmt: skip


def test_every_documented_flag_exists() -> None:
    """Every `--flag` README.md and docs/server.md name is one of paged-server's (serve,
    run-batch, chat, complete), unless docs/server.md lists it as refused."""
    refused = set(FLAG.findall(_refused_paragraph()))
    options = _options()
    missing = {}
    for path in (README, SERVER_MD):
        for flag in set(FLAG.findall(path.read_text())) - refused - NOT_SERVER_FLAGS:
            if flag not in options and flag.replace("_", "-") not in options:
                missing[flag] = path.name
    assert not missing, f"documented flags the parsers lack: {missing}"


def test_flags_documented_as_refused_are_refused() -> None:
    refused = set(FLAG.findall(_refused_paragraph())) - NOT_SERVER_FLAGS
    assert len(refused) > 30, refused
    accepted = []
    for flag in sorted(refused):
        if flag in ONLY_DEFAULT:  # refused above its default only ("--cpu-offload-gb above 0")
            continue
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                parse_args([flag, "1"])
            accepted.append(flag)
        except SystemExit:
            assert flag in err.getvalue(), err.getvalue()
    assert not accepted, f"docs/server.md says these are refused, the parser takes them: {accepted}"


@pytest.mark.parametrize(
    ("argv", "field", "value"),
    [  # docs/server.md "vLLM's ways of writing flags" and README's examples of them
        (["--max_model_len", "32k"], "max_model_len", 32000),
        (["--max-model-len", "1K"], "max_model_len", 1024),
        (["--max-model-len=auto"], "max_model_len", None),
        (["--max-num-batched-tokens", "16k"], "max_num_batched_tokens", 16000),
        (["--kv-cache-memory-bytes", "8Gi"], "kv_cache_memory_bytes", 8 * 2**30),
        (["-O3"], "compilation_config", 3),
        (["-O", "3"], "compilation_config", 3),
        (["--compilation-config.level", "3"], "compilation_config", {"level": 3}),
        (
            [
                "--speculative-config.method",
                "ngram",
                "--speculative-config.num_speculative_tokens",
                "4",
            ],
            "speculative_config",
            {"method": "ngram", "num_speculative_tokens": 4},
        ),
        (["--enable-prefix-caching", "--no-enable-prefix-caching"], "enable_prefix_caching", False),
    ],
)
def test_documented_flag_spellings(argv: list[str], field: str, value: Any) -> None:
    assert getattr(parse_args(argv), field) == value


def test_config_file(tmp_path: Path) -> None:
    """`--config serve.yaml`: a flag per key, dashes or underscores; the command line wins."""
    pytest.importorskip("yaml")
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("max_num_seqs: 4\nmax-model-len: 2k\nenable-prefix-caching: false\n")
    args = parse_args(["--config", str(cfg), "--max-num-seqs", "8"])
    assert (args.max_num_seqs, args.max_model_len, args.enable_prefix_caching) == (8, 2000, False)


def _table_row_fields(route: str) -> list[str]:
    text = SERVER_MD.read_text()
    row = text[text.index(f"| `{route}` |") :].split("\n", 1)[0]
    names = {m.split(".")[0] for m in re.findall(r"`([a-z][a-z0-9_.]*)`", row)}
    # backticked words of the row that are values, answer fields or template names
    return sorted(names - {"null", "usage", "default", "tool_use", "image_url"})


# a valid value for fields where null is not one (any other field is sent as null)
SAMPLE = {
    "n": 2, "best_of": 2, "max_tokens": 4, "max_completion_tokens": 4, "temperature": 0.5,
    "top_p": 0.9, "top_k": 5, "min_p": 0.1, "presence_penalty": 0.1, "frequency_penalty": 0.1,
    "repetition_penalty": 1.1, "seed": 1, "stop": ["x"], "stop_token_ids": [1],
    "ignore_eos": True, "min_tokens": 1, "logprobs": 1, "top_logprobs": 1, "echo": True,
    "stream": True, "stream_options": {"include_usage": True}, "use_beam_search": False,
    "length_penalty": 1.0, "skip_special_tokens": True, "include_stop_str_in_output": False,
    "user": "u", "chat_template_kwargs": {"enable_thinking": False},
}  # fmt: skip


@pytest.mark.parametrize(
    ("route", "base", "parse"),
    [
        ("POST /v1/completions", {"prompt": "x"}, parse_completion),
        ("POST /v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, parse_chat),
    ],
)
def test_documented_request_fields_are_known(route: str, base: dict, parse: Any) -> None:
    fields = _table_row_fields(route)
    assert len(fields) > 10, fields
    unknown = []
    for name in fields:
        body = {**base, name: SAMPLE.get(name, base.get(name))}
        if name == "logprobs" and "messages" in base:
            body["logprobs"] = True
        try:
            parse(body)
        except APIError as e:  # a refused value is fine; an unknown name is not
            if re.search(r"Unrecognized request argument|not supported by this server", e.message):
                unknown.append((name, e.message))
    assert not unknown, unknown


# ---- snippets against a real server (a tiny random llama under the default model's name) ----


# the tiny model under the default model's name, with a context the snippets' answers fit in
ENGINE_ARGS = ["--served-model-name", DEFAULT_NAME, "--dtype", "float32", "--max-model-len", "256",
               "--num-gpu-blocks-override", "256"]  # fmt: skip


@pytest.fixture(scope="module")
def docs_server(tiny_model: str) -> Iterator[ServerProc]:
    args = [tiny_model, *ENGINE_ARGS, "--enable-sleep-mode"]  # the sleep-mode curls
    server = launch(args, fake=False, env={"PAGED_SERVER_DEV_MODE": "1"})
    yield server
    assert server.stop() == 0, "".join(server.lines[-30:])


def _pointed_at(code: str, server: ServerProc) -> str:
    return code.replace("localhost:8000", f"{server.host}:{server.port}").replace(
        "127.0.0.1:8000", f"{server.host}:{server.port}"
    )


def _block(path: Path, first_words: str, lang: str = "python") -> str:
    for _, block in fences(path, (lang,)):
        if block.lstrip().startswith(first_words) or first_words in block.split("\n")[0]:
            return block
    raise AssertionError(f"no {lang} block starting with {first_words!r} in {path.name}")


def _run(code: str, server: ServerProc, namespace: dict[str, Any] | None = None) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(
            compile(_pointed_at(code, server), "<docs snippet>", "exec"),
            {} if namespace is None else namespace,
        )
    return out.getvalue()


def test_readme_openai_snippet(docs_server: ServerProc) -> None:
    pytest.importorskip("openai")
    code = _block(README, "from openai import OpenAI")
    assert _run(code, docs_server).strip()


def test_server_md_python_snippets(docs_server: ServerProc) -> None:
    """The Examples block, the structured outputs block after it and the Responses API block,
    in one namespace as a reader runs them one after another."""
    pytest.importorskip("openai")
    pytest.importorskip("llguidance")
    namespace: dict[str, Any] = {}
    printed = _run(_block(SERVER_MD, "from openai import OpenAI"), docs_server, namespace)
    assert "CompletionUsage(" in printed  # print([c.text ...], r.usage)
    _run(_block(SERVER_MD, "# Structured outputs and tools"), docs_server, namespace)
    printed = _run(_block(SERVER_MD, "r = client.responses.create("), docs_server, namespace)
    assert re.search(r"(completed|incomplete) \d+", printed), printed


def test_server_md_anthropic_snippet(docs_server: ServerProc) -> None:
    pytest.importorskip("anthropic")
    printed = _run(_block(SERVER_MD, "import anthropic"), docs_server)
    assert re.search(r"(end_turn|max_tokens|stop_sequence) \d+", printed), printed


def _curl_commands(block: str) -> list[str]:
    return [c for c in shell_commands(block) if c.startswith("curl ")]


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl")
def test_server_md_curl_examples(docs_server: ServerProc) -> None:
    """The Examples curls (but the Whisper one) and the sleep-mode curls, each a 2xx."""
    examples = _curl_commands(_block(SERVER_MD, "curl http://localhost:8000/v1/models", "bash"))
    sleep = _curl_commands(_block(SERVER_MD, "PAGED_SERVER_DEV_MODE=1 paged-server", "bash"))
    commands = [c for c in examples if "/audio/" not in c] + sleep
    assert len(commands) >= 11, commands
    for command in commands:
        run = subprocess.run(
            [
                "bash",
                "-c",
                _pointed_at(command.replace("curl ", "curl -sS --fail ", 1), docs_server),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert run.returncode == 0, (command, run.stdout[-500:], run.stderr[-500:])
        assert run.stdout.strip(), command


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": SRC_PATH + os.pathsep + os.environ.get("PYTHONPATH", "")}


def test_terminal_client_examples(docs_server: ServerProc) -> None:
    """`paged-server chat -q ... --stats` and `paged-server complete -q ... --max-tokens 16` as
    docs/server.md writes them, pointed at the server with --url."""
    block = _block(SERVER_MD, "paged-server chat ", "bash")
    commands = [c for c in shell_commands(block) if " -q " in c]
    assert len(commands) == 2, commands
    for command in commands:
        argv = paged_server_argv(command)
        assert argv is not None
        run = subprocess.run(
            [sys.executable, "-m", "paged_server", *argv, "--url", f"{docs_server.url}/v1"],
            capture_output=True,
            text=True,
            timeout=60,
            env=_env(),
        )
        assert run.returncode == 0, (command, run.stderr[-800:])
        assert f"Using model: {DEFAULT_NAME}" in run.stdout, run.stdout


def test_run_batch_example(tiny_model: str, tmp_path: Path) -> None:
    """The Batch files example: its batch.jsonl through `paged-server run-batch` (the model
    given as the docs' second command gives one), each record shaped as the doc's JSON line."""
    block = _block(SERVER_MD, "cat > batch.jsonl", "bash")
    lines = block.split("\n")
    batch = "\n".join(lines[1 : lines.index("JSONL")]) + "\n"
    (tmp_path / "batch.jsonl").write_text(batch)
    argv = ["run-batch", "-i", "batch.jsonl", "-o", "results.jsonl", tiny_model, *ENGINE_ARGS]
    run = subprocess.run(
        [sys.executable, "-m", "paged_server", *argv],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
    )
    assert run.returncode == 0, run.stderr[-1500:]
    assert "2 lines (0 failed)" in run.stderr
    shape = json.loads(
        _block(SERVER_MD, '{"id": "batch_req_', "json").replace("{...the route's answer...}", "{}")
    )
    records = [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["custom_id"] for r in records] == ["q1", "q2"]
    for record in records:
        assert set(record) == set(shape) and set(record["response"]) == set(shape["response"])
        assert record["id"].startswith("batch_req_") and record["error"] is None
        assert record["response"]["status_code"] == 200
        assert record["response"]["body"]["model"] == DEFAULT_NAME


def test_documented_parser_names() -> None:
    """docs/server.md's `--tool-call-parser` / `--reasoning-parser` lists (Flags) are the
    registries' names, and README.md's counts of them hold."""
    from paged_server.reasoning import REASONING_PARSERS
    from paged_server.tool_parsers import TOOL_PARSERS

    text = SERVER_MD.read_text()
    flags = text[text.index("## Flags") :]
    for flag, end, names in (
        ("--tool-call-parser", "accepted)", TOOL_PARSERS),
        ("--reasoning-parser", "above)", REASONING_PARSERS),
    ):
        start = flags.index(f"`{flag}`\n(")
        listed = set(re.findall(r"`([a-z0-9_]+)`", flags[start : flags.index(end, start)]))
        assert listed == set(names), (flag, listed ^ set(names))
    readme = " ".join(README.read_text().split())
    assert f"vLLM's {len(TOOL_PARSERS)} parser names" in readme
    assert f"its {len(REASONING_PARSERS)} `--reasoning-parser` names" in readme


def test_metrics_prefix_as_documented(docs_server: ServerProc) -> None:
    """README.md / docs/server.md Metrics: `/metrics` names are `paged:...` by default and
    `--metrics-prefix vllm` gives vLLM's own `vllm:...`."""
    _, _, text = docs_server.request("GET", "/metrics")
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line[:1] != "#"}
    assert "paged:num_requests_running" in names and "paged:request_success_total" in names
    assert not any(n.startswith("vllm:") for n in names)
    assert parse_args(["--metrics-prefix", "vllm"]).metrics_prefix == "vllm"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [  # docs/server.md Errors: which field a context overflow names
        ("/v1/completions", {"prompt": "x", "max_tokens": 1000}, "max_tokens"),
        ("/v1/completions", {"prompt": [1] * 300, "max_tokens": 1}, "prompt"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 1000},
            "max_tokens",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x " * 300}]},
            "messages",
        ),
    ],
)
def test_context_overflow_param(docs_server: ServerProc, path: str, body: dict, param: str) -> None:
    status, _, answer = docs_server.request("POST", path, body)
    assert status == 400 and answer["error"]["param"] == param, answer
