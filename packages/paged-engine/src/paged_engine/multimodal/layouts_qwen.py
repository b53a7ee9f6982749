"""Qwen-VL's patch-grid layouts and those built on them (layouts.py has the base and helpers).

QwenLayout      Qwen2-VL / 2.5-VL / 3-VL / 3.5, GLM-4.1V, GLM-OCR: a run by the merged
                patch grid, M-RoPE positions
OneFrameLayout  PaddleOCR-VL, ERNIE 4.5 VL: QwenLayout over one-frame grids (1, h, w)
OmniLayout      the Qwen2.5-Omni / Qwen3-Omni thinkers (one temporal patch per image)
Exaone45Layout  EXAONE 4.5: Qwen's runs, 1-D positions
HunyuanLayout   HunyuanOCR: a break per merged row, begin / end rows, multi-axis positions
Ovis2_5Layout   Ovis 2.5: image_start, the run, image_end (one span), 1-D positions
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from paged_engine.multimodal import qwen2_vl, qwen_omni
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.layouts import Layout, Loaded, Run, Size, _shape_error
from paged_engine.multimodal.qwen2_vl_vision import _int_field
from paged_engine.multimodal.torch_processors import saved_settings


class QwenLayout(Layout):
    """Qwen2-VL / 2.5-VL / 3-VL / 3.5: patch rows [t*h*w, 3 * tp * p * p], a run of one
    placeholder per merged patch; the prompt's M-RoPE positions (multimodal/mrope.py)."""

    mrope = True

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        qwen2_vl.check_config(config)
        self.config = config
        self.placeholder = placeholder
        self.fixed = None

    def read_saved(self, path: Path) -> None:
        """ValueError unless the saved image processor merges patches as the tower does (its
        runs are counted by its merge_size; the tower's rows by spatial_merge_size)."""
        saved = saved_settings(path).get("merge_size")
        tower = getattr(self.config.vision_config, "spatial_merge_size", None)
        if saved is not None and tower is not None and int(saved) != int(tower):
            raise ValueError(
                f"{path}: the image processor's merge_size {saved} is not "
                f"vision_config.spatial_merge_size {tower}"
            )

    def length(self, size: Size) -> int:
        if size is None or len(size) != 3 or min(size) <= 0:
            raise ValueError(
                f"multi_modal_data['image']: image_size {size} is not a patch grid (t, h, w)"
            )
        return qwen2_vl.tokens(self.config, size)

    def pixel_shape(self, size: Size) -> tuple[int, ...]:
        assert size is not None and len(size) == 3
        return (size[0] * size[1] * size[2], qwen2_vl.patch_dim(self.config))

    def load(self, run: Run, image: Any, count: int) -> Loaded:
        out = run([image])
        t, h, w = (int(v) for v in out["image_grid_thw"][0])
        pixels = out["pixel_values"].float()
        if tuple(pixels.shape) != self.pixel_shape((t, h, w)):
            raise _shape_error(pixels, self.pixel_shape((t, h, w)))
        return pixels, (t, h, w)

    def positions(self, num_tokens: int, images: tuple[ImageInput, ...]) -> Any:
        return qwen2_vl.mrope_positions(num_tokens, images, qwen2_vl.merge_size(self.config))


def grid_merge_size(config: Any) -> int:
    """vision_config.spatial_merge_size (ValueError naming it unless a positive int)."""
    return _int_field(config.vision_config, "spatial_merge_size")


def one_frame_grid(image_size: Any, merge: int) -> tuple[int, int]:
    """(h, w) of an encoder's one-frame patch grid (1, h, w) (ValueError unless h and w are
    multiples of the merge size)."""
    t, h, w = (int(x) for x in image_size)
    if t != 1 or h % merge or w % merge:
        raise ValueError(
            f"image_grid_thw {(t, h, w)}: (1, h, w) with h and w multiples of "
            f"spatial_merge_size {merge}"
        )
    return h, w


class OneFrameLayout(QwenLayout):
    """Qwen2-VL's runs and M-RoPE table over one-frame patch grids (1, h, w) whose pixel rows
    are one patch wide (`row_width`, the family's): PaddleOCR-VL, ERNIE 4.5 VL."""

    def row_width(self) -> int:
        raise NotImplementedError

    def length(self, size: Size) -> int:
        m = grid_merge_size(self.config)
        if size is None or len(size) != 3 or size[0] != 1 or min(size) <= 0:
            raise ValueError(f"multi_modal_data['image']: image_size {size} is not (1, h, w)")
        if size[1] % m or size[2] % m:
            raise ValueError(
                f"multi_modal_data['image']: image_size {size}: h and w must be multiples of "
                f"vision_config.spatial_merge_size {m}"
            )
        return size[1] * size[2] // m**2

    def pixel_shape(self, size: Size) -> tuple[int, ...]:
        assert size is not None and len(size) == 3
        return (size[1] * size[2], self.row_width())


class OmniLayout(QwenLayout):
    """The Qwen2.5-Omni / Qwen3-Omni thinkers: Qwen2-VL's runs and M-RoPE table, their rotary
    checked (multimodal/qwen_omni.py)."""

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        qwen_omni.check_config(config)
        super().__init__(config, placeholder, tokenizer)

    def length(self, size: Size) -> int:
        if size is not None and len(size) == 3 and size[0] != 1:  # (image_embeds' own grids)
            raise ValueError(
                f"multi_modal_data['image']: image_size {size}: an image of "
                f"{self.config.architectures[0]} is one temporal patch (t = 1)"
            )
        return super().length(size)


class Exaone45Layout(QwenLayout):
    """EXAONE 4.5: Qwen2-VL's patch rows and runs; its decoder rotates by plain 1-D sequence
    positions (Exaone4_5_Model: arange), so no M-RoPE table (multimodal/exaone4_5.py)."""

    mrope = False

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        if qwen2_vl.merge_size(config) < 1:
            raise ValueError("vision_config.spatial_merge_size must be at least 1")
        self.config = config
        self.placeholder = placeholder
        self.fixed = None

    def positions(self, num_tokens: int, images: tuple[ImageInput, ...]) -> Any:
        return None


class HunyuanLayout(QwenLayout):
    """HunyuanOCR: patch rows [h * w, C * p * p] (row-major), size the grid (1, h, w); a run
    of (h/m) * (w/m + 1) + 2 placeholders (a break per merged row, the begin / end rows) and
    multi-axis rope positions (multimodal/hunyuan_vl.py)."""

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        self.config = config
        self.placeholder = placeholder
        self.fixed = None

    def length(self, size: Size) -> int:
        from paged_engine.multimodal import hunyuan_vl

        if size is None or len(size) != 3 or size[0] != 1 or min(size) <= 0:
            raise ValueError(f"multi_modal_data['image']: image_size {size} is not (1, h, w)")
        return hunyuan_vl.tokens(self.config, size)

    def pixel_shape(self, size: Size) -> tuple[int, ...]:
        assert size is not None and len(size) == 3
        v = self.config.vision_config
        return (size[1] * size[2], int(v.num_channels) * int(v.patch_size) ** 2)

    def positions(self, num_tokens: int, images: tuple[ImageInput, ...]) -> Any:
        from paged_engine.multimodal import hunyuan_vl

        return hunyuan_vl.positions(num_tokens, images, hunyuan_vl.merge_size(self.config))


class Ovis2_5Layout(QwenLayout):
    """Ovis 2.5: Qwen2-VL's patch rows, each image token becoming image_start, a run of
    image tokens by the merged grid and image_end (Ovis2_5Processor; tokens spliced). The
    placed image spans all three: the start and end tokens take the encoder's indicator rows
    (multimodal/ovis2_5.py); 1-D positions."""

    mrope = False
    takes_embeds = False

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        from paged_engine.multimodal import ovis2_5

        ovis2_5.check_config(config)
        self.config = config
        self.placeholder = placeholder
        self.fixed = None
        self.bounds = (int(config.image_start_token_id), int(config.image_end_token_id))

    def length(self, size: Size) -> int:
        from paged_engine.multimodal import ovis2_5

        if size is None or len(size) != 3 or size[0] != 1 or min(size) <= 0:
            raise ValueError(
                f"multi_modal_data['image']: image_size {size} is not a patch grid (1, h, w)"
            )
        return ovis2_5.tokens(self.config, size) + 2

    def pixel_shape(self, size: Size) -> tuple[int, ...]:
        from paged_engine.multimodal import ovis2_5

        assert size is not None and len(size) == 3
        return (size[0] * size[1] * size[2], ovis2_5.patch_dim(self.config))

    def segment(self, loaded: Loaded) -> list[int]:
        start, end = self.bounds
        return [start, *[self.placeholder] * (self.length(loaded[1]) - 2), end]

    def span(self, m: ImageInput) -> list[int]:
        return self.segment((m.pixel_values, m.image_size))  # type: ignore[arg-type]

    def positions(self, num_tokens: int, images: tuple[ImageInput, ...]) -> Any:
        return None
