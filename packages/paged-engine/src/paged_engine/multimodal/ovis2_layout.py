"""The host side of Ovis2's images (multimodal/ovis2.py runs them): tiles, the prompt segment,
the text splice and the mm_processor_kwargs Ovis2's processor may take.

    "<image>" in the prompt's text (a token or not: transformers' Ovis2 tokenizer has none; its
    processor replaces the text) -> Ovis2Processor.replace_image_token's segment
    (ovis2.segment_kinds: <IMG_START>, the tiles' <IMG_ATOM> runs between <IMG_GRID>,
    <IMG_COL>, <IMG_ROW>, then <IMG_END>), spliced into the decoded prompt and tokenized again as
    HF tokenizes the replaced text. Every token of a segment is special, so a segment's ids are
    the same wherever it lands; a prompt that holds the segments already (HF's ids) is taken as
    it is. One ImageInput per image spans its whole segment: pixels [tiles, 3, S, S] (the
    thumbnail first where there are several), image_size its grid (rows, cols).

mm_processor_kwargs: `size` other than the tower's S x S tile is refused by name (the tower's
position table has S / patch squared entries), and max_patches over MOST_TILES (the covering
grid search transformers runs costs ~max_patches^2 Python steps: 1024 takes seconds), besides
kwargs_budget.py's generic bounds (tiles x tile pixels).
"""

from __future__ import annotations

from typing import Any

import torch

from paged_engine.multimodal import ovis2
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.layouts import Layout, Loaded, Run, Size, _shape_error, digest

MARKER = "<image>"  # Ovis2Processor's image_token: text, split before tokenizing
MOST_TILES = 256  # max_patches: the covering search over all grids of at most this many tiles


class Ovis2Layout(Layout):
    """Ovis2: each "<image>" of the text becomes its tiles' segment (see the module)."""

    takes_embeds = False

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        ovis2.check_config(config)
        self.config = config
        self.placeholder = placeholder  # <IMG_ATOM>: config.image_token_id
        self.tokenizer = tokenizer
        self.fixed = None
        self.side = ovis2.tile_side(config)
        self.per_tile = ovis2.tile_tokens(config)
        self.indicators = [int(i) for i in config.visual_indicator_token_ids]

    def _grid(self, size: Size) -> tuple[int, int]:
        if size is None or len(size) != 2 or min(size) <= 0:
            raise ValueError(f"multi_modal_data['image']: image_size {size} is not (rows, cols)")
        return int(size[0]), int(size[1])

    def length(self, size: Size) -> int:
        return ovis2.segment_length(*self._grid(size), self.per_tile)

    def pixel_shape(self, size: Size) -> tuple[int, ...]:
        return (ovis2.tiles_of(*self._grid(size)), 3, self.side, self.side)

    def check_kwargs(self, kwargs: dict[str, Any]) -> None:
        size = kwargs.get("size")
        if size is not None and dict(size) != {"height": self.side, "width": self.side}:
            raise ValueError(
                f"mm_processor_kwargs['size'] must be {{'height': {self.side}, 'width': "
                f"{self.side}}} (vision_config.image_size: the tower's tile), got {size!r}"
            )
        most = kwargs.get("max_patches")
        if most is not None and (isinstance(most, bool) or not isinstance(most, int)):
            raise ValueError(f"mm_processor_kwargs['max_patches'] must be an int, got {most!r}")
        if most is not None and most > MOST_TILES:
            raise ValueError(
                f"mm_processor_kwargs['max_patches']={most} is over the {MOST_TILES} tiles an "
                "Ovis2 image may be cut into"
            )
        for name in ("crop_to_patches", "use_covering_area_grid"):
            if name in kwargs and not isinstance(kwargs[name], bool):
                raise ValueError(f"mm_processor_kwargs[{name!r}] must be a bool")

    def load(self, run: Run, image: Any, count: int) -> Loaded:
        out = run([image])
        tiles = out["pixel_values"].float()
        grids = torch.as_tensor(out["grids"])
        grid = tuple(int(x) for x in grids.reshape(-1, 2)[0])
        if tiles.dim() != 4 or tuple(tiles.shape) != self.pixel_shape(grid):
            raise _shape_error(tiles, f"[tiles, 3, {self.side}, {self.side}]")
        return tiles, grid

    def segment(self, loaded: Loaded) -> list[int]:
        kinds = ovis2.segment_kinds(*self._grid(loaded[1]), self.per_tile)
        return [self.placeholder if k == ovis2.ATOM else self.indicators[k] for k in kinds]

    def place(self, loaded: Loaded, at: int, segment: list[int]) -> list[ImageInput]:
        tiles, grid = loaded
        return [ImageInput(tiles, at, len(segment), digest(tiles, grid), grid)]

    def span(self, m: ImageInput) -> list[int]:
        return self.segment((m.pixel_values, m.image_size))  # type: ignore[arg-type]

    @property
    def marker(self) -> int:
        return self.tokenizer.get_vocab().get(MARKER, -1)

    def splice(self, ids: list[int], segments: list[list[int]]) -> tuple[list[int], list[int]]:
        """The prompt's text with each "<image>" replaced by its segment, tokenized again (as
        HF's processor runs on the text); ValueError naming multi_modal_data unless there is
        one "<image>" per image and no image token of the text's own."""
        tok = self.tokenizer
        if tok is None:
            raise ValueError("the tokenizer is needed to place Ovis2's images")
        text = tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        pieces = text.split(MARKER)
        own = {self.placeholder, *self.indicators}
        if len(pieces) != len(segments) + 1:
            raise ValueError(
                f"multi_modal_data['image'] has {len(segments)} image(s) but the prompt has "
                f"{len(pieces) - 1} image placeholder(s) ({MARKER}): put one per image where "
                "it belongs"
            )
        if own & set(ids):
            raise ValueError(
                "multi_modal_data['image']: the prompt holds Ovis2 image tokens "
                f"({ovis2.INDICATORS}, <IMG_ATOM>) of its own outside its images' segments"
            )
        words = ["".join(tok.convert_ids_to_tokens(s)) for s in segments]  # special tokens
        joined = [p for piece, w in zip(pieces, words, strict=False) for p in (piece, w)]
        out = tok.encode("".join([*joined, pieces[-1]]), add_special_tokens=False)
        starts, at = [], 0
        for segment in segments:  # in order: special tokens only, so found whole
            while at < len(out) and out[at : at + len(segment)] != segment:
                at += 1
            if at >= len(out):
                raise ValueError("the tokenizer did not keep Ovis2's image tokens whole")
            starts.append(at)
            at += len(segment)
        return out, starts
