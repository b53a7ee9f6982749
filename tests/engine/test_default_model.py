"""The real default model (SmolLM2-135M-Instruct, GGUF Q4_1) against HF transformers' own GGUF
loading of the same file: identical greedy tokens and close logprobs, plain prompts and chat."""

from __future__ import annotations

import pytest
from hf_reference import assert_matches, hf_greedy

from paged_engine import LLM, SamplingParams
from paged_engine.default_model import default_model_path

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")  # transformers needs it to read GGUF; paged does not

try:
    GGUF = default_model_path()
except (FileNotFoundError, RuntimeError) as exc:  # not installed: say how to get it
    pytest.skip(f"default model missing: {exc}", allow_module_level=True)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
]
MAX_TOKENS = 10


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def built() -> dict:
    """What the module's tests share, made on first use: "sync" / "async" -> that mode's
    float32 engine, ("prompts", mode) -> its outputs on PROMPTS, ids -> HF's greedy result."""
    cache: dict = {}
    yield cache
    for key, engine in cache.items():
        if key in ("sync", "async"):
            engine.llm_engine.shutdown()


@pytest.fixture
def llm(built, scheduling) -> LLM:
    """The float32 default model (no model: the built-in default) under the test's scheduling
    mode, one engine a mode (a module-scoped engine is built before the mode is set)."""
    if scheduling not in built:
        built[scheduling] = LLM(
            dtype="float32", max_model_len=512, async_scheduling=scheduling == "async"
        )
    assert built[scheduling].llm_engine.config.async_scheduling == (scheduling == "async")
    return built[scheduling]


@pytest.fixture(scope="module")
def hf(hf_default_model):
    return hf_default_model


def _outputs(built, llm: LLM, scheduling: str) -> list:
    """`llm`'s greedy outputs on PROMPTS, generated once a mode."""
    if ("prompts", scheduling) not in built:
        built["prompts", scheduling] = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return built["prompts", scheduling]


def _check(built, out, model, ids):
    key = tuple(ids)  # HF's reference, the same in both modes: computed once
    if key not in built:
        built[key] = hf_greedy(model, ids, MAX_TOKENS)
    assert_matches("default model", out, built[key])


def test_prompts_match_hf(llm, hf, built, scheduling):
    model, tok = hf
    outs = _outputs(built, llm, scheduling)
    for prompt, out in zip(PROMPTS, outs):
        assert out.prompt_token_ids == tok.encode(prompt)
        _check(built, out, model, out.prompt_token_ids)
        assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)


def test_chat_matches_hf(llm, hf, built):
    model, tok = hf
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    ref_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ref_ids, dict) or hasattr(ref_ids, "input_ids"):
        ref_ids = ref_ids["input_ids"]
    assert out.prompt_token_ids == list(ref_ids)
    _check(built, out, model, out.prompt_token_ids)


def test_auto_dtype_runs_gguf_linears_with_fp16_weights(llm, built, scheduling):
    """With no dtype or quantization chosen, a GGUF checkpoint on an x86 CPU runs its linear
    layers with float16 weights (fbgemm) and float32 arithmetic; dtype="float32" keeps float32
    weights. Both give the same greedy tokens here."""
    from paged_engine.layers.quantization import Fp16Linear, fp16_gemm_available

    def methods(engine: LLM) -> list:
        model = engine.llm_engine.model_runner.model
        return [
            getattr(m.linear_method, "method", None)
            for m in model.modules()
            if hasattr(m, "linear_method")
        ]

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    auto = LLM(max_model_len=512)
    fp32 = llm  # dtype="float32"
    assert all(m is None for m in methods(fp32))
    if fp16_gemm_available():
        assert methods(auto) and all(isinstance(m, Fp16Linear) for m in methods(auto))
    else:
        assert all(m is None for m in methods(auto))
    try:
        got = [o.outputs[0].token_ids for o in auto.generate(PROMPTS, params, use_tqdm=False)]
    finally:
        auto.llm_engine.shutdown()
    want = [o.outputs[0].token_ids for o in _outputs(built, fp32, scheduling)]  # (greedy)
    assert got == want
