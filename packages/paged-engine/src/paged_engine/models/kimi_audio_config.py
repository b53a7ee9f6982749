"""Kimi-Audio's remote config (`MoonshotKimiaForCausalLM`, model_type "kimi_audio":
moonshotai/Kimi-Audio-7B-Instruct) read without its remote code (models/remote_aliases.py's
REMOTE_CONFIGS row), as vLLM's kimi_audio.py reads it.

    config.json (Qwen2's fields flat, kimia_* beside them)  -> text_config: Qwen2Config (vLLM
        builds Qwen2ForCausalLM from the same config: the main stack and lm_head, the text head)
    whisper-large-v3/config.json (a WhisperConfig)         -> audio_config (vLLM's tower config)
    kimia_adaptor_input_dim (5120: 4 Whisper frames)       -> kept; must be 4 * d_model
    audio_token_id: <|im_kimia_text_blank|>'s id (the tokenizer's, 151666 in the release: vLLM's
        KIMIA_TEXT_BLANK), the token a clip's placeholder run repeats

The MIMO branch (kimia_mimo_layers from kimia_mimo_transformer_from_layer_index, mimo_output)
is the audio-token head: vLLM serves text only and so does paged (its weights are passed over).
Refused by name: use_whisper_feature false (vLLM's path always adds the Whisper rows), an
adaptor width other than 4 * d_model, a missing whisper-large-v3/config.json.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import transformers

from paged_engine.models.remote_aliases import RawConfig, field, qwen2_text_fields

WHISPER_DIR = "whisper-large-v3"  # vLLM's KIMIA_WHISPER_SUBFOLDER
TEXT_BLANK = 151666  # vLLM's KimiAudioProcessor.KIMIA_TEXT_BLANK
FRAMES_PER_ROW = 4  # Whisper frames (50 Hz) folded into one adaptor row (12.5 Hz)


class KimiAudioConfig(transformers.PretrainedConfig):
    """The wrapper: text_config (Qwen2), audio_config (Whisper), kimia_adaptor_input_dim,
    audio_token_id, whisper_path (the tower's subfolder)."""

    model_type = "kimi_audio"


def _refuse(name: str, value: Any, want: str) -> ValueError:
    return ValueError(f"Kimi-Audio: config.json field {name}={value!r} is not supported: {want}")


def kimi_audio_config(raw: RawConfig) -> KimiAudioConfig:
    """The translated config (see the module doc); ValueError naming a field not served.
    `raw["_checkpoint"]` is the checkpoint folder (remote_config adds it)."""
    text = transformers.Qwen2Config(**qwen2_text_fields(raw, "Kimi-Audio"))
    if raw.get("use_whisper_feature", True) is not True:
        raise _refuse("use_whisper_feature", raw["use_whisper_feature"], "true (vLLM's path)")
    whisper = Path(raw["_checkpoint"]) / WHISPER_DIR
    if not (whisper / "config.json").is_file():
        raise ValueError(
            f"Kimi-Audio: {whisper}/config.json is missing: the Whisper tower's config (vLLM "
            f"reads the {WHISPER_DIR} subfolder)"
        )
    audio = transformers.WhisperConfig(**json.loads((whisper / "config.json").read_text()))
    width = field(raw, "kimia_adaptor_input_dim", int, FRAMES_PER_ROW * audio.d_model)
    if width != FRAMES_PER_ROW * audio.d_model:
        raise _refuse(
            "kimia_adaptor_input_dim",
            width,
            f"{FRAMES_PER_ROW} * d_model = "
            f"{FRAMES_PER_ROW * audio.d_model} (4 Whisper frames a row)",
        )
    token = raw.get("image_token_id")  # (remote_config: the tokenizer's id, where it has one)
    token = TEXT_BLANK if token is None else token
    if not isinstance(token, int) or not 0 <= token < text.vocab_size:
        raise ValueError(
            f"Kimi-Audio: <|im_kimia_text_blank|> (the audio placeholder) is id {token!r}, not "
            f"below vocab_size {text.vocab_size}"
        )
    return KimiAudioConfig(
        architectures=list(raw.get("architectures") or ["MoonshotKimiaForCausalLM"]),
        text_config=text,
        audio_config=audio,
        kimia_adaptor_input_dim=width,
        audio_token_id=token,
        whisper_path=str(whisper),
        bos_token_id=text.bos_token_id,
        eos_token_id=text.eos_token_id,
        pad_token_id=text.pad_token_id,
        tie_word_embeddings=text.tie_word_embeddings,
    )
