"""Regressions found by a review of this session's shared-code changes: a refused value is named
in its error, never echoed whole (a client's megabyte-long value made a megabyte-long 400 and log
line), and the faster stop-string holdback (engine/detokenizer.py) keeps the naive scan's answer."""

from __future__ import annotations

import random

import pytest

from paged_engine import SamplingParams, StructuredOutputsParams
from paged_engine.engine.detokenizer import stop_holdback

HUGE = "x" * 100_000


@pytest.mark.parametrize(
    "make",
    [
        lambda: StructuredOutputsParams(choice=HUGE),  # a string, not a list
        lambda: StructuredOutputsParams(choice=["a", {"k": HUGE}]),  # one bad item
        lambda: StructuredOutputsParams(json_object=HUGE),
        lambda: SamplingParams(stop={"a": HUGE}),  # neither a str nor a list
        lambda: SamplingParams(stop=["a", HUGE, ""]),
        lambda: SamplingParams(bad_words=[HUGE, 3]),
        lambda: SamplingParams(stop_token_ids=HUGE),
        lambda: SamplingParams(logit_bias=[HUGE]),
        lambda: SamplingParams(allowed_token_ids=HUGE),
        lambda: SamplingParams(extra_args=[HUGE]),
        lambda: SamplingParams(logprob_token_ids=HUGE),
        lambda: SamplingParams(temperature=HUGE),
        lambda: SamplingParams(max_tokens=HUGE),
        lambda: SamplingParams(ignore_eos=HUGE),
    ],
)
def test_a_refused_value_is_not_echoed_whole(make) -> None:
    with pytest.raises(ValueError) as e:
        make()
    assert len(str(e.value)) < 400, str(e.value)[:120]


def _naive_holdback(text: str, stops: list[str]) -> int:
    """The scan stop_holdback replaced: every prefix length of every stop, longest first."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best


def test_stop_holdback_matches_the_naive_scan() -> None:
    rng = random.Random(0)

    def word(lo: int, hi: int) -> str:
        return "".join(rng.choice("ab") for _ in range(rng.randint(lo, hi)))

    for _ in range(20_000):
        text, stops = word(0, 8), [word(1, 7) for _ in range(rng.randint(1, 3))]
        assert stop_holdback(text, stops) == _naive_holdback(text, stops), (text, stops)
    assert stop_holdback("", ["ab"]) == 0 and stop_holdback("xa", ["a"]) == 0
