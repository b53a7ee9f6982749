"""Audio through Voxtral (multimodal/voxtral.py) against HF transformers.

A tiny random VoxtralForConditionalGeneration (a 2-layer Whisper encoder over 16 mel bins,
windows of 4 s = 400 frames, max_source_positions 200 -> 50 rows a window after the 4-row
stack) with a WhisperFeatureExtractor. HF's VoxtralProcessor builds its prompts with
mistral_common's tokenizer, which is not installed here: the reference ids are built as
mistral_common's instruct encoding writes them ([BOS][INST][BEGIN_AUDIO][AUDIO] x n text
[/INST], n = ceil(frames / 8) of the padded clip), with a byte-level BPE tokenizer holding those
special tokens; the features are VoxtralProcessor's own (`_retrieve_input_features`) and the
greedy tokens and top-5 logprobs HF `generate`'s (1e-3, float32).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from audio_checks import check_audio_paths, noise_clip
from hf_reference import assert_matches, hf_greedy
from image_checks import engine, greedy

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.voxtral")

from paged_engine.testing import (  # noqa: E402
    _COMMON,
    _LLAMA_LIKE,
    TINY_VOCAB_SIZE,
    _save_random,
    build_tiny_tokenizer,
)

MAX_TOKENS = 8
MARKS = ("[INST]", "[/INST]", "[BEGIN_AUDIO]", "[AUDIO]", "[TRANSCRIBE]")
CHUNK = 4  # seconds a window holds
ROWS = 50  # tokens a window gives: 400 frames / 8


def write_tiny_voxtral(path: Path, seed: int = 0) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(TINY_VOCAB_SIZE, seed)
    tokenizer.add_special_tokens({"additional_special_tokens": list(MARKS)})
    text = {**_LLAMA_LIKE, "model_type": "llama", "vocab_size": len(tokenizer), **_COMMON}
    text |= {"head_dim": 16}
    audio = {"model_type": "voxtral_encoder", "hidden_size": 16, "intermediate_size": 64}
    audio |= {"num_hidden_layers": 2, "num_attention_heads": 2, "num_mel_bins": 16}
    audio |= {"max_source_positions": 200}
    config = transformers.VoxtralConfig(
        text_config=text,
        audio_config=audio,
        audio_token_id=tokenizer.convert_tokens_to_ids("[AUDIO]"),
        **_COMMON,
    )
    _save_random(transformers.VoxtralForConditionalGeneration, config, seed, path)
    transformers.WhisperFeatureExtractor(feature_size=16, chunk_length=CHUNK).save_pretrained(path)
    tokenizer.save_pretrained(path)
    transformers.GenerationConfig(**_COMMON).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_voxtral(tmp_path_factory.mktemp("voxtral"))


class _HF:
    def __init__(self, path: Path) -> None:
        self.model = transformers.VoxtralForConditionalGeneration.from_pretrained(
            path, dtype=torch.float32
        ).eval()
        self.model.generation_config.eos_token_id = None
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        extractor = transformers.WhisperFeatureExtractor.from_pretrained(path)
        self.processor = transformers.VoxtralProcessor(extractor, tokenizer)
        self.tok = tokenizer
        self.id = tokenizer.convert_tokens_to_ids

    def user_turn(self, parts: list, n: list[int]) -> list[int]:
        """mistral_common's [BOS][INST] chunks [/INST]: a str part is text, an int part the
        index of a clip ([BEGIN_AUDIO] and its n[i] [AUDIO])."""
        ids = [self.tok.bos_token_id, self.id("[INST]")]
        for part in parts:
            if isinstance(part, str):
                ids += self.tok.encode(part, add_special_tokens=False)
            else:
                ids += [self.id("[BEGIN_AUDIO]")] + [self.id("[AUDIO]")] * n[part]
        return [*ids, self.id("[/INST]")]

    def greedy(self, ids: list[int], clips: list):
        if not clips:
            return hf_greedy(self.model, ids, MAX_TOKENS, 5)
        features = self.processor._retrieve_input_features(
            clips,
            max_source_positions=100 * CHUNK,
            sampling_rate=16_000,
            padding=True,
            truncation=False,
            pad_to_multiple_of=16_000 * CHUNK,
            return_tensors="pt",
        )
        return hf_greedy(self.model, ids, MAX_TOKENS, 5, input_features=features)


def tokens(clip: np.ndarray) -> int:
    """mistral_common's [AUDIO] count: ceil(frames / 8) of the clip padded to the window."""
    padded = math.ceil(clip.size / (16_000 * CHUNK)) * 16_000 * CHUNK
    return math.ceil(padded // 160 / 8)


def test_audio_matches_hf(tiny):
    """One clip, two clips of different lengths (1.3 s and 3.9 s), a clip of three windows and
    text alone: the engine's ids from a prompt with one [AUDIO] per clip (its [BEGIN_AUDIO]
    written or left out) are mistral_common's, the tokens and logprobs HF's."""
    hf = _HF(tiny)
    clip1, clip2, clip3, long = (
        noise_clip(1, 1.0),
        noise_clip(2, 1.3),
        noise_clip(3, 3.9),
        noise_clip(4, 2.5 * CHUNK),
    )
    cases = [
        (["What is it?", 0], [clip1]),
        ([0, " then ", 1, " Which?"], [clip2, clip3]),
        ([0, "Describe."], [long]),
        (["Say something about the sea."], []),
    ]
    refs = []
    prompts = []
    for parts, clips in cases:
        ids = hf.user_turn(parts, [tokens(c) for c in clips])
        refs.append((ids, hf.greedy(ids, clips)))
        ours = hf.user_turn(parts, [1] * len(clips))  # one [AUDIO] a clip
        if len(clips) == 1:  # the engine puts [BEGIN_AUDIO] where the prompt lacks it
            ours.remove(hf.id("[BEGIN_AUDIO]"))
        prompts.append({"prompt_token_ids": ours, "multi_modal_data": {"audio": clips}})
    prompts[-1] = {"prompt_token_ids": prompts[-1]["prompt_token_ids"]}
    assert tokens(clip1) == ROWS and tokens(long) == 3 * ROWS
    llm = engine(tiny)
    for (ids, ref), out in zip(refs, llm.generate(prompts, greedy(), use_tqdm=False), strict=True):
        assert out.prompt_token_ids == ids
        assert_matches("voxtral", out, ref)
    ahead = [
        {"prompt_token_ids": ids, "multi_modal_data": {"audio": clips}}
        for (ids, _), (_, clips) in zip(refs, cases, strict=True)
        if clips
    ]
    outs = llm.generate(ahead, greedy(), use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [ids for ids, _ in refs[:3]]
    assert [o.outputs[0].token_ids for o in outs] == [ref.tokens for _, ref in refs[:3]]


def test_transcription_prompt(tiny):
    """mistral_common's instruct transcription request ([BOS][INST][BEGIN_AUDIO][AUDIO] x n
    [/INST] lang:xx [TRANSCRIBE]) and HF's tokens on it; translation and a context prompt are
    refused by name."""
    hf = _HF(tiny)
    llm = engine(tiny)
    host = llm.llm_engine.input_processor.audios
    clip = noise_clip(6, 1.6)
    for language in (None, "en"):
        prompt = host.transcription_prompt(language, "transcribe", "")
        lang = hf.tok.encode(f"lang:{language}", add_special_tokens=False) if language else []
        ids = [*hf.user_turn([0], [tokens(clip)]), *lang, hf.id("[TRANSCRIBE]")]
        out = llm.generate([{**prompt, "multi_modal_data": {"audio": clip}}], greedy())[0]
        assert out.prompt_token_ids == ids
        assert_matches("voxtral", out, hf.greedy(ids, [clip]))
    with pytest.raises(ValueError, match=r"^task"):
        host.transcription_prompt(None, "translate", "")
    with pytest.raises(ValueError, match=r"^prompt"):
        host.transcription_prompt(None, "transcribe", "Names: Ada")


def test_engine_paths_match_the_plain_run(tiny):
    text = "[INST][BEGIN_AUDIO][AUDIO] then [BEGIN_AUDIO][AUDIO] Which?[/INST]"
    prompts = [
        {"prompt": "[INST][AUDIO]Hi[/INST]", "multi_modal_data": {"audio": noise_clip(10, 0.6)}},
        {"prompt": "[INST][AUDIO]Hi[/INST]", "multi_modal_data": {"audio": noise_clip(11, 1.1)}},
        {"prompt": text, "multi_modal_data": {"audio": [noise_clip(12, 0.4), noise_clip(13, 5)]}},
    ]
    check_audio_paths(tiny, prompts, text)


def test_bad_input_is_refused_by_name(tiny):
    llm = engine(tiny)
    prompt = "[INST][AUDIO]Hi[/INST]"
    clip = noise_clip(17, 0.5)
    cases = [
        ({"audio": [clip, clip]}, r"2 audio\(s\) but the prompt has 1"),
        ({"audio": np.zeros((2, 3, 4))}, "1-D"),
        ({"audio": (clip, 0)}, "sampling rate"),
    ]
    for data, match in cases:
        with pytest.raises(ValueError, match=match):
            llm.generate([{"prompt": prompt, "multi_modal_data": data}], greedy(0), use_tqdm=False)
    out = llm.generate([{"prompt": prompt, "multi_modal_data": {"audio": clip}}], greedy(0))[0]
    assert len(out.outputs[0].token_ids) == 8
