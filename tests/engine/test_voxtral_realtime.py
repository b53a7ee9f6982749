"""Voxtral Realtime offline (multimodal/voxtral_realtime.py, models/voxtral_realtime.py)
against HF transformers.

A tiny random VoxtralRealtimeForConditionalGeneration (a 2-layer causal tower over 16 mel bins
with an attention window of 12 rows, a 2-layer Mistral decoder with a window of 20) and a
VoxtralRealtimeFeatureExtractor. HF's processor needs mistral_common's tekken tokenizer; the
prompt here is written as its OFFLINE request writes one ([BOS] then [STREAMING_PAD] x k, a
stand-in id) and the clip is given already padded, as that request pads it. HF `generate`
with input_features runs its streaming encoder step by step (the tower's KV cache, 4 conv
rows a position); the engine encodes the clip at once and adds row t to position t. Greedy
tokens identical, top-5 logprobs within 1e-3 (float32), up to the clip's last row.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from audio_checks import noise_clip
from hf_reference import assert_matches, hf_greedy
from image_checks import engine, greedy

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.voxtral_realtime")

from paged_engine.testing import (  # noqa: E402
    _COMMON,
    _LLAMA_LIKE,
    TINY_VOCAB_SIZE,
    _save_random,
    build_tiny_tokenizer,
)

PAD = 7  # stands for [STREAMING_PAD]
DELAY = 3  # default_num_delay_tokens: folded into the decoder's norms


def write_tiny_voxtral_realtime(path: Path, seed: int = 0) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(TINY_VOCAB_SIZE, seed)
    text = {**_LLAMA_LIKE, "model_type": "voxtral_realtime_text", **_COMMON}
    text |= {"vocab_size": len(tokenizer), "head_dim": 16, "sliding_window": 20}
    text |= {"tie_word_embeddings": True}
    audio = {"model_type": "voxtral_realtime_encoder", "hidden_size": 16}
    audio |= {"intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2}
    audio |= {"head_dim": 8, "num_mel_bins": 16, "sliding_window": 12}
    config = transformers.VoxtralRealtimeConfig(
        text_config=text, audio_config=audio, default_num_delay_tokens=DELAY, **_COMMON
    )
    _save_random(transformers.VoxtralRealtimeForConditionalGeneration, config, seed, path)
    transformers.VoxtralRealtimeFeatureExtractor(feature_size=16).save_pretrained(path)
    tokenizer.save_pretrained(path)
    transformers.GenerationConfig(**_COMMON).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_voxtral_realtime(tmp_path_factory.mktemp("voxtral_realtime"))


def _hf(path: Path):
    model = transformers.VoxtralRealtimeForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32
    ).eval()
    model.generation_config.eos_token_id = None
    extractor = transformers.VoxtralRealtimeFeatureExtractor.from_pretrained(path)
    return model, extractor


def test_offline_matches_hf(tiny):
    """Clips of 24 and 17 text positions of audio, prompts of 6, 10 and 17 tokens: the engine
    generates HF's tokens to the clip's end, its logprobs HF's. The last two share their
    prompt (a full KV block) but not their clip: the prefix cache keys blocks by the clip too.
    Then all at once with async scheduling (decode rows' audio added to device-side ids)."""
    model, extractor = _hf(tiny)
    first = noise_clip(1, 1.92)
    cases = [(first, 5), (noise_clip(2, 1.36), 9), (noise_clip(3, 1.92), 16), (first, 16)]
    refs, prompts = [], []
    for clip, k in cases:
        features = extractor(clip, sampling_rate=16_000, return_tensors="pt").input_features
        rows = features.shape[-1] // 8
        ids = [_COMMON["bos_token_id"]] + [PAD] * k
        ref = hf_greedy(
            model, ids, rows - len(ids), 5, input_features=features, num_delay_tokens=DELAY
        )
        assert len(ref.tokens) == rows - len(ids) > 5
        refs.append(ref)
        prompts.append({"prompt_token_ids": ids, "multi_modal_data": {"audio": clip}})
    llm = engine(tiny)
    for prompt, ref in zip(prompts, refs, strict=True):
        (out,) = llm.generate([prompt], greedy(n=len(ref.tokens)), use_tqdm=False)
        assert_matches("voxtral_realtime", out, ref)
    # one batch: each sequence adds its own clip's rows
    llm = engine(tiny, async_scheduling=True)
    outs = llm.generate(prompts, greedy(n=min(len(r.tokens) for r in refs)), use_tqdm=False)
    for out, ref in zip(outs, refs, strict=True):
        assert out.outputs[0].token_ids == ref.tokens[: len(out.outputs[0].token_ids)]


def test_streaming_and_bad_input_are_refused_by_name(tiny):
    llm = engine(tiny)
    clip = noise_clip(3, 0.5)  # 6 positions of audio
    ids = [_COMMON["bos_token_id"], PAD]
    with pytest.raises(ValueError, match="is_streaming"):
        llm.generate(
            [
                {
                    "prompt_token_ids": ids,
                    "multi_modal_data": {"audio": clip},
                    "mm_processor_kwargs": {"is_streaming": True},
                }
            ],
            greedy(),
            use_tqdm=False,
        )
    with pytest.raises(ValueError, match="exactly one clip"):
        llm.generate(
            [{"prompt_token_ids": ids, "multi_modal_data": {"audio": [clip, clip]}}],
            greedy(),
            use_tqdm=False,
        )
    with pytest.raises(ValueError, match="fewer than the prompt's 10 tokens"):
        llm.generate(
            [{"prompt_token_ids": ids * 5, "multi_modal_data": {"audio": clip}}],
            greedy(),
            use_tqdm=False,
        )
    # the engine still serves after the refusals
    (out,) = llm.generate(
        [{"prompt_token_ids": ids, "multi_modal_data": {"audio": clip}}],
        greedy(n=3),
        use_tqdm=False,
    )
    assert len(out.outputs[0].token_ids) == 3
