"""Checkpoint tensors absent, or present under two names, are refused by name at load.

Found by dropping each tensor of every tiny architecture's checkpoint in turn (and adding each
parameter again under a second name): a fused bias (qkv_proj / gate_up_proj) loaded from
q/k/v or gate/up biases loaded with one of them missing, its rows left uninitialized (HF reports
that bias missing); a parameter or shard filled by two checkpoint tensors (a fused and a split
form, two names a rename maps together, one tensor in two shard files) loaded, the last one
read winning."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch

from paged_engine import loader


def _header(path: Path) -> tuple[dict, bytes]:
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


def _rewrite(path: Path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _load(path: Path) -> None:
    resolved = loader.resolve_model(path)
    config = loader.load_hf_config(resolved)
    loader.load_model(resolved, config, dtype=torch.float32, device="cpu")


def _copy(tiny_model_factory, tmp_path: Path, arch: str) -> Path:
    return Path(shutil.copytree(tiny_model_factory(arch), tmp_path / "model"))


@pytest.mark.parametrize(
    ("arch", "dropped", "match"),
    [
        (
            "qwen2",
            "model.layers.0.self_attn.q_proj.bias",
            r"self_attn.qkv_proj.bias \(shards \['q'\]",
        ),
        ("opt", "model.decoder.layers.1.self_attn.v_proj.bias", r"qkv_proj.bias \(shards \['v'\]"),
        ("ernie4_5", "model.layers.1.mlp.up_proj.bias", r"mlp.gate_up_proj.bias \(shards \['1'\]"),
    ],
    ids=["qkv-q", "qkv-v", "gate_up-up"],
)
def test_a_fused_bias_missing_a_part_is_refused(tiny_model_factory, tmp_path, arch, dropped, match):
    model = _copy(tiny_model_factory, tmp_path, arch)
    file = model / "model.safetensors"
    header, data = _header(file)
    header.pop(dropped)
    _rewrite(file, header, data)
    with pytest.raises(ValueError, match=rf"missing weights .*{match}"):
        _load(model)


def _with_tensor(file: Path, name: str, shape: list[int]) -> None:
    """Append a float32 tensor of 0.5s named `name` to the safetensors `file`."""
    header, data = _header(file)
    extra = torch.full(shape, 0.5).numpy().tobytes()
    header[name] = {
        "dtype": "F32",
        "shape": shape,
        "data_offsets": [len(data), len(data) + len(extra)],
    }
    _rewrite(file, header, data + extra)


@pytest.mark.parametrize(
    ("arch", "source", "second", "match"),
    [
        # a fused qkv beside the q / k / v it is made of
        (
            "llama",
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.self_attn.qkv_proj.weight",
            r"self_attn.[kqv]_proj.weight' and '.*qkv_proj.weight' both load",
        ),
        # transformers 5's fused experts beside the per-expert matrices
        (
            "mixtral",
            "model.layers.1.block_sparse_moe.experts.0.w1.weight",
            "model.layers.1.mlp.experts.gate_up_proj",
            r"both load 'model.layers.1.mlp.experts.gate_up_proj'",
        ),
        # one expert's gate under both its v4 and v5 block names: the same shard twice
        (
            "mixtral",
            "model.layers.0.block_sparse_moe.experts.2.w1.weight",
            "model.layers.0.mlp.experts.2.w1.weight",
            r"both load 'model.layers.0.mlp.experts.gate_up_proj' \(shard \(2, 0\)\)",
        ),
    ],
    ids=["qkv-fused-and-split", "experts-fused-and-split", "expert-shard-twice"],
)
def test_a_parameter_filled_twice_is_refused(
    tiny_model_factory, tmp_path, arch, source, second, match
):
    model = _copy(tiny_model_factory, tmp_path, arch)
    file = model / "model.safetensors"
    resolved = loader.resolve_model(model)
    config = loader.load_hf_config(resolved)
    params = dict(
        loader.load_model(resolved, config, dtype=torch.float32, device="cpu").named_parameters()
    )
    # our fused parameter's shape, or (a second name for one checkpoint tensor) the source's
    shape = list(params[second].shape) if second in params else _header(file)[0][source]["shape"]
    _with_tensor(file, second, shape)
    with pytest.raises(ValueError, match=match):
        _load(model)


def test_a_tensor_in_two_shard_files_is_refused(tiny_model_factory, tmp_path):
    """A directory holding a stale shard beside the checkpoint (every *.safetensors loads
    without an index): each tensor comes twice. An equal copy loads (a module shared under
    two names is saved so: Phi-3-vision's `wte`); other values are refused."""
    model = _copy(tiny_model_factory, tmp_path, "llama")
    header, data = _header(model / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    stale = {
        name: {
            **header[name],
            "data_offsets": [0, header[name]["data_offsets"][1] - header[name]["data_offsets"][0]],
        }
    }
    begin, end = header[name]["data_offsets"]
    _rewrite(model / "model-old.safetensors", stale, data[begin:end])
    _load(model)  # the same values: one of them loads
    _rewrite(model / "model-old.safetensors", stale, bytes(end - begin))  # zeros
    with pytest.raises(ValueError, match=rf"checkpoint holds '{name}' twice .*other values"):
        _load(model)
