"""/classify's chat form (vLLM's ClassificationChatRequest): `messages` rendered by the chat
template into one classified input, as /v1/embeddings renders its chat form
(embeddings.chat_input). References: /classify's `input` form on the rendered prompt and HF
transformers' classifier on the same weights."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from server_proc import MAX_MODEL_LEN
from test_classify_routes import LABELS, _served, logits

MESSAGES = [
    {"role": "system", "content": "Classify the sentiment."},
    {"role": "user", "content": "the capital of France is a fine city"},
]


@pytest.fixture(scope="module")
def clf(tmp_path_factory) -> Iterator[SimpleNamespace]:
    """The tiny classifier of test_classify_routes, its tokenizer made to add BOS (as Llama's
    does), so that `add_special_tokens` changes the prompt."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    from paged_engine.testing import write_tiny_classifier

    path = tmp_path_factory.mktemp("cls-chat")
    write_tiny_classifier(path, "qwen3", num_labels=3, id2label=LABELS)
    tok = AutoTokenizer.from_pretrained(path)
    bos = (tok.bos_token, tok.bos_token_id)
    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{bos[0]} $A", special_tokens=[bos]
    )
    tok.save_pretrained(path)
    yield from _served(path)


def rendered(s: SimpleNamespace, messages: list[dict], **kwargs: bool) -> tuple[str, list[int]]:
    """The chat template's text for `messages` and its ids (no special tokens added)."""
    text = s.tok.apply_chat_template(messages, tokenize=False, **kwargs)
    return text, s.tok(text, add_special_tokens=False)["input_ids"]


def classify(s: SimpleNamespace, body: dict, path: str = "/classify") -> dict:
    status, _, r = s.http.request("POST", path, body)
    assert status == 200, r
    return r


@pytest.mark.parametrize("path", ["/classify", "/v1/classify"])
@pytest.mark.parametrize("generation", [False, True])
def test_chat_form_classifies_the_rendered_prompt(clf, path, generation) -> None:
    text, ids = rendered(clf, MESSAGES, add_generation_prompt=generation)
    assert clf.tok(text)["input_ids"] == [clf.tok.bos_token_id, *ids]  # BOS is added by default
    body = {"messages": MESSAGES, "request_id": "chat-7"}
    if generation:
        body["add_generation_prompt"] = True
    r = classify(clf, body, path)
    assert r["id"] == "classify-chat-7" and r["object"] == "list" and len(r["data"]) == 1
    n = len(ids)
    assert r["usage"] == {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0}
    got = r["data"][0]
    want = logits(clf, ids).softmax(-1)
    assert got["probs"] == pytest.approx(want.tolist(), abs=1e-5)
    assert got["label"] == LABELS[int(want.argmax())] and got["num_classes"] == 3
    # the input form on the same prompt: as token ids, or as text without special tokens
    for inp in ({"input": ids}, {"input": text, "add_special_tokens": False}):
        assert classify(clf, inp, path)["data"] == r["data"], inp


def test_invocations_classify_a_chat_on_a_pooling_only_engine(clf) -> None:
    """vLLM's /invocations tries the engine's tasks: a classifier has no chat completions, so
    a `messages` body is /classify's chat form."""
    body = {"messages": MESSAGES}
    got, want = classify(clf, body, "/invocations"), classify(clf, body)
    assert got["data"] == want["data"] and got["usage"] == want["usage"]


def test_chat_form_options_match_the_input_form(clf) -> None:
    text, ids = rendered(clf, MESSAGES)
    # add_special_tokens: true puts BOS before the template's text, as `input` does by default
    r = classify(clf, {"messages": MESSAGES, "add_special_tokens": True})
    assert r["usage"]["prompt_tokens"] == len(ids) + 1
    assert r["data"] == classify(clf, {"input": text})["data"]
    # truncate_prompt_tokens keeps the first tokens on this pooling-only engine, as for `input`
    body = {"messages": MESSAGES, "truncate_prompt_tokens": 3, "use_activation": False}
    r = classify(clf, body)
    assert r["usage"]["prompt_tokens"] == 3
    assert r["data"][0]["probs"] == pytest.approx(logits(clf, ids[:3]).tolist(), abs=1e-5)
    # continue_final_message leaves the assistant's last message open
    prefill = [*MESSAGES, {"role": "assistant", "content": "The sentiment is"}]
    _, open_ids = rendered(clf, prefill, continue_final_message=True)
    _, closed_ids = rendered(clf, prefill)
    assert open_ids != closed_ids
    for extra, want_ids in (({"continue_final_message": True}, open_ids), ({}, closed_ids)):
        r = classify(clf, {"messages": prefill, **extra})
        assert r["usage"]["prompt_tokens"] == len(want_ids), extra
        want = logits(clf, want_ids).softmax(-1).tolist()
        assert r["data"][0]["probs"] == pytest.approx(want, abs=1e-5), extra
    # the chat form's other fields at their defaults (or unused by the template) change nothing
    body = {
        "messages": MESSAGES,
        "chat_template_kwargs": {"enable_thinking": False},
        "mm_processor_kwargs": {},
        "media_io_kwargs": None,
        "priority": 0,
        "user": "u",
    }
    assert classify(clf, body)["data"] == classify(clf, {"input": ids})["data"]


IMAGE = [{"type": "image_url", "image_url": {"url": "data:,"}}]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "hi", "messages": MESSAGES}, "messages"),
        ({"input": "hi", "chat_template_kwargs": {}}, "chat_template_kwargs"),
        ({"input": "hi", "add_generation_prompt": True}, "add_generation_prompt"),
        ({"continue_final_message": True}, "continue_final_message"),
        ({"messages": "hi"}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": IMAGE}]}, "messages[0].content"),
        ({"messages": MESSAGES, "add_special_tokens": 1}, "add_special_tokens"),
        ({"messages": MESSAGES, "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"messages": MESSAGES, "use_activation": "no"}, "use_activation"),
        ({"messages": MESSAGES, "truncation_side": "left"}, "truncation_side"),
        ({"messages": MESSAGES, "media_io_kwargs": {"image": {"x": 1}}}, "media_io_kwargs"),
        ({"messages": MESSAGES, "tools": []}, "tools"),
        ({"messages": MESSAGES, "request_id": ""}, "request_id"),
        ({"messages": MESSAGES, "chat_template": "{{ 'x' }}"}, "chat_template"),  # untrusted
        ({"messages": MESSAGES, "model": "other"}, "model"),
        (
            {"messages": MESSAGES, "add_generation_prompt": True, "continue_final_message": True},
            "continue_final_message",
        ),
        ({"messages": [{"role": "user", "content": "word " * (2 * MAX_MODEL_LEN)}]}, "messages"),
    ],
)
def test_bad_chat_bodies_name_their_param(clf, body, param) -> None:
    status, _, r = clf.http.request("POST", "/classify", body)
    assert status in (400, 404), r
    assert r["error"]["param"] == param, r
