"""NVIDIA Dory and Microsoft BitNet b1.58 against HF transformers.

Dory (tiny_config "dory": 1 input layer, 2 recurrent layers looped 3 times, 2 output layers,
sliding (window 8, shorter than the prompts) and full layers with their own rope bases in each
section): `LLM.generate` gives HF `generate`'s greedy tokens and top-5 logprobs (1e-3, float32)
with one KV cache per loop ("per_loop") and with one cache the loops share ("last_loop"), and
from a checkpoint in the released layout (attention and MLP as separate blocks, some residual
rates negative); TP=2 gives the one-process results (the sub-norms' squares summed over the ranks).

BitNet (tiny_config "bitnet"): HF's plain model, and the online ternary quantization of the
released bf16 master weights (weights ternarized per tensor, activations to 8 bits per token;
tied embeddings as released), the latter also at TP=2 (row maxima over the ranks); packed or
other offline checkpoints are refused by name.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from hf_reference import (
    assert_matches,
    assert_tiny_case_matches_hf,
    assert_tp_matches_one_process,
    hf_greedy,
    load_hf_model,
    random_token_prompts,
)

from paged_engine import LLM, SamplingParams
from paged_engine.testing import tiny_config, write_tiny_model

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

needs_dory = pytest.mark.skipif(
    not hasattr(transformers, "DoryConfig"), reason="transformers has no Dory"
)
needs_bitnet = pytest.mark.skipif(
    not hasattr(transformers, "BitNetConfig"), reason="transformers has no BitNet"
)

BITNET_ONLINE = {
    "quant_method": "bitnet",
    "linear_class": "autobitlinear",
    "quantization_mode": "online",
}


def _engine_matches_hf(case: str, path: Path, hf, seed: int, top: int = 5) -> None:
    """LLM(model=path) gives `hf`'s greedy tokens and top-`top` logprobs on 3 random prompts:
    within 1e-3, or with `top` 0 (8-bit activations) the chosen tokens' within 0.05: float32
    noise that moves an input across a rounding boundary shifts its code by one step (it moved
    one logprob by 0.023 in a run, and swapped near-tied 5th and 6th tokens in another)."""
    prompts = random_token_prompts(seed, 3)
    refs = [hf_greedy(hf, p, 10, top) for p in prompts]
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, ref in zip(outs, refs, strict=True):
        assert_matches(case, out, ref, 1e-3 if top else 0.05)


@needs_dory
@pytest.mark.parametrize("mode", ["per_loop", "last_loop"])
def test_dory_matches_hf(mode: str, tmp_path: Path) -> None:
    # last_loop with biases: o_proj's and down_proj's make their sub-norms bite (without a
    # bias the norm after the sublayer undoes any scale of its input)
    bias = mode == "last_loop"
    overrides = {"recurrent_kv_cache_mode": mode, "attention_bias": bias, "mlp_bias": bias}
    assert_tiny_case_matches_hf(f"dory {mode}", "dory", overrides, tmp_path)


def _released_name(name: str) -> str:
    """HF's saved name -> the released two-block layout (layers.2i: attention, layers.2i+1:
    MLP, each with its residual rate), which transformers' LayerPairCollapse reads."""
    match = re.match(r"backbone\.layers\.(\d+)\.(self_attn|mlp|lambda_1|lambda_2)(.*)", name)
    if match is None:
        return name
    i, part, rest = int(match[1]), match[2], match[3]
    block = {"self_attn": (2 * i, "mixer"), "mlp": (2 * i + 1, "mixer")}.get(part)
    block = block or {"lambda_1": (2 * i, "attn_alpha"), "lambda_2": (2 * i + 1, "mlp_alpha")}[part]
    return f"backbone.layers.{block[0]}.{block[1]}{rest}"


@needs_dory
def test_dory_released_layout_matches_hf(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path, "dory", seed=2)
    weights = safetensors_torch.load_file(path / "model.safetensors")
    assert "backbone.layers.0.self_attn.g_proj.weight" in weights  # HF saves its own names
    released = {_released_name(n): w for n, w in weights.items()}
    assert "backbone.layers.9.mlp_alpha" in released
    for name, w in released.items():  # negative rates (the layer takes their magnitude)
        if name.endswith("_alpha"):
            w[::3] = -w[::3]
    safetensors_torch.save_file(released, path / "model.safetensors", metadata={"format": "pt"})
    _engine_matches_hf("dory released layout", path, load_hf_model(path), seed=7)


@needs_dory
def test_dory_tp2_matches_one_process(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path, "dory", seed=3)
    assert_tp_matches_one_process(path, random_token_prompts(11, 2), 6, 128)


@needs_bitnet
def test_bitnet_matches_hf(tmp_path: Path) -> None:
    assert_tiny_case_matches_hf("bitnet", "bitnet", {}, tmp_path)


def _online_bitnet(tmp_path: Path, seed: int) -> Path:
    """A tiny BitNet as the bf16 masters ship: the online quantization_config, tied head."""
    path = write_tiny_model(tmp_path, "bitnet", seed=seed, tie_word_embeddings=True)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = BITNET_ONLINE
    (path / "config.json").write_text(json.dumps(config))
    return path


@needs_bitnet
def test_bitnet_online_quantization_matches_hf(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")  # HF's BitNet quantizer needs it
    path = _online_bitnet(tmp_path, seed=1)
    # HF's quantizer runs torch.compile'd ops: eager here (the same float32 ops, no compile;
    # config.patch restores the setting, where monkeypatch would delete it)
    with torch._dynamo.config.patch(disable=True):
        hf = load_hf_model(path)
        assert type(hf.model.layers[0].mlp.down_proj).__name__ == "AutoBitLinear"
        _engine_matches_hf("bitnet online", path, hf, seed=5, top=0)


def _pack_ternary(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W as the packed release stores it: its absmean ternary codes + 1, four row blocks a byte
    (block i in bits 2i..2i+1), and the scale the codes are divided by."""
    scale = 1.0 / w.float().abs().mean().clamp(min=1e-5)
    codes = ((w.float() * scale).round().clamp(-1, 1) + 1).to(torch.uint8)
    packed = torch.zeros(codes.shape[0] // 4, codes.shape[1], dtype=torch.uint8)
    for i, block in enumerate(codes.chunk(4, dim=0)):
        packed |= block << (2 * i)
    return packed, scale.reshape(1).to(w.dtype)


def _packed_bitnet(tmp_path: Path, seed: int) -> Path:
    """A tiny BitNet as microsoft/bitnet-b1.58-2B-4T ships: each decoder linear's weight packed
    to 2-bit codes with a weight_scale, quantization_config {bitlinear, offline}."""
    path = write_tiny_model(tmp_path, "bitnet", seed=seed, tie_word_embeddings=True)
    file = path / "model.safetensors"
    weights = safetensors_torch.load_file(file)
    for name in [n for n in weights if n.startswith("model.layers.") and "_proj." in n]:
        packed, scale = _pack_ternary(weights[name])
        weights[name] = packed
        weights[name.replace(".weight", ".weight_scale")] = scale
    safetensors_torch.save_file(weights, file, metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitnet", "linear_class": "bitlinear"}
    (path / "config.json").write_text(json.dumps(config))
    return path


@needs_bitnet
def test_bitnet_unpacking_is_transformers():
    from transformers.integrations.bitnet import unpack_weights

    from paged_engine.quantized_checkpoint import unpack_ternary

    packed = torch.randint(0, 256, (8, 24), dtype=torch.uint8)
    scale = torch.tensor([3.5])
    want = unpack_weights(packed, torch.float32) / scale
    assert torch.equal(unpack_ternary(packed, scale), want)


@needs_bitnet
def test_bitnet_packed_checkpoint_matches_hf(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")  # HF's BitNet quantizer needs it
    path = _packed_bitnet(tmp_path, seed=3)
    with torch._dynamo.config.patch(disable=True):  # an eager reference, as above
        hf = load_hf_model(path)
        assert type(hf.model.layers[0].mlp.down_proj).__name__ == "BitLinear"
        _engine_matches_hf("bitnet packed", path, hf, seed=7, top=0)


@needs_bitnet
def test_bitnet_packed_tp2_matches_one_process(tmp_path: Path) -> None:
    path = _packed_bitnet(tmp_path, seed=4)
    assert_tp_matches_one_process(path, random_token_prompts(17, 2), 6, 128)


@needs_bitnet
def test_bitnet_online_tp2_matches_one_process(tmp_path: Path) -> None:
    path = _online_bitnet(tmp_path, seed=2)
    assert_tp_matches_one_process(path, random_token_prompts(13, 2), 6, 128)


@needs_bitnet
@pytest.mark.parametrize(
    "quant, field",
    [
        ({**BITNET_ONLINE, "quantization_mode": "offline"}, "quantization_mode='offline'"),
        ({"quant_method": "bitnet", "quantization_mode": "online"}, "linear_class='bitlinear'"),
        ({**BITNET_ONLINE, "use_rms_norm": True}, "use_rms_norm"),
        ({**BITNET_ONLINE, "modules_to_not_convert": ["lm_head"]}, "modules_to_not_convert"),
    ],
)
def test_bitnet_refuses_by_name(quant: dict, field: str) -> None:
    from paged_engine.models.bitnet import BitNetForCausalLM

    config = tiny_config("bitnet")
    config.quantization_config = quant
    with pytest.raises(ValueError, match=re.escape(field)):
        BitNetForCausalLM(config)
