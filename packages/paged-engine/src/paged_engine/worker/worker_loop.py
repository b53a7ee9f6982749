"""The life of every rank but 0: join the world, load this rank's shard of the model, then run
what rank 0 broadcasts (`(method, args)` of `Worker`) until it says "shutdown".

Rank 0 runs the same `Worker` methods in the same order in the engine's process (the driver),
so every rank executes every step; only rank 0's results reach the engine core. A step that
raises here ends this rank unless every rank failed it (`every_rank_failed`): then rank 0's
engine core isolates it (core/step_isolation.py) and this rank serves on.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback

import torch

from paged_engine.config import EngineConfig
from paged_engine.distributed.communication import (
    broadcast_object,
    every_rank_failed,
    wait_sends,
)
from paged_engine.distributed.launch import (
    cpu_threads_per_rank,
    exit_with_parent,
    launch_fingerprint,
)
from paged_engine.distributed.parallel_state import destroy_parallel_state, init_parallel_state
from paged_engine.engine.gc_tuning import freeze_startup_heap
from paged_engine.loader import ResolvedModel
from paged_engine.worker.extension import worker_class
from paged_engine.worker.stage_outputs import drain_stage_outputs
from paged_engine.worker.worker import pick_device

logger = logging.getLogger(__name__)

SHUTDOWN = "shutdown"
# After a step raised: how long each rank waits for the others to say they failed it too
STEP_FAILURE_SYNC_S = 10.0


def setup_rank_device(config: EngineConfig, local_rank: int, local_world_size: int) -> torch.device:
    """Pin this rank to its device: GPU `local_rank`, or its share of the CPU cores."""
    device = pick_device(config.device)
    if device.type == "cuda":
        if local_world_size > torch.cuda.device_count():
            raise ValueError(
                f"tensor_parallel_size * pipeline_parallel_size needs {local_world_size} GPUs on "
                f"this node, but {torch.cuda.device_count()} are visible"
            )
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if local_world_size > 1:
        torch.set_num_threads(cpu_threads_per_rank(local_world_size))
    return device


def join_world(
    config: EngineConfig, rank: int, local_rank: int, local_world_size: int, init_method: str
) -> torch.device:
    device = setup_rank_device(config, local_rank, local_world_size)
    init_parallel_state(
        rank=rank,
        tp_size=config.tensor_parallel_size,
        pp_size=config.pipeline_parallel_size,
        device=device,
        init_method=init_method,
        # torchrun: each rank parsed its own arguments (spawned ranks got rank 0's config)
        fingerprint=launch_fingerprint(config) if init_method == "env://" else None,
    )
    return device


def run_worker(
    config: EngineConfig,
    resolved: ResolvedModel,
    hf_config,
    *,
    rank: int,
    local_rank: int,
    local_world_size: int,
    init_method: str,
) -> None:
    """Serve rank 0 until it shuts the engine down; raises if the world breaks."""
    join_world(config, rank, local_rank, local_world_size, init_method)
    try:
        worker = worker_class(config.worker_extension_cls)(config, resolved, hf_config)
        while True:
            method, args = broadcast_object()
            if method == SHUTDOWN:
                # Pipeline stages: take what the last stage still sends, and let every async
                # send of this rank land before the world goes.
                drain_stage_outputs(worker)
                wait_sends()
                return
            try:
                getattr(worker, method)(*args)
            except Exception as e:
                # a step every rank failed leaves the ranks in step: rank 0's engine core
                # isolates it (executor/multiproc.py); any other failure ends this rank
                if method != "execute_model" or config.pipeline_parallel_size > 1:
                    raise
                if not every_rank_failed(STEP_FAILURE_SYNC_S):
                    raise
                logger.warning("rank %d: a step failed on every rank (%r): serving on", rank, e)
                continue
            if method == "initialize_cache":  # the last startup step: the heap is the engine's
                freeze_startup_heap()
    finally:
        destroy_parallel_state()


def spawned_worker_main(
    ready,
    environ: dict[str, str],
    config: EngineConfig,
    resolved: ResolvedModel,
    hf_config,
    rank: int,
    init_method: str,
) -> None:
    """Entry point of a rank started by rank 0 on this node (torch.multiprocessing); `environ`
    is rank 0's environment, which replaces the one this process inherited."""
    for name in set(os.environ) - set(environ):
        del os.environ[name]
    os.environ.update(environ)
    logging.basicConfig(level=logging.WARNING, format=f"[rank {rank}] %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches rank 0, which stops us
    exit_with_parent()
    ready.send(rank)
    ready.close()
    world = config.tensor_parallel_size * config.pipeline_parallel_size
    try:
        run_worker(
            config,
            resolved,
            hf_config,
            rank=rank,
            local_rank=rank,
            local_world_size=world,
            init_method=init_method,
        )
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        sys.exit(1)


def run_torchrun_worker(config: EngineConfig, resolved: ResolvedModel, hf_config) -> None:
    """A torchrun-launched rank > 0: serve rank 0's engine until it shuts down."""
    from paged_engine.distributed.launch import torchrun_env

    env = torchrun_env()
    assert env is not None and env.rank > 0
    world = config.tensor_parallel_size * config.pipeline_parallel_size
    if env.world_size != world:
        raise ValueError(
            f"torchrun started {env.world_size} processes, but tensor_parallel_size * "
            f"pipeline_parallel_size = {world}"
        )
    logger.info("rank %d of %d: serving rank 0's engine", env.rank, world)
    run_worker(
        config,
        resolved,
        hf_config,
        rank=env.rank,
        local_rank=env.local_rank,
        local_world_size=env.local_world_size,
        init_method="env://",
    )
