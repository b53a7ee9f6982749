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
import dataclasses
import datetime as dt
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import torch

from benchmarks.audio_runs import CHECKED, Context, checks, run_llm, run_whisper
from benchmarks.audio_workloads import (
    PRESETS,
    QWEN2_AUDIO_CPU,
    Preset,
    speech_clip,
    whisper_prefix,
)
from benchmarks.common import environment
from benchmarks.models import CONFIG_DIR

# (CHECKED, checks, QWEN2_AUDIO_CPU, speech_clip, whisper_prefix, CONFIG_DIR: this harness's
# names, read as benchmarks.audio.* by tests/benchmarks/test_audio_bench.py)
__all__ = [
    "CHECKED",
    "CONFIG_DIR",
    "PRESETS",
    "QWEN2_AUDIO_CPU",
    "checks",
    "main",
    "parse_args",
    "resolve_preset",
    "speech_clip",
    "whisper_prefix",
]

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ("whisper", "llm", "encoder")


# ---- driver -------------------------------------------------------------------------------------
def cpu_model() -> str | None:
    """The CPU's name from /proc/cpuinfo (None elsewhere): `platform` only says x86_64."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), None)


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
