"""What the speculative-decoding tests share (test_spec_decode.py: n-gram, test_spec_suffix.py:
suffix decoding, test_spec_draft_model.py): a prompt mix where lookups find drafts, an engine run
that checks every block came back, and outputs as (token ids, the chosen tokens' logprobs)."""

from __future__ import annotations

import random

from paged_engine import LLM


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
