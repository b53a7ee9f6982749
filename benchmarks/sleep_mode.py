"""Sleep mode (vLLM's `sleep` / `wake_up`): what each kind of sleep frees and how long the round
trip takes, on one engine.

    python -m benchmarks.sleep_mode                   # CPU: docs/benchmarks/cpu/sleep_mode.json
    python -m benchmarks.sleep_mode --device cuda --out docs/benchmarks/h100/sleep_mode.json

The model: a real architecture's config.json (`--model-config`, qwen3-0.6b by default) with
dummy weights, in the device's default dtype. Three round trips, each followed by a greedy
generation that must equal the one before any sleep:

    level 1    sleep(level=1) -> wake_up()
    level 2    sleep(level=2) -> wake_up(["weights"]) -> reload_weights -> wake_up(["kv_cache"])
    kv_cache   sleep(tags=["kv_cache"]) -> wake_up()

For each: the seconds of every call, the device memory the sleep freed (CUDA: free memory from
torch.cuda.mem_get_info before and after; CPU: the process's resident set, /proc/self/statm) and
the bytes the engine's storages gave back (their own count).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import environment, sync, write_result
from benchmarks.models import config_dir
from benchmarks.throughput import engine_kwargs

PROMPTS = [[(17 * i + j) % 1000 + 10 for j in range(64)] for i in range(4)]


def device_used(device: str) -> int:
    """Bytes of device memory in use: the GPU's (all processes), or this process's RSS."""
    if device == "cuda":
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        return total - free
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def held_bytes(llm) -> int:
    """The bytes the model's and the KV cache's storages hold (sleep mode's own count); a CPU
    KV cache's resident pages (lazily zeroed host memory: committed as blocks are written,
    given back by madvise while asleep)."""
    from paged_engine.worker import host_memory
    from paged_engine.worker.sleep import module_tensors

    runner = llm.llm_engine.model_runner
    tensors = [t for t, _ in module_tensors(runner.model)] + list(runner.kv_tensors())
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in tensors}
    return sum(
        host_memory.resident_bytes(s) if host_memory.is_lazy(s) else s.nbytes()
        for s in storages.values()
    )


def _timed(device: str, fn, *args, **kwargs) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn(*args, **kwargs)
    sync(device)
    return round(time.perf_counter() - t0, 4)


def run(config: str, device: str, kv_gib: float) -> dict:
    from paged_engine import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        spec = config_dir(config, Path(tmp) / config, device)
        # the KV cache: what --kv-gib says on a CPU, the rest of the GPU's memory on CUDA
        kv = {"cpu_kv_cache_gib": kv_gib} if device == "cpu" else {}
        llm = LLM(
            **engine_kwargs(spec, device, 1024, load_format="dummy", enforce_eager=False),
            enable_sleep_mode=True,
            **kv,
        )
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)

    def greedy() -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    want = greedy()
    rec: dict = {
        "model": spec.origin,
        "dtype": spec.dtype_name,
        "kv_cache_blocks": llm.llm_engine.num_blocks,
        "held_gib_awake": round(held_bytes(llm) / 2**30, 3),
        "trips": {},
    }
    trips = {
        "level 1": [("sleep", lambda: llm.sleep(level=1)), ("wake_up", llm.wake_up)],
        "level 2": [
            ("sleep", lambda: llm.sleep(level=2)),
            ("wake_up weights", lambda: llm.wake_up(tags=["weights"])),
            ("reload_weights", lambda: llm.collective_rpc("reload_weights")),
            ("wake_up kv_cache", lambda: llm.wake_up(tags=["kv_cache"])),
        ],
        "kv_cache": [
            ("sleep", lambda: llm.sleep(tags=["kv_cache"])),
            ("wake_up", llm.wake_up),
        ],
    }
    for name, calls in trips.items():
        before_used, before_held = device_used(device), held_bytes(llm)
        trip: dict = {"seconds": {}}
        for i, (what, fn) in enumerate(calls):
            trip["seconds"][what] = _timed(device, fn)
            if i == 0:
                trip["freed_gib_measured"] = round((before_used - device_used(device)) / 2**30, 3)
                trip["freed_gib_counted"] = round((before_held - held_bytes(llm)) / 2**30, 3)
        trip["same_greedy_tokens_after"] = greedy() == want
        rec["trips"][name] = trip
        print(name, trip)
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--model-config", default="qwen3-0.6b")
    ap.add_argument("--kv-gib", type=float, default=1.0, help="the KV cache's size (CPU)")
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks/cpu/sleep_mode.json"))
    args = ap.parse_args()
    result = {
        "benchmark": "sleep_mode",
        "command": "python -m benchmarks.sleep_mode "
        f"--device {args.device} --model-config {args.model_config} --kv-gib {args.kv_gib}",
        "environment": environment(args.device),
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "note": (
            "CPU: level 1's host copy of the weights is the same RAM, so the resident set drops "
            "only by the KV cache's resident pages; level 2 and the kv_cache sleep give RAM back"
            if args.device == "cpu"
            else "CUDA: measured = the GPU's free memory (torch.cuda.mem_get_info) before and "
            "after the sleep"
        ),
        **run(args.model_config, args.device, args.kv_gib),
    }
    write_result(args.out, result)


if __name__ == "__main__":
    main()
