"""Images, videos and audio a chat request points at, loaded on its HTTP thread (never the
engine's).

    data:image/png;base64,iVBOR...    decoded in place (data:video/mp4;base64,... for a video)
    http://... / https://...          fetched with urllib: PAGED_IMAGE_FETCH_TIMEOUT (or vLLM's
                                      VLLM_IMAGE_FETCH_TIMEOUT) seconds per read, 5 by default
                                      (videos: *_VIDEO_FETCH_TIMEOUT, 30); a body over the cap
                                      (20 MiB an image, 256 MiB a video) is refused before it
                                      is all read; with --allowed-media-domains only from those
                                      hosts (redirects included)
    file:///dir/cat.jpg               only under --allowed-local-media-path DIR (the path
                                      resolved, links followed, must stay inside DIR)

An image becomes an RGB PIL image (one over Pillow's Image.MAX_IMAGE_PIXELS is refused before
it is decoded: Pillow itself only warns up to twice that); a video (a `video_url` part) its
frames and metadata, `num_frames` of them sampled uniformly (paged_engine/multimodal/video_io.py,
PyAV); an audio clip (an `input_audio` part, OpenAI's base64 WAV / MP3, or vLLM's
`audio_url`) its mono waveform and sampling rate (paged_engine/multimodal/audio_io.py: WAV by
the standard library, other formats by PyAV); audio URLs time out after
PAGED_AUDIO_FETCH_TIMEOUT (VLLM_AUDIO_FETCH_TIMEOUT) seconds, 10 by default, and a clip is at
most 64 MiB.

An `image_embeds` part (vLLM's, with --enable-mm-embeds) holds the image's features instead:
base64 of a tensor saved by torch.save (loaded with weights_only=True, sparse tensors checked,
then made dense) or of a numpy .npy array (no pickles); Qwen2-VL's form is a dict of such
strings, {"image_embeds": ..., "image_grid_thw": ...}.

Every failure is a 400 naming where the URL was (`messages[0].content[1].image_url`): the
client sent something this server cannot read as an image (or video). Pillow is imported with
the first image and PyAV with the first video, so a text-only server needs neither.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import urllib.error
import urllib.request
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from paged_server.errors import APIError, bad_request

# (our variable, vLLM's) per kind of media, and vLLM's defaults in seconds
FETCH_TIMEOUT_ENV = {
    "image": ("PAGED_IMAGE_FETCH_TIMEOUT", "VLLM_IMAGE_FETCH_TIMEOUT"),
    "video": ("PAGED_VIDEO_FETCH_TIMEOUT", "VLLM_VIDEO_FETCH_TIMEOUT"),
    "audio": ("PAGED_AUDIO_FETCH_TIMEOUT", "VLLM_AUDIO_FETCH_TIMEOUT"),
}
DEFAULT_FETCH_TIMEOUT = {"image": 5.0, "video": 30.0, "audio": 10.0}
# an encoded image, video or clip, fetched or read; a data URL is bounded by the request body
MAX_BYTES = {"image": 20 << 20, "video": 256 << 20, "audio": 64 << 20}
DEFAULT_NUM_FRAMES = 32  # frames sampled from a video (vLLM's default)
_READ_CHUNK = 1 << 16


@dataclass(frozen=True, slots=True)
class MediaRef:
    """An image or video part of a request: its URL and the parameter that named it (for
    errors); an `image_embeds` part has its payload in `embeds` instead (and no URL)."""

    url: str
    param: str
    embeds: str | dict | None = None
    kind: str = "image"  # or "video", "audio"


def fetch_timeout(environ: Any = None, kind: str = "image") -> float:
    """Seconds a fetch of an image (or video) may wait on its server: the first of
    FETCH_TIMEOUT_ENV[kind] that is set, else vLLM's default; ValueError naming the variable
    for anything but a positive number."""
    env = os.environ if environ is None else environ
    for name in FETCH_TIMEOUT_ENV[kind]:
        raw = env.get(name, "").strip()
        if not raw:
            continue
        try:
            seconds = float(raw)
        except ValueError:
            seconds = float("nan")
        if not 0 < seconds < float("inf"):
            raise ValueError(f"{name}={raw!r} is invalid: expected seconds, a positive number")
        return seconds
    return DEFAULT_FETCH_TIMEOUT[kind]


def local_media_dir(path: str | None) -> Path | None:
    """--allowed-local-media-path resolved; ValueError unless it is an existing directory."""
    if path is None:
        return None
    resolved = Path(path).expanduser().resolve()
    if not resolved.is_dir():
        raise ValueError(f"--allowed-local-media-path {path!r} is not an existing directory")
    return resolved


def _pillow() -> Any:
    try:
        import PIL.Image
    except ImportError:
        raise APIError(
            500, "image inputs need Pillow on the server: pip install 'paged-engine[vision]'"
        ) from None
    return PIL.Image


def media_io_kwargs(value: Any, param: str = "media_io_kwargs") -> int | None:
    """vLLM's media_io_kwargs, `{"video": {"num_frames": N}}` (N > 0, or -1: every frame):
    the frames to sample, or None where it sets none; ValueError naming the field."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) - {"video", "image"}:
        raise ValueError(f"{param} must be an object such as {{'video': {{'num_frames': 32}}}}")
    video = value.get("video") or {}
    if not isinstance(video, dict) or set(video) - {"num_frames"}:
        raise ValueError(f"{param}.video takes 'num_frames' only (frames sampled per video)")
    if value.get("image"):
        raise ValueError(f"{param}.image: images take no loading arguments")
    n = video.get("num_frames")
    if n is None:
        return None
    if isinstance(n, bool) or not isinstance(n, int) or not (n > 0 or n == -1):
        raise ValueError(
            f"{param}.video.num_frames must be an int > 0 or -1 (every frame), got {n!r}"
        )
    return n


class MediaLoader:
    """Turns a `MediaRef` into an RGB `PIL.Image.Image` (a video: its frames and metadata),
    or a 400 naming its parameter. `timeout` and `max_bytes` are per kind of media (missing
    kinds take the defaults); `num_frames`: frames sampled per video (-1: all)."""

    def __init__(
        self,
        local_dir: str | Path | None = None,
        timeout: dict[str, float] | None = None,
        max_bytes: dict[str, int] | None = None,
        num_frames: int = DEFAULT_NUM_FRAMES,
        domains: list[str] | None = None,
    ) -> None:
        self.local_dir = local_media_dir(str(local_dir)) if local_dir is not None else None
        # http(s) URLs only from these hosts (None: any); compared as hostnames are, lowercase
        self.domains = None if domains is None else frozenset(d.lower() for d in domains)
        self.timeout = {**DEFAULT_FETCH_TIMEOUT, **(timeout or {})}
        self.max_bytes = {**MAX_BYTES, **(max_bytes or {})}
        self.num_frames = num_frames

    def load_all(self, refs: list[MediaRef], num_frames: int | None = None) -> list[Any]:
        return [self.load(ref, num_frames) for ref in refs]

    def load(self, ref: MediaRef, num_frames: int | None = None) -> Any:
        """The image, or a video's (frames, metadata) with `num_frames` of its frames (None:
        the loader's)."""
        if ref.embeds is not None:
            return load_embeds(ref)
        data = self._bytes(ref)
        if ref.kind == "video":
            return self._decode_video(ref, data, num_frames or self.num_frames)
        if ref.kind == "audio":
            return self._decode_audio(ref, data)
        return self._decode(ref, data)

    def load_with_soundtrack(self, ref: MediaRef, num_frames: int | None = None) -> tuple:
        """A video part's (frames, metadata) and its audio track's (waveform, rate), from one
        fetch (Qwen-Omni's use_audio_in_video); a 400 naming the part where it has no audio."""
        data = self._bytes(ref)
        video = self._decode_video(ref, data, num_frames or self.num_frames)
        return video, self._decode_audio(MediaRef(ref.url, f"{ref.param} (its audio)"), data)

    def _bytes(self, ref: MediaRef) -> bytes:
        scheme = urlsplit(ref.url).scheme.lower()
        if scheme == "data":
            data = self._data_url(ref)
        elif scheme in ("http", "https"):
            data = self._fetch(ref)
        elif scheme == "file":
            data = self._local_file(ref)
        else:
            shown = f"'{scheme}:'" if scheme else "no scheme"
            raise bad_request(
                f"{ref.param}: {'an' if ref.kind == 'image' else 'a'} {ref.kind} URL with {shown} "
                "is not supported: send a "
                f"data:{ref.kind}/...;base64 URL or an http(s) URL",
                ref.param,
            )
        return data

    def _data_url(self, ref: MediaRef) -> bytes:
        """`data:image/<format>;base64,<payload>` (`video/` for a video; whitespace in the
        payload is skipped)."""
        header, comma, payload = ref.url.partition(",")
        media_type, *flags = header[len("data:") :].split(";")
        if not comma or "base64" not in (f.strip().lower() for f in flags):
            raise bad_request(
                f"{ref.param}: a data URL must be base64: data:{ref.kind}/<format>;base64,<data>",
                ref.param,
            )
        if media_type and not media_type.strip().lower().startswith(f"{ref.kind}/"):
            raise bad_request(
                f"{ref.param}: the data URL holds {media_type.strip()!r}, not "
                f"{'an' if ref.kind == 'image' else 'a'} {ref.kind}",
                ref.param,
            )
        text = "".join(payload.split())
        text += "=" * (-len(text) % 4)  # some encoders drop the padding
        try:
            return base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise bad_request(f"{ref.param}: the data URL is not valid base64", ref.param) from None

    def _fetch(self, ref: MediaRef) -> bytes:
        self._check_domain(ref, ref.url)
        request = urllib.request.Request(ref.url, headers={"User-Agent": "paged-server"})
        open_url = urllib.request.urlopen
        if self.domains is not None:  # every redirect's target is checked too
            open_url = urllib.request.build_opener(_DomainRedirects(self, ref)).open
        try:
            with open_url(request, timeout=self.timeout[ref.kind]) as resp:
                if resp.status != 200:
                    raise bad_request(
                        f"{ref.param}: fetching the {ref.kind} answered HTTP {resp.status}",
                        ref.param,
                    )
                size = resp.headers.get("Content-Length")
                if size is not None and size.isdigit() and int(size) > self.max_bytes[ref.kind]:
                    raise self._too_large(ref)
                return self._read_capped(ref, resp)
        except urllib.error.HTTPError as e:
            raise bad_request(
                f"{ref.param}: fetching the {ref.kind} answered HTTP {e.code} {e.reason}",
                ref.param,
            ) from None
        except (urllib.error.URLError, OSError, ValueError) as e:  # DNS, refused, timeout
            why = getattr(e, "reason", None) or e
            raise bad_request(
                f"{ref.param}: the {ref.kind} could not be fetched: {why}", ref.param
            ) from None

    def _check_domain(self, ref: MediaRef, url: str) -> None:
        """A 400 naming the part when --allowed-media-domains does not list `url`'s host."""
        if self.domains is None:
            return
        host = (urlsplit(url).hostname or "").lower()
        if host not in self.domains:
            raise bad_request(
                f"{ref.param}: {ref.kind} URLs from {host or 'no host'!r} are refused: the "
                f"server fetches only from --allowed-media-domains "
                f"({', '.join(sorted(self.domains))})",
                ref.param,
            )

    def _local_file(self, ref: MediaRef) -> bytes:
        if self.local_dir is None:
            raise bad_request(
                f"{ref.param}: file:// {ref.kind} URLs are refused: the server reads local files "
                "only when started with --allowed-local-media-path DIR",
                ref.param,
            )
        parts = urlsplit(ref.url)
        if parts.netloc not in ("", "localhost"):
            raise bad_request(f"{ref.param}: a file:// URL names no host (file:///path)", ref.param)
        path = Path(unquote(parts.path)).resolve()  # links followed: the target must be inside
        if not path.is_relative_to(self.local_dir):
            raise bad_request(
                f"{ref.param}: {parts.path!r} is outside --allowed-local-media-path", ref.param
            )
        try:
            with path.open("rb") as f:
                return self._read_capped(ref, f)
        except OSError as e:
            raise bad_request(
                f"{ref.param}: cannot read {parts.path!r}: {e.strerror or e}", ref.param
            ) from None

    def _read_capped(self, ref: MediaRef, stream: Any) -> bytes:
        chunks, total = [], 0
        while chunk := stream.read(_READ_CHUNK):
            total += len(chunk)
            if total > self.max_bytes[ref.kind]:
                raise self._too_large(ref)
            chunks.append(chunk)
        return b"".join(chunks)

    def _too_large(self, ref: MediaRef) -> APIError:
        cap = self.max_bytes[ref.kind] >> 20
        return bad_request(f"{ref.param}: the {ref.kind} is over {cap} MiB", ref.param)

    @staticmethod
    def _decode_video(ref: MediaRef, data: bytes, num_frames: int) -> Any:
        """(frames uint8 [T, H, W, 3], metadata): `num_frames` frames sampled uniformly."""
        try:
            from paged_engine.multimodal.video_io import decode_video

            return decode_video(data, num_frames, what=ref.param)
        except ImportError:
            raise APIError(
                500, "video inputs need PyAV on the server: pip install 'paged-engine[video]'"
            ) from None
        except ValueError as e:
            raise bad_request(str(e), ref.param) from None

    @staticmethod
    def _decode_audio(ref: MediaRef, data: bytes) -> Any:
        """(mono float32 waveform, sampling rate); the engine resamples it to the model's."""
        from paged_engine.multimodal.audio_io import load_audio

        try:
            return load_audio(data, what=ref.param)
        except ValueError as e:
            raise bad_request(str(e), ref.param) from None

    @staticmethod
    def _decode(ref: MediaRef, data: bytes) -> Any:
        """The image, fully decoded, in RGB; a transparent one over white (as vLLM does)."""
        from paged_engine.multimodal.inputs import to_rgb

        pil = _pillow()
        try:
            image = pil.open(io.BytesIO(data))  # the header only: nothing decoded yet
        except Exception as e:  # not an image; a decompression bomb past twice the limit
            raise bad_request(
                f"{ref.param}: the data is not an image Pillow can read ({e})", ref.param
            ) from None
        # Pillow only warns between MAX_IMAGE_PIXELS and twice that: a 550 KB PNG of
        # 12000 x 12000 decoded into 2.7 GB. Refused before decoding (None: the operator's
        # Image.MAX_IMAGE_PIXELS = None lifts the limit, as it does Pillow's).
        limit = pil.MAX_IMAGE_PIXELS
        width, height = image.size
        if limit is not None and width * height > limit:
            raise bad_request(
                f"{ref.param}: an image of {width} x {height} pixels is over the limit of "
                f"{limit} pixels",
                ref.param,
            )
        try:
            image.load()
            image = to_rgb(image)  # as the engine converts an offline prompt's images
        except Exception as e:  # truncated or corrupt
            raise bad_request(
                f"{ref.param}: the data is not an image Pillow can read ({e})", ref.param
            ) from None
        return image


_NPY_MAGIC = b"\x93NUMPY"
_EMBEDS_KEYS = ("image_embeds", "image_grid_thw")


MAX_TENSOR_ELEMS = 1 << 27  # 512 MiB of float32: far above any image's or prompt's features


def load_embeds(ref: MediaRef) -> Any:
    """An `image_embeds` part's tensor, or Qwen2-VL's dict of tensors; a 400 naming the part
    for anything else."""
    value = ref.embeds
    if isinstance(value, dict):
        if "image_embeds" not in value or set(value) - set(_EMBEDS_KEYS):
            raise bad_request(
                f"{ref.param} as an object takes 'image_embeds' (and Qwen2-VL's "
                f"'image_grid_thw'), got keys {sorted(value)}",
                ref.param,
            )
        return {k: decode_tensor(f"{ref.param}.{k}", v) for k, v in value.items()}
    return decode_tensor(ref.param, value)


def decode_tensor(param: str, data: Any, max_elems: int = MAX_TENSOR_ELEMS) -> Any:
    """A base64 torch.save'd (or .npy) tensor from a client, dense, at most `max_elems`
    elements, a strided one no larger than the bytes it came with (its shape is checked
    before anything is expanded: a sparse tensor or a stride-0 view can claim far more than
    its bytes); a 400 naming `param` for anything else."""
    import numpy as np
    import torch

    if not isinstance(data, str) or not data:
        raise bad_request(
            f"{param} must be a base64 string of a tensor (torch.save, or numpy's .npy)", param
        )
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"{param} is not valid base64", param) from None
    try:
        if raw[: len(_NPY_MAGIC)] == _NPY_MAGIC:
            tensor = torch.from_numpy(np.load(io.BytesIO(raw), allow_pickle=False))
        else:
            with torch.sparse.check_sparse_tensor_invariants(), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # (a client's odd pickle protocol: not ours)
                tensor = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
                if not isinstance(tensor, torch.Tensor):
                    raise ValueError(f"it holds a {type(tensor).__name__}, not one tensor")
                if tensor.numel() > max_elems:
                    raise ValueError(f"{list(tensor.shape)} is over {max_elems} elements")
                held = tensor.untyped_storage().nbytes() if tensor.layout == torch.strided else 0
                if tensor.layout == torch.strided and tensor.numel() * tensor.element_size() > held:
                    # a view repeating its bytes (stride 0): a few bytes sent, far more made
                    raise ValueError(f"a view of {list(tensor.shape)} over {held} bytes")
                tensor = tensor.to_dense()
    except Exception as e:  # a corrupt file, pickled objects, a bad sparse tensor
        raise bad_request(f"{param} could not be read as a tensor: {e}", param) from None
    return tensor


class _DomainRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to a host --allowed-media-domains lists."""

    def __init__(self, loader: MediaLoader, ref: MediaRef) -> None:
        self.loader, self.ref = loader, ref

    def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str):
        self.loader._check_domain(self.ref, newurl)
        return super().redirect_request(req, fp, code, msg, headers, newurl)
