"""What a long-running server keeps per distinct request content stays bounded: a few hundred
requests that each differ leave the structure keyed by their content under its bound.

Responses API chains under `truncation: "auto"`: a chain never stops (its oldest turns are
dropped from the prompt), so the conversation a stored response keeps for the next turn must
be the one that was cut, not every turn since the first (which grew the store by two items a
turn, and the work of each turn with it). Over a ScriptedEngine in this process; the fake chat
template takes one token per byte of `<role>content\\n`.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from fake_engine import ScriptedEngine
from server_proc import serve_in_process

MAX_LEN = 256
ARGS = ["--max-model-len", str(MAX_LEN), "--served-model-name", "tiny", "--client-timeout", "3"]


@pytest.fixture(scope="module")
def srv() -> Iterator[SimpleNamespace]:
    engine = ScriptedEngine(max_model_len=MAX_LEN, step_time=0.0005)
    with serve_in_process(ARGS, engine) as (http, app):
        yield SimpleNamespace(http=http, engine=engine, app=app)


def _create(srv: SimpleNamespace, **body) -> dict:
    srv.engine.script = "ok"
    status, _, payload = srv.http.request("POST", "/v1/responses", body)
    assert status == 200, payload
    return payload


def _sent(srv: SimpleNamespace, rid: str) -> str:
    return srv.engine.prompts[f"{rid}-0"]["prompt"]


def test_a_truncated_responses_chain_stores_a_bounded_context(srv: SimpleNamespace) -> None:
    turns = 300
    # each turn (user + "ok" answer) renders to > 30 tokens: at most MAX_LEN // 30 turns fit
    most_items = 1 + 2 * (MAX_LEN // 30 + 1)  # the developer message + the turns that fit
    first = _create(
        srv, input=[{"role": "developer", "content": "Rules."}, {"role": "user", "content": "q0"}]
    )
    prev, sizes = first["id"], []
    for i in range(1, turns):
        r = _create(
            srv,
            input=f"question {i} " + "q" * 12,
            previous_response_id=prev,
            truncation="auto",
        )
        prev = r["id"]
        sizes.append(len(srv.app.response_store.get(prev).context))
    assert max(sizes) <= most_items, sizes[-5:]
    # the opening message and the latest turn are still what the model sees
    last = _sent(srv, prev)
    assert last.startswith("<system>Rules.\n") and f"question {turns - 1} " in last
    assert "question 1 " not in last
    # nothing the next turn needs was lost: the whole conversation, sent as one input, is cut
    # to the same prompt as the stored one continued
    whole = [{"role": "developer", "content": "Rules."}, {"role": "user", "content": "q0"}]
    for i in range(1, turns):
        whole += [
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": f"question {i} " + "q" * 12},
        ]
    again = _create(srv, input=whole, truncation="auto")
    assert _sent(srv, again["id"]) == last


def test_a_chain_that_fits_keeps_every_turn(srv: SimpleNamespace) -> None:
    """No cut, nothing dropped: truncation "auto" changes the stored context only when it cuts."""
    r = _create(srv, input="a", truncation="auto")
    for word in ("b", "c"):
        r = _create(srv, input=word, previous_response_id=r["id"], truncation="auto")
    context = srv.app.response_store.get(r["id"]).context
    assert [it.get("content") for it in context] == ["a", "ok", "b", "ok", "c", "ok"]
