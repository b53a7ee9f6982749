"""A request that outgrows the KV pool is named under pipeline micro-batching (2 gloo stages on
the CPU), as in one process, instead of thrashing forever.

`big` (n=4 sampled sequences past a one-block prompt) needs 1 + 4 * 2 = 9 blocks of a pool of 8
once its sequences pass 32 tokens. With two micro-batches, the fillers are admitted while its
step is in flight and hold the blocks it needs next: it preempts them mid-flight, then itself,
and is readmitted for a recompute chunk that fits. `SchedulerStuckError`'s "nothing planned,
nothing in flight" test never fires there; before the fix each cycle of five steps let a filler
gain one token, and `big` was named only once the fillers had finished (~200 steps, ~70
preemptions)."""

from __future__ import annotations

import pytest

from paged_engine import LLM, SamplingParams
from paged_engine.core.scheduler import SchedulerStuckError
from paged_engine.testing import write_tiny_model

pytest.importorskip("transformers")

ENGINE = {
    "dtype": "float32",
    "max_model_len": 64,
    "block_size": 16,
    "num_gpu_blocks_override": 9,  # 8 usable blocks (less the null block)
    "max_num_batched_tokens": 24,
    "max_num_seqs": 8,
    "pipeline_parallel_size": 2,
}
MAX_STEPS = 120  # fixed: ~80 steps; a thrash takes over 200
FILLER_TOKENS = 19  # 45 + 19 = max_model_len


def test_request_outgrowing_the_pool_is_named_under_micro_batching(tmp_path):
    path = write_tiny_model(tmp_path, "llama", seed=3)
    llm = LLM(model=str(path), **ENGINE)
    eng = llm.llm_engine
    try:
        big = SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=30, ignore_eos=True)
        eng.add_request("big", {"prompt_token_ids": list(range(10, 26))}, big)
        filler = SamplingParams(temperature=0, max_tokens=FILLER_TOKENS, ignore_eos=True)
        finished: dict[str, list[int]] = {}
        named: list[str] = []
        for step in range(MAX_STEPS):
            if step == 25:  # once `big`'s sequences hold 6 of the 8 blocks
                for i in range(2):
                    prompt = [(7 * i + j) % 150 + 5 for j in range(45)]
                    eng.add_request(f"f{i}", {"prompt_token_ids": prompt}, filler)
            if step > 25 and not (eng.has_unfinished_requests() or eng.can_step()):
                break
            try:
                outs = eng.step()
            except SchedulerStuckError as e:
                named += e.request_ids
                eng.abort_request(e.request_ids)
                continue
            finished.update({o.request_id: o.outputs[0].token_ids for o in outs if o.finished})
        else:
            pytest.fail(
                f"not done in {MAX_STEPS} steps: named {named}, finished {sorted(finished)}, "
                f"{eng.scheduler.num_preemptions} preemptions"
            )
        assert named == ["big"]
        assert sorted(finished) == ["f0", "f1"]
        assert all(len(t) == FILLER_TOKENS for t in finished.values())
        assert eng.scheduler.num_preemptions <= 4
    finally:
        eng.shutdown()
