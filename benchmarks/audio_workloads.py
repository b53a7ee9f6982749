"""benchmarks/audio.py's workloads: its presets, synthetic speech clips and prompts, and the
seeded random-weight models both systems load (HF dirs materialised from configs/<name>/)."""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import free_memory
from benchmarks.models import CONFIG_DIR, write_tokenizer

SR = 16_000
# Qwen2-Audio's <|audio_bos|> / <|audio_eos|> (its tokenizer's ids; <|AUDIO|> is the config's
# audio_token_index); the text around a clip is random word ids
AUDIO_BOS, AUDIO_EOS = 151647, 151648


@dataclass(frozen=True, slots=True)
class Preset:
    whisper: str  # a dir under configs/
    llm: str
    clips: int
    seconds: tuple[float, float]
    max_tokens: int
    llm_clips: int
    llm_seconds: tuple[float, float]
    llm_max_tokens: int
    hf_batch_size: int
    whisper_overrides: dict = field(default_factory=dict)
    llm_overrides: dict = field(default_factory=dict)


# CPU: the audio LLM keeps Qwen2-Audio-7B's tower width, window and vocabulary but 2 of its
# 32 tower layers and a 2-layer, 1024-wide text model (the 7B is 33 GB in float32).
QWEN2_AUDIO_CPU = {
    "audio_config": {"encoder_layers": 2},
    "text_config": {
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 2,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
    },
}
_TINY_TOWER = {"d_model": 64, "encoder_layers": 1, "encoder_attention_heads": 2}
_TINY_TOWER |= {"encoder_ffn_dim": 128}
_TINY_TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1}
_TINY_TEXT |= {"num_attention_heads": 2, "num_key_value_heads": 2}
_TINY_DECODER = {"decoder_layers": 1, "decoder_attention_heads": 2, "decoder_ffn_dim": 128}
_TINY_DECODER |= {"init_std": 0.2}  # weights large enough that each clip moves the logprobs
_BOTH = {"whisper": "whisper-tiny", "llm": "qwen2-audio-7b"}
PRESETS = {
    "gpu": Preset(
        whisper="whisper-large-v3",
        llm="qwen2-audio-7b",
        clips=64,
        seconds=(10, 30),
        max_tokens=100,
        llm_clips=64,
        llm_seconds=(10, 30),
        llm_max_tokens=100,
        hf_batch_size=64,
    ),
    "cpu": Preset(
        **_BOTH,
        clips=16,
        seconds=(10, 30),
        max_tokens=100,
        llm_clips=8,
        llm_seconds=(5, 15),
        llm_max_tokens=32,
        hf_batch_size=16,
        llm_overrides=QWEN2_AUDIO_CPU,
    ),
    # the harness on tiny sizes (tests/benchmarks): one-layer models, 64 wide
    "tiny": Preset(
        **_BOTH,
        clips=3,
        seconds=(1, 4),
        max_tokens=4,
        llm_clips=2,
        llm_seconds=(1, 3),
        llm_max_tokens=3,
        hf_batch_size=2,
        whisper_overrides={**_TINY_TOWER, **_TINY_DECODER},
        llm_overrides={"audio_config": _TINY_TOWER, "text_config": _TINY_TEXT},
    ),
}


# ---- inputs -------------------------------------------------------------------------------------
def speech_clip(seed: int, seconds: float) -> np.ndarray:
    """Speech-like mono float32 at 16 kHz: 7 harmonics of a pitch drifting around 100-160 Hz,
    gated by a ~4 Hz syllable envelope, with breath noise between syllables."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * SR)) / SR
    f0 = 100 + 60 * rng.random() + 15 * np.sin(2 * np.pi * rng.uniform(0.2, 0.6) * t)
    phase = 2 * np.pi * np.cumsum(f0) / SR
    voiced = sum(np.sin(k * phase) / k for k in range(1, 8))
    rate = rng.uniform(3.0, 5.0)
    envelope = np.clip(np.sin(2 * np.pi * rate * t + rng.uniform(0, 2 * np.pi)), 0, None)
    wave = 0.3 * voiced * envelope + 0.02 * rng.standard_normal(t.size) * (1 - envelope)
    return (wave / np.abs(wave).max() * 0.5).astype(np.float32)


def clip_set(n: int, seconds: tuple[float, float], seed: int) -> list[np.ndarray]:
    rng = random.Random(seed)
    return [speech_clip(seed * 1000 + i, rng.uniform(*seconds)) for i in range(n)]


def whisper_prefix(cfg: dict) -> list[int]:
    """<|startoftranscript|><|en|><|transcribe|><|notimestamps|> from the config alone: in the
    released vocabularies 1501 timestamp ids end it, <|notimestamps|> just before them, the
    task ids 4 and 5 before that, <|en|> right after <|startoftranscript|>."""
    no_ts = cfg["vocab_size"] - 1502
    start = cfg["decoder_start_token_id"]
    return [start, start + 1, no_ts - 4, no_ts]


def llm_prompt(rows: int, seed: int, audio_token: int) -> list[int]:
    """8 random word ids, the clip's run, 8 more: the same ids for paged and HF."""
    rng = random.Random(seed)
    words = [rng.randrange(10, 10000) for _ in range(16)]
    return words[:8] + [AUDIO_BOS] + [audio_token] * rows + [AUDIO_EOS] + words[8:]


# ---- models -------------------------------------------------------------------------------------
def merged(base: dict, overrides: dict) -> dict:
    """`base` with `overrides` applied, nested dicts (audio_config, text_config) merged."""
    out = dict(base)
    for k, v in overrides.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def materialize(name: str, overrides: dict, work_dir: Path, dtype: torch.dtype, device: str):
    """An HF dir with seeded random weights for configs/<name>/ (+ overrides): returns (dir,
    config dict). Reused when it holds the same config and dtype."""
    import transformers

    src = CONFIG_DIR / name
    cfg = merged(json.loads((src / "config.json").read_text()), overrides)
    pre = json.loads((src / "preprocessor_config.json").read_text())
    stamp = {"config": cfg, "preprocessor": pre, "dtype": str(dtype), "seed": 0}
    key = json.dumps(overrides, sort_keys=True).encode()
    tag = "-" + hashlib.sha1(key).hexdigest()[:8] if overrides else ""
    out = work_dir / f"{name}{tag}-{str(dtype).removeprefix('torch.')}"
    stamp_file = out / "bench_stamp.json"
    if stamp_file.exists() and json.loads(stamp_file.read_text()) == stamp:
        return out, cfg
    out.mkdir(parents=True, exist_ok=True)
    hf_cfg = transformers.AutoConfig.for_model(**cfg)
    cls = getattr(transformers, cfg["architectures"][0])
    torch.manual_seed(0)
    with torch.device(device):
        model = cls._from_config(hf_cfg, dtype=dtype)
    model.save_pretrained(out, safe_serialization=True)
    del model
    free_memory(device)
    (out / "preprocessor_config.json").write_text(json.dumps(pre, indent=1))
    text = cfg.get("text_config", cfg)
    write_tokenizer(out, cfg["vocab_size"], text.get("bos_token_id"), text.get("eos_token_id"))
    if cfg["model_type"] == "whisper":  # what generate(language=, task=) looks up
        sot, en, transcribe, no_ts = whisper_prefix(cfg)
        gen = {
            "decoder_start_token_id": sot,
            "bos_token_id": cfg["bos_token_id"],
            "eos_token_id": cfg["eos_token_id"],
            "pad_token_id": cfg["pad_token_id"],
            "max_length": cfg["max_target_positions"],
            "is_multilingual": True,
            "lang_to_id": {"<|en|>": en},
            "task_to_id": {"transcribe": transcribe, "translate": transcribe - 1},
            "no_timestamps_token_id": no_ts,
        }
        (out / "generation_config.json").write_text(json.dumps(gen, indent=1))
    stamp_file.write_text(json.dumps(stamp))
    return out, cfg


def load_hf(path: Path, cfg: dict, dtype: torch.dtype, device: str):
    import transformers

    cls = getattr(transformers, cfg["architectures"][0])
    return cls.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device).eval()


def feature_extractor(path: Path):
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor.from_pretrained(path)
