"""fp8_linear (paged_kernels/gemm.py): FP8 weights with a scale per output channel against
ref_fp8_linear on random inputs (dtypes, row counts of each tile config, K and N that are not
multiples of the tile, bias or not, strided rows), the per-channel quantizer, argument checks;
GPU-marked: Llama-3.1-8B's shapes and a CUDA graph replay.
"""

from __future__ import annotations

import pytest
import torch

from paged_kernels import fp8_linear, quantize_fp8_per_channel, ref_fp8_linear

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = TOL[want.dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("seed", range(4))
def test_per_channel_quantizer(seed):
    """Each row's largest |value| becomes +-448 exactly; values within half of e4m3's step:
    2^-4 relative (3 mantissa bits), or 2^-10 of the row's scale absolute where the scaled
    value is subnormal (below 2^-6); a zero row stays zero with scale 1."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(5, 70, generator=gen) * torch.tensor([1e-3, 1.0, 30.0, 0.0, 7.0])[:, None]
    w[1, :3] = torch.tensor([1e-4, -3e-6, 5e-9])  # scaled: subnormal, subnormal, rounds to 0
    q, scale = quantize_fp8_per_channel(w)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert scale[3] == 1 and not q[3].float().any()
    for row in (0, 1, 2, 4):
        assert q[row].float().abs().max() == 448.0
    back = q.float() * scale[:, None]
    bound = 2**-4 * w.abs() + 2**-10 * scale[:, None]
    assert ((back - w).abs() <= bound).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 9, 40, 100])  # each tile config; 100: several M tiles
def test_matches_reference(seed, device, dtype, rows):
    k, n = 200, 150  # not multiples of any tile
    x = torch.randn(rows, k, device=device).to(dtype)
    q, scale = quantize_fp8_per_channel(torch.randn(n, k, device=device) * k**-0.5)
    bias = torch.randn(n, device=device).to(dtype) if rows % 2 == 0 else None
    _close(fp8_linear(x, q, scale, bias), ref_fp8_linear(x, q, scale, bias))


def test_strided_rows_and_a_dense_equivalent(seed, device):
    """x as a row view of a wider tensor; the result equals a dense linear on the dequantized
    weights (fp32)."""
    wide = torch.randn(7, 96, device=device)
    x = wide[:, 32:]
    q, scale = quantize_fp8_per_channel(torch.randn(48, 64, device=device))
    want = torch.nn.functional.linear(x, q.float() * scale[:, None])
    torch.testing.assert_close(fp8_linear(x, q, scale), want, rtol=1e-4, atol=1e-4)


def test_rejects_bad_arguments(device):
    x = torch.randn(3, 32, device=device)
    q, scale = quantize_fp8_per_channel(torch.randn(16, 32, device=device))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_linear(x, q.float(), scale)
    with pytest.raises(ValueError, match="K=16"):
        fp8_linear(x[:, :16], q, scale)
    with pytest.raises(ValueError, match="scale"):
        fp8_linear(x, q, scale[:8])
    with pytest.raises(ValueError, match="bias"):
        fp8_linear(x, q, scale, torch.zeros(8, device=device))
    assert fp8_linear(x[:0], q, scale).shape == (0, 16)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 64, 2048])
def test_llama_8b_shapes(seed, rows):
    """Llama-3.1-8B's fused gate_up (28672 x 4096) and down (4096 x 14336) in bf16."""
    device, dtype = torch.device("cuda"), torch.bfloat16
    for n, k in ((28672, 4096), (4096, 14336)):
        x = torch.randn(rows, k, device=device, dtype=dtype)
        q, scale = quantize_fp8_per_channel(torch.randn(n, k, device=device) * k**-0.5)
        _close(fp8_linear(x, q, scale), ref_fp8_linear(x, q, scale))


@pytest.mark.gpu
def test_cuda_graph_replay(seed):
    device = torch.device("cuda")
    x = torch.randn(8, 4096, device=device, dtype=torch.bfloat16)
    q, scale = quantize_fp8_per_channel(torch.randn(1024, 4096, device=device))
    fp8_linear(x, q, scale)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_linear(x, q, scale)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(out, fp8_linear(x, q, scale), rtol=0, atol=0)
