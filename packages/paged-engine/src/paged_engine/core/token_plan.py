"""How one request's live sequences split a step's token budget.

`plan_tokens`: lockstep for multi-sequence requests (n > 1, beams): all reach the end of their
tokens in the same step, or none does (each then runs at most `remaining - 1`).
`reshare_plan`: a forked request recomputed after preemption computes its common prefix once and
shares it again, as the fork did.
`whole_images`: a step never ends inside an image whose tokens attend to each other (Gemma 3).
"""

from __future__ import annotations

from collections.abc import Callable

from paged_engine.core.block_manager import BlockManager
from paged_engine.core.request import Sequence
from paged_engine.core.state_slots import StateSlots


def plan_tokens(
    seqs: list[Sequence], budget: int, may_split: Callable[[int], bool]
) -> list[tuple[Sequence, int]]:
    """Tokens per sequence of one request under `budget`; [] when nothing can run.
    `may_split(n)`: whether work of n tokens may run in part (chunked prefill)."""
    if len(seqs) == 1:
        seq = seqs[0]
        n = seq.num_tokens - seq.num_computed_tokens
        if n > budget:
            if not may_split(n):
                return []
            n = budget
        return [(seq, n)] if n > 0 else []
    remaining = [s.num_tokens - s.num_computed_tokens for s in seqs]
    total = sum(remaining)
    if total <= budget:
        return [(s, r) for s, r in zip(seqs, remaining) if r > 0]
    if not may_split(total):
        return []
    # Lockstep: nobody may reach the end this step; each gets at most remaining - 1.
    plan = []
    for s, r in zip(seqs, remaining):
        n = min(r - 1, budget)
        if n > 0:
            plan.append((s, n))
            budget -= n
    return plan


def reshare_plan(
    bm: BlockManager,
    seqs: list[Sequence],
    budget: int,
    state_slots: StateSlots | None = None,
) -> list[tuple[Sequence, int]] | None:
    """A forked request (n > 1, beams) recomputed after preemption: the first sequence
    computes the common prefix alone, then the others share its full blocks as after the
    fork (recomputing each copy could need more blocks than the request ever held).
    Returns the first sequence's part while the others wait for it, None once shared
    (or nothing to share: e.g. prefix-cache hits already cover it).

    With `state_slots` (a hybrid model) a sequence also needs the first's recurrent state at
    the point it shares up to, and the first keeps only its latest state: all share the same
    number of blocks (the fewest any needs), taken when the first has computed exactly that
    far, with a copy of its state row. Past that point nothing is shared: each computes its own."""
    first = seqs[0]
    bs = bm.block_size
    wanted: list[tuple[Sequence, int]] = []  # (sequence, blocks it can share)
    for seq in seqs[1:]:
        common = 0
        for a, b in zip(first.token_ids, seq.token_ids):
            if a != b:
                break
            common += 1
        num_blocks = min(common, seq.num_tokens - 1) // bs  # the last token always runs
        if num_blocks > len(seq.block_ids):
            wanted.append((seq, num_blocks))
    if not wanted:
        return None
    if state_slots is not None:
        num_blocks = min(n for _, n in wanted)
        wanted = [(seq, num_blocks) for seq, _ in wanted if seq.num_computed_tokens == 0]
        if not wanted or first.num_computed_tokens > num_blocks * bs:
            return None
    target = 0  # tokens the first sequence must have computed before the others share
    for seq, num_blocks in wanted:
        if first.num_computed_tokens >= num_blocks * bs:
            bm.share_prefix(first, seq, num_blocks)
            if state_slots is not None:
                seq.state_slot = state_slots.allocate()
                state_slots.copy(first.state_slot, seq.state_slot)
        else:
            target = max(target, num_blocks * bs)
    if not target:
        return None
    n = min(target - first.num_computed_tokens, budget)
    return [(first, n)] if n > 0 else []


def whole_images(seq: Sequence, n: int, budget: int) -> int:
    """`n` new tokens of `seq` moved so the step does not end inside an image whose tokens attend
    to each other (`ImageInput.bidirectional`: every one must run with all the others, or its
    KV would miss them): to the image's end where `budget` allows, else to its start, else 0
    (the sequence waits for a step with room; the engine keeps max_num_batched_tokens at least
    an image's length)."""
    start = seq.num_computed_tokens
    end = start + n
    for m in seq.request.mm_inputs:
        span = m.two_way  # an image, or PaliGemma's whole prefix
        if span is not None and span[0] < end < span[1]:
            if span[1] - start <= budget:
                return span[1] - start
            return max(span[0] - start, 0)
    return n


def whole_image_plan(plan: list[tuple[Sequence, int]], budget: int) -> list[tuple[Sequence, int]]:
    """`whole_images` over a request's plan: a lone sequence may grow within `budget`, lockstep
    ones only shrink (they share the budget)."""
    if not plan or not plan[0][0].request.mm_inputs:
        return plan
    if len(plan) == 1:
        cut = [(plan[0][0], whole_images(plan[0][0], plan[0][1], budget))]
    else:
        cut = [(seq, whole_images(seq, n, n)) for seq, n in plan]
    return [(seq, n) for seq, n in cut if n > 0]
