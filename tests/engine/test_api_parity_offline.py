"""The offline API (`LLM`, llm.py; offline_args.py; sampling_params.py; inputs.py) against
vLLM's current one: argument forms vLLM code passes, the ones it refuses, and what a careless
call gets. Each case runs on one tiny model; the same LLM serves the next call unchanged."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import test_offline_hostile as hostile

from paged_engine import LLM, PoolingParams, SamplingParams
from paged_engine.outputs import RequestOutput
from paged_engine.pooling import PoolingRequestOutput
from paged_engine.sampling_params import BeamSearchParams

# the module's engine (`llm`, `want`: fixtures) and its health check, the hostile tests' own
llm, want, still_serves, GREEDY = hostile.llm, hostile.want, hostile.still_serves, hostile.GREEDY
CONV = [{"role": "user", "content": "hi"}]
# shows what reached the template: the messages, tools, the generation prompt, one variable
SHOW = (
    "{% for m in messages %}[{{ m.content }}]{% endfor %}"
    "{% if tools %}T{{ tools | length }}{% endif %}"
    "{% if add_generation_prompt %}G{% endif %}{{ extra | default('') }}"
)


def test_params_list_entries_of_the_other_kind_are_refused(llm, want) -> None:
    # a PoolingParams in generate's list used to run as an embedding and come back as one
    # (and a SamplingParams in encode's as a generation); vLLM's output check refuses both
    with pytest.raises(ValueError, match=r"sampling_params\[0\] must be a SamplingParams"):
        llm.generate(["a"], [PoolingParams()], use_tqdm=False)
    with pytest.raises(ValueError, match=r"sampling_params\[1\] must be"):
        llm.generate(["a", "b"], [GREEDY, 3], use_tqdm=False)
    with pytest.raises(ValueError, match=r"pooling_params\[0\] must be a PoolingParams"):
        llm.encode(["a"], [GREEDY], use_tqdm=False)
    with pytest.raises(ValueError, match=r"pooling_params\[0\] must be a PoolingParams"):
        llm.encode(["a"], [BeamSearchParams(beam_width=2, max_tokens=2)], use_tqdm=False)
    still_serves(llm, want)


def test_none_entries_are_the_default_params(llm) -> None:
    # None in encode's list used to reach the engine as "no params": a generation
    outs = llm.encode(["a", "b"], [None, PoolingParams()], use_tqdm=False)
    assert all(isinstance(o, PoolingRequestOutput) for o in outs)
    assert outs[0].outputs.data.shape == outs[1].outputs.data.shape
    emb = llm.embed(["a"], [None], use_tqdm=False)
    assert len(emb[0].outputs.embedding) == outs[0].outputs.data.shape[0]
    outs = llm.generate(["a", "b"], [GREEDY, None], use_tqdm=False)
    assert all(isinstance(o, RequestOutput) for o in outs)
    assert len(outs[1].outputs[0].token_ids) == llm.get_default_sampling_params().max_tokens


def test_chat_template_kwargs_merge_as_vllm(llm, want, caplog) -> None:
    def prompt(**kw) -> str:
        return llm.chat(CONV, GREEDY, use_tqdm=False, **kw)[0].prompt

    # keys named as chat()'s own arguments used to reach the render twice (a TypeError); as
    # in vLLM the argument wins, and one left None takes the key's value
    assert prompt(chat_template=SHOW) == "[hi]G"
    with caplog.at_level(logging.WARNING, logger="paged_engine.offline_args"):
        got = prompt(chat_template=SHOW, chat_template_kwargs={"add_generation_prompt": False})
    assert got == "[hi]G" and "add_generation_prompt" in caplog.text
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    kw = {"tools": [tool, tool], "extra": "X"}
    assert prompt(chat_template=SHOW, chat_template_kwargs=kw) == "[hi]T2GX"
    assert prompt(chat_template=SHOW, tools=[tool], chat_template_kwargs=kw) == "[hi]T1GX"
    assert prompt(chat_template_kwargs={"chat_template": SHOW}) == "[hi]G"
    assert prompt(chat_template=SHOW, chat_template_kwargs={"chat_template": "x"}) == "[hi]G"
    # vLLM renders text: tokenize / return_dict are forced off
    assert prompt(chat_template=SHOW, chat_template_kwargs={"tokenize": True}) == "[hi]G"
    assert prompt(chat_template=SHOW, chat_template_kwargs={"return_dict": True}) == "[hi]G"
    for bad, match in (
        ({"messages": []}, r"chat_template_kwargs\['messages'\]"),
        ({"conversation": []}, r"chat_template_kwargs\['conversation'\]"),
        ({1: True}, "chat_template_kwargs keys must be strings"),
        ({"chat_template": 5}, "chat_template must be a str"),
        ({"tools": "f"}, "tools must be a list"),
    ):
        with pytest.raises(ValueError, match=match):
            prompt(chat_template_kwargs=bad)
    still_serves(llm, want)


def test_numpy_token_ids(llm) -> None:
    ids = llm.get_tokenizer().encode("the cat sat")
    plain = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0]
    arr = np.array(ids)
    # list(array) holds numpy integers: they used to be refused as "not ints in [0, vocab)"
    for prompt in ({"prompt_token_ids": list(arr)}, list(arr), [list(arr)]):
        out = llm.generate(prompt, GREEDY, use_tqdm=False)
        assert len(out) == 1
        assert out[0].outputs[0].token_ids == plain.outputs[0].token_ids
        assert out[0].prompt_token_ids == ids
        assert all(type(t) is int for t in out[0].prompt_token_ids)
    with pytest.raises(ValueError, match="token ids must be ints"):
        llm.generate({"prompt_token_ids": [np.int64(10**6)]}, GREEDY, use_tqdm=False)


def test_sampling_params_bad_words_default_is_a_list() -> None:
    assert SamplingParams().bad_words == []  # vLLM's: iterable, never None
    assert SamplingParams(bad_words=None).bad_words == []
    assert SamplingParams(bad_words=["a", "a"]).bad_words == ["a"]


def test_prompt_type_names() -> None:
    from paged_engine import inputs

    for name in (
        "PromptType",
        "SingletonPrompt",
        "DecoderOnlyPrompt",
        "EncoderPrompt",
        "DecoderPrompt",
        "EncoderDecoderPrompt",
        "TextPrompt",
        "TokensPrompt",
        "EmbedsPrompt",
        "ExplicitEncoderDecoderPrompt",
    ):
        assert getattr(inputs, name) is not None, name


def test_a_failing_progress_bar_leaves_nothing_queued(llm, want) -> None:
    # the bar used to be made after the requests were queued, outside the abort on error:
    # they stayed in the engine and ran (unasked) inside the next call
    with pytest.raises(TypeError):
        llm.generate(["a", "b"], GREEDY, use_tqdm=lambda: None)
    assert not llm.llm_engine.has_unfinished_requests()
    still_serves(llm, want)


def test_pooling_params_clone() -> None:
    p = PoolingParams(dimensions=8, task="embed")
    q = p.clone()  # vLLM's, as SamplingParams.clone
    assert q == p and q is not p


def test_embeds_prompt_takes_its_text(tiny_llama_dir) -> None:
    import json

    import torch

    width = json.loads((tiny_llama_dir / "config.json").read_text())["hidden_size"]
    llm = LLM(
        str(tiny_llama_dir),
        dtype="float32",
        max_model_len=32,
        num_gpu_blocks_override=32,
        enable_prompt_embeds=True,
    )
    try:
        rows = torch.randn(3, width, generator=torch.Generator().manual_seed(0))
        plain = llm.generate({"prompt_embeds": rows}, GREEDY, use_tqdm=False)[0]
        # vLLM's EmbedsPrompt may carry the rows' text: shown as the output's prompt (it was
        # refused as "prompt_embeds comes alone")
        out = llm.generate({"prompt_embeds": rows, "prompt": "abc"}, GREEDY, use_tqdm=False)[0]
        assert (out.prompt, plain.prompt) == ("abc", None)
        assert out.prompt_token_ids is None and out.num_prompt_tokens == 3
        assert out.outputs[0].token_ids == plain.outputs[0].token_ids
        with pytest.raises(ValueError, match="prompt"):
            llm.generate({"prompt_embeds": rows, "prompt": 5}, GREEDY, use_tqdm=False)
        with pytest.raises(ValueError, match="comes alone"):
            llm.generate({"prompt_embeds": rows, "prompt_token_ids": [5]}, GREEDY, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize(
    "name",
    [
        "temperature",
        "top_p",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "length_penalty",
    ],
)
def test_float_fields_refuse_ints_past_float_range(name) -> None:
    # an int float() cannot hold (a JSON body can carry one) raised OverflowError, unnamed
    with pytest.raises(ValueError, match=f"{name} must be a finite number"):
        SamplingParams(**{name: 10**400})
    assert getattr(SamplingParams(**{name: np.float32(0.5)}), name) == 0.5  # numpy's floats


def test_logit_bias_is_clamped_as_vllm() -> None:
    # vLLM takes -inf as "never this token" (and from_optional clamps to [-100, 100]): it used
    # to be refused as not finite
    p = SamplingParams(logit_bias={1: -float("inf"), 2: float("inf"), 3: 10**400, 4: -7})
    assert p.logit_bias == {1: -100.0, 2: 100.0, 3: 100.0, 4: -7.0}
    with pytest.raises(ValueError, match=r"logit_bias\[1\] must be a finite number"):
        SamplingParams(logit_bias={1: float("nan")})


def test_length_penalty_that_overflows_the_score_is_refused(llm, want) -> None:
    # a beam's score is sum_logprob / len ** length_penalty: 1e300 overflowed inside the
    # step and failed the request (RequestFailedError) instead of a ValueError up front
    for value in (1e300, -1e300, 51):
        with pytest.raises(ValueError, match="length_penalty must be in"):
            BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=value)
        with pytest.raises(ValueError, match="length_penalty must be in"):
            SamplingParams(use_beam_search=True, temperature=0, length_penalty=value)
    params = BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=50)
    assert len(llm.beam_search(["hi"], params)[0].sequences) == 2
    assert SamplingParams(length_penalty=1e9).length_penalty == 1e9  # (no beam search: unused)
    still_serves(llm, want)
