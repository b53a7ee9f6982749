"""int4_linear (paged_kernels/gemm.py): 4-bit group-quantized weights (a scale and a low per 32
inputs) against ref_int4_linear on random inputs (x dtypes, row counts of each tile config, N
and K that are not multiples of the tile, fp32 and bf16 scales), the reference against a dense
weight built by hand from codes, argument checks; GPU-marked: Llama-3.1-8B's shapes.
"""

from __future__ import annotations

import pytest
import torch

from paged_kernels import int4_linear, ref_int4_linear

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = TOL[want.dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] codes 0-15 -> [N, K // 2] uint8, even k in the low nibble."""
    codes = codes.to(torch.uint8)
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def _quantized(n: int, k: int, device, scale_dtype=torch.float32):
    """Random codes with GPTQ-like groups: low = -(about 7.5) * scale, |w| about 1 / sqrt(K)."""
    codes = torch.randint(0, 16, (n, k), device=device)
    scale = (torch.rand(n, k // 32, device=device) + 0.5) / (6 * k**0.5)
    low = -(7.5 + torch.randn(n, k // 32, device=device)) * scale
    return codes, _pack(codes), scale.to(scale_dtype), low.to(scale_dtype)


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 70])  # decode / mid / prefill tiles; 70: 2 M tiles
def test_matches_reference(seed, device, dtype, scale_dtype, rows):
    for n in (16, 40, 96):
        for k in (32, 64, 160):  # 160: a tail of whole groups past every BLOCK_K but 32
            x = torch.randn(rows, k, device=device).to(dtype)
            _, packed, scale, low = _quantized(n, k, device, scale_dtype)
            _close(int4_linear(x, packed, scale, low), ref_int4_linear(x, packed, scale, low))


def test_reference_is_a_dense_linear(seed, device):
    """ref_int4_linear equals x @ dense.T for a weight written out code by code (fp64 product);
    the kernel does too, on a strided x."""
    n, k = 24, 96
    codes, packed, scale, low = _quantized(n, k, device)
    dense = torch.empty(n, k, dtype=torch.float64, device=device)
    for col in range(k):
        g = col // 32
        dense[:, col] = codes[:, col].double() * scale[:, g].double() + low[:, g].double()
    x = torch.randn(5, 2 * k, device=device)[:, k:]
    want = (x.double() @ dense.t()).float()
    torch.testing.assert_close(ref_int4_linear(x, packed, scale, low), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(int4_linear(x, packed, scale, low), want, rtol=1e-5, atol=1e-5)


def test_nibble_order(device):
    """Byte 0x21 holds code 1 at k = 0 (low nibble) and code 2 at k = 1 (high)."""
    packed = torch.zeros(1, 16, dtype=torch.uint8, device=device)
    packed[0, 0] = 0x21
    scale, low = torch.ones(1, 1, device=device), torch.zeros(1, 1, device=device)
    x = torch.zeros(2, 32, device=device)
    x[0, 0], x[1, 1] = 1.0, 1.0
    want = torch.tensor([[1.0], [2.0]], device=device)
    assert torch.equal(ref_int4_linear(x, packed, scale, low), want)
    assert torch.equal(int4_linear(x, packed, scale, low), want)


def test_rejects_bad_arguments(device):
    x = torch.randn(3, 64, device=device)
    _, packed, scale, low = _quantized(16, 64, device)
    with pytest.raises(ValueError, match=r"\(3, 48\): K=48 is not a multiple of 32"):
        int4_linear(x[:, :48], packed[:, :24], scale, low)
    with pytest.raises(ValueError, match=r"packed \(16, 16\) must be \[N, K // 2\] = \[16, 32\]"):
        int4_linear(x, packed[:, :16], scale, low)
    with pytest.raises(ValueError, match=r"scale \(16, 1\) and low \(16, 2\)"):
        int4_linear(x, packed, scale[:, :1], low)
    with pytest.raises(ValueError, match=r"packed must be uint8, got torch\.int8"):
        int4_linear(x, packed.view(torch.int8), scale, low)
    with pytest.raises(ValueError, match="x must be"):
        int4_linear(x.double(), packed, scale, low)
    with pytest.raises(ValueError, match="scale / low must be"):
        int4_linear(x, packed, scale, low.double())
    with pytest.raises(ValueError, match=r"x must be \[M, K\]"):
        int4_linear(x[0], packed, scale, low)
    with pytest.raises(ValueError, match="K=48"):
        ref_int4_linear(x[:, :48], packed[:, :24], scale, low)
    assert int4_linear(x[:0], packed, scale, low).shape == (0, 16)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 64, 2048])
def test_llama_8b_shapes(seed, rows):
    """Llama-3.1-8B's fused gate_up (28672 x 4096) and down (4096 x 14336) in bf16."""
    device, dtype = torch.device("cuda"), torch.bfloat16
    for n, k in ((28672, 4096), (4096, 14336)):
        x = torch.randn(rows, k, device=device, dtype=dtype)
        _, packed, scale, low = _quantized(n, k, device, torch.bfloat16)
        _close(int4_linear(x, packed, scale, low), ref_int4_linear(x, packed, scale, low))
