"""Hostile chat templates on a server that trusts request templates (--trust-request-chat-template,
vLLM's flag), kept as regressions of an audit of the templating surface:

- Jinja's sandbox stops attribute escapes and ranges past 100,000 items (test_hardening.py), but
  not work: two nested 100,000-item loops, or `lipsum(10**5)`, rendered for hours on the
  request's thread. A request's template renders within a time budget now (template_budget.py):
  past it, a 400 naming the field that carried the template.
- Every render held the HTTP side's tokenizer lock, so that one request stopped every other
  request's tokenization (plain /tokenize included) until it ended: renders run outside it now.
- A short template can render far more text than a client may send (`content * 2200000`); its
  tokenization took minutes. A request template's output is held to the request body limit's
  worth of characters.

vLLM renders a trusted request template with no bound (its flag is for trusted clients); these
are bounds of our own. One C-level step over a huge count (`'a' * 10**10`, which Jinja even
folds while compiling) is still not interrupted: see template_budget.py.
"""

from __future__ import annotations

import sys
import threading
import time
from types import SimpleNamespace

import pytest
import test_hardening as hardening

from paged_server.template_budget import TemplateBudgetExceeded, bounded

CHAT = [{"role": "user", "content": "Hi there"}]
NESTED = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}x"
BUDGET = 0.5  # seconds: the app's budget in these tests


# test_hardening's server: the fake engine behind a real HF tokenizer, request templates
# trusted (a fixture: this module's own instance)
trusting = hardening.trusting


@pytest.fixture(scope="module", autouse=True)
def _budget(trusting: SimpleNamespace) -> None:
    trusting.app.template_seconds = BUDGET


def _post(srv: SimpleNamespace, path: str, body: dict, timeout: float = 20.0) -> tuple[int, dict]:
    status, _, payload = srv.http.request("POST", path, body, timeout=timeout)
    return status, payload


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/tokenize", {"chat_template": NESTED}, "chat_template"),
        ("/v1/chat/completions", {"chat_template": NESTED, "max_tokens": 1}, "chat_template"),
        ("/tokenize", {"chat_template_kwargs": {"chat_template": NESTED}}, "chat_template_kwargs"),
        ("/tokenize", {"chat_template": "{{ lipsum(100000) }}"}, "chat_template"),
        (
            "/tokenize",  # a macro's calls, not a loop
            {"chat_template": "{% macro f(n) %}{% for i in range(n) %}{% endfor %}{{ f(n) }}"
             "{% endmacro %}{{ f(100000) }}"},
            "chat_template",
        ),
    ],
)  # fmt: skip
def test_a_template_that_renders_for_hours_is_cut_off_by_its_budget(
    trusting: SimpleNamespace, path: str, extra: dict, param: str
) -> None:
    start = time.monotonic()
    status, r = _post(trusting, path, {"messages": CHAT, **extra})
    assert status == 400, r
    assert r["error"]["param"] == param and "did not render within" in r["error"]["message"]
    assert time.monotonic() - start < BUDGET + 5


def test_other_requests_are_served_while_a_request_template_renders(
    trusting: SimpleNamespace,
) -> None:
    trusting.app.template_seconds = 4.0  # (behind the lock, the others waited ~3.7 s)
    try:
        slow = threading.Thread(
            target=_post, args=(trusting, "/tokenize", {"messages": CHAT, "chat_template": NESTED})
        )
        slow.start()
        time.sleep(0.3)  # the render has begun
        for body in ({"prompt": "ok"}, {"messages": CHAT}):
            start = time.monotonic()
            status, r = _post(trusting, "/tokenize", body, timeout=3.0)
            assert status == 200 and r["count"] > 0, r
            assert time.monotonic() - start < 2.0
        slow.join(timeout=10)
        assert not slow.is_alive()
    finally:
        trusting.app.template_seconds = BUDGET


def test_a_template_rendering_past_the_bound_is_a_400(trusting: SimpleNamespace) -> None:
    """2200000 copies of "Hi there" (17.6M characters, past 16 MiB) render in a blink; their
    tokenization would take minutes."""
    body = {"messages": CHAT, "chat_template": "{{ messages[0]['content'] * 2200000 }}"}
    status, r = _post(trusting, "/tokenize", body)
    assert status == 400, r
    assert r["error"]["param"] == "chat_template" and "17600000 characters" in r["error"]["message"]


def test_a_request_template_renders_as_the_servers_own(trusting: SimpleNamespace) -> None:
    """The budget changes nothing about a template that renders: the model's own template sent
    with the request gives the ids the server's gives."""
    own = trusting.tokenizer.chat_template
    _, served = _post(trusting, "/tokenize", {"messages": CHAT})
    status, sent = _post(trusting, "/tokenize", {"messages": CHAT, "chat_template": own})
    assert status == 200 and sent["tokens"] == served["tokens"]


def test_bounded_restores_the_callers_trace_function() -> None:
    def outer(frame: object, event: str, arg: object) -> None:
        return None

    previous = sys.gettrace()
    sys.settrace(outer)
    try:
        assert bounded(lambda: sum(range(10)), 1.0) == 45
        assert sys.gettrace() is outer

        def step() -> None:
            pass

        def spin() -> None:  # a Python call per turn: the budget is read at calls (and at
            while True:  # the template's own lines)
                step()

        with pytest.raises(TemplateBudgetExceeded):
            bounded(spin, 0.05)
        assert sys.gettrace() is outer
    finally:
        sys.settrace(previous)


# ---- content parts read as text (vLLM's) -----------------------------------------------------
ANSWERED = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "I can't help with that."},
    {"role": "user", "content": "Why?"},
]


@pytest.mark.parametrize(
    "parts",
    [
        [{"type": "refusal", "refusal": "I can't help with that."}],  # OpenAI's assistant part
        [{"type": "output_text", "text": "I can't help with that."}],
        [{"type": "input_text", "text": "I can't help with that."}],
        ["I can't help with that."],
    ],
)
def test_text_like_parts_render_as_their_text(trusting: SimpleNamespace, parts: list) -> None:
    """An assistant message replayed with OpenAI's `refusal` part (or the Responses API's text
    parts, or a bare string) was a 400; vLLM reads each as text."""
    _, plain = _post(trusting, "/tokenize", {"messages": ANSWERED})
    messages = [ANSWERED[0], {"role": "assistant", "content": parts}, ANSWERED[2]]
    status, r = _post(trusting, "/tokenize", {"messages": messages})
    assert status == 200 and r["tokens"] == plain["tokens"], r


def test_a_refusal_part_without_its_text_is_a_400(trusting: SimpleNamespace) -> None:
    messages = [ANSWERED[0], {"role": "assistant", "content": [{"type": "refusal"}]}]
    status, r = _post(trusting, "/tokenize", {"messages": messages})
    assert status == 400 and r["error"]["param"] == "messages[1].content"
    assert "'refusal'" in r["error"]["message"]


# ---- huge id lists ---------------------------------------------------------------------------
def test_a_huge_detokenize_runs_on_the_long_tokenizer(trusting: SimpleNamespace) -> None:
    """An 8M-id /detokenize (a 16 MiB body holds that many) decodes for seconds, and
    `return_token_strs` of a huge prompt as long: both held the shared tokenizer's lock, as a
    long text's encoding once did (test_hostile_audit.py). While another request holds that
    lock they are served now, on the long texts' tokenizer copy."""
    long_text = "hello world " * 40_000  # past _LONG_TEXT characters: makes the copy
    status, r = _post(trusting, "/tokenize", {"prompt": long_text})
    assert status == 200, r
    ids = r["tokens"]
    assert len(ids) > 1 << 16  # (_LONG_TEXT) past it in ids too
    with trusting.app.tok_lock:  # another request's tokenization, however long
        status, r = _post(trusting, "/detokenize", {"tokens": ids}, timeout=10.0)
        assert status == 200 and r["prompt"] == long_text, r
        body = {"prompt": long_text, "return_token_strs": True}
        status, r = _post(trusting, "/tokenize", body, timeout=10.0)
        assert status == 200 and len(r["token_strs"]) == len(ids)
