"""vLLM's thinking_token_budget: at most N tokens inside the reasoning block, then the closer's
ids are forced and the sequence goes on freely. The state machine on its own (markers in the
prompt or the output, a closer the model writes itself, multi-token markers, forks), then the
engine against its own free greedy continuation."""

from __future__ import annotations

import pytest

from paged_engine import LLM, SamplingParams
from paged_engine.structured_output.thinking_budget import ThinkingBudget

OPEN, CLOSE = [7], [8, 9]


def _run(tb: ThinkingBudget, tokens: list[int], seq: int = 0) -> list[int | None]:
    """The forced id before each token, then that token accepted."""
    forced = []
    for t in tokens:
        forced.append(tb.forced(seq))
        tb.accept(seq, t)
    return forced


def test_the_state_machine():
    # the template opened the block, one token after it: budget 3 leaves 2
    tb = ThinkingBudget(OPEN, CLOSE, 3, [1, 2, 7, 5])
    assert _run(tb, [10, 11, 8, 9, 12]) == [None, None, 8, 9, None]
    assert tb.forced(0) is None  # closed: free from then on
    # budget 0 with the block open: the closer at once
    tb = ThinkingBudget(OPEN, CLOSE, 0, [7])
    assert _run(tb, [8, 9, 3]) == [8, 9, None]
    # no block in the prompt: free until the model opens one; the budget spent while the
    # model is writing the closer itself: the closer is finished, not started over; a second
    # block counts again from 0
    tb = ThinkingBudget(OPEN, CLOSE, 2, [1, 2])
    tokens = [3, 7, 4, 8, 9, 5, 7, 6, 6, 8, 9, 2]
    assert _run(tb, tokens) == [None, None, None, None, 9, None, None, None, None, 8, 9, None]
    # a closer the model writes within the budget closes the block
    tb = ThinkingBudget(OPEN, CLOSE, 5, [7])
    assert _run(tb, [4, 8, 9, 4, 4, 4, 4, 4, 4]) == [None] * 9
    # a closed block in the prompt: nothing to limit
    tb = ThinkingBudget(OPEN, CLOSE, 0, [7, 4, 8, 9, 1])
    assert _run(tb, [3, 3]) == [None, None]
    # forks take the parent's state; each goes on alone
    tb = ThinkingBudget(OPEN, CLOSE, 2, [7])
    tb.accept(0, 4)
    tb.fork(0, [1, 2])
    assert tb.forced(1) is None
    tb.accept(1, 4)
    assert (tb.forced(0), tb.forced(1), tb.forced(2)) == (None, 8, None)


@pytest.fixture(scope="module")
def llama(tiny_model_factory):
    return tiny_model_factory("llama")


def _markers(llm: LLM) -> tuple[str, str, list[int], list[int]]:
    tok = llm.get_tokenizer()
    start, end = "<|im_start|>", " the end"
    close = tok.encode(end, add_special_tokens=False)
    assert len(close) >= 2  # a closer of several ids: forced over several steps
    return start, end, tok.encode(start, add_special_tokens=False), close


@pytest.mark.parametrize("budget", [0, 5])
def test_the_engine_forces_the_closer_after_the_budget(llama, budget):
    probe = LLM(model=str(llama), dtype="float32", max_model_len=128)
    start, end, open_ids, close = _markers(probe)
    probe.llm_engine.shutdown()
    llm = LLM(
        model=str(llama),
        dtype="float32",
        max_model_len=128,
        reasoning_config={"think_start_str": start, "think_end_str": end},
    )
    prompt = [20, 21, 22, *open_ids, 30]  # the template opened the block
    free = SamplingParams(temperature=0, max_tokens=budget + len(close) + 6, ignore_eos=True)
    capped = SamplingParams(
        temperature=0,
        max_tokens=budget + len(close) + 6,
        ignore_eos=True,
        thinking_token_budget=budget,
    )
    (plain,) = llm.generate({"prompt_token_ids": prompt}, free, use_tqdm=False)
    (got,) = llm.generate({"prompt_token_ids": prompt}, capped, use_tqdm=False)
    tokens = list(got.outputs[0].token_ids)
    thought = max(budget - 1, 0)  # the 30 after the opener counts
    assert tokens[:thought] == list(plain.outputs[0].token_ids)[:thought]
    assert tokens[thought : thought + len(close)] == close
    # after the closer: the free greedy continuation of everything so far
    head = prompt + tokens[: thought + len(close)]
    rest = SamplingParams(temperature=0, max_tokens=len(tokens) - len(head) + len(prompt))
    (after,) = llm.generate({"prompt_token_ids": head}, rest, use_tqdm=False)
    assert tokens[thought + len(close) :] == list(after.outputs[0].token_ids)
    # n > 1 (seeded): every sample obeys the budget
    sampled = SamplingParams(
        temperature=1.0,
        seed=3,
        n=3,
        max_tokens=thought + len(close) + 2,
        thinking_token_budget=budget,
    )
    (many,) = llm.generate({"prompt_token_ids": prompt}, sampled, use_tqdm=False)
    for c in many.outputs:
        if close[0] not in c.token_ids[:thought]:  # (a sample may close the block itself)
            assert list(c.token_ids[thought : thought + len(close)]) == close
    llm.llm_engine.shutdown()


def test_needs_the_markers_and_no_beams(llama):
    llm = LLM(model=str(llama), dtype="float32", max_model_len=64)
    with pytest.raises(ValueError, match="reasoning_config"):
        llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(thinking_token_budget=4))
    llm.llm_engine.shutdown()
    with pytest.raises(ValueError, match="thinking_token_budget is not supported with use_beam"):
        SamplingParams(use_beam_search=True, n=2, temperature=0, thinking_token_budget=3)
    with pytest.raises(ValueError, match="thinking_token_budget"):
        SamplingParams(thinking_token_budget=-2)
    assert SamplingParams(thinking_token_budget=-1).thinking_token_budget is None
    with pytest.raises(ValueError, match="reasoning_config"):
        LLM(model=str(llama), max_model_len=64, reasoning_config={"think_start_str": "<t>"})
