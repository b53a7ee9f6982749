"""Whisper (models/whisper.py, multimodal/whisper.py, worker/cross_attention.py) against HF.

A tiny random WhisperForConditionalGeneration (16 mels, 2 s windows: 200 frames -> 100 encoder
frames, so the clips fill them) saved with its WhisperFeatureExtractor and a tiny tokenizer
holding Whisper's special tokens. `LLM.generate` with the clip in `multi_modal_data['audio']`
(both of vLLM's prompt forms) must give the feature extractor's features and the greedy tokens
and top-5 logprobs (1e-3, float32) of a greedy loop over HF's model on the same features and
decoder prompt (HF `generate` adds Whisper's suppress-token processors, which vLLM does not).
Then: two audios one after the other with a long decoder prompt chunked through prefill and the
prefix cache on (no block shared between audios), n = 2 seeded sampling and beam search alone
and batched, preemption in a tiny KV cache, requests joining as others leave, TP=2 against one
process (tokens and top logprobs, 1e-4: the tiny model's tokens repeat whatever the audio, its
logprobs tell clips apart), and bad input refused by name while the engine keeps serving.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from hf_reference import Greedy, assert_matches, greedy_over_logits
from image_checks import greedy

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.whisper")

from paged_engine import LLM, SamplingParams  # noqa: E402
from paged_engine.multimodal.whisper import whisper_prompt  # noqa: E402
from paged_engine.sampling_params import BeamSearchParams  # noqa: E402
from paged_engine.testing import (  # noqa: E402
    _COMMON,
    TINY_VOCAB_SIZE,
    _save_random,
    build_tiny_tokenizer,
)

SR = 16000
LANGS = ["en", "fr", "de", "es", "ja"]
SPECIAL = ["<|startoftranscript|>", *(f"<|{c}|>" for c in LANGS), "<|transcribe|>"]
SPECIAL += ["<|translate|>", "<|startofprev|>", "<|notimestamps|>"]
# Whisper's layout: <|0.00|> ... <|2.00|> (the 2 s window) right after <|notimestamps|>, added
# as plain (not special) tokens, as the checkpoints' tokenizers have them
TIMESTAMPS = [f"<|{i * 0.02:.2f}|>" for i in range(101)]
PREFIX = "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>"


def write_tiny_whisper(path: Path, seed: int = 2) -> Path:
    """A tiny random Whisper checkpoint, its feature extractor and tokenizer at `path`."""
    tokenizer = build_tiny_tokenizer(TINY_VOCAB_SIZE, 0)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL})
    tokenizer.add_tokens(TIMESTAMPS)
    config = transformers.WhisperConfig(
        vocab_size=len(tokenizer),
        num_mel_bins=16,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_source_positions=100,  # 2 s windows: the clips fill them
        decoder_start_token_id=tokenizer.convert_tokens_to_ids(SPECIAL[0]),
        begin_suppress_tokens=None,
        architectures=["WhisperForConditionalGeneration"],
        **_COMMON,
    )
    _save_random(transformers.WhisperForConditionalGeneration, config, seed, path)
    tokenizer.save_pretrained(path)
    transformers.WhisperFeatureExtractor(feature_size=16, chunk_length=2).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_whisper(tmp_path_factory.mktemp("whisper"))


@pytest.fixture(scope="module")
def hf(tiny):
    model = transformers.WhisperForConditionalGeneration.from_pretrained(tiny)
    return model.float().eval()


def clip(seed: int, seconds: float) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * SR)) / SR
    tone = np.sin(2 * np.pi * (200 + 100 * seed) * t)
    return (0.3 * tone + 0.1 * rng.standard_normal(t.size)).astype(np.float32)


def features(path: Path, wave: np.ndarray) -> torch.Tensor:
    fe = transformers.WhisperFeatureExtractor.from_pretrained(path)
    return fe(wave, sampling_rate=SR, return_tensors="pt").input_features


def hf_loop(model, feats: torch.Tensor, prompt: list[int], n: int = 8) -> Greedy:
    """Greedy decoding over HF's forward (no logits processors), with top-5 logprobs."""
    with torch.no_grad():
        enc = model.model.encoder(feats).last_hidden_state

    def logits(ids: torch.Tensor) -> torch.Tensor:  # [S] -> [S, V]
        return model(encoder_outputs=(enc,), decoder_input_ids=ids[None]).logits[0].float()

    return greedy_over_logits(logits, prompt, n)


def engine(path: Path, **kw) -> LLM:
    return LLM(model=str(path), dtype="float32", block_size=16, **kw)


def long_prompt(tokenizer, seed: int) -> list[int]:
    """The usual prefix and 30 text tokens: past a block, chunked at 16 tokens a step."""
    rng = random.Random(seed)
    return whisper_prompt(tokenizer) + [rng.randrange(3, 500) for _ in range(30)]


def test_matches_hf(tiny, hf):
    llm = engine(tiny)
    tok = llm.get_tokenizer()
    one, two = clip(3, 1.7), clip(2, 1.3)
    # the features are the feature extractor's, bit for bit
    host = llm.llm_engine.input_processor.audios
    _, (item,), _ = host.process([1], (one, SR))
    assert torch.equal(item.pixel_values, features(tiny, one)[0])
    prefix = whisper_prompt(tok)
    assert tok.encode(PREFIX, add_special_tokens=False) == prefix
    prompts = [
        {"prompt": PREFIX, "multi_modal_data": {"audio": (one, SR)}},
        {
            "encoder_prompt": {"prompt": "", "multi_modal_data": {"audio": (two, SR)}},
            "decoder_prompt": PREFIX,
        },
    ]
    refs = [hf_loop(hf, features(tiny, w), prefix) for w in (one, two)]
    assert refs[0].tokens != refs[1].tokens  # the audio decides
    for out, ref in zip(llm.generate(prompts, greedy(), use_tqdm=False), refs, strict=True):
        assert out.prompt_token_ids == prefix
        assert_matches("whisper", out, ref)
    # no decoder prompt: the decoder starts from decoder_start_token_id alone
    bare = [
        {"encoder_prompt": {"multi_modal_data": {"audio": one}}},
        {"prompt": "", "multi_modal_data": {"audio": one}},
    ]
    ref = hf_loop(hf, features(tiny, one), prefix[:1])
    for out in llm.generate(bare, greedy(), use_tqdm=False):
        assert out.prompt_token_ids == prefix[:1]
        assert_matches("whisper bare", out, ref)
    # long decoder prompts, chunked, prefix caching on: each audio's own blocks
    chunked = engine(tiny, max_num_batched_tokens=16, enable_chunked_prefill=True)
    ids = long_prompt(tok, 0)
    for w in (one, two):  # one after the other: the second would hit the first's blocks
        out = chunked.generate(
            [{"prompt_token_ids": ids, "multi_modal_data": {"audio": (w, SR)}}],
            greedy(),
            use_tqdm=False,
        )[0]
        assert_matches("whisper chunked", out, hf_loop(hf, features(tiny, w), ids))
    # the first audio's K / V went with its sequence (the worker hears of the last one's end
    # with the next step)
    assert len(chunked.llm_engine.model_runner.cross.kv) == 1


def _requests(tok, waves) -> list[dict]:
    return [
        {"prompt_token_ids": long_prompt(tok, i), "multi_modal_data": {"audio": (w, SR)}}
        for i, w in enumerate(waves)
    ]


def same(got: list, want: list, abs_tol: float = 1e-4) -> None:
    """Each output's samples have the tokens and top logprobs of `want`'s (the tiny model's
    tokens repeat whatever the audio: its logprobs tell clips apart)."""
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g.outputs, w.outputs, strict=True):
            assert a.token_ids == b.token_ids
            for x, y in zip(a.logprobs, b.logprobs, strict=True):
                assert {t: p.logprob for t, p in x.items()} == pytest.approx(
                    {t: p.logprob for t, p in y.items()}, abs=abs_tol
                )


def test_engine_paths(tiny):
    waves = [clip(i, 0.5 + 0.4 * i) for i in range(4)]
    llm = engine(tiny, max_model_len=128)
    tok = llm.get_tokenizer()
    reqs = _requests(tok, waves)
    sampled = SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=8, logprobs=3)
    cross = llm.llm_engine.model_runner.cross
    before = cross.encoded
    alone = llm.generate([reqs[0]], sampled, use_tqdm=False)
    assert cross.encoded == before + 1  # the fork shares its parent's cross K / V
    both = llm.generate(reqs[:2], [sampled, greedy(3)], use_tqdm=False)[:1]
    same(both, alone)
    beams = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    beam_alone = llm.beam_search([{**reqs[1]}], beams)[0].sequences
    beam_both = llm.beam_search([{**reqs[0]}, {**reqs[1]}], beams)[1].sequences
    assert [s.tokens for s in beam_both] == [s.tokens for s in beam_alone]
    assert [s.cum_logprob for s in beam_both] == pytest.approx(
        [s.cum_logprob for s in beam_alone], abs=1e-4
    )
    assert len({tuple(s.tokens) for s in beam_alone}) == 3
    # preemption (recompute) in 12 blocks: the outputs of the roomy engine
    want = llm.generate(reqs, greedy(3, 20), use_tqdm=False)
    small = engine(tiny, max_model_len=128, num_gpu_blocks_override=12)
    same(small.generate(reqs, greedy(3, 20), use_tqdm=False), want)
    assert small.llm_engine.scheduler.num_preemptions > 0
    assert len(small.llm_engine.model_runner.cross.kv) <= 1
    # two seats: a request joins as another leaves (the step's audios change, not its size)
    params = [greedy(3, n) for n in (5, 12, 7, 9)]
    want = llm.generate(reqs, params, use_tqdm=False)
    seats = engine(tiny, max_model_len=128, max_num_seqs=2)
    same(seats.generate(reqs, params, use_tqdm=False), want)


def test_tensor_parallel(tiny):
    reqs = _requests(engine(tiny, max_model_len=128).get_tokenizer(), [clip(5, 2.0), clip(6, 1)])
    one = engine(tiny, max_model_len=128).generate(reqs, greedy(5, 6), use_tqdm=False)
    llm = engine(tiny, max_model_len=128, tensor_parallel_size=2)
    try:
        two = llm.generate(reqs, greedy(5, 6), use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    same(two, one)


def test_refused(tiny, tmp_path):
    llm = engine(tiny, max_model_len=128)
    tok = llm.get_tokenizer()
    one = (clip(0, 1.0), SR)
    cases = [
        ({"prompt": PREFIX}, r"multi_modal_data\['audio'\]: every Whisper prompt"),
        (PREFIX, r"multi_modal_data\['audio'\]"),
        ({"prompt": PREFIX, "multi_modal_data": {"audio": [one, one]}}, "one clip a prompt"),
        (
            {"prompt": PREFIX, "multi_modal_data": {"audio": (clip(0, 2.5), SR)}},
            r"multi_modal_data\['audio'\]: a clip of 2.50 s is longer than Whisper's 2 s",
        ),
        (
            {"encoder_prompt": {"prompt": "hi", "multi_modal_data": {"audio": one}}},
            "encoder_prompt: Whisper's encoder takes audio only",
        ),
        (
            {"prompt": PREFIX, "multi_modal_data": {"audio": one}, "mm_processor_kwargs": {"x": 1}},
            r"mm_processor_kwargs\['x'\]",
        ),
    ]
    for bad, match in cases:
        with pytest.raises(ValueError, match=match):
            llm.generate([bad], greedy(0), use_tqdm=False)
    with pytest.raises(ValueError, match="language='xx'"):
        whisper_prompt(tok, language="xx")
    with pytest.raises(ValueError, match="task must be"):
        whisper_prompt(tok, task="summarize")
    assert whisper_prompt(tok, "english", timestamps=True) == whisper_prompt(tok)[:3]
    host = llm.llm_engine.input_processor.audios
    assert host.transcription_prompt(None, "transcribe", "") == {
        "prompt_token_ids": whisper_prompt(tok)
    }
    asked = host.transcription_prompt("fr", "translate", "Hello")["prompt_token_ids"]
    prev = tok.convert_tokens_to_ids("<|startofprev|>")
    context = tok.encode(" Hello", add_special_tokens=False)
    assert asked == [prev, *context, *whisper_prompt(tok, "fr", "translate")]
    # a long context keeps its last max_target_positions // 2 - 1 tokens, as OpenAI's Whisper
    words = " ".join(f"w{i}" for i in range(300))
    context = tok.encode(" " + words, add_special_tokens=False)
    assert len(context) > 448
    cut = host.transcription_prompt("en", "transcribe", words)["prompt_token_ids"]
    assert cut == [prev, *context[-223:], *whisper_prompt(tok)]
    with pytest.raises(ValueError, match="task must be"):
        host.transcription_prompt("en", "summarize", "")
    out = llm.generate([{"prompt": PREFIX, "multi_modal_data": {"audio": one}}], greedy(0))[0]
    assert len(out.outputs[0].token_ids) == 8  # still serving
    for kw, match in [
        ({"max_model_len": 449}, r"max_model_len=449 exceeds .*max_target_positions=448"),
        ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "speculative"),
        ({"pipeline_parallel_size": 2}, "pipeline_parallel_size > 1"),
        ({"enable_prompt_embeds": True}, "enable_prompt_embeds"),
        ({"enable_lora": True}, "enable_lora is not supported for encoder-decoder"),
        ({"compilation_config": 1}, "compilation_config"),
        ({"tensor_parallel_size": 3}, r"divide the 4 attention heads of config.decoder_attention"),
    ]:
        with pytest.raises(ValueError, match=match):
            engine(tiny, **kw)
    # no feature extractor saved: nothing to serve (an audio LLM would serve its text model)
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in tiny.iterdir():
        if f.name not in ("preprocessor_config.json", "processor_config.json"):
            (bare / f.name).write_bytes(f.read_bytes())
    with pytest.raises(ValueError, match=r"preprocessor_config\.json"):
        engine(bare)


def test_language_detection(tiny, hf):
    """The host side's detection request (one greedy step over the language tokens) picks
    transformers' `detect_language` token, not the step's unrestricted argmax."""
    llm = engine(tiny, max_model_len=128)
    host = llm.llm_engine.input_processor.audios
    prompt, languages = host.language_detection()
    tok = llm.get_tokenizer()
    assert languages == {tok.convert_tokens_to_ids(f"<|{c}|>"): c for c in LANGS}
    assert prompt == {"prompt_token_ids": [hf.config.decoder_start_token_id]}
    hf.generation_config.lang_to_id = {f"<|{c}|>": i for i, c in languages.items()}
    params = SamplingParams(temperature=0, max_tokens=1, allowed_token_ids=sorted(languages))
    waves = [clip(s, 0.6 + 0.5 * s) for s in range(3)]
    reqs = [{**prompt, "multi_modal_data": {"audio": (w, SR)}} for w in waves]
    free = llm.generate(reqs, greedy(0, 1), use_tqdm=False)
    for w, out, unmasked in zip(waves, llm.generate(reqs, params, use_tqdm=False), free):
        want = hf.detect_language(features(tiny, w)).item()
        assert out.outputs[0].token_ids == [want]
        assert unmasked.outputs[0].token_ids[0] not in languages  # the restriction decides


def test_timestamp_segments(tiny):
    """`timestamp_segments` splits ids as transformers' WhisperTokenizer.decode(...,
    output_offsets=True) does on [<|0.00|>, *ids]; text after the last timestamp (or with
    none) is a segment to the window's end, which transformers drops."""
    wt = transformers.WhisperTokenizer.from_pretrained(tiny)
    llm = engine(tiny, max_model_len=128)
    host = llm.llm_engine.input_processor.audios
    begin = wt.convert_tokens_to_ids("<|0.00|>")
    assert begin == wt.convert_tokens_to_ids("<|notimestamps|>") + 1

    def t(s: float) -> int:
        return wt.convert_tokens_to_ids(f"<|{s:.2f}|>")

    a, b, c = (wt.encode(w, add_special_tokens=False) for w in (" hello", " the cat", " ran"))
    eos = wt.eos_token_id
    cases = [  # (generated ids, the segments transformers drops after its own)
        ([*a, t(0.4), t(0.4), *b, t(1.0)], 0),
        ([*a, t(0.5), t(0.6), *b, *c, t(1.2), t(1.2), *c, t(1.9), eos], 0),
        ([*a, t(0.3), *b, t(0.5), t(0.5), *c, t(1.0)], 0),  # a lone timestamp inside
        ([*a, *b], 1),
        ([*a, t(0.4), t(0.6), *b], 1),
        ([*a, t(0.4), *b], 1),
    ]
    for ids, extra in cases:
        got = host.timestamp_segments(ids, 1.5)
        want = wt.decode([begin, *ids], output_offsets=True)["offsets"]
        assert len(got) == len(want) + extra
        for g, w in zip(got, want):
            assert (g.start, g.end) == pytest.approx(w["timestamp"])
            assert g.text == w["text"]
        gen = ids[:-1] if ids[-1] == eos else ids
        for g in got:  # its ids: the sampled ids it names, after the forced <|0.00|> if first
            n = g.sampled[1] - g.sampled[0]
            assert g.tokens[len(g.tokens) - n :] == gen[g.sampled[0] : g.sampled[1]]
            assert g.tokens[: len(g.tokens) - n] in ([], [begin])
    (bare,) = host.timestamp_segments([*a, *b], 1.5)
    assert (bare.start, bare.end, bare.text, bare.tokens) == (
        0.0,
        1.5,
        wt.decode(a + b),
        [begin, *a, *b],
    )
    head, tail = host.timestamp_segments([*a, t(0.4), t(0.6), *b, eos], 1.5)
    assert head.tokens == [begin, *a, t(0.4)] and head.sampled == (0, len(a) + 1)
    assert (tail.start, tail.end, tail.tokens) == (0.6, 1.5, [t(0.6), *b])
    assert tail.sampled == (len(a) + 1, len(a) + 2 + len(b))
    # the prompt: transformers' prefix with timestamps predicted, then <|0.00|> forced
    wt.set_prefix_tokens(language="en", task="translate", predict_timestamps=True)
    ts = host.transcription_prompt("en", "translate", "", timestamps=True)["prompt_token_ids"]
    assert ts == [*wt.prefix_tokens, begin]
