"""Incremental detokenization and stop strings across tokenizer kinds (byte-level BPE with added
tokens, SentencePiece-style byte fallback, WordPiece): streamed deltas add up to the final text,
which is the decode of the output in the prompt's context (as vLLM's windowed detokenizer)."""

from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from paged_engine.core.core_output import EngineCoreOutput, SeqUpdate
from paged_engine.engine.bytelevel_detokenizer import _CHAR_TO_BYTE, make_detokenizer
from paged_engine.engine.output_processor import OutputProcessor
from paged_engine.sampling_params import RequestOutputKind, SamplingParams
from paged_engine.testing import build_tiny_tokenizer

WORDS = ["the", "fox", "jumps", "over", "lazy", "dog", "日本", "naïve"]
EMOJI = ["👍", "😀", "日", "é", "한"]


def byte_fallback_tokenizer(decoder: str = "llama") -> PreTrainedTokenizerFast:
    """Llama-2 / Mistral / Gemma style: "▁" words, <0xXX> byte fallback tokens."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for w in ["▁", *(f"▁{w}" for w in WORDS), *WORDS]:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    if decoder == "llama":
        steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        tok.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)])
    else:
        tok.decoder = decoders.Sequence(
            [decoders.ByteFallback(), decoders.Metaspace(prepend_scheme="first")]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.add_tokens([AddedToken("<tool>", normalized=False), AddedToken("▁bar", normalized=False)])
    fast.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    return fast


def wordpiece_tokenizer() -> PreTrainedTokenizerFast:
    """BERT style: "##" continuations, a decoder that cleans up spaces before punctuation."""
    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", ".", ",", "!"])}
    for w in WORDS:
        vocab.setdefault(w, len(vocab))
        vocab.setdefault(f"##{w}", len(vocab))
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer()
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]", pad_token="[PAD]"
    )


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    tok = build_tiny_tokenizer()
    tok.add_tokens(
        [
            AddedToken("<tool>", normalized=False),
            AddedToken(" foo", normalized=True),
            AddedToken("日本", normalized=False),
            AddedToken("Ġhey", normalized=False),  # all GPT-2 table characters: read as bytes
            AddedToken("<|sp|>", special=True, lstrip=True, rstrip=True),
        ]
    )
    return tok


KINDS = {
    "byte_level": byte_level_tokenizer,
    "llama_byte_fallback": byte_fallback_tokenizer,
    "metaspace_byte_fallback": lambda: byte_fallback_tokenizer("metaspace"),
    "wordpiece": wordpiece_tokenizer,
}


def byte_ids(tok: PreTrainedTokenizerFast, text: str) -> list[int]:
    """`text` as byte-fallback or byte-level tokens, one per UTF-8 byte ([] for WordPiece)."""
    if "<0x41>" in tok.get_vocab():
        return tok.convert_tokens_to_ids([f"<0x{b:02X}>" for b in text.encode()])
    if "##fox" in tok.get_vocab():
        return []
    char_of = {b: c for c, b in _CHAR_TO_BYTE.items()}
    return tok.convert_tokens_to_ids([char_of[b] for b in text.encode()])


def prompt_ids(rng: random.Random, tok: PreTrainedTokenizerFast) -> list[int]:
    """A prompt ending on a whole word (one ending inside a byte-fallback run that the output
    continues has no well-defined output text: the full decode rewrites the prompt's tail)."""
    word = rng.choice(WORDS)
    if f"▁{word}" in tok.get_vocab():
        return tok.convert_tokens_to_ids(["<s>", f"▁{word}"])
    return tok.encode(" " + word, add_special_tokens=False)


def random_ids(rng: random.Random, tok: PreTrainedTokenizerFast, n: int) -> list[int]:
    """Words, whole or cut multi-byte characters as byte tokens, added tokens, any token."""
    added = list(tok.added_tokens_decoder)
    out: list[int] = []
    while len(out) < n:
        r = rng.random()
        if r < 0.3:
            out += tok.encode(" " + rng.choice(WORDS), add_special_tokens=False)
        elif r < 0.5:
            ids = byte_ids(tok, rng.choice(EMOJI))
            out += ids if rng.random() < 0.8 or not ids else ids[: rng.randint(1, len(ids))]
        elif r < 0.7:
            out.append(rng.choice(added))
        else:
            out.append(rng.randrange(len(tok)))
    return out[:n]


@pytest.mark.parametrize("kind", list(KINDS))
def test_streamed_text_is_the_decode_in_context(kind):
    """1 to 4 tokens a step (speculative decoding), specials skipped or kept: deltas never take
    text back and add up to decode(context + output) minus decode(context)."""
    tok = KINDS[kind]()
    backend = tok.backend_tokenizer
    rng = random.Random(0)
    checked = 0
    for _ in range(300):
        prompt = prompt_ids(rng, tok)
        out = random_ids(rng, tok, rng.randint(1, 20))
        skip = rng.random() < 0.5
        # (spaces_between_special_tokens=False, specials kept, is not the decode in context:
        # adjacent added tokens join bare, as in vLLM; test_sampling_parity_vllm.py checks it)
        det = make_detokenizer(tok, prompt, skip_special_tokens=skip)
        context = backend.decode(prompt[-5:], skip_special_tokens=skip)
        whole = backend.decode(prompt[-5:] + out, skip_special_tokens=skip)
        if kind == "byte_level":
            expected = backend.decode(out, skip_special_tokens=skip)
        else:
            assert whole.startswith(context)
            expected = whole[len(context) :]
        streamed, i = "", 0
        while i < len(out):
            k = rng.randint(1, 4)
            streamed += det.add_tokens(out[i : i + k])
            i += k
            assert expected.startswith(streamed), (prompt, out, skip)
        streamed += det.finalize()
        assert streamed == det.output_text == expected, (prompt, out, skip)
        checked += 1
    assert checked == 300


def run_stop(tok, prompt, out, stop, include, finish_reason="length"):
    """Stream `out` through the output processor, 1 token a step; (text, finish_reason)."""
    processor = OutputProcessor(tok)
    params = SamplingParams(stop=[stop], include_stop_str_in_output=include, max_tokens=64)
    processor.add_request(
        "r", None, prompt, params, 0.0, num_returned=1, kind=RequestOutputKind.DELTA
    )
    text, reason = "", None
    for k, token in enumerate(out):
        last = k == len(out) - 1
        upd = SeqUpdate(
            0,
            [token],
            finish_reason=finish_reason if last else None,
            stop_reason=token if last and finish_reason == "stop" else None,
        )
        for o in processor.process([EngineCoreOutput("r", [upd], finished=last)]).request_outputs:
            text += o.outputs[0].text
            reason = o.outputs[0].finish_reason or reason
        if reason is not None:
            break
    return text, reason


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("finish", ["length", "stop"])
def test_stop_string_in_text_held_until_the_end(include, finish):
    """A byte-fallback run is held until it ends; when the sequence ends first (max_tokens, or
    eos), the flushed text is searched for stop strings like any other delta (vLLM emits each
    completed character at once, so it matches there too)."""
    tok = byte_fallback_tokenizer()
    prompt = tok.convert_tokens_to_ids(["<s>", "▁the"])
    out = byte_ids(tok, "👍u")  # "u" as a byte token too: the run never ends
    if finish == "stop":
        out.append(tok.eos_token_id)  # not detokenized unless include_stop_str_in_output
    text, reason = run_stop(tok, prompt, out, "u", include, finish)
    assert (text, reason) == ("👍u" if include else "👍", "stop")


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_across_characters_and_added_tokens(kind, include):
    """Stop strings cut from the expected text (so they span multi-byte characters, added
    tokens, skipped specials): the stream is a prefix of the result, which is cut at the first
    occurrence."""
    tok = KINDS[kind]()
    backend = tok.backend_tokenizer
    rng = random.Random(1)
    for _ in range(60):
        prompt = prompt_ids(rng, tok)
        out = random_ids(rng, tok, rng.randint(2, 16))
        context = backend.decode(prompt[-5:], skip_special_tokens=True)
        whole = backend.decode(prompt[-5:] + out, skip_special_tokens=True)[len(context) :]
        if kind == "byte_level":
            whole = backend.decode(out, skip_special_tokens=True)
        start = rng.randrange(max(1, len(whole)))
        stop = whole[start : start + rng.randint(1, 4)]
        if not stop or "\ufffd" in stop:
            continue
        pos = whole.find(stop)
        text, reason = run_stop(tok, prompt, out, stop, include)
        assert text == whole[: pos + (len(stop) if include else 0)], (prompt, out, stop)
        assert reason == "stop"
