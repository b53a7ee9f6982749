"""`LastHiddenRunner`: the base of proposers that draft from the target's final hidden state at
a sequence's last verified position and attend to nothing of their own: Medusa heads
(spec_decode/medusa.py), IBM's MLP speculator (spec_decode/mlp_speculator.py) and the Gemma 4
assistant (spec_decode/gemma4_assistant.py, which reads the target's own KV). vLLM's
counterparts take the same state from the target's forward (its `MedusaProposer` and the MLP
speculator's `previous_hidden_states`).

The invariant, between steps, for every sequence the worker holds that has run a step:
`_kept[q] == (p, i)`, where p is q's last position the target verified (its own tokens of its
latest step, then the drafts it accepted) and `_feat[i]` the target forward's output row at p.
A drafting row whose own token sits at c is served when p == c - 1; any other row (a fan-out's
sibling, a sequence the worker dropped and got back, a step that also runs prompt tokens)
proposes its own token again, a point mass: acceptance may drop, outputs never change.

No KV cache: the worker's per-step block operations (swaps, copy-on-write) have nothing to move.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch
from torch import Tensor

from paged_engine.spec_decode.draft_model import DraftModelRunner, DraftProposal

if TYPE_CHECKING:
    from paged_engine.core.sched_output import SchedulerOutput
    from paged_engine.worker.model_runner import StepInputs


@dataclass(slots=True)
class DraftingRows:
    """A step's drafting rows and what the kept states serve of them."""

    index: np.ndarray  # [D] their batch indices
    num_drafts: np.ndarray  # [D] (>= 1)
    base: np.ndarray  # [B] every batch row's own tokens (its drafts not counted)
    positions: np.ndarray  # [D] c: each one's own (last) token position
    own: Tensor  # [D] that token, which an unserved row repeats as its drafts
    served: np.ndarray  # indices into `index` of the rows with h kept at c - 1
    hidden: Tensor | None  # [len(served), D] those h (None: no row served)


class _NoKVCache:
    """The proposer's cache: no tensors, so every block operation on it does nothing."""

    kv_caches: ClassVar[list] = []

    def swap_out(self, blocks) -> None:
        pass

    def swap_in(self, blocks) -> None:
        pass

    def copy_blocks(self, blocks) -> None:
        pass


class LastHiddenRunner(DraftModelRunner):
    """Keeps each sequence's last verified hidden state (module docstring); a subclass's
    `propose` starts from `_drafting_rows` and ends with `_finish_rows`."""

    reads_target_features = True

    def __init__(self, model, hf_config, runner) -> None:
        super().__init__(model, hf_config, runner)
        self.cache = _NoKVCache()  # type: ignore[assignment]
        self._kept: dict[int, tuple[int, int]] = {}  # seq id -> (p, row of _feat)
        self._feat: Tensor | None = None  # [S, D]
        self._accepted: dict[int, int] = {}  # this step's accepted drafts per drafting seq

    def bytes_per_block(self, block_size: int) -> int:
        return 0

    def init_cache(self, num_blocks: int, num_cpu_blocks: int) -> None:
        pass

    def after_verify(self, seq_ids, num_drafts, num_accepted, drafts, positions) -> None:
        self._accepted = {
            s: a for s, d, a in zip(seq_ids, num_drafts.tolist(), num_accepted.tolist()) if d
        }

    def after_step(self, sched: SchedulerOutput, inputs: StepInputs, hidden: Tensor) -> None:
        """Keep h of each row's last verified position; sequences not in the step keep theirs
        while the worker holds them (called after the step's sampling)."""
        accepted, self._accepted = self._accepted, {}
        r, seq_ids = self.runner, sched.seq_ids
        spec = sched.spec_token_ids
        # verified tokens of each row: its own (scheduled minus drafts) plus the accepted drafts
        n = np.asarray(sched.num_new_tokens, dtype=np.int64)
        n -= np.asarray([len(spec.get(q, ())) for q in seq_ids], dtype=np.int64)
        n += np.asarray([accepted.get(q, 0) for q in seq_ids], dtype=np.int64)
        last = np.asarray(sched.start_positions, dtype=np.int64) + n - 1
        feat = hidden.index_select(0, r._to_dev(inputs.cu[:-1] + n - 1))
        kept = {q: (p, i) for i, (q, p) in enumerate(zip(seq_ids, last.tolist()))}
        in_step, live = set(seq_ids), r.batch.seqs
        carried = [(q, e) for q, e in self._kept.items() if q not in in_step and q in live]
        if carried:
            assert self._feat is not None
            old = self._feat.index_select(0, r._to_dev([e[1] for _, e in carried]))
            feat = torch.cat([feat, old])
            for j, (q, (p, _)) in enumerate(carried):
                kept[q] = (p, len(seq_ids) + j)
        self._kept, self._feat = kept, feat

    def _drafting_rows(self, sched: SchedulerOutput, inputs: StepInputs) -> DraftingRows | None:
        """The step's drafting rows (None: no row drafts) and their kept h at c - 1. Only a
        row whose step runs its own token alone is served (the scheduler drafts on decode rows
        only; want -1 below: no p is -1)."""
        spec = sched.spec_token_ids
        num_drafts = np.asarray([len(spec.get(q, ())) for q in sched.seq_ids], dtype=np.int64)
        drafting = np.flatnonzero(num_drafts)
        if drafting.size == 0:
            return None
        base = np.asarray(sched.num_new_tokens, dtype=np.int64) - num_drafts
        last = base[drafting] - 1  # a row's own last token, after its first
        c = np.asarray(sched.start_positions, dtype=np.int64)[drafting] + last
        own = inputs.input_ids.index_select(0, self.runner._to_dev(inputs.cu[drafting] + last))
        want = np.where(base[drafting] == 1, c - 1, -1).tolist()
        entries = [self._kept.get(sched.seq_ids[i]) for i in drafting.tolist()]
        hits = [(j, e[1]) for j, (e, p) in enumerate(zip(entries, want)) if e and e[0] == p]
        served, hidden = np.asarray([j for j, _ in hits], dtype=np.int64), None
        if hits:
            assert self._feat is not None
            hidden = self._feat.index_select(0, self.runner._to_dev([row for _, row in hits]))
        return DraftingRows(drafting, num_drafts[drafting], base, c, own, served, hidden)

    def _finish_rows(
        self, sched, inputs, plan: DraftingRows, tokens: Tensor, probs: Tensor | None
    ) -> DraftProposal:
        """`_finish` with the drafts [D, k] of `plan`, after giving each unserved row's
        repeated own token a point mass in q (without q the verifier assumes them)."""
        unserved = np.setdiff1d(np.arange(plan.index.size), plan.served)
        if unserved.size and probs is not None:
            at = self.runner._to_dev(unserved)
            steps = torch.arange(tokens.shape[1], device=self.runner.device)
            probs[at.unsqueeze(1), steps.unsqueeze(0), tokens[at]] = 1.0
        return self._finish(sched, inputs, plan.index, plan.num_drafts, plan.base, tokens, probs)
