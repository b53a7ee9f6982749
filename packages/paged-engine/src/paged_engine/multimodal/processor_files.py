"""Engine-start checks of a multimodal checkpoint's processor files.

preprocessor_config.json, processor_config.json (transformers 5 nests the image / video
processor and feature extractor in it) and video_preprocessor_config.json are read by
transformers' processors and our own copies only at the first image, clip or video. A broken
one then failed that request with a raw JSONDecodeError / AttributeError, a division by zero,
or an allocation of the whole machine's memory (a Qwen2-VL min_pixels of 10**15 upscales every
image to it). `check_processor_files` reads them when the engine starts and refuses, by file
and field, what no released checkpoint saves:

    a file that is not a JSON object, a nested processor that is not one
    patch_size / merge_size / temporal_patch_size / image_seq_length / ... not positive ints
    (feature extractors: sampling_rate, feature_size, n_fft, hop_length); a chunk_length not
    > 0, a window (chunk_length x sampling_rate) over MOST_WINDOW_SAMPLES, a mel filter bank
    ((n_fft // 2 + 1) x feature_size) over MOST_FILTER_ENTRIES
    a size / crop_size / max_image_size edge or pixel count that is not a number > 0
    a fixed size (height x width), a tile (Idefics3's max_image_size) or a pixel-count minimum
    (min_pixels, a merging processor's size.shortest_edge) over kwargs_budget.MOST_PIXELS:
    every image is made that large
    min_pixels over max_pixels (a merging processor's shortest_edge over longest_edge)
    image_mean / image_std lists not of 3 numbers (transformers normalizes RGB with them; a
    single number is one for every channel), an image_std of 0 (it divides)
    do_resize / do_normalize / ... flags that are not true / false (or 0 / 1)

A field left out (or null) stays the processor's default. The error is a ProcessorFileError (a
ValueError) so that the engine, which serves a checkpoint without a modality whose processor
is missing, refuses to start instead.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from paged_engine.multimodal.kwargs_budget import MOST_PIXELS


class ProcessorFileError(ValueError):
    """A processor file that is broken (not one that is missing): the engine refuses to start
    rather than serve the model without that modality."""


FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")
# processor_config.json's nested processors (transformers 5)
NESTED = ("image_processor", "video_processor", "feature_extractor", "audio_processor")
# counts that must be ints >= 1 where saved (a patch_size may also be {"height", "width"})
POSITIVE_INTS = (
    "patch_size",
    "merge_size",
    "temporal_patch_size",
    "spatial_merge_size",
    "image_seq_length",
    "image_seq_len",
    "sampling_rate",
    "feature_size",
    "n_fft",
    "hop_length",
)
# samples one feature extractor window may hold (chunk_length s at sampling_rate): 2**26 is
# 70 minutes at 16 kHz (Whisper's window is 30 s); each clip is padded to it
MOST_WINDOW_SAMPLES = 2**26
# entries of a feature extractor's mel filter bank ((n_fft // 2 + 1) x feature_size, built
# with the extractor): Whisper's is 201 x 128; 2**26 float64 entries are 512 MiB
MOST_FILTER_ENTRIES = 2**26
SIZES = ("size", "crop_size", "max_image_size")
EDGES = ("height", "width", "shortest_edge", "longest_edge", "max_height", "max_width")
FLAGS = (
    "do_resize",
    "do_rescale",
    "do_normalize",
    "do_center_crop",
    "do_convert_rgb",
    "do_pad",
    "do_image_splitting",
    "do_pan_and_scan",
)


def read_json_object(file: Path) -> dict[str, Any]:
    """`file`'s JSON object; ValueError naming the file where it is not one."""
    try:
        data = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ProcessorFileError(f"{file} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ProcessorFileError(f"{file} must hold a JSON object, got {type(data).__name__}")
    return data


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _positive_int(where: str, value: Any) -> None:
    if isinstance(value, dict):  # a patch_size of {"height": ..., "width": ...}
        for k, v in value.items():
            _positive_int(f"{where}.{k}", v)
    elif isinstance(value, (list, tuple)):  # or of [height, width]
        for i, v in enumerate(value):
            _positive_int(f"{where}[{i}]", v)
    elif value is not None and not (_number(value) and value >= 1 and value == int(value)):
        raise ProcessorFileError(f"{where} must be a positive integer, got {value!r}")


def _check_size(where: str, size: Any, merging: bool) -> None:
    """A size / crop_size: positive edges (pixel counts where `merging`), its fixed area and
    pixel-count minimum at most MOST_PIXELS."""
    if size is None:
        return
    if isinstance(size, (list, tuple)):  # older processors (Donut's): [width, height]
        if len(size) != 2:
            return
        size = {"height": size[1], "width": size[0]}
    elif not isinstance(size, dict):  # older processors: one edge for a square
        size = {"height": size, "width": size}
    for key in EDGES:
        v = size.get(key)
        if v is not None and not (_number(v) and v > 0):
            raise ProcessorFileError(f"{where}.{key} must be a number > 0, got {v!r}")
    h, w = size.get("height"), size.get("width")
    if h is not None and w is not None and h * w > MOST_PIXELS:
        raise ProcessorFileError(
            f"{where} of {h} x {w} pixels is over the {MOST_PIXELS} an image may be resized to"
        )
    if where.endswith("max_image_size"):  # Idefics3's square tiles: the image grows to one
        for key, v in size.items():
            if key in EDGES and v is not None and v * v > MOST_PIXELS:
                raise ProcessorFileError(
                    f"{where}.{key} {v}: tiles of {v} x {v} pixels are over the {MOST_PIXELS} "
                    "an image may be resized to"
                )
    low, high = size.get("shortest_edge"), size.get("longest_edge")
    if merging and low is not None:  # pixel counts: every image is resized to at least `low`
        if low > MOST_PIXELS:
            raise ProcessorFileError(
                f"{where}.shortest_edge (the fewest pixels an image is resized to) {low} is over "
                f"the {MOST_PIXELS} an image may be resized to"
            )
        if high is not None and low > high:
            raise ProcessorFileError(f"{where}: shortest_edge {low} is over longest_edge {high}")


def check_settings(where: str, s: dict[str, Any]) -> None:
    """One processor's saved settings (`where` names its file and key)."""
    for key in POSITIVE_INTS:
        _positive_int(f"{where}: {key}", s.get(key))
    chunk, rate = s.get("chunk_length"), s.get("sampling_rate")
    if chunk is not None and not (_number(chunk) and chunk > 0):  # seconds a window holds
        raise ProcessorFileError(f"{where}: chunk_length must be a number > 0, got {chunk!r}")
    if chunk is not None and rate is not None and chunk * rate > MOST_WINDOW_SAMPLES:
        raise ProcessorFileError(
            f"{where}: chunk_length {chunk} s at sampling_rate {rate} is a window of "
            f"{chunk * rate} samples, over the {MOST_WINDOW_SAMPLES} one may hold"
        )
    fft, mels = s.get("n_fft"), s.get("feature_size")
    if fft is not None and mels is not None and (fft // 2 + 1) * mels > MOST_FILTER_ENTRIES:
        raise ProcessorFileError(
            f"{where}: n_fft {fft} and feature_size {mels} make a mel filter bank of "
            f"{(fft // 2 + 1) * mels} entries, over the {MOST_FILTER_ENTRIES} it may have"
        )
    merging = s.get("merge_size") is not None  # Qwen2-VL's kind: sizes are pixel counts
    for key in SIZES:
        _check_size(f"{where}: {key}", s.get(key), merging)
    low, high = s.get("min_pixels"), s.get("max_pixels")
    for key, v in (("min_pixels", low), ("max_pixels", high)):
        if v is not None and not (_number(v) and v > 0):
            raise ProcessorFileError(f"{where}: {key} must be a number > 0, got {v!r}")
    if low is not None and low > MOST_PIXELS:
        raise ProcessorFileError(
            f"{where}: min_pixels {low} is over the {MOST_PIXELS} an image may be resized to"
        )
    if low is not None and high is not None and low > high:
        raise ProcessorFileError(f"{where}: min_pixels {low} is over max_pixels {high}")
    for key in ("image_mean", "image_std"):
        v = s.get(key)
        values = v if isinstance(v, list) else [v]
        if v is None:
            continue
        if (isinstance(v, list) and len(v) != 3) or not all(_number(x) for x in values):
            raise ProcessorFileError(
                f"{where}: {key} must be 3 numbers (R, G, B) or one, got {v!r}"
            )
        if key == "image_std" and not all(x > 0 for x in values):
            raise ProcessorFileError(f"{where}: image_std must be > 0 (it divides), got {v!r}")
    for key in FLAGS:
        v = s.get(key)
        if v is not None and not isinstance(v, bool) and v not in (0, 1):  # (0 / 1 as JSON ints)
            raise ProcessorFileError(f"{where}: {key} must be true or false, got {v!r}")


def check_processor_files(path: Path) -> None:
    """ValueError naming the file and field of the first broken processor setting saved in
    the checkpoint at `path` (module docstring); nothing for files it lacks."""
    for name in FILES:
        file = Path(path) / name
        if not file.is_file():
            continue
        data = read_json_object(file)
        check_settings(str(file), data)
        for key in NESTED:
            nested = data.get(key)
            if nested is None:
                continue
            if not isinstance(nested, dict):
                raise ProcessorFileError(
                    f"{file}: {key} must be a JSON object, got {type(nested).__name__}"
                )
            check_settings(f"{file} {key}", nested)
