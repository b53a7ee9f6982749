"""batch_invariant=True: a sequence's tokens and logprobs are bit-identical whatever else runs.

The same greedy prompt (logprobs on) runs alone, then inside batches of 1 to 64 other requests
of random lengths placed before and after it (its prompt then shares steps, chunks of the token
budget, attention groups and matmul tiles with them). Without the mode the CPU GEMMs change
their reduction order with the number of rows, so the same check fails on the default model.
"""

from __future__ import annotations

import random

import pytest

from paged_engine import LLM, SamplingParams
from paged_engine.default_model import DEFAULT_MODEL_NAME, default_model_path

try:
    default_model_path()
except RuntimeError as exc:
    pytest.skip(f"default model missing: {exc}", allow_module_level=True)

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)


def run_inside(llm: LLM, target: list[int], num_others: int, rng: random.Random):
    """(token ids, logprobs as (id, logprob) lists) of `target` among `num_others` prompts."""
    others = [
        {"prompt_token_ids": [rng.randrange(100, 10000) for _ in range(rng.randint(5, 120))]}
        for _ in range(num_others)
    ]
    half = num_others // 2
    prompts = [*others[:half], {"prompt_token_ids": target}, *others[half:]]
    out = llm.generate(prompts, PARAMS, use_tqdm=False)[half].outputs[0]
    logprobs = [sorted((k, v.logprob) for k, v in step.items()) for step in out.logprobs]
    return out.token_ids, logprobs


def batch_variation(batch_invariant: bool, sizes: tuple[int, ...]) -> list[int]:
    """Batch sizes whose result for the target differs from the target run alone."""
    llm = LLM(
        model=DEFAULT_MODEL_NAME,
        dtype="float32",
        device="cpu",
        max_model_len=512,
        max_num_batched_tokens=512,  # prompts get chunked inside big batches
        batch_invariant=batch_invariant,
    )
    rng = random.Random(0)
    target = [rng.randrange(100, 10000) for _ in range(40)]
    alone = run_inside(llm, target, 0, rng)
    return [n for n in sizes if run_inside(llm, target, n, rng) != alone]


def test_logprobs_bit_identical_in_any_batch():
    assert batch_variation(True, (1, 3, 17, 64)) == []


def test_without_the_mode_batches_change_the_logprobs():
    """The check above can fail: the plain CPU path differs in at least one batch."""
    assert batch_variation(False, (1, 17)) != []


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"batch_invariant": True, "dtype": "bfloat16"}, "float32 only"),
        ({"batch_invariant": True, "quantization": "int8"}, "does not combine"),
        ({"batch_invariant": 1}, "batch_invariant"),
    ],
)
def test_unsupported_settings_are_rejected(tiny_llama_dir, options, match):
    with pytest.raises(ValueError, match=match):
        LLM(model=str(tiny_llama_dir), device="cpu", **options)
