"""Beam search over a request's live sequences, one decoding step at a time.

The engine keeps every live beam as a `Sequence` with its own block table; beams that descend from
the same parent share its blocks (fork) and diverge by copy-on-write. This module only decides
*which* (parent, token) pairs survive; the output processor applies the decision to sequences.

Selection follows the semantics users know from HF transformers `generate(num_beams=...)`:
take the top `K = max(2, 1 + num_eos) * beam_width` candidates of `beam_score + logprob` over all
beams; candidates that end (EOS or length) among the first `beam_width` become finished hypotheses
scored `sum_logprob / generated_len ** length_penalty`; the best `beam_width` others keep running.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

NEG_INF = -1.0e9


# A beam's candidates at each step, newest last, as a chain shared by the beams that forked
# from it: (the steps before, (the candidates' logprobs, their ids), best first).
BeamTrace = tuple[Any, tuple[list[float], list[int]]]


def trace_steps(trace: BeamTrace | None) -> list[tuple[list[float], list[int]]]:
    """The steps of `trace`, oldest first."""
    steps = []
    while trace is not None:
        trace, step = trace
        steps.append(step)
    return steps[::-1]


@dataclass(slots=True)
class Hypothesis:
    """A finished beam: its generated tokens, raw cumulative logprob and length-penalised score."""

    token_ids: list[int]  # generated tokens only (the prompt is the request's)
    cumulative_logprob: float
    score: float
    finish_reason: str  # "stop" (EOS) or "length"
    trace: BeamTrace | None = None  # each step's candidates of the beam it came from


@dataclass(slots=True)
class Candidate:
    parent: int  # row of the live beam it extends
    token_id: int
    cumulative_logprob: float


@dataclass(slots=True)
class BeamStepResult:
    running: list[Candidate]  # the beams to keep running, best first
    done: bool  # the search is over; `finished` holds the answer


@dataclass
class BeamSearchState:
    beam_width: int
    length_penalty: float
    early_stopping: bool | str
    max_tokens: int
    eos_token_ids: set[int]
    finished: list[Hypothesis] = field(default_factory=list)  # best first, at most beam_width
    improvement_possible: bool = True

    @property
    def num_candidates(self) -> int:
        """Candidates kept per step (and per beam): enough to refill every beam past EOS hits."""
        return max(2, 1 + len(self.eos_token_ids)) * self.beam_width

    def step(
        self,
        top_logprobs: torch.Tensor,  # [num_live, k] each live beam's best next-token logprobs
        top_ids: torch.Tensor,  # [num_live, k] their token ids (k >= num_candidates or vocab)
        beam_scores: list[float],  # [num_live] cumulative logprob of each live beam
        generated: list[list[int]],  # [num_live] tokens each live beam generated so far
        max_new_by_context: int,  # tokens still allowed by max_model_len (same for all beams)
        traces: list[BeamTrace | None] | None = None,  # [num_live] each beam's trace so far
    ) -> BeamStepResult:
        """The global top candidates over all beams equal the top of each beam's own top-k, so
        only [num_live, k] values ever leave the device."""
        num_live, k = top_logprobs.shape
        cur_gen_len = len(generated[0])  # invariant: all live beams have the same length
        acc = top_logprobs.float().cpu() + torch.tensor(beam_scores, dtype=torch.float32)[:, None]
        top_vals, top_idx = torch.topk(acc.flatten(), k=min(self.num_candidates, num_live * k))
        ids = top_ids.cpu().flatten()
        at_length = cur_gen_len + 1 >= min(self.max_tokens, max_new_by_context + cur_gen_len)

        candidates: list[Candidate] = []
        hits: list[bool] = []
        for val, idx in zip(top_vals.tolist(), top_idx.tolist()):
            cand = Candidate(parent=idx // k, token_id=int(ids[idx]), cumulative_logprob=val)
            candidates.append(cand)
            hits.append(at_length or cand.token_id in self.eos_token_ids)

        running = [c for c, hit in zip(candidates, hits) if not hit][: self.beam_width]
        steps = None
        if traces is not None:  # a finished candidate's trace: its parent's, then this step
            lps, tids = top_logprobs.tolist(), top_ids.tolist()
            steps = [(traces[p], (lps[p], tids[p])) for p in range(num_live)]
        self._add_finished(candidates, hits, generated, cur_gen_len, at_length, steps)

        # HF's early-stop heuristic: can the best running beam still beat the worst kept answer?
        if running and self._is_full():
            if self.early_stopping == "never" and self.length_penalty > 0:
                best_len = self.max_tokens
            else:
                best_len = cur_gen_len + 1
            best_possible = running[0].cumulative_logprob / (best_len**self.length_penalty)
            if best_possible <= self.finished[-1].score:
                self.improvement_possible = False
        done = (
            not running
            or not self.improvement_possible
            or (self._is_full() and self.early_stopping is True)
        )
        return BeamStepResult(running=running, done=done)

    def _is_full(self) -> bool:
        return len(self.finished) >= self.beam_width

    def _add_finished(
        self,
        candidates: list[Candidate],
        hits: list[bool],
        generated: list[list[int]],
        cur_gen_len: int,
        at_length: bool,
        steps: list[BeamTrace] | None = None,
    ) -> None:
        if not self.improvement_possible or (self._is_full() and self.early_stopping is True):
            return
        # Only the first beam_width candidates may finish; the rest exist to keep beams running.
        for cand, hit in zip(candidates[: self.beam_width], hits[: self.beam_width]):
            if not hit:
                continue
            gen_len = cur_gen_len + 1
            score = cand.cumulative_logprob / (gen_len**self.length_penalty)
            is_eos = cand.token_id in self.eos_token_ids
            self.finished.append(
                Hypothesis(
                    token_ids=[*generated[cand.parent], cand.token_id],
                    cumulative_logprob=cand.cumulative_logprob,
                    score=score,
                    finish_reason="stop" if is_eos else "length",
                    trace=None if steps is None else steps[cand.parent],
                )
            )
        # Stable sort: on equal scores the earlier hypothesis stays ahead.
        self.finished.sort(key=lambda h: h.score, reverse=True)
        del self.finished[self.beam_width :]

    def best(self, n: int) -> list[Hypothesis]:
        return self.finished[:n]
