"""The CPU comparison of issue 12, every system side by side in one run, each in its own process.

    python -m benchmarks.cpu_compare [--only throughput single single_ab aggregate accuracy compile]

- throughput: the default model (SmolLM2-135M-Instruct GGUF, dequantised to float32), 48
  requests, prompts 16-256 random ids, outputs 16-96, ignore_eos (nano-vllm recipe, scaled):
  paged `LLM.generate` (CPU backend; with fp16 weights, eager and compiled (`-O3`); in
  batch-invariant mode; and the torch reference backend, the path before it) vs HF `generate`
  (static batches of 16) and HF continuous batching (its paged sdpa), per wall-second and per
  CPU-second (user + system time of the process, all threads).
- single: one request, 8-token prompt, 128 greedy tokens: paged in float32 / bfloat16 / fp16
  weights (fbgemm) / int8 / int4, fp16, float32 and int8 compiled (`compilation_config=3`), HF
  `generate` float32, llama.cpp (llama-cpp-python, the same
  GGUF file).
- single_ab: one stream again, paged fp16 weights, paged int8 compiled and llama.cpp in one
  process, their runs interleaved (5 rounds): the ratio to llama.cpp without the VM's drift.
Every system gets `--threads` CPU threads (default 2).
- aggregate: 16 and 48 concurrent requests (prompts from the workload, 64 outputs each): paged
  `LLM.generate` vs llama-cpp-python, which decodes one stream at a time (its Python API has no
  batching), so its aggregate is its requests run back to back.
- compile: fp16 weights eager vs `compilation_config=3`, both engines in one process, their
  runs interleaved (one stream; 16 requests), medians of 4 rounds; once in this process and once
  in a spawned worker.
- accuracy: greedy agreement (first 64 tokens of 8 text prompts) and perplexity on a fixed text,
  bfloat16 / fp16 weights / int8 / int4 against float32.

Results: docs/benchmarks/cpu/cpu_compare-threads<N>[-<tag>].json (with the load average before
and after each system: the machine is shared). llama-cpp-python is a benchmark peer only,
never a dependency.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from benchmarks.common import call, cpu_seconds, environment, error_record

ROOT = Path(__file__).resolve().parent.parent
PROMPT = list(range(100, 108))
# fp16 weights with the forward through torch.compile (worker/cpu_compile.py), compiled while
# the engine starts (outside the timed part).
FP16_COMPILED = {"quantization": "fp16", "compilation_config": 3}
# int8 weights with float32 activations, compiled: one stream's GEMVs traced into inductor's C++
INT8_COMPILED = {"quantization": "int8", "dtype": "float32", "compilation_config": 3}
TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden press adapted from wine making. "
    "Within fifty years presses were running in more than two hundred European cities, and the "
    "price of books fell so far that reading spread from monasteries and universities to "
    "merchants and craftsmen. Printers standardised spelling, grammar and the layout of pages, "
    "and the rapid copying of pamphlets carried the ideas of the Reformation across borders."
)


def _workload(num_requests: int = 48):
    from benchmarks import workloads

    return workloads.nano_vllm(num_requests, (16, 256), (16, 96), max_token_id=10000)


def _spec(work_dir: Path):
    from benchmarks.models import default_model

    return default_model("cpu", work_dir)


def _llm(**overrides):
    from paged_engine import LLM

    kw = dict(model="SmolLM2-135M-Instruct", dtype="float32", max_model_len=512, seed=0)
    kw.update(overrides)
    return LLM(**kw)


def paged_throughput(work_dir: Path, **engine) -> dict:
    from benchmarks.throughput import paged_generate

    return paged_generate(_spec(work_dir), _workload(), "cpu", **engine)


def hf_throughput(work_dir: Path, system: str) -> dict:
    from benchmarks.hf_baselines import hf_continuous, hf_static

    wl = _workload()
    if system == "hf-static":
        return hf_static(_spec(work_dir), wl, "cpu", batch_size=16)
    need = sum(-(-(len(r.prompt_token_ids) + r.max_tokens) // 256) for r in wl.requests)
    return hf_continuous(_spec(work_dir), wl, "cpu", num_blocks=need + 4, max_batch_tokens=2048)


def _timed(fn) -> tuple[float, float]:
    t0, c0 = time.perf_counter(), cpu_seconds()
    fn()
    return time.perf_counter() - t0, cpu_seconds() - c0


# One 128-token stream lasts 1-7 s, and this VM's speed drifts by tens of percent over seconds:
# each single-stream system runs SINGLE_RUNS times back to back and reports the median.
SINGLE_RUNS = 5


def _single(fn) -> dict:
    runs = sorted(_timed(fn) for _ in range(SINGLE_RUNS))
    wall, cpu = runs[len(runs) // 2]
    return {
        "tokens_per_s": round(128 / wall, 2),
        "wall_s": round(wall, 3),
        "cpu_s": round(cpu, 3),
        "runs_tokens_per_s": [round(128 / w, 2) for w, _ in runs],
    }


def paged_single(work_dir: Path, **engine) -> dict:
    from paged_engine import SamplingParams

    llm = _llm(**engine)
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    prompt = {"prompt_token_ids": PROMPT}
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    return _single(lambda: llm.generate([prompt], params, use_tqdm=False))


def hf_single(work_dir: Path) -> dict:
    import torch

    from benchmarks.models import load_hf

    model = load_hf(_spec(work_dir), "cpu", "sdpa")
    ids = torch.tensor([PROMPT])
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=8, min_new_tokens=8, **kw)
        return _single(lambda: model.generate(ids, max_new_tokens=128, min_new_tokens=128, **kw))


def _llama_cpp(threads: int):
    import llama_cpp  # benchmark peer only: pip install llama-cpp-python

    from paged_engine.default_model import default_model_path

    # n_threads_batch too: llama-cpp-python's generate() evaluates each new token as a batch,
    # and its default (every core) oversubscribes a loaded machine when `threads` is fewer.
    return llama_cpp.Llama(
        model_path=str(default_model_path()),
        n_threads=threads,
        n_threads_batch=threads,
        n_ctx=1024,
        verbose=False,
    )


def _llama_generate(llm, prompt: list[int], n: int) -> int:
    llm.reset()
    count = 0
    for _ in llm.generate(prompt, temp=0.0, reset=True):
        count += 1
        if count == n:
            break
    return count


def llama_single(work_dir: Path, threads: int) -> dict:
    llm = _llama_cpp(threads)
    _llama_generate(llm, PROMPT, 8)
    return _single(lambda: _llama_generate(llm, PROMPT, 128))


def paged_aggregate(work_dir: Path, num_requests: int, **engine) -> dict:
    from paged_engine import SamplingParams

    wl = _workload(num_requests)
    llm = _llm(**engine)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in wl.requests]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    wall, cpu = _timed(lambda: llm.generate(prompts, params, use_tqdm=False))
    tokens = 64 * num_requests
    return {
        "tokens_per_s": round(tokens / wall, 2),
        "wall_s": round(wall, 3),
        "cpu_s": round(cpu, 3),
    }


def llama_aggregate(work_dir: Path, num_requests: int, threads: int) -> dict:
    wl = _workload(num_requests)
    llm = _llama_cpp(threads)
    _llama_generate(llm, PROMPT, 4)
    wall, cpu = _timed(lambda: [_llama_generate(llm, r.prompt_token_ids, 64) for r in wl.requests])
    tokens = 64 * num_requests
    return {
        "tokens_per_s": round(tokens / wall, 2),
        "wall_s": round(wall, 3),
        "cpu_s": round(cpu, 3),
    }


def compile_ab(work_dir: Path, rounds: int = 4) -> dict:
    """fp16 weights eager vs compiled (`compilation_config=3`), both engines in this one process,
    their runs interleaved: one stream (128 tokens) and 16 requests (64 tokens each, prefix
    cache off so every round prefills). Medians over `rounds`; robust to this VM's drift, which
    separate processes run minutes apart are not."""
    import statistics

    from paged_engine import SamplingParams

    engines = {
        "eager": _llm(quantization="fp16", enable_prefix_caching=False),
        "compiled": _llm(**FP16_COMPILED, enable_prefix_caching=False),
    }
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in _workload(16).requests]
    single = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    batch = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    runs: dict = {name: {"single": [], "aggregate_16": []} for name in engines}
    for llm in engines.values():
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    one = [{"prompt_token_ids": PROMPT}]
    for _ in range(rounds):
        for name, llm in engines.items():
            wall, _ = _timed(lambda llm=llm: llm.generate(one, single, use_tqdm=False))
            runs[name]["single"].append(round(128 / wall, 2))
            wall, _ = _timed(lambda llm=llm: llm.generate(prompts, batch, use_tqdm=False))
            runs[name]["aggregate_16"].append(round(64 * 16 / wall, 2))
    out = {
        name: {k: {"tokens_per_s": statistics.median(v), "runs": v} for k, v in r.items()}
        for name, r in runs.items()
    }
    for k in ("single", "aggregate_16"):
        out[f"speedup_{k}"] = round(
            out["compiled"][k]["tokens_per_s"] / out["eager"][k]["tokens_per_s"], 3
        )
    return out


def single_ab(work_dir: Path, threads: int, rounds: int = 5) -> dict:
    """One stream (128 greedy tokens): paged fp16 weights (the default), paged int8 compiled
    and llama.cpp, all in this one process, their runs interleaved round by round; medians over
    `rounds`, and the median of each round's paged / llama.cpp ratio (this VM's speed drifts by
    tens of percent over minutes: systems measured minutes apart are not comparable)."""
    import statistics

    from paged_engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    one = [{"prompt_token_ids": PROMPT}]
    paged = {
        "paged-fp16-weights": _llm(quantization="fp16"),
        "paged-int8-compiled": _llm(**INT8_COMPILED),
    }
    runners = {
        name: (lambda llm=llm: llm.generate(one, params, use_tqdm=False))
        for name, llm in paged.items()
    }
    llama = _llama_cpp(threads)
    runners["llama.cpp-q4_1"] = lambda: _llama_generate(llama, PROMPT, 128)
    for run in runners.values():  # warm-up
        run()
    runs: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(rounds):
        for name, run in runners.items():
            wall, _ = _timed(run)
            runs[name].append(round(128 / wall, 2))
    out: dict = {
        name: {"tokens_per_s": statistics.median(v), "runs": v} for name, v in runs.items()
    }
    for name in paged:
        ratios = [p / q for p, q in zip(runs[name], runs["llama.cpp-q4_1"], strict=True)]
        out[f"{name}_vs_llama.cpp"] = round(statistics.median(ratios), 3)
    return out


def accuracy(work_dir: Path) -> dict:
    """Greedy agreement and perplexity of bf16 / int8 / int4 against float32."""
    import math

    from paged_engine import SamplingParams

    prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a small village,",
        "The three primary colors are",
        "Water boils at a temperature of",
        "To make a cup of tea, first",
        "The largest planet in the solar system is",
        "In 1969, the first humans",
    ]
    greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    scoring = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    results, reference = {}, None
    for name, kw in [
        ("float32", {}),
        ("bfloat16", {"dtype": "bfloat16"}),
        ("fp16-weights", {"quantization": "fp16"}),
        ("fp16-weights-compiled", FP16_COMPILED),
        ("int8", {"dtype": "bfloat16", "quantization": "int8"}),
        ("int8-compiled", INT8_COMPILED),
        ("int4", {"dtype": "bfloat16", "quantization": "int4"}),
    ]:
        llm = _llm(**kw)
        text_ids = llm.get_tokenizer().encode(TEXT)
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        scored = llm.generate([{"prompt_token_ids": text_ids}], scoring, use_tqdm=False)[0]
        lps = [d[t].logprob for d, t in zip(scored.prompt_logprobs[1:], text_ids[1:], strict=True)]
        ppl = math.exp(-sum(lps) / len(lps))
        if reference is None:
            reference = outs
        agree = [
            next((i for i, (a, b) in enumerate(zip(o, r, strict=True)) if a != b), len(r))
            for o, r in zip(outs, reference, strict=True)
        ]
        results[name] = {
            "perplexity": round(ppl, 4),
            "greedy_tokens_matching_fp32_before_first_difference": agree,
            "greedy_full_agreement": sum(a == 64 for a in agree),
        }
    return {"text_tokens": len(text_ids), "prompts": len(prompts), "results": results}


def _run(name: str, fn, *args, log=print, isolate: bool = True, **kwargs) -> dict:
    load0 = os.getloadavg()[0]
    try:
        rec = call(fn, *args, isolate=isolate, **kwargs)
    except Exception as exc:  # a missing peer (llama-cpp-python) is recorded, never fatal
        rec = error_record(name, fn.__name__, exc)
    rec["load_avg_1m"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
    log(f"  {name}: {json.dumps(rec)[:300]}")
    return rec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cpu_compare", description=__doc__)
    p.add_argument(
        "--only",
        nargs="+",
        default=["throughput", "single", "single_ab", "aggregate", "accuracy", "compile"],
    )
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/paged-bench"))
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks" / "cpu")
    p.add_argument(
        "--threads",
        type=int,
        default=2,
        help="CPU threads of every system (OMP_NUM_THREADS of each spawned process: paged and "
        "torch follow it; llama.cpp's n_threads)",
    )
    p.add_argument("--tag", default="", help="suffix of the result file (e.g. the machine)")
    args = p.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by every spawned system
    args.work_dir.mkdir(parents=True, exist_ok=True)
    wd = args.work_dir
    out: dict = {
        "env": environment("cpu"),
        "threads": args.threads,
        "command": "python -m benchmarks.cpu_compare " + " ".join(argv or sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    if "throughput" in args.only:
        print("throughput (48 requests, prompts 16-256, outputs 16-96, float32)", flush=True)
        out["throughput"] = {
            "paged": _run("paged", paged_throughput, wd),
            "paged-torch-reference": _run(
                "paged-torch-reference", paged_throughput, wd, attention_backend="torch"
            ),
            "paged-fp16-weights": _run(
                "paged-fp16-weights", paged_throughput, wd, quantization="fp16"
            ),
            "paged-fp16-weights-compiled": _run(
                "paged-fp16-weights-compiled", paged_throughput, wd, **FP16_COMPILED
            ),
            "paged-batch-invariant": _run(
                "paged-batch-invariant", paged_throughput, wd, batch_invariant=True
            ),
            "hf-static": _run("hf-static", hf_throughput, wd, "hf-static"),
            "hf-continuous": _run("hf-continuous", hf_throughput, wd, "hf-continuous"),
        }
    if "single" in args.only:
        print("single stream (128 greedy tokens)", flush=True)
        out["single"] = {
            "paged-float32": _run("paged-float32", paged_single, wd),
            "paged-bfloat16": _run("paged-bfloat16", paged_single, wd, dtype="bfloat16"),
            "paged-fp16-weights": _run("paged-fp16-weights", paged_single, wd, quantization="fp16"),
            "paged-fp16-weights-compiled": _run(
                "paged-fp16-weights-compiled", paged_single, wd, **FP16_COMPILED
            ),
            "paged-float32-compiled": _run(
                "paged-float32-compiled", paged_single, wd, compilation_config=3
            ),
            "paged-int8-compiled": _run("paged-int8-compiled", paged_single, wd, **INT8_COMPILED),
            "paged-int8": _run(
                "paged-int8", paged_single, wd, dtype="bfloat16", quantization="int8"
            ),
            "paged-int4": _run(
                "paged-int4", paged_single, wd, dtype="bfloat16", quantization="int4"
            ),
            "hf-generate-float32": _run("hf-generate-float32", hf_single, wd),
            "llama.cpp-q4_1": _run("llama.cpp-q4_1", llama_single, wd, args.threads),
        }
    if "single_ab" in args.only:
        print("single stream, paged and llama.cpp interleaved in one process", flush=True)
        out["single_ab"] = _run("single-ab", single_ab, wd, args.threads)
    if "aggregate" in args.only:
        print("aggregate (16 / 48 concurrent requests, 64 tokens each)", flush=True)
        out["aggregate"] = {
            str(n): {
                "paged-float32": _run(f"paged-float32-{n}", paged_aggregate, wd, n),
                "paged-bfloat16": _run(
                    f"paged-bfloat16-{n}", paged_aggregate, wd, n, dtype="bfloat16"
                ),
                "paged-fp16-weights": _run(
                    f"paged-fp16-weights-{n}", paged_aggregate, wd, n, quantization="fp16"
                ),
                "paged-fp16-weights-compiled": _run(
                    f"paged-fp16-weights-compiled-{n}", paged_aggregate, wd, n, **FP16_COMPILED
                ),
                "paged-int8": _run(
                    f"paged-int8-{n}", paged_aggregate, wd, n, dtype="bfloat16", quantization="int8"
                ),
                "paged-int8-compiled": _run(
                    f"paged-int8-compiled-{n}", paged_aggregate, wd, n, **INT8_COMPILED
                ),
                "llama.cpp-q4_1-sequential": _run(
                    f"llama.cpp-{n}", llama_aggregate, wd, n, args.threads
                ),
            }
            for n in (16, 48)
        }
    if "compile" in args.only:
        print("fp16 weights, eager vs compiled, interleaved in one process", flush=True)
        # In this process and in a spawned pool worker like every other system: the compiled
        # forward has measured slower in the latter (cpu_compare.md), the eager one has not.
        out["compile_ab"] = _run("compile-ab", compile_ab, wd, isolate=False)
        out["compile_ab_spawned"] = _run("compile-ab-spawned", compile_ab, wd)
    if "accuracy" in args.only:
        print("accuracy against float32", flush=True)
        out["accuracy"] = _run("accuracy", accuracy, wd)
    args.out.mkdir(parents=True, exist_ok=True)
    tag = f"-{args.tag}" if args.tag else ""
    path = args.out / f"cpu_compare-threads{args.threads}{tag}.json"
    old = json.loads(path.read_text()) if path.is_file() else {}
    old.update(out)
    path.write_text(json.dumps(old, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
