"""Every tiny architecture under every engine mode, against the plain engine on the same inputs.

    python tests/mode_matrix.py                               # all archs, all modes, 2 jobs
    python tests/mode_matrix.py --archs qwen3_5 gemma3 --modes stress chat --jobs 1

The suite tests each mode on a few architectures; this sweep runs each of them on every
architecture `paged_engine.testing` can build (random weights, float32, CPU), one process per
(arch, mode), and compares outputs with the mode's reference run:

- waves: six prompts (three sharing a 19-token prefix, one repetitive), greedy with logprobs,
  seeded sampling, n = 2 and top-k, sent twice (the second wave hits the prefix cache);
- chat: five chats sharing a system prompt, three turns, each turn the whole history plus a new
  message, answers appended (later turns reuse earlier answers' KV blocks and snapshots).

A mode passes when every output's tokens equal the reference's and the top logprobs agree to
1e-3 (speculative decoding: greedy outputs only, its sampled ones are equal in distribution);
an engine that refuses a mode for an architecture with a ValueError is reported, not failed.
Exit status 1 if any mode differs or fails. About 15 minutes on 2 cores for the CPU modes;
`triton` (the Triton kernels in the interpreter) adds as much again.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SYSTEM = list(range(7, 26))
PROMPTS = [
    [*SYSTEM, 30, 31, 32],
    [*SYSTEM, 40, 41],
    [5, 6, 7, 8, 9] * 6,
    list(range(60, 97)),
    [50],
    [*SYSTEM, 30, 31, 32, 33, 34, 35, 36, 37, 38],
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}
# mode -> (engine options, reference mode, workload)
MODES: dict[str, tuple[dict, str, str]] = {
    "plain": ({"enable_prefix_caching": False}, "", "waves"),
    "stress": (  # prefix caching, prefill chunks of 8, preemption in a pool of 40 blocks
        {"max_num_batched_tokens": 8, "max_num_seqs": 3, "num_gpu_blocks_override": 40},
        "plain",
        "waves",
    ),
    "async": ({"async_scheduling": True, "max_num_batched_tokens": 16}, "plain", "waves"),
    "spec": ({"speculative_config": NGRAM}, "plain", "waves"),
    # async scheduling drafts at the rows the synchronous engine drafts at: seeded rows too
    "spec-async": ({"speculative_config": NGRAM, "async_scheduling": True}, "spec", "waves"),
    "tp2": ({"tensor_parallel_size": 2}, "plain", "waves"),
    "pp2": ({"pipeline_parallel_size": 2}, "plain", "waves"),
    "swap": (
        {
            "enable_prefix_caching": False,
            "preemption_mode": "swap",
            "swap_space": 0.05,
            "num_gpu_blocks_override": 40,
            "max_num_seqs": 3,
        },
        "plain",
        "waves",
    ),
    "offload": (
        {"cpu_offload_gib": 0.05, "num_gpu_blocks_override": 48, "max_num_seqs": 3},
        "plain",
        "waves",
    ),
    "torch": ({"attention_backend": "torch"}, "plain", "waves"),
    "block16": ({"block_size": 16, "max_num_batched_tokens": 24}, "plain", "waves"),
    "triton": ({"attention_backend": "triton", "max_num_batched_tokens": 16}, "plain", "waves"),
    "invariant": ({"batch_invariant": True}, "", "waves"),
    "invariant1": ({"batch_invariant": True}, "invariant", "one-by-one"),
    "chat-plain": ({"enable_prefix_caching": False}, "", "chat"),
    "chat": ({"max_num_batched_tokens": 32}, "chat-plain", "chat"),
    "chat-async": (
        {"async_scheduling": True, "num_gpu_blocks_override": 48, "max_num_seqs": 4},
        "chat-plain",
        "chat",
    ),
}
DEFAULT_MODES = [m for m in MODES if m != "triton"]


def _params(i: int, turn: int = 0):
    from paged_engine import SamplingParams

    return [
        SamplingParams(temperature=0.0, max_tokens=24, logprobs=1),
        SamplingParams(temperature=0.9, seed=3, max_tokens=20),
        SamplingParams(temperature=0.0, max_tokens=30),
        SamplingParams(temperature=1.0, seed=4, n=2, max_tokens=12),
        SamplingParams(temperature=0.0, max_tokens=16, logprobs=1),
        SamplingParams(temperature=0.7, seed=6, top_k=20, max_tokens=16),
    ][i]


def _record(out) -> list:
    """[(token ids, each token's top logprob or None)] per completion."""
    return [
        (
            list(c.token_ids),
            [max(d.values(), key=lambda lp: lp.logprob).logprob for d in c.logprobs]
            if c.logprobs
            else None,
        )
        for c in out.outputs
    ]


def run_one(arch: str, mode: str, models: Path) -> dict:
    """One engine, one workload; the outputs (or the error) as a JSON-able dict."""
    import random

    import torch

    from paged_engine import LLM, SamplingParams
    from paged_engine.testing import write_tiny_model

    torch.set_num_threads(1)
    path = models / arch
    if not (path / "config.json").exists():
        write_tiny_model(path, arch, seed=0)
    options, _, workload = MODES[mode]
    kw = {
        "model": str(path),
        "dtype": "float32",
        "max_model_len": 128,
        "block_size": 4,
        "cpu_kv_cache_gib": 0.05,
        **options,
    }
    rec: dict = {"arch": arch, "mode": mode}
    t0 = time.perf_counter()
    try:
        llm = LLM(**kw)
        outs, greedy = [], []
        if workload == "chat":
            rng, turns = random.Random(5), random.Random(6)
            system = [rng.randrange(3, 400) for _ in range(13)]
            chats = [list(system) for _ in range(5)]
            for turn in range(3):
                for chat in chats:
                    chat += [turns.randrange(3, 400) for _ in range(turns.randrange(2, 9))]
                params = [
                    SamplingParams(
                        temperature=0 if i % 2 else 0.8,
                        seed=10 * turn + i,
                        max_tokens=6 + 3 * i,
                        ignore_eos=True,
                        logprobs=1,
                    )
                    for i in range(len(chats))
                ]
                requests = [{"prompt_token_ids": c} for c in chats]
                for i, (chat, out) in enumerate(
                    zip(chats, llm.generate(requests, params, use_tqdm=False), strict=True)
                ):
                    outs.append(_record(out))
                    greedy.append(params[i].temperature == 0)
                    chat += out.outputs[0].token_ids
        else:
            for _ in range(2):  # the second wave hits the prefix cache
                params = [_params(i) for i in range(len(PROMPTS))]
                for p in params:
                    p.ignore_eos = True
                requests = [{"prompt_token_ids": p} for p in PROMPTS]
                if workload == "one-by-one":
                    results = [
                        llm.generate([r], [p], use_tqdm=False)[0]
                        for r, p in zip(requests, params, strict=True)
                    ]
                else:
                    results = llm.generate(requests, params, use_tqdm=False)
                outs += [_record(r) for r in results]
                greedy += [p.temperature == 0 for p in params]
        llm.llm_engine.shutdown()
        rec["outs"], rec["greedy"] = outs, greedy
    except ValueError as e:  # a mode the engine refuses for this architecture
        rec["refused"] = str(e)[:300]
    except Exception as e:
        rec["error"] = f"{type(e).__name__}: {e}"[:600]
        rec["traceback"] = traceback.format_exc()[-3000:]
    rec["seconds"] = round(time.perf_counter() - t0, 1)
    return rec


def compare(got: dict, want: dict, greedy_only: bool) -> list[str]:
    """Differences of one mode's outputs from its reference's."""
    diffs = []
    for i, (a, b, greedy) in enumerate(zip(want["outs"], got["outs"], want["greedy"], strict=True)):
        if greedy_only and not greedy:
            continue
        for j, ((ta, la), (tb, lb)) in enumerate(zip(a, b, strict=True)):
            if ta != tb:
                first = next((k for k, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
                diffs.append(f"request {i}.{j}: tokens differ at {first}")
            elif la and lb and max(abs(x - y) for x, y in zip(la, lb, strict=True)) > 1e-3:
                diffs.append(f"request {i}.{j}: logprobs differ by > 1e-3")
    return diffs


def main() -> int:
    from paged_engine.testing import _ARCH_DEFAULTS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--archs", nargs="+", default=sorted(_ARCH_DEFAULTS))
    p.add_argument("--modes", nargs="+", default=DEFAULT_MODES, choices=list(MODES))
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out", type=Path, default=None, help="write every record here (JSON)")
    p.add_argument("--one", nargs=3, metavar=("ARCH", "MODE", "DIR"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        arch, mode, where = args.one
        print(json.dumps(run_one(arch, mode, Path(where))))
        return 0
    modes = list(args.modes)
    for mode in list(modes):  # references first
        ref = MODES[mode][1]
        if ref and ref not in modes:
            modes.insert(0, ref)
    with tempfile.TemporaryDirectory() as tmp:
        models = Path(tmp) / "models"
        models.mkdir()
        # write each model once, before the jobs that share it
        subprocess.run(
            [sys.executable, "-c", _WRITE, str(models), *args.archs], check=True, env=_env()
        )

        def job(item: tuple[str, str]) -> dict:
            arch, mode = item
            cmd = [sys.executable, __file__, "--one", arch, mode, str(models)]
            env = _env(TRITON_INTERPRET="1") if mode == "triton" else _env()
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
            if proc.returncode or not lines:
                return {"arch": arch, "mode": mode, "error": proc.stderr[-1500:]}
            return json.loads(lines[-1])

        records: dict[tuple[str, str], dict] = {}
        for batch in _ordered(modes):
            items = [(a, m) for m in batch for a in args.archs]
            with ThreadPoolExecutor(args.jobs) as pool:
                for rec in pool.map(job, items):
                    records[rec["arch"], rec["mode"]] = rec
    failed = refused = 0
    for (arch, mode), rec in sorted(records.items()):
        ref = MODES[mode][1]
        if "refused" in rec:
            refused += 1
            print(f"refused  {arch:18} {mode:11} {rec['refused'][:110]}")
            continue
        if "error" in rec:
            failed += 1
            print(f"ERROR    {arch:18} {mode:11} {rec['error'][-300:]}")
            continue
        want = records.get((arch, ref)) if ref else None
        if want is None or "outs" not in want:
            continue
        diffs = compare(rec, want, greedy_only=mode == "spec")
        if diffs:
            failed += 1
            print(f"DIFFERS  {arch:18} {mode:11} vs {ref}: {'; '.join(diffs[:4])}")
    checked = sum(bool(MODES[m][1]) for _, m in records)
    print(f"{len(args.archs)} archs x {len(modes)} modes: {checked} comparisons, {failed} failed,")
    print(f"{refused} refused (the engine says it does not support that mode for that model)")
    if args.out:
        args.out.write_text(json.dumps(list(records.values()), indent=1))
    return 1 if failed else 0


_WRITE = """
import sys
from pathlib import Path
from paged_engine.testing import write_tiny_model
for arch in sys.argv[2:]:
    write_tiny_model(Path(sys.argv[1]) / arch, arch, seed=0)
"""


def _env(**extra: str) -> dict[str, str]:
    root = Path(__file__).resolve().parent.parent
    paths = [str(root / "packages" / p / "src") for p in ("paged-engine", "paged-kernels")]
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")])
    env.setdefault("PAGED_LOGGING_LEVEL", "WARNING")
    return env


def _ordered(modes: list[str]) -> list[list[str]]:
    """Batches of modes, each after the references it is compared with."""
    refs = [m for m in modes if not MODES[m][1]]
    return [refs, [m for m in modes if MODES[m][1]]]


if __name__ == "__main__":
    sys.exit(main())
