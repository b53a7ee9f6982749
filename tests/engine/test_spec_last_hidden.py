"""spec_decode/last_hidden.py's bookkeeping on its own (no model): which hidden state each
sequence keeps across steps, which drafting rows it serves, and the point masses of the rows it
cannot serve. The proposers built on it (Medusa, the MLP speculator, the Gemma 4 assistant) are
tested end to end in their own files; these cases are the ones those runs never reach (a
sequence that sits a step out, a sampled row without its state)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from paged_engine.spec_decode.last_hidden import DraftingRows, LastHiddenRunner


def _runner(live: set[int]) -> LastHiddenRunner:
    """A LastHiddenRunner over a stand-in target runner whose batch holds `live`."""
    runner = SimpleNamespace(
        _to_dev=lambda v: torch.as_tensor(np.asarray(v, dtype=np.int64)),
        device=torch.device("cpu"),
        batch=SimpleNamespace(seqs=dict.fromkeys(live)),
    )
    proposer = object.__new__(LastHiddenRunner)  # (no model: only the bookkeeping runs)
    proposer.runner = runner  # type: ignore[assignment]
    proposer._kept, proposer._feat, proposer._accepted = {}, None, {}
    return proposer


def _step(seq_ids, num_new, starts, spec=None):
    """(sched, inputs) of a step: row i runs num_new[i] tokens from starts[i]; its input ids
    are 1000 * seq id + position."""
    cu = np.concatenate([[0], np.cumsum(num_new)]).astype(np.int64)
    ids = [1000 * q + s + j for q, n, s in zip(seq_ids, num_new, starts) for j in range(n)]
    sched = SimpleNamespace(
        seq_ids=seq_ids, num_new_tokens=num_new, start_positions=starts, spec_token_ids=spec or {}
    )
    return sched, SimpleNamespace(cu=cu, input_ids=torch.tensor(ids))


def test_each_sequence_keeps_its_last_verified_state_while_the_worker_holds_it():
    proposer = _runner(live={1, 2, 3})
    # seq 1: a 3-token prefill at [0, 3); seq 2: its token at 10 and 2 drafts, 1 accepted
    sched, inputs = _step([1, 2], [3, 3], [0, 10], spec={2: [-1, -1]})
    proposer.after_verify([2], np.array([2]), np.array([1]), {}, np.array([11]))
    proposer.after_step(sched, inputs, torch.arange(6.0).unsqueeze(1))  # h of row r: r
    assert proposer._kept == {1: (2, 0), 2: (11, 1)}  # position 2 (row 2); 11 (row 4)
    # seq 2 sits this step out: it keeps h_11
    sched, inputs = _step([1], [1], [3])
    proposer.after_step(sched, inputs, torch.tensor([[100.0]]))
    # each drafts 2 (seq 3: new to the proposer, a fan-out's sibling: nothing kept)
    spec = {1: [-1, -1], 2: [-1, -1], 3: [-1, -1]}
    sched, inputs = _step([1, 2, 3], [3, 3, 3], [4, 12, 7], spec=spec)
    plan = proposer._drafting_rows(sched, inputs)
    assert plan is not None and plan.served.tolist() == [0, 1]  # h_3 and h_11 are kept
    assert plan.hidden is not None and plan.hidden.flatten().tolist() == [100.0, 4.0]
    assert plan.positions.tolist() == [4, 12, 7] and plan.own.tolist() == [1004, 2012, 3007]
    # the worker dropped seq 2: its state goes with it
    proposer.runner.batch.seqs.pop(2)  # type: ignore[attr-defined]
    sched, inputs = _step([1], [1], [4])
    proposer.after_step(sched, inputs, torch.tensor([[200.0]]))
    assert set(proposer._kept) == {1}


def test_unserved_sampled_rows_get_point_masses_on_their_repeated_token():
    proposer = _runner(live={1, 2})
    finished = {}
    proposer._finish = lambda *args: finished.setdefault("args", args)  # type: ignore[method-assign]
    plan = DraftingRows(
        index=np.array([0, 1]),
        num_drafts=np.array([2, 2]),
        base=np.array([1, 1]),
        positions=np.array([5, 9]),
        own=torch.tensor([3, 7]),
        served=np.array([0]),
        hidden=torch.zeros(1, 4),
    )
    tokens = torch.tensor([[1, 2], [7, 7]])  # row 1 is unserved: its own token twice
    probs = torch.zeros(2, 2, 10)
    probs[0, :, 1:3] = 0.5
    proposer._finish_rows(None, None, plan, tokens, probs)
    assert probs[1].tolist() == torch.nn.functional.one_hot(torch.tensor([7, 7]), 10).tolist()
    assert probs[0].sum().item() == 2.0  # a served row's q is left as drawn
    passed = finished["args"][2:]  # _finish(sched, inputs, drafting, nd, base, tokens, probs)
    assert all(
        a is b for a, b in zip(passed, (plan.index, plan.num_drafts, plan.base, tokens, probs))
    )
