"""Weight-only fp16 / int8 / int4 linear layers (layers/quantization.py) on CPU, and fp8 (CUDA's
Triton kernel, run here in the interpreter, and the CPU's dequantizing path)."""

from __future__ import annotations

import random
import shutil

import pytest
import torch
import torch.nn.functional as F
from hf_reference import assert_matches, hf_greedy, load_hf_model

import paged_kernels
from paged_engine import LLM, EngineConfig, SamplingParams
from paged_engine.layers import quantization as quant_layers
from paged_engine.layers.quantization import (
    FUSED_MAX_ROWS,
    Fp16Linear,
    Int4Linear,
    Int8Linear,
    require_fp16_gemm,
)
from paged_engine.testing import write_tiny_model
from paged_kernels import quantize_fp8_per_channel

DTYPES = [torch.float32, torch.bfloat16]


def _fp16_gemm() -> bool:
    try:
        require_fp16_gemm()
    except ValueError:
        return False
    return True


needs_fp16_gemm = pytest.mark.skipif(not _fp16_gemm(), reason="no fbgemm fp16 GEMM (non-x86)")


@needs_fp16_gemm
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp16_weights_compute_in_float32(dtype):
    torch.manual_seed(0)
    w = torch.randn(96, 128)
    bias = torch.randn(96).to(dtype)
    method = Fp16Linear(w.to(dtype), dtype)
    assert method.nbytes() == 96 * 128 * 2
    for rows in (1, 7, 40):
        x = torch.randn(rows, 128).to(dtype)
        got = method.apply(x, bias)
        assert got.shape == (rows, 96) and got.dtype == dtype
        # exactly the float16-rounded weight in float32 arithmetic (up to summation order)
        want = F.linear(x.float(), w.to(dtype).half().float(), bias.float()).to(dtype)
        tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's own rounding
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    # weights beyond float16's range saturate instead of turning into inf
    big = Fp16Linear(torch.full((16, 32), 1e6), torch.float32).apply(torch.ones(1, 32), None)
    assert torch.isfinite(big).all() and big[0, 0].item() == pytest.approx(65504.0 * 32)


def test_fp16_refused_where_fbgemm_is_missing(monkeypatch):
    monkeypatch.setattr(type(torch.backends.quantized), "supported_engines", ["qnnpack"])
    with pytest.raises(ValueError, match="quantization='fp16'"):
        require_fp16_gemm()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cls", [Int8Linear, Int4Linear])
def test_fused_and_dequantized_paths_match_the_dense_matmul(cls, dtype):
    torch.manual_seed(0)
    w = torch.randn(96, 128)
    bias = torch.randn(96).to(dtype)
    method = cls(w.to(dtype), dtype)
    # relative error of the quantized weight: int8 per channel, int4 per group of 32
    tol = 0.02 if cls is Int8Linear else 0.2
    for rows in (1, FUSED_MAX_ROWS, FUSED_MAX_ROWS + 1, 40):
        x = torch.randn(rows, 128).to(dtype)
        got = method.apply(x, bias).float()
        want = F.linear(x.float(), w, bias.float())
        err = (got - want).norm() / want.norm()
        assert got.shape == (rows, 96) and got.dtype == torch.float32
        assert err < tol, (rows, err)
    # both paths compute with the same quantized weight, one row or many at a time
    x = torch.randn(FUSED_MAX_ROWS + 1, 128).to(dtype)
    few = torch.cat([method.apply(x[i : i + 1], None) for i in range(x.shape[0])])
    many = method.apply(x, None)
    diff = (few.float() - many.float()).norm() / many.float().norm()
    assert diff < (1e-5 if dtype == torch.float32 else 1e-2)  # bf16 rounds in other places


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(96, 128), (40, 36), (16, 30)])  # 30: K % 4 != 0
def test_int8_words_layout_computes_the_same_product(shape, dtype):
    """use_words() reorders the int8 weight's columns into int32 words for the compiled GEMV;
    the eager kernels on the reordered weight (activation permuted alike) and the GEMV itself
    give the product of the original layout."""
    torch.manual_seed(0)
    n, k = shape
    w = torch.randn(n, k)
    plain = Int8Linear(w.to(dtype), dtype)
    reordered = Int8Linear(w.to(dtype), dtype)
    reordered.use_words()
    assert (reordered.words is None) == (k % 4 != 0)
    assert reordered.qweight.shape == (n, k) and reordered.nbytes() == plain.nbytes()
    if reordered.words is not None:  # the same bytes, in word order
        assert reordered.words.data_ptr() == reordered.qweight.data_ptr()
        assert sorted(reordered.qweight[0].tolist()) == sorted(plain.qweight[0].tolist())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for rows in (1, FUSED_MAX_ROWS, 40):
        x = torch.randn(rows, k).to(dtype)
        torch.testing.assert_close(reordered.run(x), plain.run(x), rtol=tol, atol=tol)
    if reordered.words is not None:  # the traced GEMV, run eagerly here (plain torch ops)
        x = torch.randn(1, k).to(dtype)
        want = F.linear(x.float(), plain.qweight.float()) * plain.scales.float()
        got = reordered._gemv(x)
        assert got.shape == (1, n) and got.dtype == dtype
        torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


def test_int4_dequantize_reproduces_exact_grid_weights():
    # a weight on the int4 grid of each group (min + q * scale) comes back exactly
    q = torch.randint(0, 16, (8, 64)).float()
    q[:, ::32] = 0
    q[:, 1::32] = 15  # every group spans the full range
    w = q * 0.5 - 3.0
    torch.testing.assert_close(Int4Linear(w, torch.float32).dequantize(torch.float32), w)


@pytest.mark.parametrize(
    "quantization", [pytest.param("fp16", marks=needs_fp16_gemm), "int8", "int4"]
)
def test_engine_generates_close_to_dense(tiny_llama_dir, quantization):
    prompts = [{"prompt_token_ids": [5, 9, 3, 7, 11, 2, 8]}, {"prompt_token_ids": [4, 4, 6]}]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    kw = dict(model=str(tiny_llama_dir), device="cpu", dtype="float32")
    dense = LLM(**kw).generate(prompts, params, use_tqdm=False)
    llm = LLM(quantization=quantization, **kw)
    runner = llm.llm_engine.model_runner
    assert all(p.dtype != torch.int8 for p in runner.model.parameters())  # weights left params
    quant = llm.generate(prompts, params, use_tqdm=False)
    for d, q in zip(dense, quant, strict=True):
        assert len(q.outputs[0].token_ids) == 6
        # the first token's logprob of the dense choice stays close
        tok = d.outputs[0].token_ids[0]
        lp_dense = d.outputs[0].logprobs[0][tok].logprob
        lp_quant = q.outputs[0].logprobs[0].get(tok)
        assert lp_quant is not None and abs(lp_quant.logprob - lp_dense) < 0.5
        if quantization == "fp16":  # float32 arithmetic on weights off by <= 2**-11
            assert q.outputs[0].token_ids == d.outputs[0].token_ids
            for entry_q, entry_d, t in zip(
                q.outputs[0].logprobs, d.outputs[0].logprobs, tok_ids(d)
            ):
                assert abs(entry_q[t].logprob - entry_d[t].logprob) < 2e-3


@needs_fp16_gemm
def test_fp16_layers_packed_side_by_side_match_one_by_one(tiny_llama_dir, monkeypatch):
    """With several torch threads fp16 layers pack in a thread pool: the same products as
    packed one by one, and every dense weight freed."""
    import copy

    from paged_engine.layers.linear import LinearBase

    llm = LLM(model=str(tiny_llama_dir), device="cpu", dtype="float32")
    model = llm.llm_engine.model_runner.model
    copies, threads = [copy.deepcopy(model), copy.deepcopy(model)], torch.get_num_threads()
    pools = []
    pool_cls = quant_layers.ThreadPoolExecutor
    monkeypatch.setattr(
        quant_layers, "ThreadPoolExecutor", lambda n: pools.append(n) or pool_cls(n)
    )
    try:
        for n, m in zip((1, 2), copies, strict=True):
            torch.set_num_threads(n)
            quant_layers.quantize_model(m, "fp16")
    finally:
        torch.set_num_threads(threads)
    assert pools == [2]  # one thread: one by one; two: a pool of two
    pairs = [
        (a, b)
        for a, b in zip(copies[0].modules(), copies[1].modules(), strict=True)
        if isinstance(a, LinearBase)
    ]
    assert len(pairs) > 4 and all(a.weight is None and b.weight is None for a, b in pairs)
    for a, b in pairs:
        x = torch.randn(3, a.linear_method.method.shape[1])
        assert torch.equal(a.linear_method.apply(a, x, None), b.linear_method.apply(b, x, None))


def tok_ids(out) -> list[int]:
    return out.outputs[0].token_ids


def test_quantization_option_is_validated():
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int3")


def _fp8_rounded_copy(src, dst):
    """`src` with every linear weight (each expert's too) replaced by its per-row FP8 values
    (what quantization="fp8" multiplies by), the LM head, router and embeddings left alone."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    state = load_file(str(src / "model.safetensors"))
    for name, t in state.items():
        if t.dim() == 2 and name.endswith("_proj.weight"):
            q, scale = quantize_fp8_per_channel(t)
            state[name] = q.float() * scale[:, None]
    save_file(state, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_fp8_weights_give_hf_tokens_on_their_values(tmp_path, monkeypatch, arch, kernel):
    """quantization="fp8": every linear layer's weight, and a MoE's experts, held as
    float8_e4m3fn with a scale per output row (the head and the router stay dense), multiplied
    by the CPU's dequantizing path or by the CUDA path's Triton kernels (in the interpreter):
    HF's greedy tokens on a model holding those values, logprobs within 1e-3."""
    from paged_engine.layers import fused_moe

    if kernel == "triton" and (torch.cuda.is_available() or not paged_kernels.triton_available()):
        pytest.skip("Triton's interpreter, CPU only")
    monkeypatch.setattr(quant_layers, "TRITON_ON_CPU", kernel == "triton")
    monkeypatch.setattr(fused_moe, "TRITON_ON_CPU", kernel == "triton")
    src = write_tiny_model(tmp_path / arch, arch, seed=4)
    llm = LLM(model=str(src), device="cpu", dtype="float32", quantization="fp8")
    model = llm.llm_engine.model_runner.model
    methods = [m.linear_method.method for m in model.modules() if getattr(m, "linear_method", None)]
    assert methods and all(isinstance(m, quant_layers.Fp8Linear) for m in methods)
    assert methods[0].qweight.dtype == torch.float8_e4m3fn
    assert model.lm_head.linear_method is None
    experts = [m for m in model.modules() if isinstance(m, fused_moe.FusedMoE)]
    assert all(e.fp8 is not None and e.gate_up_proj is None for e in experts)
    assert bool(experts) == (arch == "qwen3_moe")
    hf = load_hf_model(_fp8_rounded_copy(src, tmp_path / "rounded"))
    rng = random.Random(kernel + arch)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (4, 23)]
    # the interpreter runs each layer's kernels program by program: there a prefill (27 rows:
    # 32-row tiles) and two decode steps (2 rows: 16-row tiles)
    n = 3 if kernel == "triton" else 8
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert_matches(f"fp8 {arch} {kernel}", out, hf_greedy(hf, prompt, n))
