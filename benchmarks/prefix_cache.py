"""Prefix caching on a multi-turn chat workload, on against off, side by side in one run.

    python -m benchmarks.prefix_cache                       # a hybrid (Qwen3.5) and a transformer
    python -m benchmarks.prefix_cache --archs qwen3_5 --conversations 8 --turns 2
    python -m benchmarks.prefix_cache --device cuda --archs qwen3_5 lfm2 qwen3 --hidden-size 1024

Workload: `conversations` chats that share one system prompt (`system_tokens` random ids), each
`turns` turns long. A turn sends every chat's whole history (system prompt, earlier user
messages and answers, a new user message of 32-96 tokens) in one `LLM.generate` call and appends
the greedy answers (`max_tokens`, ignore_eos). So the first turn shares the system prompt across
requests, and every later turn repeats its chat's history.

Models: random weights, written by `paged_engine.testing.write_tiny_model` at a small but not
tiny size (`--hidden-size`, `--layers`); for the hybrid, prefix caching resumes from state
snapshots (docs/engine.md, "Hybrid linear-attention models"), for a transformer from KV blocks
alone. Per (model, prefix caching): wall time, output tokens/s, prompt tokens, prompt tokens
taken from the cache (and for the hybrid the admissions resumed from a snapshot), and whether
the answers equal those of the run without it. Each engine runs the workload once to warm up,
forgets its prefix cache, and is timed on a second run.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import environment, write_result

ROOT = Path(__file__).resolve().parent.parent
# Hybrids' layer types, four layers at a time: Qwen3.5 / Qwen3-Next's 3 : 1, LFM2's
LAYER_PATTERNS = {
    "qwen3_5": ["linear_attention"] * 3 + ["full_attention"],
    "qwen3_next": ["linear_attention"] * 3 + ["full_attention"],
    "lfm2": ["conv", "conv", "full_attention", "conv"],
}


def chat(llm, args) -> dict:
    """Run the workload once; timings, token counts and the answers."""
    from paged_engine import SamplingParams

    rng = random.Random(0)
    vocab = llm.llm_engine.vocab_size

    def text(n: int) -> list[int]:
        return [rng.randrange(3, vocab - 1) for _ in range(n)]

    system = text(args.system_tokens)
    histories = [list(system) for _ in range(args.conversations)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    answers, prompt_tokens, cached, out_tokens = [], 0, 0, 0
    t0 = time.perf_counter()
    for _ in range(args.turns):
        for h in histories:
            h += text(rng.randrange(32, 97))
        outs = llm.generate([{"prompt_token_ids": h} for h in histories], params, use_tqdm=False)
        for h, o in zip(histories, outs, strict=True):
            ids = list(o.outputs[0].token_ids)
            h += ids
            answers.append(ids)
            prompt_tokens += len(o.prompt_token_ids)
            cached += o.num_cached_tokens or 0
            out_tokens += len(ids)
    elapsed = time.perf_counter() - t0
    return {
        "elapsed_s": round(elapsed, 3),
        "output_tokens_per_s": round(out_tokens / elapsed, 1),
        "prompt_tokens": prompt_tokens,
        "cached_prompt_tokens": cached,
        "computed_prompt_tokens": prompt_tokens - cached,
        "_answers": answers,
    }


def main(argv: list[str] | None = None) -> None:
    from paged_engine import LLM
    from paged_engine.testing import write_tiny_model

    p = argparse.ArgumentParser(prog="python -m benchmarks.prefix_cache", description=__doc__)
    p.add_argument("--archs", nargs="+", default=["qwen3_5", "qwen3"])
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--layers", type=int, default=8, help="a multiple of 4")
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--out", type=Path, default=None, help="default: docs/benchmarks/<device>/")
    args = p.parse_args(argv)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    out = args.out or ROOT / "docs/benchmarks" / device / "prefix_cache.json"
    size = {
        "hidden_size": args.hidden_size,
        "num_hidden_layers": args.layers,
        "intermediate_size": 2 * args.hidden_size,
        "vocab_size": 4096,
        "max_position_embeddings": 4096,
    }
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.archs:
            kw = dict(size)
            if arch in LAYER_PATTERNS:
                kw["layer_types"] = LAYER_PATTERNS[arch] * (args.layers // 4)
            path = write_tiny_model(Path(tmp) / arch, arch, seed=0, **kw)
            base = None
            for caching in (False, True):
                llm = LLM(
                    model=str(path),
                    dtype="float32",  # the answers are compared: no bf16 rounding noise
                    device=device,
                    max_model_len=4096,
                    enable_prefix_caching=caching,
                )
                chat(llm, args)  # warm-up: first calls, allocator; then a cold cache again
                assert llm.llm_engine.reset_prefix_cache()
                slots = llm.llm_engine.scheduler.state_slots
                hits0 = slots.snapshot_hits if slots is not None else 0
                r = chat(llm, args)
                if slots is not None and caching:
                    r["snapshot_hits"] = slots.snapshot_hits - hits0
                del llm
                if base is None:
                    base = r
                else:
                    r["speedup"] = round(base["elapsed_s"] / r["elapsed_s"], 3)
                    r["identical_answers"] = r["_answers"] == base["_answers"]
                rec = {"arch": arch, "prefix_caching": caching}
                rec.update({k: v for k, v in r.items() if not k.startswith("_")})
                records.append(rec)
                print(rec, flush=True)
    result = {
        "benchmark": "prefix_cache",
        "command": " ".join(["python -m benchmarks.prefix_cache", *(argv or sys.argv[1:])]),
        "model": f"write_tiny_model(arch, {size}), random weights, float32",
        "workload": f"{args.conversations} chats sharing a {args.system_tokens}-token system "
        f"prompt, {args.turns} turns, user messages of 32-96 tokens, greedy answers of "
        f"{args.max_tokens} tokens (ignore_eos); each turn one LLM.generate call",
        "environment": environment(device),
        "records": records,
    }
    write_result(out, result)


if __name__ == "__main__":
    main()
