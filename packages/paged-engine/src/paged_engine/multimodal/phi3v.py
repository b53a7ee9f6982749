"""Phi-3-vision / Phi-3.5-vision's images (`Phi3VForCausalLM`, the Hub's remote code: its
image_processing_phi3_v.py, processing_phi3_v.py and image_embedding_phi3_v.py; vLLM's
phi3v.py). The decoder is Phi-3's (models/phi3.py) built from the flat config
(models/phi3v_config.py reads config.json; models/text_wrappers.py's row).

    image -> HD transform (num_crops = hd_num): transposed to landscape when taller than wide;
        scale = the largest s with s * ceil(s / ratio) <= num_crops; resized (PIL bilinear) to
        s 336 x int(s 336 / ratio), padded white to a multiple of 336 in height (centered:
        the odd pixel at the bottom), transposed back -> H x W, multiples of 336
    -> /255, CLIP mean / std; the global view: that tensor resized to 336 x 336 (torch
        bicubic, no antialias); the crops row-major -> pixels [1 + hc wc, 3, 336, 336]
        (global first; hc = H / 336, wc = W / 336: `image_size` = (hc, wc))
    each view -> CLIP ViT-L/14-336 (`img_processor.vision_model`, pre_layrnorm, no
        post_layernorm) up to hidden_states[layer_idx] (-2), CLS dropped -> 24 x 24 x C
    -> 2 x 2 patch merge (each 2 x 2 block one 4C row, its patches row-major) -> 12 x 12 a view;
        the crops' grids joined into [12 hc, 12 wc]
    rows: the crops' grid, each row ended by sub_GN; glb_GN; the global view's 12 x 12, each
        row ended by sub_GN ("sub_glb") -> img_projection (Linear 4C -> hidden, GELU, Linear)
        = (hc wc + 1) 144 + 1 + (hc + 1) 12 rows
    prompt: "<|image_i|>" in the text (i from 1, each image once, in order: vLLM's rule) ->
        a run of that many placeholders (id 32044, vLLM's; the remote processor writes -i);
        the text between the tags tokenized piece by piece, as the remote processor does

Weights: `model.vision_embed_tokens.{img_processor.vision_model.*, glb_GN, sub_GN,
img_projection.{0,2}.*}` (post_layernorm and the layers past layer_idx passed over; `wte` is
the text model's embedding table: models/text_wrappers.py). mm_processor_kwargs: `num_crops`
(vLLM passes it to the remote processor), an int in [1, MOST_CROPS].
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, TypedDict

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.models.phi3v_config import CROP, PATCH
from paged_engine.models.utils import load_named_weights
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.kwargs_budget import MOST_PIXELS
from paged_engine.multimodal.layouts import Layout, Loaded, Run, Size, _shape_error
from paged_engine.multimodal.vision_transformer import VisionTransformer

ARCH = "Phi3VForCausalLM"
GRID = CROP // PATCH // 2  # merged rows / cols a view: 12
MOST_CROPS = MOST_PIXELS // CROP**2  # num_crops bound: the HD image stays within MOST_PIXELS
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_TAG = re.compile(r"<\|image_(\d+)\|>")
_PREFIX = "model.vision_embed_tokens."


def image_tokens(hc: int, wc: int) -> int:
    """Rows of an HD image of hc x wc crops (the remote processor's num_img_tokens)."""
    return (hc * wc + 1) * GRID * GRID + 1 + (hc + 1) * GRID


def hd_size(width: int, height: int, num_crops: int) -> tuple[int, int, bool]:
    """(resized width, resized height, transposed) of the HD transform, in its landscape frame:
    the padded height is that height rounded up to a multiple of CROP."""
    transposed = width < height
    if transposed:
        width, height = height, width
    ratio = width / height
    scale = 1
    while scale * math.ceil(scale / ratio) <= num_crops:
        scale += 1
    new_w = int((scale - 1) * CROP)
    new_h = int(new_w / ratio)
    if new_h < 1:
        raise ValueError(
            f"multi_modal_data['image']: a {width} x {height} image resizes to no rows in the "
            "HD transform (aspect ratio too extreme)"
        )
    return new_w, new_h, transposed


def check_num_crops(value: Any, where: str = "mm_processor_kwargs['num_crops']") -> int:
    """`value` when it is an int in [1, MOST_CROPS]; ValueError naming `where` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MOST_CROPS:
        raise ValueError(f"{where} must be an int in [1, {MOST_CROPS}], got {value!r}")
    return value


class _Kwargs(TypedDict, total=False):
    num_crops: int


class Phi3VImageProcessor:
    """The remote Phi3VImageProcessor's steps (see the module) in PIL and torch."""

    valid_kwargs = _Kwargs

    def __init__(self, num_crops: int, mean: Sequence[float], std: Sequence[float]) -> None:
        self.num_crops = num_crops
        self.mean = torch.tensor(mean, dtype=torch.float32).view(3, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(3, 1, 1)

    def hd_image(self, image: Any, num_crops: int) -> Any:
        """The image resized and padded white (HD_transform, padding_336)."""
        from PIL import Image

        new_w, new_h, transposed = hd_size(*image.size, num_crops)
        if transposed:
            image = image.transpose(Image.Transpose.TRANSPOSE)
        image = image.resize((new_w, new_h), Image.Resampling.BILINEAR)
        target = math.ceil(new_h / CROP) * CROP
        canvas = Image.new("RGB", (new_w, target), (255, 255, 255))
        canvas.paste(image, (0, (target - new_h) // 2))
        return canvas.transpose(Image.Transpose.TRANSPOSE) if transposed else canvas

    def one(self, image: Any, num_crops: int) -> tuple[torch.Tensor, tuple[int, int]]:
        """(pixels [1 + hc wc, 3, CROP, CROP], (H, W)) of one image."""
        hd = self.hd_image(image, num_crops)
        x = torch.from_numpy(np.asarray(hd, dtype=np.uint8).copy()).permute(2, 0, 1)
        x = (x.float() / 255 - self.mean) / self.std  # [3, H, W]
        h, w = x.shape[1:]
        whole = F.interpolate(x[None], size=(CROP, CROP), mode="bicubic")
        crops = x.view(3, h // CROP, CROP, w // CROP, CROP).permute(1, 3, 0, 2, 4)
        return torch.cat([whole, crops.reshape(-1, 3, CROP, CROP)]), (h, w)

    def __call__(
        self, images: list[Any], return_tensors: str = "pt", num_crops: int | None = None
    ) -> dict[str, list]:
        crops = self.num_crops if num_crops is None else check_num_crops(num_crops)
        done = [self.one(image, crops) for image in images]
        return {"pixel_values": [p for p, _ in done], "image_sizes": [s for _, s in done]}


class Phi3VLayout(Layout):
    """A run of image_tokens(hc, wc) placeholders an image, where its "<|image_i|>" tag is (or
    a lone placeholder id); pixels [1 + hc wc, 3, 336, 336]; `image_size` (hc, wc)."""

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        self.config = config
        self.placeholder = placeholder
        self.tokenizer = tokenizer
        self.fixed = None
        self.num_crops = 1  # the remote Phi3VImageProcessor's default
        self.mean, self.std = _CLIP_MEAN, _CLIP_STD

    def read_saved(self, path: Path) -> None:
        """preprocessor_config.json's num_crops, image_mean, image_std (where there is one)."""
        file = Path(path) / "preprocessor_config.json"
        saved = json.loads(file.read_text()) if file.is_file() else {}
        if "num_crops" in saved:
            self.num_crops = check_num_crops(saved["num_crops"], f"{file}: num_crops")
        self.mean = tuple(saved.get("image_mean", self.mean))
        self.std = tuple(saved.get("image_std", self.std))

    def image_processor(self) -> Phi3VImageProcessor:
        return Phi3VImageProcessor(self.num_crops, self.mean, self.std)

    def check_kwargs(self, kwargs: dict[str, Any]) -> None:
        if "num_crops" in kwargs:
            check_num_crops(kwargs["num_crops"])

    def _size(self, size: Size) -> tuple[int, int]:
        if size is None or len(size) != 2 or min(size) < 1 or size[0] * size[1] > MOST_CROPS:
            raise ValueError(f"multi_modal_data['image']: image_size {size} is not (hc, wc)")
        return int(size[0]), int(size[1])

    def length(self, size: Size) -> int:
        return image_tokens(*self._size(size))

    def pixel_shape(self, size: Size) -> tuple[int, ...]:
        hc, wc = self._size(size)
        return (1 + hc * wc, 3, CROP, CROP)

    def load(self, run: Run, image: Any, count: int) -> Loaded:
        out = run([image])
        h, w = out["image_sizes"][0]
        size = (h // CROP, w // CROP)
        pixels = out["pixel_values"][0].float().contiguous()
        if tuple(pixels.shape) != self.pixel_shape(size):
            raise _shape_error(pixels, self.pixel_shape(size))
        return pixels, size

    def segment(self, loaded: Loaded) -> list[int]:
        # the base's run, but placed by `splice` (the prompt marks images with text tags)
        return [self.placeholder] * self.length(loaded[1])

    def splice(self, ids: list[int], segments: list[list[int]]) -> tuple[list[int], list[int]]:
        """Lone placeholder ids each become a segment (the base's rule); else each
        "<|image_i|>" tag of the decoded prompt does, the text between them tokenized piece
        by piece with the tokenizer's special tokens (HF's and vLLM's rule; the prompt's
        leading BOS, if any, is the first piece's)."""
        if self.placeholder in ids or self.tokenizer is None:
            return super().splice(ids, segments)
        tok = self.tokenizer
        bos = getattr(tok, "bos_token_id", None)
        body = ids[1:] if ids and bos is not None and ids[0] == bos else ids
        text = tok.decode(body, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        pieces = _TAG.split(text)  # [text, i, text, i, ..., text]
        tags = [int(i) for i in pieces[1::2]]
        if tags != list(range(1, len(segments) + 1)):
            named = ", ".join(f"<|image_{i}|>" for i in tags) or "none"
            raise ValueError(
                f"multi_modal_data['image'] has {len(segments)} image(s) but the prompt's image "
                f"tags are {named}: write <|image_1|> ... <|image_{len(segments)}|>, one per "
                "image, in order"
            )
        out: list[int] = []
        starts: list[int] = []
        for i, piece in enumerate(pieces[0::2]):
            if i:
                starts.append(len(out))
                out += segments[i - 1]
            out += tok(piece).input_ids
        return out, starts


class Phi3VImageEncoder(nn.Module):
    """Images -> rows of the text model's input embedding (`Phi3HDImageEmbedding`'s names)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        vision = config.vision_config
        layer = int(config.img_processor.get("layer_idx", -2))
        self.depth = int(vision.num_hidden_layers) + layer + 1  # hidden_states[layer_idx]
        width, hidden = int(vision.hidden_size), int(config.hidden_size)
        self.img_processor = nn.Module()
        self.img_processor.vision_model = VisionTransformer(vision, self.depth)
        self.glb_GN = nn.Parameter(torch.zeros(1, 1, 4 * width))
        self.sub_GN = nn.Parameter(torch.zeros(1, 1, 1, 4 * width))
        self.img_projection = nn.Sequential(
            nn.Linear(4 * width, hidden), nn.GELU(), nn.Linear(hidden, hidden)
        )

    def _merged(self, feats: torch.Tensor, hc: int, wc: int) -> torch.Tensor:
        """[hc wc, 24 * 24, C] crops (row-major) -> [12 hc, 12 wc + 1, 4C]: 2 x 2 blocks as
        rows, the crops' grids side by side, each row ended by sub_GN."""
        c = feats.shape[-1]
        x = feats.reshape(hc, wc, GRID, 2, GRID, 2, c).permute(0, 2, 1, 4, 3, 5, 6)
        x = x.reshape(hc * GRID, wc * GRID, 4 * c)
        newline = self.sub_GN.reshape(1, 1, 4 * c).expand(hc * GRID, 1, 4 * c)
        return torch.cat([x, newline], dim=1)

    def image_rows(self, feats: torch.Tensor, hc: int, wc: int) -> torch.Tensor:
        """One image's tower features [1 + hc wc, 576, C] -> its rows [image_tokens, hidden]."""
        c4 = 4 * feats.shape[-1]
        crops = self._merged(feats[1:], hc, wc).reshape(-1, c4)
        whole = self._merged(feats[:1], 1, 1).reshape(-1, c4)
        return self.img_projection(torch.cat([crops, self.glb_GN.reshape(1, c4), whole]))

    def encode(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        weight = self.img_projection[0].weight
        for m in images:
            assert m.pixel_values is not None and m.image_size is not None
        pixels = torch.cat([m.pixel_values for m in images]).to(weight.device, weight.dtype)
        feats = self.img_processor.vision_model(pixels, [self.depth])[0][:, 1:]  # CLS dropped
        out, at = [], 0
        for m in images:
            hc, wc = (int(v) for v in m.image_size)
            out.append(self.image_rows(feats[at : at + 1 + hc * wc], hc, wc))
            at += 1 + hc * wc
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's `model.vision_embed_tokens.*` tensors this encoder runs (`wte`,
        post_layernorm and the layers past layer_idx passed over)."""
        tower = "img_processor.vision_model."

        def ours(name: str) -> str | None:
            if not name.startswith(_PREFIX):
                return None
            name = name[len(_PREFIX) :]
            inner = name.removeprefix(tower)
            if name.startswith("wte.") or inner.startswith("post_layernorm."):
                return None
            if inner.startswith("encoder.layers.") and int(inner.split(".")[2]) >= self.depth:
                return None
            return name

        picked = ((n, t) for n, t in ((ours(n), t) for n, t in weights) if n is not None)
        return load_named_weights(self, picked)
