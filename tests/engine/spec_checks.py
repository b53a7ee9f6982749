"""What the speculative-decoding tests share (test_spec_decode.py: n-gram, test_spec_suffix.py:
suffix decoding, test_spec_draft_model.py): a prompt mix where lookups find drafts, an engine run
that checks every block came back, and outputs as (token ids, the chosen tokens' logprobs)."""

from __future__ import annotations

import random

import pytest

from paged_engine import LLM, SamplingParams


def spec_prompts(seed: int = 0) -> list[dict]:
    """Two repetitive prompts (drafts found at once) and five random ones."""
    rng = random.Random(seed)
    repetitive = [{"prompt_token_ids": [5, 6, 7, 8, 9] * 6}, {"prompt_token_ids": [40, 41] * 9}]
    others = [
        {"prompt_token_ids": [rng.randrange(3, 400) for _ in range(rng.randint(1, 40))]}
        for _ in range(5)
    ]
    return repetitive + others


def run_engine(path, prompts, params, **kwargs):
    """(outputs, stats) of a fresh float32 engine (block size 8, max_model_len 256 unless
    given); every block is free again at the end."""
    kwargs.setdefault("max_model_len", 256)
    llm = LLM(model=str(path), dtype="float32", block_size=8, **kwargs)
    outs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    assert stats.num_used_blocks == 0
    return outs, stats


def tokens_and_logprobs(outs) -> list[tuple[list[int], list[float]]]:
    """Each completion's token ids and the logprobs of the tokens chosen."""
    return [
        (list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs or [])])
        for o in outs
        for c in o.outputs
    ]


def assert_logprobs_recomputed(path, outs) -> None:
    """Each emitted token's logprob (raw, under the target) equals its prompt logprob when the
    sequence is run again from scratch as a prompt: nothing a step read came from another
    sequence's KV or from a rejected draft."""
    prompts, recorded = [], []
    for o in outs:
        for c in o.outputs:
            prompts.append({"prompt_token_ids": list(o.prompt_token_ids) + list(c.token_ids)})
            recorded.append([lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    again, _ = run_engine(path, prompts, params)
    for r, got in zip(again, recorded):
        ids, plp = r.prompt_token_ids, r.prompt_logprobs
        start = len(ids) - len(got)
        want = [plp[i][ids[i]].logprob for i in range(start, len(ids))]
        assert got == pytest.approx(want, abs=1e-4)


def assert_plain_through_preemption(path, speculative_config: dict):
    """A pool too small for the batch (preemption mid-speculation), stop tokens that land
    inside accepted drafts, max_tokens never exceeded: the plain engine's tokens, logprobs and
    finish reasons. Returns the speculating run's stats."""
    prompts = spec_prompts(3) * 2
    rng = random.Random(5)
    params = [
        SamplingParams(
            temperature=0,
            max_tokens=rng.randint(5, 40),
            stop_token_ids=[rng.randrange(3, 400)] if i % 3 == 0 else None,
            logprobs=1,
        )
        for i in range(len(prompts))
    ]
    kwargs = {"num_gpu_blocks_override": 16, "max_num_seqs": 8, "max_model_len": 96}
    plain, _ = run_engine(path, prompts, params, **kwargs)
    spec, stats = run_engine(path, prompts, params, speculative_config=speculative_config, **kwargs)
    assert stats.num_preemptions > 0
    got, want = tokens_and_logprobs(spec), tokens_and_logprobs(plain)
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, g), (_, w) in zip(got, want):
        assert g == pytest.approx(w, abs=1e-4)
    for o, p, ref in zip(spec, params, plain):
        assert len(o.outputs[0].token_ids) <= p.max_tokens
        assert o.outputs[0].finish_reason == ref.outputs[0].finish_reason
    return stats
