"""`SchedulerOutput`: what one step runs, as plain data (picklable; no live engine object).

A sequence the worker has not seen comes once in full (`new_seqs`); afterwards only what
changed: block-table deltas and, every step, where it starts and how many tokens it runs.

    batch row i runs positions [start_positions[i], start_positions[i] + num_new_tokens[i])
    of sequence seq_ids[i]; rows in `sample_rows` sample a token from their last position.

Worker order for one output: drop `finished_seq_ids`, add `new_seqs`, apply `block_updates`,
run `blocks_to_swap_out`, `blocks_to_swap_in`, `blocks_to_copy`, `state_copies`, then the forward
over the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class NewSeqData:
    """A sequence the worker does not hold: new, resumed after preemption, or forked."""

    seq_id: int
    index: int  # sample index within its request (seeds each seeded draw)
    token_ids: list[int]  # every token the host knows
    num_prompt_tokens: int
    block_ids: list[int]  # the whole table
    params: Any  # SamplingParams, or BeamSearchParams (then the worker returns top-k)
    beam_candidates: int = 0  # beam search: candidates (top-k) returned per step
    eos_token_ids: tuple[int, ...] = ()  # masked while below min_tokens (empty: ignore_eos)
    lora_id: int = 0  # the adapter it runs with (lora/), 0 for none
    lora_path: str | None = None
    state_slot: int = -1  # hybrid models: its recurrent-state row (core/state_slots.py)
    # images (multimodal/inputs.py) whose placeholders it has yet to run
    mm_inputs: tuple = ()
    mrope: Any = None  # its prompt's M-RoPE positions (Qwen-VL with images), else None
    embeds_prompt: bool = False  # prompt_embeds: its prompt ids are placeholders, not tokens


@dataclass(slots=True)
class SchedulerOutput:
    step_id: int
    new_seqs: list[NewSeqData] = field(default_factory=list)
    # The batch, one row per sequence with tokens this step, in order.
    seq_ids: list[int] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    start_positions: list[int] = field(default_factory=list)  # num_computed before the step
    sample_rows: list[int] = field(default_factory=list)  # batch rows that sample
    # seq_id -> samples drawn from its logits when more than one (n > 1: the first token)
    num_samples: dict[int, int] = field(default_factory=dict)
    # (seq_id, first table index, block ids): table[first : first + len(ids)] = ids
    block_updates: list[tuple[int, int, list[int]]] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)  # the worker drops these
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) CoW
    num_batched_tokens: int = 0
    # Constrained sequences sampled this step: (seq ids, [R, ceil(V / 32)] int32 numpy bitmask),
    # row r the tokens seq_ids[r] may sample (structured_output/bitmask.py); None when none.
    token_bitmask: tuple[list[int], Any] | None = None
    # Speculative decoding: seq id -> draft tokens the row runs after its last token; the row
    # then samples at every one of its positions (verification).
    spec_token_ids: dict[int, list[int]] = field(default_factory=dict)
    # seq id -> tokens of the row's first positions that the worker does not know (generated
    # tokens run again after a rejected draft rolled a recurrent state back: Sequence.replay_end).
    known_token_ids: dict[int, list[int]] = field(default_factory=dict)
    # KV blocks moved to / from the CPU pool (swap preemption, the prefix cache's CPU tier):
    # (device block, CPU block) copied out first, then (CPU block, device block) copied in.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    # Hybrid models: (src, dst) recurrent-state rows copied before the forward (forks).
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    # KV transfer (kv_transfer/): (block id, storage key) filled from storage before the
    # forward, and saved to it after the forward (only with a kv_transfer_config).
    kv_loads: list[tuple[int, str]] = field(default_factory=list)
    kv_saves: list[tuple[int, str]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.seq_ids

    @property
    def has_block_work(self) -> bool:
        """Block copies or swaps the worker must run even when no sequence runs."""
        return bool(
            self.blocks_to_copy
            or self.blocks_to_swap_out
            or self.blocks_to_swap_in
            or self.state_copies
        )
