"""Image prompts on the host: images -> pixel values, each image token -> the tokens it stands for.

vLLM's prompt form: `{"prompt": "USER: <image>\\nWhat is this? ASSISTANT:",
"multi_modal_data": {"image": image_or_list}}` (or `prompt_token_ids`). Each image token in the
prompt stands for one image, in order. The checkpoint's own image processor
(preprocessor_config.json: resize, crop / tile, normalize, as HF's processors run it) gives the
image's pixel values (where transformers builds that processor on torchvision alone and
torchvision is missing, multimodal/torch_processors.py's torch copy of it); the wrapper's
layout (multimodal/layout_table.py) says what the image token becomes (a run of placeholders, one
per feature row; tiles with text between them; lines of placeholders with break tokens) and
where each `ImageInput` sits. For run layouts a prompt whose runs are expanded already (token
ids of an earlier output, or a client's HF processor) is taken as it is. Also: images processed
ahead (`ImageInput`s, from a server's request thread), vLLM's image features input (`embeds`),
vLLM's mm_processor_kwargs.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from paged_engine.multimodal.archs import IMAGE_ARCHS, image_kind
from paged_engine.multimodal.inputs import ImageInput, check_decodes, to_rgb
from paged_engine.multimodal.kwargs_budget import (
    MOST_PIXELS,
    check_budget,
    pixels_per_token,
    resized_pixels,
)
from paged_engine.multimodal.layout_table import LAYOUTS
from paged_engine.multimodal.layouts import (
    Layout,
    Loaded,
    digest,
    expand_runs,
    run_starts,
)
from paged_engine.multimodal.llava import image_token_id
from paged_engine.multimodal.mrope import MropePositions
from paged_engine.multimodal.processor_cache import ProcessorCache, image_key
from paged_engine.multimodal.processor_files import check_processor_files
from paged_engine.multimodal.torch_processors import image_processor

logger = logging.getLogger(__name__)

_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
# mm_processor_kwargs that would change what the vision encoder reads: refused
_LAYOUT_KWARGS = {
    "patch_size",
    "merge_size",
    "temporal_patch_size",
    "return_tensors",
    "data_format",
    "input_data_format",
    "device",
    "image_seq_length",
    "disable_grouping",
}
_PIXEL_BOUNDS = {"min_pixels": "shortest_edge", "max_pixels": "longest_edge"}  # Qwen2-VL


def require_pillow():
    try:
        import PIL.Image
    except ImportError as e:
        raise ImportError("image inputs need Pillow: pip install 'paged-engine[vision]'") from e
    return PIL.Image


def wrapper_config(path: Path, trust_remote_code: bool = False) -> Any | None:
    """The checkpoint's own config when it is a wrapper whose images paged runs, else None."""
    from transformers import AutoConfig

    from paged_engine.mistral_format import mistral_wrapper_config
    from paged_engine.mistral_vision import native_vision
    from paged_engine.models.remote_aliases import remote_config
    from paged_engine.multimodal.internvl_chat import chat_config

    if native_vision(path):  # Mistral's params.json (Pixtral): its HF wrapper's config
        return mistral_wrapper_config(Path(path))
    config = (
        chat_config(path)
        or remote_config(path)  # a renamed class (Qwen2_5OmniModel)
        or AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    )
    archs = getattr(config, "architectures", None) or []
    if not any(a in IMAGE_ARCHS for a in archs):
        return None
    from paged_engine.multimodal.qwen_omni import thinker_config

    return thinker_config(config)


def processor_saved(path: Path) -> bool:
    """Whether the checkpoint holds its image processor (transformers 5 saves it inside
    processor_config.json; Mistral's native Pixtral: params.json and tekken.json say it)."""
    from paged_engine.mistral_vision import native_vision

    return any((Path(path) / f).exists() for f in _PROCESSOR_FILES) or native_vision(path)


def builds_own_processor(config: Any) -> bool:
    """Whether the wrapper's layout builds its image processor from the config (InternVL-Chat:
    multimodal/internvl_chat.py), so that no processor file is needed."""
    return hasattr(LAYOUTS[image_kind(config)], "image_processor")


def _rehashed(m: ImageInput) -> ImageInput:
    """A processed-ahead image hashed again from what it carries: with a stale hash (its
    pixels changed after processing) its rows would be cached as the image it names, and
    served to every later request for that image."""
    values = m.pixel_values if m.pixel_values is not None else m.embeds
    return m if values is None else dataclasses.replace(m, mm_hash=digest(values, m.image_size))


def _array_image(array: np.ndarray, what: str, PIL_Image: Any) -> Any:
    """A uint8 (H, W), (H, W, 1), (H, W, 3) or (H, W, 4) array as a PIL image (L, RGB, RGBA);
    ValueError naming `what` for any other dtype or shape."""
    shape_ok = array.ndim == 2 or (array.ndim == 3 and array.shape[-1] in (1, 3, 4))
    if array.dtype != np.uint8 or not shape_ok or 0 in array.shape:
        raise ValueError(
            f"{what}: a numpy image must be uint8 of shape (H, W), (H, W, 1), (H, W, 3) or "
            f"(H, W, 4), got {array.dtype} {tuple(array.shape)}"
        )
    if array.ndim == 3 and array.shape[-1] == 1:
        array = array[..., 0]
    return PIL_Image.fromarray(np.ascontiguousarray(array))


def as_image(item: Any, where: str) -> Any:
    """One image input as a decoded PIL image: a uint8 numpy array (H, W[, 1 | 3 | 4]), which
    vLLM also takes, becomes the image PIL makes of it; another type, an undecodable file or a
    0-pixel image is a ValueError naming `where` (processors divide by a side)."""
    PIL_Image = require_pillow()
    if isinstance(item, np.ndarray):
        item = _array_image(item, where, PIL_Image)
    if not isinstance(item, PIL_Image.Image):
        raise ValueError(
            f"{where} must be a PIL.Image.Image or a uint8 numpy array, got {type(item).__name__}"
        )
    check_decodes(item, where)
    if 0 in item.size:
        raise ValueError(f"{where} is {_pixels(item)}: an image needs at least one pixel each way")
    return item


def _flat(images: Any) -> list[Any]:
    """The images of a (nested) list, as HF's processors take them."""
    return [i for x in images for i in _flat(x)] if isinstance(images, list) else [images]


def _pixels(image: Any) -> str:
    """An image's size as errors name it: "{width}x{height} pixels"."""
    size = getattr(image, "size", None)
    if not isinstance(size, tuple) or len(size) != 2:
        return "unknown size"
    return f"{size[0]}x{size[1]} pixels"


def _is_embeds(data: Any) -> bool:
    """Whether multi_modal_data['image'] holds features rather than images."""
    if isinstance(data, (torch.Tensor, dict)):
        return True
    return (
        isinstance(data, (list, tuple))
        and bool(data)
        and all(isinstance(d, torch.Tensor) for d in data)
    )


class ImageProcessor:
    """Turns a prompt's images into `ImageInput`s placed in its token ids."""

    def __init__(
        self, path: Path, config: Any, limit: int | None = None, tokenizer: Any = None
    ) -> None:
        self.path = Path(path)
        check_processor_files(self.path)  # broken processor files refused at engine start
        self.config = config
        self.image_token_id = image_token_id(config)
        self.kind = image_kind(config)
        layout = LAYOUTS[self.kind]
        self.layout: Layout = layout(config, self.image_token_id, tokenizer)
        saved = getattr(self.layout, "read_saved", None)  # processor_config.json's (Janus')
        if saved is not None:
            saved(self.path)
        # placeholders an image takes; None where each image's size decides
        self.tokens_per_image = self.layout.fixed
        self.limit = limit  # images per prompt (limit_mm_per_prompt["image"]); None: any
        self.kwargs: dict[str, Any] = {}  # the engine's mm_processor_kwargs, checked
        self.cache: ProcessorCache | None = None  # mm_processor_cache_gb (set by the engine)
        self.max_model_len: int | None = None  # bounds what kwargs may make (set by the engine)
        # a layout that builds its image processor from the config (InternVL-Chat)
        self._own_processor = getattr(self.layout, "image_processor", None)
        if self._own_processor is None and not processor_saved(self.path):
            raise ValueError(
                f"{path} has neither preprocessor_config.json nor processor_config.json: the "
                "image processor of "
                f"{config.architectures[0]} is needed to run its images (pass "
                "limit_mm_per_prompt={'image': 0} to serve its text model only)"
            )
        self._hf = None  # the image processor (`hf`), loaded with the first image

    @property
    def hf(self):
        """transformers' image processor, or (where it needs the missing torchvision) our torch
        copy of it (multimodal/torch_processors.py), called the same way."""
        if self._hf is None and self._own_processor is not None:
            self._hf = self._own_processor()
        if self._hf is None:
            self._hf = image_processor(self.path, self.config)
        return self._hf

    @property
    def _runs_only(self) -> bool:
        """Whether an image token becomes a plain run of placeholders (and nothing else)."""
        return type(self.layout).segment is Layout.segment

    def process(
        self, token_ids: list[int], images: Any, kwargs: Any = None
    ) -> tuple[list[int], tuple[ImageInput, ...]]:
        """(token ids with each image's tokens, the images); ValueError naming
        multi_modal_data for anything wrong with the images or their placeholders. Items that
        are `ImageInput`s already (this method's output, e.g. from a server that processed the
        images on its request thread) are taken as they are once they check out against the
        prompt. `kwargs`: the prompt's mm_processor_kwargs, on top of the engine's. Features
        instead of images (vLLM's embedding input) become images with `embeds`."""
        if _is_embeds(images):
            self._check_takes_embeds()
            return self._embedded(token_ids, images)
        items = list(images) if isinstance(images, (list, tuple)) else [images]
        if not items:
            raise ValueError("multi_modal_data['image'] is empty: give an image or leave it out")
        if all(isinstance(m, ImageInput) for m in items):  # checked where they were made
            items = [_rehashed(m) for m in items]
            return self._finish(*self._placed(token_ids, items))
        self._check_limit(len(items))
        items = [as_image(m, f"multi_modal_data['image'][{i}]") for i, m in enumerate(items)]
        call = self.kwargs if kwargs is None else {**self.kwargs, **self.processor_kwargs(kwargs)}
        check = getattr(self.layout, "check_kwargs", None)  # a family's bounds, before any pixel
        if check is not None:
            check(call)
        self._check_own_resize(items, call)
        ppt = pixels_per_token(self.hf) if call else None
        size = next((k for k in _PIXEL_BOUNDS if k in (kwargs or {})), "size")  # as given
        for image in items if call else ():  # what the processor would make of each, unmade
            check_budget(call, self.hf, image.size, ppt, self.max_model_len, size, self.kind)
        run = self._runner(call, sorted(kwargs or ()))
        loaded = [self._load(run, image, call, len(items)) for image in items]
        segments = [self.layout.segment(x) for x in loaded]
        if self._runs_only:
            token_ids = self.expand(token_ids, [len(s) for s in segments])
            starts = self._run_starts(token_ids)
        else:
            token_ids, starts = self._locate(token_ids, segments)
        out: list[ImageInput] = []
        for x, at, segment in zip(loaded, starts, segments, strict=True):
            out += self.layout.place(x, at, segment)
        return self._finish(token_ids, tuple(out))

    def _check_own_resize(self, items: list[Any], call: dict[str, Any]) -> None:
        """ValueError naming the image where the checkpoint's own aspect-keeping resize (a
        `size` of shortest_edge alone: CLIP's, LLaVA 1.5's) would make more than
        kwargs_budget.MOST_PIXELS of a thin strip before its center crop: 1 x 10000 at 336
        is 336 x 3360000 pixels, 11 GB and 40 s. A `size` the request or engine gives is
        check_budget's; LLaVA-NeXT's pinpoint processors resize the base image to a square."""
        size = getattr(self.hf, "size", None) or {}
        get = size.get if isinstance(size, dict) else lambda k: getattr(size, k, None)  # SizeDict
        short = get("shortest_edge")
        others = any(get(k) for k in ("height", "width", "longest_edge"))
        pinpoints = getattr(self.hf, "image_grid_pinpoints", None) is not None
        if not isinstance(short, int) or others or pinpoints or "size" in call:
            return
        for i, image in enumerate(items):
            made = resized_pixels("size", {"shortest_edge": short}, image.size, as_pixels=False)
            if made > MOST_PIXELS:
                raise ValueError(
                    f"multi_modal_data['image'][{i}]: image {i} of the prompt is "
                    f"{_pixels(image)} (width x height), too thin: this model's image "
                    "processor would resize it "
                    f"to ~{made:.3g} pixels (shortest edge {short}), over the {MOST_PIXELS} "
                    "an image may take"
                )

    def _finish(
        self, token_ids: list[int], images: tuple[ImageInput, ...]
    ) -> tuple[list[int], tuple[ImageInput, ...]]:
        """The layout's last word on the whole prompt's images (PaliGemma: its prefix)."""
        finish = getattr(self.layout, "finish", None)
        return token_ids, images if finish is None else finish(token_ids, images)

    def _load(self, run: Any, image: Any, kwargs: dict[str, Any], count: int) -> Loaded:
        """The layout's load of one image of `count`, or what the processor cache holds."""
        if self.cache is None:
            return self.layout.load(run, image, count)
        # 1, 2 and more images apart (H2OVL: one alone; DeepSeek-VL2: up to two tiled)
        key = image_key(
            image, {**kwargs, "(images)": min(count, 3)} if self.layout.by_count else kwargs
        )
        loaded = self.cache.get(key)
        if loaded is None:
            loaded = self.layout.load(run, image, count)
            self.cache.put(key, loaded)
        return loaded

    def _runner(self, kwargs: dict[str, Any], given: list[str] | None = None):
        """The image processor on a list of images (as HF's processor nests them), the
        layout's arguments under the request's; its failures as ValueErrors (naming `given`,
        the request's own mm_processor_kwargs)."""
        named = f" with mm_processor_kwargs {given}" if given else ""

        def run(images: list[Any], **extra: Any) -> Any:
            def rgb(x: Any) -> Any:  # transparency over white, as transformers' processors
                return [rgb(i) for i in x] if isinstance(x, list) else to_rgb(x)

            try:
                return self.hf(images=rgb(images), return_tensors="pt", **{**extra, **kwargs})
            except Exception as e:  # a corrupt or truncated image, a size the processor refuses
                what = ", ".join(_pixels(x) for x in _flat(images))
                raise ValueError(
                    f"multi_modal_data['image']: the image of {what} (width x height) could "
                    f"not be processed{named}: {str(e) or type(e).__name__}"
                ) from e

        return run

    def _placed(
        self, token_ids: list[int], images: list[ImageInput]
    ) -> tuple[list[int], tuple[ImageInput, ...]]:
        """Images processed ahead: each must be what this model reads, where the prompt (its
        runs expanded, for run layouts) holds its tokens, and they cover every placeholder."""
        placed = getattr(self.layout, "placed", None)  # Mllama: images span the whole prompt
        if placed is not None:
            return placed(token_ids, images)
        if self._runs_only:
            token_ids = self.expand(token_ids, [self._fits(m) for m in images])
            ok = [m.offset for m in images] == self._run_starts(token_ids)
        else:
            spans = [
                self.layout.span(m)
                for m in images
                if self.layout.fits(m) or (m.embeds is not None and self._fits(m))
            ]
            ok = (
                len(spans) == len(images)
                and all(token_ids[m.offset : m.end] == s for m, s in zip(images, spans))
                and all(a.end <= b.offset for a, b in itertools.pairwise(images))
                and sum(s.count(self.image_token_id) for s in spans)
                == token_ids.count(self.image_token_id)
            )
        if not ok:
            raise ValueError(
                "multi_modal_data['image']: these processed images do not fit this prompt and "
                "model (their placeholder runs or pixel shapes differ)"
            )
        return token_ids, tuple(images)

    def _find(self, ids: list[int], segments: list[list[int]]) -> list[int] | None:
        """Where each segment starts, in order, when the prompt holds them all already and no
        other placeholder; else None."""
        tid = self.image_token_id
        if sum(s.count(tid) for s in segments) != ids.count(tid):
            return None
        starts, at = [], 0
        for segment in segments:
            first = segment[0]
            while True:
                try:
                    at = ids.index(first, at)
                except ValueError:
                    return None
                if ids[at : at + len(segment)] == segment:
                    break
                at += 1
            starts.append(at)
            at += len(segment)
        return starts

    def _locate(self, ids: list[int], segments: list[list[int]]) -> tuple[list[int], list[int]]:
        """(the prompt holding the segments, where each starts): as it is when it holds them
        already (an HF processor's ids), else with the layout's splice."""
        found = self._find(ids, segments)
        return (ids, found) if found is not None else self.layout.splice(ids, segments)

    def _check_takes_embeds(self) -> None:
        if not self.layout.takes_embeds:
            raise ValueError(
                "multi_modal_data['image']: image embeddings are not supported for "
                f"{self.config.architectures[0]} (give the images)"
            )

    def _fits(self, m: ImageInput) -> int:
        """The run of a processed image: ValueError unless its pixels (or features) are what
        this model reads for an image of its size."""
        if m.embeds is not None:
            self._check_takes_embeds()
            self._check_embeds(m.embeds, "an image's embeds")
            if self.layout.mrope and m.length != self.layout.length(m.image_size):
                raise ValueError("multi_modal_data['image']: embeds do not fit their grid")
            if m.length != m.embeds.shape[0]:
                raise ValueError("multi_modal_data['image']: embeds do not fit their run")
            return m.length
        if not self.layout.fits(m):
            raise ValueError(
                "multi_modal_data['image']: these processed images do not fit this prompt and "
                "model (their placeholder runs or pixel shapes differ)"
            )
        return m.length

    def _embedded(
        self, token_ids: list[int], data: Any
    ) -> tuple[list[int], tuple[ImageInput, ...]]:
        """vLLM's image embeddings: a tensor [images, rows, hidden] or [rows, hidden], a list
        of [rows, hidden] tensors, or {"image_embeds": ..., "image_grid_thw": [images, 3]}
        (Qwen2-VL: the grid places the rows' M-RoPE positions; its rows are all images' rows
        concatenated)."""
        grids: list[tuple[int, ...] | None] | None = None
        if isinstance(data, dict):
            extra = sorted(set(data) - {"image_embeds", "image_grid_thw"})
            if extra or "image_embeds" not in data:
                raise ValueError(
                    "multi_modal_data['image'] as a dict takes 'image_embeds' (and Qwen2-VL's "
                    f"'image_grid_thw'); got keys {sorted(data)}"
                )
            grid = data.get("image_grid_thw")
            if grid is not None:
                grids = [tuple(int(x) for x in g) for g in torch.as_tensor(grid).tolist()]
                if any(len(g) != 3 for g in grids):
                    raise ValueError("multi_modal_data['image']['image_grid_thw'] must be [N, 3]")
            data = data["image_embeds"]
        if self.layout.mrope and grids is None:
            raise ValueError(
                "multi_modal_data['image']: Qwen2-VL image embeddings need their "
                "'image_grid_thw' beside 'image_embeds' (the M-RoPE positions follow the grid)"
            )
        if isinstance(data, torch.Tensor) and data.dim() == 3:
            embeds = list(data.unbind(0))
        elif isinstance(data, torch.Tensor) and grids is not None:  # rows of all images
            lengths = [self.layout.length(g) for g in grids]
            if data.dim() != 2 or data.shape[0] != sum(lengths):
                raise ValueError(
                    f"multi_modal_data['image']['image_embeds'] has shape {tuple(data.shape)}; "
                    f"its image_grid_thw gives {sum(lengths)} rows"
                )
            embeds = list(data.split(lengths))
        elif isinstance(data, torch.Tensor):
            embeds = [data]
        else:
            embeds = list(data)
        for e in embeds:
            self._check_embeds(e, "image embeds")
        if grids is None:
            grids = [None] * len(embeds)
        elif len(grids) != len(embeds):
            raise ValueError(
                f"multi_modal_data['image']: {len(embeds)} embeddings for {len(grids)} grids"
            )
        self._check_limit(len(embeds))
        lengths = [e.shape[0] for e in embeds]
        if self.layout.mrope and lengths != [self.layout.length(g) for g in grids]:
            raise ValueError("multi_modal_data['image']: image embeds do not fit their grids")
        if self._runs_only:
            token_ids = self.expand(token_ids, lengths)
            starts = self._run_starts(token_ids)
        else:  # a run between other tokens (InternVL's <img> ... </img>)
            spans = [self.layout.features_segment(n) for n in lengths]
            token_ids, found = self._locate(token_ids, [segment for segment, _ in spans])
            starts = [at + skip for at, (_, skip) in zip(found, spans, strict=True)]
        out = tuple(
            ImageInput(None, offset, n, digest(e, g), g, embeds=e.detach().cpu())
            for e, offset, n, g in zip(embeds, starts, lengths, grids, strict=True)
        )
        return token_ids, out

    def _check_embeds(self, e: Any, what: str) -> None:
        text = getattr(self.config, "text_config", None) or self.config  # (Phi-4-mm: flat)
        hidden = int(text.hidden_size)
        if (
            not isinstance(e, torch.Tensor)
            or e.dim() != 2
            or e.shape[0] < 1
            or e.shape[1] != hidden
            or not e.is_floating_point()
        ):
            shape = tuple(e.shape) if isinstance(e, torch.Tensor) else type(e).__name__
            raise ValueError(
                f"multi_modal_data['image']: {what} must be float tensors [rows, {hidden}] "
                f"(the text model's hidden size), got {shape}"
            )
        if not bool(torch.isfinite(e).all()):
            raise ValueError(f"multi_modal_data['image']: {what} hold NaN or infinite values")

    def positions(self, num_tokens: int, images: tuple[ImageInput, ...]) -> MropePositions | None:
        """The prompt's M-RoPE positions where the model has them (Qwen-VL), else None."""
        return self.layout.positions(num_tokens, images)

    def _run_starts(self, ids: list[int]) -> list[int]:
        return run_starts(ids, self.image_token_id)

    def _check_limit(self, count: int) -> None:
        if self.limit is not None and count > self.limit:
            raise ValueError(
                f"multi_modal_data['image'] has {count} images, over "
                f"limit_mm_per_prompt={{'image': {self.limit}}}"
            )

    def processor_kwargs(self, kwargs: Any) -> dict[str, Any]:
        """vLLM's mm_processor_kwargs as the image processor takes them; ValueError naming
        mm_processor_kwargs for a name it does not take or one that would change the layout
        the vision encoder reads (patch and merge sizes, tensor formats). Qwen2-VL's
        min_pixels / max_pixels become its size's shortest_edge / longest_edge."""
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
            raise ValueError(
                f"mm_processor_kwargs must be a dict of argument names, got {type(kwargs).__name__}"
            )
        refused = getattr(self.layout, "refused_kwargs", {})  # a family's own word on a name
        for name in sorted(set(kwargs) & set(refused)):
            raise ValueError(f"mm_processor_kwargs[{name!r}]: {refused[name]}")
        valid = getattr(getattr(self.hf, "valid_kwargs", None), "__annotations__", {})
        known = set(valid) - _LAYOUT_KWARGS
        bad = sorted(k for k in kwargs if k not in known)
        if bad:
            raise ValueError(
                f"mm_processor_kwargs[{bad[0]!r}] is not an argument this model's image "
                f"processor takes; it takes {sorted(known) or 'none'}"
            )
        out = {k: v for k, v in kwargs.items() if k not in _PIXEL_BOUNDS}
        bounds = {k: kwargs[k] for k in _PIXEL_BOUNDS if k in kwargs}
        if bounds:  # the size dict transformers 5 reads (min_pixels / max_pixels: deprecated)
            for name, value in bounds.items():
                if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                    raise ValueError(f"mm_processor_kwargs[{name!r}] must be an int > 0")
            size = dict(out.get("size") or self.hf.size)
            size.update({_PIXEL_BOUNDS[k]: v for k, v in bounds.items()})
            low, high = size.get("shortest_edge"), size.get("longest_edge")
            if "min_pixels" in bounds and high is not None and low > high:  # else upscaled past
                raise ValueError(
                    f"mm_processor_kwargs['min_pixels'] ({low}) exceeds max_pixels ({high})"
                )
            out["size"] = size
        return out

    def expand(self, ids: list[int], lengths: list[int]) -> list[int]:
        """Each lone placeholder -> a run of its image's length; runs already that long stay
        (ValueError unless there is one placeholder or run per image). A server calls it to
        know the prompt's length before the engine takes the images."""
        return expand_runs(ids, self.image_token_id, lengths, "image")[0]
