"""Multi-LoRA under tensor parallelism (2 gloo ranks on the CPU): each rank packs its shard of
every adapter (B cut by output rows on column-parallel layers, replicated KV heads included; A
cut by input on row-parallel layers, whose shrink is all-reduced) and the outputs are the single
process's: identical greedy tokens, logprobs within 1e-4."""

from __future__ import annotations

import random

import pytest

from paged_engine import LLM, LoRARequest, SamplingParams
from paged_engine.testing import write_lora_adapter, write_tiny_model

pytest.importorskip("transformers")


def _generate(path, prompts, loras, **kwargs):
    llm = LLM(
        str(path),
        dtype="float32",
        max_model_len=128,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        **kwargs,
    )
    try:
        sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
        outs = llm.generate(prompts, sp, lora_request=loras, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    return [
        (
            o.outputs[0].token_ids,
            [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)],
        )
        for o in outs
    ]


def test_adapters_under_tensor_parallelism_match_one_process(tmp_path):
    # One KV head: the two ranks hold the same k / v rows, so each takes the whole k / v of B.
    model = write_tiny_model(tmp_path / "m", "llama", seed=3, num_key_value_heads=1)
    a = write_lora_adapter(tmp_path / "a", model, rank=4, seed=1)
    b = write_lora_adapter(tmp_path / "b", model, rank=8, seed=2)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(3, 30))] for _ in range(5)]
    la, lb = LoRARequest("a", 1, str(a)), LoRARequest("b", 2, str(b))
    loras = [la, lb, None, lb, la]
    want = _generate(model, prompts, loras)
    got = _generate(model, prompts, loras, tensor_parallel_size=2)
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, g), (_, w) in zip(got, want):
        assert g == pytest.approx(w, abs=1e-4)
    assert len({tuple(t) for t, _ in want}) == len(want)  # adapters and base all differ
