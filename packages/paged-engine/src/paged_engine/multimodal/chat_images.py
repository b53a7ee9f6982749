"""`LLM.chat` with images: OpenAI-style image parts out of the messages, placeholders in.

    {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}   decoded
    {"type": "image_url", "image_url": "https://..."}                         fetched (urllib)
    {"type": "image_pil", "image_pil": PIL.Image}                              vLLM's offline form

Each becomes `{"type": "image"}` for the chat template (Hugging Face's part, where the template
writes the image token), and the images go to `multi_modal_data` in order. Messages without
images pass unchanged. Local files: open them with PIL and send `image_pil`. The server has its
own loader (paged_server/media.py: size caps, local-path policy, errors as HTTP 400s).
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import urllib.request
from typing import Any

from paged_engine.multimodal.processor import require_pillow

_TIMEOUT_ENV = ("PAGED_IMAGE_FETCH_TIMEOUT", "VLLM_IMAGE_FETCH_TIMEOUT")


def split_images(messages: list[dict]) -> tuple[list[dict], list[Any]]:
    """(messages as the chat template takes them, their images in order); ValueError naming
    the part for one that cannot be read."""
    out, images = [], []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list) or not any(_is_image(p) for p in content):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            if _is_image(part):
                images.append(_load(part, f"messages[{i}].content[{j}]"))
                parts.append({"type": "image"})
            else:
                parts.append(part)
        out.append({**message, "content": parts})
    return out, images


def _is_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in ("image_url", "image_pil")


def _load(part: dict, param: str) -> Any:
    Image = require_pillow()
    if part["type"] == "image_pil":
        image = part.get("image_pil")
        if not isinstance(image, Image.Image):
            raise ValueError(f"{param}.image_pil must be a PIL.Image.Image")
        return image
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str):
        raise ValueError(f"{param}.image_url needs a 'url' string")
    if url.startswith("data:"):
        head, _, payload = url.partition(",")
        if ";base64" not in head:
            raise ValueError(f"{param}.image_url: a data URL must be base64 (data:...;base64,)")
        try:
            data = base64.b64decode("".join(payload.split()), validate=True)
        except binascii.Error:
            raise ValueError(f"{param}.image_url: the data URL is not valid base64") from None
    elif url.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(url, timeout=_timeout()) as response:
                data = response.read()
        except OSError as e:
            raise ValueError(f"{param}.image_url: could not fetch {url}: {e}") from None
    else:
        raise ValueError(
            f"{param}.image_url: only data: and http(s) URLs are read here; for a local file "
            "pass {'type': 'image_pil', 'image_pil': PIL.Image.open(path)}"
        )
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except Exception as e:
        raise ValueError(f"{param}.image_url: not an image Pillow can read: {e}") from None
    return image


def _timeout() -> float:
    for name in _TIMEOUT_ENV:
        if os.environ.get(name):
            return float(os.environ[name])
    return 5.0
