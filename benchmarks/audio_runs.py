"""benchmarks/audio.py's runners: each section timed on paged and on its HF reference, with
the records, guards and first-token logprobs the report reads (see benchmarks/audio.py)."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.audio_workloads import (
    SR,
    Preset,
    clip_set,
    feature_extractor,
    llm_prompt,
    load_hf,
    materialize,
    whisper_prefix,
)
from benchmarks.common import cpu_seconds, free_memory, now

CHECKED = 4  # clips whose first-token logprobs both systems report (after the timed runs)


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


# ---- context ------------------------------------------------------------------------------------
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


def model_entry(name: str, overrides: dict, path: Path) -> dict:
    return {"config": f"benchmarks/configs/{name}", "overrides": overrides, "path": str(path)}
