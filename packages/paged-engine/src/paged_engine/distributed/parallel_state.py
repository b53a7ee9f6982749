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

import dataclasses
import datetime
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# Workers wait in a receive for rank 0's next step however long the engine idles; gloo would
# otherwise abort that wait after its default 30 minutes.
IDLE_TIMEOUT = datetime.timedelta(days=365)
# How long a rank waits for the others to join the world (then raises, naming the wait); torch's
# own default. Ranks launched one by one (torchrun, one node each) may start minutes apart, and
# one that died at start would otherwise keep the others waiting for IDLE_TIMEOUT.
JOIN_TIMEOUT_ENV, JOIN_TIMEOUT_S = "PAGED_DIST_JOIN_TIMEOUT_S", 1800.0


def join_timeout() -> datetime.timedelta:
    raw = os.environ.get(JOIN_TIMEOUT_ENV, "").strip()
    try:
        seconds = float(raw) if raw else JOIN_TIMEOUT_S
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{JOIN_TIMEOUT_ENV}={raw!r} is invalid: a positive number of seconds")
    return datetime.timedelta(seconds=seconds)


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
# Per thread: a world of 1 while a single-process engine's worker runs (`outside_world`).
_local = threading.local()


def get_parallel_state() -> ParallelState:
    own = getattr(_local, "state", None)
    return _state if own is None else own


def get_tp_rank() -> int:
    return get_parallel_state().tp_rank


def get_tp_size() -> int:
    return get_parallel_state().tp_size


@contextmanager
def outside_world() -> Iterator[None]:
    """While open, this thread's getters answer as rank 0 of a world of 1 whatever world the
    process joined: a single-process engine next to an engine with ranks (whose rank 0 lives in
    this process) builds unsharded layers and its steps run no collective."""
    saved = getattr(_local, "state", None)
    _local.state = _SINGLE
    try:
        yield
    finally:
        _local.state = saved


def init_parallel_state(
    *,
    rank: int,
    tp_size: int,
    pp_size: int,
    device: torch.device,
    init_method: str,
    fingerprint: dict[str, str] | None = None,
) -> ParallelState:
    """Join the world (`init_method`: "env://" under torchrun, "tcp://host:port" otherwise) and
    build the groups. Every rank calls this with the same sizes; new_group is collective.
    `fingerprint` (ranks that parsed their own arguments: launch.py `launch_fingerprint`): the
    ranks compare theirs over the first (gloo) group, before any sized by tp / pp, and each
    raises ValueError naming what differs (having left the world)."""
    global _state
    check_not_in_world()
    world_size = tp_size * pp_size
    backend = "nccl" if device.type == "cuda" else "gloo"
    joining = join_timeout()
    try:  # the rendezvous and every group's setup bounded; the world's waits after: IDLE_TIMEOUT
        dist.init_process_group(
            backend, init_method=init_method, world_size=world_size, rank=rank, timeout=joining
        )
    except (RuntimeError, TimeoutError) as e:  # (torch's DistStoreError is a RuntimeError)
        _forget_failed_join()
        raise RuntimeError(
            f"rank {rank} of {world_size}: the other ranks did not join the world "
            f"({init_method}) within {joining.total_seconds():.0f}s ({JOIN_TIMEOUT_ENV}); did "
            f"one fail at start? Its own log says why. ({e})"
        ) from e
    cpu_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    if fingerprint is not None:  # over gloo: no device state is needed to compare them
        from paged_engine.distributed.launch import launch_mismatch

        every: list[Any] = [None] * world_size
        dist.all_gather_object(every, fingerprint, group=cpu_group)
        mismatch = launch_mismatch(every)
        if mismatch is not None:
            dist.destroy_process_group()
            raise ValueError(mismatch)
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
    dist.distributed_c10d._set_pg_timeout(IDLE_TIMEOUT)  # the world's own group, from now on
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


@contextmanager
def single_stage() -> Iterator[None]:
    """While open, the getters answer as this TP rank of one pipeline stage: a model built
    then (a speculative proposer, which the last stage runs whole) builds, loads and caches
    every layer. The process groups stay the same."""
    global _state
    saved = _state
    if saved.pp_size > 1:
        _state = dataclasses.replace(
            saved, rank=saved.tp_rank, world_size=saved.tp_size, pp_size=1, pp_group=None
        )
    try:
        yield
    finally:
        _state = saved


def _forget_failed_join() -> None:
    """Undo what a failed `init_process_group` left behind. torch names the default group by a
    process-wide counter it bumps before the rendezvous and resets only when a world is
    destroyed: after a join that timed out, this process's next world would be named "1" while
    fresh ranks name theirs "0", and its gloo setup would wait on keys no peer writes (a hang
    until the join timeout)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    else:
        dist.distributed_c10d._world.group_count = 0


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


# vLLM's override of the split: the decoder layers of each stage, first to last ("10,14").
PP_LAYER_PARTITION = "VLLM_PP_LAYER_PARTITION"


def layer_partition(pp_size: int) -> list[int] | None:
    """The stage sizes `VLLM_PP_LAYER_PARTITION` asks for, checked against `pp_size` (one
    positive count a stage); None when it is unset or there is one stage (which holds every
    layer whatever it says). Its sum is checked against the model in `stage_sizes`.

    Every process reads the variable itself: spawned workers inherit the engine's environment
    and torchrun ranks get the launcher's, and the engine checks it (`check_model_parallelism`)
    before any rank starts, so every rank and caller splits the same way."""
    text = os.environ.get(PP_LAYER_PARTITION)
    if text is None or pp_size == 1:
        return None
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(
            f"{PP_LAYER_PARTITION}={text!r} must be the decoder layers of each pipeline stage, "
            "comma-separated (e.g. '10,14')"
        ) from None
    if len(sizes) != pp_size:
        raise ValueError(
            f"{PP_LAYER_PARTITION}={text!r} names {len(sizes)} stages, "
            f"pipeline_parallel_size={pp_size}"
        )
    if min(sizes) < 1:
        raise ValueError(
            f"{PP_LAYER_PARTITION}={text!r}: every pipeline stage must hold at least one "
            "decoder layer"
        )
    return sizes


def stage_sizes(num_layers: int, pp_size: int) -> list[int]:
    """How many of the model's `num_layers` decoder layers each pipeline stage holds:
    `VLLM_PP_LAYER_PARTITION` when set (`layer_partition`), else vLLM's default split: an even
    share, and the remainder one layer each to the stages just before the last (the last stage
    also runs the final norm and the LM head; with fewer extra layers than middle stages the
    first stage, which runs the embedding, gets none either). 5 layers over 3 stages:
    [2, 2, 1]; 4 over 3: [1, 2, 1]."""
    sizes = layer_partition(pp_size)
    if sizes is not None:
        if sum(sizes) != num_layers:
            raise ValueError(
                f"{PP_LAYER_PARTITION}={os.environ[PP_LAYER_PARTITION]!r} sums to {sum(sizes)} "
                f"layers; the model has {num_layers} decoder layers"
            )
        return sizes
    if num_layers < pp_size:
        raise ValueError(
            f"pipeline_parallel_size={pp_size} exceeds the model's {num_layers} decoder layers"
        )
    base, extra = divmod(num_layers, pp_size)
    return [base + (pp_size - 1 - extra <= r < pp_size - 1) for r in range(pp_size)]


def stage_layers(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """The decoder layers [start, end) of pipeline stage `pp_rank`: contiguous, sized by
    `stage_sizes`. `num_layers` always counts decoder layers (what `VLLM_PP_LAYER_PARTITION`
    sums to): a per-layer list of k entries a layer (LongCat-Flash's two caches) takes its
    entries [k * start, k * end) (`worker/cache_engine.py: kv_layers`), never a split of its
    own length, so every caller cuts at the same layer boundaries."""
    sizes = stage_sizes(num_layers, pp_size)
    start = sum(sizes[:pp_rank])
    return start, start + sizes[pp_rank]


def decoder_layer_count(hf_config) -> int | None:
    """The decoder layers the pipeline stages split, from the config: the model class's own
    count where it counts them its way (`decoder_layer_count`: LongCat-Flash, whose HF
    num_hidden_layers counts its two attention sublayers a layer), else the layer field of
    the language model's config (a VLM's text_config); None when the config names none."""
    from paged_engine.models import get_model_class  # the model registry imports this module

    try:
        own = getattr(get_model_class(hf_config), "decoder_layer_count", None)
    except ValueError:  # not a registered architecture: the loader names it later
        own = None
    if own is not None:
        return int(own(hf_config))
    try:
        text = hf_config.get_text_config()
    except (AttributeError, ValueError):  # not a transformers config; several text configs
        text = hf_config
    names = ("num_hidden_layers", "n_layer", "n_layers", "num_layers")
    for config in (text, hf_config):
        count = next((n for n in (_config_int(config, k) for k in names) if n), None)
        if count is not None:
            return count
    return None


def _config_int(hf_config, name: str) -> int | None:
    """An int field of the config; None when it is missing, not an int, or per-layer only
    (transformers' heterogeneous configs, Gemma 4's, raise on reading a field that varies
    by layer)."""
    try:
        value = getattr(hf_config, name, None)
    except RuntimeError:
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _kv_head_counts(hf_config, heads: int) -> set[int]:
    """The KV head counts of the model's attention layers: each cached layer's where the model
    declares a per-layer layout (Gemma 4's full layers have their own), else the global one."""
    from paged_engine.models import kv_cache_layout  # the model registry imports this module

    counts = {_config_int(hf_config, "num_key_value_heads") or heads}
    try:
        layout = kv_cache_layout(hf_config)
    except Exception:  # the model's own checks refuse such a config later, with their message
        layout = None
    return {int(h) for h, _ in layout} if layout else counts


def check_model_parallelism(hf_config, tp_size: int, pp_size: int) -> None:
    """Fail before any process starts when the model cannot be split this way."""
    # A pure state-space model (Mamba) has no attention heads to split.
    heads = _config_int(hf_config, "num_attention_heads") or _config_int(hf_config, "n_head")
    heads = heads or tp_size
    if heads % tp_size:
        raise ValueError(
            f"tensor_parallel_size={tp_size} must divide the model's {heads} attention heads"
        )
    for kv_heads in sorted(_kv_head_counts(hf_config, heads)):
        if kv_heads % tp_size and tp_size % kv_heads:
            raise ValueError(
                f"tensor_parallel_size={tp_size} and the model's {kv_heads} KV heads: one must "
                "divide the other (more ranks than KV heads replicate each KV head)"
            )
    # The MLPs' (and MoE experts', shared experts') hidden widths are split across ranks like
    # the heads.
    for name in (
        "intermediate_size",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "shared_intermediate_size",
        "ffn_dim",
        "n_inner",
    ):
        width = _config_int(hf_config, name)
        if width is not None and width % tp_size:
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
        count = _config_int(hf_config, name)
        if count is not None and count % tp_size:
            raise ValueError(
                f"tensor_parallel_size={tp_size} must divide the model's {name}={count}"
            )
    # Mamba (v1) mixers split their channels (Jamba's: mamba_expand x hidden_size)
    expand, hidden = _config_int(hf_config, "mamba_expand"), _config_int(hf_config, "hidden_size")
    if expand is not None and (expand * (hidden or 0)) % tp_size:
        raise ValueError(
            f"tensor_parallel_size={tp_size} must divide the model's mamba width "
            f"(mamba_expand x hidden_size = {expand * hidden})"
        )
    for name in ("mamba_n_groups", "n_groups"):
        count = _config_int(hf_config, name)
        if count is not None and count > 1 and count % tp_size:
            raise ValueError(
                f"tensor_parallel_size={tp_size} must divide the model's {name}={count} "
                "(or the model have a single group, replicated on every rank)"
            )
    layer_partition(pp_size)  # a malformed VLLM_PP_LAYER_PARTITION, whatever the model
    layers = decoder_layer_count(hf_config)
    if layers is not None:  # otherwise the model's own stage split refuses these
        stage_sizes(layers, pp_size)  # more stages than layers, a partition of another sum
