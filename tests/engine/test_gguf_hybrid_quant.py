"""Quantized GGUF files of the hybrid models, as llama.cpp makes them (gguf_writer.py:
convert_hf_to_gguf.py --outtype q8_0, or llama-quantize Q4_K_M / Q6_K of the F32 file): the
tensors llama.cpp keeps F32 stay F32, the others are stored Q8_0 / Q4_K / Q6_K or the fallback
types of rows that are not whole blocks (Q5_0, Q8_0, F16). Our loader must give back the
dequantized weights bit for bit, through the transforms that move quantized rows / columns
(Qwen3.5's tiled value heads, Qwen3-Next's split in_proj_qkvz, Granite's split input_linear),
and LLM(model=<file>.gguf) HF's greedy tokens and logprobs with those weights loaded.

Tiny models of hidden size 256 make the K-quants possible (ggml's 256-value super-blocks run along
rows); at 64 most matrices fall back as llama-quantize falls back."""

from __future__ import annotations

import pytest
import torch

from paged_engine.gguf import GGUFFile, gguf_weights
from paged_engine.gguf.dequant import type_name

gguf = pytest.importorskip("gguf")

from gguf_writer import dequantized_reference, hybrid_tensor_types, write_gguf  # noqa: E402  (needs gguf)
from hf_reference import assert_file_logprobs_match_hf  # noqa: E402
from test_gguf_hybrid import CASES as QWEN_LFM2  # noqa: E402
from test_gguf_mamba import CASES as MAMBA  # noqa: E402
from test_models import load_hf  # noqa: E402

_WIDE = {"hidden_size": 256, "intermediate_size": 256}
# id -> (tiny arch, config overrides, quant, ggml types the file must hold)
CASES = {
    # Q8_0; the shared expert's down projection (48 columns) falls back to F16
    "qwen3_next-q8_0": ("qwen3_next", QWEN_LFM2["qwen3_next"], "q8_0", {"Q8_0", "F16"}),
    # Q4_K_M: in_proj_qkvz stored as attn_qkv (Q6_K on use_more_bits layers, else Q4_K) and
    # attn_gate (Q4_K); experts' down projections (32 columns) -> Q8_0 / Q5_0
    "qwen3_next-q4_k_m": (
        "qwen3_next",
        {**QWEN_LFM2["qwen3_next"], **_WIDE},
        "q4_k_m",
        {"Q4_K", "Q6_K", "Q5_0", "Q8_0", "F16"},
    ),
    # tiled value heads in attn_qkv / attn_gate rows and ssm_out columns (64: Q5_0)
    "qwen3_5-q4_k_m": (
        "qwen3_5",
        {**QWEN_LFM2["qwen3_5"], **_WIDE},
        "q4_k_m",
        {"Q4_K", "Q6_K", "Q5_0"},
    ),
    "qwen3_5-q8_0": ("qwen3_5", QWEN_LFM2["qwen3_5"], "q8_0", {"Q8_0"}),
    "qwen3_5_moe-q6_k": (
        "qwen3_5_moe",
        {**QWEN_LFM2["qwen3_5_moe"], **_WIDE},
        "q6_k",
        {"Q6_K", "Q8_0", "F16"},
    ),
    # tied embeddings: token_embd takes the output's type (Q8_0: rows of 64)
    "lfm2-q4_k_m": ("lfm2", QWEN_LFM2["lfm2"], "q4_k_m", {"Q8_0", "Q5_0"}),
    "lfm2_moe-q8_0": ("lfm2_moe", QWEN_LFM2["lfm2_moe"], "q8_0", {"Q8_0"}),
    # input_linear split into gate / up (experts and shared MLP), its 48-wide down -> F16
    "granitemoehybrid-q4_k_m": (
        "granitemoehybrid",
        {**MAMBA["granitemoehybrid"][1], **_WIDE, "mamba_d_head": 64},
        "q4_k_m",
        {"Q4_K", "Q6_K", "F16"},
    ),
    "granitemoehybrid-dense-q8_0": (
        "granitemoehybrid",
        MAMBA["granitemoehybrid-dense"][1],
        "q8_0",
        {"Q8_0"},
    ),
    "nemotron_h-q4_k_m": (
        "nemotron_h",
        {**MAMBA["nemotron_h"][1], **_WIDE},
        "q4_k_m",
        {"Q4_K", "Q6_K", "Q5_0"},
    ),
    "nemotron_h-moe-q8_0": ("nemotron_h", MAMBA["nemotron_h-moe"][1], "q8_0", {"Q8_0"}),
}


def _always_f32(tensor: str) -> bool:
    """Never quantized by llama.cpp (convert_hf_to_gguf.py / llama-quant.cpp): norms, convs,
    routers, A / D, biases (dt's among them)."""
    part = tensor.split(".", 2)[-1] if tensor.startswith("blk.") else tensor
    return (
        tensor.endswith(("norm.weight", ".bias"))
        or part in ("ssm_a", "ssm_d")
        or part.startswith(("ssm_conv1d.", "shortconv.conv.", "ffn_gate_inp"))
    )


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tiny_model_factory, tmp_path_factory):
    """(case, gguf path, HF model dir, expected HF-named weights, names to match exactly)."""
    name = request.param
    arch, overrides, quant, _ = CASES[name]
    src = tiny_model_factory(arch, **overrides)
    path = tmp_path_factory.mktemp(name) / f"{name}.gguf"
    exact: set[str] = set()
    expected = write_gguf(src, path, arch, quant=quant, exact=exact)
    return name, path, src, expected, exact


def test_types_as_llama_cpp_stores_them(case):
    name, path, *_ = case
    f = GGUFFile(path)
    types = {t: type_name(info.ggml_type) for t, info in f.tensors.items()}
    assert set(types.values()) >= CASES[name][3] | {"F32"}
    for tensor, kind in types.items():
        if _always_f32(tensor):
            assert kind == "F32", tensor
        elif kind == "F32":  # only vectors otherwise
            assert len(f.tensors[tensor].shape) == 1 or 1 in f.tensors[tensor].shape, tensor
        block = {"Q4_K": 256, "Q6_K": 256, "Q5_0": 32, "Q8_0": 32}.get(kind, 1)
        assert f.tensors[tensor].shape[-1] % block == 0, tensor


def test_weights_are_the_dequantized_ones(case):
    _, path, _, expected, exact = case
    got = dict(gguf_weights(GGUFFile(path)))
    assert got.keys() == expected.keys()
    assert len(exact) > len(expected) // 3
    for key, want in expected.items():
        if key in exact:  # dequantized (then moved) by us as by the gguf package: bit for bit
            assert torch.equal(got[key].float(), want), key
        else:  # A_log (stored -exp) and the +1 norms round in float32
            torch.testing.assert_close(got[key].float(), want, atol=1e-6, rtol=1e-6, msg=key)


def test_llm_matches_hf_on_the_dequantized_weights(case, tmp_path):
    """LLM(model=<file>.gguf) against HF loaded with the weights the file holds."""

    name, path, src, expected, _ = case
    ref_dir = dequantized_reference(src, tmp_path / "dequantized", expected)
    assert_file_logprobs_match_hf(name, path, load_hf(ref_dir), seed=3)


def test_fallback_types_follow_llama_quant():
    """tensor_type_fallback and the Q4_K_M choices on shapes of a tiny hybrid."""
    cfg = {"num_hidden_layers": 8}
    tensors = [
        ("token_embd.weight", (512, 256)),
        ("blk.0.attn_qkv.weight", (192, 256)),  # use_more_bits(0, 2) is False: Q4_K
        ("blk.1.attn_qkv.weight", (192, 256)),  # use_more_bits(1, 2): Q6_K (>= 7 * 2 / 8)
        ("blk.0.ffn_down.weight", (256, 256)),  # layer 0 of 8: Q6_K
        ("blk.3.ffn_down.weight", (256, 256)),  # the 3rd FFN_DOWN (no experts: counted): Q4_K
        ("blk.0.ssm_out.weight", (256, 64)),  # Q4_K -> Q5_0
        ("blk.0.ffn_down_shexp.weight", (256, 48)),  # Q4_K -> Q5_0 -> F16
        ("blk.0.ssm_conv1d.weight", (192, 4)),
        ("blk.0.ssm_norm.weight", (2, 64)),
        ("blk.0.ssm_a", (8, 1)),
        ("blk.0.ffn_gate_inp.weight", (8, 256)),
        ("blk.0.ffn_gate_inp_shexp.weight", (1, 256)),  # one ggml dim
    ]
    got = hybrid_tensor_types(tensors, "q4_k_m", cfg)
    assert got == {
        "token_embd.weight": "Q6_K",  # tied (no output.weight): the output's type
        "blk.0.attn_qkv.weight": "Q4_K",
        "blk.1.attn_qkv.weight": "Q6_K",
        "blk.0.ffn_down.weight": "Q6_K",
        "blk.3.ffn_down.weight": "Q4_K",
        "blk.0.ssm_out.weight": "Q5_0",
        "blk.0.ffn_down_shexp.weight": "F16",
        "blk.0.ssm_conv1d.weight": "F32",
        "blk.0.ssm_norm.weight": "F32",
        "blk.0.ssm_a": "F32",
        "blk.0.ffn_gate_inp.weight": "F32",
        "blk.0.ffn_gate_inp_shexp.weight": "F32",
    }
    q8 = hybrid_tensor_types(tensors, "q8_0", cfg)
    assert q8["blk.0.ffn_down_shexp.weight"] == "F16" and q8["blk.0.ssm_out.weight"] == "Q8_0"
    assert q8["blk.0.ffn_gate_inp_shexp.weight"] == "F32"


def test_fused_halves_of_different_types(tiny_model_factory, tmp_path):
    """Granite's input_linear stored as an F16 gate and a Q8_0 up (llama-quantize Q6_K with
    --tensor-type ffn_gate=f16): the fused weight keeps both halves' values."""
    src = tiny_model_factory("granitemoehybrid", **MAMBA["granitemoehybrid-dense"][1])
    path = tmp_path / "mixed.gguf"
    exact: set[str] = set()
    expected = write_gguf(
        src, path, "granitemoehybrid", quant="q6_k", exact=exact, tensor_types={"ffn_gate": "F16"}
    )
    f = GGUFFile(path)
    assert type_name(f.tensors["blk.0.ffn_gate.weight"].ggml_type) == "F16"
    assert type_name(f.tensors["blk.0.ffn_up.weight"].ggml_type) == "Q8_0"
    got = dict(gguf_weights(f))
    key = "model.layers.0.shared_mlp.input_linear.weight"
    assert key in exact
    assert got[key].dtype == torch.float32 and torch.equal(got[key], expected[key])


def test_two_to_four_bit_types_load_as_hf(tiny_model_factory, tmp_path):
    """The types of llama-quantize's smaller mixes (Q2_K, Q3_K_S/M/L: Q2_K / Q3_K; IQ4_NL,
    IQ4_XS), each stored in some matrices (--tensor-type): the loader gives their dequantized
    values bit for bit and LLM(model=<file>.gguf) HF's tokens on those weights."""
    src = tiny_model_factory("qwen3_5", **{**QWEN_LFM2["qwen3_5"], **_WIDE})
    path = tmp_path / "low-bit.gguf"
    types = {
        "ffn_gate": "Q2_K",
        "ffn_up|attn_qkv": "Q3_K",
        "ffn_down": "IQ4_XS",
        "ssm_out|attn_output": "IQ4_NL",  # rows of 64: IQ4_NL's blocks are 32
    }
    exact: set[str] = set()
    expected = write_gguf(src, path, "qwen3_5", quant="q4_k_m", exact=exact, tensor_types=types)
    f = GGUFFile(path)
    stored = {type_name(info.ggml_type) for info in f.tensors.values()}
    assert {"Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS", "Q4_K"} <= stored
    got = dict(gguf_weights(f))
    assert len(exact) > len(expected) // 3
    for key in exact:
        assert torch.equal(got[key].float(), expected[key]), key
    ref_dir = dequantized_reference(src, tmp_path / "dequantized", expected)
    assert_file_logprobs_match_hf("qwen3_5-low-bit", path, load_hf(ref_dir), seed=3)
