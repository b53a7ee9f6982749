"""MiDashengLM's remote config (`MiDashengLMModel`, model_type "midashenglm":
mispeech/midashenglm-7b) read without its remote code (models/remote_aliases.py's
REMOTE_CONFIGS row), as vLLM's transformers_utils/configs/midashenglm.py reads it.

    text_config (Qwen2.5-Omni's thinker text fields)  -> text_config: Qwen2Config (vLLM builds
        Qwen2ForCausalLM from it with rope_parameters cleared: 1-D positions, the plain rope;
        an M-RoPE rope_scaling is that rope at 1-D positions, any other rope is refused)
    audio_encoder_config (DashengConfig's fields)     -> audio_encoder_config: a
        PretrainedConfig holding them, the release defaults where absent
    subsample_factor (5), audio_token_id              kept

Refused by name, as vLLM's code runs only these shapes (multimodal/midashenglm.py): a patch
other than one n_mels x 4 patch a time step (vLLM's mask and token count assume 4 mel frames a
patch and one patch row), hop_length other than 160 and subsample_factor other than 5 (vLLM's
placeholder count hard-codes both), center false, f_min / f_max other than 0 / sample_rate / 2,
win_length over n_fft, a target_length that is no multiple of 4, use_sliding_window.
"""

from __future__ import annotations

from typing import Any

import transformers

from paged_engine.models.remote_aliases import RawConfig, field, qwen2_text_fields

# DashengConfig's defaults (the release's encoder where config.json leaves a field out)
_DASHENG: dict[str, Any] = {
    "embed_dim": 768,
    "patch_size": 16,
    "patch_stride": 16,
    "input_channels": 1,
    "target_length": 1012,
    "depth": 12,
    "num_heads": 12,
    "mlp_ratio": 4.0,
    "qkv_bias": True,
    "init_values": None,
    "f_min": 0.0,
    "f_max": 8000.0,
    "center": True,
    "win_length": 512,
    "hop_length": 160,
    "sample_rate": 16000,
    "n_fft": 512,
    "n_mels": 64,
}
HOP = 160  # vLLM's calculate_mel_frames_dasheng: hop_size 160, 4 frames a patch, 5 patches a row
FRAMES_PER_PATCH = 4
SUBSAMPLE = 5


class MiDashengLMConfig(transformers.PretrainedConfig):
    """The wrapper: text_config (Qwen2), audio_encoder_config (Dasheng), subsample_factor,
    audio_token_id."""

    model_type = "midashenglm"


def _refuse(name: str, value: Any, want: str) -> ValueError:
    return ValueError(f"MiDashengLM: config.json field {name}={value!r} is not supported: {want}")


def _pair(value: Any, name: str) -> tuple[int, int]:
    pair = (value, value) if isinstance(value, int) and not isinstance(value, bool) else value
    if (
        not isinstance(pair, (list, tuple))
        or len(pair) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in pair)
    ):
        raise _refuse(name, value, "a positive int or a pair of them")
    return int(pair[0]), int(pair[1])


def _audio_config(raw: RawConfig) -> transformers.PretrainedConfig:
    given = raw.get("audio_encoder_config") or {}
    if not isinstance(given, dict):
        raise _refuse("audio_encoder_config", given, "a dict (DashengConfig's fields)")
    audio = {**_DASHENG, **{k: v for k, v in given.items() if v is not None}}
    name = "audio_encoder_config"
    for key in ("embed_dim", "depth", "num_heads", "n_fft", "win_length", "n_mels"):
        audio[key] = field(audio, key, int)
    for key in ("target_length", "sample_rate", "hop_length", "input_channels"):
        audio[key] = field(audio, key, int)
    for key in ("mlp_ratio", "f_min", "f_max"):
        audio[key] = float(audio[key])
    patch = _pair(audio["patch_size"], f"{name}.patch_size")
    stride = _pair(audio["patch_stride"], f"{name}.patch_stride")
    want_patch = (audio["n_mels"], FRAMES_PER_PATCH)
    if patch != want_patch or stride != want_patch:
        raise _refuse(
            f"{name}.patch_size / patch_stride",
            (audio["patch_size"], audio["patch_stride"]),
            f"both {list(want_patch)} (n_mels x {FRAMES_PER_PATCH}: vLLM's frame mask)",
        )
    checks = [
        ("hop_length", audio["hop_length"] == HOP, f"{HOP} (vLLM's placeholder count)"),
        ("center", audio["center"] is True, "true"),
        ("f_min", audio["f_min"] == 0.0, "0"),
        ("f_max", audio["f_max"] == audio["sample_rate"] / 2, "sample_rate / 2"),
        ("win_length", audio["win_length"] <= audio["n_fft"], "at most n_fft"),
        ("target_length", audio["target_length"] % FRAMES_PER_PATCH == 0, "a multiple of 4"),
        ("input_channels", audio["input_channels"] == 1, "1 (mono)"),
        ("embed_dim", audio["embed_dim"] % audio["num_heads"] == 0, "a multiple of num_heads"),
    ]
    for key, ok, want in checks:
        if not ok:
            raise _refuse(f"{name}.{key}", audio[key], want)
    audio["patch_size"], audio["patch_stride"] = list(patch), list(stride)
    return transformers.PretrainedConfig(**audio)


def _text_config(raw: RawConfig) -> transformers.Qwen2Config:
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise _refuse("text_config", text, "a dict (the Qwen2.5 decoder's fields)")
    ids = ("bos_token_id", "eos_token_id", "pad_token_id")  # (the top level's where it has none)
    text = {**{k: raw[k] for k in ids if raw.get(k) is not None}, **text}
    rope = text.get("rope_scaling") or text.get("rope_parameters")
    if isinstance(rope, dict):
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", "mrope") and "mrope_section" not in rope:
            raise _refuse("text_config.rope_scaling", rope, "none or M-RoPE (vLLM's plain rope)")
        theta = rope.get("rope_theta", text.get("rope_theta"))
        text = {**text, "rope_scaling": None, "rope_parameters": None, "rope_theta": theta}
    fields = qwen2_text_fields(text, "MiDashengLM")
    return transformers.Qwen2Config(**fields)


def midashenglm_config(raw: RawConfig) -> MiDashengLMConfig:
    """The translated config (see the module doc); ValueError naming a field not served."""
    text = _text_config(raw)
    subsample = field(raw, "subsample_factor", int, SUBSAMPLE)
    if subsample != SUBSAMPLE:
        raise _refuse("subsample_factor", subsample, f"{SUBSAMPLE} (vLLM's placeholder count)")
    token = raw.get("audio_token_id")
    if token is not None and (not isinstance(token, int) or not 0 <= token < text.vocab_size):
        raise _refuse("audio_token_id", token, f"a token id below vocab_size {text.vocab_size}")
    return MiDashengLMConfig(
        architectures=list(raw.get("architectures") or ["MiDashengLMModel"]),
        text_config=text,
        audio_encoder_config=_audio_config(raw),
        subsample_factor=subsample,
        audio_token_id=token,
        bos_token_id=text.bos_token_id,
        eos_token_id=text.eos_token_id,
        pad_token_id=text.pad_token_id,
        tie_word_embeddings=text.tie_word_embeddings,
    )
