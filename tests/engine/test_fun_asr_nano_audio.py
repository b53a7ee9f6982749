"""Audio through Fun-ASR-Nano (multimodal/fun_asr_nano.py, fun_asr_nano_encoder.py) against HF.

A tiny random FunAsrNanoForConditionalGeneration (a 3-block SAN-M encoder over 8-mel LFR
stacks of 7 with an even FSMN kernel, its last block a timestamp block; a 2-layer adaptor; a
2-layer Qwen3). HF's feature extractor needs torchaudio, so the features are paged's
(`KaldiFeatures`), checked here against a numpy implementation of Kaldi's formulas, and HF's
model is fed them (`generate(input_features=..., input_features_mask=...)` for one clip; each
clip encoded alone for two, as HF's padded batch lets the adaptor attend to the padding): HF's
prompt ids (the processor's rule: one placeholder per LFR
row), greedy tokens and top-5 logprobs (1e-3, float32); then chunked prefill and prefix
caching through clips, the transcription prompt, and bad input refused by name.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from audio_checks import (
    HFAudio,
    check_chat_input_audio,
    check_clips_match_hf,
    check_one_two_paths,
    check_prompt_matches_hf,
    held,
    noise_clip,
    wav_bytes,
)
from image_checks import engine, greedy

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.fun_asr_nano")

from paged_engine.multimodal.fun_asr_nano import FunAsrNanoAudio, KaldiFeatures  # noqa: E402
from paged_engine.testing import (  # noqa: E402
    _COMMON,
    _LLAMA_LIKE,
    TINY_VOCAB_SIZE,
    _randomize,
    build_tiny_tokenizer,
)

AUDIO = "<|object_ref_start|>"
TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'audio' %}<|object_ref_start|>"
    "{% elif part['type'] == 'text' %}context: {{ part['text'] }}"
    "{% elif part['type'] == 'language' %}语音转写成{{ part['language'] }}：{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
USER = "<|im_start|>user\n"
REPLY = "<|im_end|>\n<|im_start|>assistant\n"
ONE = f"{USER}{AUDIO}what is said here?{REPLY}"
TWO = f"{USER}{AUDIO} and then {AUDIO} which is longer?{REPLY}"
TEXT = f"{USER}Say something about the sea.{REPLY}"
SETTINGS = {"feature_size": 8}


def write_tiny_fun_asr_nano(path: Path, seed: int = 0) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(TINY_VOCAB_SIZE, seed)
    tokenizer.add_special_tokens({"additional_special_tokens": [AUDIO]})
    tokenizer.chat_template = TEMPLATE
    text = {**_LLAMA_LIKE, "model_type": "qwen3", "vocab_size": len(tokenizer), **_COMMON}
    text |= {"head_dim": 16, "tie_word_embeddings": False}
    audio = {"num_mel_bins": 8, "num_stacked_frames": 7, "hidden_size": 32}
    audio |= {"num_attention_heads": 2, "intermediate_size": 48, "num_hidden_layers": 3}
    audio |= {"num_timestamp_prediction_layers": 1, "fsmn_kernel_size": 4}
    audio |= {"max_position_embeddings": 120, "hidden_dropout": 0.0, "attention_dropout": 0.0}
    adaptor = {"hidden_size": 64, "num_attention_heads": 2, "intermediate_size": 16}
    adaptor |= {"num_hidden_layers": 2, "projector_hidden_size": 48}
    config = transformers.FunAsrNanoConfig(
        text_config=text,
        audio_config=audio,
        adaptor_config=adaptor,
        audio_token_id=tokenizer.convert_tokens_to_ids(AUDIO),
        tie_word_embeddings=False,  # (a tied head repeats one token)
        **_COMMON,
    )
    torch.manual_seed(seed)
    model = transformers.FunAsrNanoForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():
        _randomize(model, seed)
    model.save_pretrained(path)
    extractor = {"feature_extractor_type": "FunAsrNanoFeatureExtractor", **SETTINGS}
    saved = {"feature_extractor": extractor, "processor_class": "FunAsrNanoProcessor"}
    (path / "processor_config.json").write_text(json.dumps({**saved, "audio_token": AUDIO}))
    tokenizer.save_pretrained(path)
    transformers.GenerationConfig(**_COMMON).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_fun_asr_nano(tmp_path_factory.mktemp("fun_asr_nano"))


def numpy_fbank(wave: np.ndarray, n_mels=8, sr=16_000, size=400, shift=160) -> np.ndarray:
    """Kaldi's fbank in float64 numpy, as torchaudio.compliance.kaldi.fbank's defaults write it:
    snipped frames, DC removed, pre-emphasis 0.97 (x[-1] = x[0]), symmetric Hamming, |rfft|^2
    at 512, mel triangles 20 Hz .. Nyquist over the bins below Nyquist, log floored at eps."""
    x = wave.astype(np.float64)
    frames = 1 + (x.size - size) // shift
    f = np.stack([x[i * shift : i * shift + size] for i in range(frames)])
    f = f - f.mean(axis=1, keepdims=True)
    f = f - 0.97 * np.concatenate([f[:, :1], f[:, :-1]], axis=1)
    f = f * (0.54 - 0.46 * np.cos(2 * np.pi * np.arange(size) / (size - 1)))
    power = np.abs(np.fft.rfft(f, n=512)) ** 2
    mel = lambda hz: 1127 * np.log(1 + hz / 700)
    edges = np.linspace(mel(20.0), mel(sr / 2), n_mels + 2)
    bins = mel(sr / 512 * np.arange(256))
    bank = np.zeros((257, n_mels))
    for m in range(n_mels):
        lo, mid, hi = edges[m : m + 3]
        bank[:256, m] = np.clip(
            np.minimum((bins - lo) / (mid - lo), (hi - bins) / (hi - mid)), 0, None
        )
    return np.log(np.maximum(power @ bank, np.finfo(np.float32).eps))


def numpy_lfr(fb: np.ndarray, m=7, s=6) -> np.ndarray:
    """Windows of m frames every s, the first frame repeated (m - 1) // 2 times before and the
    last as often as the last window needs, stacked frame-major."""
    rows = -(-fb.shape[0] // s)
    left = (m - 1) // 2
    padded = np.concatenate([np.repeat(fb[:1], left, 0), fb, np.repeat(fb[-1:], 3 * m, 0)])
    return np.stack([padded[r * s : r * s + m].reshape(-1) for r in range(rows)])


class _HF(HFAudio):
    """FunAsrNanoProcessor's ids (one placeholder per LFR row); one clip through HF's own
    path, two each encoded alone."""

    model_class = transformers.FunAsrNanoForConditionalGeneration
    audio = AUDIO

    def __init__(self, path: Path) -> None:
        super().__init__(path, KaldiFeatures(SETTINGS))

    def placeholders(self, clip) -> int:
        return self.features(clip).shape[0]

    def greedy(self, text: str, clips: list):
        ids = self.ids(text, clips)
        if not clips:
            return ids, self.generate(ids)
        feats = [self.features(c) for c in clips]
        if len(feats) == 1:  # HF's own path: features and mask into generate
            kw = {"input_features": feats[0][None], "input_features_mask": self._ones(feats[0])}
            return ids, self.generate(ids, **kw)
        inner = self.model.model
        with torch.no_grad():  # each clip encoded alone (HF's batch: the adaptor sees padding)
            rows = [inner.get_audio_features(f[None], self._ones(f)).pooler_output for f in feats]
            embeds = inner.get_input_embeddings()(torch.tensor([ids]))
            where = torch.tensor([ids]) == self.model.config.audio_token_id
            embeds[where] = torch.cat(rows)
        return ids, self.generate(ids, inputs_embeds=embeds)

    @staticmethod
    def _ones(f: torch.Tensor) -> torch.Tensor:
        return torch.ones(1, f.shape[0], dtype=torch.long)


def test_features_match_the_formulas():
    """KaldiFeatures against the numpy formulas (features are log energies; 1e-3 absolute),
    LFR rows = ceil(frames / 6), clips from one frame (400 samples) to 1.9 s."""
    features = KaldiFeatures(SETTINGS)
    for seed, n in enumerate((400, 559, 4000, 16_000, 30_321)):
        wave = noise_clip(seed, n / 16_000)
        fb = features.fbank(wave).numpy()
        want = numpy_fbank(wave)
        assert fb.shape == want.shape == (1 + (n - 400) // 160, 8)
        assert np.abs(fb - want).max() < 1e-3
        lfr = features(wave).numpy()
        assert lfr.shape == (features.rows(n), 56)
        assert np.array_equal(lfr, numpy_lfr(fb))


def test_audio_matches_hf(tiny):
    """One clip, text alone, two clips of different lengths: HF's prompt ids, greedy tokens
    and top-5 logprobs; then the transcription prompt."""
    hf = _HF(tiny)
    llm = engine(tiny)
    refs = check_clips_match_hf(llm, hf, ONE, TEXT, TWO, "fun_asr_nano")
    # 1 s: 98 frames -> 17 LFR rows
    assert refs[0][0].count(llm.get_tokenizer().convert_tokens_to_ids(AUDIO)) == 17

    host = llm.llm_engine.input_processor.audios
    prompt = host.transcription_prompt("en", "transcribe", "a weather report")
    # HF's apply_transcription_request over the same chat template (its processor, which
    # needs torchaudio, stood in for by the tokenizer's template)
    request = transformers.FunAsrNanoProcessor.apply_transcription_request
    render = lambda chats, **kw: [
        hf.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
        for c in chats
    ]
    clip = noise_clip(20, 0.9)
    want = request(SimpleNamespace(apply_chat_template=render), clip, "en", "a weather report")
    assert prompt == {"prompt": want[0]}
    check_prompt_matches_hf(llm, hf, prompt, clip, "fun_asr_nano transcription")
    for args, match in (
        (("xx", "transcribe", ""), "language"),
        (("en", "translate", ""), "task"),
    ):
        with pytest.raises(ValueError, match=match):
            host.transcription_prompt(*args)


def test_chunked_prefill_and_prefix_caching(tiny):
    check_one_two_paths(tiny, ONE, TWO)


def test_server_chat_and_transcription(tiny):
    """The server's chat path (an input_audio part) gives the offline tokens; its
    /v1/audio/transcriptions (language "en") the offline run of the transcription prompt on the
    decoded clip; a translation is a 400 naming the task."""
    llm = engine(tiny)
    clip = noise_clip(16, 1.2)
    asr = llm.llm_engine.input_processor.audios.transcription_prompt("en", "transcribe", "")
    want = llm.generate([{**asr, "multi_modal_data": {"audio": held(clip)}}], greedy(0, 6))[0]
    fields = {"model": "tiny", "max_completion_tokens": 6, "language": "en"}
    form = b"".join(
        f'--b\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
        for k, v in fields.items()
    )
    form += b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
    form += b"Content-Type: audio/wav\r\n\r\n" + wav_bytes(clip) + b"\r\n--b--\r\n"
    multipart = {"Content-Type": "multipart/form-data; boundary=b"}

    def more(http, body, chat) -> None:
        status, _, out = http.request("POST", "/v1/audio/transcriptions", form, multipart)
        assert status == 200 and out["text"] == want.outputs[0].text, out
        status, _, out = http.request("POST", "/v1/audio/translations", form, multipart)
        assert status == 400 and "only transcribes" in out["error"]["message"], out

    check_chat_input_audio(llm, clip, more=more)


def test_bad_input_is_refused_by_name(tiny, tmp_path):
    llm = engine(tiny)
    clip = noise_clip(17, 0.5)
    for data, match in (
        ({"audio": np.zeros(399, dtype=np.float32)}, "too short"),
        ({"audio": noise_clip(18, 7.2)}, "too long"),  # 120 rows of 60 ms: 7.2 s is 120
    ):
        with pytest.raises(ValueError, match=match):
            llm.generate([{"prompt": ONE, "multi_modal_data": data}], greedy(0), use_tqdm=False)
    out = llm.generate([{"prompt": ONE, "multi_modal_data": {"audio": clip}}], greedy(0))[0]
    assert len(out.outputs[0].token_ids) == 8  # still serving
    # the /v1/audio routes' window: the longest clip the positions take
    host = llm.llm_engine.input_processor.audios
    window = host.transcription_window
    assert host.extractor.rows(window) == 119 < host.extractor.rows(window + 1)

    tokenizer = llm.get_tokenizer()
    for key, value, match in (
        ("window", "povey", "window 'povey'"),
        ("num_frames_lfr", 6, r"feature_size \* num_frames_lfr 48 differs"),
        ("stride_lfr", 0, "stride_lfr must be a positive whole number"),
    ):
        other = shutil.copytree(tiny, tmp_path / key)
        saved = json.loads((other / "processor_config.json").read_text())
        saved["feature_extractor"][key] = value
        (other / "processor_config.json").write_text(json.dumps(saved))
        config = transformers.AutoConfig.from_pretrained(other)
        with pytest.raises(ValueError, match=match):
            FunAsrNanoAudio(other, config, tokenizer)
