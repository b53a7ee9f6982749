"""`paged-server --speculative-config '{...}'`: n-gram speculation, suffix decoding and an EAGLE-3
head behind the OpenAI API give the plain server's greedy text (penalized and schema-constrained
requests too), and the spec_decode counters show up in /metrics."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest
from server_proc import REAL_ARGS, ServerProc, launch, parse_metrics

from paged_server.cli import parse_args, start_engine

openai = pytest.importorskip("openai")

PROMPTS = ["one two three one two three one two", "a b a b a b a b a b", "Hello, my name is"]


def _texts(server: ServerProc) -> list[str]:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="EMPTY", max_retries=0)
    r = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=24, temperature=0)
    stream = client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=24, temperature=0, stream=True
    )
    return [c.text for c in r.choices] + ["".join(c.choices[0].text for c in stream)]


def _penalized_and_constrained(server: ServerProc) -> list[str]:
    """Rows that draft with their penalties and grammar (test_spec_penalties.py,
    test_spec_structured.py): a chat client's penalties, a JSON schema, a regex."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="EMPTY", max_retries=0)
    r = client.completions.create(
        model="tiny", prompt=PROMPTS, max_tokens=24, temperature=0, presence_penalty=0.5,
        frequency_penalty=0.3, extra_body={"repetition_penalty": 1.1},
    )  # fmt: skip
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "a JSON object"}], max_tokens=30,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    )  # fmt: skip
    regex = client.completions.create(
        model="tiny", prompt=PROMPTS[1], max_tokens=12, temperature=0,
        extra_body={"structured_outputs": {"regex": "(a b ){3}c"}},
    )  # fmt: skip
    return [c.text for c in r.choices] + [chat.choices[0].message.content, regex.choices[0].text]


def test_speculative_server_matches_the_plain_one(real_server, tiny_model):
    want = _texts(real_server)
    want_constrained = _penalized_and_constrained(real_server)
    config = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    args = ["--model", tiny_model, "--speculative-config", config, *REAL_ARGS]
    server = launch(args, fake=False)
    try:
        assert _texts(server) == want
        assert _penalized_and_constrained(server) == want_constrained
        assert want_constrained[-1] == "a b a b a b c"
        text = _settled_metrics(server)  # every figure below from this one snapshot
        m = parse_metrics(text)
        drafts = m["paged:spec_decode_num_drafts_total"]
        drafted = m["paged:spec_decode_num_draft_tokens_total"]
        accepted = m["paged:spec_decode_num_accepted_tokens_total"]
        assert drafted > 0 and 0 <= accepted <= drafted
        assert m["paged:spec_decode_draft_acceptance_rate"] == pytest.approx(accepted / drafted)
        assert m["paged:spec_decode_mean_acceptance_length"] == pytest.approx(1 + accepted / drafts)
        # vLLM's labelled counter: one sample per draft position, summing to the accepted total
        per_pos = {
            int(pos): float(value)
            for pos, value in re.findall(
                r'^paged:spec_decode_num_accepted_tokens_per_pos_total\{engine="0",'
                r'model_name="[^"]*",position="(\d+)"\} (\S+)$',
                text,
                re.MULTILINE,
            )
        }
        assert sorted(per_pos) == [0, 1, 2]
        assert sum(per_pos.values()) == accepted and per_pos[0] <= drafts
    finally:
        assert server.stop() == 0, "".join(server.lines[-30:])


def test_suffix_decoding_behind_the_server(real_server, tiny_model):
    """`--speculative-config '{"method": "suffix"}'` (vLLM's defaults): the plain server's greedy
    text, penalized and constrained rows included, with drafts accepted (the repetitive prompts,
    and the finished requests' outputs for the streamed repeat of the first)."""
    want = _texts(real_server)
    want_constrained = _penalized_and_constrained(real_server)
    args = ["--model", tiny_model, "--speculative-config", '{"method": "suffix"}', *REAL_ARGS]
    server = launch(args, fake=False)
    try:
        assert _texts(server) == want
        assert _penalized_and_constrained(server) == want_constrained
        m = parse_metrics(_settled_metrics(server))
        assert m["paged:spec_decode_num_accepted_tokens_total"] > 0
    finally:
        assert server.stop() == 0, "".join(server.lines[-30:])


def test_eagle3_head_behind_the_server(real_server, tiny_model, tmp_path):
    """`--speculative-config '{"model": HEAD}'` with an EAGLE-3 head in the speculators layout
    (aux layers [1, 1, 1] of the 2-layer model): the server tells the method and the draft
    count from the head's config, and gives the plain server's greedy text."""
    from paged_engine.testing import write_tiny_eagle3_head

    want = _texts(real_server)
    head = write_tiny_eagle3_head(
        tmp_path / "head", tiny_model, speculators=True, eagle_aux_hidden_state_layer_ids=[1, 1, 1]
    )
    args = ["--model", tiny_model, "--speculative-config", json.dumps({"model": str(head)})]
    server = launch([*args, *REAL_ARGS], fake=False)
    try:
        assert _texts(server) == want
        m = parse_metrics(_settled_metrics(server))
        assert m["paged:spec_decode_num_draft_tokens_total"] > 0
    finally:
        assert server.stop() == 0, "".join(server.lines[-30:])


def _settled_metrics(server) -> str:
    """/metrics once the last step's counters landed: a client can have its answer before the
    engine records that step's speculation counters, so wait for two equal reads."""
    deadline = time.monotonic() + 10
    _, _, last = server.request("GET", "/metrics")
    while True:
        time.sleep(0.2)
        _, _, text = server.request("GET", "/metrics")
        spec = [line for line in text.splitlines() if "spec_decode" in line]
        if spec == [line for line in last.splitlines() if "spec_decode" in line]:
            return text
        assert time.monotonic() < deadline, "speculation counters kept changing"
        last = text


def test_bad_speculative_config_fails_at_start(tiny_model, capsys):
    # The command itself: a config that is not JSON stops it at the flags (exit code 2, before
    # the engine's imports). The engine's refusals, through the same start_engine the command
    # runs (its exit code 2 for them: test_cli.py's --trust-remote-code refusal): a fresh
    # interpreter importing torch and the engine for each would only repeat that.
    r = subprocess.run(
        [sys.executable, "-m", "paged_server", "--model", tiny_model, "--port", "0",
         "--speculative-config", "{not json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2 and "not JSON" in r.stderr, r.stderr[-2000:]
    cases = (
        ('{"method": "dflash", "num_speculative_tokens": 2}', "not supported"),
        ('{"method": "suffix", "suffix_decoding_min_token_prob": 2}', "min_token_prob must be"),
        ('{"method": "eagle"}', "speculative_config.model must name"),  # a head to run
    )
    for bad, needle in cases:
        args = parse_args(["--model", tiny_model, "--port", "0", "--speculative-config", bad])
        assert start_engine(args, "paged-server") is None
        err = capsys.readouterr().err
        assert "paged-server: cannot start the engine: " in err and needle in err, err
