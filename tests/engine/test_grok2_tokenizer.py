"""Grok-2 checkpoints with xAI's tokenizer.tok.json only (paged_engine/grok2_tokenizer.py).

The tiny tokenizer.tok.json is written in the release's format (as vLLM's Grok2Tokenizer reads
it): `regular_tokens` / `special_tokens` as {"bytes": [...], "token": id}, word_split "V1",
vocab_size; the 256 single bytes, then the specials, then merges learned here by byte-level BPE
on a small multilingual corpus (ids not contiguous per kind, as tiktoken allows). The reference
ids are tiktoken's own Encoding built from the same ranks and specials, with the specials vLLM's
encode allows.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import save_file

regex = pytest.importorskip("regex")
transformers = pytest.importorskip("transformers")

from test_tekken import bpe_merges  # noqa: E402

from paged_engine.grok2_tokenizer import (  # noqa: E402
    GROK2_CHAT_TEMPLATE,
    V1_PATTERN,
    grok2_only,
    grok2_tokenizer,
)

# "<|mask|>" and "<|tool call|>" are not among the specials vLLM's encode allows: plain text in
# a prompt (the second's space is outside the byte-level alphabet).
SPECIALS = [
    "<|pad|>", "<|separator|>", "<|eos|>", "<|mask|>", "<|control1|>", "<|reserved_3|>",
    "<|tool call|>",
]  # fmt: skip
# Tokens no merge reaches: " Zqx" is one token only as a whole piece; "20" spans two of V1's
# one-digit pieces, so never appears.
UNREACHED = [b" Zqx", b"20"]
CORPUS = (
    "Hello world, the weather's fine today. I'll say we're done; you'd agree.\n"
    "Naïve café owners serve crème brûlée; déjà vu. Über große Straßen fährt ein Zug.\n"
    "東京は日本の首都です。Привет, как дела? Numbers 12345 and 3.14159, emoji 🙂🙂 ok!!\n"
    "  Tabs\tand  double  spaces\n\nnew lines.\n"
) * 3
TEXTS = [
    "Hello world, the weather's fine.",
    "I'LL SAY WE'RE done  \n\n\t tabs   ",
    "naïve café — 東京 🙂 Привет! 2024-12-06",
    "unseen: ǅemal ℌ 𝔘 \u200b end",
    "Done.\n\nein einein Zqx Zqx",  # pairs compete: the lowest rank must merge first
]


def learn_merges(n: int) -> list[bytes]:
    """`n` multi-byte tokens by byte-level BPE on CORPUS split by the V1 pattern (most frequent
    pair first)."""
    return bpe_merges([m.encode() for m in regex.findall(V1_PATTERN, CORPUS)], n)


def write_tok_json(path: Path, num_merges: int = 200) -> tuple[dict[bytes, int], dict[str, int]]:
    """tokenizer.tok.json in `path`: bytes at ids 0 .. 255, SPECIALS next, merges after them;
    returns (regular bytes -> id, special -> id)."""
    path.mkdir(parents=True, exist_ok=True)
    specials = {s: 256 + i for i, s in enumerate(SPECIALS)}
    merges = learn_merges(num_merges) + UNREACHED
    regular = {bytes([b]): b for b in range(256)}
    regular |= {t: 256 + len(SPECIALS) + i for i, t in enumerate(merges)}
    data = {
        "regular_tokens": [{"bytes": list(t), "token": i} for t, i in regular.items()],
        "special_tokens": [{"bytes": list(s.encode()), "token": i} for s, i in specials.items()],
        "word_split": "V1",
        "vocab_size": len(regular) + len(specials),
    }
    (path / "tokenizer.tok.json").write_text(json.dumps(data))
    return regular, specials


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> tuple[Path, dict[bytes, int], dict[str, int]]:
    path = tmp_path_factory.mktemp("grok2tok")
    return path, *write_tok_json(path)


def test_round_trip_and_tiktoken_ids(tok_dir):
    """Text (unicode, unseen characters, whitespace runs, digits one by one) and the allowed
    specials round-trip, merges used; the ids are tiktoken's (where tiktoken is installed)."""
    path, regular, specials = tok_dir
    assert grok2_only(path)
    tok = grok2_tokenizer(path)
    assert len(tok) == len(regular) + len(specials)
    texts = [
        *TEXTS,
        "<|separator|>Human: hi<|eos|> <|mask|><|control1|><|reserved_3|>x<|tool call|>",
    ]
    for text in texts:
        assert tok.decode(tok.encode(text)) == text
    assert any(len(tok.encode(t)) < len(t.encode()) // 2 for t in TEXTS)  # merges used
    assert tok.encode("2024") == [ord(c) for c in "2024"]  # V1 splits each digit
    assert tok.encode(" Zqx") == [regular[b" Zqx"]]
    assert tok.encode("<|eos|>") == [specials["<|eos|>"]]  # no BOS added
    tiktoken = pytest.importorskip("tiktoken")
    ref = tiktoken.Encoding(
        name="grok2-tiny",
        pat_str=V1_PATTERN,
        mergeable_ranks=regular,
        special_tokens=specials,
        explicit_n_vocab=len(tok),
    )
    allowed = set(SPECIALS) - {"<|mask|>", "<|tool call|>"}
    for text in texts:
        want = ref.encode(text, allowed_special=allowed, disallowed_special=())
        assert tok.encode(text) == want, text
        assert tok.decode(want) == ref.decode(want)


def test_special_tokens(tok_dir):
    """Specials keep their file ids and decode to their text; those not allowed are plain text
    in a prompt, named in byte-level form; BOS is <|separator|>, EOS <|eos|>, PAD / UNK
    <|pad|>."""
    path, regular, specials = tok_dir
    tok = grok2_tokenizer(path)
    for name, i in specials.items():
        assert tok.convert_ids_to_tokens(i) == name.replace(" ", "Ġ")
        assert tok.decode([i]) == name
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == (
        257, 258, 256, 256,
    )  # fmt: skip
    assert specials["<|mask|>"] not in tok.encode("a<|mask|>")
    assert tok.decode(tok.encode("<|tool call|>")) == "<|tool call|>"
    ids = tok.encode("<|separator|>hi<|eos|>")
    assert (ids[0], ids[-1]) == (257, 258)
    assert tok.decode(ids, skip_special_tokens=True) == "hi"
    assert tok.convert_ids_to_tokens(regular[b" the"]) == "Ġthe"
    assert tok.chat_template == GROK2_CHAT_TEMPLATE


def test_malformed_files_are_refused_by_name(tmp_path):
    write_tok_json(tmp_path, 10)
    good = json.loads((tmp_path / "tokenizer.tok.json").read_text())
    regular, special = good["regular_tokens"], good["special_tokens"]
    cases = [
        ({**good, "word_split": "V2"}, "word_split"),
        ({**good, "regular_tokens": regular[1:]}, "256 single bytes"),
        ({**good, "regular_tokens": [{"bytes": "YQ==", "token": 0}]}, r"regular_tokens\[0\]"),
        ({**good, "special_tokens": [{**special[0], "token": 5}]}, "distinct"),
        ({**good, "vocab_size": 10_000}, "vocab_size=10000"),
        ({**good, "pat_str": 7}, "pat_str"),
        ([], "JSON object"),
    ]
    for data, match in cases:
        (tmp_path / "tokenizer.tok.json").write_text(json.dumps(data))
        with pytest.raises(ValueError, match=rf"tokenizer\.tok\.json.*{match}"):
            grok2_tokenizer(tmp_path)


def _tiny_grok2(path: Path) -> Path:
    """test_models_grok's tiny Grok-2 ("grok2" case: random weights, config.json as the release
    writes it) with tokenizer.tok.json as its only tokenizer file."""
    from test_models_grok import CASES, _grok_reference, _grok_tensors

    arch, tied, fields = CASES["grok2"]
    hf, src, moe = _grok_reference(fields, tied, seed=3)
    path.mkdir(parents=True)
    config = {
        "architectures": [arch],
        "vocab_size": src.vocab_size,
        "hidden_size": src.hidden_size,
        "intermediate_size": src.intermediate_size,
        "num_hidden_layers": src.num_hidden_layers,
        "num_attention_heads": src.num_attention_heads,
        "num_key_value_heads": src.num_key_value_heads,
        "max_position_embeddings": src.max_position_embeddings,
        "num_experts_per_tok": moe.num_experts_per_tok,
        "torch_dtype": "float32",
        **fields,
    }
    (path / "config.json").write_text(json.dumps(config))
    save_file(
        _grok_tensors(hf, fields, moe.intermediate_size, tied), str(path / "model.safetensors")
    )
    return path


def test_llm_loads_and_chats_with_tok_json_only(tmp_path):
    """LLM(...) on a Grok-2 directory whose only tokenizer is tokenizer.tok.json: prompts are
    tokenized by it, outputs detokenized by it, and LLM.chat renders vLLM's Grok-2 layout."""
    from image_checks import engine

    from paged_engine import SamplingParams

    path = _tiny_grok2(tmp_path / "grok2")
    _, specials = write_tok_json(path)
    assert grok2_only(path) and [p.name for p in path.glob("tokenizer*")] == ["tokenizer.tok.json"]
    llm = engine(path, max_model_len=128, tokenizer_mode="grok2")  # vLLM's mode name, accepted
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    (out,) = llm.generate(["Hello world, naïve café"], params)
    assert out.prompt_token_ids == tok.encode("Hello world, naïve café")
    assert len(out.outputs[0].token_ids) == 6
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids)
    messages = [
        {"role": "system", "content": " Be brief. "},
        {"role": "user", "content": " Hi there "},
        {"role": "assistant", "content": " Hello "},
        {"role": "user", "content": "Why?"},
    ]
    (chat,) = llm.chat(messages, params)
    want = (
        "System: Be brief.<|separator|>\n\nHuman: Hi there<|separator|>\n\n"
        "Assistant:  Hello <|separator|>\n\nHuman: Why?<|separator|>\n\nAssistant:"
    )
    assert chat.prompt == want
    assert chat.prompt_token_ids == tok.encode(want)
    assert chat.prompt_token_ids.count(specials["<|separator|>"]) == 4
    # tokenizer_config.json's chat_template wins, as vLLM reads it
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ 'X' }}"}))
    assert grok2_tokenizer(path).chat_template == "{{ 'X' }}"
