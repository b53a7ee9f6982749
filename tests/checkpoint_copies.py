"""Quantized copies of a tiny checkpoint for the quantized-checkpoint tests
(test_quantized_checkpoints.py, test_packed_checkpoints.py, test_bnb_checkpoints.py): the
checkpoint with some weights replaced by a quantizer's tensors, and beside it `dense/`, the
same model holding the values those tensors stand for."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from paged_engine.loader import load_hf_config, load_model, resolve_model

# (HF name, weight) -> ({tensor name: tensor} to store instead, the dequantized weight)
Quantizer = Callable[[str, torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]]


def quantized_copy(
    src: Path,
    dst: Path,
    quant_config: dict,
    quantize: Quantizer,
    picks: Callable[[str, torch.Tensor], bool],
    shuffle: str | None = None,
) -> tuple[Path, Path]:
    """(dst, dst / "dense"): `src` with each weight `picks` chooses stored as `quantize` gives
    it and `quant_config` as its quantization_config; `shuffle` (a seed) stores the tensors in
    a random order, so a layer's pieces arrive apart."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    shutil.copytree(src, dst / "dense")
    state = load_file(str(src / "model.safetensors"))
    stored, dense = {}, {}
    for name, w in state.items():
        if not picks(name, w):
            stored[name] = dense[name] = w
            continue
        tensors, dense[name] = quantize(name, w)
        stored.update(tensors)
    names = list(stored)
    if shuffle is not None:
        random.Random(shuffle).shuffle(names)
    save_file({n: stored[n].contiguous() for n in names}, str(dst / "model.safetensors"))
    save_file(dense, str(dst / "dense" / "model.safetensors"))
    with_quant_config(dst, quant_config)
    return dst, dst / "dense"


def with_quant_config(path: Path, quant_config: dict) -> Path:
    """Set the checkpoint's quantization_config in place."""
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": quant_config}))
    return path


def copy_with_quant_config(src: Path, dst: Path, quant_config: dict) -> Path:
    shutil.copytree(src, dst)
    return with_quant_config(dst, quant_config)


def load_cpu(path: Path) -> torch.nn.Module:
    """The checkpoint through the engine's loader, float32 on the CPU."""
    resolved = resolve_model(str(path))
    return load_model(resolved, load_hf_config(resolved), dtype=torch.float32, device="cpu")


def assert_loads_as_dense(path: Path, dense: Path, original: Path, tolerance: float = 0.3):
    """The quantized checkpoint's parameters equal the dense copy's exactly, and its down
    projection is really quantized: off the original, by a mean under `tolerance` of its size."""
    assert_same_params(path, dense)
    got = dict(load_cpu(path).named_parameters())
    unquantized = dict(load_cpu(original).named_parameters())
    name = "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(got[name], unquantized[name])  # really quantized
    error = (got[name] - unquantized[name]).abs().mean()
    assert error < tolerance * unquantized[name].abs().mean()


def assert_same_params(path: Path, dense: Path) -> None:
    """The checkpoint's parameters equal the dense copy's exactly."""
    got, want = dict(load_cpu(path).named_parameters()), dict(load_cpu(dense).named_parameters())
    assert got.keys() == want.keys()
    for name, p in got.items():
        assert torch.equal(p, want[name]), name


def assert_generates_like_hf(llm, dense: Path, seed: str) -> None:
    """The engine's greedy tokens and logprobs on two random prompts equal HF transformers'
    on the dense copy (hf_reference.assert_matches)."""
    from hf_reference import assert_matches, hf_greedy, load_hf_model

    from paged_engine import SamplingParams

    hf = load_hf_model(dense)
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 27)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert_matches(seed, out, hf_greedy(hf, prompt, 8))
