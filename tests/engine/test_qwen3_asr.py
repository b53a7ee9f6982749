"""Qwen3-ASR (multimodal/qwen3_asr.py) against HF transformers.

A tiny random Qwen3ASRForConditionalGeneration (Qwen3-Omni's tower over 16 mel bins: chunks of
100 frames, 13 rows each, attention windows of two chunks (n_window_infer 200); a Qwen3
decoder) with its Qwen3ASRFeatureExtractor and a Qwen3ASRProcessor whose chat template writes
<|audio_start|><|audio_pad|><|audio_end|> for an audio part. `LLM.generate` must give the
processor's prompt ids (<|audio_pad|> expanded by its `_get_audio_token_length`) and HF
`generate`'s greedy tokens and top-5 logprobs (1e-3, float32): one clip, a clip under 0.5 s
(zero-padded to it), two clips of different lengths in one prompt (extracted together, the
shorter padded to the longer as the processor pads it), a clip of three windows. The
transcription prompt equals `apply_transcription_request`'s (with and without a language and
a context prompt) and the engine transcribes with it as HF does. Then chunks through clips,
prefix caching, clips processed ahead, the server's /v1/audio/transcriptions, and bad input
refused by name.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from audio_checks import check_audio_paths, noise_clip, wav_bytes
from hf_reference import assert_matches, hf_greedy
from image_checks import engine, greedy

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.qwen3_asr")

from paged_engine import SamplingParams  # noqa: E402
from paged_engine.testing import (  # noqa: E402
    _COMMON,
    _LLAMA_LIKE,
    TINY_VOCAB_SIZE,
    _save_random,
    build_tiny_tokenizer,
)

MAX_TOKENS = 8
TOKENS = {
    "audio_token": "<|audio_pad|>",
    "audio_bos_token": "<|audio_start|>",
    "audio_eos_token": "<|audio_end|>",
}
CLIP = "<|audio_start|><|audio_pad|><|audio_end|>"
# an assistant turn given last is left open (the processor continues it)
TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    f"{{% if part['type'] == 'audio' %}}{CLIP}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if not (loop.last and message['role'] == 'assistant') %}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
END = "<|im_end|>\n<|im_start|>assistant\n"
ONE = f"<|im_start|>user\n{CLIP}What is said?{END}"
TWO = f"<|im_start|>user\n{CLIP} then {CLIP} Which is louder?{END}"


def write_tiny_qwen3_asr(path: Path, seed: int = 0) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(TINY_VOCAB_SIZE, seed)
    tokenizer.add_special_tokens({"additional_special_tokens": [*TOKENS.values(), "<asr_text>"]})
    tokenizer.save_pretrained(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, extra_special_tokens=TOKENS)
    text = {**_LLAMA_LIKE, "model_type": "qwen3", "head_dim": 16, "vocab_size": len(tokenizer)}
    audio = {"d_model": 8, "encoder_layers": 1, "encoder_attention_heads": 2}
    audio |= {"encoder_ffn_dim": 16, "num_mel_bins": 16, "downsample_hidden_size": 8}
    audio |= {"n_window": 50, "n_window_infer": 200, "output_dim": text["hidden_size"]}
    config = transformers.Qwen3ASRConfig(
        text_config={**text, **_COMMON},
        audio_config=audio,
        audio_token_id=tokenizer.convert_tokens_to_ids(TOKENS["audio_token"]),
        **_COMMON,
    )
    _save_random(transformers.Qwen3ASRForConditionalGeneration, config, seed, path)
    extractor = transformers.Qwen3ASRFeatureExtractor(feature_size=16)
    processor = transformers.Qwen3ASRProcessor(extractor, tokenizer, chat_template=TEMPLATE)
    processor.save_pretrained(path)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    transformers.GenerationConfig(**_COMMON).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_qwen3_asr(tmp_path_factory.mktemp("qwen3_asr"))


class _HF:
    def __init__(self, path: Path) -> None:
        cls = transformers.Qwen3ASRForConditionalGeneration
        self.model = cls.from_pretrained(path, dtype=torch.float32).eval()
        self.model.generation_config.eos_token_id = None
        self.processor = transformers.Qwen3ASRProcessor.from_pretrained(path)
        self.pad = self.model.config.audio_token_id

    def inputs(self, text: str, clips: list) -> tuple[list[int], dict]:
        """The processor's rule for a prompt's clips (its __call__ takes one clip a prompt):
        the clips extracted together, each placeholder expanded by _get_audio_token_length."""
        ids = self.processor.tokenizer.encode(text, add_special_tokens=False)
        out = self.processor.feature_extractor(
            clips,
            sampling_rate=16_000,
            padding=True,
            truncation=False,
            n_window=50,
            return_attention_mask=True,
        )
        mask = out["attention_mask"]
        runs = iter(int(n) for n in self.processor._get_audio_token_length(mask.sum(-1), 50))
        expanded: list[int] = []
        for t in ids:
            expanded += [t] * next(runs) if t == self.pad else [t]
        return expanded, {"input_features": out["input_features"], "input_features_mask": mask}

    def greedy(self, ids: list[int], extra: dict):
        return hf_greedy(self.model, ids, MAX_TOKENS, 5, **extra)


def test_audio_matches_hf(tiny):
    """HF's prompt ids, greedy tokens and top-5 logprobs: one clip (also through the
    processor's own call), a 0.3 s clip (zero-padded to 0.5 s: 50 frames, 7 rows), two clips
    of different lengths off a multiple of the hop, a clip of 2.7 s (three chunks, the last
    short; its 35 rows in two attention windows)."""
    hf = _HF(tiny)
    cases = [
        (ONE, [noise_clip(1, 1.0)]),
        (ONE, [noise_clip(2, 0.3)]),
        (TWO, [noise_clip(3, 1.2505), noise_clip(4, 2.0101)]),
        (ONE, [noise_clip(5, 2.7)]),
    ]
    refs = []
    for text, clips in cases:
        ids, extra = hf.inputs(text, clips)
        refs.append((ids, hf.greedy(ids, extra)))
    own = hf.processor(text=[ONE], audio=cases[0][1], sampling_rate=16_000)
    assert own["input_ids"][0].tolist() == refs[0][0]
    llm = engine(tiny)
    prompts = [{"prompt": t, "multi_modal_data": {"audio": clips}} for t, clips in cases]
    for (ids, ref), out in zip(refs, llm.generate(prompts, greedy(), use_tqdm=False), strict=True):
        assert out.prompt_token_ids == ids
        assert_matches("qwen3_asr", out, ref)
    assert [ids.count(hf.pad) for ids, _ in refs[:2]] == [13, 7]
    assert refs[3][0].count(hf.pad) == 13 + 13 + 9  # 70 frames -> 35 -> 18 -> 9


@pytest.mark.parametrize(
    ("language", "context"), [("en", ""), (None, ""), ("French", "Names: Ada, Lovelace.")]
)
def test_transcription_prompt_matches_the_processor(tiny, language, context):
    """`transcription_prompt` renders apply_transcription_request's conversation: with the
    clip, the same ids; the engine's tokens and logprobs are HF's on them."""
    hf = _HF(tiny)
    clip = noise_clip(6, 1.3)
    want = hf.processor.apply_transcription_request(
        clip, language=language, prompt=context or None, sampling_rate=16_000
    )
    ids = want["input_ids"][0].tolist()
    extra = {k: want[k] for k in ("input_features", "input_features_mask")}
    ref = hf.greedy(ids, extra)
    llm = engine(tiny)
    request = llm.llm_engine.input_processor.audios.transcription_prompt(
        language, "transcribe", context
    )
    request["multi_modal_data"] = {"audio": clip}
    out = llm.generate([request], greedy(), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids
    assert_matches("qwen3_asr transcription", out, ref)
    if language is not None:
        assert request["prompt"].endswith("<asr_text>")


def test_engine_paths_match_the_plain_run(tiny):
    prompts = [
        {"prompt": ONE, "multi_modal_data": {"audio": noise_clip(10 + i, 0.7 + 0.9 * i)}}
        for i in range(2)
    ]
    prompts.append(
        {"prompt": TWO, "multi_modal_data": {"audio": [noise_clip(12, 0.4), noise_clip(13, 2.3)]}}
    )
    check_audio_paths(tiny, prompts, TWO)


def test_server_transcription(tiny):
    """/v1/audio/transcriptions on a WAV file with language "en" is the offline run of the
    host's transcription prompt on the decoded clip; a translation is a 400."""
    pytest.importorskip("paged_server")
    from server.server_proc import COMMON_ARGS, serve_in_process

    llm = engine(tiny)
    clip = np.clip(noise_clip(18, 1.4), -1, 1)
    clip16 = (clip * 32767).astype(np.int16).astype(np.float32) / 32768  # what the WAV holds
    asr = llm.llm_engine.input_processor.audios.transcription_prompt("en", "transcribe", "")
    params = SamplingParams(temperature=0, max_tokens=6)
    want = llm.generate([{**asr, "multi_modal_data": {"audio": clip16}}], params)[0]
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
    fields = {"model": "tiny", "max_completion_tokens": "6", "language": "en"}
    try:
        with serve_in_process(COMMON_ARGS, llm.llm_engine) as (http, _):
            status, _, out = http.request(
                "POST", "/v1/audio/transcriptions", form(**fields), multipart
            )
            assert status == 200, out
            assert out["text"] == want.outputs[0].text and len(want.outputs[0].text) > 3
            status, _, out = http.request(
                "POST", "/v1/audio/translations", form(**fields), multipart
            )
            assert status == 400 and "transcribes only" in out["error"]["message"], out
    finally:
        llm.llm_engine.shutdown()


def test_bad_input_is_refused_by_name(tiny):
    """A translation, a language the model does not name, a clip count off the placeholders,
    a config whose chunk is not 13 rows, a missing projector weight: ValueErrors naming what
    is wrong; the engine serves on."""
    from safetensors.torch import load_file

    from paged_engine.multimodal.qwen3_asr import Qwen3AsrEncoder

    llm = engine(tiny)
    audios = llm.llm_engine.input_processor.audios
    with pytest.raises(ValueError, match="task: 'translate'"):
        audios.transcription_prompt(None, "translate", "")
    with pytest.raises(ValueError, match="language: 'xx'"):
        audios.transcription_prompt("xx", "transcribe", "")
    clip = noise_clip(14, 0.6)
    with pytest.raises(ValueError, match=r"2 audio\(s\) but the prompt has 1"):
        llm.generate([{"prompt": ONE, "multi_modal_data": {"audio": [clip, clip]}}], greedy(0))
    out = llm.generate([{"prompt": ONE, "multi_modal_data": {"audio": clip}}], greedy(0))[0]
    assert len(out.outputs[0].token_ids) == MAX_TOKENS

    config = transformers.AutoConfig.from_pretrained(tiny)
    weights = load_file(str(tiny / "model.safetensors"))
    tower = {n.removeprefix("model.") for n in weights if "audio_tower." in n}
    projector = {n.removeprefix("model.") for n in weights if "multi_modal_projector." in n}
    assert Qwen3AsrEncoder(config).load_weights(weights.items()) == tower | projector
    name = "model.multi_modal_projector.linear_2.bias"
    dropped = ((n, t) for n, t in weights.items() if n != name)
    with pytest.raises(ValueError, match=r"multi_modal_projector\.linear_2\.bias"):
        Qwen3AsrEncoder(config).load_weights(dropped)
    config.audio_config.n_window = 20
    with pytest.raises(ValueError, match=r"audio_config\.n_window=20"):
        Qwen3AsrEncoder(config)
