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
