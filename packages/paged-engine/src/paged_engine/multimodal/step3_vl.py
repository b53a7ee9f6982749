"""Step3-VL's host side (`Step3VLForConditionalGeneration`, remote code: stepfun-ai/step3;
config models/step3_vl_config.py, tower multimodal/step3_vl_encoder.py): the image split into
views and the prompt tokens around them, as vLLM's Step3VLProcessor / ImagePatcher make them.

    views     an image (RGB) W x H: when min(W, H) < 32 and its ratio is past 4 (or 1/4),
              pasted at the top left of a black square of the longer side; when the longer
              side is past 3024, PIL bilinear resized to fit 3024 (int scale) -> image I.
              The window w: long <= 728: the short side if long / short > 1.5, else none;
              longer: min(short, 504) if long / short > 4, else 504.
              Global view: I -> [0, 1] -> (x - CLIP mean) / CLIP std -> bilinear antialiased
              resize to 728 x 728.
              Patches (only with a window): each side s of I becomes s when s < w, else
              w * (s // w, one more when s / w - s // w > 0.2); I PIL bilinear resized to
              that (unless it equals the size before the 3024 fit: vLLM compares those) and
              cut into w x w windows row-major from the top left (the last column / row
              moved back to end at the edge; a window past a side shorter than w reads
              black); each normalized as above and resized to 504 x 504
    prompt    each "<im_patch>" (the config's image_token_id) becomes, per patch,
              <patch_start> 81 x <im_patch> <patch_end> (then <patch_newline> after a row's
              last patch but the last row's), then <im_start> 169 x <im_patch> <im_end>

Each view is one `ImageInput` (its run of <im_patch>), pixels [3, S, S], image_size (S,): the
decoder takes the tower's rows there, patches first, as vLLM merges them. No mm_processor_kwargs
(vLLM's processor takes none); vLLM's image_embeds input is refused (takes_embeds), and so is
a thin image whose square pad would pass kwargs_budget.MOST_PIXELS (vLLM pastes it whole: an 8 x
20000 strip would take 20000 x 20000 pixels before the fit).
"""

from __future__ import annotations

from math import ceil
from typing import Any, ClassVar, TypedDict

import torch
import torch.nn.functional as F

from paged_engine.models.step3_vl_config import GLOBAL_ROWS, GLOBAL_SIDE, PATCH_ROWS, PATCH_SIDE
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.kwargs_budget import MOST_PIXELS
from paged_engine.multimodal.layouts import Layout, Loaded, Run, Size, digest, run_starts, token_ids
from paged_engine.multimodal.torch_processors import TorchImageProcessor

MAX_SIDE = 3024  # vLLM's MAX_IMAGE_SIZE
MEAN = (0.48145466, 0.4578275, 0.40821073)  # CLIP's, as vLLM's Step3VisionProcessor
STD = (0.26862954, 0.26130258, 0.27577711)
PATCH_START, PATCH_END, NEWLINE = "<patch_start>", "<patch_end>", "<patch_newline>"
IM_START, IM_END = "<im_start>", "<im_end>"
ROWS = {GLOBAL_SIDE: GLOBAL_ROWS, PATCH_SIDE: PATCH_ROWS}  # view side -> its placeholders


def padded_size(width: int, height: int) -> tuple[int, int]:
    """The size after the square pad of thin small images (module doc)."""
    ratio = width / height
    if min(width, height) < 32 and (ratio > 4 or ratio < 1 / 4):
        return max(width, height), max(width, height)
    return width, height


def fitted_size(width: int, height: int) -> tuple[int, int]:
    """The size after the fit to MAX_SIDE (int of the scaled sides, as vLLM)."""
    if max(width, height) > MAX_SIDE:
        scale = MAX_SIDE / max(width, height)
        return int(width * scale), int(height * scale)
    return width, height


def window_size(long: int, short: int) -> int:
    """The patch window's side; 0: no patches."""
    if long <= GLOBAL_SIDE:
        return short if long / short > 1.5 else 0
    return min(short, PATCH_SIDE) if long / short > 4 else PATCH_SIDE


def crop_side(side: int, window: int) -> int:
    """A side of the image the windows cut (module doc)."""
    ratio = side / window
    if ratio < 1:
        return side
    return window * (int(ratio) + 1 if ratio - side // window > 0.2 else int(ratio))


def _starts(side: int, window: int) -> list[int]:
    count = 1 if side <= window else ceil((side - window) / window + 1)
    starts = [window * i for i in range(count)]
    if count > 1 and starts[-1] + window > side:
        starts[-1] = side - window
    return starts


def plan(width: int, height: int) -> tuple[int, list[tuple[int, int]], list[bool], tuple[int, int]]:
    """(window, each patch's top-left (x, y) row-major, whether a <patch_newline> follows each
    patch, the size the windows cut) for an image of width x height; no patches: window 0."""
    width, height = fitted_size(*padded_size(width, height))
    window = window_size(max(width, height), min(width, height))
    if window == 0:
        return 0, [], [], (width, height)
    cut = crop_side(width, window), crop_side(height, window)
    xs, ys = _starts(cut[0], window), _starts(cut[1], window)
    corners = [(x, y) for y in ys for x in xs]
    ends = [(i + 1) % len(xs) == 0 and i < len(corners) - 1 for i in range(len(corners))]
    return window, corners, ends, cut


def num_tokens(width: int, height: int) -> int:
    """The prompt tokens an image of width x height becomes (vLLM's get_num_image_tokens)."""
    _, corners, ends, _ = plan(width, height)
    return len(corners) * (PATCH_ROWS + 2) + sum(ends) + GLOBAL_ROWS + 2


def _normalized(image: Any, side: int) -> torch.Tensor:
    """A PIL RGB image -> [3, side, side] float32: / 255, CLIP-normalized, then resized
    (bilinear, antialiased; torchvision's Resize after Normalize, as vLLM composes them)."""
    import numpy as np

    x = torch.from_numpy(np.asarray(image, dtype=np.uint8).copy()).permute(2, 0, 1).float() / 255
    x = (x - torch.tensor(MEAN).view(3, 1, 1)) / torch.tensor(STD).view(3, 1, 1)
    if tuple(x.shape[1:]) == (side, side):
        return x
    resized = F.interpolate(
        x[None], size=(side, side), mode="bilinear", antialias=True, align_corners=False
    )
    return resized[0]


def views(image: Any) -> tuple[list[torch.Tensor], list[bool]]:
    """A PIL image -> (its patch views [3, 504, 504] then the global view [3, 728, 728], the
    newline flags of the patches)."""
    from PIL import Image  # only where images arrive: the engine imports without Pillow

    image = image.convert("RGB")
    size = padded_size(*image.size)
    if size != image.size and size[0] * size[1] > MOST_PIXELS:  # before the 3024 fit
        raise ValueError(
            f"a {image.width} x {image.height} image is padded square to {size[0]} x "
            f"{size[1]} pixels first (vLLM's ImagePatcher), over the {MOST_PIXELS} an image "
            "may take"
        )
    if size != image.size:
        square = Image.new(image.mode, size, 0)
        square.paste(image, (0, 0))
        image = square
    fitted = fitted_size(*image.size)
    before = image.size
    image = image.resize(fitted, Image.Resampling.BILINEAR)
    window, corners, ends, cut = plan(*before)
    out = []
    if window:
        source = image if cut == before else image.resize(cut, Image.Resampling.BILINEAR)
        for x, y in corners:
            out.append(_normalized(source.crop((x, y, x + window, y + window)), PATCH_SIDE))
    return [*out, _normalized(image, GLOBAL_SIDE)], ends


class _NoKwargs(TypedDict):
    pass


class Step3VLImageProcessor(TorchImageProcessor):
    """vLLM's Step3VLProcessor's pixels: per image, its views flattened and concatenated
    (`pixel_values`) and (patches, *newline flags) (`image_sizes`)."""

    name = "Step3VLProcessor"
    defaults: ClassVar[dict[str, Any]] = {}
    valid_kwargs = _NoKwargs

    def load_image(self, image: Any) -> Any:
        return image  # PIL: vLLM's resizes and crops are PIL's

    def preprocess(self, images: list[Any], s: dict[str, Any]) -> dict[str, Any]:
        flat, sizes = [], []
        for image in images:
            made, ends = views(image)
            flat.append(torch.cat([v.flatten() for v in made]))
            sizes.append((len(made) - 1, *(int(e) for e in ends)))
        return {"pixel_values": flat, "image_sizes": sizes}


class Step3VLLayout(Layout):
    """The module doc's prompt; loaded: the views flattened, size (patches, *newline flags);
    one ImageInput a view, image_size (S,)."""

    takes_embeds = False
    refused_kwargs: ClassVar[dict[str, str]] = {}

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        self.config = config
        self.placeholder = placeholder
        self.fixed = None
        names = (PATCH_START, PATCH_END, NEWLINE, IM_START, IM_END)
        self.ids = dict(zip(names, token_ids(tokenizer, *names), strict=True))

    def image_processor(self) -> Step3VLImageProcessor:
        return Step3VLImageProcessor({}, self.config)

    def length(self, size: Size) -> int:
        if size is None or len(size) != 1 or size[0] not in ROWS:
            raise ValueError(f"multi_modal_data['image']: image_size {size} is not a Step3 view")
        return ROWS[size[0]]

    def pixel_shape(self, size: Size) -> tuple[int, ...]:
        self.length(size)
        assert size is not None
        return (3, size[0], size[0])

    def load(self, run: Run, image: Any, count: int) -> Loaded:
        out = run([image])
        return out["pixel_values"][0], tuple(out["image_sizes"][0])

    def segment(self, loaded: Loaded) -> list[int]:
        size = loaded[1]
        assert size is not None
        ids, run = self.ids, [self.placeholder]
        out: list[int] = []
        for newline in size[1:]:
            out += [ids[PATCH_START], *run * PATCH_ROWS, ids[PATCH_END]]
            out += [ids[NEWLINE]] if newline else []
        return [*out, ids[IM_START], *run * GLOBAL_ROWS, ids[IM_END]]

    def place(self, loaded: Loaded, at: int, segment: list[int]) -> list[ImageInput]:
        flat, size = loaded
        assert size is not None
        sides = [PATCH_SIDE] * size[0] + [GLOBAL_SIDE]
        made = flat.split([3 * s * s for s in sides])
        starts = run_starts(segment, self.placeholder)
        return [
            ImageInput(v.view(3, s, s), at + start, ROWS[s], digest(v.view(3, s, s), (s,)), (s,))
            for v, s, start in zip(made, sides, starts, strict=True)
        ]
