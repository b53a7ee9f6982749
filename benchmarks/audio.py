"""The audio paths against HF transformers: Whisper transcription, an audio LLM, the encoder alone.

    python -m benchmarks.audio --preset cpu      # whisper-tiny, Qwen2-Audio-7B scaled down
    python -m benchmarks.audio --preset gpu      # whisper-large-v3 and Qwen2-Audio-7B, bf16

Sections, each one model materialised once (HF random weights from `configs/<name>/`, seeded,
saved as safetensors with the config's feature extractor, a word-level tokenizer and, for
Whisper, a generation config with the language and task ids), loaded by paged and by HF:

- whisper: N synthetic speech-like clips (harmonics on a drifting pitch, syllable-rate
  envelope, noise; lengths drawn in --seconds) transcribed greedily, max_tokens each, EOS
  ignored: paged `LLM.generate` (decoder prompt <|startoftranscript|><|en|><|transcribe|>
  <|notimestamps|>, the clip in multi_modal_data) against HF
  `WhisperForConditionalGeneration.generate(language="en", task="transcribe")` on padded
  batches of --hf-batch-size clips (the same four-token prefix; its suppress-token processors
  off, as paged applies none).
- llm: Qwen2-Audio, each clip in a chat-like prompt whose <|AUDIO|> run is already expanded to
  the clip's rows (the same ids for both systems): paged `LLM.generate` against HF `generate`
  on left-padded batches with the features and their masks.
- encoder: Whisper's audio tower alone (paged's `WhisperEncoder` against HF's), clips/s on
  batches of --hf-batch-size log-mel windows; Qwen2-Audio's tower is the same network.

Every generate timing excludes one warm-up and includes feature extraction (paged's input
processor, HF's feature extractor call) and prefill; the encoder's excludes feature extraction.
Guards (exit status 1, `checks` in the JSON): both systems' sequences start with the same prompt
ids and hold exactly max_tokens after them. Reported, not asserted (bf16 on a GPU may flip
near-ties of random weights): how many greedy outputs agree, and the largest difference of the
first CHECKED clips' first-token logprobs (one extra untimed step each). Output:
`<out>/audio.json` (rewritten after each system) and `<out>/audio.png`.

Refused by name (SystemExit from argparse): --clips, --llm-clips, --max-tokens,
--llm-max-tokens, --hf-batch-size below 1; --seconds / --llm-seconds outside
0 < LO <= HI <= 30 (the towers' window: paged's Whisper refuses longer clips); a
--whisper-config / --llm-config without benchmarks/configs/<name>/config.json.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime as dt
import hashlib
import json
import os
import random
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.common import cpu_seconds, environment, free_memory, now
from benchmarks.models import CONFIG_DIR, write_tokenizer

ROOT = Path(__file__).resolve().parent.parent
SR = 16_000
SECTIONS = ("whisper", "llm", "encoder")
CHECKED = 4  # clips whose first-token logprobs both systems report (after the timed runs)
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


# ---- records ------------------------------------------------------------------------------------
def record(system: str, section: str, clips: list[np.ndarray], tokens: int, t: tuple) -> dict:
    elapsed, cpu_s = t
    audio_s = sum(c.size for c in clips) / SR
    return {
        "system": system,
        "workload": section,
        "num_clips": len(clips),
        "audio_seconds": round(audio_s, 1),
        "output_tokens": tokens,
        "elapsed_s": round(elapsed, 4),
        "cpu_s": round(cpu_s, 3),
        "clips_per_s": round(len(clips) / elapsed, 3),
        "output_tokens_per_s": round(tokens / elapsed, 2),
        "audio_seconds_per_s": round(audio_s / elapsed, 2),
    }


class Timer:
    def __init__(self, device: str) -> None:
        self.device = device

    def __enter__(self) -> Timer:
        self.t0, self.c0 = now(self.device), cpu_seconds()
        return self

    def __exit__(self, *exc: object) -> None:
        self.result = (now(self.device) - self.t0, cpu_seconds() - self.c0)


def timed_hf(ctx: Context, run: Callable[[int], list]) -> tuple[list, tuple[float, float], int]:
    """`run(batch_size)` timed: (its result, (wall s, CPU s), the batch size that ran); on
    out-of-memory the batch size halves and the run starts over."""
    batch = ctx.batch
    while True:
        try:
            with Timer(ctx.device) as t:
                out = run(batch)
            return out, t.result, batch
        except torch.OutOfMemoryError:
            if batch == 1:
                raise
            batch //= 2
            free_memory(ctx.device)


def paged_engine(path: Path, dtype: torch.dtype, device: str, max_len: int, threads: int | None):
    from paged_engine import LLM

    kw: dict[str, Any] = dict(model=str(path), dtype=str(dtype).removeprefix("torch."), seed=0)
    kw |= dict(device=device, max_model_len=max_len, enforce_eager=device != "cuda")
    if threads:
        kw["cpu_num_threads"] = threads
    return LLM(**kw), kw


def paged_generate(
    llm, prompts: list[dict], max_tokens: int, lps: list[float] | None = None
) -> list[list[int]]:
    """Every sequence's ids (prompt included); with `lps`, each first token's logprob is
    appended to it."""
    from paged_engine import SamplingParams

    params = SamplingParams(
        temperature=0, ignore_eos=True, max_tokens=max_tokens, logprobs=None if lps is None else 1
    )
    outs = llm.generate(prompts, params, use_tqdm=False)
    if lps is not None:
        lps += [o.outputs[0].logprobs[0][o.outputs[0].token_ids[0]].logprob for o in outs]
    return [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]


def first_logprobs(out, lps: list[float] | None) -> None:
    """Append each row's first generated token's logprob (HF `generate` with output_scores:
    greedy with no processors, so the scores are the logits)."""
    if lps is None:
        return
    step = torch.log_softmax(out.scores[0].float(), -1)
    chosen = out.sequences[:, -len(out.scores)]
    lps += step.gather(1, chosen[:, None].to(step.device))[:, 0].tolist()


def shut(llm, device: str) -> None:
    llm.llm_engine.shutdown()
    free_memory(device)


# ---- whisper ------------------------------------------------------------------------------------
def hf_whisper(
    model, fe, clips: list, prefix: list[int], max_tokens: int, batch: int, device, lps=None
) -> list[list[int]]:
    """Greedy transcription in padded batches; every sequence's ids (prefix included); with
    `lps`, each first token's logprob is appended to it."""
    gen = copy.deepcopy(model.generation_config)
    gen.eos_token_id = None  # ignore EOS: every clip runs to max_tokens
    gen.suppress_tokens = gen.begin_suppress_tokens = None
    gen.max_length = None  # max_new_tokens says it
    seqs: list[list[int]] = []
    for i in range(0, len(clips), batch):
        feats = fe(clips[i : i + batch], sampling_rate=SR, return_tensors="pt").input_features
        out = model.generate(
            feats.to(device, model.dtype),
            language="en",
            task="transcribe",
            return_timestamps=False,
            generation_config=gen,
            max_new_tokens=max_tokens,
            do_sample=False,
            num_beams=1,
            return_dict_in_generate=True,  # sequences with the prefix HF put before them
            output_scores=lps is not None,
        )
        first_logprobs(out, lps)
        seqs += out.sequences.tolist()
    return seqs


def run_whisper(ctx: Context, result: dict) -> None:
    free_memory(ctx.device)  # what the section before left cached
    p = ctx.preset
    path, cfg = materialize(p.whisper, p.whisper_overrides, ctx.work_dir, ctx.dtype, ctx.device)
    prefix = whisper_prefix(cfg)
    clips = clip_set(p.clips, p.seconds, seed=1)
    warm = clip_set(2, (1, 2), seed=99)
    sec = result["sections"]["whisper"] = {
        "model": model_entry(p.whisper, p.whisper_overrides, path),
        "workload": f"{len(clips)} clips of {p.seconds[0]}-{p.seconds[1]} s synthetic speech, "
        f"greedy, {p.max_tokens} tokens each (EOS ignored), prefix {prefix}",
        "records": [],
    }
    want_len = len(prefix) + p.max_tokens
    got: dict[str, list[list[int]]] = {}
    lps: dict[str, list[float]] = {"paged": [], "hf": []}
    # paged
    llm, kw = paged_engine(path, ctx.dtype, ctx.device, want_len, ctx.threads)
    try:

        def prompts(waves: list) -> list[dict]:
            return [
                {"prompt_token_ids": prefix, "multi_modal_data": {"audio": (w, SR)}} for w in waves
            ]

        paged_generate(llm, prompts(warm), 4)
        with Timer(ctx.device) as t:
            got["paged"] = paged_generate(llm, prompts(clips), p.max_tokens)
        rec = record("paged", "whisper", clips, p.clips * p.max_tokens, t.result)
        rec["engine"] = {k: v for k, v in kw.items() if k != "model"}
        rec["cuda_graphs"] = False  # encoder-decoder models run eager (cross_attention.py)
        sec["records"].append(rec)
        ctx.save(result)
        paged_generate(llm, prompts(clips[:CHECKED]), 1, lps["paged"])
        if "encoder" in ctx.sections:
            enc = llm.llm_engine.model_runner.model.model.encoder
            host = llm.llm_engine.input_processor.audios
            ctx.encoder_paged = encoder_rate(
                ctx,
                "paged",
                clips,
                lambda w: host.process(prefix, (w, SR))[1][0].pixel_values,
                lambda f: enc(f, [f.shape[-1] // 2] * f.shape[0]),
            )
    finally:
        shut(llm, ctx.device)
    # HF
    model = load_hf(path, cfg, ctx.dtype, ctx.device)
    fe = feature_extractor(path)
    with torch.inference_mode():
        hf_whisper(model, fe, warm, prefix, 4, ctx.batch, ctx.device)
        got["hf"], timing, batch = timed_hf(
            ctx, lambda b: hf_whisper(model, fe, clips, prefix, p.max_tokens, b, ctx.device)
        )
        rec = record("hf-generate", "whisper", clips, p.clips * p.max_tokens, timing)
        rec["batch_size"] = batch
        sec["records"].append(rec)
        hf_whisper(model, fe, clips[:CHECKED], prefix, 1, ctx.batch, ctx.device, lps["hf"])
        if "encoder" in ctx.sections:
            tower = model.model.encoder

            def hf_features(w: np.ndarray) -> torch.Tensor:
                return fe(w, sampling_rate=SR, return_tensors="pt").input_features[0]

            ctx.encoder_hf = encoder_rate(
                ctx, "hf", clips, hf_features, lambda f: tower(f).last_hidden_state
            )
            del tower
    finish(sec, got, lps, [prefix] * len(clips), want_len)


def encoder_rate(ctx: Context, system: str, clips: list, features, tower) -> dict:
    """The tower alone on the clips' log-mel windows (extracted before timing), batches of
    ctx.batch, one warm-up batch."""
    dev, dtype = ctx.device, ctx.dtype
    feats = torch.stack([features(w).float() for w in clips]).to(dev, dtype)
    with torch.inference_mode():
        tower(feats[:1])
        with Timer(dev) as t:
            for i in range(0, len(clips), ctx.batch):
                tower(feats[i : i + ctx.batch])
    rec = record(system, "encoder", clips, 0, t.result)
    del rec["output_tokens"], rec["output_tokens_per_s"]
    return {**rec, "batch_size": ctx.batch, "window_frames": int(feats.shape[-1])}


# ---- audio LLM ----------------------------------------------------------------------------------
def llm_prompt(rows: int, seed: int, audio_token: int) -> list[int]:
    """8 random word ids, the clip's run, 8 more: the same ids for paged and HF."""
    rng = random.Random(seed)
    words = [rng.randrange(10, 10000) for _ in range(16)]
    return words[:8] + [AUDIO_BOS] + [audio_token] * rows + [AUDIO_EOS] + words[8:]


def hf_llm(
    model, fe, clips: list, prompts: list[list[int]], max_tokens: int, batch: int, dev, lps=None
) -> list[list[int]]:
    """Greedy generate on left-padded batches; every sequence's ids (prompt included); with
    `lps`, each first token's logprob is appended to it."""
    model.generation_config.eos_token_id = None
    seqs: list[list[int]] = []
    for i in range(0, len(clips), batch):
        part = prompts[i : i + batch]
        out = fe(
            clips[i : i + batch],
            sampling_rate=SR,
            return_tensors="pt",
            padding="max_length",
            return_attention_mask=True,
        )
        width = max(map(len, part))
        ids = torch.zeros(len(part), width, dtype=torch.long)
        mask = torch.zeros(len(part), width, dtype=torch.long)
        for j, p in enumerate(part):
            ids[j, width - len(p) :] = torch.tensor(p)
            mask[j, width - len(p) :] = 1
        gen = model.generate(
            input_ids=ids.to(dev),
            attention_mask=mask.to(dev),
            input_features=out["input_features"].to(dev, model.dtype),
            feature_attention_mask=out["attention_mask"].to(dev),
            max_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=0,
            return_dict_in_generate=True,
            output_scores=lps is not None,
        )
        first_logprobs(gen, lps)
        for j, p in enumerate(part):
            seqs.append(list(p) + gen.sequences[j, width:].tolist())
    return seqs


def run_llm(ctx: Context, result: dict) -> None:
    from paged_engine.multimodal.qwen2_audio import output_rows

    free_memory(ctx.device)  # what the section before left cached
    p = ctx.preset
    path, cfg = materialize(p.llm, p.llm_overrides, ctx.work_dir, ctx.dtype, ctx.device)
    clips = clip_set(p.llm_clips, p.llm_seconds, seed=2)
    warm = clip_set(2, (1, 2), seed=98)
    fe = feature_extractor(path)

    def ids(waves: list, seed: int) -> list[list[int]]:
        masks = fe(waves, sampling_rate=SR, padding="max_length", return_attention_mask=True)
        rows = [output_rows(int(sum(m))) for m in masks["attention_mask"]]
        return [llm_prompt(n, seed + i, cfg["audio_token_index"]) for i, n in enumerate(rows)]

    prompts, warm_prompts = ids(clips, 0), ids(warm, 500)
    sec = result["sections"]["llm"] = {
        "model": model_entry(p.llm, p.llm_overrides, path),
        "workload": f"{len(clips)} clips of {p.llm_seconds[0]}-{p.llm_seconds[1]} s synthetic "
        f"speech, each in a prompt of 16 text ids + its audio run ({min(map(len, prompts))}-"
        f"{max(map(len, prompts))} prompt ids), greedy, {p.llm_max_tokens} tokens (EOS ignored)",
        "prompt_tokens": sum(map(len, prompts)),
        "records": [],
    }
    want_len = max(map(len, prompts)) + p.llm_max_tokens
    got: dict[str, list[list[int]]] = {}
    lps: dict[str, list[float]] = {"paged": [], "hf": []}
    llm, kw = paged_engine(path, ctx.dtype, ctx.device, want_len, ctx.threads)
    try:

        def engine_prompts(ps: list, waves: list) -> list[dict]:
            return [
                {"prompt_token_ids": q, "multi_modal_data": {"audio": (w, SR)}}
                for q, w in zip(ps, waves, strict=True)
            ]

        paged_generate(llm, engine_prompts(warm_prompts, warm), 4)
        with Timer(ctx.device) as t:
            got["paged"] = paged_generate(llm, engine_prompts(prompts, clips), p.llm_max_tokens)
        rec = record("paged", "llm", clips, p.llm_clips * p.llm_max_tokens, t.result)
        rec["engine"] = {k: v for k, v in kw.items() if k != "model"}
        rec["cuda_graphs"] = ctx.device == "cuda"
        sec["records"].append(rec)
        ctx.save(result)
        checked = engine_prompts(prompts[:CHECKED], clips[:CHECKED])
        paged_generate(llm, checked, 1, lps["paged"])
    finally:
        shut(llm, ctx.device)
    model = load_hf(path, cfg, ctx.dtype, ctx.device)
    with torch.inference_mode():
        hf_llm(model, fe, warm, warm_prompts, 4, ctx.batch, ctx.device)
        got["hf"], timing, batch = timed_hf(
            ctx, lambda b: hf_llm(model, fe, clips, prompts, p.llm_max_tokens, b, ctx.device)
        )
        n = CHECKED
        hf_llm(model, fe, clips[:n], prompts[:n], 1, ctx.batch, ctx.device, lps["hf"])
    rec = record("hf-generate", "llm", clips, p.llm_clips * p.llm_max_tokens, timing)
    sec["records"].append({**rec, "batch_size": batch})
    finish(sec, got, lps, prompts, None, p.llm_max_tokens)


# ---- checks -------------------------------------------------------------------------------------
def finish(
    sec: dict,
    got: dict,
    lps: dict,
    prompts: list,
    want_len: int | None,
    max_tokens: int | None = None,
) -> None:
    """Ratios and guards of one section from each system's sequences (prompt + output ids)
    and first-token logprobs of the first CHECKED clips (informational: random weights give
    near-ties, bf16 moves them)."""
    paged, hf = sec["records"][0], sec["records"][1]
    paged["vs_hf"] = round(paged["output_tokens_per_s"] / hf["output_tokens_per_s"], 3)
    sec["checks"] = checks(got["paged"], got["hf"], prompts, want_len, max_tokens)
    diff = max(abs(a - b) for a, b in zip(lps["paged"], lps["hf"], strict=True))
    sec["checks"]["first_token_logprobs"] = {
        "ok": None,
        "max_abs_diff": round(diff, 6),
        "of": len(lps["hf"]),
    }


def checks(
    paged: list, hf: list, prompts: list, want_len: int | None, max_tokens: int | None
) -> dict:
    """Both systems' sequences start with the prompts and have max_tokens after them; how many
    greedy outputs agree (informational)."""

    def ok(seqs: list) -> bool:
        return all(
            s[: len(q)] == q and len(s) == (want_len or len(q) + (max_tokens or 0))
            for s, q in zip(seqs, prompts, strict=True)
        )

    same = sum(a == b for a, b in zip(paged, hf, strict=True))
    return {
        "paged_prompts_and_lengths": {"ok": ok(paged)},
        "hf_prompts_and_lengths": {"ok": ok(hf)},
        "greedy_outputs_equal": {"ok": None, "equal": same, "of": len(prompts)},
    }


# ---- driver -------------------------------------------------------------------------------------
@dataclass(slots=True)
class Context:
    preset: Preset
    device: str
    dtype: torch.dtype
    batch: int
    threads: int | None
    work_dir: Path
    out_file: Path
    sections: list[str]
    encoder_paged: dict | None = None
    encoder_hf: dict | None = None

    def save(self, result: dict) -> None:
        """Rewritten after every system: a run cut short keeps what it measured."""
        self.out_file.write_text(json.dumps(result, indent=1) + "\n")


def cpu_model() -> str | None:
    """The CPU's name from /proc/cpuinfo (None elsewhere): `platform` only says x86_64."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), None)


def model_entry(name: str, overrides: dict, path: Path) -> dict:
    return {"config": f"benchmarks/configs/{name}", "overrides": overrides, "path": str(path)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.audio", description=__doc__)
    p.add_argument("--preset", choices=tuple(PRESETS), default=None, help="default: the device's")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    p.add_argument("--clips", type=int, default=None, help="Whisper clips (and encoder)")
    p.add_argument("--llm-clips", type=int, default=None, help="audio-LLM clips")
    p.add_argument("--seconds", type=float, nargs=2, default=None, metavar=("LO", "HI"))
    p.add_argument("--llm-seconds", type=float, nargs=2, default=None, metavar=("LO", "HI"))
    p.add_argument("--max-tokens", type=int, default=None, help="Whisper tokens per clip")
    p.add_argument("--llm-max-tokens", type=int, default=None)
    p.add_argument("--hf-batch-size", type=int, default=None, help="HF (and encoder) batch")
    p.add_argument("--whisper-config", default=None, help="a dir name under benchmarks/configs")
    p.add_argument("--llm-config", default=None, help="a dir name under benchmarks/configs")
    p.add_argument("--cpu-threads", type=int, default=1, help="torch threads on CPU (0: default)")
    p.add_argument("--out", type=Path, default=None, help="dir (default docs/benchmarks/<device>)")
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/paged-bench"))
    p.add_argument("--note", default="", help="free text kept with the results")
    args = p.parse_args(argv)
    for name in ("clips", "llm_clips", "max_tokens", "llm_max_tokens", "hf_batch_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    for name in ("seconds", "llm_seconds"):
        lo_hi = getattr(args, name)
        if lo_hi is not None and not 0 < lo_hi[0] <= lo_hi[1] <= 30:
            flag = f"--{name.replace('_', '-')}"
            p.error(f"{flag} needs 0 < LO <= HI <= 30 (the 30 s window), got {lo_hi}")
    for name in ("whisper_config", "llm_config"):
        value = getattr(args, name)
        if value is not None and not (CONFIG_DIR / value / "config.json").is_file():
            p.error(f"--{name.replace('_', '-')} {value!r}: no benchmarks/configs/{value}/")
    return args


def resolve_preset(args: argparse.Namespace, device: str) -> Preset:
    base = PRESETS[args.preset or ("gpu" if device == "cuda" else "cpu")]
    given = {
        "whisper": args.whisper_config,
        "llm": args.llm_config,
        "clips": args.clips,
        "llm_clips": args.llm_clips,
        "seconds": tuple(args.seconds) if args.seconds else None,
        "llm_seconds": tuple(args.llm_seconds) if args.llm_seconds else None,
        "max_tokens": args.max_tokens,
        "llm_max_tokens": args.llm_max_tokens,
        "hf_batch_size": args.hf_batch_size,
    }
    return dataclasses.replace(base, **{k: v for k, v in given.items() if v is not None})


def table(result: dict) -> str:
    lines = ["| section | system | clips/s | output tok/s | audio s/s | wall s | paged / HF |"]
    lines.append("|---|---|---:|---:|---:|---:|---:|")
    for name, sec in result["sections"].items():
        for r in sec.get("records", []):
            if "error" in r:
                lines.append(f"| {name} | {r['system']} | error | | | | |")
                continue
            tok = r.get("output_tokens_per_s", "")
            lines.append(
                f"| {name} | {r['system']} | {r['clips_per_s']} | {tok} | "
                f"{r['audio_seconds_per_s']} | {r['elapsed_s']} | {r.get('vs_hf', '')} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from benchmarks import plots
    from benchmarks.models import default_dtype
    from benchmarks.run_all import device_slug

    device = (
        args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    )
    threads = args.cpu_threads if device == "cpu" and args.cpu_threads else None
    if threads:
        torch.set_num_threads(threads)
    preset = resolve_preset(args, device)
    out_dir = args.out or ROOT / "docs" / "benchmarks" / device_slug(device)
    out_dir.mkdir(parents=True, exist_ok=True)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    dtype = default_dtype(device)
    ctx = Context(
        preset,
        device,
        dtype,
        preset.hf_batch_size,
        threads,
        args.work_dir,
        out_dir / "audio.json",
        args.sections,
    )
    result: dict[str, Any] = {
        "device": device_slug(device),
        "dtype": str(dtype).removeprefix("torch."),
        "date_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python -m benchmarks.audio "
        + shlex.join(sys.argv[1:] if argv is None else argv),
        "preset": args.preset or ("gpu" if device == "cuda" else "cpu"),
        "sizes": dataclasses.asdict(preset),
        "cpu_threads": threads,
        "note": args.note,
        "env": {**environment(device), "cpu_model": cpu_model()},
        "load_avg": {"before": [round(x, 2) for x in os.getloadavg()]},
        "complete": False,
        "sections": {},
    }
    failed = False
    chosen = set(args.sections)
    runners = {"whisper": run_whisper, "llm": run_llm}
    # the encoder section times the towers of the engines the whisper section starts
    for name in [n for n in runners if n in chosen or (n == "whisper" and "encoder" in chosen)]:
        print(f"== {name}", flush=True)
        try:
            runners[name](ctx, result)
        except Exception as exc:  # recorded; the other section still runs
            import traceback

            traceback.print_exc()
            result["sections"].setdefault(name, {})["error"] = f"{type(exc).__name__}: {exc}"
            failed = True
        ctx.save(result)
    if "encoder" in args.sections and ctx.encoder_paged and ctx.encoder_hf:
        paged, hf = ctx.encoder_paged, ctx.encoder_hf
        paged["vs_hf"] = round(paged["clips_per_s"] / hf["clips_per_s"], 3)
        result["sections"]["encoder"] = {
            "model": result["sections"].get("whisper", {}).get("model"),
            "workload": "the Whisper clips' log-mel windows through the audio tower alone",
            "records": [paged, hf],
        }
    result["load_avg"]["after"] = [round(x, 2) for x in os.getloadavg()]
    result["complete"] = True
    ctx.save(result)

    def label(name: str, model: dict) -> str:
        scaled = " (scaled down)" if model["overrides"] else ""
        return f"{name}: {model['config'].rsplit('/', 1)[1]}{scaled}"

    records = [
        {**r, "workload": label(n, s["model"])}
        for n, s in result["sections"].items()
        if n != "encoder"
        for r in s.get("records", [])
    ]
    plots.throughput(records, out_dir / "audio.png", f"audio paths, {result['device']}")
    print(table(result))
    for name, sec in result["sections"].items():
        for check, value in sec.get("checks", {}).items():
            print(f"{name} {check}: {json.dumps(value)}")
            failed |= value["ok"] is False
    print(f"wrote {ctx.out_file}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
