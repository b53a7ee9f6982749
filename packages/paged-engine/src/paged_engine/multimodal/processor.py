"""Image prompts on the host: images -> pixel values, one placeholder -> a run of placeholders.

vLLM's prompt form: `{"prompt": "USER: <image>\\nWhat is this? ASSISTANT:",
"multi_modal_data": {"image": image_or_list}}` (or `prompt_token_ids`). Each image token in the
prompt stands for one image, in order; it becomes a run of as many copies of itself as the
image has feature rows (LLaVA: `tokens_per_image`, the same for every image; LLaVA-NeXT: by the
image's size, multimodal/llava_next.py), and the image becomes an `ImageInput` at that run. A
prompt whose runs are expanded already (token ids of an earlier output, or a client's HF
processor) is taken as it is. Images go through the checkpoint's own image processor
(preprocessor_config.json: resize, crop / tile, normalize), as HF's LlavaProcessor and
LlavaNextProcessor run them.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

import torch

from paged_engine.multimodal import idefics3, qwen2_vl
from paged_engine.multimodal.archs import IMAGE_ARCHS, image_kind
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.llava import image_token_id, tokens_per_image
from paged_engine.multimodal.llava_next import AnyRes

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

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    archs = getattr(config, "architectures", None) or []
    return config if any(a in IMAGE_ARCHS for a in archs) else None


def processor_saved(path: Path) -> bool:
    """Whether the checkpoint holds its image processor (transformers 5 saves it inside
    processor_config.json)."""
    return any((Path(path) / f).exists() for f in _PROCESSOR_FILES)


def _digest(values: torch.Tensor, size: tuple[int, ...] | None) -> str:
    data = values.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    h = hashlib.blake2b(data, digest_size=16)
    h.update(repr((size, values.dtype, tuple(values.shape))).encode())
    return h.hexdigest()


def _token_ids(tokenizer: Any, *tokens: str) -> tuple[int, ...]:
    """The ids of special tokens the tokenizer must hold (ValueError naming the missing)."""
    if tokenizer is None:
        raise ValueError(f"the tokenizer is needed for the image tokens {tokens}")
    vocab = tokenizer.get_vocab()
    missing = [t for t in tokens if t not in vocab]
    if missing:
        raise ValueError(f"the tokenizer has no {missing[0]} token, which images need")
    return tuple(vocab[t] for t in tokens)


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
        self.config = config
        self.kind = image_kind(config)
        self.image_token_id = image_token_id(config)
        self.anyres = AnyRes.from_config(config) if self.kind == "llava_next" else None
        # placeholders an image takes; None where its size decides (LLaVA-NeXT, Qwen2-VL)
        self.tokens_per_image = tokens_per_image(config) if self.kind == "llava" else None
        # Idefics3 / SmolVLM: placeholders of a tile; an image's text around its tiles is
        # tokenized with the model's tokenizer
        self.tile = idefics3.tile_tokens(config) if self.kind == "idefics3" else None
        self.tokenizer = tokenizer
        # InternVL: placeholders of a tile; an image's run sits between <img> and </img>
        self.tile_rows = 0
        if self.kind == "internvl":
            from paged_engine.multimodal import internvl

            self.tile_rows = internvl.patch_tokens(config)
            self.bounds = _token_ids(
                tokenizer,
                getattr(tokenizer, "start_image_token", None) or "<img>",
                getattr(tokenizer, "end_image_token", None) or "</img>",
            )
        # Pixtral / Mistral 3: an image's side in pixels per placeholder, its line-break tokens
        self.unit = 0
        if self.kind == "pixtral":
            from paged_engine.multimodal import pixtral

            self.unit = pixtral.patch_size(config) * pixtral.merge_size(config)
            self.breaks = _token_ids(tokenizer, "[IMG_BREAK]", "[IMG_END]")
        # Qwen2-VL: each prompt's M-RoPE positions (`positions`)
        self.mrope = self.kind == "qwen2_vl"
        if self.mrope:
            qwen2_vl.check_config(config)
        self.limit = limit  # images per prompt (limit_mm_per_prompt["image"]); None: any
        self.kwargs: dict[str, Any] = {}  # the engine's mm_processor_kwargs, checked
        if not processor_saved(self.path):
            raise ValueError(
                f"{path} has neither preprocessor_config.json nor processor_config.json: the "
                "image processor of "
                f"{config.architectures[0]} is needed to run its images (pass "
                "limit_mm_per_prompt={'image': 0} to serve its text model only)"
            )
        self._hf = None  # transformers' image processor, loaded with the first image

    @property
    def hf(self):
        if self._hf is None:
            from transformers import AutoImageProcessor

            self._hf = AutoImageProcessor.from_pretrained(self.path)
        return self._hf

    def process(
        self, token_ids: list[int], images: Any, kwargs: Any = None
    ) -> tuple[list[int], tuple[ImageInput, ...]]:
        """(token ids with each image's placeholder run, the images); ValueError naming
        multi_modal_data for anything wrong with the images or their placeholders. Items that
        are `ImageInput`s already (this method's output, e.g. from a server that processed the
        images on its request thread) are taken as they are once their runs check out.
        `kwargs`: the prompt's mm_processor_kwargs, on top of the engine's. Features instead of
        images (vLLM's embedding input: `embedding_inputs`) become images with `embeds`."""
        if _is_embeds(images):
            if self.tile is not None or self.unit or self.tile_rows:
                raise ValueError(
                    "multi_modal_data['image']: image embeddings are not supported for "
                    f"{self.config.architectures[0]} (give the images)"
                )
            return self._embedded(token_ids, images)
        items = list(images) if isinstance(images, (list, tuple)) else [images]
        if not items:
            raise ValueError("multi_modal_data['image'] is empty: give an image or leave it out")
        if self.unit and all(isinstance(m, ImageInput) for m in items):
            return self._spans_in_place(token_ids, items)
        if all(isinstance(m, ImageInput) for m in items):  # checked where they were made
            token_ids = self.expand(token_ids, [self._fits(m) for m in items])
            if [m.offset for m in items] != self._run_starts(token_ids):
                raise ValueError(
                    "multi_modal_data['image']: these processed images do not fit this prompt "
                    "and model (their placeholder runs or pixel shapes differ)"
                )
            return token_ids, tuple(items)
        if self.limit is not None and len(items) > self.limit:
            raise ValueError(
                f"multi_modal_data['image'] has {len(items)} images, over "
                f"limit_mm_per_prompt={{'image': {self.limit}}}"
            )
        items = self._image_list(items)
        call = self.kwargs if kwargs is None else {**self.kwargs, **self.processor_kwargs(kwargs)}
        if self.tile is not None:
            return self._tiles(token_ids, items, call)
        if self.unit:
            return self._spans(token_ids, items, call)
        if self.tile_rows:
            return self._internvl(token_ids, items, call)
        pixels, sizes = self._pixels(items, call)
        lengths = [self.length(size) for size in sizes]
        token_ids = self.expand(token_ids, lengths)
        starts = self._run_starts(token_ids)
        out = tuple(
            ImageInput(p, offset, n, _digest(p, size), size)
            for p, offset, n, size in zip(pixels, starts, lengths, sizes, strict=True)
        )
        return token_ids, out

    def _tiles(
        self, token_ids: list[int], images: list[Any], kwargs: dict[str, Any]
    ) -> tuple[list[int], tuple[ImageInput, ...]]:
        """Idefics3 / SmolVLM: each image's tiles (the processor's rows x cols, then the whole
        image), its <image> token replaced by HF's text around the tiles' runs."""
        assert self.tile is not None and self.tokenizer is not None
        side = (3, self.image_size, self.image_size)
        segments: list[list[int]] = []
        tiles: list[torch.Tensor] = []
        for image in images:
            try:
                out = self.hf(
                    images=[[image.convert("RGB")]],
                    return_tensors="pt",
                    return_row_col_info=True,
                    **kwargs,
                )
            except Exception as e:  # a corrupt image, a size the processor refuses
                raise ValueError(
                    f"multi_modal_data['image']: the image could not be processed: {e}"
                ) from e
            rows, cols = int(out["rows"][0][0]), int(out["cols"][0][0])
            pixels = out["pixel_values"][0].float()
            count = rows * cols + 1 if rows or cols else 1
            if tuple(pixels.shape) != (count, *side):
                raise ValueError(
                    f"the image processor gave pixel values of shape {tuple(pixels.shape)}, not "
                    f"{(count, *side)} ({rows} x {cols} tiles and the whole image)"
                )
            text = idefics3.image_prompt(rows, cols, self.tile)
            segments.append(self.tokenizer.encode(text, add_special_tokens=False))
            tiles.extend(pixels.unbind(0))
        token_ids = self._splice(token_ids, segments)
        starts = self._run_starts(token_ids)
        if len(starts) != len(tiles):  # the tokenizer did not keep <image> whole
            raise ValueError(
                f"the expanded prompt holds {len(starts)} image runs for {len(tiles)} tiles: "
                "check the tokenizer's image tokens"
            )
        return token_ids, tuple(
            ImageInput(p, offset, self.tile, _digest(p, None))
            for p, offset in zip(tiles, starts, strict=True)
        )

    def _internvl(
        self, token_ids: list[int], images: list[Any], kwargs: dict[str, Any]
    ) -> tuple[list[int], tuple[ImageInput, ...]]:
        """InternVL: each image's tiles (the processor's crop to patches: a grid of tiles and,
        for more than one, a thumbnail), its placeholder replaced by <img>, a run of tile_rows
        per tile, </img>."""
        kwargs = {"crop_to_patches": True, **kwargs}  # what InternVLProcessor asks for
        start, end = self.bounds
        side = self.image_size
        pixels: list[torch.Tensor] = []
        segments: list[list[int]] = []
        for image in images:
            try:
                out = self.hf(images=[image.convert("RGB")], return_tensors="pt", **kwargs)
            except Exception as e:  # a corrupt image, a size the processor refuses
                raise ValueError(
                    f"multi_modal_data['image']: the image could not be processed: {e}"
                ) from e
            tiles = out["pixel_values"].float()
            if tiles.dim() != 4 or tuple(tiles.shape[1:]) != (3, side, side):
                raise ValueError(
                    f"the image processor gave pixel values of shape {tuple(tiles.shape)}, not "
                    f"[tiles, 3, {side}, {side}]"
                )
            pixels.append(tiles)
            run = [self.image_token_id] * (tiles.shape[0] * self.tile_rows)
            segments.append([start, *run, end])
        token_ids = self._splice(token_ids, segments)
        starts = self._run_starts(token_ids)
        return token_ids, tuple(
            ImageInput(p, offset, p.shape[0] * self.tile_rows, _digest(p, None), (p.shape[0],))
            for p, offset in zip(pixels, starts, strict=True)
        )

    def _span(self, size: tuple[int, ...]) -> list[int]:
        """Pixtral: an image of `size` (h, w) pixels as h / u lines of w / u placeholders,
        each line ended by [IMG_BREAK], the last by [IMG_END] (u: patch x merge)."""
        lines, cols = size[0] // self.unit, size[1] // self.unit
        brk, end = self.breaks
        span = ([self.image_token_id] * cols + [brk]) * lines
        span[-1] = end
        return span

    def _spans(
        self, token_ids: list[int], images: list[Any], kwargs: dict[str, Any]
    ) -> tuple[list[int], tuple[ImageInput, ...]]:
        """Pixtral / Mistral 3: each image resized (longest edge, multiples of u pixels) and
        its [IMG] token replaced by its span of lines."""
        unit = {"height": self.unit, "width": self.unit}
        pixels, sizes = [], []
        for image in images:
            try:
                out = self.hf(
                    images=[image.convert("RGB")], return_tensors="pt", patch_size=unit, **kwargs
                )
            except Exception as e:  # a corrupt image, a size the processor refuses
                raise ValueError(
                    f"multi_modal_data['image']: the image could not be processed: {e}"
                ) from e
            h, w = (int(v) for v in out["image_sizes"][0])
            if h % self.unit or w % self.unit or min(h, w) < self.unit:
                raise ValueError(
                    f"the image processor gave a {h} x {w} image, not multiples of {self.unit}"
                )
            pixels.append(out["pixel_values"][0][:, :h, :w].float().contiguous())
            sizes.append((h, w))
        token_ids = self._splice(token_ids, [self._span(s) for s in sizes])
        out_images: list[ImageInput] = []
        at = 0
        for p, size in zip(pixels, sizes, strict=True):
            at = token_ids.index(self.image_token_id, at)
            n = len(self._span(size))
            cols = size[1] // self.unit
            out_images.append(ImageInput(p, at, n, _digest(p, size), size, break_every=cols + 1))
            at += n
        return token_ids, tuple(out_images)

    def _spans_in_place(
        self, token_ids: list[int], images: list[ImageInput]
    ) -> tuple[list[int], tuple[ImageInput, ...]]:
        """Pixtral images processed ahead: each span must be in the prompt where it says."""
        for m in images:
            size = m.image_size
            if (
                size is None
                or len(size) != 2
                or m.pixel_values is None
                or tuple(m.pixel_values.shape) != (3, *size)
                or token_ids[m.offset : m.end] != self._span(size)
                or m.break_every != size[1] // self.unit + 1
            ):
                raise ValueError(
                    "multi_modal_data['image']: these processed images do not fit this prompt "
                    "and model (their spans or pixel shapes differ)"
                )
        return token_ids, tuple(images)

    def _splice(self, ids: list[int], segments: list[list[int]]) -> list[int]:
        """Each lone image token -> its image's segment (ValueError naming multi_modal_data
        unless there is one per image)."""
        tid = self.image_token_id
        lone = [i for i, t in enumerate(ids) if t == tid]
        runs = self._run_starts(ids)
        if len(lone) != len(segments) or len(runs) != len(lone):
            raise ValueError(
                f"multi_modal_data['image'] has {len(segments)} image(s) but the prompt has "
                f"{len(runs)} image placeholder(s) (token id {tid}): put one image token per "
                "image where it belongs"
            )
        out: list[int] = []
        last = 0
        for i, segment in zip(lone, segments, strict=True):
            out += ids[last:i] + segment
            last = i + 1
        return out + ids[last:]

    def _fits(self, m: ImageInput) -> int:
        """The run of a processed image: ValueError unless its pixels (or features) are what
        this model reads for an image of its size."""
        if m.embeds is not None:
            self._check_embeds(m.embeds, "an image's embeds")
            if self.mrope and m.length != self.length(m.image_size):
                raise ValueError("multi_modal_data['image']: embeds do not fit their grid")
            if m.length != m.embeds.shape[0]:
                raise ValueError("multi_modal_data['image']: embeds do not fit their run")
            return m.length
        if (
            m.pixel_values is None
            or m.length != self.length(m.image_size)
            or tuple(m.pixel_values.shape) != self.pixel_shape(m.image_size)
        ):
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
        if self.mrope and grids is None:
            raise ValueError(
                "multi_modal_data['image']: Qwen2-VL image embeddings need their "
                "'image_grid_thw' beside 'image_embeds' (the M-RoPE positions follow the grid)"
            )
        if isinstance(data, torch.Tensor) and data.dim() == 3:
            embeds = list(data.unbind(0))
        elif isinstance(data, torch.Tensor) and grids is not None:  # rows of all images
            lengths = [self.length(g) for g in grids]
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
        if self.limit is not None and len(embeds) > self.limit:
            raise ValueError(
                f"multi_modal_data['image'] has {len(embeds)} images, over "
                f"limit_mm_per_prompt={{'image': {self.limit}}}"
            )
        lengths = [e.shape[0] for e in embeds]
        if self.mrope and lengths != [self.length(g) for g in grids]:
            raise ValueError("multi_modal_data['image']: image embeds do not fit their grids")
        token_ids = self.expand(token_ids, lengths)
        starts = self._run_starts(token_ids)
        out = tuple(
            ImageInput(None, offset, n, _digest(e, g), g, embeds=e.detach().cpu())
            for e, offset, n, g in zip(embeds, starts, lengths, grids, strict=True)
        )
        return token_ids, out

    def _check_embeds(self, e: Any, what: str) -> None:
        hidden = int(self.config.text_config.hidden_size)
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

    def positions(
        self, num_tokens: int, images: tuple[ImageInput, ...]
    ) -> qwen2_vl.MropePositions | None:
        """The prompt's M-RoPE positions where the model has them (Qwen2-VL), else None."""
        if not self.mrope:
            return None
        return qwen2_vl.mrope_positions(num_tokens, images, qwen2_vl.merge_size(self.config))

    def length(self, size: tuple[int, ...] | None) -> int:
        """Placeholders of an image of `size` (LLaVA-NeXT: its (h, w); Qwen2-VL: its patch
        grid (t, h, w)); LLaVA's are the same for every image, Idefics3's for every tile."""
        if self.tokens_per_image is not None:
            return self.tokens_per_image
        if self.tile is not None:
            return self.tile
        if self.tile_rows and size is not None and len(size) == 1 and size[0] > 0:
            return size[0] * self.tile_rows  # InternVL: size = (tiles,)
        if self.unit and size is not None and len(size) == 2:
            return len(self._span(size))
        n = 3 if self.mrope else 2
        if size is None or len(size) != n or min(size) <= 0:
            raise ValueError(
                f"multi_modal_data['image']: a processed image's image_size {size} is not "
                f"{'a patch grid (t, h, w)' if self.mrope else 'its (h, w)'}"
            )
        if self.mrope:
            return qwen2_vl.tokens(self.config, size)
        assert self.anyres is not None
        return self.anyres.tokens(size)  # type: ignore[arg-type]

    def pixel_shape(self, size: tuple[int, ...] | None) -> tuple[int, ...]:
        if self.mrope:
            assert size is not None  # length() checked it
            return (size[0] * size[1] * size[2], qwen2_vl.patch_dim(self.config))
        side = (self.image_size, self.image_size)
        if self.tile_rows:
            assert size is not None  # length() checked it
            return (size[0], 3, *side)
        if self.anyres is None:
            return (3, *side)
        assert size is not None  # length() checked it
        return (self.anyres.views(size), 3, *side)  # type: ignore[arg-type]

    @property
    def image_size(self) -> int:
        size = self.config.vision_config.image_size
        return int(size[0] if isinstance(size, (list, tuple)) else size)

    def _run_starts(self, ids: list[int]) -> list[int]:
        tid = self.image_token_id
        return [i for i, t in enumerate(ids) if t == tid and (i == 0 or ids[i - 1] != tid)]

    def _image_list(self, items: list[Any]) -> list[Any]:
        PIL_Image = require_pillow()
        for i, item in enumerate(items):
            if not isinstance(item, PIL_Image.Image):
                raise ValueError(
                    f"multi_modal_data['image'][{i}] must be a PIL.Image.Image, got "
                    f"{type(item).__name__}"
                )
        return items

    def processor_kwargs(self, kwargs: Any) -> dict[str, Any]:
        """vLLM's mm_processor_kwargs as the image processor takes them; ValueError naming
        mm_processor_kwargs for a name it does not take or one that would change the layout
        the vision encoder reads (patch and merge sizes, tensor formats). Qwen2-VL's
        min_pixels / max_pixels become its size's shortest_edge / longest_edge."""
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
            raise ValueError(
                f"mm_processor_kwargs must be a dict of argument names, got {type(kwargs).__name__}"
            )
        known = set(getattr(self.hf, "valid_kwargs", dict).__annotations__) - _LAYOUT_KWARGS
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
            out["size"] = size
        return out

    def _pixels(
        self, images: list[Any], kwargs: dict[str, Any]
    ) -> tuple[list[torch.Tensor], list[tuple[int, ...] | None]]:
        """Each image's pixel values and, for LLaVA-NeXT, its (h, w) as the processor saw it
        (Qwen2-VL: its patch grid (t, h, w))."""
        try:
            rgb = [im.convert("RGB") for im in images]
            out = self.hf(images=rgb, return_tensors="pt", **kwargs)
        except Exception as e:  # a corrupt or truncated image, a size the processor refuses
            raise ValueError(
                f"multi_modal_data['image']: the image could not be processed: {e}"
            ) from e
        pixels = out["pixel_values"].float()
        sizes: list[tuple[int, ...] | None] = [None] * len(images)
        if self.mrope:  # [all images' patches, patch_dim], each image's grid
            sizes = [(int(t), int(h), int(w)) for t, h, w in out["image_grid_thw"].tolist()]
            views = list(pixels.split([t * h * w for t, h, w in sizes]))  # type: ignore[misc]
        elif self.anyres is not None:  # [N, most views, 3, S, S], zero views after each's own
            sizes = [(int(h), int(w)) for h, w in out["image_sizes"].tolist()]
            views = [p[: self.anyres.views(size)] for p, size in zip(pixels, sizes, strict=True)]
        else:
            views = list(pixels)
        for p, size in zip(views, sizes, strict=True):
            if tuple(p.shape) != self.pixel_shape(size):
                raise ValueError(
                    f"the image processor gave pixel values of shape {tuple(p.shape)}, not "
                    f"{self.pixel_shape(size)} (the vision tower's image_size): check "
                    "preprocessor_config.json"
                )
        return views, sizes

    def expand(self, ids: list[int], lengths: list[int]) -> list[int]:
        """Each lone placeholder -> a run of its image's length; runs already that long stay
        (ValueError unless there is one placeholder or run per image). A server calls it to
        know the prompt's length before the engine takes the images."""
        tid = self.image_token_id
        runs: list[tuple[int, int]] = []  # (start, length)
        for i, t in enumerate(ids):
            if t != tid:
                continue
            if runs and runs[-1][0] + runs[-1][1] == i:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((i, 1))
        if len(runs) != len(lengths) or any(
            length not in (1, n) for (_, length), n in zip(runs, lengths)
        ):
            found = ", ".join(str(length) for _, length in runs) or "none"
            want = ", ".join(str(n) for n in lengths)
            raise ValueError(
                f"multi_modal_data['image'] has {len(lengths)} image(s) but the prompt has "
                f"{len(runs)} image placeholder(s) (token id {tid}; runs of {found} tokens): "
                f"put one image token per image where it belongs (or runs of {want})"
            )
        out: list[int] = []
        last = 0
        for (start, length), n in zip(runs, lengths):
            out += ids[last:start]
            out += [tid] * n
            last = start + length
        return out + ids[last:]
