"""Review of the session's commits (64b9b89..85f328a): regressions the original tests missed.

- spec_decode/eagle.py `_forward_head`: a head with a plain rope (no `mrope_section`) on a
  text target drafts without any per-sequence Python lookup of its rows (the M-RoPE commit
  mapped every pass's sequences through `batch.row_of` one by one, on every EAGLE step); an
  M-RoPE head (Qwen3.5's MTP layer) on a batch without images makes no M-RoPE positions either.
"""

from __future__ import annotations

import pytest

from paged_engine import LLM, SamplingParams
from paged_engine.spec_decode import eagle
from paged_engine.testing import write_tiny_eagle_head, write_tiny_model

pytestmark = pytest.mark.usefixtures("no_isolated_step_failures")  # conftest.py


class _CountingRows(dict):
    """batch.row_of, counting the lookups made while a proposer runs."""

    lookups = 0

    def __getitem__(self, key):
        type(self).lookups += 1
        return super().__getitem__(key)


def test_plain_rope_eagle_head_does_no_per_sequence_row_lookups(tmp_path) -> None:
    target = write_tiny_model(tmp_path / "target", "llama")
    head = write_tiny_eagle_head(tmp_path / "head", target, seed=1)
    spec = {"method": "eagle", "model": str(head), "num_speculative_tokens": 3}
    llm = LLM(
        str(target), dtype="float32", max_model_len=128, block_size=8, speculative_config=spec
    )
    runner = llm.llm_engine.model_runner
    draft = runner.draft
    assert not draft.mrope
    propose = draft.propose
    proposals = 0

    def counted(sched, cached, inputs):
        nonlocal proposals
        plain, runner.batch.row_of = runner.batch.row_of, _CountingRows(runner.batch.row_of)
        try:
            out = propose(sched, cached, inputs)
            proposals += bool(out.tokens)
            return out
        finally:
            runner.batch.row_of = plain

    draft.propose = counted
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 9, 2)]
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert proposals > 0
    assert _CountingRows.lookups == 0

    # as an M-RoPE head sees a batch without images (no sequence has a table): no positions made
    made = []

    def counting_positions(*args):
        made.append(1)
        return args[-1]

    draft.mrope = True
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(eagle, "target_rope_positions", counting_positions)
        again = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert again == plain
    assert not made
