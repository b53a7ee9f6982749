"""NVLM-D (`NVLM_D`, nvidia/NVLM-D-72B; the Hub's remote code modeling_nvlm_d.py, vLLM's
nvlm_d.py): the remote InternVL-Chat model (multimodal/internvl_chat.py reads its config.json
and weight names: InternViT-6B, v2 pixel shuffle, a Qwen2 LLM from llm_config) with three
differences:

    projector    mlp1: LayerNorm(D s^2) -> Linear(D s^2 -> llm intermediate_size, no bias)
                 -> GELU -> Linear(intermediate_size -> llm hidden_size, no bias)
                 (InternVL: Linear(D s^2 -> hidden) and Linear(hidden -> hidden), biased)
    context      <|vision_pad|> (Qwen2's token) holds the image rows, not <IMG_CONTEXT>
    prompt       "<image>" -> <Image> <tile_1> run <tile_2> run ... <tile_global_thumbnail>
                 run </Image>: each tile's run of <|vision_pad|> after its tag, the last tile
                 (the thumbnail after a grid; the one tile of a 1 x 1 grid) tagged
                 <tile_global_thumbnail> (vLLM's NVLMProcessor.get_image_repl)

vLLM's InternViT for NVLM pads 7 dummy heads for tensor parallelism (zero rows, its q / k norm
over the real width): the same function as the checkpoint's 25 heads, which run here as they
are. The tiles are InternVL-Chat's (GotOcr2's crop_to_patches from the config's
min / max_dynamic_patch, ImageNet mean / std).

The tags are text, not special tokens: vLLM replaces "<image>" in the prompt's text and
tokenizes the whole, so "<Image><tile_1>" merges with the text before it ("><", " <" ...).
Here the decoded prompt is spliced and tokenized the same way; an image's segment is what
lies between its first and last <|vision_pad|> (special tokens, so those tokens are the same
wherever it lands), and each tile is its own `ImageInput` ([1, 3, S, S], one run).

Refused by name: image embeddings (vLLM's NVLM refuses them too), InternVL-Chat's refusals.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from paged_engine.multimodal import internvl
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.internvl_chat import InternVLChatImageEncoder, InternVLChatLayout
from paged_engine.multimodal.layouts import Loaded, digest, run_starts
from paged_engine.multimodal.qianfan_ocr import MARKER

PAD = "<|vision_pad|>"
THUMBNAIL = "<tile_global_thumbnail>"


def image_text(tiles: int, rows: int) -> str:
    """The text an image of `tiles` tiles (its thumbnail last when more than one) of `rows`
    tokens each becomes: tags <tile_1> .. <tile_{tiles - 1}>, then the thumbnail's."""
    tags = [f"<tile_{i}>" for i in range(1, tiles)] + [THUMBNAIL]
    return "<Image>" + "".join(tag + PAD * rows for tag in tags) + "</Image>"


class NVLMImageEncoder(InternVLChatImageEncoder):
    """InternVL-Chat's encoder with NVLM-D's projector (through the llm's intermediate size,
    no biases; the checkpoint's mlp1.{0,1,3})."""

    def build_projector(self, config, width: int) -> nn.Module:
        inner = int(config.text_config.intermediate_size)
        return internvl._Projector(config, width, inner=inner, bias=False)


class NVLMLayout(InternVLChatLayout):
    """InternVL-Chat's tiles; "<image>" in the text becomes NVLM-D's tagged tiles (see the
    module doc), the prompt tokenized again whole; one `ImageInput` per tile."""

    takes_embeds = False

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        if tokenizer is None:
            raise ValueError("the tokenizer is needed for NVLM-D's image prompts")
        # not BoundedLayout's: NVLM-D's tokenizer has no <img> / </img>
        self.config = config
        self.placeholder = placeholder
        self.tokenizer = tokenizer
        self.fixed = None
        self.tile_rows = internvl.patch_tokens(config)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def segment(self, loaded: Loaded) -> list[int]:
        tiles = loaded[1][0]  # type: ignore[index]
        ids = self._encode(image_text(tiles, self.tile_rows))
        first = ids.index(self.placeholder)
        last = len(ids) - ids[::-1].index(self.placeholder)
        inner = ids[first:last]  # first run .. last run: the same in any context
        if len(run_starts(inner, self.placeholder)) != tiles:
            raise ValueError(f"the tokenizer did not keep NVLM-D's tile tags apart from {PAD}")
        return inner

    def place(self, loaded: Loaded, at: int, segment: list[int]) -> list[ImageInput]:
        tiles, rows = loaded[0], self.tile_rows
        starts = run_starts(segment, self.placeholder)
        assert len(starts) == len(tiles)  # segment() checked it
        out = []
        for i, start in enumerate(starts):
            pixels = tiles[i : i + 1].clone()  # its own storage: pickled alone to other ranks
            out.append(ImageInput(pixels, at + start, rows, digest(pixels, (1,)), (1,)))
        return out

    def splice(self, ids: list[int], segments: list[list[int]]) -> tuple[list[int], list[int]]:
        tok, pad = self.tokenizer, self.placeholder
        text = tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        pieces = text.split(MARKER)
        if len(pieces) != len(segments) + 1 or pad in ids:
            raise ValueError(
                f"multi_modal_data['image'] has {len(segments)} image(s) but the prompt has "
                f"{len(pieces) - 1} {MARKER} placeholder(s) (and {ids.count(pad)} {PAD} of its "
                f"own): put one {MARKER} per image where it belongs"
            )
        tiles = [len(run_starts(segment, pad)) for segment in segments]
        joined = pieces[0]
        for n, piece in zip(tiles, pieces[1:], strict=True):
            joined += image_text(n, self.tile_rows) + piece
        out = self._encode(joined)
        runs = run_starts(out, pad)  # the text holds no pad of its own: only the images' runs
        firsts = [sum(tiles[:i]) for i in range(len(segments))]  # each image's first run
        starts = [runs[k] for k in firsts] if len(runs) == sum(tiles) else []
        if not starts or any(
            out[at : at + len(s)] != s for at, s in zip(starts, segments, strict=True)
        ):
            raise ValueError("the tokenizer did not keep NVLM-D's image tokens whole")
        return out, starts
