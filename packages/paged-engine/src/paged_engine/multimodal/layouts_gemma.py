"""Gemma's layouts: image runs between begin / end tokens that attend both ways (layouts.py has
the base and helpers).

    Gemma3Layout         Gemma 3: <start_of_image> replaced in the prompt's text, a fixed run
                         per view (and pan-and-scan crops)
    Gemma4Layout         Gemma 4: <|image>, a run by the patch grid, <image|>
    Gemma4UnifiedLayout  Gemma 4 Unified: the same, one token per model patch
"""

from __future__ import annotations

from typing import Any

from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.layouts import (
    Layout,
    Loaded,
    Run,
    Size,
    _shape_error,
    _side,
    digest,
    run_starts,
)


def _split_tokens() -> ValueError:
    return ValueError(
        "the tokenizer did not keep Gemma 3's image tokens whole (<start_of_image>, "
        "<image_soft_token>, <end_of_image> must be special tokens)"
    )


class Gemma3Layout(Layout):
    """Gemma 3: pixels [1 + crops, 3, S, S] (the image, then its pan-and-scan crops when the
    processor makes any); a user's <start_of_image> (boi) becomes, as text (HF's processor
    replaces it in the string, so newlines merge with their neighbours'), one run
    "\n\n<start_of_image>" + <image_soft_token> x n + "<end_of_image>\n\n" per view (with
    crops, HF's "Here is the original image ... and here are some crops ..." around them).
    Each view is one `ImageInput` whose tokens attend to each other both ways. Between a
    segment's first <start_of_image> and its end everything sits between special tokens, so
    its tokens from there to its last <end_of_image> are the same wherever the segment lands."""

    takes_embeds = False
    bidirectional = True

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        from paged_engine.multimodal.gemma3 import image_tokens

        if tokenizer is None:
            raise ValueError("the tokenizer is needed for Gemma 3's image prompts")
        self.config = config
        self.placeholder = placeholder
        self.tokenizer = tokenizer
        self.fixed = image_tokens(config)
        self.boi = int(config.boi_token_index)
        self.eoi = int(config.eoi_token_index)
        boi, soft, eoi = tokenizer.convert_ids_to_tokens([self.boi, placeholder, self.eoi])
        fields = ("boi_token_index", "image_token_index", "eoi_token_index")
        for name, token_id, token in zip(
            fields, (self.boi, placeholder, self.eoi), (boi, soft, eoi)
        ):
            if token is None:  # an id past the tokenizer's vocabulary
                raise ValueError(
                    f"config.{name} {token_id} is not a token of the checkpoint's tokenizer "
                    f"({len(tokenizer)} tokens)"
                )
        self.view_text = f"\n\n{boi}{soft * self.fixed}{eoi}\n\n"

    def load(self, run: Run, image: Any, count: int) -> Loaded:
        out = run([image])
        crops = int(out["num_crops"][0]) if "num_crops" in out else 0
        views = out["pixel_values"].float()
        side = _side(self.config)
        if tuple(views.shape) != (1 + crops, 3, side, side):
            raise _shape_error(views, f"[{1 + crops}, 3, {side}, {side}] ({crops} crops)")
        return views, (crops,)

    def _text(self, crops: int) -> str:
        if not crops:
            return self.view_text
        return (  # Gemma3Processor's wording
            f"Here is the original image {self.view_text} and here are some crops to help you "
            "see better " + " ".join([self.view_text] * crops)
        )

    def segment(self, loaded: Loaded) -> list[int]:
        crops = loaded[1][0] if loaded[1] else 0  # type: ignore[index]
        return self.tokenizer.encode(self._text(crops), add_special_tokens=False)

    def place(self, loaded: Loaded, at: int, segment: list[int]) -> list[ImageInput]:
        views = loaded[0]
        runs = run_starts(segment, self.placeholder)
        if len(runs) != views.shape[0]:
            raise _split_tokens()
        n = self.length(None)
        return [
            ImageInput(v, at + r, n, digest(v, None), bidirectional=True)
            for v, r in zip(views.unbind(0), runs, strict=True)
        ]

    def pixel_shape(self, size: Size) -> tuple[int, ...]:
        return (3, _side(self.config), _side(self.config))  # one view

    def fits(self, m: ImageInput) -> bool:
        return m.bidirectional and super().fits(m)

    @property
    def marker(self) -> int:
        return self.boi

    def splice(self, ids: list[int], segments: list[list[int]]) -> tuple[list[int], list[int]]:
        """Each <start_of_image> not followed by its run replaced in the prompt's text (decoded
        with its special tokens, then tokenized again: HF's ids for a text prompt). A segment's
        start is placed by its first <start_of_image>."""
        boi, tid = self.boi, self.placeholder
        marks = [i for i, t in enumerate(ids) if t == boi and ids[i + 1 : i + 2] != [tid]]
        if len(marks) != len(segments) or tid in ids:
            raise ValueError(
                f"multi_modal_data['image'] has {len(segments)} image(s) but the prompt has "
                f"{len(marks)} <start_of_image> token(s) (id {boi}) of its own: put one per "
                "image where it belongs"
            )
        tok = self.tokenizer

        def text(part: list[int]) -> str:
            return tok.decode(part, skip_special_tokens=False, clean_up_tokenization_spaces=False)

        pieces, last = [], 0
        for i, segment in zip(marks, segments, strict=True):
            pieces += [text(ids[last:i]), text(segment)]
            last = i + 1
        pieces.append(text(ids[last:]))
        out = tok.encode("".join(pieces), add_special_tokens=False)
        runs = run_starts(out, tid)
        starts, k = [], 0
        for segment in segments:  # its first run in `out`, less where it sits in the segment
            first = segment.index(boi)
            tail = segment[first : len(segment) - segment[::-1].index(self.eoi)]
            at = runs[k] - 1 if k < len(runs) else -1
            if at < 0 or out[at : at + len(tail)] != tail:
                raise _split_tokens()
            starts.append(at - first)
            k += len(run_starts(segment, tid))
        if k != len(runs):
            raise ValueError("the prompt's text holds image tokens of its own")
        return out, starts


class Gemma4Layout(Layout):
    """Gemma 4: an image's patches [h * w, 3 * p * p] (the processor's aspect-kept resize to an
    h x w patch grid, its padding rows dropped), size (h, w); its <|image|> becomes <|image> +
    <|image|> x (h * w / k^2) + <image|> (HF's processor replaces the token in the text; all
    three are special, so this is the same on the ids). With use_bidirectional_attention
    "vision" its `ImageInput` is `bidirectional`, so one step must hold the run; runs differ by
    image, so the layout's own flag (the engine's start-time check of one fixed run against
    max_num_batched_tokens) stays off and a longer run is refused when its request comes in
    (engine/input_processor.py)."""

    takes_embeds = False

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        from paged_engine.multimodal import gemma4

        gemma4.check_config(config)
        self.config = config
        self.placeholder = placeholder
        self.bounds = (int(config.boi_token_id), int(config.eoi_token_id))
        self.two_way = gemma4.bidirectional(config)  # the ImageInputs' `bidirectional`
        self.fixed = None

    def length(self, size: Size) -> int:
        from paged_engine.multimodal import gemma4

        if size is None or len(size) != 2 or min(size) <= 0:
            raise ValueError(f"multi_modal_data['image']: image_size {size} is not a patch grid")
        return gemma4.image_tokens(self.config, size)

    def pixel_shape(self, size: Size) -> tuple[int, ...]:
        from paged_engine.multimodal import gemma4

        assert size is not None and len(size) == 2
        return (size[0] * size[1], gemma4.patch_dim(self.config))

    def load(self, run: Run, image: Any, count: int) -> Loaded:
        out = run([image])
        where = out["image_position_ids"][0]  # [max patches, 2] (column, row); -1: padding
        real = int((where >= 0).all(-1).sum())
        w, h = (int(v) + 1 for v in where[:real].amax(0))
        pixels = out["pixel_values"][0][:real].float()
        if real != h * w or tuple(pixels.shape) != self.pixel_shape((h, w)):
            raise _shape_error(pixels, self.pixel_shape((h, w)))
        n = self.length((h, w))
        if n != int(out["num_soft_tokens_per_image"][0]):
            raise ValueError(
                f"the image processor's pooling_kernel_size gives other soft tokens than the "
                f"tower's {n}: check preprocessor_config.json"
            )
        return pixels.contiguous(), (h, w)

    def segment(self, loaded: Loaded) -> list[int]:
        start, end = self.bounds
        return [start, *([self.placeholder] * self.length(loaded[1])), end]

    def place(self, loaded: Loaded, at: int, segment: list[int]) -> list[ImageInput]:
        pixels, size = loaded
        n = self.length(size)
        return [
            ImageInput(pixels, at + 1, n, digest(pixels, size), size, bidirectional=self.two_way)
        ]

    def fits(self, m: ImageInput) -> bool:
        return m.bidirectional == self.two_way and super().fits(m)


class Gemma4UnifiedLayout(Gemma4Layout):
    """Gemma 4 Unified: Gemma 4's prompt and two-way runs, one soft token per model patch of
    (k p)^2 pixels: patches [h * w, 3 (k p)^2], size (h, w) in model patches, h * w tokens
    (multimodal/gemma4_unified.py)."""

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        from paged_engine.multimodal import gemma4, gemma4_unified

        gemma4_unified.check_config(config)
        self.config = config
        self.placeholder = placeholder
        self.bounds = (int(config.boi_token_id), int(config.eoi_token_id))
        self.two_way = gemma4.bidirectional(config)
        self.fixed = None

    def length(self, size: Size) -> int:
        from paged_engine.multimodal import gemma4_unified

        if size is None or len(size) != 2 or min(size) <= 0:
            raise ValueError(f"multi_modal_data['image']: image_size {size} is not a patch grid")
        return gemma4_unified.image_tokens(self.config, size)

    def pixel_shape(self, size: Size) -> tuple[int, ...]:
        from paged_engine.multimodal import gemma4_unified

        assert size is not None and len(size) == 2
        return (size[0] * size[1], gemma4_unified.patch_dim(self.config))
