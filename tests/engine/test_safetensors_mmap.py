"""`.safetensors` weights load as views of one memory map: nothing is copied until a rank copies
out its slice, and every tensor equals what the safetensors library reads."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from paged_engine.loader import mmap_safetensors

safetensors_torch = pytest.importorskip("safetensors.torch")


def test_tensors_are_views_of_one_mapping_with_the_files_values(tmp_path):
    tensors = {
        "a": torch.randn(64, 32),
        "b": torch.randn(7, dtype=torch.float64),
        "c": torch.arange(12, dtype=torch.int32).reshape(3, 4),
        "d": torch.randn(5, 8).to(torch.bfloat16),
        "e": torch.zeros(0, 3),
    }
    file = tmp_path / "w.safetensors"
    safetensors_torch.save_file(tensors, str(file), metadata={"format": "pt"})
    got = dict(mmap_safetensors(file))
    assert set(got) == set(tensors)
    for name, want in tensors.items():
        assert got[name].dtype == want.dtype and torch.equal(got[name], want), name
    # One mapping: the data pointers lie exactly as far apart as the file's offsets.
    expected = safetensors_torch.load_file(str(file))
    assert all(torch.equal(expected[n], got[n]) for n in got)
    header_offsets = _offsets(file)
    base = got["a"].data_ptr() - header_offsets["a"]
    for name in ("b", "c", "d"):
        assert got[name].data_ptr() - base == header_offsets[name]
    # A private mapping: writing a view never reaches the file.
    got["a"].zero_()
    assert torch.equal(dict(mmap_safetensors(file))["a"], tensors["a"])


def _offsets(file):
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {k: v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}
