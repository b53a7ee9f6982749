"""Arbitrary Unicode through the offline `LLM`: prompts (tokenizer), chat messages (template)
and what comes back (detokenizer). Valid text round-trips; a lone surrogate is a ValueError
naming the field; nothing else is raised."""

from __future__ import annotations

from pathlib import Path

import pytest
from fuzz_text import has_lone_surrogate, hostile_text
from hypothesis import given, settings

from paged_engine import LLM, SamplingParams

FUZZ = settings(max_examples=40, deadline=None)
PARAMS = SamplingParams(max_tokens=3, temperature=0, logprobs=1)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256, num_gpu_blocks_override=64)


@FUZZ
@given(text=hostile_text())
def test_generate_any_text(llm: LLM, text: str) -> None:
    prompt = "x" + text
    if has_lone_surrogate(text):
        with pytest.raises(ValueError, match=r"prompt contains a lone UTF-16 surrogate"):
            llm.generate(prompt, PARAMS, use_tqdm=False)
        return
    (out,) = llm.generate(prompt, PARAMS, use_tqdm=False)
    assert out.prompt == prompt
    assert llm.get_tokenizer().decode(out.prompt_token_ids) == prompt
    out.outputs[0].text.encode()  # the detokenizer's text is valid Unicode
    for lp in out.outputs[0].logprobs:
        for entry in lp.values():
            entry.decoded_token.encode()


@FUZZ
@given(text=hostile_text())
def test_chat_any_text(llm: LLM, text: str) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": text}]
    messages.append({"role": "user", "content": "ok"})
    if has_lone_surrogate(text):
        with pytest.raises(ValueError, match=r"messages\[1\]\.content contains a lone"):
            llm.chat(messages, PARAMS, use_tqdm=False)
        return
    (out,) = llm.chat(messages, PARAMS, use_tqdm=False)
    assert text in out.prompt
    out.outputs[0].text.encode()


def test_a_surrogate_in_a_prompt_list_rejects_the_call_and_leaves_nothing_queued(
    llm: LLM,
) -> None:
    with pytest.raises(ValueError, match="U\\+DC00 at index 2"):
        llm.generate(["fine", "ab\udc00"], PARAMS, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.generate("fine", PARAMS, use_tqdm=False)[0].outputs[0].token_ids
