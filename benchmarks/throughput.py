"""Offline throughput: paged `LLM.generate` against HF static and continuous batching.

Every system gets the same model weights, prompts (token ids), per-request output lengths and
sampling settings (ignore_eos, so output lengths are fixed); one warm-up, then one timed run that
includes prefill. Ratios are paged / peer on output tokens/s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from benchmarks.common import call, cpu_seconds, error_record, now, throughput_record
from benchmarks.hf_baselines import hf_continuous, hf_static
from benchmarks.models import ModelSpec
from benchmarks.workloads import Workload

SYSTEMS = ("paged", "hf-static", "hf-continuous")


def engine_kwargs(spec: ModelSpec, device: str, max_model_len: int, **overrides) -> dict:
    """LLM(...) arguments shared by every paged benchmark."""
    kw = dict(
        model=str(spec.path),
        dtype=spec.dtype_name,
        max_model_len=max_model_len,
        seed=0,
        device=device,
        enforce_eager=device != "cuda",
    )
    kw.update(overrides)
    return kw


def max_len(wl: Workload, device: str) -> int:
    """4096 as in the published workloads on GPUs; just enough on CPU (smaller KV pool)."""
    need = max(len(r.prompt_token_ids) + r.max_tokens for r in wl.requests)
    return max(4096, need) if device == "cuda" else -(-need // 64) * 64


def paged_generate(
    spec: ModelSpec, wl: Workload, device: str, llm=None, min_model_len: int = 0, **engine_overrides
) -> dict:
    """The timed run through `LLM.generate`; `llm`: an engine built from the same `engine_kwargs`
    (with `min_model_len`) to reuse instead of starting one."""
    from paged_engine import LLM, SamplingParams

    kw = engine_kwargs(spec, device, max(max_len(wl, device), min_model_len), **engine_overrides)
    llm = llm if llm is not None else LLM(**kw)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in wl.requests]
    params = [
        SamplingParams(
            temperature=wl.temperature, top_p=wl.top_p, ignore_eos=True, max_tokens=r.max_tokens
        )
        for r in wl.requests
    ]
    warm = SamplingParams(temperature=wl.temperature, ignore_eos=True, max_tokens=4)
    llm.generate(
        [{"prompt_token_ids": wl.requests[0].prompt_token_ids[:8]}] * 2, warm, use_tqdm=False
    )
    t0, c0 = now(device), cpu_seconds()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed, cpu_s = now(device) - t0, cpu_seconds() - c0
    got = [len(o.outputs[0].token_ids) for o in outs]
    if got != [r.max_tokens for r in wl.requests]:
        raise RuntimeError("paged did not generate the requested number of tokens")
    extra = {"engine": {k: v for k, v in kw.items() if k != "model"}}
    extra["cuda_graphs"] = device == "cuda" and not kw["enforce_eager"]
    try:
        st = llm.get_stats()
        extra["peak_used_blocks"] = st.peak_used_blocks
        extra["num_total_blocks"] = st.num_total_blocks
        extra["num_preemptions"] = st.num_preemptions
    except Exception as exc:  # stats are a bonus here, never a reason to lose the timing
        extra["stats_error"] = repr(exc)
    return throughput_record("paged", wl, elapsed, cpu_s, **extra)


def run_one(system: str, spec: ModelSpec, wl: Workload, device: str, opts: dict) -> dict:
    if system == "paged":
        return paged_generate(spec, wl, device, **opts.get("paged", {}))
    if system == "hf-static":
        return hf_static(spec, wl, device, **opts.get("hf-static", {}))
    if system == "hf-continuous":
        return hf_continuous(spec, wl, device, **opts.get("hf-continuous", {}))
    raise ValueError(f"unknown system {system!r}")


def run(
    spec: ModelSpec,
    workloads: list[Workload],
    device: str,
    out_dir: Path,
    *,
    systems: tuple[str, ...] = SYSTEMS,
    isolate: bool = False,
    opts: dict | None = None,
    peer_requests: int | None = None,
    on_record: Callable[[dict], None] | None = None,
    log=print,
) -> dict:
    """All systems on all workloads; a failing system is recorded, never fatal.

    `peer_requests`: the HF peers run only the first that many requests of each workload (their
    tok/s on a sample, where the whole workload would outlast a time limit; the record says so).
    `on_record(partial_result)` after each system, so a run cut short keeps what it measured.
    """
    records: list[dict] = []
    for wl in workloads:
        for system in systems:
            run_wl = wl
            if system != "paged" and peer_requests and peer_requests < wl.num_requests:
                note = f"first {peer_requests} of the {wl.num_requests} requests"
                run_wl = dataclasses.replace(wl, requests=wl.requests[:peer_requests], scaled=note)
            log(f"  throughput {system} on {run_wl.describe()}")
            try:
                rec = call(run_one, system, spec, run_wl, device, opts or {}, isolate=isolate)
            except Exception as exc:
                rec = error_record(system, wl.name, exc)
            if run_wl is not wl:
                rec["sample"] = run_wl.scaled
            rec["model"] = spec.name
            records.append(rec)
            log(f"    -> {_short(rec)}")
            if on_record is not None:
                on_record({"records": records, "ratios": ratios(records)})
    return {"records": records, "ratios": ratios(records)}


def ratios(records: list[dict]) -> list[dict]:
    """paged / peer on every metric, per workload."""
    out = []
    by = {(r["workload"], r["system"]): r for r in records if "error" not in r}
    for (wl, system), peer in by.items():
        ours = by.get((wl, "paged"))
        if system == "paged" or ours is None:
            continue
        out.append(
            {
                "workload": wl,
                "peer": system,
                **{
                    m: round(ours[m] / peer[m], 2)
                    for m in (
                        "requests_per_s",
                        "total_tokens_per_s",
                        "output_tokens_per_s",
                        "output_tokens_per_cpu_s",
                    )
                    if m in ours and m in peer
                },
            }
        )
    return out


def _short(rec: dict) -> str:
    if "error" in rec:
        return "ERROR " + rec["error"][:300]
    return (
        f"{rec['output_tokens_per_s']:.1f} out tok/s, {rec['requests_per_s']:.2f} req/s "
        f"in {rec['elapsed_s']:.1f}s"
    )
