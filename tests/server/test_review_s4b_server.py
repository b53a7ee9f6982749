"""Review of the hostile-template bounds (template_budget.py): a request template's text bound
held only once the render had finished, so a short loop of large pieces had the server build
the whole text first (229 MiB in under a second in the probe; a 5 s budget's worth runs to
gigabytes, and the clock is read only every 256 trace events). The bound now stops the render
as its root yields pass it."""

from __future__ import annotations

import resource
from types import SimpleNamespace

import pytest
import test_hardening as hardening

from paged_server import template_budget
from paged_server.app import MAX_RENDERED_CHARS

CHAT = [{"role": "user", "content": "Hi there"}]  # 8 characters
PIECE = 60_000  # copies of the content a loop iteration yields: 480,000 characters
# 80 pieces: 38.4M characters in all, past the bound after 35 of them
LOOP = "{% for i in range(80) %}{{ messages[0]['content'] * " + str(PIECE) + " }}{% endfor %}"

trusting = hardening.trusting


def test_bounded_stops_a_render_as_its_output_passes_the_bound() -> None:
    """The text bound stops the template while it renders: what it had yielded by then is at
    most the bound plus one piece, and the process never held the rest."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    bounded, exceeded = template_budget.bounded, template_budget.TemplateOutputExceeded
    template = ImmutableSandboxedEnvironment().from_string(
        "{% for i in range(400) %}{{ 'a' * (1000000 + i) }}{% endfor %}"  # 400 MB in all
    )
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(exceeded) as caught:
        bounded(template.render, 60.0, max_chars=4_000_000)
    assert 4_000_000 < caught.value.chars <= 5_000_100, caught.value.chars
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 200 * 1024, grown_kib  # not the 400 MB (twice, joined) of the old way
    # a render within the bound is unchanged, macros and all
    small = ImmutableSandboxedEnvironment().from_string(
        "{% macro m(x) %}<{{ x }}>{% endmacro %}{% for i in range(3) %}{{ m(i) }}{% endfor %}"
    )
    assert bounded(small.render, 60.0, max_chars=9) == "<0><1><2>"
    with pytest.raises(exceeded):
        bounded(small.render, 60.0, max_chars=8)


def test_a_loop_of_large_pieces_is_refused_as_it_passes_the_bound(
    trusting: SimpleNamespace,
) -> None:
    """Over HTTP: a 400 naming chat_template that counts what had rendered when it was stopped
    (the old code rendered all 38.4M characters, then refused them)."""
    body = {"messages": CHAT, "chat_template": LOOP}
    status, _, r = trusting.http.request("POST", "/tokenize", body, timeout=30)
    assert status == 400, r
    assert r["error"]["param"] == "chat_template", r
    rendered = int(r["error"]["message"].split(" rendered ")[1].split()[0])
    assert MAX_RENDERED_CHARS < rendered <= MAX_RENDERED_CHARS + 8 * PIECE, rendered
    # the server serves on: the same conversation through its own template
    status, _, r = trusting.http.request("POST", "/tokenize", {"messages": CHAT}, timeout=30)
    assert status == 200 and r["count"] > 0, r


def test_the_budget_holds_when_each_iteration_is_a_costly_c_step() -> None:
    """The clock was read every 256 trace events; a loop whose iterations each build a large
    string (2 to 3 events apiece) ran ~100 of them past the budget (0.5 s -> 1.7 s). Read every
    16 events, it stops within a few iterations of it."""
    import time

    from jinja2.sandbox import ImmutableSandboxedEnvironment

    template = ImmutableSandboxedEnvironment().from_string(
        "{% for i in range(5000) %}{% set x = 'a' * (80000000 + i) %}{% endfor %}"
    )
    start = time.monotonic()
    with pytest.raises(template_budget.TemplateBudgetExceeded):
        template_budget.bounded(template.render, 0.5)
    assert time.monotonic() - start < 2.5  # (0.6 s quiet; the old code: 3.7 s)
