"""Voxtral in Mistral's native format (mistral_audio.py, vLLM's VoxtralForConditionalGeneration
with config / load / tokenizer format "mistral").

A tiny random HF VoxtralForConditionalGeneration (a 2-layer Whisper encoder over 16 mel bins,
windows of 4 s = 400 frames, max_source_positions 200, Whisper's sinusoid positions as the real
checkpoints have them) is rewritten here as Mistral ships it: params.json with a
`multimodal.whisper_model_args` section, consolidated.safetensors under Mistral's names
(transformers' convert_voxtral_weights_to_hf.py table read backwards, text wq / wk rows back in
the interleaved rotary layout, no positions) and a byte-level tekken.json (the Pixtral test's
writer) whose specials sit at mistral_common's ids ([AUDIO] 24, [BEGIN_AUDIO] 25, [TRANSCRIBE]
34) with an `audio` section (16 kHz, 12.5 frames/s, chunk_length_s 4). The engine on that
directory must give mistral_common's prompt ([BOS][INST][BEGIN_AUDIO][AUDIO] x ceil(frames / 8)
text [/INST]) and HF's greedy tokens and top-5 logprobs with VoxtralProcessor's features
(WhisperFeatureExtractor at the same settings). Also: the weights equal the HF checkpoint's,
and what paged does not map is refused by name.
"""

from __future__ import annotations

import json
import math
import shutil
import types
from pathlib import Path

import pytest
import torch
from audio_checks import noise_clip
from hf_parity import write_hf_checkpoint
from hf_reference import assert_matches, hf_greedy
from image_checks import engine, greedy
from safetensors.torch import load_file, save_file
from test_mistral_format import (
    assert_native_weights_are_hf,
    native_text_params,
    native_text_weight,
)
from test_mistral_format_vision import write_byte_tekken

from paged_engine.loader import load_hf_config, resolve_model
from paged_engine.testing import tiny_config

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.voxtral")

# mistral_common's v7 specials, then Voxtral's audio ones at their ids (the rest unnamed)
SPECIALS = [
    "<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]",
    "[IMG_END]", "[PREFIX]", "[MIDDLE]", "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
    "[TOOL_CONTENT]",
]  # fmt: skip
NUM_SPECIAL = 36
AUDIO, BEGIN, TRANSCRIBE, BOS, INST, END_INST = 24, 25, 34, 1, 3, 4
MELS, POSITIONS, CHUNK, RATE = 16, 200, 4, 16_000  # a window: CHUNK s = 2 * POSITIONS frames
AUDIO_SECTION = {
    "sampling_rate": RATE,
    "frame_rate": 12.5,
    "audio_encoding_config": {"num_mel_bins": MELS, "hop_length": 160, "window_size": 400},
    "chunk_length_s": float(CHUNK),
}
# HF name -> Mistral's (convert_voxtral_weights_to_hf.py's table read backwards)
_AUDIO = (
    ("audio_tower.", "mm_whisper_embeddings.whisper_encoder."),
    ("conv1.", "conv_layers.0."),
    ("conv2.", "conv_layers.1."),
    ("encoder.layer_norm.", "encoder.transformer.norm."),
    ("encoder.layers.", "encoder.transformer.layers."),
    ("self_attn_layer_norm", "attention_norm"),
    ("self_attn.q_proj", "attention.wq"),
    ("self_attn.k_proj", "attention.wk"),
    ("self_attn.v_proj", "attention.wv"),
    ("self_attn.out_proj", "attention.wo"),
    ("final_layer_norm", "ffn_norm"),
    ("fc1", "feed_forward.w1"),
    ("fc2", "feed_forward.w2"),
    ("multi_modal_projector.linear_1", "mm_whisper_embeddings.audio_language_projection.0"),
    ("multi_modal_projector.linear_2", "mm_whisper_embeddings.audio_language_projection.2"),
)


def write_hf(path: Path) -> Path:
    from transformers.models.whisper.modeling_whisper import sinusoids

    text = tiny_config("mistral", vocab_size=NUM_SPECIAL + 256, rms_norm_eps=1e-5)
    audio = {"model_type": "voxtral_encoder", "hidden_size": 16, "intermediate_size": 64}
    audio |= {"num_hidden_layers": 2, "num_attention_heads": 2, "num_mel_bins": MELS}
    audio |= {"max_source_positions": POSITIONS}
    config = transformers.VoxtralConfig(text_config=text, audio_config=audio, audio_token_id=AUDIO)

    def positions(model) -> None:  # Whisper's fixed sinusoids (vLLM builds them, not random)
        model.model.audio_tower.embed_positions.weight.data.copy_(sinusoids(POSITIONS, 16))

    cls = transformers.VoxtralForConditionalGeneration
    return write_hf_checkpoint(path, cls, config, seed=5, adjust=positions)


def write_native(hf_dir: Path, out: Path) -> Path:
    """`hf_dir` as Mistral ships it: params.json, consolidated.safetensors, tekken.json."""
    out.mkdir(parents=True)
    cfg = json.loads((hf_dir / "config.json").read_text())
    text, audio = cfg["text_config"], cfg["audio_config"]
    heads, kv_heads = text["num_attention_heads"], text["num_key_value_heads"]
    encoder = {
        "audio_encoding_args": {"sampling_rate": RATE, "num_mel_bins": MELS}
        | {"hop_length": 160, "window_size": 400},
        "dim": audio["hidden_size"],
        "n_layers": audio["num_hidden_layers"],
        "head_dim": audio["hidden_size"] // audio["num_attention_heads"],
        "hidden_dim": audio["intermediate_size"],
        "n_heads": audio["num_attention_heads"],
        "vocab_size": audio["vocab_size"],
        "max_source_positions": audio["max_source_positions"],
    }
    params = {
        **native_text_params(text),
        "multimodal": {
            "whisper_model_args": {
                "encoder_args": encoder,
                "downsample_args": {"downsample_factor": 4},
            }
        },
    }
    weights = load_file(hf_dir / "model.safetensors")
    if "language_model.lm_head.weight" not in weights:
        params["tied_embeddings"] = True
    (out / "params.json").write_text(json.dumps(params))
    native = {}
    for name, w in weights.items():
        if name == "audio_tower.embed_positions.weight":
            continue  # not in Mistral's files: the loader builds it
        if name.startswith(("audio_tower.", "multi_modal_projector.")):
            for hf, ours in _AUDIO:
                name = name.replace(hf, ours)
        elif name == "language_model.model.embed_tokens.weight":
            name = "mm_whisper_embeddings.tok_embeddings.weight"
        else:
            name, w = native_text_weight(name.removeprefix("language_model."), w, heads, kv_heads)
        native[name] = w.contiguous()
    save_file(native, out / "consolidated.safetensors")
    write_byte_tekken(out, {})  # then Voxtral's specials and audio section in place of images
    data = json.loads((out / "tekken.json").read_text())
    names = {AUDIO: "[AUDIO]", BEGIN: "[BEGIN_AUDIO]", TRANSCRIBE: "[TRANSCRIBE]"}
    specials = [SPECIALS[i] if i < len(SPECIALS) else names.get(i) for i in range(NUM_SPECIAL)]
    data["special_tokens"] = [
        {"rank": i, "token_str": s or f"<SPECIAL_{i}>"} for i, s in enumerate(specials)
    ]
    data["config"] |= {"default_num_special_tokens": NUM_SPECIAL}
    data["config"] |= {"default_vocab_size": NUM_SPECIAL + 256}
    del data["image"]
    data["audio"] = AUDIO_SECTION
    (out / "tekken.json").write_text(json.dumps(data))
    return out


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> tuple[Path, Path]:
    hf_dir = write_hf(tmp_path_factory.mktemp("voxtral"))
    return hf_dir, write_native(hf_dir, tmp_path_factory.mktemp("n") / "voxtral")


def _ids(text: str) -> list[int]:
    return [NUM_SPECIAL + b for b in text.encode()]


def _count(clip) -> int:
    """mistral_common's [AUDIO] count: ceil(frames / 8) of the clip padded to whole chunks."""
    padded = math.ceil(clip.size / (RATE * CHUNK)) * RATE * CHUNK
    return math.ceil(padded // 160 / 8)


def _hf_features(clips: list) -> torch.Tensor:
    """VoxtralProcessor's features (its _retrieve_input_features) at the tekken settings."""
    extractor = transformers.WhisperFeatureExtractor(
        feature_size=MELS, sampling_rate=RATE, hop_length=160, n_fft=400, chunk_length=CHUNK
    )
    holder = types.SimpleNamespace(feature_extractor=extractor)
    return transformers.VoxtralProcessor._retrieve_input_features(
        holder,
        clips,
        max_source_positions=2 * POSITIONS,
        sampling_rate=RATE,
        padding=True,
        truncation=False,
        pad_to_multiple_of=RATE * CHUNK,
        return_tensors="pt",
    )


def test_native_checkpoint_serves_audio_like_hf(dirs):
    """One clip, two clips (one of two windows), text alone: mistral_common's ids from prompts
    with one [AUDIO] a clip, HF's tokens and top-5 logprobs; then the three "mistral" flags
    give the same tokens."""
    hf_dir, native = dirs
    model = transformers.VoxtralForConditionalGeneration.from_pretrained(
        hf_dir, dtype=torch.float32
    ).eval()
    model.generation_config.eos_token_id = None
    one, two, three = noise_clip(1, 1.3), noise_clip(2, 0.7), noise_clip(3, CHUNK + 1.1)
    cases = [(["What is it?", 0], [one]), ([0, " then ", 1, " Which?"], [two, three])]
    cases.append((["Say hi."], []))
    prompts, refs = [], []
    for parts, clips in cases:
        ids, ours = [BOS, INST], "[INST]"
        for part in parts:
            if isinstance(part, str):
                ids, ours = ids + _ids(part), ours + part
            else:
                ids += [BEGIN] + [AUDIO] * _count(clips[part])
                ours += "[AUDIO]"
        ids, ours = ids + [END_INST], ours + "[/INST]"
        extra = {"input_features": _hf_features(clips)} if clips else {}
        refs.append((ids, hf_greedy(model, ids, 8, 5, **extra)))
        prompts.append({"prompt": ours, "multi_modal_data": {"audio": clips}} if clips else ours)
    assert _count(three) == 2 * POSITIONS * 2 // 8
    outs = []
    for formats in (
        {},
        dict.fromkeys(("tokenizer_mode", "config_format", "load_format"), "mistral"),
    ):
        llm = engine(native, **formats)
        outs.append(llm.generate(prompts, greedy(), use_tqdm=False))
        llm.llm_engine.shutdown()
    for (ids, ref), out in zip(refs, outs[0], strict=True):
        assert out.prompt_token_ids == ids
        assert_matches("native voxtral", out, ref)
    assert [o.outputs[0].token_ids for o in outs[1]] == [ref.tokens for _, ref in refs]


def test_transcription_prompt_uses_tekken_specials(dirs):
    _, native = dirs
    llm = engine(native)
    prompt = llm.llm_engine.input_processor.audios.transcription_prompt("en", "transcribe", "")
    want = [BOS, INST, BEGIN, AUDIO, END_INST, *_ids("lang:en"), TRANSCRIBE]
    assert prompt["prompt_token_ids"] == want
    llm.llm_engine.shutdown()


def test_weights_and_config_are_the_hf_checkpoints(dirs):
    hf_dir, native = dirs
    assert_native_weights_are_hf(hf_dir, native)
    ours, theirs = load_hf_config(resolve_model(native)), load_hf_config(resolve_model(hf_dir))
    for field in ("hidden_size", "vocab_size", "tie_word_embeddings", "num_key_value_heads"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.text_only_of == theirs.text_only_of == "VoxtralForConditionalGeneration"


def _edited(native: Path, out: Path, encoder=None, tekken=None, **whisper) -> Path:
    shutil.copytree(native, out)
    params = json.loads((native / "params.json").read_text())
    args = params["multimodal"]["whisper_model_args"]
    args["encoder_args"] |= encoder or {}
    args |= whisper
    (out / "params.json").write_text(json.dumps(params))
    if tekken is not None:
        data = json.loads((native / "tekken.json").read_text())
        data["audio"] |= tekken
        (out / "tekken.json").write_text(json.dumps(data))
    return out


def test_unmapped_audio_fields_are_refused_by_name(dirs, tmp_path):
    from paged_engine.mistral_audio import audio_hf_name, native_feature_extractor

    _, native = dirs
    for i, (edit, match) in enumerate(
        [
            ({"encoder": {"causal": True}}, "causal"),
            ({"encoder": {"rope_theta": 1e6}}, "rope_theta"),
            ({"encoder": {"hidden_dim": 48}}, "hidden_dim"),
            ({"downsample_args": {"downsample_factor": 2}}, "downsample_factor"),
            ({"vision_encoder_args": {}}, "vision_encoder_args"),
        ]
    ):
        path = _edited(native, tmp_path / str(i), **edit)
        with pytest.raises(ValueError, match=match):
            load_hf_config(resolve_model(path))
    for i, (tekken, match) in enumerate(
        [
            ({"sampling_rate": 24_000}, "sampling_rate"),
            ({"frame_rate": 25.0}, "frame_rate"),
            ({"chunk_length_s": None}, "chunk_length_s"),
            ({"transcription_format": "streaming"}, "transcription_format"),
        ]
    ):
        path = _edited(native, tmp_path / f"t{i}", tekken=tekken)
        with pytest.raises(ValueError, match=match):
            native_feature_extractor(path)
    with pytest.raises(ValueError, match="unknown tensor"):
        audio_hf_name("mm_whisper_embeddings.whisper_encoder.transformer.layers.0.attention.wz")
