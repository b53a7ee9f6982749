"""KV memory: waste (slots allocated but holding no token) and what sharing saves.

Both drive `LLMEngine.step` directly and read `get_stats()` after every step, so the figures are
averages over the whole run (every step weighs the same), beside the peak.

- waste:   sum(kv_slots_allocated - kv_tokens_stored) / sum(kv_slots_allocated) over steps.
           Paper: under 4% with paging (20-38% of reserved memory held tokens before it).
- sharing: n parallel samples and beam widths share the prompt's blocks (copy-on-write).
           Without sharing every sequence would hold its own copy of every block it maps:
           unshared = used + blocks_saved_by_sharing. Saved % = saved / unshared, averaged over
           steps. Paper: parallel sampling 6-30%, beam search 37-66%.
           Throughput that sharing buys (parallel sampling): the same samples as n independent
           requests (prefix caching off, so nothing is shared), on the same KV pool; the pool is
           sized to a quarter of what all sequences need unshared, so both runs are memory-bound
           as in the paper.
"""

from __future__ import annotations

import itertools
import statistics

from benchmarks.common import call, error_record, now
from benchmarks.models import ModelSpec
from benchmarks.throughput import engine_kwargs
from benchmarks.workloads import Workload

PAPER = {"parallel": "6-30%", "beam": "37-66%", "waste": "under 4%"}


def drive(llm, items: list[tuple[dict, object]]) -> tuple[list[dict], list]:
    """Add all requests, step to completion; per-step stats and the finished outputs."""
    engine = llm.llm_engine
    ids = [f"bench-{next(_IDS)}" for _ in items]
    steps, finished = [], []
    try:
        for rid, (prompt, params) in zip(ids, items):
            engine.add_request(rid, prompt, params)
        while engine.has_unfinished_requests():
            finished += [o for o in engine.step() if o.finished]
            st = engine.get_stats()
            steps.append(
                {
                    "used": st.num_used_blocks,
                    "saved": st.blocks_saved_by_sharing,
                    "allocated": st.kv_slots_allocated,
                    "stored": st.kv_tokens_stored,
                    "running": st.num_running,
                }
            )
    except BaseException:
        engine.abort_request(ids)  # leave a reused engine clean for the next case
        raise
    return steps, finished


def summarize(steps: list[dict]) -> dict:
    live = [s for s in steps if s["allocated"]]
    alloc = sum(s["allocated"] for s in live)
    used = sum(s["used"] for s in live)
    saved = sum(s["saved"] for s in live)
    peak = max(live, key=lambda s: s["used"] + s["saved"], default=None)
    return {
        "steps": len(steps),
        "waste_perc": round(100 * (alloc - sum(s["stored"] for s in live)) / alloc, 2)
        if alloc
        else None,
        "max_step_waste_perc": round(
            max(100 * (s["allocated"] - s["stored"]) / s["allocated"] for s in live), 2
        )
        if live
        else None,
        "mean_used_blocks": round(used / len(live), 1) if live else 0,
        "mean_unshared_blocks": round((used + saved) / len(live), 1) if live else 0,
        "memory_saved_perc": round(100 * saved / (used + saved), 2) if used + saved else 0.0,
        "peak_unshared_blocks": peak["used"] + peak["saved"] if peak else 0,
        "peak_used_blocks": max((s["used"] for s in live), default=0),
        "mean_running": round(statistics.fmean(s["running"] for s in live), 1) if live else 0,
    }


_IDS = itertools.count()  # request ids stay unique across runs on a reused engine
_ENGINES: dict = {}  # one engine per pool size within a process (building one takes seconds)


def _engine(spec: ModelSpec, device: str, max_model_len: int, num_blocks: int | None):
    from paged_engine import LLM

    kw = engine_kwargs(
        spec,
        device,
        max_model_len,
        enable_prefix_caching=False,  # only fork sharing is counted
        num_gpu_blocks_override=num_blocks,
        max_num_seqs=256,
    )
    key = (str(spec.path), max_model_len, num_blocks)
    if key not in _ENGINES:
        _ENGINES.clear()
        _ENGINES[key] = LLM(**kw)
    return _ENGINES[key]


def waste(spec: ModelSpec, wl: Workload, device: str, max_model_len: int) -> dict:
    from paged_engine import SamplingParams

    llm = _engine(spec, device, max_model_len, None)
    items = [
        (
            {"prompt_token_ids": r.prompt_token_ids},
            SamplingParams(temperature=wl.temperature, ignore_eos=True, max_tokens=r.max_tokens),
        )
        for r in wl.requests
    ]
    steps, _ = drive(llm, items)
    return {"workload": wl.describe(), "paper": PAPER["waste"], **summarize(steps)}


def sharing_case(
    spec: ModelSpec,
    wl: Workload,
    device: str,
    kind: str,
    width: int,
    max_model_len: int,
    num_blocks: int | None,
) -> dict:
    """One (kind, width): memory saved with sharing, and its throughput (vs unshared copies).

    `num_blocks` None: the default pool (not memory-bound; the smoke runs).
    """
    from paged_engine import SamplingParams

    def params(n: int, max_tokens: int):
        if kind == "beam":
            return SamplingParams(
                n=n, use_beam_search=True, temperature=0.0, ignore_eos=True, max_tokens=max_tokens
            )
        return SamplingParams(n=n, temperature=0.8, ignore_eos=True, max_tokens=max_tokens)

    llm = _engine(spec, device, max_model_len, num_blocks)
    items = [
        ({"prompt_token_ids": r.prompt_token_ids}, params(width, r.max_tokens)) for r in wl.requests
    ]
    drive(llm, items[:1])  # warm-up
    pre0 = llm.get_stats().num_preemptions
    t0 = now(device)
    steps, finished = drive(llm, items)
    elapsed = now(device) - t0
    pre1 = llm.get_stats().num_preemptions
    out_tokens = sum(len(c.token_ids) for o in finished for c in o.outputs)
    rec = {
        "kind": kind,
        "width": width,
        "paper": PAPER[kind],
        "kv_pool_blocks": llm.get_stats().num_total_blocks,
        "elapsed_s": round(elapsed, 3),
        "output_tokens_per_s": round(out_tokens / elapsed, 2),
        "preemptions": pre1 - pre0,
        **summarize(steps),
    }
    if kind == "parallel":  # the same samples as independent requests: nothing shared
        solo = [(p, params(1, sp.max_tokens)) for p, sp in items for _ in range(width)]
        t0 = now(device)
        steps_u, finished_u = drive(llm, solo)
        elapsed_u = now(device) - t0
        tokens_u = sum(len(c.token_ids) for o in finished_u for c in o.outputs)
        rec["unshared_output_tokens_per_s"] = round(tokens_u / elapsed_u, 2)
        rec["unshared_mean_used_blocks"] = summarize(steps_u)["mean_used_blocks"]
        rec["unshared_preemptions"] = llm.get_stats().num_preemptions - pre1
        rec["throughput_gain"] = round(
            rec["output_tokens_per_s"] / rec["unshared_output_tokens_per_s"], 3
        )
    return rec


def pool_for(wl: Workload, width: int, block_size: int = 16) -> int:
    """A quarter of the blocks all sequences need unshared (at least one full request)."""
    need = [width * -(-(len(r.prompt_token_ids) + r.max_tokens) // block_size) for r in wl.requests]
    return max(sum(need) // 4, max(need) + 2) + 1  # +1: the null block


def run(
    spec: ModelSpec,
    sharing_wl: Workload,
    waste_wl: Workload,
    device: str,
    *,
    widths: tuple[int, ...] = (2, 4, 6),
    isolate: bool = False,
    bounded_pool: bool = True,
    log=print,
) -> dict:
    """Waste, then every (kind, width); `bounded_pool` makes each sharing run memory-bound."""
    mml = (
        -(
            -max(
                len(r.prompt_token_ids) + r.max_tokens
                for r in waste_wl.requests + sharing_wl.requests
            )
            // 64
        )
        * 64
    )
    result: dict = {"sharing_workload": sharing_wl.describe(), "sharing": []}
    log(f"  waste on {waste_wl.describe()}")
    try:
        result["waste"] = call(waste, spec, waste_wl, device, mml, isolate=isolate)
    except Exception as exc:
        result["waste"] = error_record("paged", "waste", exc)
    log(f"    -> {result['waste']}")
    for kind in ("parallel", "beam"):
        for width in widths:
            log(f"  sharing {kind} width {width}")
            try:
                rec = call(
                    sharing_case,
                    spec,
                    sharing_wl,
                    device,
                    kind,
                    width,
                    mml,
                    pool_for(sharing_wl, width) if bounded_pool else None,
                    isolate=isolate,
                )
            except Exception as exc:
                rec = {"kind": kind, "width": width, **error_record("paged", "sharing", exc)}
            log(f"    -> {rec}")
            result["sharing"].append(rec)
    _ENGINES.clear()
    result["bounded_pool"] = bounded_pool
    return result
