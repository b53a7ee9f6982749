"""KV memory, side by side in one run: an fp8 KV cache against the model dtype's at the same
memory, swap-out against recompute preemption, and the prefix cache's CPU tier under memory
pressure.

    python -m benchmarks.kv_memory                    # CPU smoke sizes, float32 model, writes
                                                      # docs/benchmarks/cpu/kv_memory.json
    python -m benchmarks.kv_memory --dtype bfloat16   # a 16-bit cache vs fp8 (issue 13):
                                                      # .../kv_memory-bfloat16.json
    python -m benchmarks.kv_memory --device cuda --dtype bfloat16 --out ...   # GPU
    python -m benchmarks.kv_memory --smoke --out ...  # short prompts and outputs: a rehearsal

The KV cache takes the model's dtype (`--dtype`) unless it is fp8.

fp8     the nano-vllm workload (scaled down) on one KV budget (`--kv-gib`, turned into a block
        count per cache dtype, so a GPU run gets the same pool a CPU run does), kv_cache_dtype
        "auto" (the model dtype) vs "fp8" vs "fp8_e5m2": KV blocks, the most sequences running
        at once, preemptions, wall time and output tokens/s, per attention backend (on CPU the
        cpu backend, the default, and the torch reference for "auto" vs "fp8"; ratios are
        against the same backend's "auto" run).
swap    the same workload on a pool too small for it (`--swap-blocks`), preemption_mode
        "recompute" vs "swap" (a CPU pool of `swap_space` GiB): preemptions, how many swapped,
        the most sequences running at once, output tokens/s; the outputs must be identical.
chat    a multi-turn chat (each turn resends the conversation so far: a shared system prompt,
        earlier turns, the model's replies, a new user message) over a device pool that cannot
        keep every conversation: prefix-cache hit rate and TTFT without and with the CPU tier
        (`cpu_offload_gib`); the outputs must be identical.

The model is a random-weight llama (`--hidden`, `--layers`; write_tiny_model), so the numbers
measure the engine, not a checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import environment
from benchmarks.workloads import nano_vllm

ROOT = Path(__file__).resolve().parent.parent


def tiny_llama(path: Path, hidden: int, layers: int) -> Path:
    from paged_engine.testing import write_tiny_model

    heads = max(hidden // 32, 1)
    return write_tiny_model(
        path, "llama", hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=max(heads // 2, 1), max_position_embeddings=4096,
    )  # fmt: skip


def kv_blocks(model: Path, dtype: str, kv_cache_dtype: str, gib: float) -> int:
    """Blocks of 16 tokens that `gib` GiB of KV cache holds, as the engine sizes a CPU pool
    (`cpu_kv_cache_gib`); passed as num_gpu_blocks_override, so every device gets this pool."""
    import torch
    import transformers

    from paged_engine.worker.cache_engine import num_cpu_blocks

    elem = {"fp8_e5m2": torch.float8_e5m2, "fp8": torch.float8_e4m3fn}.get(
        kv_cache_dtype.removesuffix("_e4m3"), getattr(torch, dtype)
    )
    hf = transformers.AutoConfig.from_pretrained(model)
    return max(num_cpu_blocks(hf, 16, elem, gib), 2)


def nano_requests(num_requests: int, io: tuple):
    """The nano-vllm recipe scaled down: (workload, [(id, prompt, seeded sampling params)])."""
    from paged_engine import SamplingParams

    wl = nano_vllm(num_requests, input_len=io[0], output_len=io[1], max_token_id=500)
    requests = [
        (str(i), {"prompt_token_ids": r.prompt_token_ids}, SamplingParams(
            temperature=0.6, seed=i, ignore_eos=True, max_tokens=r.max_tokens))
        for i, r in enumerate(wl.requests)
    ]  # fmt: skip
    return wl, requests


def _warm(engine) -> None:
    from paged_engine import SamplingParams

    engine.add_request("warmup", {"prompt_token_ids": [5] * 32}, SamplingParams(max_tokens=4))
    while engine.has_unfinished_requests():
        engine.step()


def _drive(engine, requests) -> tuple[float, int, dict[str, list[int]]]:
    """Run (id, prompt, params) to the end; (wall seconds, most sequences running at once,
    output token ids by request id)."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params, final_only=True)
    peak, outputs = 0, {}
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        peak = max(peak, engine.scheduler.num_running_seqs)
    return time.perf_counter() - t0, peak, outputs


def run_fp8(
    model: Path, device: str, kv_gib: float, num_requests: int, io: tuple,
    backends: tuple[str, ...] | None = None, repeat: int = 1, dtype: str = "float32",
) -> dict:  # fmt: skip
    """The nano-vllm recipe at one KV budget, per attention backend and kv_cache_dtype. With
    `repeat` > 1 the whole set of runs repeats (interleaved, so load drifts hit every config
    alike) and each config keeps its fastest run (`wall_s_all` lists them all)."""
    from paged_engine import LLM

    wl, requests = nano_requests(num_requests, io)
    if backends is None:
        backends = ("cpu", "torch") if device == "cpu" else ("auto",)
    runs = [(b, kv) for b in backends for kv in ("auto", "fp8", "fp8_e5m2")]
    runs = [(b, kv) for b, kv in runs if b != "torch" or kv != "fp8_e5m2"]  # the slow path
    records: dict[tuple[str, str], dict] = {}
    for backend, kv in [run for _ in range(repeat) for run in runs]:
        llm = LLM(
            model=str(model), dtype=dtype, device=device, max_model_len=1024,
            kv_cache_dtype=kv, attention_backend=backend,
            num_gpu_blocks_override=kv_blocks(model, dtype, kv, kv_gib),
        )  # fmt: skip
        engine = llm.llm_engine
        _warm(engine)
        elapsed, peak, _ = _drive(engine, requests)
        stats = engine.get_stats()
        walls = records.get((backend, kv), {}).get("wall_s_all", []) + [round(elapsed, 2)]
        elapsed = min(elapsed, *walls)
        records[(backend, kv)] = {
            "attention_backend": backend,
            "kv_cache_dtype": kv,
            "cache_dtype": str(engine.model_runner.kv_cache_dtype).removeprefix("torch."),
            "kv_blocks": engine.num_blocks,  # the pool as sized (null block included)
            "max_running_seqs": peak,
            "preemptions": stats.num_preemptions,
            "wall_s": round(elapsed, 2),
            "wall_s_all": walls,
            "output_tokens_per_s": round(wl.output_tokens / elapsed, 1),
        }  # fmt: skip
        engine.shutdown()
    for r in records.values():
        if r["kv_cache_dtype"] == "auto":
            base = r  # runs go backend by backend, "auto" first
            continue
        r["blocks_vs_auto"] = round(r["kv_blocks"] / base["kv_blocks"], 2)
        r["throughput_vs_auto"] = round(r["output_tokens_per_s"] / base["output_tokens_per_s"], 2)
    return {"workload": wl.describe(), "kv_gib": kv_gib, "records": list(records.values())}


def run_swap(
    model: Path, device: str, blocks: int, num_requests: int, io: tuple, dtype: str = "float32",
) -> dict:  # fmt: skip
    """The nano-vllm recipe on a `blocks`-block pool, preempting by recompute, then by swap
    (a CPU pool four times the device pool's size, so no swap falls back to recompute)."""
    from paged_engine import LLM

    wl, requests = nano_requests(num_requests, io)
    swap_gib = 4 * blocks / kv_blocks(model, dtype, "auto", 1.0)
    records, outputs = [], {}
    for mode in ("recompute", "swap"):
        llm = LLM(
            model=str(model), dtype=dtype, device=device, num_gpu_blocks_override=blocks,
            max_model_len=min(1024, 16 * (blocks - 1)), preemption_mode=mode,
            swap_space=swap_gib if mode == "swap" else 0.0,
        )  # fmt: skip
        engine = llm.llm_engine
        _warm(engine)
        elapsed, peak, outputs[mode] = _drive(engine, requests)
        stats = engine.get_stats()
        records.append({
            "preemption_mode": mode,
            "kv_blocks": engine.num_blocks,
            "cpu_blocks": stats.num_cpu_blocks,
            "max_running_seqs": peak,
            "preemptions": stats.num_preemptions,
            "swap_preemptions": stats.num_swap_preemptions,
            "wall_s": round(elapsed, 2),
            "output_tokens_per_s": round(wl.output_tokens / elapsed, 1),
        })  # fmt: skip
        engine.shutdown()
    differ = [rid for rid, toks in outputs["recompute"].items() if toks != outputs["swap"][rid]]
    # Exact in float32 (asserted); in 16 bits recompute's prefill of the generated tokens rounds
    # differently from the decode steps that first wrote their KV, so a near-tie can flip.
    assert not differ or dtype != "float32", f"swap and recompute outputs differ: {differ}"
    recompute, swap = records
    return {
        "workload": wl.describe(),
        "outputs_identical": not differ,
        "requests_differing": len(differ),
        "records": records,
        "throughput_swap_vs_recompute": round(
            swap["output_tokens_per_s"] / recompute["output_tokens_per_s"], 2
        ),
    }


def chat_turns(num_convs: int, turns: int, system_len: int, user_len: tuple, seed: int = 0):
    rng = random.Random(seed)
    system = [rng.randrange(3, 500) for _ in range(system_len)]
    users = [
        [[rng.randrange(3, 500) for _ in range(rng.randint(*user_len))] for _ in range(turns)]
        for _ in range(num_convs)
    ]
    return system, users


def run_chat(
    model: Path, device: str, gpu_blocks: int, tier_gib: float, num_convs: int, turns: int,
    system_len: int, user_len: tuple, reply_len: int, dtype: str = "float32",
) -> dict:  # fmt: skip
    """Every conversation's turn t, then turn t + 1 (each resends the whole conversation)."""
    from paged_engine import LLM, SamplingParams

    system, users = chat_turns(num_convs, turns, system_len, user_len)
    sp = SamplingParams(temperature=0, max_tokens=reply_len, ignore_eos=True)
    records, outputs = [], {}
    max_len = min(1024, 16 * (gpu_blocks - 1))  # what the device pool holds
    for tier in (0.0, tier_gib):
        llm = LLM(
            model=str(model), dtype=dtype, device=device, max_model_len=max_len,
            num_gpu_blocks_override=gpu_blocks, cpu_offload_gib=tier,
        )  # fmt: skip
        convs = [list(system) for _ in range(num_convs)]
        ttft, replies = [], []
        t0 = time.perf_counter()
        for t in range(turns):
            prompts = [{"prompt_token_ids": c + u[t]} for c, u in zip(convs, users)]
            outs = llm.generate(prompts, sp, use_tqdm=False)
            for c, u, o in zip(convs, users, outs):
                c += u[t] + list(o.outputs[0].token_ids)
                replies.append(list(o.outputs[0].token_ids))
                if t:  # later turns: the ones a prefix cache can serve
                    ttft.append(o.metrics.first_token_time - o.metrics.arrival_time)
        elapsed = time.perf_counter() - t0
        stats = llm.get_stats()
        outputs[tier] = replies
        records.append({
            "cpu_offload_gib": tier,
            "prefix_cache_hit_rate": round(stats.prefix_cache_hits / stats.prefix_cache_queries, 3),
            "prefix_cache_cpu_hit_tokens": stats.prefix_cache_cpu_hits,
            "ttft_mean_ms_turns_2+": round(1000 * statistics.mean(ttft), 1),
            "ttft_p50_ms_turns_2+": round(1000 * statistics.median(ttft), 1),
            "wall_s": round(elapsed, 2),
            "cpu_blocks": stats.num_cpu_blocks,
        })  # fmt: skip
        llm.llm_engine.shutdown()
    same = outputs[0.0] == outputs[tier_gib]
    return {
        "workload": f"{num_convs} conversations x {turns} turns, system prompt {system_len} "
        f"tokens, user turns {user_len[0]}-{user_len[1]} tokens, greedy replies of {reply_len}; "
        f"device pool {gpu_blocks} blocks",
        "outputs_identical": same,
        "records": records,
        "ttft_mean_ratio_tier_vs_none": round(
            records[1]["ttft_mean_ms_turns_2+"] / records[0]["ttft_mean_ms_turns_2+"], 2
        ),
    }


def cpu_model() -> str:
    """The CPU's model name (lscpu's), or the architecture where /proc/cpuinfo has none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return os.uname().machine


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="model dtype, and the KV cache's unless fp8")  # fmt: skip
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--sections", nargs="+", default=["fp8", "swap", "chat"],
                   choices=("fp8", "swap", "chat"))  # fmt: skip
    p.add_argument("--kv-gib", type=float, default=2**-6, help="fp8 section: KV budget (GiB)")
    p.add_argument("--requests", type=int, default=24, help="fp8 and swap sections")
    p.add_argument("--repeat", type=int, default=1, help="fp8 section: runs per config (best)")
    p.add_argument("--backends", nargs="+", help="fp8 section (default: cpu and torch on CPU)")
    p.add_argument("--swap-blocks", type=int, default=96, help="swap section: device pool")
    p.add_argument("--gpu-blocks", type=int, default=96, help="chat section: device pool")
    p.add_argument("--tier-gib", type=float, default=2**-6, help="chat section: CPU tier (GiB)")
    p.add_argument("--convs", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--out", help="default docs/benchmarks/cpu/kv_memory[-DTYPE].json")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="short prompts and outputs (a rehearsal of the code paths, no figures)",
    )
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    suffix = "" if args.dtype == "float32" else f"-{args.dtype}"
    out = Path(args.out or ROOT / f"docs/benchmarks/cpu/kv_memory{suffix}.json")
    # (input, output) token ranges of the fp8 / swap workload; the chat's system prompt, user
    # turns and replies
    io, chat = (
        (((16, 64), (4, 12)), (40, (8, 16), 4))
        if args.smoke
        else (((100, 400), (50, 200)), (200, (40, 80), 32))
    )
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_llama(Path(tmp), args.hidden, args.layers)
        result = {
            "command": " ".join(["python -m benchmarks.kv_memory", *argv]),
            "environment": {**environment(args.device), "cpu_model": cpu_model()},
            "model": f"random llama, hidden {args.hidden}, {args.layers} layers, {args.dtype}",
        }
        if "fp8" in args.sections:
            backends = tuple(args.backends) if args.backends else None
            result["fp8"] = run_fp8(
                model, args.device, args.kv_gib, args.requests, io, backends, args.repeat,
                args.dtype,
            )  # fmt: skip
        if "swap" in args.sections:
            result["swap"] = run_swap(
                model, args.device, args.swap_blocks, args.requests, io, args.dtype
            )
        if "chat" in args.sections:
            result["chat"] = run_chat(
                model, args.device, args.gpu_blocks, args.tier_gib, args.convs, args.turns,
                *chat, args.dtype,
            )  # fmt: skip
    result["load_average_1min"] = {"before": round(load0, 2), "after": round(os.getloadavg()[0], 2)}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in args.sections}, indent=2))
    return result


if __name__ == "__main__":
    main()
