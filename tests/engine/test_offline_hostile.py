"""Careless and hostile arguments to the offline API (`LLM`, llm.py; offline_args.py), as code
ported from vLLM would pass them: each is refused with a ValueError naming the parameter before
it reaches the engine, and the same LLM then serves the next call unchanged."""

from __future__ import annotations

import pytest

from paged_engine import LLM, SamplingParams
from paged_engine.pooling import PoolingParams
from paged_engine.sampling_params import BeamSearchParams

GREEDY = SamplingParams(max_tokens=3, temperature=0)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=64, num_gpu_blocks_override=64)
    yield llm
    llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def want(llm) -> list[int]:
    return list(llm.generate(["hi"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids)


def still_serves(llm: LLM, want: list[int]) -> None:
    out = llm.generate(["hi"], GREEDY, use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == want


@pytest.mark.parametrize(
    ("prompts", "match"),
    [
        (None, "prompts must be"),
        (5, "prompts must be"),
        ({"foo": 1}, "needs 'prompt' or 'prompt_token_ids'"),
        ({"prompt_token_ids": [-1, 2]}, "token ids must be ints"),
        ({"prompt_token_ids": [10**6]}, "token ids must be ints"),
        ({"prompt_token_ids": [1.5]}, "token ids must be ints"),
        ([1, 2.5], "token ids must be ints"),  # one token-id prompt with a float, not two prompts
        ([["a", "b"]], "token ids must be ints"),
        ("", "must not be empty"),
        ([[]], "must not be empty"),
        ([list(range(3, 100))], "prompt is too long"),
    ],
)
def test_bad_prompts_are_refused_by_name(llm, want, prompts, match) -> None:
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    still_serves(llm, want)


@pytest.mark.parametrize("params", ["greedy", {"max_tokens": 3}, 3, PoolingParams()])
def test_sampling_params_of_the_wrong_kind_are_named(llm, want, params) -> None:
    # a str / dict used to be iterated (a count mismatch, or a dict key as the "params")
    with pytest.raises(ValueError, match="sampling_params must be a SamplingParams"):
        llm.generate(["a"], params, use_tqdm=False)
    with pytest.raises(ValueError, match="got 2 prompts but 1 sampling_params"):
        llm.generate(["a", "b"], [GREEDY], use_tqdm=False)
    with pytest.raises(ValueError, match="pooling_params must be a PoolingParams"):
        llm.encode(["a"], GREEDY, use_tqdm=False)
    still_serves(llm, want)


def test_beam_search_of_no_prompts_is_empty(llm, want) -> None:
    assert llm.beam_search([], BeamSearchParams(beam_width=2, max_tokens=3)) == []
    assert llm.generate([], GREEDY, use_tqdm=False) == []
    still_serves(llm, want)


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        (None, "messages must be a list"),
        ("hello", "messages must be a list"),
        ([{"content": "hi"}], r"messages\[0\]\.role"),
        ([{"role": None, "content": "hi"}], r"messages\[0\]\.role"),
        ([{"role": "user", "content": 5}], r"messages\[0\]\.content"),
        ([{"role": "user", "content": {"a": 1}}], r"messages\[0\]\.content"),
        ([[{"role": "user", "content": "hi"}], 5], r"messages\[1\] must be"),
        ([[{"role": "user", "content": "hi"}, "hi"]], r"messages\[0\]\[1\] must be"),
    ],
)
def test_malformed_chat_messages_are_named(llm, want, messages, match) -> None:
    with pytest.raises(ValueError, match=match):
        llm.chat(messages, GREEDY, use_tqdm=False)
    still_serves(llm, want)


def test_chat_template_failures_are_value_errors(llm, want) -> None:
    messages = [{"role": "user", "content": "hi"}]
    for template in ("{% for %}", "{{ raise_exception('no system role') }}", "{{ a.b }}"):
        with pytest.raises(ValueError, match="could not apply the chat template"):
            llm.chat(messages, GREEDY, use_tqdm=False, chat_template=template)
    with pytest.raises(ValueError, match="chat_template_kwargs must be a dict"):
        llm.chat(messages, GREEDY, use_tqdm=False, chat_template_kwargs="enable_thinking")
    ok = llm.chat(messages, GREEDY, use_tqdm=False)
    assert ok[0].prompt.endswith("assistant\n") and len(ok[0].outputs[0].token_ids) == 3
    still_serves(llm, want)


def test_use_tqdm_callable_draws_the_bar(llm, want) -> None:
    calls: list[dict] = []

    class Bar:  # vLLM's use_tqdm=<tqdm class>: called with total=, then update / close
        def __init__(self, **kw) -> None:
            calls.append(kw)
            self.n = 0

        def update(self, k: int) -> None:
            self.n += k

        def close(self) -> None:
            calls.append({"closed": self.n})

    llm.generate(["a", "b"], GREEDY, use_tqdm=Bar)
    assert calls[0]["total"] == 2 and calls[-1] == {"closed": 2}
    still_serves(llm, want)
