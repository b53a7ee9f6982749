"""batch_invariant=True: a sequence's tokens and logprobs are bit-identical whatever else runs.

The same greedy prompt (logprobs on) runs alone, then inside batches of 1 to 33 other requests
of random lengths placed before and after it (its prompt then shares steps, chunks of the token
budget, attention groups and matmul tiles with them; from the second run on it also hits the
prefix cache). Without the mode the CPU GEMMs change their reduction order with the number of
rows, so the same check fails on the default model.

Both kernel sets are checked: the CPU backend's (default model), and the Triton kernels'
(paged_kernels.matmul / rms_norm / logsumexp / paged_attention in its batch_invariant mode),
here in Triton's interpreter on a tiny Qwen3 and, GPU-marked, natively on CUDA in bfloat16.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch

from paged_engine import LLM, SamplingParams
from paged_engine.default_model import DEFAULT_MODEL_NAME, default_model_path


@pytest.fixture
def default_model() -> str:
    try:
        default_model_path()
    except RuntimeError as exc:
        pytest.skip(f"default model missing: {exc}")
    return DEFAULT_MODEL_NAME


PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
TRITON_PARAMS = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=3)


def run_inside(
    llm: LLM,
    target: list[int],
    num_others: int,
    rng: random.Random,
    vocab: int = 10000,
    longest: int = 120,
    params: SamplingParams = PARAMS,
):
    """(token ids, logprobs as (id, logprob) lists) of `target` among `num_others` prompts of
    5 to `longest` random tokens."""
    others = [
        {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(rng.randint(5, longest))]}
        for _ in range(num_others)
    ]
    half = num_others // 2
    prompts = [*others[:half], {"prompt_token_ids": target}, *others[half:]]
    out = llm.generate(prompts, params, use_tqdm=False)[half].outputs[0]
    logprobs = [sorted((k, v.logprob) for k, v in step.items()) for step in out.logprobs]
    return out.token_ids, logprobs


def batch_variation(
    model: str,
    batch_invariant: bool,
    sizes: tuple[int, ...],
    longest: int = 120,
    vocab: int = 10000,
    budget: int = 512,
) -> Iterator[int]:
    """Batch sizes whose result for the target differs from the target run alone, lazily (a
    caller after one such size stops at it)."""
    llm = LLM(
        model=model,
        dtype="float32",
        device="cpu",
        max_model_len=512,
        max_num_batched_tokens=budget,  # prompts get chunked inside big batches
        batch_invariant=batch_invariant,
    )
    rng = random.Random(0)
    target = [rng.randrange(3, vocab) for _ in range(100)]
    kw = {"longest": longest, "vocab": vocab}
    alone = run_inside(llm, target, 0, rng, **kw)
    return (n for n in sizes if run_inside(llm, target, n, rng, **kw) != alone)


# 33 others of 5..60 tokens: ~1,100 prompt tokens over three 512-token steps (prompts chunked
# at the borders)
CPU_SIZES, CPU_LONGEST = (1, 5, 33), 60


def test_logprobs_bit_identical_in_any_batch(default_model):
    assert list(batch_variation(default_model, True, CPU_SIZES, CPU_LONGEST)) == []


def test_without_the_mode_batches_change_the_logprobs(default_model):
    """The check above can fail: on its workload the plain CPU path differs in at least one
    batch (the first one found ends the run)."""
    assert next(batch_variation(default_model, False, CPU_SIZES, CPU_LONGEST), None) is not None


@pytest.mark.parametrize("arch", ["gemma2", "bloom"])
def test_softcapped_and_alibi_attention_bit_identical_in_any_batch(tiny_model_factory, arch):
    """Gemma 2's soft-capped attention and BLOOM's ALiBi run the CPU backend's explicit float32
    path (not the fixed-order SDPA one): it too gives the target its logprobs in any batch."""
    model = str(tiny_model_factory(arch))
    assert list(batch_variation(model, True, (1, 9), longest=40, vocab=512, budget=64)) == []


def triton_variation(
    model_dir,
    batch_invariant: bool,
    sizes,
    longest: int = 12,
    target_len: int = 16,
    budget: int = 24,
    params: SamplingParams = TRITON_PARAMS,
    **options,
):
    """`batch_variation` on the Triton path, for a tiny model (512-token vocabulary). In the
    interpreter every token is a program of each launch: short prompts, a small budget."""
    llm = LLM(
        model=str(model_dir),
        attention_backend="triton",
        max_model_len=256,
        max_num_batched_tokens=budget,  # the target's prompt is chunked in big batches
        batch_invariant=batch_invariant,
        **options,
    )
    rng = random.Random(1)
    target = [rng.randrange(3, 512) for _ in range(target_len)]
    # 2 tokens: the target's chunked prompt and a decode step (which reads the prompt's KV and
    # its own from the cache), each slow in the interpreter (the same cost whatever the rows)
    kw = {"vocab": 512, "longest": longest, "params": params}
    alone = run_inside(llm, target, 0, rng, **kw)
    return alone, [n for n in sizes if run_inside(llm, target, n, rng, **kw) != alone]


def test_triton_kernels_logprobs_bit_identical_in_any_batch(tiny_model_factory):
    """Triton's interpreter on CPU, float32. The same values as the plain engine up to
    rounding (greedy tokens identical); and without the mode the check fails."""
    model_dir = tiny_model_factory("qwen3")
    (tokens, logprobs), varied = triton_variation(model_dir, True, (1, 6), dtype="float32")
    assert varied == []
    (plain_tokens, plain_logprobs), plain_varied = triton_variation(
        model_dir, False, (4,), dtype="float32"
    )
    assert plain_varied != []
    assert tokens == plain_tokens
    for step, plain_step in zip(logprobs, plain_logprobs):
        assert [k for k, _ in step] == [k for k, _ in plain_step]
        assert [v for _, v in step] == pytest.approx([v for _, v in plain_step], abs=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3", "gpt2"])
def test_gpu_logprobs_bit_identical_in_any_batch(tiny_model_factory, arch):
    """Natively on CUDA in bfloat16 (cuBLAS and torch's reductions vary with the batch there),
    with CUDA graphs on for decode steps."""
    model_dir = tiny_model_factory(arch, hidden_size=256, num_attention_heads=8)
    options = {"dtype": "bfloat16", "device": "cuda"}
    sizes, lengths = (1, 7, 31, 64), {"longest": 120, "target_len": 40, "budget": 64}
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=3)
    _, varied = triton_variation(model_dir, True, sizes, **lengths, params=params, **options)
    assert varied == []


def test_cpu_logsumexp_of_one_row_matches_the_row_in_any_batch():
    """With 2+ threads torch reduces a lone row in two passes split between the threads, and
    every other row count row by row: ~4% of lone rows differ in their last bit (the benchmark
    run that found it: the 15th logprob of a 200-token prompt run alone)."""
    from paged_engine.layers.batch_invariant import cpu_logsumexp

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        gen = torch.Generator().manual_seed(0)
        for _ in range(100):
            x = torch.randn(5, 49152, generator=gen) * 5
            alone = cpu_logsumexp(x[:1])
            assert torch.equal(alone, cpu_logsumexp(x)[:1])
            assert torch.equal(alone, cpu_logsumexp(x[:2])[:1])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"batch_invariant": True, "dtype": "bfloat16"}, "float32 only"),
        ({"batch_invariant": True, "quantization": "int8"}, "does not combine"),
        ({"batch_invariant": 1}, "batch_invariant"),
        ({"batch_invariant": True, "attention_backend": "torch"}, "'cpu' or 'triton'"),
        ({"batch_invariant": True, "tensor_parallel_size": 4}, "tensor_parallel_size <= 2"),
    ],
)
def test_unsupported_settings_are_rejected(tiny_llama_dir, options, match):
    with pytest.raises(ValueError, match=match):
        LLM(model=str(tiny_llama_dir), device="cpu", **options)
