"""N-gram speculation of constrained requests (structured outputs, bad words).

A constrained row drafts the leading n-gram tokens its constraint allows; each draft position
is verified under its own mask (the grammar advanced through the drafts before it, then rolled
back), and the engine core advances the matcher with the tokens kept. Checked on a target that
repeats its last token (so drafts are accepted) and on a random one:

- greedy: plain decoding's tokens, logprobs and finish reasons under a regex that switches
  letters (drafts cut where the grammar switches), one that forces every token (three drafts a
  step, each under a different mask), JSON schemas, and bad words;
- `valid_drafts`: the grammar's and the bad words' limits, never past a token that ends the
  grammar, and the matcher left as it was;
- draft models and heads do not draft for constrained rows (their drafts would skip the
  grammar).
"""

from __future__ import annotations

import json
import re

import pytest

from paged_engine import SamplingParams, StructuredOutputsParams
from paged_engine.testing import write_tiny_model

pytest.importorskip("llguidance")
pytest.importorskip("transformers")
from spec_checks import run_engine
from test_spec_penalties import repeating  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("no_isolated_step_failures")  # conftest.py

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}


def _ids(path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path).encode(text, add_special_tokens=False)


def _assert_same(got, want) -> None:
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.outputs[0].finish_reason for o in got] == [o.outputs[0].finish_reason for o in want]
    for o, w in zip(got, want):
        g, e = o.outputs[0], w.outputs[0]
        if e.logprobs:
            lp = [x[t].logprob for t, x in zip(g.token_ids, g.logprobs)]
            want = [x[t].logprob for t, x in zip(e.token_ids, e.logprobs)]
            assert lp == pytest.approx(want, abs=1e-4)


def _regex(pattern: str, **kw) -> SamplingParams:
    so = StructuredOutputsParams(regex=pattern)
    return SamplingParams(temperature=0, max_tokens=40, logprobs=1, structured_outputs=so, **kw)


def test_regex_rows_draft_under_their_own_masks(repeating):  # noqa: F811
    """a{6}b{6}c{6} after "aaaaa": the target repeats its letter, the grammar moves it on;
    drafts of the old letter past a switch are cut, the rest accepted. (xyz){6} after
    "xyzxyz": every token forced, three drafts a step, each position under the mask after
    the drafts before it. The completing token is never drafted."""
    prompts = [
        {"prompt_token_ids": _ids(repeating, "aaaaa")},
        {"prompt_token_ids": _ids(repeating, "xyzxyz")},
    ]
    params = [_regex(r"a{6}b{6}c{6}"), _regex(r"(xyz){6}")]
    plain, _ = run_engine(repeating, prompts, params)
    got, stats = run_engine(repeating, prompts, params, speculative_config=NGRAM)
    _assert_same(got, plain)
    assert got[0].outputs[0].text == "aaaaaabbbbbbcccccc"
    assert got[1].outputs[0].text == "xyz" * 6
    assert all(o.outputs[0].finish_reason == "stop" for o in got)
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
    assert stats.spec_decode_num_draft_tokens >= 18  # 7 + 12 on this tokenizer
    assert stats.spec_decode_num_draft_tokens > stats.spec_decode_num_drafts  # several a step


def test_bad_words_rows_draft(repeating):  # noqa: F811
    """bad_words "aaa" on a target that would repeat "a" forever: drafts stop before a token
    that completes the word; plain decoding's tokens, and the word never appears."""
    prompts = [{"prompt_token_ids": _ids(repeating, "aaaaa")}] * 2
    params = [
        SamplingParams(temperature=0, max_tokens=30, logprobs=1, bad_words=["aaa"]),
        SamplingParams(temperature=0, max_tokens=30, bad_words=["aaa"], n=2, best_of=2),
    ]
    plain, _ = run_engine(repeating, prompts, params)
    got, stats = run_engine(repeating, prompts, params, speculative_config=NGRAM)
    _assert_same(got, plain)
    assert [[c.token_ids for c in o.outputs] for o in got] == [
        [c.token_ids for c in o.outputs] for o in plain
    ]
    assert all("aaa" not in c.text for o in got for c in o.outputs)
    assert stats.spec_decode_num_accepted_tokens > 0


def test_json_schemas_match_plain(tmp_path):
    """JSON schemas on a random-weight model (drafts mostly rejected): plain decoding's
    tokens, every output valid."""
    target = write_tiny_model(tmp_path / "llama", "llama", seed=1)
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
        "required": ["name", "n"],
    }
    so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    params = SamplingParams(temperature=0, max_tokens=60, logprobs=1, structured_outputs=so)
    prompts = [{"prompt_token_ids": _ids(target, '{"name": "ab", "n": 12} ' * k)} for k in (1, 3)]
    plain, _ = run_engine(target, prompts, params)
    got, stats = run_engine(target, prompts, params, speculative_config=NGRAM)
    _assert_same(got, plain)
    assert stats.spec_decode_num_draft_tokens > 0
    for o in got:
        if o.outputs[0].finish_reason == "stop":
            assert set(json.loads(o.outputs[0].text)) == {"name", "n"}


def test_valid_drafts(repeating):  # noqa: F811
    from transformers import AutoTokenizer

    from paged_engine.structured_output.grammar import grammar_text
    from paged_engine.structured_output.llguidance_backend import LLGuidanceBackend
    from paged_engine.structured_output.request_constraint import RequestConstraint

    tok = AutoTokenizer.from_pretrained(repeating)
    a, b, c = (_ids(repeating, x)[0] for x in "abc")
    backend = LLGuidanceBackend(tok, len(tok), [tok.eos_token_id])
    text = grammar_text(StructuredOutputsParams(regex=r"a{3}b{2}c"))
    compiled = backend.compile(text)

    class Done:  # a compiled grammar, as the manager's future gives it
        def result(self):
            return compiled

        def done(self):
            return True

    constraint = RequestConstraint(Done(), [[b, b]])  # type: ignore[arg-type]
    m = constraint.matcher(1)
    assert constraint.valid_drafts(1, [], [a, a, a, b, b]) == 4  # "bb" is a bad word
    assert constraint.valid_drafts(1, [], [a, b]) == 1  # the grammar wants a third "a"
    for t in (a, a, a, b):
        assert m.accept(t)
    # "c" would complete the grammar: never drafted (the position after it has no mask)
    assert constraint.valid_drafts(1, [a, a, a, b], [b, c]) == 0  # "bb" again
    plain = RequestConstraint(Done(), [])  # type: ignore[arg-type]
    m2 = plain.matcher(2)
    for t in (a, a, a, b):
        assert m2.accept(t)
    assert plain.valid_drafts(2, [a, a, a, b], [b, c, c]) == 1
    assert m2.accept(b) and not m2.is_stopped()  # rolled back: "b" is still next
    assert m2.accept(c) and m2.is_stopped()


def test_draft_models_skip_constrained_rows(tmp_path):
    """With a draft model, a constrained row does not draft (the worker's drafts would skip
    its grammar); the unconstrained rows beside it do. Outputs as plain."""
    target = write_tiny_model(tmp_path / "llama", "llama", seed=1)
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    regex = _regex(r"[a-z]{3}-[0-9]{2}")
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}] * 2
    spec = {"model": str(target), "num_speculative_tokens": 3}
    plain, _ = run_engine(target, prompts[:1], [regex])
    got, stats = run_engine(target, prompts[:1], [regex], speculative_config=spec)
    _assert_same(got, plain)
    assert re.fullmatch(r"[a-z]{3}-[0-9]{2}", got[0].outputs[0].text)
    assert stats.spec_decode_num_drafts == 0
    _, stats = run_engine(target, prompts, [regex, free], speculative_config=spec)
    assert stats.spec_decode_num_drafts > 0
