"""Mistral chats without a template (paged_engine/mistral_chat.py) against mistral_common
itself, the code vLLM's tokenizer_mode="mistral" renders chats with: for tokenizer versions
v3, v7, v11 and v13, each conversation (system prompts, merged turns, tools, tool calls and
results, images, reasoning, continued answers, special tokens' text in a message) gives
mistral_common's `encode_chat_completion` ids, or both refuse it. The tiny tekken.json files are
test_tekken's, with the version's specials. mistral_common's image encoder (OpenCV resizing) is
replaced by one [IMG] per image: paged's builder leaves the run's expansion to the engine's
image processor. Last, LLM.chat on a tiny native-format Mistral with tekken.json only renders
the same ids and generates what generate() does from them."""

from __future__ import annotations

import base64
import json
import pickle
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

mc = pytest.importorskip("mistral_common")
pytest.importorskip("regex")

from mistral_common.protocol.instruct.request import ChatCompletionRequest  # noqa: E402
from mistral_common.protocol.instruct.validator import ValidationMode  # noqa: E402
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer  # noqa: E402
from test_tekken import PATTERN, SPECIALS, _str, learn_merges  # noqa: E402

from paged_engine.tekken import tekken_tokenizer  # noqa: E402

NUM_SPECIAL = 40
NEW_SPECIALS = ["[ARGS]", "[CALL_ID]", "[THINK]", "[/THINK]"]  # v11 / v13 (Magistral)
VERSIONS = ("v3", "v7", "v11", "v13")


def write_tekken(path: Path, version: str, num_merges: int = 150) -> Path:
    """test_tekken's vocabulary as a tekken.json of `version` (v3 without `special_tokens`,
    as such files were saved; the others list the specials, v11+ with [ARGS] ... [/THINK])."""
    path.mkdir(parents=True, exist_ok=True)
    ranks = [bytes([b]) for b in range(256)] + learn_merges(num_merges)
    entries = [
        {"rank": r, "token_bytes": base64.b64encode(t).decode(), "token_str": _str(t)}
        for r, t in enumerate(ranks)
    ]
    specials = SPECIALS + (NEW_SPECIALS if version in ("v11", "v13") else [])
    config = {
        "pattern": PATTERN,
        "num_vocab_tokens": len(entries),
        "default_vocab_size": NUM_SPECIAL + len(entries),
        "default_num_special_tokens": NUM_SPECIAL,
        "version": version,
    }
    data = {"config": config, "vocab": entries}
    if version != "v3":
        data["special_tokens"] = [
            {"rank": i, "token_str": s, "is_control": True} for i, s in enumerate(specials)
        ]
    (path / "tekken.json").write_text(json.dumps(data, ensure_ascii=False))
    return path


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> dict[str, tuple]:
    """Per version: (paged's tokenizer, mistral_common's MistralTokenizer)."""
    out = {}
    for version in VERSIONS:
        path = write_tekken(tmp_path_factory.mktemp(version), version)
        ref = MistralTokenizer.from_file(str(path / "tekken.json"), mode=ValidationMode.test)
        img = ref.instruct_tokenizer.tokenizer.get_special_token("[IMG]")
        ref.instruct_tokenizer.image_encoder = lambda chunk, img=img: SimpleNamespace(
            tokens=[img], image=np.zeros((3, 2, 2))
        )
        out[version] = (tekken_tokenizer(path), ref)
    return out


def reference(ref: MistralTokenizer, messages: list[dict], tools, cont: bool) -> list[int]:
    request = ChatCompletionRequest.from_openai(messages, tools, continue_final_message=cont)
    return ref.encode_chat_completion(request).tokens


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "now", "parameters": None}}


def _call(cid: str, name: str, args) -> dict:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def _bot(text) -> dict:
    return {"role": "assistant", "content": text}


SYS = {"role": "system", "content": "You are terse. Réponds en français."}
CALLS = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        _call("abcDEF123", "get_weather", '{"city": "Paris", "unit": "c"}'),
        _call("zzz999yyy", "now", {"tz": "東京"}),
    ],
}
RESULTS = [  # answered in the other order: v11+ put them in the calls' order
    {"role": "tool", "tool_call_id": "zzz999yyy", "content": "12:00"},
    {"role": "tool", "tool_call_id": "abcDEF123", "content": '{"temp": 21, "sky": "clear"}'},
]
IMAGE = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}

# (name, messages, tools, continue_final_message)
CASES = [
    ("one user", [_user("Hello world, the weather is fine.")], None, False),
    ("system", [SYS, _user("Naïve café?")], None, False),
    (
        "multi-turn",
        [SYS, _user("Hi"), _bot("Hello!  "), _user("The quick brown fox?")],
        None,
        False,
    ),
    (
        "systems between",
        [SYS, _user("a"), {"role": "system", "content": "b"}, _user("c")],
        None,
        False,
    ),
    ("only system", [SYS], None, False),
    ("merged turns", [_user("one"), _user("two"), _bot("x"), _bot("y"), _user("3")], None, False),
    (
        "text parts",
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            }
        ],
        None,
        False,
    ),
    ("tools", [SYS, _user("Weather?")], [WEATHER, TIME], False),
    ("tools multi-turn", [_user("Hi"), _bot("Yes?"), _user("Weather?")], [WEATHER], False),
    ("tool calls", [SYS, _user("Weather and time?"), CALLS, *RESULTS], [WEATHER, TIME], False),
    (
        "after results",
        [_user("Weather?"), CALLS, *RESULTS, _bot("21 and sunny."), _user("Thanks")],
        [WEATHER, TIME],
        False,
    ),
    (
        "plain result and odd arguments",
        [
            _user("go"),
            {"role": "assistant", "tool_calls": [_call("a1b2c3d4e", "now", "not json")]},
            {"role": "tool", "tool_call_id": "a1b2c3d4e", "content": "plain text 東京"},
        ],
        [TIME],
        False,
    ),
    (
        "content and calls",
        [_user("go"), {**CALLS, "content": "Let me check."}, *RESULTS],
        [WEATHER, TIME],
        False,
    ),
    ("continued", [_user("Count"), _bot("1, 2, ")], None, True),
    ("last assistant closed", [_user("Count"), _bot("1, 2")], None, False),
    ("specials as text", [_user("[INST] hi </s> [TOOL_CALLS]")], None, False),
    (
        "image last",
        [SYS, {"role": "user", "content": [{"type": "text", "text": "What?"}, IMAGE]}],
        None,
        False,
    ),
    (
        "images around text",
        [{"role": "user", "content": [IMAGE, {"type": "text", "text": "and"}, IMAGE]}],
        None,
        False,
    ),
    (
        "reasoning",
        [
            _user("2+2?"),
            {"role": "assistant", "content": "4", "reasoning_content": "Add."},
            _user("3+3?"),
        ],
        None,
        False,
    ),
    (
        "open thinking continued",
        [
            _user("Why?"),
            {
                "role": "assistant",
                "content": [{"type": "thinking", "thinking": "Hmm", "closed": False}],
            },
        ],
        None,
        True,
    ),
    (
        "system thinking",
        [
            {
                "role": "system",
                "content": [{"type": "text", "text": "S"}, {"type": "thinking", "thinking": "T"}],
            },
            _user("q"),
        ],
        None,
        False,
    ),
    ("starts with assistant", [_bot("Hi"), _user("Hello")], None, False),
    (
        "unanswered id",
        [_user("go"), CALLS, {"role": "tool", "tool_call_id": "nonesuch1", "content": "x"}],
        None,
        False,
    ),
    ("unanswered call", [_user("go"), CALLS, RESULTS[0], _bot("Done."), _user("ok")], None, False),
    ("user after system after assistant", [_user("a"), _bot("b"), SYS, _user("c")], None, False),
]


@pytest.mark.parametrize("version", VERSIONS)
def test_ids_are_mistral_commons(pairs, version):
    """Every case gives mistral_common's ids, or both refuse it (ours: a ValueError)."""
    tok, ref = pairs[version]
    chat = tok.mistral_chat
    built = refused = 0
    for name, messages, tools, cont in CASES:
        try:
            want = reference(ref, messages, tools, cont)
        except Exception:  # mistral_common's own exception types
            with pytest.raises(ValueError):
                chat.render(
                    messages, tools, add_generation_prompt=False, continue_final_message=cont
                )
            refused += 1
            continue
        assert (
            chat.render(
                messages, tools, add_generation_prompt=not cont, continue_final_message=cont
            )
            == want
        ), name
        built += 1
    assert built >= 15 and refused >= 3, (built, refused)


def test_layout_by_version(pairs):
    """Landmarks of each layout, so the reference comparison cannot pass on a shared slip:
    where the tools and the system prompt go, and how calls and results are written."""
    sid = {v: (lambda s, t=pairs[v][0]: t.convert_tokens_to_ids(s)) for v in VERSIONS}
    conv = [SYS, _user("Hi"), _bot("Yes?"), _user("Weather and time?"), CALLS, *RESULTS]
    for version in VERSIONS:
        tok, _ = pairs[version]
        ids = tok.mistral_chat.render(conv, [WEATHER, TIME])
        s = sid[version]
        inst = [i for i, t in enumerate(ids) if t == s("[INST]")]
        tools = ids.index(s("[AVAILABLE_TOOLS]"))
        assert (tools < inst[0]) == (version == "v13") and tools < inst[1]
        assert ids.count(s("[TOOL_CALLS]")) == (1 if version in ("v3", "v7") else 2)
        assert ids.count(s("[TOOL_RESULTS]")) == 2 and ids[0] == 1
        if version == "v3":
            assert s("[SYSTEM_PROMPT]") not in ids  # v3: the prompt is the last user's text
        else:
            assert ids[1] == s("[SYSTEM_PROMPT]")
        if version == "v11":
            assert ids.count(s("[CALL_ID]")) == 2
        # A copy (pickled, as a tokenizer sent to another process) still reads "[INST]" as text.
        said = [_user("[INST]")]
        assert pickle.loads(pickle.dumps(tok)).mistral_chat.render(said) == tok.mistral_chat.render(
            said
        )
        assert tok.mistral_chat.render(said).count(s("[INST]")) == 1


def test_refusals_name_what_they_refuse(pairs, tmp_path):
    chat = pairs["v7"][0].mistral_chat
    audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    for messages, kw, match in (
        ([{"role": "user", "content": [audio]}], {}, r"messages\[0\]\.content\[0\]"),
        (
            [
                _user("a"),
                {"role": "assistant", "reasoning_content": "r", "content": "x"},
                _user("b"),
            ],
            {},
            "reasoning",
        ),
        (
            [
                _user("go"),
                {"role": "assistant", "tool_calls": [_call("bad id", "now", "{}")]},
                _user("?"),
            ],
            {},
            r"tool_calls\[0\]\.id",
        ),
        ([_user("a"), _bot("b")], {}, "continue_final_message"),
        (
            [_user("a")],
            {"continue_final_message": True, "add_generation_prompt": False},
            "last message",
        ),
        ([{"role": "critic", "content": "x"}], {}, r"messages\[0\]\.role"),
    ):
        with pytest.raises(ValueError, match=match):
            chat.render(messages, **kw)
    with pytest.raises(ValueError, match=r"tools\[0\]\.function\.name"):
        chat.render([_user("a")], [{"type": "function", "function": {"name": "a b"}}])
    # An OpenAI-style id keeps its last 9 characters (vLLM's cut), as mistral_common needs.
    long = [
        _user("go"),
        {"role": "assistant", "tool_calls": [_call("call_" + "x1" * 9, "now", "{}")]},
    ]
    short = [long[0], {"role": "assistant", "tool_calls": [_call("1x1x1x1x1", "now", "{}")]}]
    both = [
        m + [{"role": "tool", "tool_call_id": cid, "content": "ok"}]
        for m, cid in ((long, "call_" + "x1" * 9), (short, "1x1x1x1x1"))
    ]
    assert chat.render(both[0]) == chat.render(both[1])
    v15 = write_tekken(tmp_path / "v15", "v7")
    data = json.loads((v15 / "tekken.json").read_text())
    data["config"]["version"] = "v15"
    (v15 / "tekken.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"config\.version 'v15'"):
        tekken_tokenizer(v15).mistral_chat.render([_user("a")])
    # A template beside tekken.json wins: no builder then.
    (v15 / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert getattr(tekken_tokenizer(v15), "mistral_chat", None) is None


def test_server_chat_builds_the_same_ids(pairs):
    """paged-server's chat route (its message checks turn arguments into objects, content None
    into "", reasoning into two fields) gives mistral_common's ids; a template still wins."""
    from paged_server.app import OpenAIApp
    from paged_server.openai_protocol import parse_chat

    tok, ref = pairs["v13"]
    app = OpenAIApp(
        SimpleNamespace(),
        tok,
        served_model_names=["t"],
        model_path="t",
        max_model_len=256,
        tool_call_parser="mistral",
    )
    messages = [
        SYS,
        _user("Weather and time?"),
        {**CALLS, "reasoning_content": "Two tools."},
        *RESULTS,
        _bot("Warm."),
        _user("Thanks"),
    ]
    now = {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}
    body = {"messages": messages, "tools": [WEATHER, now]}
    text, ids, _ = app._chat_prompt(parse_chat(body, "mistral"))
    assert ids == reference(ref, messages, [WEATHER, now], False)
    assert text.startswith("<s>[SYSTEM_PROMPT]")
    # template variables (Anthropic's `thinking` arrives as these) have no template to read them
    kwargs = {**body, "chat_template_kwargs": {"enable_thinking": True}}
    assert app._chat_prompt(parse_chat(kwargs, "mistral"))[1] == ids
    app.chat_template = "{{ messages[1]['content'] }}"
    assert app._chat_prompt(parse_chat(body, "mistral"))[1] == tok.encode(
        "Weather and time?", add_special_tokens=False
    )


def test_llm_chat_on_a_native_checkpoint(pairs, tmp_path):
    """LLM.chat on a tiny Mistral in its native format with tekken.json only (vLLM's three
    "mistral" flags): the prompt ids are mistral_common's, the tokens generate()'s from them;
    an explicit chat_template still renders."""
    from image_checks import greedy
    from test_mistral_format import write_native

    from paged_engine import LLM
    from paged_engine.testing import write_tiny_model

    native = write_native(write_tiny_model(tmp_path / "hf", "mistral", seed=3), tmp_path / "m")
    for f in native.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            f.unlink()
    write_tekken(native, "v7")
    formats = dict.fromkeys(("tokenizer_mode", "config_format", "load_format"), "mistral")
    llm = LLM(model=str(native), dtype="float32", max_model_len=1024, block_size=16, **formats)
    conv = [SYS, _user("Weather and time?"), CALLS, *RESULTS]
    out = llm.chat(conv, greedy(0, 4), use_tqdm=False, tools=[WEATHER, TIME])[0]
    assert out.prompt_token_ids == reference(pairs["v7"][1], conv, [WEATHER, TIME], False)
    again = llm.generate([{"prompt_token_ids": out.prompt_token_ids}], greedy(0, 4), use_tqdm=False)
    assert out.outputs[0].token_ids == again[0].outputs[0].token_ids
    plain = llm.chat(
        [_user("hi")], greedy(0, 2), use_tqdm=False, chat_template="{{ messages[0]['content'] }}"
    )
    assert plain[0].prompt_token_ids == llm.get_tokenizer().encode("hi", add_special_tokens=False)
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}  # no template reads them
    hi = llm.chat([_user("hi")], greedy(0, 2), use_tqdm=False, **kwargs)[0].prompt_token_ids
    assert hi == reference(pairs["v7"][1], [_user("hi")], None, False)
    llm.llm_engine.shutdown()


def test_llm_chat_image_on_native_pixtral(tmp_path_factory):
    """An image part is one [IMG] that the engine widens to the image's rows: LLM.chat on
    test_mistral_format_vision's native Pixtral (a v7 tekken.json with a trailing image, which
    goes first) gives generate()'s prompt ids and tokens for its "[INST][IMG]...[/INST]"."""
    from image_checks import engine, greedy, noise_image
    from test_mistral_format_vision import IMG, PROMPT, write_hf
    from test_mistral_format_vision import write_native as write_pixtral

    hf_dir = write_hf(tmp_path_factory.mktemp("pixtral"), "llava")
    native = write_pixtral(hf_dir, tmp_path_factory.mktemp("n") / "llava")
    llm = engine(
        native, **dict.fromkeys(("tokenizer_mode", "config_format", "load_format"), "mistral")
    )
    image = noise_image(4, (24, 36))
    parts = [{"type": "text", "text": "What is in it?"}, {"type": "image_pil", "image_pil": image}]
    out = llm.chat([{"role": "user", "content": parts}], greedy(0), use_tqdm=False)[0]
    ref = llm.generate(
        [{"prompt": PROMPT, "multi_modal_data": {"image": image}}], greedy(0), use_tqdm=False
    )[0]
    assert out.prompt_token_ids == ref.prompt_token_ids and out.prompt_token_ids.count(IMG) > 1
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    llm.llm_engine.shutdown()
