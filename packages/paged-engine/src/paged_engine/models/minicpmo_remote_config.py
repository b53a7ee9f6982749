"""MiniCPM-o 2.6's remote config (`MiniCPMO`, model_type "minicpmo": openbmb/MiniCPM-o-2_6)
read without its remote code (models/remote_aliases.py's REMOTE_CONFIGS row), as vLLM's
minicpmo.py reads it: MiniCPM-V 2.6's fields (models/minicpmv_remote_config.py translates
them) plus the audio input's.

    version 2.6                                   the only one served (MiniCPM-V 2.6's image
                                                  path and Qwen2 LM)
    audio_config {d_model, encoder_layers, encoder_attention_heads, encoder_ffn_dim,
        num_mel_bins, max_source_positions, activation_function; model_type "whisper"}
                                                  -> audio_config: WhisperConfig (`apm`, the
        Whisper-medium encoder)
    audio_pool_step (2), audio_chunk_length (1.0) kept: the pooling after the projection, the
        encoder's block-causal attention chunk (50 frames a second)
    tts_config, init_tts, stream_input            not read: the TTS is output-only (vLLM does
        not run it; its `tts.*` weights are skipped)

Refused by name: a `version` other than 2.6, init_vision / init_audio false (the checkpoint
lacks a tower the prompt processing expects), audio_pool_step other than 2 (the release
processor's placeholder count hard-codes 2), audio_chunk_length other than 1.0 (vLLM's
placeholder chunks are 1 s), an audio_config whose encoder_ffn_dim is not 4 x d_model (vLLM's
projection takes encoder_ffn_dim // 4 inputs, the encoder gives d_model), and whatever
minicpmv_remote_config refuses.
"""

from __future__ import annotations

from typing import Any

import transformers

from paged_engine.models.minicpmv_remote_config import (
    MiniCPMVRemoteConfig,
    minicpmv_remote_config,
    version,
)
from paged_engine.models.remote_aliases import RawConfig, field

_AUDIO_INTS = (
    "d_model",
    "encoder_layers",
    "encoder_attention_heads",
    "encoder_ffn_dim",
    "num_mel_bins",
    "max_source_positions",
)


def _refuse(name: str, value: Any, want: str) -> ValueError:
    return ValueError(f"MiniCPMO: config.json field {name}={value!r} is not supported: {want}")


def _audio_config(raw: RawConfig) -> transformers.WhisperConfig:
    audio = raw.get("audio_config")
    if not isinstance(audio, dict):
        raise _refuse("audio_config", audio, "a dict (the Whisper encoder's fields)")
    if audio.get("model_type", "whisper") != "whisper":
        raise _refuse("audio_config.model_type", audio["model_type"], "'whisper'")
    fields = {k: field(audio, k, int) for k in _AUDIO_INTS}
    if fields["encoder_ffn_dim"] != 4 * fields["d_model"]:
        raise _refuse(
            "audio_config.encoder_ffn_dim",
            fields["encoder_ffn_dim"],
            f"4 x d_model = {4 * fields['d_model']} (the projection's input width)",
        )
    return transformers.WhisperConfig(
        **fields, activation_function=audio.get("activation_function", "gelu")
    )


def minicpmo_remote_config(raw: RawConfig) -> MiniCPMVRemoteConfig:
    """MiniCPM-V 2.6's translated config with audio_config, audio_pool_step and
    audio_chunk_length set (see the module doc); ValueError naming a field not served."""
    if version(raw) != "2.6":
        raise _refuse("version", raw.get("version"), "2.6 (MiniCPM-o 2.6)")
    for name in ("init_vision", "init_audio"):
        if not raw.get(name, True):
            raise _refuse(name, raw[name], "true (the release's)")
    pool = field(raw, "audio_pool_step", int, 2)
    if pool != 2:
        raise _refuse("audio_pool_step", pool, "2 (the release processor's placeholder count)")
    chunk = field(raw, "audio_chunk_length", float, 1.0)
    if chunk != 1.0:
        raise _refuse("audio_chunk_length", chunk, "1.0 (vLLM's 1 s placeholder chunks)")
    audio = _audio_config(raw)
    config = minicpmv_remote_config({**raw, "architectures": ["MiniCPMO"]})
    config.audio_config = audio
    config.audio_pool_step = pool
    config.audio_chunk_length = chunk
    return config
