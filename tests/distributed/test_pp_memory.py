"""Pipeline parallelism (2 gloo stages on the CPU) holds a bounded number of async sends: a
gloo send's work completes only in wait(), so the buffers of every hidden state and every last
stage output stayed queued for the engine's life (rank 1's RSS grew with each step) until a
later step proved them received and released them."""

from __future__ import annotations

import random

import pytest

from paged_engine import LLM, SamplingParams
from paged_engine.distributed.communication import pending_sends, sends_mark
from paged_engine.testing import write_tiny_model

pytest.importorskip("transformers")

PP = 2


def _sends(worker) -> tuple[int, int]:
    """(async sends this rank still holds, async sends it made)."""
    return pending_sends(), sends_mark()


def test_pipeline_async_sends_stay_bounded(tmp_path):
    path = write_tiny_model(tmp_path, "llama", seed=3)
    llm = LLM(
        model=str(path),
        pipeline_parallel_size=PP,
        dtype="float32",
        max_model_len=128,
        block_size=16,
        num_gpu_blocks_override=12,  # preemptions and recomputes too
        max_num_batched_tokens=32,
        max_num_seqs=6,
        seed=0,
    )
    try:
        rng = random.Random(0)
        for wave in range(4):
            prompts = [
                {"prompt_token_ids": [rng.randrange(3, 200) for _ in range(rng.randint(3, 40))]}
                for _ in range(6)
            ]
            sp = SamplingParams(temperature=0.8, seed=wave, max_tokens=16, ignore_eos=True)
            outs = llm.generate(prompts, sp, use_tqdm=False)
            assert all(len(o.outputs[0].token_ids) == 16 for o in outs)
        (held0, made0), (held1, made1) = llm.collective_rpc(_sends)
    finally:
        llm.llm_engine.shutdown()
    # rank 1 (the last stage) sends each step's output as two messages (length, bytes); the
    # sends of at most PP + 1 steps are held, however many steps ran
    assert made1 >= 100, made1
    assert held1 <= 2 * (PP + 1), (held1, made1)
    # rank 0 sends each step's broadcast (2 messages, empty steps' too) and its hidden states
    assert made0 >= 150, made0
    assert held0 <= 4 * (PP + 1), (held0, made0)
