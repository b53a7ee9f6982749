"""Cohere ASR (models/cohere_asr.py, multimodal/cohere_asr.py) against HF.

A tiny random CohereAsrForConditionalGeneration (Parakeet encoder: hidden 32, one conformer
block, 8x subsampling of 16 mels; decoder: hidden 32, 2 layers of 4 heads) saved with a
CohereAsrFeatureExtractor and a tiny tokenizer holding the ten control tokens. `LLM.generate`
with clips of different lengths must give HF `generate`'s greedy tokens and top-5 logprobs
(1e-3, float32) from the transcription prompt (transformers' `get_decoder_prompt_ids`),
batched, in both of vLLM's prompt forms; then the transcription prompt, and bad input and
configurations refused by name.
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
pytest.importorskip("transformers.models.cohere_asr")

from paged_engine import LLM  # noqa: E402
from paged_engine.testing import _COMMON, TINY_VOCAB_SIZE, _save_random, build_tiny_tokenizer  # noqa: E402

SR = 16000
ARCH = "CohereAsrForConditionalGeneration"
# the control tokens of transformers' CohereAsrProcessor.get_decoder_prompt_ids for en / fr
CONTROL = ["▁", "<|startofcontext|>", "<|startoftranscript|>", "<|emo:undefined|>", "<|en|>"]
CONTROL += ["<|fr|>", "<|pnc|>", "<|noitn|>", "<|notimestamp|>", "<|nodiarize|>"]


def write_tiny_cohere_asr(path: Path, seed: int = 5) -> Path:
    """A tiny random Cohere ASR checkpoint, its feature extractor and tokenizer at `path`."""
    tokenizer = build_tiny_tokenizer(TINY_VOCAB_SIZE, 0)
    tokenizer.add_tokens(CONTROL, special_tokens=True)
    encoder = dict(
        model_type="parakeet_encoder",
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        conv_kernel_size=5,
        subsampling_factor=8,
        subsampling_conv_channels=8,
        num_mel_bins=16,
    )
    config = transformers.CohereAsrConfig(
        encoder_config=encoder,
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        # the prompt's first token, so HF `generate` prepends no start token (vLLM adds none)
        decoder_start_token_id=tokenizer.convert_tokens_to_ids("▁"),
        architectures=[ARCH],
        **_COMMON,
    )
    _save_random(transformers.CohereAsrForConditionalGeneration, config, seed, path)
    tokenizer.save_pretrained(path)
    transformers.CohereAsrFeatureExtractor(feature_size=16).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_cohere_asr(tmp_path_factory.mktemp("cohere_asr"))


@pytest.fixture(scope="module")
def hf(tiny):
    model = transformers.CohereAsrForConditionalGeneration.from_pretrained(tiny).float().eval()
    fe = transformers.CohereAsrFeatureExtractor.from_pretrained(tiny)
    tok = transformers.AutoTokenizer.from_pretrained(tiny)
    return model, fe, tok


def hf_generate(hf, wave: np.ndarray, prompt: list[int], n: int = 8) -> Greedy:
    """HF `generate`'s greedy continuation (no end-of-text stop), with top-5 logprobs."""
    model, fe, _ = hf
    feats = fe(wave, sampling_rate=SR, return_tensors="pt", return_attention_mask=True)
    return hf_generate_greedy(
        model,
        n,
        input_features=feats["input_features"],
        attention_mask=feats["attention_mask"],
        decoder_input_ids=torch.tensor([prompt]),
    )


def ids(hf, language: str) -> list[int]:
    """transformers' decoder prompt for `language` (the processor's own token list)."""
    _, fe, tok = hf
    processor = transformers.CohereAsrProcessor(feature_extractor=fe, tokenizer=tok)
    return processor.get_decoder_prompt_ids(language)


def engine(path: Path, **kw) -> LLM:
    return LLM(model=str(path), dtype="float32", block_size=16, **kw)


def test_matches_hf_batched(tiny, hf):
    llm = engine(tiny)
    en, fr = ids(hf, "en"), ids(hf, "fr")
    waves = [clip(1, 0.9), clip(2, 0.35), clip(3, 1.6)]  # 12, 5 and 20 encoder rows
    prompts_ids = [en, fr, en]
    refs = [hf_generate(hf, w, p) for w, p in zip(waves, prompts_ids, strict=True)]
    assert refs[0].tops != refs[2].tops  # the audio decides
    prompts = [
        {"prompt": "", "multi_modal_data": {"audio": (waves[0], SR)}},  # empty: "en"
        {"prompt_token_ids": fr, "multi_modal_data": {"audio": waves[1]}},
        {"encoder_prompt": {"prompt": "", "multi_modal_data": {"audio": (waves[2], SR)}}},
    ]
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    for i, (out, ref, p) in enumerate(zip(outs, refs, prompts_ids, strict=True)):
        assert out.prompt_token_ids == p
        assert_matches(f"cohere_asr clip {i}", out, ref)
    assert llm.llm_engine.model_runner.cross.encoded == 3
    host = llm.llm_engine.input_processor.audios
    assert host.transcription_prompt("fr", "transcribe", "") == {"prompt_token_ids": fr}
    assert host.transcription_prompt(None, "transcribe", "") == {"prompt_token_ids": en}
    assert host.transcription_window == 30 * SR


def test_refused(tiny, tmp_path):
    llm = engine(tiny, max_model_len=48)
    check_transcription_refusals(llm, "Cohere ASR", "0.050")
    host = llm.llm_engine.input_processor.audios
    with pytest.raises(ValueError, match="language: 'xx'"):
        host.transcription_prompt("xx", "transcribe", "")
    with pytest.raises(ValueError, match=r"language: the tokenizer lacks .*<\|de\|>"):
        host.transcription_prompt("de", "transcribe", "")
    out = llm.generate([{"prompt": "", "multi_modal_data": {"audio": clip(1, 0.9)}}], greedy())
    assert len(out[0].outputs[0].token_ids) == 8  # the engine still serves
    with pytest.raises(ValueError, match="max_model_len"):
        engine(tiny, max_model_len=65)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        engine(edited(tiny, tmp_path / "gqa", num_key_value_heads=2))
    with pytest.raises(ValueError, match="transf_decoder"):
        engine(
            edited(tiny, tmp_path / "nemo", transf_decoder={"config_dict": {"hidden_size": 1024}})
        )
