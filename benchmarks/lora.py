"""What multi-LoRA costs: five engines on one workload, side by side in one process.

    (a) base            enable_lora=False
    (b) lora-unused     enable_lora=True (max_loras=4), no request names an adapter
    (c) one-adapter     every request with the same adapter (max_loras=4)
    (d) four-adapters   requests round-robin over 4 adapters, max_loras=4
    (e) four-on-2-slots the same 4 adapters with max_loras=2: adapters take turns in the batch

Adapters: rank 16 (alpha 16) on q/k/v/o/gate/up/down, random A and B (`write_lora_adapter`),
all four kept in host memory (max_cpu_loras=4) and loaded during the warm-up, so the timed run
measures serving them, not reading them from disk. Workload: nano-vllm's shape, greedy
(temperature 0), ignore_eos. Each engine: one warm-up, then one timed `generate` (prefill
included), then shut down before the next starts.

Guards (in the JSON under `checks`, exit status 1 when one fails): (b)'s tokens equal (a)'s for
every request, and (c) and (d) change the output of most requests (the adapters are applied).
`--repeat N` runs N rounds over the five systems (a fresh engine each time, so a load spike on a
shared machine hits one round, not one system) and keeps each system's fastest round.

    python -m benchmarks.lora --smoke                 # CPU: 8 requests, qwen3-0.6b with 2 layers
    python -m benchmarks.lora --device cuda           # Qwen3-0.6B config, bf16, 256 requests
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.common import (
    cpu_seconds,
    environment,
    error_record,
    free_memory,
    now,
    throughput_record,
)
from benchmarks.models import CONFIGS, ModelSpec, config_dir, from_dir
from benchmarks.throughput import engine_kwargs, max_len
from benchmarks.workloads import Workload, nano_vllm

if TYPE_CHECKING:
    from paged_engine import LoRARequest

ROOT = Path(__file__).resolve().parent.parent
RANK = 16
ALPHA = 16
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NUM_ADAPTERS = 4


@dataclass(frozen=True, slots=True)
class System:
    key: str  # (a)..(e)
    name: str
    enable_lora: bool
    max_loras: int  # 0 without LoRA
    num_adapters: int  # requests cycle over this many adapters; 0: none names one

    @property
    def setup(self) -> str:
        if not self.enable_lora:
            return "enable_lora=False"
        used = f"{self.num_adapters} adapter(s)" if self.num_adapters else "no adapter used"
        return f"max_loras={self.max_loras}, {used}"


SYSTEMS = (
    System("a", "base", False, 0, 0),
    System("b", "lora-unused", True, NUM_ADAPTERS, 0),
    System("c", "one-adapter", True, NUM_ADAPTERS, 1),
    System("d", "four-adapters", True, NUM_ADAPTERS, NUM_ADAPTERS),
    System("e", "four-on-2-slots", True, 2, NUM_ADAPTERS),
)


def write_adapters(spec: ModelSpec, out_dir: Path) -> list[LoRARequest]:
    """NUM_ADAPTERS random adapters (seeds 1..N) for `spec`, as LoRARequests with ids 1..N."""
    from paged_engine import LoRARequest
    from paged_engine.testing import write_lora_adapter

    loras = []
    for i in range(1, NUM_ADAPTERS + 1):
        path = write_lora_adapter(
            out_dir / f"adapter-{i}",
            spec.path,
            rank=RANK,
            alpha=ALPHA,
            target_modules=TARGETS,
            seed=i,
        )
        loras.append(LoRARequest(f"bench-{i}", i, str(path)))
    return loras


def measure(
    system: System,
    spec: ModelSpec,
    wl: Workload,
    device: str,
    loras: list[LoRARequest],
    base_kw: dict,
) -> tuple[dict, list[list[int]]]:
    """One engine: warm-up (which also loads the adapters it uses), one timed generate,
    shutdown. Returns the record and every request's output token ids."""
    from paged_engine import LLM, SamplingParams

    kw = dict(base_kw)
    if system.enable_lora:
        kw.update(
            enable_lora=True,
            max_loras=system.max_loras,
            max_lora_rank=RANK,
            max_cpu_loras=NUM_ADAPTERS,
        )
    used = loras[: system.num_adapters]
    per_request = [used[i % len(used)] for i in range(wl.num_requests)] if used else None
    llm = LLM(**kw)
    try:
        warm_prompt = {"prompt_token_ids": wl.requests[0].prompt_token_ids[:8]}
        warm = SamplingParams(temperature=0, ignore_eos=True, max_tokens=4)
        n_warm = max(2, len(used))
        llm.generate(
            [warm_prompt] * n_warm,
            warm,
            use_tqdm=False,
            lora_request=[used[i % len(used)] for i in range(n_warm)] if used else None,
        )
        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in wl.requests]
        params = [
            SamplingParams(temperature=0, ignore_eos=True, max_tokens=r.max_tokens)
            for r in wl.requests
        ]
        t0, c0 = now(device), cpu_seconds()
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=per_request)
        elapsed, cpu_s = now(device) - t0, cpu_seconds() - c0
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        if [len(t) for t in tokens] != [r.max_tokens for r in wl.requests]:
            raise RuntimeError("paged did not generate the requested number of tokens")
        stats = llm.get_stats()
        extra = {
            "key": system.key,
            "setup": system.setup,
            "enable_lora": system.enable_lora,
            "max_loras": system.max_loras,
            "num_adapters": system.num_adapters,
            "engine": {k: v for k, v in kw.items() if k != "model"},
            "cuda_graphs": device == "cuda" and not kw["enforce_eager"],
            "num_preemptions": stats.num_preemptions,
            "num_total_blocks": stats.num_total_blocks,
        }
        return throughput_record(system.name, wl, elapsed, cpu_s, **extra), tokens
    finally:
        llm.llm_engine.shutdown()
        del llm
        free_memory(device)


def _differing(x: list[list[int]], y: list[list[int]]) -> int:
    return sum(a != b for a, b in zip(x, y, strict=True))


def checks(tokens: dict[str, list[list[int]]]) -> dict:
    """The guards; a check whose systems did not both run has ok = None."""
    out = {}

    def compare(name: str, left: str, right: str, want_equal: bool, what: str) -> None:
        if left not in tokens or right not in tokens:
            out[name] = {"what": what, "ok": None}
            return
        n, k = len(tokens[left]), _differing(tokens[left], tokens[right])
        ok = k == 0 if want_equal else 2 * k > n
        out[name] = {"what": what, "ok": ok, "requests_differing": k, "of": n}

    compare("unused_lora_equals_base", "a", "b", True, "(b) tokens == (a) tokens, every request")
    compare("one_adapter_applied", "a", "c", False, "(c) differs from (a) on most requests")
    compare("four_adapters_applied", "a", "d", False, "(d) differs from (a) on most requests")
    if "d" in tokens and "e" in tokens:  # informational: batches differ, so may the numerics
        k = _differing(tokens["d"], tokens["e"])
        out["two_slots_vs_four_slots"] = {
            "what": "(e) vs (d), same adapter per request (not a guard)",
            "requests_differing": k,
            "of": len(tokens["d"]),
        }
    return out


def with_ratios(best: dict[str, dict]) -> list[dict]:
    """The records in system order, each with its output tok/s over (a)'s when (a) ran."""
    base = best.get("a", {}).get("output_tokens_per_s")
    records = [best[s.key] for s in SYSTEMS if s.key in best]
    for rec in records:
        if base and "error" not in rec:
            rec["vs_base"] = round(rec["output_tokens_per_s"] / base, 3)
    return records


def keep_fastest(best: dict[str, dict], rec: dict) -> None:
    """Fold one round's record into `best` (per system key): the fastest round's record, with
    every round's wall time in `elapsed_runs_s`."""
    prev = best.get(rec["key"])
    runs = [*(prev or {}).get("elapsed_runs_s", []), rec["elapsed_s"]]
    if prev is None or rec["elapsed_s"] < prev["elapsed_s"]:
        best[rec["key"]] = rec
    best[rec["key"]]["elapsed_runs_s"] = runs


def table(records: list[dict]) -> str:
    lines = [
        "| system | setup | output tok/s | wall s | vs (a) |",
        "|---|---|---:|---:|---:|",
    ]
    for r in records:
        label = f"({r['key']}) {r['system']}"
        if "error" in r:
            lines.append(f"| {label} | {r['setup']} | error | | |")
            continue
        ratio = r.get("vs_base")
        lines.append(
            f"| {label} | {r['setup']} | {r['output_tokens_per_s']:.1f} | {r['elapsed_s']:.2f} | "
            f"{'' if ratio is None else f'{ratio:.3f}'} |"
        )
    return "\n".join(lines)


def build_workload(args: argparse.Namespace, device: str, vocab_size: int) -> Workload:
    """nano-vllm's recipe at this run's size (the published size on a GPU), greedy."""
    if device == "cuda":
        n, inp, outp = (32 if args.smoke else 256), (100, 1024), (100, 1024)
    elif args.smoke:
        n, inp, outp = 8, (16, 64), (8, 24)
    else:
        n, inp, outp = 32, (32, 256), (32, 128)
    n = args.requests or n
    inp = tuple(args.input_len or inp)
    outp = tuple(args.output_len or outp)
    wl = nano_vllm(n, inp, outp, max_token_id=min(10000, vocab_size - 1))
    return dataclasses.replace(wl, temperature=0.0)


def resolve_spec(args: argparse.Namespace, device: str) -> tuple[ModelSpec, dict]:
    """A named config as a config-only dir (dummy weights; CPU keeps 2 layers unless --layers
    says otherwise), or an HF dir with weights. Returns the spec and extra engine arguments."""
    if args.model_config in CONFIGS:
        layers = args.layers or (2 if device == "cpu" else None)
        overrides = {"num_hidden_layers": layers} if layers else {}
        tag = f"-L{layers}" if layers else ""
        out = args.work_dir / f"{args.model_config}{tag}-cfg"
        return config_dir(args.model_config, out, device, **overrides), {"load_format": "dummy"}
    path = Path(args.model_config)
    if not (path / "config.json").is_file():
        raise ValueError(
            f"--model-config {args.model_config!r}: neither a name in benchmarks/configs "
            f"({', '.join(CONFIGS)}) nor a model directory"
        )
    if args.layers:
        raise ValueError("--layers applies to a named config only")
    return from_dir(path, device), {}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.lora", description=__doc__)
    p.add_argument("--smoke", action="store_true", help="a small workload")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument(
        "--model-config",
        default="qwen3-0.6b",
        help=f"a name in benchmarks/configs ({', '.join(CONFIGS)}; dummy weights) or an HF dir",
    )
    p.add_argument("--layers", type=int, default=None, help="num_hidden_layers (CPU default 2)")
    p.add_argument("--requests", type=int, default=None, help="override the request count")
    p.add_argument("--input-len", type=int, nargs=2, default=None, metavar=("LO", "HI"))
    p.add_argument("--output-len", type=int, nargs=2, default=None, metavar=("LO", "HI"))
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rounds over the five systems (a fresh engine each time); each one's fastest counts",
    )
    p.add_argument("--cpu-threads", type=int, default=1, help="torch threads on CPU (0: default)")
    p.add_argument("--out", type=Path, default=None, help="dir (default docs/benchmarks/<device>)")
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/paged-bench"))
    args = p.parse_args(argv)
    for name in ("requests", "layers", "repeat"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name} must be >= 1, got {value}")
    for name in ("input_len", "output_len"):
        lo_hi = getattr(args, name)
        if lo_hi is not None and not 1 <= lo_hi[0] <= lo_hi[1]:
            p.error(f"--{name.replace('_', '-')} needs 1 <= LO <= HI, got {lo_hi}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from benchmarks.run_all import device_slug

    device = (
        args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    )
    if device == "cpu" and args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)
        # The engine sets its own thread count (default: the physical cores) on its thread.
        threads_kw = {"cpu_num_threads": args.cpu_threads}
    else:
        threads_kw = {}
    args.work_dir.mkdir(parents=True, exist_ok=True)
    spec, load_kw = resolve_spec(args, device)
    wl = build_workload(args, device, spec.vocab_size)
    base_kw = engine_kwargs(spec, device, max_len(wl, device), **load_kw, **threads_kw)
    loras = write_adapters(spec, args.work_dir / f"lora-{spec.path.name}")
    out_dir = args.out or ROOT / "docs" / "benchmarks" / device_slug(device)
    out_dir.mkdir(parents=True, exist_ok=True)
    out_file = out_dir / "lora.json"
    result = {
        "device": device_slug(device),
        "dtype": spec.dtype_name,
        "cuda_graphs": device == "cuda" and not base_kw["enforce_eager"],
        "date_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python -m benchmarks.lora " + " ".join(sys.argv[1:] if argv is None else argv),
        "smoke": args.smoke,
        "cpu_threads": threads_kw.get("cpu_num_threads"),  # None: the engine's default
        "model": {"name": spec.name, "dtype": spec.dtype_name, "origin": spec.origin},
        "workload": {
            "desc": wl.describe(),
            **wl.params,
            "prompt_tokens": wl.prompt_tokens,
            "output_tokens": wl.output_tokens,
            "sampling": "greedy (temperature 0), ignore_eos",
        },
        "lora": {
            "rank": RANK,
            "alpha": ALPHA,
            "target_modules": list(TARGETS),
            "num_adapters": NUM_ADAPTERS,
            "max_cpu_loras": NUM_ADAPTERS,
            "adapters_in": "random A and B (paged_engine.testing.write_lora_adapter, seeds 1-4)",
        },
        "env": environment(device),
        "load_avg": {"before": [round(x, 2) for x in os.getloadavg()]},
        "repeat": args.repeat,  # rounds over the systems; each record is its fastest round
        "rounds_identical": [],  # systems whose greedy tokens were the same in every round
        "complete": False,
        "records": [],
        "checks": {},
    }
    print(f"{spec.origin}, {spec.dtype_name}; {wl.describe()}; greedy", flush=True)
    tokens: dict[str, list[list[int]]] = {}  # per system: the first round's output ids
    best: dict[str, dict] = {}  # per system: its fastest round's record (or its error)
    changed: set[str] = set()  # systems whose tokens differed between rounds
    for rnd in range(1, args.repeat + 1):
        for system in SYSTEMS:
            if "error" in best.get(system.key, {}):
                continue  # failed in an earlier round
            print(f"[{rnd}/{args.repeat}] ({system.key}) {system.name}: {system.setup}", flush=True)
            try:
                rec, got = measure(system, spec, wl, device, loras, base_kw)
            except Exception as exc:  # recorded; the other systems still run
                rec = {**error_record(system.name, wl.name, exc), "key": system.key}
                if system.key in best:  # an earlier round measured it: keep that, note this
                    best[system.key]["round_error"] = rec["error"]
                else:
                    best[system.key] = {**rec, "setup": system.setup}
                print(f"  -> ERROR {rec['error']}", flush=True)
            else:
                if got != tokens.setdefault(system.key, got):
                    changed.add(system.key)
                keep_fastest(best, rec)
                print(f"  -> {rec['output_tokens_per_s']} out tok/s", flush=True)
            result["records"] = with_ratios(best)
            result["checks"] = checks(tokens)
            result["rounds_identical"] = sorted(set(tokens) - changed)
            # Rewritten after every engine: a run cut short by a time limit keeps its part.
            out_file.write_text(json.dumps(result, indent=1) + "\n")
    result["load_avg"]["after"] = [round(x, 2) for x in os.getloadavg()]
    result["complete"] = True
    out_file.write_text(json.dumps(result, indent=1) + "\n")
    print(table(result["records"]))
    for name, check in result["checks"].items():
        print(f"{name}: {json.dumps({k: v for k, v in check.items() if k != 'what'})}")
    print(f"wrote {out_file}", flush=True)
    errors = any("error" in r or "round_error" in r for r in result["records"])
    failed = any(c.get("ok") is False for c in result["checks"].values())
    return 1 if errors or failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
