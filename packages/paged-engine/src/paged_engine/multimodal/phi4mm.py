"""Phi-4-multimodal's images (Phi4MultimodalForCausalLM: transformers' phi4_multimodal, vLLM's
phi4_multimodal.py): a SigLIP-style tower over HD crops and a global view, 2 x 2 average pooling
and a GELU MLP into the text width. The decoder is Phi-3's (models/phi3.py), built from the
wrapper's own flat config (models/text_wrappers.py `flat`).

    image -> Phi4MultimodalImageProcessor (phi4mm_processor.py's torch copy where transformers'
        needs the missing torchvision): a crop grid of hc x wc views of S x S (S = 448), the
        image resized into it and padded white right / bottom; the global view is the padded
        image resized to S x S -> pixels [1 + hc * wc, 3, S, S] (global first, crops row-major)
        and a patch mask over the HD grid (the last floor(pad / patch) patch rows / cols are
        padding): `image_size` = (hc, wc, valid patch rows, valid patch cols)
    each view -> tower: patch conv; position ids bucket the fractions of the view's valid patch
        grid into the side x side table (Idefics2's rule), padding patches take id 0 and are
        masked out as keys; layers up to hidden_states[feature_layer] (-2: the last layer never
        runs; no post_layernorm, no pooling head) -> m x m grid (m = S / patch, reflection-padded
        to even) -> AvgPool 2 x 2 -> b x b (b = 16: HF's processor counts 256 + 16 rows)
    rows of an image: the crops' pooled grid [hc b, wc b] cut to its valid (u_h, u_w) (the even
        patch rows / cols of the mask), each row then sub_img_feature_extensor -> u_h (u_w + 1);
        global_img_feature_extensor (1); the global view's b rows each ended by
        sub_img_feature_extensor -> b (b + 1); all -> img_projection_up -> GELU (exact) ->
        img_projection_down
    prompt: each <|image|> (vision_config.image_token_id) becomes a run of that many <|image|>
        (HF's num_img_tokens)

Weights: `model.embed_tokens_extend.image_embed.{img_processor, img_projection_up,
img_projection_down, global_img_feature_extensor, sub_img_feature_extensor}` (the tower's head,
post_layernorm and layers past feature_layer passed over). Audio (`embed_tokens_extend.
audio_embed`): phi4mm_audio.py; a prompt may hold both, in any order (its clips then take the
vision-speech projector, as in HF).

LoRA: the released checkpoint keeps its text model un-merged and ships the vision and speech
LoRA as PEFT adapter directories (`vision-lora/`, `speech-lora/`, rank 320 on the decoder's
qkv_proj / o_proj / gate_up_proj / down_proj): transformers loads them apart
(`model.load_adapter(path, adapter_name=..., adapter_kwargs={"subfolder": "vision-lora"})`), and
vLLM serves them as per-request LoRA (`--enable-lora --max-lora-rank 320`). paged does the same:
`LLM(model, enable_lora=True, max_lora_rank=320)` and
`lora_request=LoRARequest("vision", 1, f"{model}/vision-lora")` on image prompts (and
`LoRARequest("speech", 2, f"{model}/speech-lora")` on audio ones, the vision one on a prompt
with both, as the Hub's remote code picks for its VISION_SPEECH mode; the adapters'
`model.layers.*` names are the decoder's own). Without an adapter the base model runs, as HF's
does.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.models.utils import load_named_weights
from paged_engine.multimodal.idefics2 import bucketed_position_ids
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.layouts import Layout, Loaded, Run, Size, _shape_error
from paged_engine.multimodal.vision_transformer import VisionEmbeddings, VisionLayer

ARCH = "Phi4MultimodalForCausalLM"
POOLED_SIDE = 16  # b: Phi4MultimodalImageProcessor counts 16 x 16 pooled rows a view
_PREFIX = "model.embed_tokens_extend.image_embed."
_OURS = (
    "img_processor.embeddings.",
    "img_processor.encoder.layers.",
    "img_projection_up.",
    "img_projection_down.",
    "global_img_feature_extensor",
    "sub_img_feature_extensor",
)


def _side(value: Any) -> int:
    return int(value[0] if isinstance(value, (list, tuple)) else value)


def check_config(config: Any) -> tuple[int, int, int]:
    """(S, patch, depth: the layers run) of a servable config; ValueError naming the field."""
    vision = config.vision_config
    if getattr(vision, "model_type", None) != "phi4_multimodal_vision":
        raise ValueError(
            f"vision_config.model_type={vision.model_type!r} is not supported: "
            "'phi4_multimodal_vision'"
        )
    side, patch, crop = _side(vision.image_size), _side(vision.patch_size), int(vision.crop_size)
    if side != crop or side % patch:
        raise ValueError(
            f"vision_config.image_size={side} must equal crop_size={crop} and be a multiple of "
            f"patch_size={patch}"
        )
    if math.ceil(side // patch / 2) != POOLED_SIDE:
        raise ValueError(
            f"vision_config.image_size / patch_size = {side // patch} patches a side is not "
            f"supported: HF's processor counts {POOLED_SIDE} x {POOLED_SIDE} pooled rows a view "
            f"(31 or 32 patches)"
        )
    layers, layer = int(vision.num_hidden_layers), int(vision.feature_layer)
    depth = layers + layer + 1 if layer < 0 else layer
    if not 0 < depth <= layers:
        raise ValueError(
            f"vision_config.feature_layer={layer} is outside the tower's {layers} layers"
        )
    return side, patch, depth


def _grid_mask(size: tuple[int, ...], m: int) -> torch.Tensor:
    """The HD grid's patch mask [hc m, wc m] (1: image, 0: padding) of `size`."""
    hc, wc, rows, cols = size
    mask = torch.zeros(hc * m, wc * m)
    mask[:rows, :cols] = 1
    return mask


def valid_pooled(size: tuple[int, ...], m: int) -> tuple[int, int]:
    """(u_h, u_w): the crops' pooled rows / cols HF keeps (the mask's even patch rows / cols
    within each view, summed over the grid's first column / row of views), counted without
    building the mask (an image_size of a client's ImageInput may be absurd)."""

    def even(n: int) -> int:  # patches p < n with p % m even
        return n // m * ((m + 1) // 2) + (n % m + 1) // 2

    return even(size[2]), even(size[3])


def image_tokens(size: tuple[int, ...], m: int) -> int:
    """num_img_tokens of an image of `size` (hc, wc, valid rows, valid cols)."""
    u_h, u_w = valid_pooled(size, m)
    b = math.ceil(m / 2)
    return u_h * (u_w + 1) + 1 + b * (b + 1)


class Phi4MMLayout(Layout):
    """A run of num_img_tokens <|image|> an image; pixels [1 + hc wc, 3, S, S]; `image_size`
    (hc, wc, valid patch rows, valid patch cols) of the HD grid."""

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        self.config = config
        self.placeholder = placeholder
        self.fixed = None
        self.side, self.patch, _ = check_config(config)
        self.m = self.side // self.patch

    def _size(self, size: Size) -> tuple[int, int, int, int]:
        m = self.m
        if size is None or len(size) != 4 or min(size) <= 0:
            raise ValueError(f"multi_modal_data['image']: image_size {size} is not (hc, wc, r, c)")
        hc, wc, rows, cols = (int(v) for v in size)
        if rows > hc * m or cols > wc * m:
            raise ValueError(f"multi_modal_data['image']: image_size {size} is past its grid")
        return hc, wc, rows, cols

    def length(self, size: Size) -> int:
        return image_tokens(self._size(size), self.m)

    def pixel_shape(self, size: Size) -> tuple[int, ...]:
        hc, wc, _, _ = self._size(size)
        return (1 + hc * wc, 3, self.side, self.side)

    def load(self, run: Run, image: Any, count: int) -> Loaded:
        out = run([image])
        h, w = (int(v) for v in out["image_sizes"][0])
        s, m = self.side, self.m
        if h % s or w % s or min(h, w) < s:
            raise ValueError(f"the image processor gave a {h} x {w} image, not multiples of {s}")
        hc, wc = h // s, w // s
        views = 1 + hc * wc
        mask = out["image_attention_mask"][0][1:views]
        if tuple(mask.shape) != (hc * wc, m, m):
            raise _shape_error(mask, (hc * wc, m, m))
        grid = mask.reshape(hc, wc, m, m).transpose(1, 2).reshape(hc * m, wc * m)
        size = (hc, wc, int(grid[:, 0].sum()), int(grid[0, :].sum()))
        if not torch.equal(grid, _grid_mask(size, m).to(grid.dtype)):
            raise ValueError("the image processor's image_attention_mask is not a padded grid")
        pixels = out["image_pixel_values"][0][:views].float().contiguous()
        if tuple(pixels.shape) != self.pixel_shape(size):
            raise _shape_error(pixels, self.pixel_shape(size))
        return pixels, size


class _Embeddings(VisionEmbeddings):
    """Patch conv and position table; ids by each view's valid grid (the rest id 0)."""

    def __init__(self, vision: Any) -> None:
        super().__init__(vision, has_cls=False)
        self.side = _side(vision.image_size) // _side(vision.patch_size)

    def forward_masked(self, pixels: torch.Tensor, valid: list[tuple[int, int]]) -> torch.Tensor:
        """[N, 3, S, S] and each view's (valid rows, valid cols) -> [N, m * m, D]."""
        x = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype))
        m = x.shape[-1]
        ids = torch.zeros(len(valid), m, m, dtype=torch.long)
        for i, (rows, cols) in enumerate(valid):
            if rows and cols:
                ids[i, :rows, :cols] = bucketed_position_ids(rows, cols, self.side).view(rows, cols)
        return x.flatten(2).transpose(1, 2) + self.position_embedding(ids.flatten(1).to(x.device))


class _Tower(nn.Module):
    """`img_processor` (Phi4MultimodalVisionModel's names), `depth` layers, keys masked."""

    def __init__(self, vision: Any, depth: int) -> None:
        super().__init__()
        self.embeddings = _Embeddings(vision)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(VisionLayer(vision) for _ in range(depth))

    def forward(self, pixels: torch.Tensor, valid: list[tuple[int, int]]) -> torch.Tensor:
        x = self.embeddings.forward_masked(pixels, valid)  # [N, m * m, D]
        n, m = x.shape[0], self.embeddings.side
        keys = torch.zeros(n, m, m, dtype=torch.bool)
        for i, (rows, cols) in enumerate(valid):
            keys[i, :rows, :cols] = True
        keys[~keys.flatten(1).any(1)] = True  # an all-padding view (never read): no NaN rows
        mask = None if bool(keys.all()) else keys.view(n, 1, 1, m * m).to(x.device)
        for layer in self.encoder.layers:
            x = x + _attend(layer.self_attn, layer.layer_norm1(x), mask)
            x = x + layer.mlp(layer.layer_norm2(x))
        return x


def _attend(attn: nn.Module, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """VisionAttention with a key mask [N, 1, 1, L] (True: attend)."""
    n, length, _ = x.shape
    q, k, v = (
        p(x).view(n, length, attn.num_heads, attn.head_dim).transpose(1, 2)
        for p in (attn.q_proj, attn.k_proj, attn.v_proj)
    )
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return attn.out_proj(out.transpose(1, 2).reshape(n, length, -1))


class Phi4MMImageEncoder(nn.Module):
    """Images -> rows of the text model's input embedding (one per <|image|> of the run)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        side, patch, depth = check_config(config)
        vision = config.vision_config
        self.side, self.m = side, side // patch
        width, text = int(vision.hidden_size), int(config.hidden_size)
        self.img_processor = _Tower(vision, depth)
        self.img_projection_up = nn.Linear(width, text)
        self.img_projection_down = nn.Linear(text, text)
        self.global_img_feature_extensor = nn.Parameter(torch.zeros(1, 1, width))
        self.sub_img_feature_extensor = nn.Parameter(torch.zeros(1, 1, 1, width))

    def _pooled(self, pixels: torch.Tensor, valid: list[tuple[int, int]]) -> torch.Tensor:
        """Views [N, 3, S, S] -> pooled features [N, b, b, D]."""
        x = self.img_processor(pixels, valid)
        m = self.m
        grid = x.view(x.shape[0], m, m, -1).permute(0, 3, 1, 2)  # [N, D, m, m]
        if m % 2:
            grid = F.pad(grid, (0, 1, 0, 1), mode="reflect")
        return F.avg_pool2d(grid, 2, 2).permute(0, 2, 3, 1)

    def image_rows(self, pixels: torch.Tensor, size: tuple[int, ...]) -> torch.Tensor:
        """One image's rows [num_img_tokens, text hidden] (see the module)."""
        hc, wc, rows, cols = size
        m = self.m
        valid = [(m, m)] + [
            (min(m, max(0, rows - i * m)), min(m, max(0, cols - j * m)))
            for i in range(hc)
            for j in range(wc)
        ]
        pooled = self._pooled(pixels, valid)  # [1 + hc wc, b, b, D]
        b, dim = pooled.shape[1], pooled.shape[-1]
        sub_ext = self.sub_img_feature_extensor.view(1, 1, dim)
        whole = torch.cat([pooled[0], sub_ext.expand(b, 1, dim)], dim=1).reshape(-1, dim)
        crops = pooled[1:].reshape(hc, wc, b, b, dim).transpose(1, 2).reshape(hc * b, wc * b, dim)
        u_h, u_w = valid_pooled(size, m)
        crops = torch.cat([crops[:u_h, :u_w], sub_ext.expand(u_h, 1, dim)], dim=1)
        glb = self.global_img_feature_extensor.view(1, dim)
        rows_ = torch.cat([crops.reshape(-1, dim), glb, whole])
        return self.img_projection_down(F.gelu(self.img_projection_up(rows_)))

    def encode(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        weight = self.img_projection_up.weight
        out = []
        for m in images:
            assert m.pixel_values is not None and m.image_size is not None
            pixels = m.pixel_values.to(weight.device, weight.dtype)
            out.append(self.image_rows(pixels, tuple(m.image_size)))
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's `model.embed_tokens_extend.image_embed.*` tensors this encoder
        runs (the tower's head, post_layernorm and unread layers passed over)."""
        depth = len(self.img_processor.encoder.layers)

        def ours(name: str) -> str | None:
            if not name.startswith(_PREFIX):
                return None
            name = name[len(_PREFIX) :]
            if not name.startswith(_OURS):
                return None
            layer = name.startswith("img_processor.encoder.layers.")
            return None if layer and int(name.split(".")[3]) >= depth else name

        picked = ((n, t) for n, t in ((ours(n), t) for n, t in weights) if n is not None)
        return load_named_weights(self, picked)
