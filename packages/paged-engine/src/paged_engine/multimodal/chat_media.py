"""`LLM.chat` with images, videos and audio: OpenAI-style parts out of the messages,
placeholders in.

    {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}   decoded
    {"type": "image_url", "image_url": "https://..."}                         fetched (urllib)
    {"type": "image_pil", "image_pil": PIL.Image}                              vLLM's offline form
    {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,..."}}  decoded (PyAV),
                                                                               32 frames sampled
    {"type": "input_audio", "input_audio": {"data": "<base64>", "format": "wav"}}  decoded
    {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,..."}}      decoded

Each becomes `{"type": "image"}` / `{"type": "video"}` / `{"type": "audio"}` for the chat
template (Hugging Face's
parts, where the template writes the placeholder; a template of string content gets them as
the model's placeholder text instead: chat_format.py), and the media go to `multi_modal_data` in
order. Messages without media pass unchanged. Local files: open them with PIL and send
`image_pil`, or pass a video's frames to `LLM.generate`. The server has its own loader
(paged_server/media.py: size caps, local-path policy, errors as HTTP 400s).
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import urllib.request
from typing import Any

from paged_engine.multimodal.processor import require_pillow

_TIMEOUT_ENV = {
    "image": ("PAGED_IMAGE_FETCH_TIMEOUT", "VLLM_IMAGE_FETCH_TIMEOUT"),
    "video": ("PAGED_VIDEO_FETCH_TIMEOUT", "VLLM_VIDEO_FETCH_TIMEOUT"),
    "audio": ("PAGED_AUDIO_FETCH_TIMEOUT", "VLLM_AUDIO_FETCH_TIMEOUT"),
}
_DEFAULT_TIMEOUT = {"image": 5.0, "video": 30.0, "audio": 10.0}
_KINDS = {
    "image_url": "image",
    "image_pil": "image",
    "video_url": "video",
    "input_audio": "audio",
    "audio_url": "audio",
}


def split_media(
    messages: list[dict], audio_in_video: bool = False
) -> tuple[list[dict], dict[str, list[Any]]]:
    """(messages as the chat template takes them, their multi_modal_data: images and videos,
    each in order); ValueError naming the part for one that cannot be read. `audio_in_video`
    (Qwen-Omni's use_audio_in_video): each video's soundtrack is added to the audio, in video
    order."""
    out: list[dict] = []
    media: dict[str, list[Any]] = {}
    soundtracks: list[Any] = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list) or not any(_kind(p) for p in content):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            kind = _kind(part)
            if kind is None:
                parts.append(part)
                continue
            param = f"messages[{i}].content[{j}]"
            if kind == "video" and audio_in_video:
                video, clip = _load_video_with_audio(part, param)
                media.setdefault("video", []).append(video)
                soundtracks.append(clip)
                parts.append({"type": kind})
                continue
            load = {"video": _load_video, "audio": _load_audio}.get(kind, _load_image)
            media.setdefault(kind, []).append(load(part, param))
            parts.append({"type": kind})
        out.append({**message, "content": parts})
    if soundtracks:
        media["audio"] = media.get("audio", []) + soundtracks
    return out, media


def _kind(part: Any) -> str | None:
    return _KINDS.get(part.get("type")) if isinstance(part, dict) else None


def _load_image(part: dict, param: str) -> Any:
    Image = require_pillow()
    if part["type"] == "image_pil":
        image = part.get("image_pil")
        if not isinstance(image, Image.Image):
            raise ValueError(f"{param}.image_pil must be a PIL.Image.Image")
        return image
    data = _url_bytes(part, "image", param)
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except Exception as e:
        raise ValueError(f"{param}.image_url: not an image Pillow can read: {e}") from None
    return image


def _load_video(part: dict, param: str) -> Any:
    """(frames, metadata): the video's frames sampled as vLLM samples them by default."""
    from paged_engine.multimodal.video_io import decode_video

    return decode_video(_url_bytes(part, "video", param), what=f"{param}.video_url")


def _load_video_with_audio(part: dict, param: str) -> tuple[Any, Any]:
    """A video part's (frames, metadata) and its audio track's (waveform, rate)."""
    from paged_engine.multimodal.audio_io import load_audio
    from paged_engine.multimodal.video_io import decode_video

    data = _url_bytes(part, "video", param)
    video = decode_video(data, what=f"{param}.video_url")
    return video, load_audio(data, what=f"{param}.video_url (its audio)")


def _load_audio(part: dict, param: str) -> Any:
    """(waveform, sampling rate) of an input_audio part's base64 data or an audio_url's."""
    from paged_engine.multimodal.audio_io import load_audio

    if part["type"] == "input_audio":
        value = part.get("input_audio")
        data = value.get("data") if isinstance(value, dict) else None
        if not isinstance(data, str):
            raise ValueError(f"{param}.input_audio needs base64 'data' (and a 'format')")
        try:
            raw = base64.b64decode("".join(data.split()), validate=True)
        except binascii.Error:
            raise ValueError(f"{param}.input_audio: the data is not valid base64") from None
        return load_audio(raw, what=f"{param}.input_audio")
    return load_audio(_url_bytes(part, "audio", param), what=f"{param}.audio_url")


def _url_bytes(part: dict, kind: str, param: str) -> bytes:
    """The bytes a part's data: or http(s) URL holds."""
    key = f"{kind}_url"
    value = part.get(key)
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str):
        raise ValueError(f"{param}.{key} needs a 'url' string")
    if url.startswith("data:"):
        head, _, payload = url.partition(",")
        if ";base64" not in head:
            raise ValueError(f"{param}.{key}: a data URL must be base64 (data:...;base64,)")
        try:
            return base64.b64decode("".join(payload.split()), validate=True)
        except binascii.Error:
            raise ValueError(f"{param}.{key}: the data URL is not valid base64") from None
    if url.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(url, timeout=_timeout(kind)) as response:
                return response.read()
        except OSError as e:
            raise ValueError(f"{param}.{key}: could not fetch {url}: {e}") from None
    local = (
        "pass {'type': 'image_pil', 'image_pil': PIL.Image.open(path)}"
        if kind == "image"
        else "decode it and pass its frames in multi_modal_data={'video': frames}"
        if kind == "video"
        else "send its bytes as an input_audio part"
    )
    raise ValueError(
        f"{param}.{key}: only data: and http(s) URLs are read here; for a local file {local}"
    )


def _timeout(kind: str) -> float:
    for name in _TIMEOUT_ENV[kind]:
        if os.environ.get(name):
            return float(os.environ[name])
    return _DEFAULT_TIMEOUT[kind]
