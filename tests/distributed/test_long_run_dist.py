"""Long runs at world size 2 (found by a soak of TP=2 and PP=2 engines against a single-process
reference in the same process): a single-process engine stays a world of 1 while an engine with
ranks (rank 0 in this process) lives beside it, whether it was built before or during that
engine's life; its steps run no collective (they waited forever for the other rank before) and
its layers are unsharded."""

from __future__ import annotations

import random
import threading

import pytest

from paged_engine import LLM, SamplingParams
from paged_engine.distributed.parallel_state import get_parallel_state
from paged_engine.layers.embedding import ParallelLMHead
from paged_engine.testing import write_tiny_model

pytest.importorskip("transformers")

ENGINE = {"dtype": "float32", "max_model_len": 64, "seed": 0}


def _world(worker) -> tuple[int, int, int]:
    """(world size, TP size, the LM head's shard rows) as this engine's worker sees them."""
    state = get_parallel_state()
    model = worker.model_runner.model
    (head,) = [m for m in model.modules() if isinstance(m, ParallelLMHead)]
    return state.world_size, state.tp_size, head.weight.shape[0]


def _within(seconds: float, fn, *args):
    """fn(*args), failing (not hanging) when it waits longer than `seconds`."""
    box: list = []
    thread = threading.Thread(target=lambda: box.append(fn(*args)), daemon=True)
    thread.start()
    thread.join(seconds)
    assert box, f"{fn.__name__} hung (waited {seconds}s)"
    return box[0]


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_a_single_process_engine_beside_a_parallel_one_stays_a_world_of_one(tmp_path, tp, pp):
    path = str(write_tiny_model(tmp_path, "llama", seed=3))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randint(3, 20))] for _ in range(3)]
    before = LLM(model=path, **ENGINE)
    (whole,) = before.collective_rpc(_world)
    want = _tokens(before, prompts)
    parallel = LLM(
        model=path,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        enable_prefix_caching=False,
        **ENGINE,
    )
    try:
        assert _within(20, before.collective_rpc, _world) == [whole] == [(1, 1, whole[2])]
        assert _within(20, _tokens, before, prompts) == want  # no collective: it hung before
        during = LLM(model=path, **ENGINE)
        assert during.collective_rpc(_world) == [whole]  # unsharded layers
        assert _tokens(during, prompts) == want
        assert _tokens(parallel, prompts) == want
        assert _tokens(before, prompts) == want
    finally:
        parallel.llm_engine.shutdown()
    assert _tokens(before, prompts) == want
