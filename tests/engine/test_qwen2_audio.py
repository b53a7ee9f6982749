"""Audio through Qwen2-Audio (multimodal/qwen2_audio.py) against HF transformers.

A tiny random Qwen2AudioForConditionalGeneration (a 2-layer Whisper encoder over 16 mel bins, a
3-second window: 300 feature frames, max_source_positions 150) with its WhisperFeatureExtractor.
`LLM.generate` with `multi_modal_data={"audio": ...}` must give Qwen2AudioProcessor's prompt
ids (<|AUDIO|> expanded to the clip's pooled rows) and HF `generate`'s greedy tokens and top-5
logprobs (1e-3, float32), clips of different lengths batched (the encoder masks each one's
padding); then chunks through clips, prefix caching, clips processed ahead, TP=2, resampling,
the server's chat path with an input_audio part, and bad input refused by name.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from audio_checks import (
    check_chat_input_audio,
    check_matches_hf,
    check_one_two_paths,
    held,
    noise_clip,
    wav_base64,
)
from hf_reference import hf_greedy
from image_checks import check_tensor_parallel, engine, greedy

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.qwen2_audio")

from paged_engine.testing import (  # noqa: E402
    _COMMON,
    _LLAMA_LIKE,
    TINY_VOCAB_SIZE,
    _save_random,
    build_tiny_tokenizer,
)

MAX_TOKENS = 8
MARKS = ("<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>")
TEMPLATE = (
    "{% set n = namespace(v=0) %}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'audio' %}{% set n.v = n.v + 1 %}"
    "Audio {{ n.v }}: <|audio_bos|><|AUDIO|><|audio_eos|>\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CLIP = "<|audio_bos|><|AUDIO|><|audio_eos|>"
ONE = f"<|im_start|>user\nAudio 1: {CLIP}\nWhat is that sound?<|im_end|>\n<|im_start|>assistant\n"
TWO = f"<|im_start|>user\n{CLIP} then {CLIP} Which is louder?<|im_end|>\n<|im_start|>assistant\n"
TEXT = "<|im_start|>user\nSay something about the sea.<|im_end|>\n<|im_start|>assistant\n"


def write_tiny_qwen2_audio(path: Path, seed: int = 0) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(TINY_VOCAB_SIZE, seed)
    tokenizer.add_special_tokens({"additional_special_tokens": list(MARKS)})
    tokenizer.chat_template = TEMPLATE
    audio_id = tokenizer.convert_tokens_to_ids("<|AUDIO|>")
    text = {**_LLAMA_LIKE, "model_type": "qwen2", "vocab_size": len(tokenizer), **_COMMON}
    audio = {"d_model": 16, "encoder_layers": 2, "encoder_attention_heads": 2}
    audio |= {"encoder_ffn_dim": 32, "num_mel_bins": 16, "max_source_positions": 150}
    config = transformers.Qwen2AudioConfig(
        text_config=text, audio_config=audio, audio_token_index=audio_id, **_COMMON
    )
    _save_random(transformers.Qwen2AudioForConditionalGeneration, config, seed, path)
    extractor = transformers.WhisperFeatureExtractor(feature_size=16, chunk_length=3)
    transformers.Qwen2AudioProcessor(extractor, tokenizer, chat_template=TEMPLATE).save_pretrained(
        path
    )
    tokenizer.save_pretrained(path)
    transformers.GenerationConfig(**_COMMON).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_qwen2_audio(tmp_path_factory.mktemp("qwen2_audio"))


class _HF:
    def __init__(self, path: Path) -> None:
        cls = transformers.Qwen2AudioForConditionalGeneration
        self.model = cls.from_pretrained(path, dtype=torch.float32).eval()
        self.model.generation_config.eos_token_id = None
        self.processor = transformers.Qwen2AudioProcessor.from_pretrained(path)

    def greedy(self, text: str, clips: list):
        if not clips:
            ids = self.processor.tokenizer.encode(text, add_special_tokens=False)
            return ids, hf_greedy(self.model, ids, MAX_TOKENS, 5)
        out = self.processor(text=text, audio=clips, sampling_rate=16_000, return_tensors="pt")
        ids = out["input_ids"][0].tolist()
        extra = {k: out[k] for k in ("input_features", "feature_attention_mask")}
        return ids, hf_greedy(self.model, ids, MAX_TOKENS, 5, **extra)


def test_audio_matches_hf(tiny):
    """One clip, text alone, two clips of different lengths (1.3 s and 2.9 s: the longer
    nearly fills the window) and a clip over the window (cut to it, as HF's extractor cuts it):
    HF's prompt ids, greedy tokens and top-5 logprobs; the expanded ids taken as they are."""
    hf = _HF(tiny)
    cases = [
        (ONE, [noise_clip(1, 1.0)]),
        (TEXT, []),
        (TWO, [noise_clip(2, 1.3), noise_clip(3, 2.9)]),
        (ONE, [noise_clip(4, 4.5)]),
    ]
    refs = [hf.greedy(t, clips) for t, clips in cases]
    llm = engine(tiny)
    check_matches_hf(llm, cases, refs, "qwen2_audio")
    # 1 s = 100 frames -> 50 after conv2 -> 25 pooled rows
    assert refs[0][0].count(llm.get_tokenizer().convert_tokens_to_ids("<|AUDIO|>")) == 25


def test_sampling_rates_and_forms(tiny):
    """A clip at 8 kHz as (waveform, 8000) is resampled to 16 kHz; an int16 waveform, a torch
    tensor and a stereo [2, n] array are the float mono clip."""
    llm = engine(tiny)
    clip = noise_clip(5, 1.0)
    base = llm.generate([{"prompt": ONE, "multi_modal_data": {"audio": clip}}], greedy(0))[0]
    forms = [
        torch.from_numpy(clip),
        (np.stack([clip, clip]), 16_000),
        ((clip * 32767).astype(np.int16), 16_000),
    ]
    for form in forms:
        out = llm.generate([{"prompt": ONE, "multi_modal_data": {"audio": form}}], greedy(0))[0]
        assert out.outputs[0].token_ids == base.outputs[0].token_ids
    # the same tone sampled at 8 kHz: resampled, the same placeholder count as at 16 kHz
    slow = noise_clip(5, 1.0, sr=8_000)
    out = llm.generate([{"prompt": ONE, "multi_modal_data": {"audio": (slow, 8_000)}}], greedy(0))
    assert len(out[0].prompt_token_ids) == len(base.prompt_token_ids)


def test_engine_paths_match_the_plain_run(tiny):
    check_one_two_paths(tiny, ONE, TWO, longest=2.0)


def test_tensor_parallel_matches_one_process(tiny):
    clips = [noise_clip(14, 0.8), noise_clip(15, 1.7)]
    check_tensor_parallel(tiny, [{"prompt": TWO, "multi_modal_data": {"audio": clips}}], 8, 4)


def test_chat_input_audio_gives_the_offline_tokens(tiny):
    """The server's chat path: an input_audio part (base64 WAV) and an audio_url part (a data:
    URL) give the offline tokens of the chat template's prompt; two clips over
    limit_mm_per_prompt one are a 400 naming messages; bytes that are no audio a 400 naming
    the part."""
    clip = noise_clip(16, 1.2)
    b64 = wav_base64(clip)

    def more(http, body, want):
        (part, question) = body["messages"][0]["content"]
        url = {"type": "audio_url", "audio_url": {"url": f"data:audio/wav;base64,{b64}"}}
        for content, status, param in [
            ([url, question], 200, None),
            ([part, part, question], 400, "messages"),
            ([{**part, "input_audio": {"data": "bm90IGF1ZGlv", "format": "wav"}}], 400, None),
        ]:
            sent = {**body, "messages": [{"role": "user", "content": content}]}
            got, _, out = http.request("POST", "/v1/chat/completions", sent)
            assert got == status, out
            if status == 200:
                assert out["choices"][0]["token_ids"] == want.outputs[0].token_ids
            else:
                assert out["error"]["param"] == (param or "messages[0].content[0].input_audio")

    check_chat_input_audio(engine(tiny, limit_mm_per_prompt={"audio": 1}), clip, more=more)


def test_bad_input_is_refused_by_name(tiny):
    llm = engine(tiny)
    clip = noise_clip(17, 0.5)
    cases = [
        ({"audio": [clip, clip]}, r"2 audio\(s\) but the prompt has 1"),
        ({"audio": (clip, -5)}, "sampling rate"),
        ({"audio": np.zeros((2, 3, 4))}, "1-D"),
        ({"audio": np.array([np.nan] * 100, dtype=np.float32)}, "NaN"),
        ({"audio": "clip.wav"}, "waveform"),
        ({"audio": np.zeros(10, dtype=np.float32)}, "too short"),
        ({"image": clip}, "multi_modal_data"),
    ]
    for data, match in cases:
        with pytest.raises(ValueError, match=match):
            llm.generate([{"prompt": ONE, "multi_modal_data": data}], greedy(0), use_tqdm=False)
    with pytest.raises(ValueError, match="mm_processor_kwargs"):
        prompt = {"prompt": ONE, "multi_modal_data": {"audio": clip}}
        llm.generate([{**prompt, "mm_processor_kwargs": {"fps": 2}}], greedy(0), use_tqdm=False)
    # a processed clip whose features were cut after processing: refused, not a failed step
    ids, (placed,), _ = llm.llm_engine.input_processor.audios.process(
        llm.get_tokenizer().encode(ONE), clip
    )
    cut = dataclasses.replace(placed, pixel_values=placed.pixel_values[:, :-40])
    with pytest.raises(ValueError, match="hash differs"):
        llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"audio": cut}}], greedy(0))
    limited = engine(tiny, limit_mm_per_prompt={"audio": 0})
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        limited.generate([{"prompt": ONE, "multi_modal_data": {"audio": clip}}], greedy(0))
    assert limited.generate([TEXT], greedy(0))[0].outputs[0].token_ids
    out = llm.generate([{"prompt": ONE, "multi_modal_data": {"audio": clip}}], greedy(0))[0]
    assert len(out.outputs[0].token_ids) == 8


def test_llm_chat_takes_audio_parts(tiny):
    """LLM.chat reads input_audio (base64 WAV) and audio_url (data: URL) parts as the server
    does: the chat template's prompt with the decoded clip, the same tokens as generate."""
    llm = engine(tiny)
    clip = noise_clip(18, 0.9)
    b64 = wav_base64(clip)
    question = {"type": "text", "text": "What is it?"}
    prompt = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": [{"type": "audio"}, question]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    want = llm.generate([{"prompt": prompt, "multi_modal_data": {"audio": held(clip)}}], greedy(0))
    for part in (
        {"type": "input_audio", "input_audio": {"data": b64, "format": "wav"}},
        {"type": "audio_url", "audio_url": {"url": f"data:audio/wav;base64,{b64}"}},
    ):
        got = llm.chat([{"role": "user", "content": [part, question]}], greedy(0), use_tqdm=False)
        assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    bad = {"type": "input_audio", "input_audio": {"data": "@@", "format": "wav"}}
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\]\.input_audio"):
        llm.chat([{"role": "user", "content": [bad, question]}], greedy(0), use_tqdm=False)
