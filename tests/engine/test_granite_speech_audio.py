"""Audio through Granite Speech (multimodal/granite_speech.py) against HF transformers.

A tiny random GraniteSpeechForConditionalGeneration (a 3-block conformer over 8 stacked mel
pairs, 16-row attention blocks, a 2-layer Q-Former over 6-row windows with 2 queries each, a
2-layer Granite) with random BatchNorm statistics. HF's feature extractor needs torchaudio, so
the features are paged's (`MelFeatures`), checked here against a numpy implementation of the
formulas, and HF's model is fed them: `LLM.generate` must give the prompt ids of HF's processor
rule (`_get_num_audio_features`) and HF's greedy tokens and top-5 logprobs (1e-3, float32), each
clip encoded as HF encodes it alone; then chunks through clips, prefix caching, clips processed
ahead, TP=2, the chat path, the transcription prompt, and bad input refused by name.
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
    noise_clip,
)
from hf_reference import assert_matches
from image_checks import check_tensor_parallel, engine, greedy

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.granite_speech")

from paged_engine.multimodal.granite_speech import (  # noqa: E402
    GraniteSpeechAudio,
    MelFeatures,
)
from paged_engine.testing import (  # noqa: E402
    _COMMON,
    _LLAMA_LIKE,
    TINY_VOCAB_SIZE,
    _randomize,
    build_tiny_tokenizer,
)

AUDIO = "<|audio|>"
TEMPLATE = (
    "{% for message in messages %}<|start_of_role|>{{ message['role'] }}<|end_of_role|>"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'audio' %}<|audio|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|end_of_text|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|start_of_role|>assistant<|end_of_role|>{% endif %}"
)
MARKS = ("<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>", AUDIO)
USER = "<|start_of_role|>user<|end_of_role|>"
REPLY = "<|end_of_text|>\n<|start_of_role|>assistant<|end_of_role|>"
ONE = f"{USER}{AUDIO}what is said here?{REPLY}"
TWO = f"{USER}{AUDIO} and then {AUDIO} which is longer?{REPLY}"
TEXT = f"{USER}Say something about the sea.{REPLY}"
SETTINGS = {"n_mels": 8, "projector_window_size": 6, "projector_downsample_rate": 3}


def write_tiny_granite_speech(path: Path, seed: int = 0) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(TINY_VOCAB_SIZE, seed)
    tokenizer.add_special_tokens({"additional_special_tokens": list(MARKS)})
    tokenizer.chat_template = TEMPLATE
    text = {**_LLAMA_LIKE, "model_type": "granite", "vocab_size": len(tokenizer), **_COMMON}
    text |= {"residual_multiplier": 0.7, "attention_multiplier": 0.2, "logits_scaling": 1.5}
    text["embedding_multiplier"] = 2.0  # HF scales the merged embeddings, audio rows too
    encoder = {"input_dim": 16, "num_layers": 3, "hidden_dim": 32, "feedforward_mult": 2}
    encoder |= {"num_heads": 2, "output_dim": 7, "context_size": 16, "max_pos_emb": 20}
    encoder |= {"conv_kernel_size": 5, "conv_expansion_factor": 2, "dropout": 0.0}
    projector = {"model_type": "blip_2_qformer", "hidden_size": 32, "num_attention_heads": 2}
    projector |= {"num_hidden_layers": 2, "intermediate_size": 64, "encoder_hidden_size": 32}
    projector |= {"cross_attention_frequency": 1}
    config = transformers.GraniteSpeechConfig(
        text_config=text,
        encoder_config=encoder,
        projector_config=projector,
        audio_token_index=tokenizer.convert_tokens_to_ids(AUDIO),
        window_size=6,
        downsample_rate=3,
        has_lora_adapter=False,
        tie_word_embeddings=False,  # (a tied head repeats one token)
        **_COMMON,
    )
    save_random(transformers.GraniteSpeechForConditionalGeneration, config, path, seed)
    # what transformers 5 saves for GraniteSpeechProcessor (building one needs torchaudio)
    extractor = {"feature_extractor_type": "GraniteSpeechFeatureExtractor", **SETTINGS}
    extractor |= {"sampling_rate": 16_000, "n_fft": 512, "win_length": 400, "hop_length": 160}
    saved = {"audio_processor": extractor, "processor_class": "GraniteSpeechProcessor"}
    (path / "processor_config.json").write_text(json.dumps({**saved, "audio_token": AUDIO}))
    tokenizer.save_pretrained(path)
    transformers.GenerationConfig(**_COMMON).save_pretrained(path)
    return path


def save_random(model_class: type, config, path: Path, seed: int) -> None:
    """`model_class(config)` with random weights (`_randomize`) and BatchNorm statistics other
    than (0, 1), saved at `path`."""
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        _randomize(model, seed)
        for name, b in model.named_buffers():
            if name.endswith("running_mean"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.3)
            elif name.endswith("running_var"):
                b.copy_(torch.rand(b.shape, generator=gen) + 0.5)
    model.save_pretrained(path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_granite_speech(tmp_path_factory.mktemp("granite_speech"))


def numpy_features(wave: np.ndarray, n_fft=512, win=400, hop=160, n_mels=8, sr=16_000):
    """The extractor's formulas in float64 numpy: |rfft|^2 of reflect-padded frames under a
    periodic Hann window centred in n_fft, HTK triangles, log10 floored at max - 8, / 4 + 1,
    frame pairs stacked."""
    x = np.pad(wave.astype(np.float64), n_fft // 2, mode="reflect")
    window = np.zeros(n_fft)
    left = (n_fft - win) // 2
    window[left : left + win] = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(win) / win)
    frames = 1 + (x.size - n_fft) // hop
    power = np.stack(
        [np.abs(np.fft.rfft(x[i * hop : i * hop + n_fft] * window)) ** 2 for i in range(frames)]
    )
    top = 2595 * np.log10(1 + (sr // 2) / 700)  # HTK mels of sr / 2
    hz = 700 * (10 ** (np.linspace(0, top, n_mels + 2) / 2595) - 1)
    freqs = np.linspace(0, sr // 2, n_fft // 2 + 1)
    bank = np.zeros((freqs.size, n_mels))
    for m in range(n_mels):
        lo, mid, hi = hz[m : m + 3]
        bank[:, m] = np.clip(
            np.minimum((freqs - lo) / (mid - lo), (hi - freqs) / (hi - mid)), 0, None
        )
    logmel = np.log10(np.maximum(power @ bank, 1e-10))
    logmel = np.maximum(logmel, logmel.max() - 8) / 4 + 1
    return logmel[: frames // 2 * 2].reshape(-1, 2 * n_mels)


def hf_tokens(samples: int) -> int:
    """HF's processor rule for a clip's placeholder count (GraniteSpeechFeatureExtractor's)."""
    rule = transformers.GraniteSpeechFeatureExtractor._get_num_audio_features
    extractor = SimpleNamespace(
        melspec_kwargs={"hop_length": 160},
        projector_window_size=SETTINGS["projector_window_size"],
        projector_downsample_rate=SETTINGS["projector_downsample_rate"],
    )
    return rule(extractor, [samples])[0]


class _HF(HFAudio):
    """GraniteSpeechProcessor's ids (HF's rule per clip), each clip encoded as HF encodes it
    alone."""

    model_class = transformers.GraniteSpeechForConditionalGeneration
    audio = AUDIO

    def __init__(self, path: Path) -> None:
        super().__init__(path, MelFeatures(SETTINGS))

    def placeholders(self, clip) -> int:
        return hf_tokens(clip.size)

    def greedy(self, text: str, clips: list):
        ids = self.ids(text, clips)
        if not clips:
            return ids, self.generate(ids)
        inner = self.model.model
        with torch.no_grad():  # each clip encoded alone (HF's batch runs over the padding)
            rows = [
                inner.get_audio_features(self.features(c)[None]).pooler_output[0] for c in clips
            ]
            embeds = inner.get_merged_audio_embeddings(torch.tensor([ids]), torch.cat(rows))
        return ids, self.generate(ids, inputs_embeds=embeds)


def test_features_match_the_formulas():
    """MelFeatures against the numpy formulas (4e-5 on features of about +-1) and HF's rule for
    the number of rows and placeholders, clips of 257 samples (the shortest) to 1.9 s; a loud
    half then a near-silent one spans over 8 decades of power, so the floor at max - 8 binds."""
    features = MelFeatures(SETTINGS)
    quiet = noise_clip(9, 1.0)
    quiet[8000:] *= 1e-5
    clips = [noise_clip(seed, n / 16_000) for seed, n in enumerate((257, 4000, 16_000, 30_321))]
    for wave in [*clips, quiet]:
        samples = wave.size
        got = features(wave).numpy()
        want = numpy_features(wave)
        assert got.shape == want.shape == ((samples // 160 + 1) // 2, 16)
        assert np.abs(got - want).max() < 4e-5
        assert features.tokens(samples) == hf_tokens(samples)
    assert np.isclose(got.min(), got.max() - 2)  # the floor binds: (max - 8) / 4 + 1


def test_audio_matches_hf(tiny):
    """One clip, text alone, two clips of different lengths (0.7 s and 1.9 s: more than one
    attention block and window each, one ending mid-block): HF's prompt ids, greedy tokens and
    top-5 logprobs; the expanded ids taken as they are."""
    llm = engine(tiny)
    refs = check_clips_match_hf(llm, _HF(tiny), ONE, TEXT, TWO, "granite_speech")
    # 1 s: 101 frames -> 50 rows -> 9 windows of 6 -> 18 placeholders
    assert refs[0][0].count(llm.get_tokenizer().convert_tokens_to_ids(AUDIO)) == 18


def test_engine_paths_match_the_plain_run(tiny):
    check_one_two_paths(tiny, ONE, TWO)


def test_tensor_parallel_matches_one_process(tiny):
    clips = [noise_clip(14, 0.8), noise_clip(15, 1.2)]
    check_tensor_parallel(tiny, [{"prompt": TWO, "multi_modal_data": {"audio": clips}}], 8, 4)


def test_transcription_prompt(tiny):
    """vLLM's transcription request (one user turn: the audio token, then the ask) through the
    chat template: HF's prompt ids for a clip and HF's greedy tokens; translation asks for
    English; a language it does not know, another task or a context prompt are refused."""
    llm = engine(tiny)
    host = llm.llm_engine.input_processor.audios
    clip = noise_clip(20, 0.9)
    prompt = host.transcription_prompt("en", "transcribe", "")
    ask = f"{AUDIO}can you transcribe the speech into a written format?"
    template = llm.get_tokenizer().apply_chat_template
    text = template([{"role": "user", "content": ask}], tokenize=False, add_generation_prompt=True)
    assert prompt == {"prompt": text}
    check_prompt_matches_hf(llm, _HF(tiny), prompt, clip, "granite_speech transcription")
    translate = host.transcription_prompt(None, "translate", "")["prompt"]
    assert f"{AUDIO}translate the speech to English" in translate
    for args, match in (
        (("xx", "transcribe", ""), "language"),
        (("en", "summarize", ""), "task"),
        (("en", "transcribe", "earlier words"), "prompt"),
    ):
        with pytest.raises(ValueError, match=match):
            host.transcription_prompt(*args)


def write_speech_adapter(path: Path, prefix: str, seed: int = 5) -> dict[str, tuple]:
    """A rank-4 PEFT adapter on the text model's q_proj / v_proj (what Granite Speech ships)
    with module names under `prefix`; returns {(layer, projection): (A, B)} (scale 2)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    parts, tensors = {}, {}
    for i in range(_LLAMA_LIKE["num_hidden_layers"]):
        for proj, rows in (("q_proj", 64), ("v_proj", 32)):
            a = torch.randn(4, 64, generator=gen) * 0.125
            b = torch.randn(rows, 4, generator=gen) * 0.5
            key = f"base_model.model.{prefix}layers.{i}.self_attn.{proj}"
            tensors |= {f"{key}.lora_A.weight": a, f"{key}.lora_B.weight": b}
            parts[i, proj] = (a, b)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "bias": "none"}
    (path / "adapter_config.json").write_text(
        json.dumps(config | {"target_modules": ["q_proj", "v_proj"]})
    )
    return parts


def test_lora_adapter_with_audio(tiny, tmp_path):
    """The checkpoint's speech adapter sent as a lora_request with an audio prompt (HF's
    `generate` enables it for audio): HF's model with the adapter merged, whether the adapter
    names the text model as the Hub's saves do (language_model.model.) or as transformers 5
    does (model.language_model.)."""
    from paged_engine import LoRARequest

    hub = write_speech_adapter(tmp_path / "hub", "language_model.model.")
    write_speech_adapter(tmp_path / "v5", "model.language_model.")
    hf = _HF(tiny)
    layers = hf.model.model.language_model.layers
    with torch.no_grad():
        for (i, proj), (a, b) in hub.items():
            getattr(layers[i].self_attn, proj).weight += 2.0 * (b @ a)
    clip = noise_clip(21, 0.8)
    ids, ref = hf.greedy(ONE, [clip])
    llm = engine(tiny, enable_lora=True, max_lora_rank=4)
    prompt = {"prompt": ONE, "multi_modal_data": {"audio": clip}}
    for n, name in enumerate(("hub", "v5"), start=1):
        lora = LoRARequest(name, n, str(tmp_path / name))
        out = llm.generate([prompt], greedy(), lora_request=lora, use_tqdm=False)[0]
        assert out.prompt_token_ids == ids
        assert_matches(f"granite_speech lora {name}", out, ref)


def test_chat_input_audio_gives_the_offline_tokens(tiny):
    """The server's chat path: an input_audio part (base64 WAV) gives the offline tokens of the
    chat template's prompt."""
    check_chat_input_audio(engine(tiny), noise_clip(16, 1.2))


def test_bad_input_is_refused_by_name(tiny, tmp_path):
    llm = engine(tiny)
    clip = noise_clip(17, 0.5)
    cases = [
        ({"audio": [clip, clip]}, r"2 audio\(s\) but the prompt has 1"),
        ({"audio": (clip, -5)}, "sampling rate"),
        ({"audio": np.zeros(200, dtype=np.float32)}, "too short"),
        ({"audio": "clip.wav"}, "waveform"),
    ]
    for data, match in cases:
        with pytest.raises(ValueError, match=match):
            llm.generate([{"prompt": ONE, "multi_modal_data": data}], greedy(0), use_tqdm=False)
    with pytest.raises(ValueError, match="mm_processor_kwargs"):
        prompt = {"prompt": ONE, "multi_modal_data": {"audio": clip}}
        llm.generate([{**prompt, "mm_processor_kwargs": {"fps": 2}}], greedy(0), use_tqdm=False)
    out = llm.generate([{"prompt": ONE, "multi_modal_data": {"audio": clip}}], greedy(0))[0]
    assert len(out.outputs[0].token_ids) == 8  # still serving

    # the host refuses checkpoints whose audio it cannot run as HF does
    tokenizer = llm.get_tokenizer()
    other = shutil.copytree(tiny, tmp_path / "other")
    saved = json.loads((other / "processor_config.json").read_text())
    saved["audio_processor"]["projector_window_size"] = 5
    (other / "processor_config.json").write_text(json.dumps(saved))
    config = transformers.AutoConfig.from_pretrained(other)
    with pytest.raises(
        ValueError, match=r"projector_window_size 5 differs from config\.window_size"
    ):
        GraniteSpeechAudio(other, config, tokenizer)
