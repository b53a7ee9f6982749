"""Mistral checkpoints with tekken.json only (paged_engine/tekken.py).

The tiny tekken.json files are written as mistral_common saves them (base64 `token_bytes` by
rank, the first 256 the single bytes; `special_tokens` with ranks; the Tekken split pattern;
`num_vocab_tokens` / `default_vocab_size` / `default_num_special_tokens`), their merges learned
here from a small multilingual corpus. The reference ids are an independent reading of the
same file by tiktoken's rules (split by the pattern, a piece in the vocab is one token, else
the adjacent pair making the lowest rank merges first, leftmost on a tie; id = rank + number
of specials), which is what mistral_common's Tekkenizer.encode returns, BOS first.
"""

from __future__ import annotations

import base64
import fnmatch
import json
import shutil
from collections import Counter
from itertools import pairwise
from pathlib import Path

import pytest
from audio_checks import noise_clip
from image_checks import engine, greedy

regex = pytest.importorskip("regex")
transformers = pytest.importorskip("transformers")

from paged_engine.hub import _METADATA_PATTERNS  # noqa: E402
from paged_engine.loader import load_tokenizer, resolve_model  # noqa: E402
from paged_engine.tekken import tekken_only, tekken_tokenizer  # noqa: E402

# Mistral's tekken split pattern (as in its tekken.json files).
PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Ranks as in Voxtral's tekken.json for the first 20; the rest fill to NUM_SPECIAL.
SPECIALS = [
    "<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]",
    "[IMG_END]", "[PREFIX]", "[MIDDLE]", "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
    "[TOOL_CONTENT]", "[AUDIO]", "[BEGIN_AUDIO]", "[TRANSCRIBE]",
]  # fmt: skip
SPECIALS_INFO = [{"rank": i, "token_str": s, "is_control": True} for i, s in enumerate(SPECIALS)]
NUM_SPECIAL = 32
CORPUS = (
    "Hello world, the weather is fine today. The quick brown fox jumps over the lazy dog.\n"
    "Naïve café owners serve crème brûlée; déjà vu. Über große Straßen fährt ein Zug.\n"
    "東京は日本の首都です。東京タワー。Привет, как дела? Всё хорошо, спасибо.\n"
    "Numbers 12345 and 3.14159, emoji 🙂🙂 ok!!  Tabs\tand  double  spaces\n\nnew lines.\n"
) * 3
TEXTS = [
    "Hello world, the weather is fine.",
    "  leading spaces\n\nand new lines\t tabs   ",
    "naïve café — 東京タワー 🙂 Привет!",
    "numbers 12345 and 3.14, über-große ẞ",
    "unseen: ǅemal ℌ 𝔘 \u200b end",
    "Naïveaïve ,ошорох",  # pairs compete: the lowest rank must merge first
    "Zqaax Zqabx",  # filler 0 whole; " Zqabx" (a piece of its own) is not in the vocab
]


def pieces(text: str) -> list[bytes]:
    return [m.encode() for m in regex.findall(PATTERN, text)]


def bpe_merges(pieces: list[bytes], n: int) -> list[bytes]:
    """Up to `n` multi-byte tokens learned as byte-level BPE on `pieces` (the most frequent
    adjacent pair first, ties to the larger pair); fewer when every piece is one token."""
    words = [[bytes([b]) for b in p] for p in pieces]
    made: list[bytes] = []
    while len(made) < n:
        pairs = Counter(p for w in words for p in pairwise(w))
        if not pairs:  # every piece is one token
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        made.append(a + b)
        for w in words:
            i = 0
            while i < len(w) - 1:
                if (w[i], w[i + 1]) == (a, b):
                    w[i : i + 2] = [a + b]
                i += 1
    return made


def learn_merges(n: int) -> list[bytes]:
    """`n` multi-byte tokens, learned as byte-level BPE on CORPUS (most frequent pair first),
    then filler words that no merge reaches (one token only as a whole piece)."""
    made = bpe_merges(pieces(CORPUS), n)
    return made + [filler(i).encode() for i in range(n - len(made))]


def filler(i: int) -> str:
    return f"Zq{chr(97 + i // 26)}{chr(97 + i % 26)}x"


def write_tekken(
    path: Path, num_merges: int, *, extra: int = 0, old_format: bool = False
) -> list[bytes]:
    """A tekken.json in `path` with 256 bytes + `num_merges` used tokens (and `extra` past
    default_vocab_size, which count for nothing), SPECIALS listed unless `old_format`;
    returns the used vocab by rank."""
    path.mkdir(parents=True, exist_ok=True)
    ranks = [bytes([b]) for b in range(256)] + learn_merges(num_merges + extra)
    entries = [
        {"rank": r, "token_bytes": base64.b64encode(t).decode(), "token_str": _str(t)}
        for r, t in enumerate(ranks)
    ]
    used = 256 + num_merges
    data = {
        "config": {
            "pattern": PATTERN,
            "num_vocab_tokens": len(entries),
            "default_vocab_size": NUM_SPECIAL + used,
            "default_num_special_tokens": NUM_SPECIAL,
            "version": "v3" if old_format else "v7",
        },
        "vocab": entries,
    }
    if not old_format:  # v3 files predate the special_tokens list
        data["special_tokens"] = SPECIALS_INFO
    (path / "tekken.json").write_text(json.dumps(data, ensure_ascii=False))
    return ranks[:used]


def _str(token: bytes) -> str | None:
    try:
        return token.decode()
    except UnicodeDecodeError:
        return None


def reference_ids(text: str, ranks: list[bytes]) -> list[int]:
    """tiktoken's encoding of `text` by `ranks` (ids offset by NUM_SPECIAL)."""
    rank_of = {t: r for r, t in enumerate(ranks)}
    ids = []
    for piece in pieces(text):
        if piece in rank_of:
            ids.append(rank_of[piece])
            continue
        parts = [bytes([b]) for b in piece]
        while len(parts) > 1:
            pairs = [(rank_of.get(a + b), i) for i, (a, b) in enumerate(pairwise(parts))]
            known = [pair for pair in pairs if pair[0] is not None]
            if not known:
                break
            _, i = min(known)  # the lowest rank, leftmost on a tie
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        ids += [rank_of[p] for p in parts]
    return [NUM_SPECIAL + i for i in ids]


@pytest.fixture(scope="module")
def tekken_dir(tmp_path_factory) -> tuple[Path, list[bytes]]:
    path = tmp_path_factory.mktemp("tekken")
    return path, write_tekken(path, 240, extra=5)  # 233 merges, 7 fillers, 5 unused


def test_text_ids_are_mistral_commons(tekken_dir):
    """Ids of texts (unicode, unseen characters, whitespace runs) equal the rank-BPE reading
    of the file with BOS first; decode gives the text back."""
    path, ranks = tekken_dir
    assert tekken_only(path)
    tok = tekken_tokenizer(path)
    assert len(tok) == NUM_SPECIAL + len(ranks)  # the entries past default_vocab_size dropped
    assert any(len(reference_ids(t, ranks)) < len(t.encode()) for t in TEXTS)  # merges used
    for text in TEXTS:
        want = reference_ids(text, ranks)
        assert tok.encode(text) == [1, *want], text
        assert tok.encode(text, add_special_tokens=False) == want, text
        assert tok.decode(want) == text
        assert tok.decode([1, *want], skip_special_tokens=True) == text
    # A piece in the vocab is one token though no merge makes it; past the vocab it is not.
    for word, count in ((filler(0), 1), (filler(6), 1), (filler(7), 5)):
        assert len(reference_ids(word, ranks)) == count
        assert tok.encode(word, add_special_tokens=False) == reference_ids(word, ranks)


def test_special_tokens(tekken_dir):
    """Specials take ids 0 .. 31 by rank (unnamed ones `<SPECIAL_i>`), their text in a prompt
    is the token, and BOS / EOS / UNK / PAD are Mistral's."""
    path, ranks = tekken_dir
    tok = tekken_tokenizer(path)
    for i, name in enumerate(SPECIALS):
        assert tok.convert_tokens_to_ids(name) == i
    assert tok.convert_tokens_to_ids("<SPECIAL_31>") == 31
    assert tok.convert_ids_to_tokens(NUM_SPECIAL + ord("a")) == "a"
    assert (tok.bos_token_id, tok.eos_token_id, tok.unk_token_id, tok.pad_token_id) == (
        1, 2, 0, 11,
    )  # fmt: skip
    text = "[INST]What is it?[AUDIO][BEGIN_AUDIO][/INST]"
    ids = [3, *reference_ids("What is it?", ranks), 20, 21, 4]
    assert tok.encode(text, add_special_tokens=False) == ids
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == "What is it?"
    assert tok.chat_template is None


def test_old_format_and_files(tmp_path):
    """A tekken.json without `special_tokens` (version <= v7) gets mistral_common's 20; a chat
    template beside it is used; tekken.json is fetched from the Hub and read by load_tokenizer
    only where the repo has no tokenizer.json / tokenizer_config.json."""
    ranks = write_tekken(tmp_path, 40, old_format=True)
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    tok = tekken_tokenizer(tmp_path)
    assert tok.convert_tokens_to_ids(["[IMG]", "<pad>", "[TOOL_CONTENT]", "<SPECIAL_20>"]) == [
        10, 11, 19, 20,
    ]  # fmt: skip
    assert tok.encode("café", add_special_tokens=False) == reference_ids("café", ranks)
    assert tok.chat_template == "{{ messages[0]['content'] }}"
    assert any(fnmatch.fnmatch("tekken.json", p) for p in _METADATA_PATTERNS)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mistral"}))
    loaded = load_tokenizer(resolve_model(tmp_path))
    assert loaded.encode("café") == tok.encode("café")
    tok.save_pretrained(tmp_path)  # now the repo's own HF files are used
    assert not tekken_only(tmp_path)


def test_malformed_files_are_refused_by_name(tmp_path):
    write_tekken(tmp_path, 10)
    good = json.loads((tmp_path / "tekken.json").read_text())
    old = {**good, "config": {**good["config"], "version": "v11"}}
    del old["special_tokens"]
    big = {**good, "config": {**good["config"], "default_vocab_size": 10_000}}
    swapped = {**good, "vocab": [good["vocab"][1], good["vocab"][0], *good["vocab"][2:]]}
    gaps = {**good, "special_tokens": [{**t, "rank": t["rank"] * 2} for t in SPECIALS_INFO]}
    cases = [
        (old, "special_tokens is missing"),
        (big, r"config\.default_vocab_size=10000"),
        (swapped, r"vocab\[0\] must have rank 0"),
        (gaps, "special_tokens ranks"),
    ]
    for data, match in cases:
        (tmp_path / "tekken.json").write_text(json.dumps(data))
        with pytest.raises(ValueError, match=match):
            tekken_tokenizer(tmp_path)


@pytest.fixture(scope="module")
def voxtral_pair(tmp_path_factory) -> tuple[Path, Path, list[bytes]]:
    """A tiny Voxtral (test_voxtral_audio's) twice: with tekken.json only, and with the
    tokenizer.json / tokenizer_config.json transformers converts from it (its own BPE build;
    BOS added and Mistral's special tokens named here, which that conversion leaves out)."""
    pytest.importorskip("transformers.models.voxtral")
    from test_voxtral_audio import write_tiny_voxtral
    from tokenizers.processors import TemplateProcessing

    base = write_tiny_voxtral(tmp_path_factory.mktemp("voxtral_base"))
    vocab = json.loads((base / "config.json").read_text())["text_config"]["vocab_size"]
    only = tmp_path_factory.mktemp("voxtral_tekken")
    for f in base.iterdir():
        if not f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, only / f.name)
    ranks = write_tekken(only, vocab - NUM_SPECIAL - 256)
    config = json.loads((only / "config.json").read_text())
    config["audio_token_id"] = SPECIALS.index("[AUDIO]")
    (only / "config.json").write_text(json.dumps(config))
    hf_files = tmp_path_factory.mktemp("voxtral_hf")
    for f in only.iterdir():
        if f.name != "tekken.json":
            shutil.copy(f, hf_files / f.name)
    try:  # transformers 5 converts a tekken-only directory; 4.x asks for mistral_common
        # (mistral_format=False: its own conversion, not mistral_common's backend where installed)
        converted = transformers.AutoTokenizer.from_pretrained(only, mistral_format=False)
    except (OSError, ValueError, ImportError) as error:
        pytest.skip(f"this transformers does not convert tekken.json: {error}")
    converted.backend_tokenizer.post_processor = TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)]
    )
    converted.add_special_tokens({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    converted.save_pretrained(hf_files)
    return only, hf_files, ranks


def test_voxtral_with_tekken_only(voxtral_pair):
    """Audio prompts (text with [AUDIO], ids, a transcription request) run with tekken.json
    only give the prompt ids mistral_common's request encoding writes and the same tokens,
    logprobs and text as with the converted tokenizer.json; LLM.chat builds mistral_common's
    layout (mistral_chat.py), refuses reasoning on v7 by name, and the engine keeps serving."""
    only, hf_files, ranks = voxtral_pair
    clip, clip2 = noise_clip(1, 1.0), noise_clip(2, 0.6)
    audio = [20] * 50  # [AUDIO] x ceil(400 frames / 8): one 4 s window
    prompts = [
        {"prompt": "[INST][AUDIO]What is it?[/INST]", "multi_modal_data": {"audio": clip}},
        {"prompt": "[INST][BEGIN_AUDIO][AUDIO] then [BEGIN_AUDIO][AUDIO][/INST]",
         "multi_modal_data": {"audio": [clip, clip2]}},
        {"prompt": "[INST]Say something about the sea.[/INST]"},
    ]  # fmt: skip
    wants = [
        [1, 3, 21, *audio, *reference_ids("What is it?", ranks), 4],
        [1, 3, 21, *audio, *reference_ids(" then ", ranks), 21, *audio, 4],
        [1, 3, *reference_ids("Say something about the sea.", ranks), 4],
    ]
    results = []
    for path in (only, hf_files):
        llm = engine(path)
        request = llm.llm_engine.input_processor.audios.transcription_prompt("en", "transcribe", "")
        outs = llm.generate(
            [*prompts, {**request, "multi_modal_data": {"audio": clip2}}], greedy(), use_tqdm=False
        )
        if path == only:
            chat = llm.chat([{"role": "user", "content": "Hi"}], greedy(), use_tqdm=False)
            assert chat[0].prompt_token_ids == [1, 3, *reference_ids("Hi", ranks), 4]
            said = {"role": "assistant", "content": "Hello", "reasoning_content": "Greet."}
            turns = [{"role": "user", "content": "Hi"}, said, {"role": "user", "content": "?"}]
            with pytest.raises(ValueError, match="reasoning_content"):  # v7 has no [THINK]
                llm.chat(turns, greedy(), use_tqdm=False)
            again = llm.generate([prompts[0]], greedy(), use_tqdm=False)[0]
            assert again.outputs[0].token_ids == outs[0].outputs[0].token_ids
        results.append(outs)
        del llm
    ours, theirs = results
    lang = reference_ids("lang:en", ranks)
    wants.append([1, 3, 21, *audio, 4, *lang, 22])
    assert [o.prompt_token_ids for o in ours] == wants
    for a, b in zip(ours, theirs, strict=True):
        assert a.prompt_token_ids == b.prompt_token_ids
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].text == b.outputs[0].text
        got = [e[t].logprob for e, t in zip(a.outputs[0].logprobs, a.outputs[0].token_ids)]
        ref = [e[t].logprob for e, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids)]
        assert got == pytest.approx(ref, abs=1e-5)
