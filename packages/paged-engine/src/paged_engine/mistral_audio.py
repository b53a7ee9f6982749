"""Voxtral (Voxtral-Mini-3B-2507, Voxtral-Small-24B-2507) in Mistral's native format (vLLM's
`VoxtralForConditionalGeneration` with config / load / tokenizer format "mistral"):
params.json's `multimodal.whisper_model_args` section, the consolidated `mm_whisper_embeddings.*`
tensors, tekken.json's [AUDIO] / [BEGIN_AUDIO] specials and its `audio` section.

    wrapper = audio_wrapper_config(params["multimodal"], text_config, path)  # VoxtralConfig
    name = audio_hf_name("mm_whisper_embeddings.whisper_encoder.conv_layers.0.weight")
    extractor = native_feature_extractor(path)              # HF's WhisperFeatureExtractor

The checkpoint is mapped onto the HF form paged already serves (multimodal/voxtral.py), as
transformers' convert_voxtral_weights_to_hf.py does, so the model code is shared:
    encoder_args (dim, n_layers, n_heads, hidden_dim, audio_encoding_args.num_mel_bins,
        max_source_positions)  -> VoxtralEncoderConfig (a Whisper encoder, GELU, no rotary:
        its wq / wk rows stay as they are)
    downsample_args.downsample_factor 4  -> the 4-row stack into the projector; HF's projector
        reads audio_config.intermediate_size wide rows, so hidden_dim must be 4 * dim
    audio_language_projection.0 / .2 (no biases, exact GELU between) -> multi_modal_projector
    mm_whisper_embeddings.tok_embeddings -> the text model's embed_tokens
The encoder's positions are not in the checkpoint (vLLM builds them): Whisper's sinusoids
(sin | cos halves, timescales 1 .. 10^4) are yielded as audio_tower.embed_positions.weight.

Audio: mistral_common (vLLM's mistral tokenizer) pads a clip with zeros to a multiple of
tekken.json's audio.chunk_length_s, takes a Whisper log-mel spectrogram of the whole padded clip
(window_size-point STFT every hop_length samples, num_mel_bins Slaney mels up to 8 kHz, log10
clamped at max - 8, (x + 4) / 4) and writes [BEGIN_AUDIO] then ceil(frames / 8) [AUDIO] (8 =
sampling_rate / frame_rate / hop_length). HF's WhisperFeatureExtractor with those settings and
paged's Voxtral host (padding to whole windows) compute the same features and count.
Refused by name: a field paged does not map, a causal (Voxtral Realtime) or sliding-window
encoder, a downsample factor other than 4, global_log_mel_max, a streaming transcription
format, a tekken.json audio section that disagrees with params.json, no chunk_length_s.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import torch

AUDIO_FIELD = "multimodal"
WHISPER = "whisper_model_args"
MERGE = 4  # tower rows per projector row (multimodal/voxtral.py's)
_AUDIO_ID = 24  # mistral_common's [AUDIO], where there is no tekken.json to read it from
_WHERE = f"params.json {AUDIO_FIELD}.{WHISPER}"
_ENCODER = {"audio_encoding_args", "dim", "n_layers", "head_dim", "hidden_dim", "n_heads"}
_ENCODER |= {"vocab_size", "max_source_positions", "n_kv_heads"}
# encoder fields taken at the value Voxtral's (non-causal Whisper) encoder has, refused otherwise
_NEUTRAL = {"causal": False, "pos_embed": "sinusoidal", "use_biases": True}
_ENCODING = {"sampling_rate", "num_mel_bins", "hop_length", "window_size"}
_ENCODING_TAKEN = {"frame_rate", "chunk_length_s", "transcription_format"}  # cross-checked


def _dict(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a JSON object")
    return {k: v for k, v in value.items() if v is not None}


def _need(section: dict[str, Any], name: str, where: str) -> Any:
    if name not in section:
        raise ValueError(f"{where}.{name} is missing")
    return section[name]


def encoder_args(multimodal: Any) -> tuple[dict[str, Any], dict[str, Any], int]:
    """(encoder_args, its audio_encoding_args, downsample factor) of params.json's
    `multimodal` section, each field checked (ValueError naming it)."""
    multimodal = _dict(multimodal, f"params.json {AUDIO_FIELD}")
    extra = sorted(set(multimodal) - {WHISPER})
    if extra or WHISPER not in multimodal:
        raise ValueError(
            f"params.json {AUDIO_FIELD} fields {extra or sorted(multimodal)} are not mapped by "
            f"paged (only {WHISPER!r}: Voxtral's audio encoder)"
        )
    whisper = _dict(multimodal[WHISPER], _WHERE)
    extra = sorted(set(whisper) - {"encoder_args", "downsample_args"})
    if extra:
        raise ValueError(f"{_WHERE} fields {extra} are not mapped by paged")
    where = f"{_WHERE}.encoder_args"
    enc = _dict(_need(whisper, "encoder_args", _WHERE), where)
    for field, value in _NEUTRAL.items():
        if enc.pop(field, value) != value:
            raise ValueError(f"{where}.{field} other than {value!r} is not supported")
    unknown = sorted(set(enc) - _ENCODER)
    if unknown:
        raise ValueError(f"{where} fields {unknown} are not mapped by paged")
    audio = _dict(_need(enc, "audio_encoding_args", where), f"{where}.audio_encoding_args")
    unknown = sorted(set(audio) - _ENCODING - _ENCODING_TAKEN)
    if unknown:  # global_log_mel_max (Realtime's fixed clamp) among them
        raise ValueError(f"{where}.audio_encoding_args fields {unknown} are not mapped by paged")
    down = _dict(_need(whisper, "downsample_args", _WHERE), f"{_WHERE}.downsample_args")
    factor = _need(down, "downsample_factor", f"{_WHERE}.downsample_args")
    if factor != MERGE or set(down) != {"downsample_factor"}:
        raise ValueError(
            f"{_WHERE}.downsample_args={down}: only downsample_factor={MERGE} is supported"
        )
    return enc, audio, MERGE


def audio_wrapper_config(multimodal: Any, text: Any, path: Path) -> Any:
    """The HF VoxtralConfig of params.json's `multimodal` section around the text model's
    config `text`; [AUDIO]'s id from `path`'s tekken.json."""
    import transformers

    enc, audio, factor = encoder_args(multimodal)
    where = f"{_WHERE}.encoder_args"
    dim, heads = int(_need(enc, "dim", where)), int(_need(enc, "n_heads", where))
    hidden = int(_need(enc, "hidden_dim", where))
    if int(enc.get("head_dim", dim // heads)) * heads != dim:
        raise ValueError(f"{where}.head_dim={enc['head_dim']} must be dim / n_heads (Whisper's)")
    if int(enc.get("n_kv_heads", heads)) != heads:
        raise ValueError(f"{where}.n_kv_heads={enc['n_kv_heads']} must be n_heads (Whisper's)")
    if hidden != factor * dim:
        raise ValueError(
            f"{where}.hidden_dim={hidden}: HF's Voxtral projector reads audio_config."
            f"intermediate_size rows, so it must be downsample_factor * dim = {factor * dim}"
        )
    tower = transformers.VoxtralEncoderConfig(
        hidden_size=dim,
        intermediate_size=hidden,
        num_hidden_layers=int(_need(enc, "n_layers", where)),
        num_attention_heads=heads,
        num_mel_bins=int(_need(audio, "num_mel_bins", f"{where}.audio_encoding_args")),
        max_source_positions=int(enc.get("max_source_positions", 1500)),  # Whisper's 30 s
        vocab_size=int(enc.get("vocab_size", 51866)),
        activation_function="gelu",
    )
    config = transformers.VoxtralConfig(
        text_config=text,
        audio_config=tower,
        audio_token_id=_special_id(path, "[AUDIO]", _AUDIO_ID),
        projector_hidden_act="gelu",  # vLLM's AudioLanguageAdapter: exact GELU
    )
    config.architectures = ["VoxtralForConditionalGeneration"]
    config.dtype = getattr(text, "dtype", None)
    return config


def _special_id(path: Path, token: str, default: int) -> int:
    from paged_engine.tekken import TEKKEN_FILE, read_tekken

    file = Path(path) / TEKKEN_FILE
    if not file.is_file():
        return default
    _, specials, _ = read_tekken(file)
    return specials.index(token) if token in specials else default


# consolidated name (after mm_whisper_embeddings.) -> HF name, first match wins
_AUDIO_NAMES = (
    (r"tok_embeddings\.weight", r"language_model.model.embed_tokens.weight"),
    (r"whisper_encoder\.conv_layers\.0\.(weight|bias)", r"audio_tower.conv1.\1"),
    (r"whisper_encoder\.conv_layers\.1\.(weight|bias)", r"audio_tower.conv2.\1"),
    (r"whisper_encoder\.transformer\.norm\.(weight|bias)", r"audio_tower.layer_norm.\1"),
    (r"whisper_encoder\.transformer\.layers\.(\d+)\.attention\.w([qkv])\.(weight|bias)",
     r"audio_tower.layers.\1.self_attn.\2_proj.\3"),
    (r"whisper_encoder\.transformer\.layers\.(\d+)\.attention\.wo\.(weight|bias)",
     r"audio_tower.layers.\1.self_attn.out_proj.\2"),
    (r"whisper_encoder\.transformer\.layers\.(\d+)\.attention_norm\.(weight|bias)",
     r"audio_tower.layers.\1.self_attn_layer_norm.\2"),
    (r"whisper_encoder\.transformer\.layers\.(\d+)\.feed_forward\.w([12])\.(weight|bias)",
     r"audio_tower.layers.\1.fc\2.\3"),
    (r"whisper_encoder\.transformer\.layers\.(\d+)\.ffn_norm\.(weight|bias)",
     r"audio_tower.layers.\1.final_layer_norm.\2"),
    (r"audio_language_projection\.0\.weight", r"multi_modal_projector.linear_1.weight"),
    (r"audio_language_projection\.2\.weight", r"multi_modal_projector.linear_2.weight"),
)  # fmt: skip
_PREFIX = "mm_whisper_embeddings."
POSITIONS = "audio_tower.embed_positions.weight"


def audio_hf_name(name: str) -> str | None:
    """The HF name (as transformers saves VoxtralForConditionalGeneration) of a consolidated
    `mm_whisper_embeddings.*` tensor; None for any other; ValueError for one paged does not
    know."""
    if not name.startswith(_PREFIX):
        return None
    rest = name.removeprefix(_PREFIX)
    for pattern, new in _AUDIO_NAMES:
        if re.fullmatch(pattern, rest):
            return re.sub(pattern, new, rest)
    raise ValueError(f"load_format='mistral': unknown tensor {name!r} in the consolidated weights")


def sinusoid_positions(length: int, channels: int) -> torch.Tensor:
    """Whisper's fixed positions [length, channels]: sin of t / 10^(4 i / (C/2 - 1)) in the
    first half, cos in the second (i < C/2)."""
    half = channels // 2
    rates = torch.exp(-math.log(10_000) / (half - 1) * torch.arange(half, dtype=torch.float32))
    angles = torch.arange(length, dtype=torch.float32)[:, None] * rates[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=1)


def audio_positions(params: dict[str, Any]) -> tuple[int, int] | None:
    """(max_source_positions, dim) of the encoder params.json describes, None without one."""
    if params.get(AUDIO_FIELD) is None:
        return None
    enc, _, _ = encoder_args(params[AUDIO_FIELD])
    return int(enc.get("max_source_positions", 1500)), int(enc["dim"])


def native_feature_extractor(path: Path) -> Any:
    """HF's WhisperFeatureExtractor as mistral_common computes Voxtral's features (see the
    module docstring): tekken.json's `audio` section, checked against params.json's
    audio_encoding_args."""
    import transformers

    from paged_engine.mistral_format import read_params
    from paged_engine.tekken import TEKKEN_FILE

    params = read_params(Path(path))
    _, ours, factor = encoder_args(params.get(AUDIO_FIELD))
    file = Path(path) / TEKKEN_FILE
    data = json.loads(file.read_text(encoding="utf-8")) if file.is_file() else {}
    theirs = _dict(data.get("audio") or {}, "tekken.json audio")
    if not theirs:
        raise ValueError(f"{path}: no tekken.json `audio` section (Voxtral's audio settings)")
    encoding = _dict(theirs.get("audio_encoding_config") or {}, "tekken.json audio")
    got = {**encoding, **{k: theirs[k] for k in ("sampling_rate",) if k in theirs}}
    got |= {k: theirs[k] for k in _ENCODING_TAKEN if k in theirs}
    for field in _ENCODING | _ENCODING_TAKEN:
        if field in ours and field in got and ours[field] != got[field]:
            raise ValueError(
                f"tekken.json audio {field}={got[field]!r} is not {_WHERE}.encoder_args."
                f"audio_encoding_args.{field}={ours[field]!r}"
            )
    settings = {**ours, **got}
    missing = sorted(f for f in _ENCODING | {"frame_rate", "chunk_length_s"} if f not in settings)
    if missing:
        raise ValueError(f"tekken.json audio: {missing} missing (Voxtral's audio settings)")
    streaming = settings.get("transcription_format", "instruct") != "instruct"
    if streaming or theirs.get("transcription_delay_ms") is not None:
        raise ValueError(
            "tekken.json audio.transcription_format / transcription_delay_ms: streaming "
            "(Voxtral Realtime) is not supported"
        )
    rate, hop = int(settings["sampling_rate"]), int(settings["hop_length"])
    per_token = int(rate // float(settings["frame_rate"])) // hop
    if per_token != 2 * factor:  # mel frames per [AUDIO]: the conv's 2 times the stack's 4
        raise ValueError(
            f"tekken.json audio.frame_rate={settings['frame_rate']}: {per_token} mel frames a "
            f"token, but the encoder gives one per {2 * factor}"
        )
    chunk = float(settings["chunk_length_s"])
    if not chunk.is_integer() or chunk <= 0:
        raise ValueError(f"tekken.json audio.chunk_length_s={chunk} must be whole seconds")
    return transformers.WhisperFeatureExtractor(
        feature_size=int(settings["num_mel_bins"]),
        sampling_rate=rate,
        hop_length=hop,
        n_fft=int(settings["window_size"]),
        chunk_length=int(chunk),
    )


def native_audio(path: Path) -> bool:
    """Whether `path` is a native Voxtral checkpoint read from params.json: no config.json
    (vLLM's "auto" reading) and a `multimodal` section."""
    from paged_engine.mistral_format import native_section

    return native_section(path, AUDIO_FIELD)


def native_audio_config(path: Path) -> Any | None:
    """The HF VoxtralConfig of a native Voxtral checkpoint (mistral_format.py reads it), None
    for any other (the caller reads config.json)."""
    from paged_engine.mistral_format import mistral_wrapper_config

    return mistral_wrapper_config(Path(path)) if native_audio(path) else None
