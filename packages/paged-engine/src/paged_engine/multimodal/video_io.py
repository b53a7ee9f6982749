"""Encoded videos (mp4, webm, mkv, ... bytes) -> the frames and metadata a video prompt takes.

    bytes -> PyAV (FFmpeg) demuxes and decodes the first video stream -> `num_frames` frames
    sampled uniformly (vLLM's rule: indices linspace(0, total - 1, num_frames) truncated; every
    frame when the video has no more, or num_frames is -1) -> (uint8 [T, H, W, 3],
    {"fps", "total_num_frames", "frames_indices", "duration"})

The metadata is transformers' VideoMetadata as vLLM's loaders fill it: `fps` is the file's
frame rate, so the rate of the frames kept is len(frames_indices) / total_num_frames * fps
(Qwen2.5-VL's temporal positions use it; multimodal/qwen_video.py).

Decoding needs PyAV (`pip install 'paged-engine[video]'`), imported with the first video. What
the frames may hold is bounded (MAX_VIDEO_PIXELS over all frames kept), so a small file that
decodes to a huge video is refused before its frames are stacked.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

DEFAULT_NUM_FRAMES = 32  # vLLM's default (media_io_kwargs {"video": {"num_frames": 32}})
MAX_VIDEO_PIXELS = 1 << 28  # pixels over the frames kept: 768 MiB of RGB, 32 frames of 4K
_DEFAULT_FPS = 24.0  # a stream without a rate (transformers' default)


def require_av() -> Any:
    try:
        import av
    except ImportError as e:
        raise ImportError("video inputs need PyAV: pip install 'paged-engine[video]'") from e
    return av


def decode_video(
    data: bytes, num_frames: int = DEFAULT_NUM_FRAMES, what: str = "the video"
) -> tuple[np.ndarray, dict[str, Any]]:
    """(frames uint8 [T, H, W, 3], metadata) of the encoded video `data`, `num_frames` of its
    frames sampled uniformly (-1 or more than it has: all); ValueError naming `what` for data
    that is no video PyAV can read, or frames over MAX_VIDEO_PIXELS."""
    if isinstance(num_frames, bool) or not isinstance(num_frames, int) or num_frames < -1:
        raise ValueError(f"num_frames must be a positive int or -1 (all), got {num_frames!r}")
    if num_frames == 0:
        raise ValueError("num_frames must be a positive int or -1 (all), got 0")
    av = require_av()
    try:
        total, fps, (height, width) = _probe(av, data)
        if total == 0:
            raise ValueError("it holds no frames")
        # frames kept (distinct: linspace steps by >= 1), checked before any index list is
        # made: the count is the container's claim, which a small file can make huge
        count = total if num_frames == -1 or total <= num_frames else num_frames
        if count * height * width > MAX_VIDEO_PIXELS:
            raise ValueError(
                f"{count} frames of {width} x {height} are over {MAX_VIDEO_PIXELS} "
                "pixels: sample fewer frames (media_io_kwargs {'video': {'num_frames': N}})"
            )
        if count == total:
            wanted: range | set[int] = range(total)
        else:
            wanted = set(np.linspace(0, total - 1, num_frames, dtype=int).tolist())
        frames, kept = _decode(av, data, wanted)
    except Exception as e:  # also FFmpeg's: not a container, a truncated or corrupt stream
        raise ValueError(f"{what} cannot be read as a video: {e}") from None
    meta = {
        "fps": fps,
        "total_num_frames": total,
        "frames_indices": kept,
        "duration": total / fps,
    }
    return np.stack(frames), meta


def _probe(av: Any, data: bytes) -> tuple[int, float, tuple[int, int]]:
    """(frame count, frame rate, (height, width)) of the first video stream. A container that
    does not state its frame count has its packets counted (demuxed, not decoded)."""
    with av.open(io.BytesIO(data)) as container:
        if not container.streams.video:
            raise ValueError("it holds no video stream")
        stream = container.streams.video[0]
        ctx = stream.codec_context
        height, width = int(ctx.height), int(ctx.width)
        if height <= 0 or width <= 0:
            raise ValueError(f"its frames are {width} x {height}")
        rate = stream.average_rate or stream.guessed_rate
        fps = float(rate) if rate else _DEFAULT_FPS
        total = int(stream.frames or 0)
        if total <= 0:
            total = sum(1 for packet in container.demux(stream) if packet.size)
    return total, fps, (height, width)


def _decode(av: Any, data: bytes, wanted: range | set[int]) -> tuple[list[np.ndarray], list[int]]:
    """The frames at `wanted` indices, in order, and the indices found (a stream may decode
    fewer frames than it states: those past its end are missing)."""
    frames, kept = [], []
    last = wanted[-1] if isinstance(wanted, range) else max(wanted)
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        for i, frame in enumerate(container.decode(stream)):
            if i in wanted:
                frames.append(frame.to_ndarray(format="rgb24"))
                kept.append(i)
            if i >= last:
                break
    if not frames:
        raise ValueError("no frame decodes")
    if len({f.shape for f in frames}) > 1:
        raise ValueError("its frames change size")
    return frames, kept
