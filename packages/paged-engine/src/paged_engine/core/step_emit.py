"""The end of `Scheduler.schedule()`: the step's plan becomes a plain `SchedulerOutput`.

For each planned (sequence, token count): `num_computed_tokens` advances, a token the step will
sample turns pending, a rolled-back verify step's tokens are sent to run again, a hybrid
model's state snapshots are marked, and the worker gets a sequence it does not hold in full
(`NewSeqData`) or else only its new block ids. The block manager's copies and swaps, the state
row copies and the KV connector's loads / saves ride along with the step.

`StepEmitter` is a mixin of `Scheduler` (core/scheduler.py). vLLM v1: the tail of
`Scheduler.schedule()` (`NewRequestData`, `CachedRequestData`) and `_update_after_schedule`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from paged_engine.core.request import Request, Sequence
from paged_engine.core.sched_output import NewSeqData, SchedulerOutput
from paged_engine.core.state_slots import BlockKey
from paged_engine.multimodal.inputs import is_embeds_prompt

if TYPE_CHECKING:
    from collections.abc import Callable

    from paged_engine.core.block_manager import BlockManager
    from paged_engine.core.state_slots import StateSlots
    from paged_engine.kv_transfer.connector import KVConnector


@dataclass(slots=True)
class PromptTokenSources:
    """Prompt tokens by source, counted at each request's first scheduling (vLLM's
    prompt_tokens_by_source / _cached / _recomputed, which it counts at the prefill's output).

    computed + local_cache_hit + external_kv_transfer - recomputed == prompt tokens (so
    computed + cached). `recomputed`: 1 for a
    request whose cache hit left only its last token to run (a hit is capped there so that its
    logits exist); vLLM counts that token as a hit and as recomputed."""

    computed: int = 0  # prompt tokens the model runs
    local_cache_hit: int = 0  # found in the prefix cache (GPU or CPU tier)
    external_kv_transfer: int = 0  # loaded by the kv_transfer connector
    recomputed: int = 0

    @property
    def cached(self) -> int:
        """Prompt tokens not run: local hits plus loaded tokens."""
        return self.local_cache_hit + self.external_kv_transfer - self.recomputed

    def count(self, num_prompt_tokens: int, num_local: int, num_external: int) -> None:
        cached = num_local + num_external
        recomputed = int(cached + 1 == num_prompt_tokens)
        self.computed += num_prompt_tokens - cached
        self.local_cache_hit += num_local + recomputed
        self.external_kv_transfer += num_external
        self.recomputed += recomputed


class StepEmitter:
    """Builds the step's `SchedulerOutput` from the plan (mixed into `Scheduler`)."""

    # the Scheduler's state it uses
    block_manager: BlockManager
    state_slots: StateSlots | None
    kv_connector: KVConnector | None
    clock: Callable[[], float]
    step_seqs: dict[int, list[Sequence]]
    _next_step_id: int
    _finished_seq_ids: list[int]
    _drafts: dict[int, list[int]]
    prompt_sources: PromptTokenSources

    def _emit(
        self, planned: list[tuple[Sequence, int]], admitted: list[Request]
    ) -> SchedulerOutput:
        """The plain-data step: advances num_computed_tokens and marks sampled tokens pending.
        `admitted`: the requests this step admitted (their first schedule time, if unset)."""
        out = SchedulerOutput(step_id=self._next_step_id)
        self._next_step_id += 1
        out.finished_seq_ids, self._finished_seq_ids = self._finished_seq_ids, []
        now = None
        for req in admitted:
            if req.first_scheduled_time is None:
                now = self.clock() if now is None else now
                req.first_scheduled_time = now
                first = req.seqs[0]
                req.num_cached_tokens = first.num_cached_tokens + first.num_external_tokens
                self.prompt_sources.count(
                    req.num_prompt_tokens, first.num_cached_tokens, first.num_external_tokens
                )
        out.seq_ids = [seq.seq_id for seq, _ in planned]
        out.num_new_tokens = num_new = [n for _, n in planned]
        out.start_positions = [seq.num_computed_tokens for seq, _ in planned]
        sample_rows, updates, new_seqs = out.sample_rows, out.block_updates, out.new_seqs
        bm = self.block_manager
        bs, caching = bm.block_size, bm.enable_prefix_caching
        slots, drafts_of = self.state_slots, self._drafts
        if slots is not None:  # first: the snapshots this step takes run with the next
            out.state_copies = slots.take_copies(self._known_block_key)
        filled: list[Sequence] = []  # may fill a block this step (for the prefix cache)
        for row, (seq, n) in enumerate(planned):
            start = seq.num_computed_tokens
            end = seq.num_computed_tokens = start + n
            if caching and end // bs > seq.num_registered_blocks:
                filled.append(seq)
            if seq.replay_end:  # a rolled-back verify step's tokens run again
                out.known_token_ids[seq.seq_id] = seq.token_ids[start : min(end, seq.replay_end)]
                if end >= seq.replay_end:
                    seq.replay_end = 0
            drafts = drafts_of.pop(seq.seq_id, None) if drafts_of else None
            if drafts:  # the row runs its last token and the drafts, and samples from all
                out.spec_token_ids[seq.seq_id] = drafts
                end -= len(drafts)
            if end == len(seq.token_ids) + seq.num_pending:
                sample_rows.append(row)
                req = seq.request
                if req.max_live_seqs > 1 and req.fans_out:
                    out.num_samples[seq.seq_id] = req.max_live_seqs
                seq.num_pending += 1
            table = seq.block_ids
            if slots is not None:
                if seq.state_slot < 0:
                    assert start == 0, "a sequence with computed tokens and no recurrent state"
                    seq.state_slot = slots.allocate()
                marks, end = seq.state_checkpoints, seq.num_computed_tokens
                if marks and marks[0] <= end:
                    if marks[0] == end:
                        slots.snapshot(seq.state_slot, seq, end // bs - 1)
                    seq.state_checkpoints = [m for m in marks if m > end]
                elif (  # a block of generated tokens ends here: the decode snapshot
                    slots.max_held
                    and end % bs == 0
                    and end > seq.num_prompt_tokens
                    and not drafts
                    and seq.request.max_live_seqs == 1
                ):
                    slots.snapshot(seq.state_slot, seq, end // bs - 1, decode=True)
            if not seq.in_worker:
                new_seqs.append(self._new_seq_data(seq, start))
                seq.in_worker = True
                seq.num_synced_blocks = len(table)
            elif seq.num_synced_blocks < len(table):
                first = seq.num_synced_blocks
                updates.append((seq.seq_id, first, table[first:]))
                seq.num_synced_blocks = len(table)
        out.num_batched_tokens = sum(num_new)
        if self.kv_connector is not None:
            self.kv_connector.build_step(out, planned)
        out.blocks_to_copy = bm.take_blocks_to_copy()
        out.blocks_to_swap_out, out.blocks_to_swap_in = bm.take_swaps()
        self.step_seqs[out.step_id] = filled
        return out

    def _known_block_key(self, seq: Sequence, i: int) -> BlockKey | None:
        """The prefix-cache key of full block i, None while one of its tokens is pending."""
        if len(seq.token_ids) < (i + 1) * self.block_manager.block_size:
            return None
        return self.block_manager.block_key(seq, i)

    @staticmethod
    def _new_seq_data(seq: Sequence, start: int) -> NewSeqData:
        """`start`: its first position this step; images placed before it are not sent."""
        req = seq.request
        return NewSeqData(
            seq_id=seq.seq_id,
            index=seq.index,
            token_ids=list(seq.token_ids),
            num_prompt_tokens=seq.num_prompt_tokens,
            block_ids=list(seq.block_ids),
            params=req.params,
            beam_candidates=req.beam.num_candidates if req.beam is not None else 0,
            eos_token_ids=tuple(sorted(req.eos_token_ids)),
            lora_id=req.lora_id,
            lora_path=req.lora_path,
            state_slot=seq.state_slot,
            # (PaliGemma's images also while their two-way prefix has tokens to run)
            mm_inputs=tuple(m for m in req.mm_inputs if max(m.end, m.prefix_end) > start),
            mrope=req.mrope,
            embeds_prompt=is_embeds_prompt(req.mm_inputs),
        )
