"""`LLM.beam_search(prompts, BeamSearchParams(...))` as in vLLM: one BeamSearchOutput per
prompt, its beams best first, each beam's tokens and text including the prompt."""

from __future__ import annotations

from pathlib import Path

import pytest

from paged_engine import LLM, BeamSearchOutput, BeamSearchParams, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), dtype="float32", max_model_len=128, num_gpu_blocks_override=64)


def _score(seq, prompt_len: int, length_penalty: float) -> float:
    return seq.cum_logprob / (len(seq.tokens) - prompt_len) ** length_penalty


def test_beam_search_returns_vllms_records(llm: LLM) -> None:
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt": "Hello, my name"}, {"prompt_token_ids": [5, 6, 7]}, "abc"]
    outs = llm.beam_search(prompts, params)
    assert len(outs) == 3 and all(isinstance(o, BeamSearchOutput) for o in outs)
    tok = llm.get_tokenizer()
    same = llm.generate(prompts, params, use_tqdm=False)  # the engine's beams, as RequestOutputs
    for out, ref in zip(outs, same):
        n = len(ref.prompt_token_ids)
        assert len(out.sequences) == 3
        for seq, c in zip(out.sequences, ref.outputs):
            assert seq.tokens == ref.prompt_token_ids + c.token_ids
            assert len(seq.tokens) == n + 6
            assert seq.cum_logprob == pytest.approx(c.cumulative_logprob)
            assert seq.text == tok.decode(seq.tokens)
            assert seq.finish_reason == "length"
        scores = [_score(s, n, 1.0) for s in out.sequences]
        assert scores == sorted(scores, reverse=True)
        assert len({tuple(s.tokens) for s in out.sequences}) == 3


def test_concurrency_limit_gives_the_same_beams(llm: LLM) -> None:
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    prompts = ["one", "two", "three"]
    whole = llm.beam_search(prompts, params)
    limited = llm.beam_search(prompts, params, concurrency_limit=1)
    assert [[s.tokens for s in o.sequences] for o in whole] == [
        [s.tokens for s in o.sequences] for o in limited
    ]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"params": SamplingParams()}, "params must be a BeamSearchParams"),
        ({"lora_request": object()}, "lora_request"),
        ({"concurrency_limit": 0}, "concurrency_limit"),
    ],
)
def test_beam_search_refuses_what_it_cannot_do(llm: LLM, kwargs: dict, match: str) -> None:
    args = {"params": BeamSearchParams(beam_width=2, max_tokens=2), **kwargs}
    with pytest.raises(ValueError, match=match):
        llm.beam_search(["x"], **args)


@pytest.mark.parametrize("ignore_eos", [True, False])
def test_beam_logprobs_are_the_candidates_each_token_came_from(llm: LLM, ignore_eos) -> None:
    """vLLM's `BeamSearchSequence.logprobs`: one dict per generated token holding the raw
    logprobs of the 2 x beam_width candidates its beam chose from, ranked, the chosen token
    among them; the chosen ones sum to the beam's cumulative logprob, and each equals the
    token's logprob when the beam's text is scored as a prompt (forks keep their own history)."""
    width, max_tokens = 3, 7
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=ignore_eos)
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [40, 41, 40, 41]}, "abc"]
    outs = llm.beam_search(prompts, params)
    tok = llm.get_tokenizer()
    scored = []
    for out, prompt in zip(outs, prompts):
        n = len(prompt["prompt_token_ids"]) if isinstance(prompt, dict) else None
        for seq in out.sequences:
            n = n if n is not None else len(seq.tokens) - len(seq.logprobs)
            generated = seq.tokens[n:]
            assert len(seq.logprobs) == len(generated) > 0
            chosen = []
            for token, entry in zip(generated, seq.logprobs):
                assert len(entry) == 2 * width and token in entry
                ranked = sorted(entry.values(), key=lambda lp: lp.rank)
                assert [lp.rank for lp in ranked] == list(range(1, 2 * width + 1))
                assert [lp.logprob for lp in ranked] == sorted(
                    (lp.logprob for lp in ranked), reverse=True
                )
                assert entry[token].decoded_token == tok.decode([token])
                chosen.append(entry[token].logprob)
            assert sum(chosen) == pytest.approx(seq.cum_logprob, abs=1e-4)
            scored.append((seq.tokens, n, chosen))
    again = llm.generate(
        [{"prompt_token_ids": tokens} for tokens, _, _ in scored],
        SamplingParams(max_tokens=1, prompt_logprobs=0),
        use_tqdm=False,
    )
    for (tokens, n, chosen), out in zip(scored, again):
        want = [out.prompt_logprobs[p][tokens[p]].logprob for p in range(n, len(tokens))]
        assert chosen == pytest.approx(want, abs=1e-4)


def test_generate_with_use_beam_search_returns_asked_logprobs(llm: LLM) -> None:
    """SamplingParams(use_beam_search=True, logprobs=k): each finished beam's tokens with the
    top k of their candidates and the chosen one (as vLLM's server renders beam search);
    without logprobs, none. The values are LLM.beam_search's."""
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [9, 9, 9, 9]}]
    asked = SamplingParams(n=2, use_beam_search=True, max_tokens=5, temperature=0, logprobs=1)
    outs = llm.generate(prompts, asked, use_tqdm=False)
    full = llm.beam_search(prompts, BeamSearchParams(beam_width=2, max_tokens=5))
    for out, ref in zip(outs, full):
        for c, seq in zip(out.outputs, ref.sequences):
            assert len(c.logprobs) == len(c.token_ids)
            for token, entry, whole in zip(c.token_ids, c.logprobs, seq.logprobs):
                assert token in entry and 1 <= len(entry) <= 2
                assert min(lp.rank for lp in entry.values()) == 1
                assert {t: lp.logprob for t, lp in entry.items()} == {
                    t: whole[t].logprob for t in entry
                }
    plain = SamplingParams(n=2, use_beam_search=True, max_tokens=5, temperature=0)
    assert all(c.logprobs is None for o in llm.generate(prompts, plain) for c in o.outputs)
