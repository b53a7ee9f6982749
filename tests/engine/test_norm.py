"""RMSNorm against HF's formula (LlamaRMSNorm): the same bits in float32 on CPU, for decode
rows, prompt batches and 3-D inputs; other dtypes and the (weight - 1) checkpoints match too."""

from __future__ import annotations

import pytest
import torch

from paged_engine.layers.norm import RMSNorm


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@pytest.mark.parametrize("shape", [(1, 576), (7, 576), (64, 96), (3, 5, 64), (2, 1000)])
@pytest.mark.parametrize("eps", [1e-6, 1e-5])
def test_float32_bits_equal_hf(shape, eps):
    torch.manual_seed(sum(shape))
    norm = RMSNorm(shape[-1], eps)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1]))
    for scale in (1e-3, 1.0, 300.0):
        x = torch.randn(shape) * scale
        want = hf_rms_norm(x, norm.weight.detach(), eps)
        with torch.inference_mode():
            got = norm(x)
        assert torch.equal(got, want)
        assert torch.equal(got, torch.rms_norm(x, (shape[-1],), norm.weight.detach(), eps))
    with torch.no_grad():  # outside inference mode too (the constants are made once)
        assert torch.equal(norm(x), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_dtypes_and_weight_offset(dtype):
    torch.manual_seed(0)
    x = torch.randn(5, 64).to(dtype)
    norm = RMSNorm(64, 1e-6, weight_offset=1.0)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64) * 0.1)
        got = norm(x)
    want = hf_rms_norm(x, (norm.weight + 1.0).detach(), 1e-6)
    torch.testing.assert_close(got, want)
