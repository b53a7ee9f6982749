"""KV memory, side by side in one run: an fp8 KV cache against the model dtype's at the same
memory, and the prefix cache's CPU tier under memory pressure.

    python -m benchmarks.kv_memory                 # CPU smoke sizes, writes
                                                   # docs/benchmarks/cpu/kv_memory.json
    python -m benchmarks.kv_memory --device cuda   # GPU (same sizes unless changed)

fp8     the nano-vllm workload (scaled down) on one KV budget (`--kv-gib`), kv_cache_dtype
        "auto" (the model dtype) vs "fp8" vs "fp8_e5m2": KV blocks, the most sequences running
        at once, preemptions, wall time and output tokens/s, per attention backend (on CPU the
        cpu backend, the default, and the torch reference for "auto" vs "fp8"; ratios are
        against the same backend's "auto" run).
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
import random
import statistics
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


def _drive(engine, requests) -> tuple[float, int]:
    """Run (id, prompt, params) to the end; (wall seconds, most sequences running at once)."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params, final_only=True)
    peak = 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, engine.scheduler.num_running_seqs)
    return time.perf_counter() - t0, peak


def run_fp8(
    model: Path, device: str, kv_gib: float, num_requests: int, io: tuple,
    backends: tuple[str, ...] | None = None, repeat: int = 1,
) -> dict:  # fmt: skip
    """The nano-vllm recipe at one KV budget, per attention backend and kv_cache_dtype. With
    `repeat` > 1 the whole set of runs repeats (interleaved, so load drifts hit every config
    alike) and each config keeps its fastest run (`wall_s_all` lists them all)."""
    from paged_engine import LLM, SamplingParams

    wl = nano_vllm(num_requests, input_len=io[0], output_len=io[1], max_token_id=500)
    requests = [
        (str(i), {"prompt_token_ids": r.prompt_token_ids}, SamplingParams(
            temperature=0.6, seed=i, ignore_eos=True, max_tokens=r.max_tokens))
        for i, r in enumerate(wl.requests)
    ]  # fmt: skip
    if backends is None:
        backends = ("cpu", "torch") if device == "cpu" else ("auto",)
    runs = [(b, kv) for b in backends for kv in ("auto", "fp8", "fp8_e5m2")]
    runs = [(b, kv) for b, kv in runs if b != "torch" or kv != "fp8_e5m2"]  # the slow path
    records: dict[tuple[str, str], dict] = {}
    for backend, kv in [run for _ in range(repeat) for run in runs]:
        llm = LLM(
            model=str(model), dtype="float32", device=device, max_model_len=1024,
            kv_cache_dtype=kv, cpu_kv_cache_gib=kv_gib, attention_backend=backend,
        )  # fmt: skip
        engine = llm.llm_engine
        engine.add_request("warmup", {"prompt_token_ids": [5] * 32}, SamplingParams(max_tokens=4))
        while engine.has_unfinished_requests():
            engine.step()
        elapsed, peak = _drive(engine, requests)
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
    system_len: int, user_len: tuple, reply_len: int,
) -> dict:  # fmt: skip
    """Every conversation's turn t, then turn t + 1 (each resends the whole conversation)."""
    from paged_engine import LLM, SamplingParams

    system, users = chat_turns(num_convs, turns, system_len, user_len)
    sp = SamplingParams(temperature=0, max_tokens=reply_len, ignore_eos=True)
    records, outputs = [], {}
    max_len = min(1024, 16 * (gpu_blocks - 1))  # what the device pool holds
    for tier in (0.0, tier_gib):
        llm = LLM(
            model=str(model), dtype="float32", device=device, max_model_len=max_len,
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


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--kv-gib", type=float, default=2**-6, help="fp8 section: KV budget (GiB)")
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--repeat", type=int, default=1, help="fp8 section: runs per config (best)")
    p.add_argument("--gpu-blocks", type=int, default=96, help="chat section: device pool")
    p.add_argument("--tier-gib", type=float, default=2**-6, help="chat section: CPU tier (GiB)")
    p.add_argument("--convs", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--out", default=str(ROOT / "docs/benchmarks/cpu/kv_memory.json"))
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_llama(Path(tmp), args.hidden, args.layers)
        result = {
            "command": "python -m benchmarks.kv_memory " + " ".join(argv or []),
            "environment": environment(args.device),
            "model": f"random llama, hidden {args.hidden}, {args.layers} layers, float32",
            "fp8": run_fp8(model, args.device, args.kv_gib, args.requests,
                           ((100, 400), (50, 200)), repeat=args.repeat),
            "chat": run_chat(model, args.device, args.gpu_blocks, args.tier_gib, args.convs,
                             args.turns, 200, (40, 80), 32),
        }  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("fp8", "chat")}, indent=2))
    return result


if __name__ == "__main__":
    main()
