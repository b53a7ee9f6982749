"""compilation_config >= 1 on the CPU (worker/cpu_compile.py): the model forward through
torch.compile gives the eager engine's tokens and logprobs (inductor fuses the norms and
elementwise ops, so logprobs agree to float32 rounding, not bit for bit).

Every step shape goes through the compiled graphs: one decode sequence (the static graph),
batched decode, prefill and chunked prefill mixed with decode (the graph with a symbolic token
count)."""

from __future__ import annotations

import logging

import pytest

from paged_engine import LLM, EngineConfig, SamplingParams
from paged_engine.layers.quantization import fp16_gemm_available

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
PROMPTS = [
    {"prompt_token_ids": list(range(10, 10 + n))} for n in (3, 17, 40, 9)
]  # different lengths: decode rows of different contexts share steps


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _run(model_dir, *prompt_sets, **options):
    """One engine generates each prompt set in turn: (llm, runner, [results of each set])."""
    llm = LLM(
        model=str(model_dir),
        device="cpu",
        dtype="float32",
        max_model_len=128,
        max_num_batched_tokens=32,  # the 40-token prompt is chunked beside decode rows
        block_size=8,
        **options,
    )
    graphs = _graphs()
    results = []
    for prompts in prompt_sets:
        outs = llm.generate(prompts, PARAMS, use_tqdm=False)
        results.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
    # Every step shape runs a graph compiled while the engine started: nothing recompiles.
    assert _graphs() == graphs
    return llm, llm.llm_engine.model_runner, results


def _assert_same(got, want):
    """`got` and `want`: lists of prompt sets' results, or one set's."""
    if got and isinstance(got[0], list):
        for got_set, want_set in zip(got, want, strict=True):
            _assert_same(got_set, want_set)
        return
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want, strict=True):
        assert tokens == want_tokens
        for step, want_step in zip(logprobs, want_logprobs, strict=True):
            assert step.keys() == want_step.keys()
            for token, lp in step.items():
                assert lp.logprob == pytest.approx(want_step[token].logprob, abs=1e-4)


# Qwen3 (a Llama with q/k norms) compiles in the int8 test below; Gemma 2 traces its sliding
# window and soft-capped scores into the one-token graph.
@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_compiled_forward_matches_eager(tiny_model_factory, arch):
    model = tiny_model_factory(arch)
    # Then one sequence alone: its prompt's first 16 tokens are cached from the batch, so it
    # prefills one token after a cached context, then decodes, all in the one-token graph.
    _, runner, got = _run(model, PROMPTS, PROMPTS[1:2], compilation_config=3)
    assert runner.compiled is not None
    _, _, want = _run(model, PROMPTS, PROMPTS[1:2])
    _assert_same(got, want)


needs_fp16_gemm = pytest.mark.skipif(not fp16_gemm_available(), reason="no fbgemm fp16 GEMM")
FP16 = {"quantization": "fp16", "compilation_config": 3}


@pytest.fixture(scope="module")
def compiled_fp16_llama(tiny_model_factory):
    """_run over the tiny llama with fp16 weights, compiled: the fp16 case below and the first
    engine of test_engines_of_one_class_keep_their_own_graphs (each engine's compile is most of
    either test's time)."""
    return _run(tiny_model_factory("llama"), PROMPTS, PROMPTS[1:2], **FP16)


@pytest.mark.parametrize(
    ("quantization", "arch"),
    [
        pytest.param("fp16", "llama", marks=needs_fp16_gemm),
        ("int8", "qwen3"),  # a tied head: the int8 head gets a graph of its own
        ("int4", "llama"),
    ],
)
def test_compiled_quantized_weights_match_eager(request, tiny_model_factory, quantization, arch):
    """fbgemm's fp16 GEMM and the int4 kernels run as the opaque paged_engine::linear operator;
    int8 layers trace their single-row GEMV into the graph (on reordered weights) and run the
    operator for more rows."""
    model = tiny_model_factory(arch)
    options = {"quantization": quantization}
    # Then one sequence alone: every decode step (and its logits) is a single-row graph.
    if quantization == "fp16":
        _, runner, got = request.getfixturevalue("compiled_fp16_llama")
    else:
        _, runner, got = _run(model, PROMPTS, PROMPTS[1:2], compilation_config=3, **options)
    assert runner.compiled is not None
    assert (runner.compiled.head is not None) == (quantization == "int8")
    _, _, want = _run(model, PROMPTS, PROMPTS[1:2], **options)
    _assert_same(got, want)


@needs_fp16_gemm
def test_engines_of_one_class_keep_their_own_graphs(tiny_model_factory, compiled_fp16_llama):
    """Guards on modules are dropped, so each engine compiles its own code object: a second
    model of the same class and shapes must not run the first engine's graphs, which name the
    first model's fp16 weights by their operator handles."""
    first = compiled_fp16_llama[0]  # compiled before the second engine, as _run builds it
    graphs = _graphs()
    got_first = [
        (o.outputs[0].token_ids, o.outputs[0].logprobs)
        for o in first.generate(PROMPTS[:2], PARAMS, use_tqdm=False)
    ]
    assert _graphs() == graphs
    second_dir = tiny_model_factory("llama", seed=1)
    second, _, got_second = _run(second_dir, PROMPTS[:2], **FP16)
    _, _, want_second = _run(second_dir, PROMPTS[:2], quantization="fp16")
    _assert_same(got_second, want_second)
    # The first engine still serves with its own graphs after the second compiled.
    again = first.generate(PROMPTS[:2], PARAMS, use_tqdm=False)
    _assert_same([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in again], got_first)
    del second


def test_compiled_fp8_cache_keeps_the_attention_operator(tiny_model_factory):
    """An fp8 cache is not traced (attend_decode covers caches in a float dtype): the decode
    graphs call the operator for it, and the tokens and logprobs equal the eager engine's."""
    model = tiny_model_factory("llama")
    options = {"kv_cache_dtype": "fp8"}
    _, runner, got = _run(model, PROMPTS, PROMPTS[1:2], compilation_config=3, **options)
    assert runner.compiled.single is not None and runner.compiled.decode is not None
    layers = [m for m in runner.model.modules() if hasattr(m, "trace_decode")]
    assert layers and not any(m.trace_decode for m in layers)
    _, _, want = _run(model, PROMPTS, PROMPTS[1:2], **options)
    _assert_same(got, want)


def test_failed_compile_runs_eagerly(tiny_model_factory, monkeypatch, caplog):
    from paged_engine.worker.cpu_compile import CompiledForward

    def broken(self):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(CompiledForward, "compile", broken)
    model = tiny_model_factory("llama")
    with caplog.at_level(logging.WARNING):
        _, runner, got = _run(model, PROMPTS[:2], compilation_config=3)
    assert runner.compiled is None
    assert "torch.compile failed" in caplog.text and "no C++ compiler" in caplog.text
    _, _, want = _run(model, PROMPTS[:2])
    _assert_same(got, want)


@pytest.mark.parametrize(
    ("value", "level"), [(None, 0), (0, 0), (3, 3), ({"level": 1}, 1), ({"mode": 3}, 3)]
)
def test_compilation_config_forms(value, level):
    assert EngineConfig(model="m", compilation_config=value).compilation_level == level


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"compilation_config": 4}, "compilation_config=4 is invalid"),
        ({"compilation_config": "3"}, "compilation_config='3' is invalid"),
        ({"compilation_config": True}, "compilation_config=True is invalid"),
        ({"compilation_config": {"level": 3, "backend": "x"}}, "compilation_config="),
        ({"compilation_config": {}}, "compilation_config="),
        ({"compilation_config": 3, "batch_invariant": True}, "does not combine"),
        ({"compilation_config": 3, "tensor_parallel_size": 2}, "parallelism"),
    ],
)
def test_bad_compilation_config_is_rejected(options, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(model="m", **options)
