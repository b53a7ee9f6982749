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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_norms_match_torch_ops(dtype, device):
    """use_triton_norms (what the Triton backend runs) switches plain RMSNorms, with
    or without a weight offset, and Gemma's (which rounds once, after the weight) to
    paged_kernels.rms_norm with their roundings; the kernel (Triton's interpreter here) matches
    the torch ops on decode rows, prompt rows and per-head [T, H, D] inputs."""
    from paged_engine.layers.norm import GemmaRMSNorm
    from paged_engine.layers.triton_layers import use_triton_norms

    torch.manual_seed(0)
    plain, offset, gemma = RMSNorm(64, 1e-6), RMSNorm(64, 1e-5, weight_offset=1.0), GemmaRMSNorm(64)
    model = torch.nn.ModuleList([plain, offset, gemma]).to(device, dtype)
    with torch.no_grad():
        for m in model:
            m.weight.copy_(torch.randn(64) * 0.5)
    want = {}
    inputs = [torch.randn(1, 64), torch.randn(9, 64) * 30, torch.randn(3, 4, 64)]
    inputs = [x.to(device) for x in inputs]
    with torch.inference_mode():
        for i, x in enumerate(inputs):
            for j, m in enumerate(model):
                want[i, j] = m(x.to(dtype))
        assert use_triton_norms(model) == 3  # Gemma's too, rounding once after the weight
        assert all(m.kernel is not None for m in model)
        for i, x in enumerate(inputs):
            for j, m in enumerate(model):
                got = m(x.to(dtype))
                assert got.dtype == dtype and got.shape == x.shape
                # Triton's interpreter rounds to bf16 its own way (a few bf16 steps apart);
                # the GPU test below holds the kernel to the torch ops' bits on CUDA.
                # (On a CUDA machine the kernel runs natively here, on CUDA tensors.)
                tol = {} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 4e-2}
                torch.testing.assert_close(got, want[i, j], **tol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_triton_norm_bits_match_torch_ops(dtype):
    """On CUDA the kernel rounds as the torch ops do: the same bits on all but a few elements
    (float32 sums in another order), which differ by one step of the dtype."""
    from paged_kernels import rms_norm

    torch.manual_seed(0)
    for rows, width, offset in ((256, 1024, 0.0), (4096, 128, 0.0), (37, 2048, 1.0)):
        norm = RMSNorm(width, 1e-6, weight_offset=offset).to("cuda", dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(width) * 0.5)
        x = (torch.randn(rows, width, device="cuda") * 4).to(dtype)
        with torch.inference_mode():
            want = norm(x)
            got = rms_norm(x, norm.weight, norm.eps, offset)
        differ = (got != want).float().mean().item()
        assert differ < 1e-3, f"{differ:.2%} of the elements differ"
        torch.testing.assert_close(got, want)  # within the dtype's own tolerance elsewhere
