"""Video bytes for tests: frames encoded with PyAV."""

from __future__ import annotations

from typing import Any


def encode_video(frames: Any, fps: int = 6, container: str = "mp4", codec: str = "mpeg4") -> bytes:
    """uint8 frames [T, H, W, 3] (even H and W) encoded with PyAV as `container` bytes, the
    frame rate `fps` (matroska states no frame count: readers count its packets)."""
    import io

    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.height, stream.width = int(frames.shape[1]), int(frames.shape[2])
        stream.pix_fmt = "yuv420p"
        for frame in frames:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        out.mux(stream.encode())
    return buf.getvalue()
