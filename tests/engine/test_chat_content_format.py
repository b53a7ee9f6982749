"""vLLM's chat-template content format (multimodal/chat_format.py): "auto" reads the template
(a loop over a message's content: parts, else one string), "string" writes each image, video
and audio part as the model's placeholder text before the message's text.

Detection on templates written as the Hub's are (InternVL2's and Llama 3's take string
content, Qwen2-VL's iterates the parts), the placeholder text of a few families, the string
form's order and checks, then a tiny LLaVA checkpoint whose template takes string content:
`LLM.chat` and the server's chat route give the prompt written by hand with "<image>" and its
tokens.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from image_checks import data_url, greedy, noise_image

from paged_engine.multimodal.chat_format import (
    MediaPlaceholders,
    detect_content_format,
    media_placeholders,
    resolve_content_format,
    string_content,
)
from paged_engine.testing import LLAVA_CHAT_TEMPLATE, QWEN2_VL_CHAT_TEMPLATE, write_tiny_llava

# InternVL2's (InternLM2-chat's ChatML): content concatenated as a string
INTERNVL2 = (
    "{{ bos_token }}{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Llama 3's: messages through a set variable, content through a filter, no loop over it
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
    "message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
# Qwen2-VL's: a string or a loop over the parts, images counted
QWEN2_VL = (
    "{% set image_count = namespace(value=0) %}{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif 'text' in content %}"
    "{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\\n{% endif %}"
)
# a loop over a sliced, renamed message list, its content through a filter; {% generation %}
SLICED = (
    "{% set rest = messages[1:] %}{% for m in rest | selectattr('role') %}"
    "{% generation %}{% for p in m.content | list %}{{ p.text }}{% endfor %}"
    "{% endgeneration %}{% endfor %}"
)
STRING_TEMPLATE = (  # old LLaVA's: "USER: ..." with the content as a string
    "{% for message in messages %}{{ message['role'].upper() }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def test_detects_the_format_a_template_takes():
    for template in (INTERNVL2, LLAMA3, STRING_TEMPLATE, "{% for x in %}"):  # (last: broken)
        assert detect_content_format(template) == "string", template
    for template in (QWEN2_VL, SLICED, QWEN2_VL_CHAT_TEMPLATE, LLAVA_CHAT_TEMPLATE):
        assert detect_content_format(template) == "openai", template
    hits = detect_content_format.cache_info().hits
    detect_content_format(QWEN2_VL)
    assert detect_content_format.cache_info().hits == hits + 1  # cached per template text
    assert resolve_content_format("auto", {"default": INTERNVL2, "tool_use": QWEN2_VL}) == "string"
    assert resolve_content_format("auto", None) == "string"
    assert resolve_content_format("openai", INTERNVL2) == "openai"
    assert resolve_content_format("string", QWEN2_VL) == "string"


class _Tokenizer:
    """decode([id]) -> the token's text, over a few special tokens."""

    def decode(self, ids: list[int]) -> str:
        vocab = {7: "<image>", 8: "<|image_pad|>", 9: "<|video_pad|>", 10: "<|AUDIO|>", 11: "<|x|>"}
        return "".join(vocab[i] for i in ids)


def _image_side(kind: str, marker: int = 7) -> SimpleNamespace:
    return SimpleNamespace(kind=kind, layout=SimpleNamespace(marker=marker))


def _marks(images=None, videos=None, audios=None) -> MediaPlaceholders:
    return media_placeholders(_Tokenizer(), images, videos, audios)


def test_placeholder_text_per_family():
    qwen_video = SimpleNamespace(
        config=SimpleNamespace(architectures=["Qwen2VLForConditionalGeneration"]),
        video_token_id=9,
    )
    qwen = _marks(_image_side("qwen2_vl", 8), qwen_video)
    assert qwen.text("image", 1) == "<|vision_start|><|image_pad|><|vision_end|>"
    assert qwen.text("video", 2) == "<|vision_start|><|video_pad|><|vision_end|>"
    assert qwen.text("audio", 1) is None  # no audio side: nothing written
    assert _marks(_image_side("llava")).text("image", 3) == "<image>"  # its token, decoded
    assert _marks(_image_side("internvl_chat", 11)).text("image", 1) == "<image>"
    assert _marks(_image_side("phi4mm", 11)).text("image", 2) == "<|image|>"
    assert _marks(_image_side("blip2")).text("image", 1) is None  # placed without a marker
    audio = SimpleNamespace(config=SimpleNamespace(architectures=["UltravoxModel"]), placeholder=11)
    assert _marks(audios=audio).text("audio", 1) == "<|audio|>"  # the text, not the id's
    audio.config.architectures = ["Qwen2AudioForConditionalGeneration"]
    audio.placeholder = 10
    assert _marks(audios=audio).text("audio", 2) == "Audio 2: <|audio_bos|><|AUDIO|><|audio_eos|>"


def test_string_form_puts_missing_placeholders_first():
    marks = MediaPlaceholders({"image": "<|image_{n}|>", "audio": "<a>", "video": None})
    text = {"type": "text", "text": "Compare."}
    image, audio, video = {"type": "image"}, {"type": "audio"}, {"type": "video"}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [image, audio, text, image, {"type": "text", "text": "ok"}]},
        {"role": "user", "content": [{"type": "text", "text": "and <|image_3|> here"}, image]},
        {"role": "user", "content": [audio, video]},
    ]
    got = string_content(messages, marks)
    assert got[0] == messages[0]
    # a modality's items together (modalities as met), numbered across the conversation
    assert got[1]["content"] == "<|image_1|>\n<|image_2|>\n<a>\nCompare.\nok"
    assert got[2]["content"] == "and <|image_3|> here"  # written by the user: left there
    assert got[3]["content"] == "<a>"  # no text: the placeholders alone; None writes nothing
    too_many = [{"role": "user", "content": [{"type": "text", "text": "<a><a>"}, audio]}]
    with pytest.raises(ValueError, match=r"messages\[0\]\.content.*2 '<a>'"):
        string_content(too_many, marks)
    with pytest.raises(ValueError, match=r"messages\[0\]\.content.*'file'"):
        string_content([{"role": "user", "content": [{"type": "file"}]}], marks)


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    from image_checks import engine

    llm = engine(write_tiny_llava(tmp_path_factory.mktemp("llava"), seed=3), max_model_len=256)
    yield llm
    llm.llm_engine.shutdown()


def _ask(image) -> list[dict]:
    part = {"type": "image_url", "image_url": {"url": data_url(image)}}
    return [{"role": "user", "content": [{"type": "text", "text": "What is in it?"}, part]}]


def test_llm_chat_writes_image_placeholders_for_a_string_template(llava):
    """A template that takes string content (auto-detected, or "string" given over one that
    reads parts) gets "<image>" before the text: the hand-written prompt's tokens. "openai"
    hands it the parts, which it prints without a placeholder (refused by name)."""
    image = noise_image(4, (40, 52))
    params = greedy(0, 4)
    by_hand = "USER: <image>\nWhat is in it?\nASSISTANT:"
    want = llava.generate([{"prompt": by_hand, "multi_modal_data": {"image": image}}], params)
    for kw in ({"chat_template": STRING_TEMPLATE}, {"chat_template_content_format": "string"}):
        (got,) = llava.chat(_ask(image), params, use_tqdm=False, **kw)
        assert got.prompt == by_hand, kw
        assert got.prompt_token_ids == want[0].prompt_token_ids
        assert got.outputs[0].token_ids == want[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="placeholder"):
        llava.chat(
            _ask(image),
            params,
            use_tqdm=False,
            chat_template=STRING_TEMPLATE,
            chat_template_content_format="openai",
        )


def test_server_chat_writes_image_placeholders_for_a_string_template(llava):
    pytest.importorskip("paged_server")
    from server.server_proc import COMMON_ARGS, serve_in_process

    image = noise_image(5, (40, 52))
    by_hand = "USER: <image>\nWhat is in it?\nASSISTANT:"
    (want,) = llava.generate(
        [{"prompt": by_hand, "multi_modal_data": {"image": image}}], greedy(0, 4)
    )
    tokenizer = llava.llm_engine.tokenizer
    saved, tokenizer.chat_template = tokenizer.chat_template, STRING_TEMPLATE  # (the app's copy)
    body = {"model": "tiny", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    body |= {"return_token_ids": True, "messages": _ask(image)}
    try:
        with serve_in_process(COMMON_ARGS, llava.llm_engine) as (http, _):
            status, _, got = http.request("POST", "/v1/chat/completions", body)
    finally:
        tokenizer.chat_template = saved
    assert status == 200, got
    assert got["prompt_token_ids"] == want.prompt_token_ids
    assert got["choices"][0]["token_ids"] == want.outputs[0].token_ids
