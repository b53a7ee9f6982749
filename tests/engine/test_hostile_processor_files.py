"""Broken or hostile processor files of multimodal checkpoints (multimodal/processor_files.py).

Tiny random Qwen2-VL (images and videos), LLaVA, LLaVA-NeXT, Gemma 3, Idefics3, InternVL and
Qwen2-Audio checkpoints, each written once and copied per case with one processor file
changed (or config.json, where the image host reads it): the engine must refuse to start
with a ValueError naming the file and the field.
Before these checks the engine started and the first image, clip or video met them: a raw
JSONDecodeError / AttributeError / ZeroDivisionError / RuntimeError out of the request, an
image upscaled to a Qwen2-VL min_pixels of 10**12 (the process killed for memory), a crop
of 10**6 x 10**6 pixels tried, NaN features from an image_std of 0 served as tokens, or (a
file that is not a JSON object) AttributeError / JSONDecodeError at start. Values that
released checkpoints save still start.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from paged_engine import LLM
from paged_engine.testing import (
    write_tiny_gemma3,
    write_tiny_idefics3,
    write_tiny_internvl,
    write_tiny_llava,
    write_tiny_qwen2_vl,
)

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL.Image")


def _qwen2_audio(path: Path) -> Path:
    from test_qwen2_audio import write_tiny_qwen2_audio

    return write_tiny_qwen2_audio(path)


WRITERS: dict[str, Callable[[Path], Path]] = {
    "qwen2vl": lambda p: write_tiny_qwen2_vl(p, version="2", seed=2),
    "llava": lambda p: write_tiny_llava(p, seed=0),
    "llavanext": lambda p: write_tiny_llava(p, seed=0, grid_pinpoints=[[30, 60], [60, 30]]),
    "gemma3": lambda p: write_tiny_gemma3(p, seed=3),
    "idefics3": lambda p: write_tiny_idefics3(p, seed=3),
    "internvl": lambda p: write_tiny_internvl(p, seed=2),
    "qwen2audio": _qwen2_audio,
}
PRE, PROC, VIDEO = (
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """name -> the tiny checkpoint's directory, written once per module."""
    cache: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in cache:
            cache[name] = WRITERS[name](tmp_path_factory.mktemp(name))
        return cache[name]

    return make


def _mutated(src: Path, dst: Path, file: str, change: str | dict[str, Any]) -> Path:
    """A copy of `src` at `dst` with `file` replaced by `change` (a str: the file's text) or
    updated by it (a dict: set in the image processor's / feature extractor's settings,
    nested in processor_config.json where transformers 5 saves them; "top." keys at the top)."""
    shutil.copytree(src, dst)
    target = dst / file
    if isinstance(change, str):
        target.write_text(change)
        return dst
    data = json.loads(target.read_text())
    keys = ("image_processor", "feature_extractor")
    nested = next((data[k] for k in keys if isinstance(data.get(k), dict)), data)
    for key, value in change.items():
        if key.startswith("top."):
            data[key.removeprefix("top.")] = value
        else:
            nested[key] = value
    target.write_text(json.dumps(data))
    return dst


def _llm(path: Path) -> LLM:
    return LLM(model=str(path), dtype="float32", max_model_len=512, block_size=16)


REFUSED = [
    # Qwen2-VL: a division by zero / a reshape error at each image, or its memory taken
    ("qwen2vl", PRE, {"patch_size": 0}, "patch_size must be a positive integer"),
    ("qwen2vl", PRE, {"patch_size": -4}, "patch_size must be a positive integer"),
    ("qwen2vl", PRE, {"temporal_patch_size": 0}, "temporal_patch_size must be a positive"),
    (
        "qwen2vl",
        PRE,
        {"size": {"shortest_edge": 10**12, "longest_edge": 10**15}},
        r"size\.shortest_edge .* is over the 33554432",
    ),
    ("qwen2vl", PRE, {"min_pixels": 10**12}, "min_pixels 1000000000000 is over the"),
    ("qwen2vl", PRE, {"min_pixels": 10**6, "max_pixels": 100}, "min_pixels .* over max_pixels"),
    ("qwen2vl", PRE, {"image_std": [0, 0, 0]}, "image_std must be > 0"),
    ("qwen2vl", PRE, {"image_mean": [0.5]}, "image_mean must be 3 numbers"),
    ("qwen2vl", PRE, {"do_resize": "no"}, "do_resize must be true or false"),
    ("qwen2vl", PRE, "{not json", "is not valid JSON"),
    ("qwen2vl", PRE, "null", "must hold a JSON object, got NoneType"),
    ("qwen2vl", PRE, "[1, 2]", "must hold a JSON object, got list"),
    # its videos: ZeroDivisionError / RuntimeError out of each request, NaN rows from std 0
    ("qwen2vl", VIDEO, {"merge_size": 0}, "merge_size must be a positive integer"),
    ("qwen2vl", VIDEO, {"image_mean": [0.5]}, "image_mean must be 3 numbers"),
    ("qwen2vl", VIDEO, {"image_std": [0.5, 0, 0.5]}, "image_std must be > 0"),
    (
        "qwen2vl",
        VIDEO,
        {"size": {"shortest_edge": 10**15, "longest_edge": 10**15}},
        r"size\.shortest_edge",
    ),
    ("qwen2vl", VIDEO, "[]", "must hold a JSON object, got list"),
    # LLaVA / LLaVA-NeXT: a 2.7 TiB crop tried, sizes blamed on mm_processor_kwargs, raw
    # JSONDecodeError / AttributeError out of each request
    ("llava", PROC, {"crop_size": {"height": 10**6, "width": 10**6}}, r"crop_size of .* is over"),
    ("llava", PROC, {"crop_size": {"height": 0, "width": 0}}, r"crop_size\.height must be"),
    ("llava", PROC, {"size": {"shortest_edge": 0}}, r"size\.shortest_edge must be a number > 0"),
    ("llava", PROC, {"image_std": [0, 0, 0]}, "image_std must be > 0"),
    ("llava", PROC, "{not json", "is not valid JSON"),
    ("llava", PROC, "[1, 2]", "must hold a JSON object, got list"),
    ("llava", PROC, {"top.image_processor": [1]}, "image_processor must be a JSON object"),
    ("llavanext", PROC, {"size": {"shortest_edge": -5}}, r"size\.shortest_edge must be"),
    ("llavanext", PROC, {"image_std": [0, 0, 0]}, "image_std must be > 0"),
    ("llavanext", PROC, "{not json", "is not valid JSON"),
    # Gemma 3: a MemoryError at each image
    ("gemma3", PROC, {"size": {"height": 10**9, "width": 10**9}}, r"size of .* is over"),
    ("gemma3", PROC, {"size": {"height": 0, "width": 0}}, r"size\.height must be"),
    ("gemma3", PROC, {"image_std": [0, 0, 0]}, "image_std must be > 0"),
    ("gemma3", PROC, "[]", "must hold a JSON object, got list"),
    # Idefics3 / SmolVLM
    ("idefics3", PROC, {"image_std": [0, 0, 0]}, "image_std must be > 0"),
    ("idefics3", PROC, {"max_image_size": {"longest_edge": 0}}, r"max_image_size\.longest_edge"),
    ("idefics3", PROC, {"max_image_size": {"longest_edge": 10**6}}, r"tiles of .* are over"),
    ("idefics3", PROC, "{not json", "is not valid JSON"),
    # what the image hosts read of config.json: a ZeroDivisionError / TypeError at start
    ("idefics3", "config.json", {"scale_factor": 0}, "config.scale_factor must be a positive"),
    (
        "gemma3",
        "config.json",
        {"image_token_index": 10**6},
        r"config\.image_token_index 1000000 is not a token of the checkpoint's tokenizer",
    ),
    # InternVL (GotOcr2ImageProcessor)
    ("internvl", PRE, {"size": {"height": 10**6, "width": 10**6}}, r"size of .* is over"),
    ("internvl", PRE, {"image_std": [0, 0, 0]}, "image_std must be > 0"),
    ("internvl", PRE, "[]", "must hold a JSON object, got list"),
    # Qwen2-Audio (WhisperFeatureExtractor): ZeroDivisionError / RuntimeError out of each
    # request, a 2.9 GiB or 60 GiB allocation tried, or (n_fft / hop_length 0) the model
    # served without audio after a warning, its clips refused as if limit_mm_per_prompt said so
    ("qwen2audio", PROC, {"sampling_rate": 0}, "sampling_rate must be a positive integer"),
    ("qwen2audio", PROC, {"sampling_rate": -16000}, "sampling_rate must be a positive"),
    ("qwen2audio", PROC, {"feature_size": 0}, "feature_size must be a positive integer"),
    ("qwen2audio", PROC, {"n_fft": 0}, "n_fft must be a positive integer"),
    ("qwen2audio", PROC, {"hop_length": 0}, "hop_length must be a positive integer"),
    ("qwen2audio", PROC, {"chunk_length": 0}, "chunk_length must be a number > 0"),
    ("qwen2audio", PROC, {"chunk_length": 10**6}, r"a window of .* samples, over the"),
    # a RuntimeError from the tower's conv at each clip (16 mel bins, 80 extracted)
    ("qwen2audio", PROC, {"feature_size": 80}, r"windows of 300 frames of 80 mels; .* of 16"),
    ("qwen2audio", PROC, {"n_fft": 10**9}, r"a mel filter bank of \d+ entries, over"),
    ("qwen2audio", PROC, {"sampling_rate": "16000"}, "sampling_rate must be a positive"),
    ("qwen2audio", PROC, "{x", "is not valid JSON"),
    ("qwen2audio", PROC, {"top.feature_extractor": []}, "feature_extractor must be a JSON object"),
]


def _case_id(name: str, file: str, change: str | dict[str, Any]) -> str:
    if isinstance(change, dict):
        what = "+".join(change)
    else:
        try:
            what = f"a_{type(json.loads(change)).__name__}"
        except ValueError:
            what = "not_json"
    return f"{name}-{file.removesuffix('.json')}-{what}"


@pytest.mark.parametrize(
    ("name", "file", "change", "match"),
    REFUSED,
    ids=[_case_id(n, f, c) for n, f, c, _ in REFUSED],
)
def test_broken_processor_file_refused_at_start(checkpoint, tmp_path, name, file, change, match):
    path = _mutated(checkpoint(name), tmp_path / name, file, change)
    with pytest.raises(ValueError, match=match) as caught:
        _llm(path)
    if file != "config.json":  # (config fields are named as config.<field>)
        assert file in str(caught.value)


def test_release_values_start(checkpoint, tmp_path):
    """Qwen2-VL's released sizes (pixel counts 56 * 56 to 28 * 28 * 1280 as size and as
    min / max_pixels, do_convert_rgb true) are taken."""
    released = {
        "size": {"shortest_edge": 3136, "longest_edge": 12845056},
        "min_pixels": 3136,
        "max_pixels": 12845056,
        "do_convert_rgb": True,
    }
    _llm(_mutated(checkpoint("qwen2vl"), tmp_path / "q", PRE, released))
