"""bitsandbytes checkpoints (bnb_checkpoint.py): `*-bnb-4bit` NF4 / FP4 (with and without double
quantization) and LLM.int8 8-bit. Each tiny checkpoint's linear weights are quantized by
bitsandbytes itself and stored as transformers stores them (`X.weight` plus
`X.weight.absmax`, `X.weight.quant_map`, ..., `X.weight.quant_state.bitsandbytes__nf4`; 8-bit:
`X.SCB`, `X.weight_format`); the weights must load as exactly bitsandbytes' own dequantized
values, and the engine must give HF's greedy tokens on a copy holding them. A hand-packed
checkpoint checks the format without bitsandbytes installed.
"""

from __future__ import annotations

import json

import pytest
import torch
from checkpoint_copies import (
    assert_generates_like_hf,
    assert_loads_as_dense,
    copy_with_quant_config,
    load_cpu,
    quantized_copy,
)

from paged_engine import LLM
from paged_engine.testing import write_tiny_model

pytest.importorskip("transformers")

SCHEMES = {
    "nf4-double": dict(bits=4, quant_type="nf4", double=True, blocksize=64),
    "nf4": dict(bits=4, quant_type="nf4", double=False, blocksize=64),
    # bitsandbytes' own CPU dequantizer blocks each row apart (wrong when a row is not a
    # multiple of the block: it then disagrees with its quantizer and its CUDA kernel), so the
    # reference cases keep rows (64, 128 inputs) whole multiples of the block
    "fp4-block32": dict(bits=4, quant_type="fp4", double=False, blocksize=32),
    "int8": dict(bits=8),
}


def _config(s: dict) -> dict:
    if s["bits"] == 8:
        return {"quant_method": "bitsandbytes", "load_in_8bit": True, "load_in_4bit": False}
    return {
        "quant_method": "bitsandbytes",
        "load_in_4bit": True,
        "load_in_8bit": False,
        "bnb_4bit_quant_type": s["quant_type"],
        "bnb_4bit_use_double_quant": s["double"],
        "bnb_4bit_compute_dtype": "float32",
        "bnb_4bit_quant_storage": "uint8",
        "llm_int8_skip_modules": ["lm_head"],
    }


def _bnb_layer(w: torch.Tensor, s: dict) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """bitsandbytes' tensors for one weight (names after `X.`) and its dequantized values."""
    import bitsandbytes.functional as F

    if s["bits"] == 8:
        cb, scb, _ = F.int8_vectorwise_quant(w.half())
        tensors = {"weight": cb, "SCB": scb, "weight_format": torch.tensor(0, dtype=torch.uint8)}
        return tensors, F.int8_vectorwise_dequant(cb, scb)
    q, state = F.quantize_4bit(
        w,
        blocksize=s["blocksize"],
        quant_type=s["quant_type"],
        compress_statistics=s["double"],
    )
    tensors = {"weight": q}
    tensors.update({f"weight.{k}": v for k, v in state.as_dict(packed=True).items()})
    return tensors, F.dequantize_4bit(q, state).float()


def _is_linear(name: str, t: torch.Tensor) -> bool:
    return t.dim() == 2 and name.endswith("_proj.weight")


def _quantized_copy(src, scheme: str, dst, layer=None):
    """`src` with its linear weights quantized by `layer(weight, scheme)` (bitsandbytes by
    default), and beside it `dst/dense`: the dequantized values; tensors shuffled."""
    s = SCHEMES[scheme]

    def quantize(name: str, w: torch.Tensor):
        tensors, deq = (layer or _bnb_layer)(w, s)
        prefix = name.removesuffix(".weight")
        return {f"{prefix}.{k}": v for k, v in tensors.items()}, deq

    return quantized_copy(src, dst, _config(s), quantize, _is_linear, shuffle=scheme)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("llama"), "llama", seed=2)


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_weights_load_as_bitsandbytes_dequantizes_them(tiny, tmp_path, scheme):
    pytest.importorskip("bitsandbytes")
    path, dense = _quantized_copy(tiny, scheme, tmp_path / scheme)
    assert_loads_as_dense(path, dense, tiny)


NF4_BOOK = [-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0,
            0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.723, 1.0]  # fmt: skip


def _hand_packed(w: torch.Tensor, s: dict) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The 4-bit format written here without bitsandbytes: nearest code of each value over its
    block's absmax; two codes a byte, the first in the high nibble."""
    book = torch.tensor(NF4_BOOK)
    flat = w.reshape(-1).float()
    block = s["blocksize"]
    absmax = flat.view(-1, block).abs().amax(1)
    scaled = flat / absmax.repeat_interleave(block)
    codes = (scaled[:, None] - book[None, :]).abs().argmin(1)
    packed = ((codes[0::2] << 4) | codes[1::2]).to(torch.uint8).unsqueeze(1)
    state = {"quant_type": "nf4", "blocksize": block, "dtype": "float32", "shape": list(w.shape)}
    raw = torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8)
    tensors = {
        "weight": packed,
        "weight.absmax": absmax,
        "weight.quant_map": book,
        "weight.quant_state.bitsandbytes__nf4": raw,
    }
    return tensors, (book[codes] * absmax.repeat_interleave(block)).view(w.shape)


def test_hand_packed_4bit_weightsload_cpu(tiny, tmp_path):
    path, dense = _quantized_copy(tiny, "nf4", tmp_path / "q", layer=_hand_packed)
    assert_loads_as_dense(path, dense, tiny)


@pytest.mark.parametrize("scheme", ["nf4-double", "int8"])
def test_generation_matches_hf_on_the_dequantized_weights(tiny, tmp_path, scheme):
    pytest.importorskip("bitsandbytes")
    path, dense = _quantized_copy(tiny, scheme, tmp_path / scheme)
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, quantization="bitsandbytes")
    assert_generates_like_hf(llm, dense, scheme)


def test_unsupported_settings_fail_naming_them(tiny, tmp_path):
    bnb = {"quant_method": "bitsandbytes"}
    cases = [
        (bnb, "neither load_in_4bit nor load_in_8bit"),
        ({**bnb, "load_in_4bit": True, "bnb_4bit_quant_type": "int4"}, "'int4'"),
        ({**bnb, "load_in_4bit": True, "bnb_4bit_quant_storage": "bfloat16"}, "'bfloat16'"),
    ]
    for i, (quant, match) in enumerate(cases):
        with pytest.raises(ValueError, match=match):
            load_cpu(copy_with_quant_config(tiny, tmp_path / str(i), quant))


def test_a_layer_missing_its_scales_is_named(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = _quantized_copy(tiny, "nf4", tmp_path / "q", layer=_hand_packed)
    state = load_file(str(path / "model.safetensors"))
    del state["model.layers.1.mlp.up_proj.weight.absmax"]
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.up_proj \(has weight, weight\.quant"):
        load_cpu(path)
