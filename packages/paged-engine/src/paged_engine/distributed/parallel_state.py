"""Which tensor- and pipeline-parallel rank this process is, and its process groups.

One engine is a world of `tp_size * pp_size` processes. Global rank r is pipeline stage
`r // tp_size` and tensor-parallel rank `r % tp_size`; rank 0 also runs the engine core (and,
for serving, the HTTP server). Groups, all built by `init_parallel_state` on every rank:

    tp group    the ranks of one stage: all-reduce / all-gather of activations
                (the device backend: NCCL on GPUs, gloo on CPUs)
    pp group    the ranks sharing a TP rank across stages: hidden states between stages
    cpu group   the whole world over gloo: rank 0's plain-data messages (the step), so a GPU
                world never moves pickles through NCCL
    fail group  the whole world over gloo, used only when a step raised: the ranks agree that
                every one of them failed it (communication.every_rank_failed)

Before `init_parallel_state` (and in a single-process engine) every getter answers as rank 0 of
a world of 1, so layers built without a world are plain unsharded layers.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# Workers wait in a receive for rank 0's next step however long the engine idles; gloo would
# otherwise abort that wait after its default 30 minutes.
IDLE_TIMEOUT = datetime.timedelta(days=365)


@dataclass(frozen=True, slots=True)
class ParallelState:
    rank: int
    world_size: int
    tp_size: int
    pp_size: int
    tp_group: dist.ProcessGroup | None
    pp_group: dist.ProcessGroup | None
    cpu_group: dist.ProcessGroup | None
    fail_group: dist.ProcessGroup | None = None

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def stage_rank(self, pp_rank: int) -> int:
        """The global rank holding this process's TP rank in stage `pp_rank`."""
        return pp_rank * self.tp_size + self.tp_rank


_SINGLE = ParallelState(0, 1, 1, 1, None, None, None)
_state: ParallelState = _SINGLE


def get_parallel_state() -> ParallelState:
    return _state


def get_tp_rank() -> int:
    return _state.tp_rank


def get_tp_size() -> int:
    return _state.tp_size


def init_parallel_state(
    *,
    rank: int,
    tp_size: int,
    pp_size: int,
    device: torch.device,
    init_method: str,
) -> ParallelState:
    """Join the world (`init_method`: "env://" under torchrun, "tcp://host:port" otherwise) and
    build the groups. Every rank calls this with the same sizes; new_group is collective."""
    global _state
    check_not_in_world()
    world_size = tp_size * pp_size
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, init_method=init_method, world_size=world_size, rank=rank, timeout=IDLE_TIMEOUT
    )
    cpu_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    fail_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    tp_group = pp_group = None
    for stage in range(pp_size):  # every rank creates every group, in the same order
        ranks = list(range(stage * tp_size, (stage + 1) * tp_size))
        group = dist.new_group(ranks, backend=backend)
        if rank in ranks:
            tp_group = group
    for tp_rank in range(tp_size):
        ranks = list(range(tp_rank, world_size, tp_size))
        group = dist.new_group(ranks, backend=backend)
        if rank in ranks:
            pp_group = group
    _state = ParallelState(
        rank, world_size, tp_size, pp_size, tp_group, pp_group, cpu_group, fail_group
    )
    logger.info(
        "rank %d of %d joined (%s): tp rank %d/%d, pp stage %d/%d",
        rank,
        world_size,
        backend,
        _state.tp_rank,
        tp_size,
        _state.pp_rank,
        pp_size,
    )
    return _state


def check_not_in_world() -> None:
    """One engine with ranks per process: refuse a second before it starts any process."""
    if dist.is_initialized():
        raise RuntimeError(
            "this process already belongs to a torch.distributed world (another engine with "
            "tensor or pipeline parallelism, or the application's own): shut that engine down "
            "(llm.llm_engine.shutdown()) or destroy the process group first"
        )


def destroy_parallel_state() -> None:
    """Leave the world (idempotent); the getters answer for a world of 1 again."""
    global _state
    _state = _SINGLE
    if dist.is_initialized():
        dist.destroy_process_group()


def stage_layers(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """The decoder layers [start, end) of pipeline stage `pp_rank`: contiguous, as even as
    possible, earlier stages taking the remainder."""
    if num_layers < pp_size:
        raise ValueError(
            f"pipeline_parallel_size={pp_size} exceeds the model's {num_layers} decoder layers"
        )
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)


def check_model_parallelism(hf_config, tp_size: int, pp_size: int) -> None:
    """Fail before any process starts when the model cannot be split this way."""
    # A pure state-space model (Mamba) has no attention heads to split.
    heads = getattr(hf_config, "num_attention_heads", None) or getattr(hf_config, "n_head", None)
    heads = heads or tp_size
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if heads % tp_size:
        raise ValueError(
            f"tensor_parallel_size={tp_size} must divide the model's {heads} attention heads"
        )
    if kv_heads % tp_size and tp_size % kv_heads:
        raise ValueError(
            f"tensor_parallel_size={tp_size} and the model's {kv_heads} KV heads: one must "
            "divide the other (more ranks than KV heads replicate each KV head)"
        )
    # The MLPs' (and MoE experts') hidden widths are split across ranks like the heads.
    for name in ("intermediate_size", "moe_intermediate_size", "ffn_dim", "n_inner"):
        width = getattr(hf_config, name, None)
        if isinstance(width, int) and width % tp_size:
            raise ValueError(
                f"tensor_parallel_size={tp_size} must divide the model's {name}={width}"
            )
    # Hybrids' linear mixers split their heads too (Gated DeltaNet's key and value heads,
    # Mamba2's heads); Mamba2's groups split as well unless there is one (replicated).
    for name in (
        "linear_num_key_heads",
        "linear_num_value_heads",
        "mamba_n_heads",
        "mamba_num_heads",
        "num_heads",  # Mamba2ForCausalLM's SSM heads
    ):
        count = getattr(hf_config, name, None)
        if isinstance(count, int) and count % tp_size:
            raise ValueError(
                f"tensor_parallel_size={tp_size} must divide the model's {name}={count}"
            )
    # Mamba (v1) mixers split their channels (Jamba's: mamba_expand x hidden_size)
    expand, hidden = getattr(hf_config, "mamba_expand", None), getattr(hf_config, "hidden_size", 0)
    if isinstance(expand, int) and (expand * hidden) % tp_size:
        raise ValueError(
            f"tensor_parallel_size={tp_size} must divide the model's mamba width "
            f"(mamba_expand x hidden_size = {expand * hidden})"
        )
    for name in ("mamba_n_groups", "n_groups"):
        count = getattr(hf_config, name, None)
        if isinstance(count, int) and count > 1 and count % tp_size:
            raise ValueError(
                f"tensor_parallel_size={tp_size} must divide the model's {name}={count} "
                "(or the model have a single group, replicated on every rank)"
            )
    layers = getattr(hf_config, "num_hidden_layers", None) or hf_config.n_layer
    stage_layers(layers, 0, pp_size)  # raises when there are more stages than layers
