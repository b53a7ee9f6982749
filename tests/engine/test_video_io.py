"""Encoded videos -> frames and metadata (multimodal/video_io.py, PyAV): `num_frames` frames
sampled as vLLM samples them (linspace over the file's frames, truncated), every frame with -1
or when the file has fewer, the file's frame rate and count in the metadata (also from a
container that does not state its count), the frames' pixels as encoded (within the codec's
loss); what is no video, or decodes to too many pixels, is a ValueError naming the input."""

from __future__ import annotations

import numpy as np
import pytest

from paged_engine.multimodal import video_io
from paged_engine.multimodal.video_io import decode_video
from paged_engine.testing import encode_video

av = pytest.importorskip("av")


def _ramp(count: int = 12, size: tuple[int, int] = (40, 56)) -> np.ndarray:
    """Frame i a flat gray of 20 * i: which frame was kept reads back from its mean."""
    levels = np.arange(count, dtype=np.uint8) * 20
    return np.broadcast_to(levels[:, None, None, None], (count, *size, 3)).copy()


def _levels(frames: np.ndarray) -> list[int]:
    return [round(float(f.mean()) / 20) for f in frames]


@pytest.mark.parametrize("container", ["mp4", "matroska", "avi"])
def test_frames_sampled_as_vllm_samples_them(container) -> None:
    data = encode_video(_ramp(12), fps=6, container=container)
    frames, meta = decode_video(data, num_frames=4)
    want = np.linspace(0, 11, 4, dtype=int).tolist()  # [0, 3, 7, 11]
    assert meta["frames_indices"] == want and _levels(frames) == want
    assert frames.shape == (4, 40, 56, 3) and frames.dtype == np.uint8
    assert meta["total_num_frames"] == 12 and meta["fps"] == 6.0
    assert meta["duration"] == pytest.approx(2.0)


def test_every_frame_with_minus_one_or_a_shorter_video() -> None:
    data = encode_video(_ramp(5), fps=3)
    for n in (-1, 5, 32):
        frames, meta = decode_video(data, num_frames=n)
        assert meta["frames_indices"] == [0, 1, 2, 3, 4] == _levels(frames)
    frames, _ = decode_video(data, num_frames=1)
    assert _levels(frames) == [0]


def test_pixels_survive_the_codec() -> None:
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 5, 7, 3), dtype=np.uint8)
    frames = np.kron(blocks, np.ones((1, 8, 8, 1), np.uint8))  # 8 x 8 flat blocks
    got, _ = decode_video(encode_video(frames, fps=2), num_frames=-1)
    assert np.abs(got.astype(int) - frames.astype(int)).mean() < 12


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"", "Invalid data"),
        (b"hello, not a video at all", "Invalid data"),
        ("truncated", ""),
    ],
)
def test_what_is_no_video_is_a_value_error_naming_it(data, says) -> None:
    if data == "truncated":
        data = encode_video(_ramp(6), fps=3)[:300]
    with pytest.raises(
        ValueError,
        match=rf"messages\[0\]\.content\[0\]\.video_url cannot be read as a video: .*{says}",
    ):
        decode_video(data, what="messages[0].content[0].video_url")


def test_frames_over_the_pixel_cap_are_refused(monkeypatch) -> None:
    data = encode_video(_ramp(8), fps=4)
    monkeypatch.setattr(video_io, "MAX_VIDEO_PIXELS", 4 * 40 * 56)
    assert len(decode_video(data, num_frames=4)[0]) == 4
    with pytest.raises(ValueError, match="sample fewer frames"):
        decode_video(data, num_frames=5)


@pytest.mark.parametrize("n", [0, -2, 1.5, True, "4"])
def test_bad_num_frames(n) -> None:
    with pytest.raises(ValueError, match="num_frames"):
        decode_video(encode_video(_ramp(2), fps=2), num_frames=n)
