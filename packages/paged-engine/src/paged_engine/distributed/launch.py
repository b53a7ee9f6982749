"""How the ranks of one engine come to exist: spawned by rank 0, or launched by torchrun.

    paged-server --model M -tp 2                 rank 0 starts rank 1 (torch.multiprocessing;
                                                 `start_method` says how)
    torchrun --nnodes 2 --nproc-per-node 8 ...   every rank runs the same command; rank 0 runs
                                                 the engine, the others serve it (`is_worker_rank`)

Either way the world meets through torch.distributed's own rendezvous (a TCP store on
localhost, or torchrun's MASTER_ADDR / MASTER_PORT): nothing of our own. Under torchrun each
rank parsed its own arguments: as soon as the world exists they compare what shapes a rank's
work (`launch_fingerprint`), and every rank refuses a mismatch by name (a rank given another
model or max_model_len would otherwise serve silently wrong tokens, or stall a collective).
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class TorchrunEnv:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int


def torchrun_env() -> TorchrunEnv | None:
    """This process's place when torchrun (or any launcher that sets its variables) started
    it; None otherwise."""
    if "TORCHELASTIC_RUN_ID" not in os.environ and "MASTER_ADDR" not in os.environ:
        return None
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return TorchrunEnv(rank, local_rank, world, local_world)


def is_worker_rank(world_size: int) -> bool:
    """True in a torchrun-launched process that is not rank 0 of a multi-rank engine."""
    env = torchrun_env()
    return world_size > 1 and env is not None and env.rank != 0


START_METHODS = ("spawn", "forkserver")


# What a forkserver imports once for every rank it forks: torch; the Llama config's module,
# whose import pulls in the machinery every transformers config class needs to unpickle (a
# rank imports its model's own config module on top: tens of ms); and a rank's own code. ~4.5 s
# of imports together on a 2-core machine. No paged module reads the environment or touches a
# device at import.
FORKSERVER_PRELOAD = [
    "torch",
    "transformers.models.llama.configuration_llama",
    "paged_engine.worker.worker_loop",
]


def forkserver_context():
    """The forkserver context, its server started (once per process) with `FORKSERVER_PRELOAD`.
    Called as an engine starts, so the server imports while the engine loads its config and
    tokenizer, and again when the ranks start."""
    from multiprocessing import forkserver

    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)  # read once, when the server starts
    forkserver.ensure_running()
    return ctx


def start_method(device_type: str) -> str:
    """How rank 0 starts ranks 1..: `PAGED_WORKER_MULTIPROC_METHOD` (spawn | forkserver), else
    forkserver on the CPU and spawn on CUDA (and where there is no forkserver: Windows).

    forkserver: the first parallel engine of a process starts a server process that imports
    `FORKSERVER_PRELOAD`, and every rank after is a fork of it, so later engines' ranks start
    without those imports (the test suite starts dozens). Spawn on CUDA: a fork of a process that
    has asked the CUDA driver anything cannot use CUDA, and an import may ask."""
    method = os.environ.get("PAGED_WORKER_MULTIPROC_METHOD", "").strip()
    if not method:
        forkserver = "forkserver" in multiprocessing.get_all_start_methods()
        return "spawn" if device_type == "cuda" or not forkserver else "forkserver"
    if method not in START_METHODS:
        raise ValueError(
            f"PAGED_WORKER_MULTIPROC_METHOD={method!r} is invalid: expected one of {START_METHODS}"
        )
    return method


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_threads_per_rank(local_world_size: int) -> int:
    """torch intra-op threads for one of `local_world_size` ranks sharing this machine's cores:
    two OpenMP teams on one core make every parallel op wait for a sleeping thread."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // local_world_size)


def exit_with_parent(poll_s: float = 0.5) -> None:
    """End this process when the one that started it is gone (killed with SIGKILL, say, so it
    could not stop us). A daemon thread polls the parent pid."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="paged-parent-watch", daemon=True).start()


# EngineConfig fields every rank of one engine must share: what a rank loads, how it sizes its
# buffers and cache, what it runs. (Per-node paths, secrets and front-end options are not here.)
LAUNCH_FIELDS = (
    "model",
    "revision",
    "load_format",
    "config_format",
    "quantization",
    "hf_overrides",
    "trust_remote_code",
    "model_impl",
    "runner",
    "convert",
    "task",
    "dtype",
    "kv_cache_dtype",
    "mamba_ssm_cache_dtype",
    "max_model_len",
    "block_size",
    "max_num_seqs",
    "max_num_batched_tokens",
    "enable_chunked_prefill",
    "enable_prefix_caching",
    "prefix_state_snapshots",
    "num_gpu_blocks_override",
    "kv_cache_memory_bytes",
    "seed",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "speculative_config",
    "pooler_config",
    "attention_backend",
    "enforce_eager",
    "compilation_config",
    "batch_invariant",
    "max_logprobs",
    "async_scheduling",
    "worker_extension_cls",
    "preemption_mode",
    "swap_space",
    "cpu_offload_gib",
    "enable_lora",
    "max_loras",
    "max_lora_rank",
    "max_cpu_loras",
    "enable_sleep_mode",
    "limit_mm_per_prompt",
    "mm_processor_kwargs",
    "enable_mm_embeds",
    "enable_prompt_embeds",
    "kv_transfer_config",
)


def _plain(value: Any) -> Any:
    """A JSON stand-in for a config value that is not JSON: a dataclass's fields, else the
    qualified name of the function or class (never a repr with a memory address)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    named = value if hasattr(value, "__qualname__") else type(value)
    return f"{named.__module__}.{named.__qualname__}"


def launch_fingerprint(config: Any) -> dict[str, str]:
    """`LAUNCH_FIELDS` of `config`, each as canonical JSON (`_shared_part` of it)."""
    return {
        name: json.dumps(
            _shared_part(name, getattr(config, name, None)), sort_keys=True, default=_plain
        )
        for name in LAUNCH_FIELDS
    }


def _shared_part(name: str, value: Any) -> Any:
    """What of a field every rank must share. A KV-transfer storage path may differ per node
    (the same shared storage mounted elsewhere): ranks that disagree on it only miss each
    other's blocks, which are then recomputed, never read wrong. Connector and role must match."""
    if name == "kv_transfer_config" and value is not None:
        from paged_engine.kv_transfer.config import KVTransferConfig

        kv = KVTransferConfig.parse(value)
        return {"kv_connector": kv.kv_connector, "kv_role": kv.kv_role}
    return value


def launch_mismatch(fingerprints: list[dict[str, str]]) -> str | None:
    """What differs between the ranks' `launch_fingerprint`s (rank i's at index i), or None."""
    first = fingerprints[0]
    diffs = []
    for name in first:
        values = [f.get(name) for f in fingerprints]
        if any(v != values[0] for v in values):
            ranks = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            diffs.append(f"{name} ({ranks})")
    if not diffs:
        return None
    return (
        "the ranks of this engine were launched with different arguments; give every rank "
        "the same command. Differing: " + "; ".join(diffs)
    )
