"""Admission's lookup: what a waiting request has computed already, before it is planned.

Each sequence takes its prefix-cache hit from the block manager (its `num_computed_tokens` set),
and a lone sequence the blocks a KV connector finds in storage. A hybrid model (recurrent
state beside the KV cache) resumes only at the deepest hit block that has a state snapshot, and
marks where snapshots should be taken for the requests to come.

`PrefixLookup` is a mixin of `Scheduler` (core/scheduler.py), called from the waiting loop of
`schedule()`. vLLM v1: `kv_cache_manager.get_computed_blocks` and the connector's
`get_num_new_matched_tokens` in the same loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from paged_engine.core.request import Sequence

if TYPE_CHECKING:
    from paged_engine.core.block_manager import BlockManager
    from paged_engine.core.state_slots import StateSlots
    from paged_engine.kv_transfer.connector import KVConnector


class PrefixLookup:
    """The admission-time prefix-cache / KV-connector lookup (mixed into `Scheduler`)."""

    # the Scheduler's state it uses
    block_manager: BlockManager
    state_slots: StateSlots | None
    kv_connector: KVConnector | None

    def _computed_blocks(self, seqs: list[Sequence]) -> bool:
        """Admission's prefix-cache hit for each sequence (blocks taken, num_computed_tokens
        set). Returns whether the lookup counted in the cache's stats.

        A hybrid model resumes only at the deepest hit block with a state snapshot (the rest of
        the hit is computed again; its state comes from a copy of the snapshot), and sets the
        block boundaries where snapshots are wanted for the requests to come: where the KV hit
        ends (a shared prefix, e.g. a system prompt, that has no snapshot yet) and the last full
        block of its tokens (the next turn of a chat resumes there). A forked request recomputed
        after preemption takes no hit: `reshare_plan` shares its prefix."""
        bm, slots = self.block_manager, self.state_slots
        if slots is None:
            for seq in seqs:
                bm.get_computed_blocks(seq)
            if self.kv_connector is not None and len(seqs) == 1:  # (a fork reshares instead)
                self.kv_connector.match(bm, seqs[0])
            return True
        if len(seqs) > 1:
            return False
        seq = seqs[0]
        bs = bm.block_size
        num_hit = bm.get_computed_blocks(seq) // bs
        # (a model whose prompt tokens update the state their own way resumes in the prompt)
        num = num_hit if slots.past_prompt else min(num_hit, seq.num_prompt_tokens // bs)
        row = None
        while num and (row := slots.lookup(bm.block_key(seq, num - 1))) is None:
            num -= 1
        if num < num_hit:
            bm.drop_computed_blocks(seq, num)
        if row is not None:
            seq.state_slot = slots.allocate()
            slots.copy(row, seq.state_slot)
            slots.snapshot_hits += 1
        end = seq.num_tokens if slots.past_prompt else seq.num_prompt_tokens
        marks = {num_hit * bs, end // bs * bs}
        seq.state_checkpoints = sorted(m for m in marks if num * bs < m <= end)
        return True
