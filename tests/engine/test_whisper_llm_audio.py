"""Audio through the Whisper-encoder audio LLMs against HF transformers: Audio Flamingo 3
(multimodal/audioflamingo3.py), Music Flamingo (musicflamingo.py) and GLM-ASR (glmasr.py);
Voxtral has its own file (test_voxtral_audio.py: its processor needs mistral_common).

Tiny random checkpoints (2-layer towers over 16 mel bins; windows of 3 s for the Flamingos =
300 frames, max_source_positions 150; of 4 s for GLM-ASR = 400 frames, 50 rows after the merge)
with their WhisperFeatureExtractor and processor. `LLM.generate` with
`multi_modal_data={"audio": ...}` must give the HF processor's prompt ids (the processor takes
one clip a text: a prompt of two clips goes in as two texts, joined) and HF `generate`'s greedy
tokens and top-5 logprobs (1e-3, float32) for one clip, text alone, two clips of different
lengths in one prompt and a clip of three windows; then the engine's paths (chunks, prefix
caching, clips processed ahead), the transcription prompt of each processor's
`apply_transcription_request`, bad input refused by name, and on GLM-ASR: TP=2, the server's
/v1/audio/transcriptions and a chat input_audio part.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from audio_checks import check_audio_paths, check_matches_hf, noise_clip, wav_base64, wav_bytes
from hf_reference import assert_matches, hf_greedy
from image_checks import check_tensor_parallel, engine, greedy

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.audioflamingo3")
pytest.importorskip("transformers.models.glmasr")

from paged_engine import SamplingParams  # noqa: E402
from paged_engine.multimodal.audio_archs import build_audio_host  # noqa: E402
from paged_engine.testing import (  # noqa: E402
    _COMMON,
    _LLAMA_LIKE,
    TINY_VOCAB_SIZE,
    _save_random,
    build_tiny_tokenizer,
)

MAX_TOKENS = 8


@dataclass(frozen=True)
class Family:
    name: str
    model: str  # transformers class names
    config: str
    processor: str
    text_type: str
    marks: tuple[str, ...]  # special tokens the tokenizer gets
    clip: str  # what the chat template writes for an audio part
    audio: dict  # the tower's config
    chunk_length: int  # seconds a window holds
    rows_per_second: int  # placeholders of a 1 s clip
    transcribes: bool = True  # the processor defines apply_transcription_request


AF3 = Family(
    "audioflamingo3",
    "AudioFlamingo3ForConditionalGeneration",
    "AudioFlamingo3Config",
    "AudioFlamingo3Processor",
    "qwen2",
    ("<sound>",),
    "<sound>",
    {"hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2}
    | {"intermediate_size": 32, "num_mel_bins": 16, "max_source_positions": 150},
    3,
    25,  # 100 frames -> 50 after conv2 -> 25 pooled
)
GLMASR = Family(
    "glmasr",
    "GlmAsrForConditionalGeneration",
    "GlmAsrConfig",
    "GlmAsrProcessor",
    "llama",
    ("<|begin_of_audio|>", "<|audio|>", "<|end_of_audio|>"),
    "<|begin_of_audio|><|audio|><|end_of_audio|>",
    # head_dim 16: rope turns 8 of its dims (partial_rotary_factor 0.5), one k / v head
    {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2}
    | {"num_key_value_heads": 1, "intermediate_size": 128, "num_mel_bins": 16},
    4,
    12,  # 100 frames -> 50 after conv2 -> 12 merged
)
MUSIC = Family(
    "musicflamingo",
    "MusicFlamingoForConditionalGeneration",
    "MusicFlamingoConfig",
    "MusicFlamingoProcessor",
    "qwen2",
    ("<|sound_bos|>", "<sound>", "<|sound_eos|>"),
    "<sound>",  # the processor adds the marks around the run
    {**AF3.audio, "model_type": "audioflamingo3_encoder"},
    3,
    25,
    transcribes=False,
)
FAMILIES = {f.name: f for f in (AF3, GLMASR, MUSIC)}


def template(clip: str) -> str:
    return (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        f"{{% if part['type'] == 'audio' %}}{clip}"
        "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
        "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


def prompts(f: Family) -> tuple[str, str, str]:
    """(one clip, two clips, text alone) as the chat template writes them."""
    one = f"<|im_start|>user\n{f.clip}What is that sound?<|im_end|>\n<|im_start|>assistant\n"
    two = f"<|im_start|>user\n{f.clip} then {f.clip} Which?<|im_end|>\n<|im_start|>assistant\n"
    text = "<|im_start|>user\nSay something about the sea.<|im_end|>\n<|im_start|>assistant\n"
    return one, two, text


def write_tiny(f: Family, path: Path, seed: int = 0) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(TINY_VOCAB_SIZE, seed)
    tokenizer.add_special_tokens({"additional_special_tokens": list(f.marks)})
    tokenizer.chat_template = template(f.clip)
    audio_token = f.marks[len(f.marks) // 2]
    audio_id = tokenizer.convert_tokens_to_ids(audio_token)
    text = {**_LLAMA_LIKE, "model_type": f.text_type, "vocab_size": len(tokenizer), **_COMMON}
    marks = {}
    if f is MUSIC:
        bos, eos = tokenizer.convert_tokens_to_ids([f.marks[0], f.marks[2]])
        marks = {"audio_bos_token_id": bos, "audio_eos_token_id": eos}
    config = getattr(transformers, f.config)(
        text_config=text, audio_config=f.audio, audio_token_id=audio_id, **marks, **_COMMON
    )
    _save_random(getattr(transformers, f.model), config, seed, path)
    extractor = transformers.WhisperFeatureExtractor(feature_size=16, chunk_length=f.chunk_length)
    processor = getattr(transformers, f.processor)(
        extractor, tokenizer, chat_template=tokenizer.chat_template, audio_token=audio_token
    )
    processor.save_pretrained(path)
    tokenizer.save_pretrained(path)
    transformers.GenerationConfig(**_COMMON).save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory) -> tuple[Family, Path]:
    f = FAMILIES[request.param]
    return f, write_tiny(f, tmp_path_factory.mktemp(f.name))


class _HF:
    def __init__(self, f: Family, path: Path) -> None:
        cls = getattr(transformers, f.model)
        self.model = cls.from_pretrained(path, dtype=torch.float32).eval()
        self.model.generation_config.eos_token_id = None
        self.processor = getattr(transformers, f.processor).from_pretrained(path)
        self.clip = f.clip

    def greedy(self, text: str, clips: list):
        if not clips:
            ids = self.processor.tokenizer.encode(text, add_special_tokens=False)
            return ids, hf_greedy(self.model, ids, MAX_TOKENS, 5)
        # the processor takes one clip a text: the prompt as pieces of one clip each, joined
        # (the clip's special tokens end every piece, so the pieces tokenize as the whole)
        pieces = text.split(self.clip)
        texts = [f"{p}{self.clip}" for p in pieces[:-2]] + [self.clip.join(pieces[-2:])]
        out = self.processor(text=texts, audio=clips, sampling_rate=16_000, return_tensors="pt")
        ids = out["input_ids"][out["attention_mask"].bool()].tolist()
        extra = {k: out[k] for k in ("input_features", "input_features_mask")}
        return ids, hf_greedy(self.model, ids, MAX_TOKENS, 5, **extra)


def test_audio_matches_hf(family):
    """One clip, text alone, two clips of different lengths (1.3 s and 2.9 s) and a clip of
    three windows (the last one partial): the processor's prompt ids, HF's greedy tokens and
    top-5 logprobs; the expanded ids taken as they are."""
    f, path = family
    one, two, text = prompts(f)
    hf = _HF(f, path)
    cases = [
        (one, [noise_clip(1, 1.0)]),
        (text, []),
        (two, [noise_clip(2, 1.3), noise_clip(3, 2.9)]),
        (one, [noise_clip(4, 2.5 * f.chunk_length)]),
    ]
    refs = [hf.greedy(t, clips) for t, clips in cases]
    llm = engine(path)
    check_matches_hf(llm, cases, refs, f.name)
    audio_id = llm.llm_engine.input_processor.audios.placeholder
    assert refs[0][0].count(audio_id) == f.rows_per_second


def test_transcription_prompt_is_the_processors(family):
    """transcription_prompt(None, "transcribe", "") is apply_transcription_request's prompt
    (the default text; a client's text in its place), and the engine transcribes a clip with
    it as HF does; a language or a translation is refused by name."""
    f, path = family
    llm = engine(path)
    host = llm.llm_engine.input_processor.audios
    if not f.transcribes:
        with pytest.raises(ValueError, match="does not serve transcriptions"):
            host.transcription_prompt(None, "transcribe", "")
        return
    hf = _HF(f, path)
    clip = noise_clip(6, 1.6)
    for text in ("", "Write down the words."):
        want = hf.processor.apply_transcription_request(clip, prompt=text or None, tokenize=False)
        assert host.transcription_prompt(None, "transcribe", text) == {"prompt": want[0]}
    # the /v1/audio routes split a clip where the processor would cut it (max_audio_len)
    windows = int(hf.processor.max_audio_len // f.chunk_length)
    assert host.transcription_window == 16_000 * f.chunk_length * windows
    prompt = host.transcription_prompt(None, "transcribe", "")
    ids, ref = hf.greedy(prompt["prompt"], [clip])
    out = llm.generate([{**prompt, "multi_modal_data": {"audio": clip}}], greedy(), use_tqdm=False)
    assert out[0].prompt_token_ids == ids
    assert_matches(f.name, out[0], ref)
    with pytest.raises(ValueError, match=r"^language"):
        host.transcription_prompt("en", "transcribe", "")
    with pytest.raises(ValueError, match=r"^task"):
        host.transcription_prompt(None, "translate", "")


def test_engine_paths_match_the_plain_run(family):
    f, path = family
    one, two, _ = prompts(f)
    batch = [
        {"prompt": one, "multi_modal_data": {"audio": noise_clip(10 + i, 0.6 + 0.5 * i)}}
        for i in range(2)
    ]
    clips = [noise_clip(12, 0.4), noise_clip(13, f.chunk_length + 0.7)]  # 1 and 2 windows
    batch.append({"prompt": two, "multi_modal_data": {"audio": clips}})
    check_audio_paths(path, batch, two)


@pytest.fixture(scope="module")
def glmasr(tmp_path_factory) -> Path:
    return write_tiny(GLMASR, tmp_path_factory.mktemp("glmasr_one"))


def test_tensor_parallel_matches_one_process(glmasr):
    """GLM-ASR (a tied head, grouped k / v heads in tower and decoder) at TP=2."""
    _, two, _ = prompts(GLMASR)
    clips = [noise_clip(14, 0.8), noise_clip(15, GLMASR.chunk_length + 1.7)]
    check_tensor_parallel(glmasr, [{"prompt": two, "multi_modal_data": {"audio": clips}}], 8, 4)


def test_server_transcription_and_chat_audio(glmasr):
    """GLM-ASR served: /v1/audio/transcriptions on a WAV file is the offline run of the host's
    transcription prompt and the decoded clip (a language is a 400 naming it); a chat
    input_audio part gives the offline tokens of the chat template's prompt."""
    pytest.importorskip("paged_server")
    from server.server_proc import COMMON_ARGS, serve_in_process

    llm = engine(glmasr)
    clip = np.clip(noise_clip(18, 1.4), -1, 1)
    clip16 = (clip * 32767).astype(np.int16).astype(np.float32) / 32768  # what the WAV holds
    params = SamplingParams(temperature=0, max_tokens=6)
    asr = llm.llm_engine.input_processor.audios.transcription_prompt(None, "transcribe", "")
    asr_want = llm.generate([{**asr, "multi_modal_data": {"audio": clip16}}], params)[0]
    question = [{"type": "audio"}, {"type": "text", "text": "What is it?"}]
    chat = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    chat_want = llm.generate([{"prompt": chat, "multi_modal_data": {"audio": clip16}}], params)[0]
    boundary = "paged-test"

    def form(**fields: str) -> bytes:
        out = b"".join(
            f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
            for k, v in fields.items()
        )
        head = f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"'
        out += f"{head}\r\nContent-Type: audio/wav\r\n\r\n".encode() + wav_bytes(clip)
        return out + f"\r\n--{boundary}--\r\n".encode()

    multipart = {"Content-Type": f"multipart/form-data; boundary={boundary}"}
    fields = {"model": "tiny", "max_completion_tokens": "6"}
    try:
        with serve_in_process(COMMON_ARGS, llm.llm_engine) as (http, _):
            path = "/v1/audio/transcriptions"
            status, _, out = http.request("POST", path, form(**fields), multipart)
            assert status == 200, out
            assert out["text"] == asr_want.outputs[0].text and len(asr_want.outputs[0].text) > 3
            status, _, out = http.request("POST", path, form(**fields, language="en"), multipart)
            assert status == 400 and out["error"]["param"] == "language", out
            part = {"type": "input_audio", "input_audio": {"data": wav_base64(clip)}}
            part["input_audio"]["format"] = "wav"
            body = {"model": "tiny", "max_tokens": 6, "temperature": 0, "return_token_ids": True}
            body["messages"] = [{"role": "user", "content": [part, question[1]]}]
            status, _, out = http.request("POST", "/v1/chat/completions", body)
            assert status == 200, out
            assert out["prompt_token_ids"] == chat_want.prompt_token_ids
            assert out["choices"][0]["token_ids"] == chat_want.outputs[0].token_ids
    finally:
        llm.llm_engine.shutdown()


def test_bad_input_is_refused_by_name(family, tmp_path):
    f, path = family
    one, _, text = prompts(f)
    llm = engine(path)
    clip = noise_clip(17, 0.5)
    cases = [
        ({"audio": [clip, clip]}, r"2 audio\(s\) but the prompt has 1"),
        ({"audio": (clip, -5)}, "sampling rate"),
        ({"audio": np.zeros((2, 3, 4))}, "1-D"),
        ({"audio": np.zeros(10, dtype=np.float32)}, "too short"),
    ]
    for data, match in cases:
        with pytest.raises(ValueError, match=match):
            llm.generate([{"prompt": one, "multi_modal_data": data}], greedy(0), use_tqdm=False)
    out = llm.generate([{"prompt": one, "multi_modal_data": {"audio": clip}}], greedy(0))[0]
    assert len(out.outputs[0].token_ids) == 8
    assert llm.generate([text], greedy(0))[0].outputs[0].token_ids
    # a feature extractor whose window is not what the tower takes
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    config = (bad / "processor_config.json").read_text()
    (bad / "processor_config.json").write_text(
        config.replace(f'"chunk_length": {f.chunk_length}', '"chunk_length": 5')
        .replace(f'"n_samples": {16_000 * f.chunk_length}', '"n_samples": 80000')
        .replace(f'"nb_max_frames": {100 * f.chunk_length}', '"nb_max_frames": 500')
    )
    config = transformers.AutoConfig.from_pretrained(bad)
    with pytest.raises(ValueError, match="chunk_length" if f is GLMASR else "max_source_positions"):
        build_audio_host(bad, config, llm.get_tokenizer(), None)
