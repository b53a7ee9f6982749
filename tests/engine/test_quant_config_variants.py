"""`quantization_config` variants as real releases write them, beyond the base cases of
test_quantized_checkpoints.py / test_packed_checkpoints.py: a quantized LM head (GPTQ
`lm_head: true`), GPTQModel's `dynamic` exclusions and `modules_in_block_to_quantize`, MoE
experts quantized with the router left alone (Mixtral's w1/w2/w3, Qwen3-MoE under AWQ's
`modules_to_not_convert` and compressed-tensors' regex `ignore`), block FP8 through
compressed-tensors' `block_structure` and DeepSeek-style `fp8`, symmetric 8-bit checkpoints
whose writer kept all-zero zero points, and early GPTQ / AWQ releases whose scheme sits in
quantize_config.json / quant_config.json instead of config.json. Each loads as exactly its
dequantized values (or gives HF's greedy tokens on them); variants we cannot load are refused
before any weight is read, naming the field.
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
from int_packers import _awq, _compressed, _gptq, _quantize

from paged_engine import LLM
from paged_engine.quantized_checkpoint import dequantize
from paged_engine.testing import write_tiny_model

pytest.importorskip("transformers")

FP8 = torch.float8_e4m3fn
GPTQ = {
    "quant_method": "gptq",
    "bits": 4,
    "group_size": 32,
    "desc_act": False,
    "sym": True,
    "checkpoint_format": "gptq",
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("llama"), "llama", seed=2)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe", seed=3)


def _linear(name: str, t: torch.Tensor) -> bool:
    return t.dim() == 2 and name.endswith("_proj.weight")


def _layers(pack):
    """A Quantizer storing `pack(w) -> ({suffix: tensor}, dequantized)` under the layer."""

    def quantize(name: str, w: torch.Tensor):
        tensors, dense = pack(w)
        prefix = name.removesuffix(".weight")
        return {f"{prefix}.{k}": v for k, v in tensors.items()}, dense

    return quantize


def _gptq_copy(src, dst, config: dict, picks=_linear):
    pack = _layers(lambda w: _gptq(w, 4, 32, True, False, "gptq"))
    return quantized_copy(src, dst, config, pack, picks, shuffle="gptq")


def _per_channel(dtype: torch.dtype, zero_point: int | None = None, scale_name="weight_scale"):
    """A Quantizer to 8-bit `dtype` with one scale a row; `zero_point`: also store a
    `weight_zero_point` of that value (older compressed-tensors kept them)."""

    def quantize(name: str, w: torch.Tensor):
        scale = w.abs().amax(1, keepdim=True) / (127.0 if dtype == torch.int8 else 448.0)
        q = w / scale
        q = q.round().clamp(-127, 127).to(dtype) if dtype == torch.int8 else q.to(dtype)
        prefix = name.removesuffix(".weight")
        tensors = {name: q, f"{prefix}.{scale_name}": scale}
        if zero_point is not None:
            tensors[f"{prefix}.weight_zero_point"] = torch.full(
                scale.shape, zero_point, dtype=torch.int8
            )
        return tensors, dequantize(q, scale, None)

    return quantize


def _w8a8(kind: str) -> dict:
    """llm-compressor's W8A8 (int) / FP8-dynamic (float) config: dynamic per-token
    activations, the router and head left alone by a regex `ignore`."""
    return {
        "quant_method": "compressed-tensors",
        "format": f"{kind}-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": kind, "strategy": "channel", "symmetric": True},
                "input_activations": {
                    "num_bits": 8,
                    "type": kind,
                    "strategy": "token",
                    "dynamic": True,
                    "symmetric": True,
                },
            }
        },
        "ignore": ["lm_head", "re:.*mlp.gate$"],
    }


def _block_fp8(block: tuple[int, int], scale_name: str):
    """A Quantizer to fp8 with one scale per [bn, bk] block (ragged at the edges)."""

    def quantize(name: str, w: torch.Tensor):
        (n, k), (bn, bk) = w.shape, block
        pad = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk)
        pad[:n, :k] = w.abs()
        scale = pad.unflatten(0, (-1, bn)).unflatten(2, (-1, bk)).amax((1, 3)) / 448.0
        q = (w / scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]).to(FP8)
        return {name: q, f"{name.removesuffix('.weight')}.{scale_name}": scale}, dequantize(
            q, scale, block
        )

    return quantize


def test_a_gptq_quantized_lm_head_loads_and_runs_as_codes(tiny, tmp_path):
    """GPTQ `lm_head: true` (GPTQModel): the head's qweight / qzeros / scales load as its
    dequantized values, dense and through the int4 codes path."""

    def picks(name, t):
        return _linear(name, t) or name == "lm_head.weight"

    path, dense = _gptq_copy(tiny, tmp_path / "q", {**GPTQ, "lm_head": True}, picks)
    assert_same_params(path, dense)
    want = LLM(model=str(dense), dtype="float32", max_model_len=64)
    codes = LLM(model=str(path), dtype="float32", max_model_len=64, quantization="int4")
    prompt = [{"prompt_token_ids": [5, 6, 7, 9, 11, 40, 41]}]
    from paged_engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    a = codes.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    b = want.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert a.token_ids == b.token_ids
    for la, lb in zip(a.logprobs, b.logprobs, strict=True):
        assert all(abs(lp.logprob - lb[t].logprob) < 1e-4 for t, lp in la.items())


@pytest.mark.parametrize(
    "extra, skipped",
    [
        ({"dynamic": {r"-:.*mlp\.down_proj": {}}}, ("down_proj",)),
        (
            {
                "modules_in_block_to_quantize": [
                    ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
                    ["mlp.up_proj"],
                ]
            },
            ("o_proj", "gate_proj", "down_proj"),
        ),
    ],
)
def test_gptq_modules_left_unquantized_load_as_they_are(tiny, tmp_path, extra, skipped):
    def picks(name, t):
        return _linear(name, t) and not any(s in name for s in skipped)

    path, dense = _gptq_copy(tiny, tmp_path / "q", {**GPTQ, **extra}, picks)
    assert_same_params(path, dense)


def test_gptq_dynamic_overrides_give_layers_their_own_bits(tiny, tmp_path):
    """GPTQModel's mixed-precision `dynamic`: "+:" patterns (re.match on the layer's name, the
    first match winning) give down_proj 8 bits in groups of 64 and the MLP's other layers 2
    bits, "-:" leaves o_proj unquantized; every layer unpacks with its own bits."""
    dynamic = {
        r"-:.*o_proj": {},
        r"+:.*down_proj": {"bits": 8, "group_size": 64},
        r"+:.*mlp\.": {"bits": 2},
    }

    def pack(name: str, w: torch.Tensor):
        bits, group = (8, 64) if "down_proj" in name else (2, 32) if ".mlp." in name else (4, 32)
        tensors, dense = _gptq(w, bits, group, True, False, "gptq")
        prefix = name.removesuffix(".weight")
        return {f"{prefix}.{k}": v for k, v in tensors.items()}, dense

    def picks(name, t):
        return _linear(name, t) and "o_proj" not in name

    config = {**GPTQ, "dynamic": dynamic}
    path, dense = quantized_copy(tiny, tmp_path / "q", config, pack, picks, shuffle="dyn")
    assert_same_params(path, dense)
    llm = LLM(model=str(path), dtype="float32", max_model_len=128)
    assert_generates_like_hf(llm, dense, "gptq-dynamic")


def _autogptq_pack_3bit(values: torch.Tensor) -> torch.Tensor:
    """AutoGPTQ's 3-bit packing of int values [R, C] along R (R a multiple of 32), written as
    its packer loops: per 32 rows, 10 values a word and one straddling into the next, three
    words in all -> int32 [R * 3 / 32, C]."""
    v = values.to(torch.int64)
    out = torch.zeros(v.shape[0] // 32 * 3, v.shape[1], dtype=torch.int64)
    i = row = 0
    while row < out.shape[0]:
        for j in range(10):
            out[row] |= v[i + j] << (3 * j)
        i += 10
        out[row] |= (v[i] << 30) & 0xFFFFFFFF
        row += 1
        out[row] |= (v[i] >> 2) & 1
        i += 1
        for j in range(10):
            out[row] |= v[i + j] << (3 * j + 1)
        i += 10
        out[row] |= (v[i] << 31) & 0xFFFFFFFF
        row += 1
        out[row] |= (v[i] >> 1) & 3
        i += 1
        for j in range(10):
            out[row] |= v[i + j] << (3 * j + 2)
        i += 10
        row += 1
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


@pytest.mark.parametrize("desc_act", [False, True])
def test_3bit_gptq_unpacks_autogptqs_bit_stream(tiny, tmp_path, desc_act):
    """TheBloke's `gptq-3bit-*` branches: 3-bit codes and zero points (stored minus one), 32
    of them in three words; also with act-order (g_idx)."""

    def pack(name: str, w: torch.Tensor):
        perm = torch.randperm(w.shape[1], generator=torch.Generator().manual_seed(5))
        q, zero, scale, g = _quantize(w, 3, 32, False, perm if desc_act else None)
        prefix = name.removesuffix(".weight")
        tensors = {
            "qweight": _autogptq_pack_3bit(q.t()),  # [K * 3 / 32, N]
            "qzeros": _autogptq_pack_3bit(zero - 1).t().contiguous(),  # [G, N * 3 / 32]
            "scales": scale.t().contiguous(),
            "g_idx": g.to(torch.int32),
        }
        dense = (q - zero[:, g]).float() * scale.float()[:, g]
        return {f"{prefix}.{k}": v for k, v in tensors.items()}, dense

    config = {**GPTQ, "bits": 3, "desc_act": desc_act, "sym": False}
    path, dense = quantized_copy(tiny, tmp_path / "q", config, pack, _linear, shuffle="3bit")
    assert_same_params(path, dense)
    if desc_act:
        llm = LLM(model=str(path), dtype="float32", max_model_len=128)
        assert_generates_like_hf(llm, dense, "gptq-3bit")


def test_mixtral_experts_packed_by_gptq(tmp_path):
    """Mixtral's experts (w1 / w2 / w3) packed, its router (block_sparse_moe.gate) not."""
    src = write_tiny_model(tmp_path / "mixtral", "mixtral", seed=3)

    def picks(name, t):
        return t.dim() == 2 and (name.endswith("_proj.weight") or ".experts." in name)

    path, dense = _gptq_copy(src, tmp_path / "q", GPTQ, picks)
    assert_same_params(path, dense)


def test_moe_experts_quantized_router_left_alone(moe, tmp_path):
    """Qwen3-MoE under AWQ (`modules_to_not_convert` naming the router) and W4A16 (a regex
    `ignore` naming it): the experts' packed weights and the router's plain one."""
    awq = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 16,
        "zero_point": True,
        "version": "GEMM",
        "modules_to_not_convert": ["mlp.gate"],
    }
    path, dense = quantized_copy(
        moe, tmp_path / "awq", awq, _layers(lambda w: _awq(w, 16)), _linear
    )
    assert_same_params(path, dense)
    w4a16 = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"},
            }
        },
        "ignore": ["lm_head", "re:.*mlp.gate$"],
    }
    pack = _layers(lambda w: _compressed(w, 4, 16, True, False))
    path, dense = quantized_copy(moe, tmp_path / "w4a16", w4a16, pack, _linear)
    assert_same_params(path, dense)


def test_block_fp8_in_both_spellings(tiny, moe, tmp_path):
    """compressed-tensors' `strategy: block` with `block_structure` (scales `weight_scale`) on
    a dense model, and DeepSeek-style `fp8` with `weight_block_size` and dynamic activations
    (scales `weight_scale_inv`) on an MoE one."""
    block = (48, 40)
    config = _w8a8("float")
    weights = config["config_groups"]["group_0"]["weights"]
    weights.update(strategy="block", block_structure=list(block))
    path, dense = quantized_copy(
        tiny, tmp_path / "ct", config, _block_fp8(block, "weight_scale"), _linear
    )
    assert_same_params(path, dense)
    fp8 = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [32, 32],
    }
    quantize = _block_fp8((32, 32), "weight_scale_inv")
    path, dense = quantized_copy(moe, tmp_path / "fp8", fp8, quantize, _linear)
    assert_same_params(path, dense)


@pytest.mark.parametrize("kind, dtype", [("int", torch.int8), ("float", FP8)])
def test_symmetric_8bit_weights_with_zero_zero_points_load(tiny, tmp_path, kind, dtype):
    """compressed-tensors before 0.9 kept a symmetric scheme's weight_zero_point (all zero)
    beside each 8-bit weight: dropped, the weight gives HF's tokens on its values; a nonzero
    one (an asymmetric scheme) is refused naming it."""
    path, dense = quantized_copy(
        tiny, tmp_path / "zp", _w8a8(kind), _per_channel(dtype, zero_point=0), _linear
    )
    assert_same_params(path, dense)
    if kind == "int":
        llm = LLM(model=str(path), dtype="float32", max_model_len=128)
        assert_generates_like_hf(llm, dense, "w8a8")
    bad, _ = quantized_copy(
        tiny, tmp_path / "nz", _w8a8(kind), _per_channel(dtype, zero_point=3), _linear
    )
    with pytest.raises(ValueError, match=r"weight_zero_point: asymmetric"):
        load_cpu(bad)


def _move_quant_config(path, filename: str, quant: dict):
    """The checkpoint as early releases shipped it: the scheme beside config.json, not in it."""
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))
    (path / filename).write_text(json.dumps(quant))


def test_early_gptq_and_awq_releases_read_their_quantize_config(tiny, tmp_path):
    """AutoGPTQ's quantize_config.json (no quant_method in it) and AutoAWQ's quant_config.json
    (w_bit, q_group_size, version "GEMM") name the scheme where config.json does not: they
    load as their dequantized values, also with vLLM's quantization="gptq" named."""
    path, dense = _gptq_copy(tiny, tmp_path / "gptq", GPTQ)
    old = {k: v for k, v in GPTQ.items() if k not in ("quant_method", "checkpoint_format")}
    _move_quant_config(path, "quantize_config.json", {**old, "damp_percent": 0.01})
    assert_same_params(path, dense)
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, quantization="gptq")
    assert_generates_like_hf(llm, dense, "gptq-sidecar")

    awq = {"quant_method": "awq", "bits": 4, "group_size": 16, "version": "gemm"}
    path, dense = quantized_copy(
        tiny, tmp_path / "awq", awq, _layers(lambda w: _awq(w, 16)), _linear
    )
    autoawq = {"zero_point": True, "q_group_size": 16, "w_bit": 4, "version": "GEMM"}
    _move_quant_config(path, "quant_config.json", autoawq)
    assert_same_params(path, dense)


def test_unsupported_variants_are_refused_naming_the_field(tiny, tmp_path):
    ct = {"quant_method": "compressed-tensors"}
    cases = [
        ({**GPTQ, "bits": 5}, "5-bit"),
        ({**GPTQ, "dynamic": {r"+:.*down_proj": {"desc_act": True}}}, "per-module desc_act"),
        (
            {**GPTQ, "dynamic": {r"+:.*down_proj": {"bits": 5}}},
            r"override '\+:\.\*down_proj': 5-bit",
        ),
        ({**GPTQ, "pack_dtype": "int16"}, "pack_dtype 'int16'"),
        ({"quant_method": "awq", "bits": 4, "version": "GEMV"}, "version 'gemv'"),
        ({**ct, "format": "mixed-precision"}, "format 'mixed-precision'"),
        ({**ct, "format": "nvfp4-pack-quantized"}, "format 'nvfp4-pack-quantized'"),
        (
            {
                "quant_method": "bitsandbytes",
                "load_in_4bit": True,
                "bnb_4bit_quant_storage": "bfloat16",
            },
            "bnb_4bit_quant_storage",
        ),
    ]
    for i, (quant, match) in enumerate(cases):
        with pytest.raises(ValueError, match=match):
            load_cpu(copy_with_quant_config(tiny, tmp_path / str(i), quant))
    # a sidecar quantize_config.json is refused the same way
    path = copy_with_quant_config(tiny, tmp_path / "sidecar", GPTQ)
    _move_quant_config(path, "quantize_config.json", {**GPTQ, "bits": 5})
    with pytest.raises(ValueError, match="5-bit"):
        load_cpu(path)
