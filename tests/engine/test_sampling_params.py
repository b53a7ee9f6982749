"""SamplingParams / BeamSearchParams: vLLM defaults, normalization, validation messages."""

from __future__ import annotations

import pickle

import pytest

from paged_engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from paged_engine.sampling_params import BeamSearchParams, SamplingParams, SamplingType


def test_vllm_defaults():
    p = SamplingParams()
    assert (p.n, p.best_of, p.temperature, p.top_p, p.top_k, p.min_p) == (1, None, 1.0, 1.0, 0, 0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.prompt_logprobs) == (16, 0, None, None)
    assert p.stop == [] and p.stop_token_ids == [] and p.all_stop_token_ids == set()
    assert p.skip_special_tokens and p.spaces_between_special_tokens and p.detokenize
    assert not (p.ignore_eos or p.include_stop_str_in_output or p.use_beam_search)
    assert p.sampling_type == SamplingType.RANDOM and not p.is_greedy and not p.is_beam_search


def test_normalization():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    p = SamplingParams(stop_token_ids=[7, 9])
    assert p.all_stop_token_ids == {7, 9}
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=2**63).top_k == 0  # past any vocabulary: off, not an overflow
    assert SamplingParams(max_tokens=None).max_tokens is None
    assert SamplingParams(max_tokens=32.0).max_tokens == 32  # integral float from JSON
    assert SamplingParams(temperature=1).temperature == 1.0
    greedy = SamplingParams(temperature=0.0, top_p=0.5, top_k=5, min_p=0.2)
    assert (greedy.top_p, greedy.top_k, greedy.min_p) == (1.0, 0, 0.0)
    assert greedy.is_greedy and greedy.sampling_type == SamplingType.GREEDY
    assert SamplingParams(seed=3).sampling_type == SamplingType.RANDOM_SEED


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"n": 0}, "n"),
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"max_tokens": "16"}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 10, "max_tokens": 5}, "min_tokens"),
        ({"logprobs": -2}, "logprobs"),
        ({"prompt_logprobs": -2}, "prompt_logprobs"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop": ""}, "stop"),
        ({"stop": "x", "detokenize": False}, "stop"),
        ({"seed": "abc"}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"stop": 5}, "stop"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"n": True}, "n"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids"),
        ({"early_stopping": "sometimes"}, "early_stopping"),
        ({"use_beam_search": True, "n": 2, "temperature": 1.0, "top_p": 0.5}, "top_p"),
    ],
)
def test_validation_names_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_stop_strings_and_bad_words_are_bounded_and_errors_stay_short():
    from paged_engine.sampling_params import MAX_STOP_STRINGS

    assert len(SamplingParams(stop=["s"] * MAX_STOP_STRINGS).stop) == MAX_STOP_STRINGS
    with pytest.raises(ValueError, match=f"stop holds at most {MAX_STOP_STRINGS} strings, got"):
        SamplingParams(stop=["s"] * (MAX_STOP_STRINGS + 1))
    with pytest.raises(ValueError, match=r"stop\[1\]") as err:  # a huge bad item is not echoed
        SamplingParams(stop=["ok", ["x" * 10_000]])
    assert len(str(err.value)) < 200
    with pytest.raises(ValueError, match=f"bad_words holds at most {MAX_STOP_STRINGS} words"):
        SamplingParams(bad_words=[f"w{i}" for i in range(MAX_STOP_STRINGS + 1)])
    assert len(SamplingParams(bad_words=["w"] * 5000).bad_words) == 1  # repeats count once


def test_beam_search_conversion():
    p = SamplingParams(use_beam_search=True, n=2, best_of=4, temperature=0.0, max_tokens=20)
    assert p.is_beam_search and p.sampling_type == SamplingType.BEAM
    b = p.to_beam_search_params()
    assert isinstance(b, BeamSearchParams)
    assert (b.beam_width, b.max_tokens, b.temperature, b.length_penalty) == (4, 20, 0.0, 1.0)
    assert SamplingParams(use_beam_search=True, n=3).to_beam_search_params().beam_width == 3
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=5)
    with pytest.raises(ValueError, match="max_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=0)


def test_picklable_and_clone_independent():
    p = SamplingParams(temperature=0.7, stop=["x"], stop_token_ids=[5], seed=1)
    p.all_stop_token_ids.add(2)  # the engine adds eos
    q = pickle.loads(pickle.dumps(p))
    assert q == p and q.all_stop_token_ids == {2, 5}
    c = p.clone()
    c.stop.append("y")
    c.all_stop_token_ids.add(9)
    assert p.stop == ["x"] and p.all_stop_token_ids == {2, 5}


def test_outputs_records_and_repr():
    lp = {5: Logprob(-0.1, 1, "a")}
    c = CompletionOutput(0, "hi", [5], -0.1, [lp], finish_reason=None)
    assert not c.finished()
    c.finish_reason, c.stop_reason = "stop", "###"
    assert c.finished()
    m = RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5, first_token_time=11.0)
    assert m.time_in_queue == 0.5 and m.time_to_first_token == 1.0 and m.e2e_latency is None
    r = RequestOutput("7", "Hello", [1, 2], None, [c], True, m, num_cached_tokens=16)
    text = repr(r)
    assert text.startswith("RequestOutput(request_id=7, prompt='Hello', prompt_token_ids=[1, 2]")
    assert "CompletionOutput(index=0, text='hi', token_ids=[5]" in text
    assert "finish_reason=stop, stop_reason=###" in text and "num_cached_tokens=16" in text
    assert pickle.loads(pickle.dumps(r)).outputs[0].logprobs == [lp]


def test_a_top_k_past_any_vocabulary_runs_as_off(tiny_llama_dir) -> None:
    """top_k = 2**63 (a hostile client's) once overflowed the worker's int64 row and failed
    the whole step; it samples exactly as top_k off."""
    from paged_engine import LLM

    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=64)
    try:
        params = [SamplingParams(max_tokens=6, seed=5, top_k=k) for k in (2**63, 0)]
        huge, off = llm.generate(["Hello", "Hello"], params, use_tqdm=False)
        assert huge.outputs[0].token_ids == off.outputs[0].token_ids
    finally:
        llm.llm_engine.shutdown()
