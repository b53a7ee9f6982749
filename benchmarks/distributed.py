"""Tensor and pipeline parallelism: throughput and agreement with one process, side by side.

    python -m benchmarks.distributed --smoke                     # CPU: gloo ranks, a small llama
    python -m benchmarks.distributed --model-config llama-3.1-8b --tp 1 2 4 8 --pp 1   # GPUs

Each layout runs the same greedy workload (nano-vllm shape, ignore_eos) on one engine; the
record holds output tokens/s, the wall time, and how the layout's tokens and logprobs compare
with the first layout's (tp=1, pp=1). Seeded random weights of a real architecture's config
(benchmarks/configs), written once as a checkpoint; without --model-config a small llama, so
two ranks fit on two cores. On a CPU the ranks share the cores and add collectives: there TP
is about being correct, not faster.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.common import environment
from benchmarks.models import CONFIGS, materialize
from benchmarks.workloads import nano_vllm

ROOT = Path(__file__).resolve().parent.parent


def run_layout(model: str, workload, tp: int, pp: int, device: str, dtype: str) -> dict:
    from paged_engine import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        model=model,
        dtype=dtype,
        device=device,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        max_model_len=2048,
        seed=0,
    )
    startup = time.perf_counter() - t0
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in workload.requests]
    params = [
        SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True, logprobs=0)
        for r in workload.requests
    ]
    try:
        llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
    finally:
        llm.llm_engine.shutdown()
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [
        [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
        for o in outs
    ]
    return {
        "tp": tp,
        "pp": pp,
        "startup_s": round(startup, 2),
        "elapsed_s": round(elapsed, 3),
        "output_tokens_per_s": round(workload.output_tokens / elapsed, 2),
        "_tokens": tokens,
        "_logprobs": logprobs,
    }


def compare(base: dict, other: dict) -> dict:
    """Agreement of a layout with the base layout: identical greedy tokens, logprob gap."""
    same = sum(a == b for a, b in zip(base["_tokens"], other["_tokens"]))
    gaps = [
        abs(x - y)
        for a, b, la, lb in zip(
            base["_tokens"], other["_tokens"], base["_logprobs"], other["_logprobs"]
        )
        if a == b
        for x, y in zip(la, lb)
    ]
    return {
        "requests_with_identical_tokens": same,
        "max_logprob_diff": max(gaps) if gaps else None,
        "speed_vs_base": round(other["output_tokens_per_s"] / base["output_tokens_per_s"], 3),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.distributed", description=__doc__)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None)
    p.add_argument("--model-config", default=None, help="a name under benchmarks/configs")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--pp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/paged-bench/distributed"))
    args = p.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.model_config is None:
        # A small llama (the 1B config, narrowed) so two ranks run on two cores.
        cfg = json.loads(CONFIGS["llama-3.2-1b"].read_text())
        cfg.update(
            hidden_size=512,
            intermediate_size=1536,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=64,
            vocab_size=8192,
            bos_token_id=1,
            eos_token_id=2,
            tie_word_embeddings=False,
        )
        args.work_dir.mkdir(parents=True, exist_ok=True)
        config: str | Path = args.work_dir / "llama-small.json"
        config.write_text(json.dumps(cfg))
    else:
        config = args.model_config
    # Real (seeded random) weights in a checkpoint, so every layout runs the same model:
    # dummy weights would be drawn per shard, a different model per layout.
    torch_dtype = torch.float32 if device == "cpu" else torch.bfloat16
    spec = materialize(config, args.work_dir / Path(str(config)).stem, torch_dtype, device)
    dtype = "float32" if device == "cpu" else "bfloat16"
    n = args.num_requests or (16 if args.smoke or device == "cpu" else 256)
    out_len = (16, 64) if args.smoke or device == "cpu" else (100, 1024)
    in_len = (16, 256) if args.smoke or device == "cpu" else (100, 1024)
    workload = nano_vllm(n, in_len, out_len, max_token_id=spec.vocab_size - 1)
    layouts = [(1, 1)] + [(t, q) for q in args.pp for t in args.tp if (t, q) != (1, 1)]
    records = []
    for tp, pp in layouts:
        print(f"tp={tp} pp={pp} ...", flush=True)
        records.append(run_layout(str(spec.path), workload, tp, pp, device, dtype))
        if len(records) > 1:
            records[-1].update(compare(records[0], records[-1]))
        print({k: v for k, v in records[-1].items() if not k.startswith("_")}, flush=True)
    result = {
        "benchmark": "distributed",
        "command": "python -m benchmarks.distributed" + (" --smoke" if args.smoke else ""),
        "model": spec.origin,
        "workload": workload.describe() + ", greedy, ignore_eos",
        "dtype": dtype,
        "environment": environment(device),
        "records": [{k: v for k, v in r.items() if not k.startswith("_")} for r in records],
    }
    out = args.out or ROOT / "docs" / "benchmarks" / device / "distributed.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
