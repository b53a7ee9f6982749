"""Per-sequence recurrent state of hybrid models: Gated DeltaNet layers (Qwen3-Next, Qwen3.5)
between full-attention layers.

A linear-attention layer keeps nothing per token: each sequence carries a fixed-size state (a
conv window and a [Hv, Dk, Dv] matrix a layer, layers/gated_delta_net.py) that has absorbed its
tokens in order. The pools hold one row per InputBatch row (a sequence's row is its state slot)
plus one scratch row, the last, that CUDA-graph padding rows read and write.

Invariant: after a forward, row r holds the state of its sequence over positions
[0, num_computed_tokens). A row whose step starts at position 0 starts from zeros; any other
start continues the row. So a sequence arriving in the worker with computed tokens but no state
of its own (a fork of n > 1, a beam that took another candidate, the copies of a forked request
recomputed after preemption) names the sequence whose state it continues
(`NewSeqData.state_from`), and `copy_rows` copies those rows before the step's forward (and
before the step drops any sequence: the source may be leaving).

Prefix caching keeps snapshots of the state at chosen block boundaries in rows of their own,
after the seats (core/state_slots.py has the row layout and the rules); a copy of a snapshot
into a seat resumes a prefix-cache hit there.

What the engine gives up for it (`hybrid_engine_config`): swap preemption and the CPU offload
tier (the state is not in blocks) and batch-invariant mode; pipeline parallelism is served for
the verified families (models/hybrid.py: PIPELINE_MODEL_TYPES), each stage holding the state of
its own layers only, when every stage holds an attention layer. Speculative
decoding takes a backup row per seat: a verify step backs its rows up, a rejected draft restores
the row, and the engine core rolls the sequence back so that its accepted tokens run again
(`Sequence.replay_end`). Under pipeline parallelism only the last stage samples and restores at
once; every other stage restores at the rolled-back sequence's next step, which starts where
its backup stands (`roll_back`, before the step's row copies). LoRA adapters have nothing to
do with the state (a token's adapter changes its projections only; prefix-cache snapshots are
keyed by block hashes whose root names the adapter), so they are served.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn

from paged_engine.distributed.parallel_state import stage_sizes
from paged_engine.models.hybrid import (
    PIPELINE_MODEL_TYPES,
    is_hybrid,
    layer_types,
    num_kv_layers,
    stage_kv_range,
)

__all__ = [
    "RecurrentStatePool",
    "fit_state_snapshots",
    "hybrid_engine_config",
    "is_hybrid",
    "resolve_ssm_dtype",
    "states_depend_on_prompt",
]

logger = logging.getLogger(__name__)

# Speculation methods served for hybrids under pipeline stages: the engine core's proposers,
# whose rejections every stage learns from the next step (`RecurrentStatePool.roll_back`).
PIPELINE_SPEC_METHODS = ("ngram", "suffix")

_SSM_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def hybrid_engine_config(config, hf_config) -> None:
    """Refuse (ValueError naming the option) or turn off what a hybrid model cannot run with."""
    if not is_hybrid(hf_config):
        return
    arch = ", ".join(getattr(hf_config, "architectures", None) or ["this model"])
    if config.pipeline_parallel_size > 1:
        _check_pipeline(config.pipeline_parallel_size, hf_config, arch)
        if config.speculative_config is not None:
            from paged_engine.spec_decode.config import SpeculativeConfig

            method = SpeculativeConfig.from_dict(config.speculative_config).method
            if method not in PIPELINE_SPEC_METHODS:  # a worker-side proposer: unverified here
                raise ValueError(
                    f"speculative_config method {method!r} is not supported with "
                    f"pipeline_parallel_size > 1 for {arch} (a model with recurrent state); "
                    f"methods that are: {', '.join(PIPELINE_SPEC_METHODS)}"
                )
    unsupported = {
        "batch_invariant=True": bool(config.batch_invariant),
        "cpu_offload_gib > 0": bool(config.cpu_offload_gib),
        "preemption_mode='swap'": config.preemption_mode == "swap",
        "compilation_config (torch.compile)": bool(config.compilation_level),
    }
    for what, on in unsupported.items():
        if on:
            raise ValueError(
                f"{what} is not supported for models with a recurrent state (hybrid and "
                f"state-space models: {arch}): their per-sequence state is not held in KV blocks"
            )
    if config.prefix_state_snapshots == 0 and config.enable_prefix_caching:
        logger.info("%s: prefix caching is off (prefix_state_snapshots=0)", arch)
        config.enable_prefix_caching = False
    if not config.enable_prefix_caching:
        config.prefix_state_snapshots = 0
    if config.swap_space:
        logger.info("%s is a hybrid linear-attention model: swap_space is unused", arch)
        config.swap_space = 0.0
    config.preemption_mode = "recompute"


def _check_pipeline(pp_size: int, hf_config, arch: str) -> None:
    """Refuse pipeline stages for a hybrid outside PIPELINE_MODEL_TYPES, or a split that leaves
    a stage without an attention layer (its blocks would hold nothing, and the KV cache is
    sized in blocks every stage holds)."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in PIPELINE_MODEL_TYPES or num_kv_layers(hf_config) == 0:
        raise ValueError(
            f"pipeline_parallel_size > 1 is not supported for {arch} (model_type "
            f"{model_type!r}): of the models with a recurrent state, pipeline stages serve "
            f"{', '.join(sorted(PIPELINE_MODEL_TYPES))}"
        )
    start = 0
    for rank, size in enumerate(stage_sizes(len(layer_types(hf_config)), pp_size)):
        first, end = stage_kv_range(hf_config, start, start + size)
        if first == end:
            raise ValueError(
                f"pipeline_parallel_size={pp_size}: stage {rank} holds decoder layers "
                f"[{start}, {start + size}) of {arch}, none with attention (a stage of a "
                "hybrid model must cache KV for some layer; move one there with "
                "VLLM_PP_LAYER_PARTITION)"
            )
        start += size


def states_depend_on_prompt(model: nn.Module) -> bool:
    """Whether some layer updates its state differently for prompt tokens than for generated
    ones (`state_depends_on_prompt`: Mamba2's dt limit), so that a snapshot after generated
    tokens would not stand for a prompt of the same tokens. A pipeline stage that holds no
    state layer cannot tell (another stage's mixers decide): True, the answer that is always
    safe (snapshots of prompt tokens only); a stage with state layers answers for all (a
    model's mixers are of one kind, one config)."""
    from paged_engine.models.utils import PPMissingLayer

    modules = list(model.modules())
    if not state_layers(model) and any(isinstance(m, PPMissingLayer) for m in modules):
        return True
    return any(getattr(m, "state_depends_on_prompt", False) for m in modules)


# Unless told how many, state snapshots take at most this share of the KV cache's memory.
SNAPSHOT_SHARE = 0.1


def fit_state_snapshots(config, num_blocks: int, block_bytes: int, row_bytes: int) -> int:
    """Sets `config.prefix_state_snapshots` (None: as many as fit in SNAPSHOT_SHARE of the
    `num_blocks` KV blocks' memory, at most max_num_seqs) and returns the KV blocks left once
    the snapshots' memory comes out of them (all of them under num_gpu_blocks_override, which
    fixes the block count). No snapshot fits: prefix caching is off.

    A model without KV layers (`block_bytes` 0: Mamba, Mamba2) has blocks that hold nothing:
    `num_blocks` is then the state rows the memory budget holds (memory_profiler.py), all of
    them the snapshots' to take (at most max_num_seqs by default), and the blocks returned are
    enough for every seat's sequence at max_model_len, up to MAX_COUNTING_BLOCKS (or
    num_gpu_blocks_override)."""
    if block_bytes == 0:
        return _fit_without_kv(config, num_blocks)
    if not config.enable_prefix_caching:
        config.prefix_state_snapshots = 0
        return num_blocks
    if config.prefix_state_snapshots is None:
        fit = int(SNAPSHOT_SHARE * num_blocks * block_bytes // row_bytes)
        config.prefix_state_snapshots = min(config.max_num_seqs, fit)
        if not fit:
            logger.info(
                "prefix caching is off: a recurrent-state snapshot (%.1f MiB) is more than %d%% "
                "of the KV cache (set prefix_state_snapshots to keep some anyway)",
                row_bytes / 2**20,
                round(100 * SNAPSHOT_SHARE),
            )
            config.enable_prefix_caching = False
            return num_blocks
    if config.num_gpu_blocks_override is not None:
        return num_blocks
    return num_blocks - -(-config.prefix_state_snapshots * row_bytes // block_bytes)


# Blocks of a model without KV cost host memory only (the pool's bookkeeping, ~150 bytes each):
# at most this many unless one sequence at max_model_len needs more (2**18 blocks of 16: 4M
# tokens in flight; past that, sequences are preempted as when KV blocks run out).
MAX_COUNTING_BLOCKS = 1 << 18


def _fit_without_kv(config, budget_rows: int) -> int:
    if config.num_gpu_blocks_override is not None:
        num_blocks, budget_rows = config.num_gpu_blocks_override, config.max_num_seqs
    else:
        per_seq = -(-config.max_model_len // config.block_size)
        num_blocks = config.max_num_seqs * per_seq + 1  # + the null block
        num_blocks = max(per_seq + 1, min(num_blocks, MAX_COUNTING_BLOCKS))
    if not config.enable_prefix_caching:
        config.prefix_state_snapshots = 0
    elif config.prefix_state_snapshots is None:
        config.prefix_state_snapshots = min(config.max_num_seqs, budget_rows)
        if not budget_rows:
            logger.info("prefix caching is off: no memory left for a recurrent-state snapshot")
            config.enable_prefix_caching = False
    elif config.prefix_state_snapshots > budget_rows:
        raise ValueError(
            f"prefix_state_snapshots={config.prefix_state_snapshots}: the memory left holds "
            f"{budget_rows} recurrent-state rows"
        )
    return num_blocks


def resolve_ssm_dtype(name: str, model_dtype: torch.dtype, hf_config) -> torch.dtype:
    """EngineConfig.mamba_ssm_cache_dtype -> the recurrent matrices' dtype. "auto": the
    checkpoint's `mamba_ssm_dtype` where its config names one (Qwen3.5's say float32), else
    the model dtype."""
    if name == "auto":
        name = getattr(hf_config, "mamba_ssm_dtype", None) or "auto"
        if name not in _SSM_DTYPES:
            return model_dtype
    return _SSM_DTYPES[name]


def state_layers(model: nn.Module) -> list[nn.Module]:
    """The modules holding recurrent state (those with `allocate_state`), in model order."""
    return [m for m in model.modules() if hasattr(m, "allocate_state")]


def state_pools(layer: nn.Module) -> list[torch.Tensor]:
    """A state layer's pools: its conv window and, but for LFM2's short conv, its ssm_state."""
    return [t for t in (layer.conv_state, getattr(layer, "ssm_state", None)) if t is not None]


class RecurrentStatePool:
    """Allocates every state layer's pools and copies rows between them. Rows: `num_rows`
    (the seats, then the prefix cache's snapshots), `num_backups` (under speculative decoding,
    backup row `backup_row + r` holds seat r's state from before its verify step), the scratch
    row last."""

    def __init__(
        self,
        model: nn.Module,
        num_rows: int,
        dtype: torch.dtype,
        ssm_dtype: torch.dtype,
        device: torch.device,
        num_backups: int = 0,
    ) -> None:
        self.layers = state_layers(model)
        self.device = device
        self._dtypes = dtype, ssm_dtype
        self.num_backups = num_backups
        self.resize(num_rows)

    def resize(self, num_rows: int) -> None:
        """(Re)allocate every layer's pools with `num_rows` rows, the backups and the scratch
        row, zeroed: at start, before anything is stored (the seats, then with the snapshots
        once the KV cache is sized)."""
        self.backup_row = num_rows
        self.scratch_row = num_rows + self.num_backups  # CUDA-graph padding rows use it
        total = self.scratch_row + 1
        for layer in self.layers:
            layer.allocate_state(total, *self._dtypes, self.device)
        # Tokens each row's state has absorbed, checked against every step's start positions:
        # a scheduler bug shows as an error here instead of as wrong text.
        self.num_absorbed = np.zeros(total, dtype=np.int64)
        self.nbytes = sum(
            t.numel() * t.element_size() for layer in self.layers for t in state_pools(layer)
        )
        self.nbytes_per_row = self.nbytes // total
        logger.info(
            "recurrent state: %d layers x %d rows, %.1f MiB",
            len(self.layers),
            total,
            self.nbytes / 2**20,
        )

    def back_up(self, rows: np.ndarray, starts: np.ndarray) -> None:
        """Keep seats `rows`' states, which stand at `starts`, before a verify step runs their
        drafts through them."""
        self.copy_rows([(int(r), self.backup_row + int(r)) for r in rows])
        self.num_absorbed[self.backup_row + rows] = starts

    def restore(self, rows: np.ndarray) -> None:
        """Put seats `rows` back to their backups (a draft was rejected: the accepted tokens
        run again in the next step, from where the verify step started)."""
        self.copy_rows([(self.backup_row + int(r), int(r)) for r in rows])

    def roll_back(self, rows: np.ndarray, starts: np.ndarray) -> None:
        """Restore the seats `rows` (sequences the engine core rolled back after a rejected
        draft, now continuing from `starts`) whose state still holds the rejected drafts: on a
        stage that did not sample, the rollback is learnt from this step. A seat that stands at
        its start already (the sampling stage restored it) is left alone."""
        if not self.num_backups or not rows.size:
            return
        absorbed, backed_up = self.num_absorbed[rows], self.num_absorbed[self.backup_row + rows]
        stale = (starts > 0) & (absorbed != starts) & (backed_up == starts)
        if stale.any():
            self.restore(rows[stale])

    def copy_rows(self, pairs: list[tuple[int, int]]) -> None:
        """state[dst] = state[src] for every (src, dst) and layer; all sources are read before
        any row is written."""
        src, dst = (np.asarray(x, dtype=np.int64) for x in zip(*pairs))
        src_t, dst_t = (torch.from_numpy(x).to(self.device) for x in (src, dst))
        for layer in self.layers:
            for pool in state_pools(layer):
                pool.index_copy_(0, dst_t, pool.index_select(0, src_t))
        self.num_absorbed[dst] = self.num_absorbed[src]

    def advance(self, rows: np.ndarray, starts: np.ndarray, num_new: np.ndarray) -> None:
        """Book a step: row i runs positions [starts[i], starts[i] + num_new[i]), continuing
        its state when starts[i] > 0 (which must be exactly where that state stands)."""
        if (rows < 0).any():
            raise RuntimeError("a sequence of a hybrid model was scheduled without a state slot")
        cont = starts > 0
        stale = cont & (self.num_absorbed[rows] != starts)
        if stale.any():
            i = int(np.flatnonzero(stale)[0])
            raise RuntimeError(
                f"recurrent state row {int(rows[i])} holds {int(self.num_absorbed[rows[i]])} "
                f"tokens but its sequence continues from position {int(starts[i])}"
            )
        self.num_absorbed[rows] = starts + num_new
