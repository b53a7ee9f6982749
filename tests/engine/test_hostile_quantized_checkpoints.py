"""Broken or hostile quantized checkpoints: a `quantization_config` field or one layer's
quantized tensor altered so that config and tensors disagree (bits, group_size, desc_act /
actorder, symmetric, weight_block_size, a scale of another shape, a NaN scale, a packed tensor of
another dtype, a bitsandbytes quant_state that is not one). Each must be refused at load with a
ValueError naming the field or tensor, never load other weights silently (a scale broadcast, a
block size guessed, an act-order g_idx ignored) nor fail with a raw IndexError /
ZeroDivisionError. Each tiny checkpoint is written once per module and copied per case.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from checkpoint_copies import load_cpu, quantized_copy
from int_packers import packed_copy
from safetensors.torch import load_file, save_file

from paged_engine.testing import write_tiny_model

pytest.importorskip("transformers")

FP8 = torch.float8_e4m3fn
BLOCK = (48, 40)  # tiles the tiny llama's 64 / 128 rows and columns with ragged edges
LAYER = "model.layers.0.mlp.down_proj"  # [64, 128]


def _is_proj(name: str, t: torch.Tensor) -> bool:
    return t.dim() == 2 and name.endswith("_proj.weight")


def _fp8(kind: str):
    """A quantizer to fp8 with block ([48, 40]) or per-channel scales."""

    def quantize(name: str, w: torch.Tensor):
        (n, k), (bn, bk) = w.shape, BLOCK
        if kind == "block":
            pad = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk)
            pad[:n, :k] = w.abs()
            scale = pad.unflatten(0, (-1, bn)).unflatten(2, (-1, bk)).amax((1, 3)) / 448.0
            full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
        else:
            scale = full = w.abs().amax(1, keepdim=True) / 448.0
        prefix = name.removesuffix(".weight")
        suffix = "weight_scale_inv" if kind == "block" else "weight_scale"
        return {name: (w / full).to(FP8), f"{prefix}.{suffix}": scale}, w

    return quantize


def _bnb(bits: int):
    """A quantizer to bitsandbytes' stored layout (without bitsandbytes): 4-bit codes of a
    16-value book over blocks of 64, or 8-bit rows with their absmax (SCB)."""

    def quantize(name: str, w: torch.Tensor):
        prefix = name.removesuffix(".weight")
        if bits == 8:
            scb = w.abs().amax(1)
            q = torch.round(w / scb[:, None] * 127).to(torch.int8)
            return {name: q, f"{prefix}.SCB": scb}, w
        book = torch.linspace(-1, 1, 16)
        flat = w.reshape(-1)
        absmax = flat.view(-1, 64).abs().amax(1)
        codes = (flat / absmax.repeat_interleave(64))[:, None].sub(book).abs().argmin(1)
        state = {"quant_type": "nf4", "blocksize": 64, "dtype": "float32", "shape": list(w.shape)}
        tensors = {
            name: ((codes[0::2] << 4) | codes[1::2]).to(torch.uint8).unsqueeze(1),
            f"{name}.absmax": absmax,
            f"{name}.quant_map": book,
            f"{name}.quant_state.bitsandbytes__nf4": _json_bytes(state),
        }
        return tensors, w

    return quantize


def _json_bytes(obj) -> torch.Tensor:
    return torch.tensor(list(json.dumps(obj).encode()), dtype=torch.uint8)


_FP8_CONFIGS = {
    "fp8-block": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(BLOCK)},
    "fp8-channel": {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}
        },
    },
}
_BNB_CONFIGS = {
    "bnb-nf4": {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
    "bnb-int8": {"quant_method": "bitsandbytes", "load_in_8bit": True},
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Callable[[str], Path]:
    """kind -> its tiny quantized checkpoint, written on first use."""
    root = tmp_path_factory.mktemp("hostile")
    tiny = write_tiny_model(root / "tiny", "llama", seed=2)
    written: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in written:
            dst = root / kind
            if kind in _FP8_CONFIGS:
                quantizer = _fp8("block" if kind == "fp8-block" else "channel")
                quantized_copy(tiny, dst, _FP8_CONFIGS[kind], quantizer, _is_proj)
            elif kind in _BNB_CONFIGS:
                quantizer = _bnb(8 if kind == "bnb-int8" else 4)
                quantized_copy(tiny, dst, _BNB_CONFIGS[kind], quantizer, _is_proj)
            else:
                packed_copy(tiny, kind, dst)
            written[kind] = dst
        return written[kind]

    return get


def _config(change: Callable[[dict], None]):
    def mutate(path: Path) -> None:
        config = json.loads((path / "config.json").read_text())
        change(config["quantization_config"])
        (path / "config.json").write_text(json.dumps(config))

    return mutate


def _set(key: str, value):
    return _config(lambda q: q.__setitem__(key, value))


def _weights(key: str, value):  # compressed-tensors' group_0 weights
    return _config(lambda q: q["config_groups"]["group_0"]["weights"].__setitem__(key, value))


def _tensor(suffix: str, change: Callable[[torch.Tensor], torch.Tensor]):
    def mutate(path: Path) -> None:
        state = load_file(str(path / "model.safetensors"))
        name = f"{LAYER}.{suffix}"
        state[name] = change(state[name]).contiguous()
        save_file(state, str(path / "model.safetensors"))

    return mutate


def _quant_state(change: Callable[[dict], object]):
    def edit(t: torch.Tensor) -> torch.Tensor:
        state = json.loads(bytes(t.tolist()).decode())
        return _json_bytes(change(state))

    return _tensor("weight.quant_state.bitsandbytes__nf4", edit)


def _without(key: str):
    def change(state: dict) -> dict:
        del state[key]
        return state

    return change


# id -> (checkpoint kind, mutation, what the ValueError must say). Before the fixes each loaded
# other weights silently (wrong values, NaN) or failed with a raw exception.
CASES = {
    # an act-order g_idx dropped because the config says desc_act false: other groups
    "gptq desc_act false with act-order g_idx": (
        "gptq-4bit-act-order",
        _set("desc_act", False),
        r"down_proj\.g_idx: the groups are in activation order.*desc_act",
    ),
    "gptq group_size against scales": (
        "gptq-4bit",
        _set("group_size", 64),
        r"down_proj: scales of 8 groups for 128 inputs, but quantization_config group_size 64",
    ),
    "gptq group_size 0": ("gptq-4bit", _set("group_size", 0), r"gptq group_size 0"),
    "gptq qweight stored as float": (
        "gptq-4bit",
        _tensor("qweight", lambda t: t.float()),
        r"down_proj\.qweight: packed integers stored as torch\.float32",
    ),
    "gptq NaN scales": (
        "gptq-4bit",
        _tensor("scales", lambda t: torch.full_like(t, float("nan"))),
        r"down_proj\.scales: .* must be finite",
    ),
    "gptq qzeros one word wider": (
        "gptq-4bit",
        _tensor("qzeros", lambda t: torch.cat([t, t[:, :1]], 1)),
        r"down_proj: qzeros \(8, 9\) is not 8 words",
    ),
    "gptq tensors read as awq": (
        "gptq-4bit",
        _set("quant_method", "awq"),
        r"qweight \(\d+, \d+\) and qzeros .* are not \d+ words a row",
    ),
    "awq qzeros one word narrower": (
        "awq",
        _tensor("qzeros", lambda t: t[:, :-1]),
        r"down_proj: qweight \(128, 8\) and qzeros \(8, 7\) are not 8 words",
    ),
    "awq qweight one word wider": (
        "awq",
        _tensor("qweight", lambda t: torch.cat([t, t[:, :1]], 1)),
        r"down_proj: qweight \(128, 9\) and qzeros \(8, 8\) are not 8 words",
    ),
    "awq group_size against scales": (
        "awq",
        _set("group_size", 32),
        r"down_proj: scales of 8 groups .* group_size 32 makes 4",
    ),
    "compressed 4-bit words read as 2-bit": (
        "w4a16",
        _weights("num_bits", 2),
        r"down_proj: weight_packed \(64, 16\) does not hold \[64, 128\] in 2-bit",
    ),
    "compressed asymmetric zero points called symmetric": (
        "w4a16-asym-act-order",
        _weights("symmetric", True),
        r"down_proj\.weight_zero_point: nonzero zero points.*symmetric",
    ),
    "compressed act-order g_idx without actorder": (
        "w4a16-asym-act-order",
        _weights("actorder", None),
        r"down_proj\.weight_g_idx: the groups are in activation order.*actorder",
    ),
    "compressed per-channel scale for group strategy": (
        "w4a16",
        _tensor("weight_scale", lambda t: t[:, :1]),
        r"down_proj: scales of 1 groups .* group_size 16 makes 8",
    ),
    "compressed weight_packed stored as float": (
        "w4a16",
        _tensor("weight_packed", lambda t: t.float()),
        r"down_proj\.weight_packed: packed integers stored as torch\.float32",
    ),
    "fp8 weight_block_size zero": (
        "fp8-block",
        _set("weight_block_size", [0, 0]),
        r"weight_block_size \[0, 0\] is not two positive integers",
    ),
    "fp8 weight_block_size one value": (
        "fp8-block",
        _set("weight_block_size", [48]),
        r"weight_block_size \[48\] is not two positive integers",
    ),
    # without it the block size was guessed from the scales' shape (here 32 x 32, not 48 x 40)
    "fp8 block scales without weight_block_size": (
        "fp8-block",
        _config(lambda q: q.pop("weight_block_size")),
        r"names no weight_block_size",
    ),
    "fp8 one scale for a block-scaled weight": (
        "fp8-block",
        _tensor("weight_scale_inv", lambda t: t.reshape(-1)[:1]),
        r"scale of \(1,\) does not tile \[64, 128\] in \[48, 40\] blocks",
    ),
    "fp8 NaN scale": (
        "fp8-channel",
        _tensor("weight_scale", lambda t: t.index_fill(0, torch.tensor([3]), float("nan"))),
        r"NaN or infinite",
    ),
    "fp8 infinite scale": (
        "fp8-channel",
        _tensor("weight_scale", lambda t: torch.full_like(t, float("inf"))),
        r"NaN or infinite",
    ),
    # [1, N]: a transposed per-channel scale, read before as blocks of [64, 2]
    "fp8 per-channel scale transposed": (
        "fp8-channel",
        _tensor("weight_scale", lambda t: t.reshape(1, -1)),
        r"scale of \(1, 64\) for \[64, 128\] is not per tensor, per channel",
    ),
    "bnb quant_map of 8 codes": (
        "bnb-nf4",
        _tensor("weight.quant_map", lambda t: t[:8]),
        r"down_proj\.weight\.quant_map: 8 entries",
    ),
    "bnb blocksize 0": (
        "bnb-nf4",
        _quant_state(lambda s: {**s, "blocksize": 0}),
        r"down_proj\.weight\.quant_state: blocksize 0",
    ),
    "bnb quant_state without shape": (
        "bnb-nf4",
        _quant_state(_without("shape")),
        r"down_proj\.weight\.quant_state: shape None",
    ),
    "bnb quant_state a list": (
        "bnb-nf4",
        _quant_state(lambda s: [1, 2]),
        r"down_proj\.weight\.quant_state: expected a JSON object",
    ),
    "bnb quant_state not JSON": (
        "bnb-nf4",
        _tensor("weight.quant_state.bitsandbytes__nf4", lambda t: t[:5]),
        r"down_proj\.weight\.quant_state: not UTF-8 JSON",
    ),
    "bnb NaN absmax": (
        "bnb-nf4",
        _tensor("weight.absmax", lambda t: torch.full_like(t, float("nan"))),
        r"down_proj\.weight\.absmax: holds NaN",
    ),
    # one SCB for every row: broadcast before
    "bnb int8 one SCB": (
        "bnb-int8",
        _tensor("SCB", lambda t: t[:1]),
        r"down_proj\.SCB: \(1,\) row scales for an int8 weight of \(64, 128\)",
    ),
    "bnb int8 SCB short": (
        "bnb-int8",
        _tensor("SCB", lambda t: t[:-1]),
        r"down_proj\.SCB: \(63,\) row scales",
    ),
    "bnb int8 NaN SCB": (
        "bnb-int8",
        _tensor("SCB", lambda t: torch.full_like(t, float("nan"))),
        r"down_proj\.SCB: holds NaN",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_hostile_quantized_checkpoint_is_refused_naming_it(checkpoints, tmp_path, case):
    kind, mutate, match = CASES[case]
    skip_dense = shutil.ignore_patterns("dense")
    path = shutil.copytree(checkpoints(kind), tmp_path / "q", ignore=skip_dense)
    mutate(path)
    with pytest.raises(ValueError, match=match):
        load_cpu(path)


def test_a_quantization_config_that_is_not_an_object_is_refused(checkpoints, tmp_path):
    """transformers failed on it with a raw AttributeError (`.to_dict()` of an int)."""
    path = shutil.copytree(checkpoints("gptq-4bit"), tmp_path / "q")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": 4}))
    with pytest.raises(ValueError, match=r"config\.json: quantization_config is not a JSON"):
        load_cpu(path)


@pytest.mark.parametrize("kind", ["gptq-4bit", "awq", "w4a16", "fp8-block", "bnb-nf4", "bnb-int8"])
def test_the_unaltered_checkpoints_load(checkpoints, kind):
    """The checks refuse only the altered copies: each original loads."""
    params = dict(load_cpu(checkpoints(kind)).named_parameters())
    assert torch.isfinite(params[f"{LAYER}.weight"]).all()


def test_row_group_scales_without_a_block_size_still_load(checkpoints, tmp_path):
    """[N, G] scales, G dividing K (compressed-tensors' "group" 8-bit weights), need no
    weight_block_size: here each row's scale repeated over 4 groups loads as the original."""
    original = checkpoints("fp8-channel")
    path = shutil.copytree(original, tmp_path / "q", ignore=shutil.ignore_patterns("dense"))
    _tensor("weight_scale", lambda t: t.repeat(1, 4))(path)
    got = dict(load_cpu(path).named_parameters())
    for name, p in load_cpu(original).named_parameters():
        assert torch.equal(p, got[name]), name
