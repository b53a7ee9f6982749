"""How many KV blocks fit: the device's share for this engine minus weights and the activation
peak of the largest step (measured by running it once), divided by the bytes of one block."""

from __future__ import annotations

import gc
import logging
from typing import TYPE_CHECKING

import numpy as np
import torch

from paged_engine.worker.cache_engine import CacheEngine

if TYPE_CHECKING:
    from paged_engine.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def gpu_baseline(device: torch.device, utilization: float) -> int:
    """Bytes in use on the device before the engine loads anything (other processes, the CUDA
    context). The engine's share, total * utilization, must be free now: fail early if not.

    An engine this process dropped (an earlier `LLM` in a notebook or a test) may still hold its
    KV cache and graph pools through reference cycles, and torch's caching allocator keeps freed
    blocks from the driver: collect and release both before asking the driver what is free."""
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    want = total * utilization
    if free < want:
        raise ValueError(
            f"gpu_memory_utilization={utilization} asks for {want / 2**30:.1f} GiB of {device} "
            f"({total / 2**30:.1f} GiB), but only {free / 2**30:.1f} GiB is free (other processes "
            "hold the rest): lower gpu_memory_utilization"
        )
    return total - free


@torch.inference_mode()
def profile_num_blocks(runner: ModelRunner, baseline_used: int | None = None) -> int:
    """KV blocks that fit once weights and the activations of the largest step are resident
    (for a model without KV layers: recurrent-state rows).

    `gpu_memory_utilization` is this engine's share of the device: the budget is
    `total * utilization` minus what the engine itself holds (memory used now minus
    `baseline_used`, the device's use before the engine loaded anything: other processes)
    minus the activation peak. Without a baseline all used memory counts as ours."""
    cfg = runner.config
    bytes_per_block = CacheEngine.bytes_per_block(
        runner.hf_config, runner.block_size, runner.kv_cache_dtype
    )
    if runner.draft is not None:  # a draft model's cache: the same blocks, a second set
        bytes_per_block += runner.draft.bytes_per_block(runner.block_size)
    if bytes_per_block == 0 and runner.states is None:
        # Nothing cached at all (an encoder, models/bert.py): blocks only count tokens and
        # cost no memory, enough for max_num_seqs sequences of max_model_len.
        if cfg.num_gpu_blocks_override is not None:
            return cfg.num_gpu_blocks_override
        assert cfg.max_model_len is not None
        return 1 + cfg.max_num_seqs * -(-cfg.max_model_len // runner.block_size)
    if bytes_per_block == 0:
        # No KV layers (a pure state-space model): the budget is counted in recurrent-state
        # rows instead, which the prefix cache's snapshots take (fit_state_snapshots).
        assert runner.states is not None, "a model without KV layers carries recurrent state"
        bytes_per_block = runner.states.nbytes_per_row
    if cfg.num_gpu_blocks_override is not None:
        return cfg.num_gpu_blocks_override
    if cfg.kv_cache_memory_bytes is not None:  # the pool's size, given: nothing to profile
        return max(cfg.kv_cache_memory_bytes // bytes_per_block, 2)
    if runner.device.type != "cuda":
        return max(int(cfg.cpu_kv_cache_gib * (1 << 30)) // bytes_per_block, 2)
    dev = runner.device
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    free_before, total = torch.cuda.mem_get_info(dev)
    used_before = total - free_before  # weights, CUDA context, other processes
    own = used_before - (baseline_used or 0)
    allocated_before = torch.cuda.memory_allocated(dev)
    scratch_bytes = profile_forward(runner)
    torch.cuda.synchronize(dev)
    # The peak counts the forward's scratch KV blocks too: the real pool replaces them.
    activation_peak = torch.cuda.max_memory_allocated(dev) - allocated_before - scratch_bytes
    budget = total * cfg.gpu_memory_utilization - own - activation_peak
    torch.cuda.empty_cache()
    num_blocks = int(budget // bytes_per_block)
    logger.info(
        "profiling: %.2f GiB held by the engine, %.2f GiB activation peak -> %d KV blocks",
        own / 2**30,
        activation_peak / 2**30,
        num_blocks,
    )
    return num_blocks


def profile_forward(runner: ModelRunner) -> int:
    """One forward of max_num_batched_tokens tokens over max_num_seqs rows, then logits.
    Returns the bytes of the scratch KV cache it allocated."""
    cfg, bs, dev = runner.config, runner.block_size, runner.device
    assert cfg.max_num_batched_tokens is not None
    assert cfg.max_model_len is not None
    num_seqs = max(1, min(cfg.max_num_seqs, cfg.max_num_batched_tokens))
    # No step runs more than max_model_len tokens of one sequence (nor positions past it).
    num_tokens = min(cfg.max_num_batched_tokens, num_seqs * cfg.max_model_len)
    q, r = divmod(num_tokens, num_seqs)
    lens = [q + 1] * r + [q] * (num_seqs - r)  # each <= ceil(num_tokens / num_seqs)
    blocks_needed = sum(-(-n // bs) for n in lens) + 1
    dtype = _model_dtype(runner.model)
    kv_dtype = runner.kv_cache_dtype
    scratch = CacheEngine(
        runner.hf_config, blocks_needed, bs, dtype=kv_dtype, device=dev, backend=runner.backend
    )
    tables, slots, next_block = [], [], 1
    for n in lens:
        nb = -(-n // bs)
        table = list(range(next_block, next_block + nb))
        next_block += nb
        tables.append(table + [0] * (max(1, blocks_needed) - nb))
        slots.extend(table[p // bs] * bs + p % bs for p in range(n))
    cu = np.concatenate([[0], np.cumsum(lens)]).tolist()
    meta = runner.backend.build_metadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
        max_seqlen_q=max(lens),
        max_seqlen_k=max(lens),
    )
    ids = torch.zeros(num_tokens, dtype=torch.int64, device=dev)
    positions = torch.cat([torch.arange(n, device=dev) for n in lens])
    state = runner.parallel
    hidden_in = None  # a later pipeline stage profiles on stand-in hidden states
    if not state.is_first_stage:
        hidden_in = torch.zeros(num_tokens, runner.stage_width, dtype=dtype, device=dev)
    hidden = runner.model(ids, positions, scratch.kv_caches, meta, hidden_in)
    if state.is_last_stage:
        _profile_sampler(runner, hidden[:num_seqs])
        k = _num_speculative_tokens(runner)
        if k:  # a verification step samples k + 1 positions a row
            _profile_verification(runner, hidden[: min(num_tokens, num_seqs * (k + 1))], k)
        _profile_prompt_logprobs(runner, hidden)
    del scratch, hidden
    return blocks_needed * CacheEngine.bytes_per_block(runner.hf_config, bs, kv_dtype)


def _model_dtype(model: torch.nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


def _num_speculative_tokens(runner: ModelRunner) -> int:
    from paged_engine.spec_decode.config import SpeculativeConfig

    spec = runner.config.speculative_config
    return 0 if spec is None else SpeculativeConfig.from_dict(spec).max_draft_tokens


def _profile_sampler(runner: ModelRunner, hidden: torch.Tensor) -> None:
    """The sampled rows' logits through the sampler's costliest path: every row with
    temperature, top-k and top-p (a full sort), min-p, the three penalties, and max_logprobs
    logprobs (the vocabulary for -1). Every row is seeded and the host seed generator put back,
    so the engine's draws are those it would make without this."""
    sampler = runner.sampler
    md = _costliest_metadata(runner, len(hidden), hidden.device)
    host_seeds = sampler._race_seeds.bit_generator.state
    sampler(runner.compute_logits(hidden), md)
    sampler._race_seeds.bit_generator.state = host_seeds


def _profile_verification(runner: ModelRunner, hidden: torch.Tensor, k: int) -> None:
    """A verification step's logits as `ModelRunner._sample_drafts` holds them at once: rows
    of k drafts and a bonus position, raw and processed by the costliest path, their noise, a
    draft model's q (its proposal's rows, and q laid out over every row), the rejection
    sampler's temporaries, then the logprobs. Seeded rows only: no generator moves."""
    from paged_engine.sample.logprobs import gather_logprobs
    from paged_engine.spec_decode import rejection_sampler

    n, sampler = len(hidden), runner.sampler
    md = _costliest_metadata(runner, n, hidden.device)
    raw = runner.compute_logits(hidden).float()
    processed = sampler.process_logits(raw, md)
    noise = sampler.noise(raw.shape, md, raw.device)
    num_drafts = np.full(-(-n // (k + 1)), k, dtype=np.int64)
    num_drafts[-1] = (n - 1) % (k + 1)  # the last row's drafts (its bonus row is the last)
    is_bonus = np.zeros(n, dtype=bool)
    is_bonus[np.cumsum(num_drafts + 1) - 1] = True
    drafts = torch.where(torch.from_numpy(is_bonus), -1, 1).to(raw.device)
    q = None
    if runner.draft is not None:
        draft_rows = drafts >= 0
        proposal = processed[draft_rows].softmax(dim=-1)  # held, as the step holds it, with q
        q = processed.new_zeros(processed.shape)
        q[draft_rows] = proposal
    greedy = torch.zeros(n, dtype=torch.bool, device=raw.device)
    verified = rejection_sampler.verify(processed, drafts, greedy, noise, num_drafts, q)
    gather_logprobs(raw, verified.tokens, md.max_num_logprobs, sampler.logsumexp, None)


def _costliest_metadata(runner: ModelRunner, n: int, device: torch.device):
    """n seeded rows with every filter and penalty, and max_logprobs logprobs."""
    from paged_engine.sample.metadata import build_sampling_metadata

    k = runner.config.max_logprobs
    k = runner.vocab_size if k == -1 else k

    def full(value: float) -> np.ndarray:
        return np.full(n, value)

    return build_sampling_metadata(
        device=device,
        vocab_size=runner.vocab_size,
        temperature=full(0.8),
        top_k=full(50).astype(np.int64),
        top_p=full(0.9),
        min_p=full(0.05),
        repetition=full(1.1),
        frequency=full(0.1),
        presence=full(0.1),
        history=[([1, 2], [3])] * n,
        banned=[()] * n,
        seeds=[(row, row) for row in range(n)],
        num_logprobs=[k] * n,
        need_logprobs=True,
    )


def _profile_prompt_logprobs(runner: ModelRunner, hidden: torch.Tensor) -> None:
    """The largest logits a step makes besides the sampled rows': one slice of a prompt's rows
    for prompt logprobs (model_runner.PROMPT_LOGPROBS_ELEMENTS), packed with max_logprobs
    entries each, beside the forward's hidden states, as the step holds them."""
    from paged_engine.sample.logprobs import prompt_logprobs
    from paged_engine.worker.model_runner import PROMPT_LOGPROBS_ELEMENTS

    rows = min(len(hidden), max(1, PROMPT_LOGPROBS_ELEMENTS // runner.vocab_size))
    k = runner.config.max_logprobs
    k = runner.vocab_size if k == -1 else k
    targets = torch.zeros(rows, dtype=torch.long, device=hidden.device)
    logits = runner.compute_logits(hidden[:rows])
    prompt_logprobs(logits, targets, k, runner.sampler.logsumexp)
