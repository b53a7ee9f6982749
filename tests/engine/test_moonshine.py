"""Moonshine (models/moonshine.py, multimodal/moonshine.py / moonshine_encoder.py) against HF.

A tiny random MoonshineForConditionalGeneration (hidden 64, 4 heads of 16 dims, 14 of them
rotary) saved with a Wav2Vec2FeatureExtractor (Moonshine's: raw 16 kHz samples) and a tiny
tokenizer. `LLM.generate` with clips of different lengths (no fixed window: each clip's own
frames) must give HF `generate`'s greedy tokens and top-5 logprobs (1e-3, float32) for the
decoder start token alone (both of vLLM's prompt forms), batched; then a long decoder prompt
chunked through prefill with the prefix cache on, preemption in a tiny KV cache, the
transcription prompt, and bad input and configurations refused by name.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from audio_checks import check_transcription_refusals
from audio_checks import tone_clip as clip
from hf_reference import Greedy, assert_matches, hf_generate_greedy
from hf_reference import edited_checkpoint as edited
from image_checks import greedy

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.moonshine")

from paged_engine import LLM  # noqa: E402
from paged_engine.testing import (  # noqa: E402
    _COMMON,
    BOS_ID,
    TINY_VOCAB_SIZE,
    _save_random,
    build_tiny_tokenizer,
)

SR = 16000
ARCH = "MoonshineForConditionalGeneration"


def write_tiny_moonshine(path: Path, seed: int = 3) -> Path:
    """A tiny random Moonshine checkpoint, its feature extractor and tokenizer at `path`."""
    tokenizer = build_tiny_tokenizer(TINY_VOCAB_SIZE, 0)
    kw = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=64,
        encoder_num_hidden_layers=2,
        decoder_num_hidden_layers=2,
        encoder_num_attention_heads=4,
        decoder_num_attention_heads=4,
        max_position_embeddings=96,
        decoder_start_token_id=BOS_ID,
        architectures=[ARCH],
        **_COMMON,
    )
    config = transformers.MoonshineConfig(**kw)
    _save_random(transformers.MoonshineForConditionalGeneration, config, seed, path)
    tokenizer.save_pretrained(path)
    transformers.Wav2Vec2FeatureExtractor(
        feature_size=1, sampling_rate=SR, padding_value=0.0, do_normalize=False
    ).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_moonshine(tmp_path_factory.mktemp("moonshine"))


@pytest.fixture(scope="module")
def hf(tiny):
    return transformers.MoonshineForConditionalGeneration.from_pretrained(tiny).float().eval()


def hf_generate(model, wave: np.ndarray, prompt: list[int] | None = None, n: int = 8) -> Greedy:
    """HF `generate`'s greedy continuation (no end-of-text stop), with top-5 logprobs."""
    kw = {} if prompt is None else {"decoder_input_ids": torch.tensor([prompt])}
    return hf_generate_greedy(model, n, input_values=torch.from_numpy(wave)[None], **kw)


def engine(path: Path, **kw) -> LLM:
    return LLM(model=str(path), dtype="float32", block_size=16, **kw)


def test_matches_hf_batched(tiny, hf):
    llm = engine(tiny)
    start = [BOS_ID]
    waves = [clip(1, 0.9), clip(2, 0.35), clip(3, 1.6)]  # 30, 11 and 55 encoder frames
    refs = [hf_generate(hf, w) for w in waves]
    assert refs[0].tops != refs[1].tops  # the audio decides
    prompts = [
        {"prompt": "", "multi_modal_data": {"audio": (waves[0], SR)}},
        {"encoder_prompt": {"prompt": "", "multi_modal_data": {"audio": (waves[1], SR)}}},
        {"prompt_token_ids": start, "multi_modal_data": {"audio": waves[2]}},
    ]
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        assert out.prompt_token_ids == start
        assert_matches(f"moonshine clip {i}", out, ref)
    cross = llm.llm_engine.model_runner.cross
    assert cross.encoded == 3
    # the transcription route's prompt is the start token alone
    host = llm.llm_engine.input_processor.audios
    assert host.transcription_prompt(None, "transcribe", "") == {"prompt_token_ids": start}
    assert host.transcription_window == 30 * SR


def test_chunked_prefix_cache_and_preemption(tiny, hf):
    waves = [clip(4, 0.7), clip(5, 1.1)]
    ids = [BOS_ID, *range(10, 40)]  # 31 tokens: chunked at 16 a step
    refs = [hf_generate(hf, w, ids, n=6) for w in waves]
    chunked = engine(tiny, max_num_batched_tokens=16, enable_chunked_prefill=True)
    for w, ref in zip(waves, refs, strict=True):  # one after the other: no shared blocks
        req = {"prompt_token_ids": ids, "multi_modal_data": {"audio": (w, SR)}}
        out = chunked.generate([req], greedy(n=6), use_tqdm=False)[0]
        assert_matches("moonshine chunked", out, ref)
    # a KV cache of 5 blocks: the two sequences (3 blocks each at the end) preempt each other
    small = engine(tiny, num_gpu_blocks_override=5, max_model_len=48)
    reqs = [{"prompt_token_ids": ids, "multi_modal_data": {"audio": (w, SR)}} for w in waves]
    outs = small.generate(reqs, greedy(n=6), use_tqdm=False)
    for out, ref in zip(outs, refs, strict=True):
        assert_matches("moonshine preempted", out, ref)
    assert small.llm_engine.model_runner.cross.encoded > 2  # a preempted clip is encoded again


def test_tensor_parallel(tiny, hf):
    """TP=2: each rank's heads and its share of both halves of the gated fc1."""
    waves = [clip(6, 0.8), clip(7, 0.5)]
    refs = [hf_generate(hf, w, n=6) for w in waves]
    llm = engine(tiny, max_model_len=64, tensor_parallel_size=2)
    try:
        reqs = [{"prompt": "", "multi_modal_data": {"audio": (w, SR)}} for w in waves]
        outs = llm.generate(reqs, greedy(n=6), use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    for out, ref in zip(outs, refs, strict=True):
        assert_matches("moonshine tp=2", out, ref)


def test_refused(tiny, tmp_path):
    llm = engine(tiny, max_model_len=64)
    check_transcription_refusals(llm, "Moonshine", "0.056")
    prompts = [  # the shared encoder / decoder prompt code names the model asked for
        ({"prompt": ""}, r"every Moonshine prompt needs an audio clip"),
        ("words", r"a Moonshine prompt is a dict with the clip"),
        (
            {"encoder_prompt": {"prompt": "hi", "multi_modal_data": {"audio": clip(1, 0.5)}}},
            r"encoder_prompt: Moonshine's encoder takes audio only",
        ),
    ]
    for prompt, why in prompts:
        with pytest.raises(ValueError, match=why):
            llm.generate([prompt], greedy())
    # the engine still serves
    out = llm.generate([{"prompt": "", "multi_modal_data": {"audio": clip(1, 0.9)}}], greedy())
    assert len(out[0].outputs[0].token_ids) == 8
    with pytest.raises(ValueError, match="max_model_len"):
        engine(tiny, max_model_len=97)
    # (transformers' own models rewrite these to the encoder's counts when built: a config
    # edited by hand)
    with pytest.raises(ValueError, match="decoder_num_key_value_heads"):
        engine(edited(tiny, tmp_path / "gqa", decoder_num_key_value_heads=2))
