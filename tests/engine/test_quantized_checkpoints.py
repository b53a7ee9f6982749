"""FP8 / INT8 weight-quantized checkpoints (quantized_checkpoint.py): Qwen3-FP8's block scales,
llm-compressor's per-channel / per-tensor fp8 and int8, fbgemm's fp8. Each tiny checkpoint is
quantized here; its weights must load as exactly their dequantized values, and the engine must
give HF's greedy tokens (logprobs within 1e-3) on a copy holding those values unquantized.
Quantizations we cannot load fail before any weight is read, naming the method. GPTQ, AWQ and
packed integers: test_packed_checkpoints.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from checkpoint_copies import (
    assert_generates_like_hf,
    assert_same_params,
    copy_with_quant_config,
    load_cpu,
    quantized_copy,
)

from paged_engine import LLM
from paged_engine.loader import load_hf_config, load_model, resolve_model
from paged_engine.quantized_checkpoint import dequantize, fp8_checkpoint
from paged_engine.testing import write_tiny_model

pytest.importorskip("transformers")

FP8 = torch.float8_e4m3fn
BLOCK = (48, 40)  # tiles the tiny shapes (64, 128, 32 rows / columns) with ragged edges

# name -> (quantization_config, weight dtype, scale: "block" | "channel" | "tensor", scale name)
SCHEMES = {
    "fp8-block": (
        {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(BLOCK)},
        FP8,
        "block",
        "weight_scale_inv",
    ),
    "compressed-fp8-channel": (
        {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {
                "group_0": {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}
            },
            "ignore": ["lm_head"],
        },
        FP8,
        "channel",
        "weight_scale",
    ),
    "compressed-int8-tensor": (
        {
            "quant_method": "compressed-tensors",
            "format": "int-quantized",
            "config_groups": {
                "group_0": {"weights": {"num_bits": 8, "type": "int", "strategy": "tensor"}}
            },
        },
        torch.int8,
        "tensor",
        "weight_scale",
    ),
    "fbgemm-fp8": ({"quant_method": "fbgemm_fp8"}, FP8, "channel", "weight_scale"),
    "modelopt-fp8": (
        {"quant_method": "modelopt", "quant_algo": "FP8"},
        FP8,
        "tensor",
        "weight_scale",
    ),
}


def _quantize(w: torch.Tensor, dtype: torch.dtype, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q, scale) with q * scale ~ w; the largest |w| of each group maps to the
    format's largest value."""
    top = 448.0 if dtype == FP8 else 127.0
    n, k = w.shape
    if kind == "tensor":
        scale = w.abs().max().reshape(1) / top
        full = scale.expand(n, k)
    elif kind == "channel":
        scale = w.abs().amax(1, keepdim=True) / top
        full = scale.expand(n, k)
    else:
        bn, bk = BLOCK
        pad = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk)
        pad[:n, :k] = w.abs()
        scale = pad.unflatten(0, (-1, bn)).unflatten(2, (-1, bk)).amax((1, 3)) / top
        full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    q = w / full
    q = q.to(dtype) if dtype == FP8 else q.round().clamp(-127, 127).to(dtype)
    return q, scale


def _is_linear(name: str, t: torch.Tensor) -> bool:
    return t.dim() == 2 and name.endswith("_proj.weight")


def _quantized_copy(src, scheme: str, dst):
    """`src` with its linear weights quantized by `scheme` (plus an activation scale the loader
    must drop), and beside it `dst/dense`: the same model holding the dequantized values."""
    config_quant, dtype, kind, scale_name = SCHEMES[scheme]

    def quantize(name: str, w: torch.Tensor):
        q, scale = _quantize(w, dtype, kind)
        prefix = name.removesuffix(".weight")
        tensors = {name: q, f"{prefix}.{scale_name}": scale, f"{prefix}.input_scale": torch.ones(1)}
        return tensors, dequantize(q, scale, BLOCK if kind == "block" else None)

    return quantized_copy(src, dst, config_quant, quantize, _is_linear)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("llama"), "llama", seed=2)


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_weights_load_as_their_dequantized_values(tiny, tmp_path, scheme):
    path, dense = _quantized_copy(tiny, scheme, tmp_path / scheme)
    got, want = dict(load_cpu(path).named_parameters()), dict(load_cpu(dense).named_parameters())
    assert got.keys() == want.keys()
    for name, p in got.items():
        assert torch.equal(p, want[name]), name
    unquantized = dict(load_cpu(tiny).named_parameters())
    name = "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(got[name], unquantized[name])  # really quantized
    torch.testing.assert_close(got[name], unquantized[name], atol=0.1, rtol=0.1)


@pytest.mark.parametrize("scheme", ["fp8-block", "compressed-int8-tensor"])
def test_generation_matches_hf_on_the_dequantized_weights(tiny, tmp_path, scheme):
    path, dense = _quantized_copy(tiny, scheme, tmp_path / scheme)
    llm = LLM(model=str(path), dtype="float32", max_model_len=128)
    assert_generates_like_hf(llm, dense, scheme)


def test_per_expert_moe_weights_dequantize(tmp_path):
    """Qwen3-30B-A3B-FP8's layout: every expert's matrices quantized by block."""
    src = write_tiny_model(tmp_path / "moe", "qwen3_moe", seed=3)
    path, dense = _quantized_copy(src, "fp8-block", tmp_path / "q")
    assert_same_params(path, dense)


def test_unsupported_quantizations_fail_naming_them(tiny, tmp_path):
    cases = [
        ({"quant_method": "hqq"}, "'hqq' is not supported"),
        ({"quant_method": "gptq", "bits": 5}, "5-bit"),
        ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "NVFP4"),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "pack-quantized"),
        (
            {
                "quant_method": "compressed-tensors",
                "config_groups": {"g": {"weights": {"num_bits": 8, "symmetric": False}}},
            },
            "asymmetric",
        ),
    ]
    for i, (quant, match) in enumerate(cases):
        with pytest.raises(ValueError, match=match):
            load_cpu(copy_with_quant_config(tiny, tmp_path / str(i), quant))


def test_a_quantized_weight_without_its_scale_is_named(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = _quantized_copy(tiny, "fp8-block", tmp_path / "q")
    state = load_file(str(path / "model.safetensors"))
    del state["model.layers.1.self_attn.o_proj.weight_scale_inv"]
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.o_proj\.weight \(no scale\)"):
        load_cpu(path)


def test_fp8_checkpoints_are_told_apart_for_cuda():
    """Which checkpoints run as quantization="fp8" on CUDA: FP8 weights, not INT8 ones."""
    from types import SimpleNamespace

    for scheme, (quant, dtype, _, _) in SCHEMES.items():
        config = SimpleNamespace(quantization_config=quant)
        assert fp8_checkpoint(config) == (dtype == FP8), scheme
    assert not fp8_checkpoint(SimpleNamespace())
    assert not fp8_checkpoint(SimpleNamespace(quantization_config={"quant_method": "mxfp4"}))


def test_per_channel_fp8_codes_survive_bf16_and_requantization(tiny, tmp_path):
    """What CUDA does with an FP8 checkpoint: dequantize into bf16 as it loads, then back to
    FP8 per row (quantization="fp8"). A per-channel checkpoint gets its own codes back."""
    from safetensors.torch import load_file

    from paged_kernels import quantize_fp8_per_channel

    path, _ = _quantized_copy(tiny, "compressed-fp8-channel", tmp_path / "q")
    resolved = resolve_model(str(path))
    model = load_model(resolved, load_hf_config(resolved), dtype=torch.bfloat16, device="cpu")
    state = load_file(str(path / "model.safetensors"))
    params = dict(model.named_parameters())
    name = "model.layers.1.mlp.down_proj.weight"
    codes, _ = quantize_fp8_per_channel(params[name])
    assert torch.equal(codes.view(torch.uint8), state[name].view(torch.uint8))


def test_a_kv_scales_only_checkpoint_still_loads(tiny, tmp_path):
    """llm-compressor's fp8 KV-cache-only checkpoints: compressed-tensors, format "dense",
    unquantized weights plus k / v scales (read by kv_scales.py)."""
    quant = {
        "quant_method": "compressed-tensors",
        "format": "dense",
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"},
    }
    path = copy_with_quant_config(tiny, tmp_path / "kv", quant)
    got = dict(load_cpu(path).named_parameters())
    for name, p in load_cpu(tiny).named_parameters():
        assert torch.equal(p, got[name]), name


def test_fp8_tensors_without_a_quantization_config_are_dequantized(tiny, tmp_path):
    """A checkpoint that names its scheme only in hf_quant_config.json (ModelOpt's): the
    tensors' dtypes tell, and the weights load as their values."""
    path, dense = _quantized_copy(tiny, "modelopt-fp8", tmp_path / "q")
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))
    assert_same_params(path, dense)
