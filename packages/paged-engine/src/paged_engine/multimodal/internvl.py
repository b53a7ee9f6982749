"""The image encoder of InternVLForConditionalGeneration (InternVL 2.5 / 3 in HF's form).

    one image: its tiles [T, 3, S, S] (the image processor's crops, S = vision image_size)
        -> patch conv (kernel = stride = p, with bias) -> [CLS] + side x side patches row-major
        -> + position_embeddings (learned, one per token: tiles are S x S, never interpolated)
        -> layers: x = x + lambda_1 * attention(norm_before(x))
                   x = x + lambda_2 * fc2(act(fc1(norm_after(x))))
        -> hidden_states[vision_feature_layer]   (-1: the last layer's output, then the tower's
           `layernorm` when use_mean_pooling is False; any other index: that state as is)
        -> drop CLS -> pixel shuffle, s = 1 / downsample_ratio: each s x s block of patches
           becomes one row of s * s * D features
        -> multi_modal_projector: layer_norm -> linear_1 -> projector_hidden_act -> linear_2
        -> [T * patch_tokens, text hidden_size], tiles in order

hidden_states follows transformers' indexing: entry 0 is the embeddings' output, entry i the
output of layer i (i <= num_hidden_layers); only the layers up to the one read are built.
norm_before / norm_after are LayerNorm or RMSNorm (`norm_type`, eps layer_norm_eps); with
`use_qk_norm`, q and k pass an RMSNorm (eps 1e-6, over the whole width, before the head split).

Pixel shuffle (HF's view / permute sequence; vision_transformer.pixel_shuffle): block (I, J)
of the (side / s)^2 grid is row I * (side / s) + J, and its features are patch
(s * I + a, s * J + b)'s channels at offset (a * s + b) * D: the block row-major, each patch's
D channels together.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.layers.activation import get_act_fn
from paged_engine.layers.norm import RMSNorm
from paged_engine.models.utils import load_named_weights
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.vision_transformer import pixel_shuffle

_QK_NORM_EPS = 1e-6  # HF builds the q / k RMSNorms with their default eps, not layer_norm_eps
_NORMS = ("layer_norm", "rms_norm")
_LAYERS = "vision_tower.encoder.layer."


def _square(vision, name: str) -> int:
    """vision_config.image_size / patch_size as one side (an int or an equal pair)."""
    value = getattr(vision, name)
    sides = list(value) if isinstance(value, (list, tuple)) else [value, value]
    if len(sides) != 2 or sides[0] != sides[1] or not isinstance(sides[0], int) or sides[0] <= 0:
        raise ValueError(f"vision_config.{name}={value!r} is not supported: a positive square")
    return sides[0]


def _grid(config) -> tuple[int, int]:
    """(patches a side, s): s = 1 / downsample_ratio, a whole number dividing the side."""
    vision = config.vision_config
    image, patch = _square(vision, "image_size"), _square(vision, "patch_size")
    if image % patch:
        raise ValueError(
            f"vision_config.image_size={image} is not a multiple of vision_config.patch_size="
            f"{patch}"
        )
    side, ratio = image // patch, config.downsample_ratio
    scale = 1 / ratio if ratio > 0 else 0.0
    if not scale or scale != int(scale) or side % int(scale):
        raise ValueError(
            f"downsample_ratio={ratio!r} is not supported: 1 / downsample_ratio must be a whole "
            f"number dividing the tower's {side} patches a side"
        )
    return side, int(scale)


def patch_tokens(config) -> int:
    """Placeholders (= feature rows) of one tile: (image_size / patch_size)^2 * ratio^2."""
    side, scale = _grid(config)
    return (side // scale) ** 2


def feature_layer(config) -> int:
    """vision_feature_layer as an index into hidden_states (0..num_hidden_layers)."""
    layer, total = config.vision_feature_layer, int(config.vision_config.num_hidden_layers)
    # HF indexes a tuple with it: a list fails there, so it is refused here
    if isinstance(layer, bool) or not isinstance(layer, int) or not -total - 1 <= layer <= total:
        raise ValueError(
            f"vision_feature_layer={layer!r} is not supported: one int in "
            f"[{-total - 1}, {total}] (the tower has {total} layers)"
        )
    return layer % (total + 1)


def _norm(vision, hidden: int) -> nn.Module:
    if vision.norm_type == "rms_norm":
        return RMSNorm(hidden, vision.layer_norm_eps)
    return nn.LayerNorm(hidden, eps=vision.layer_norm_eps)


class _Attention(nn.Module):
    def __init__(self, vision) -> None:
        super().__init__()
        hidden, heads = int(vision.hidden_size), int(vision.num_attention_heads)
        if hidden % heads:
            raise ValueError(
                f"vision_config.hidden_size={hidden} is not a multiple of "
                f"vision_config.num_attention_heads={heads}"
            )
        self.num_heads, self.head_dim = heads, hidden // heads
        bias = bool(vision.attention_bias)
        self.q_proj = nn.Linear(hidden, hidden, bias=bias)
        self.k_proj = nn.Linear(hidden, hidden, bias=bias)
        self.v_proj = nn.Linear(hidden, hidden, bias=bias)
        self.projection_layer = nn.Linear(hidden, hidden)  # always with bias
        qk_norm = bool(vision.use_qk_norm)
        self.q_norm = RMSNorm(hidden, _QK_NORM_EPS) if qk_norm else nn.Identity()
        self.k_norm = RMSNorm(hidden, _QK_NORM_EPS) if qk_norm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, L, D]
        n, length, _ = x.shape
        q, k, v = self.q_norm(self.q_proj(x)), self.k_norm(self.k_proj(x)), self.v_proj(x)
        shape = (n, length, self.num_heads, self.head_dim)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v)  # bidirectional, scale head_dim^-0.5
        return self.projection_layer(out.transpose(1, 2).reshape(n, length, -1))


class _MLP(nn.Module):
    def __init__(self, vision) -> None:
        super().__init__()
        self.fc1 = nn.Linear(vision.hidden_size, vision.intermediate_size)
        self.act = get_act_fn(vision.hidden_act, "vision_config.hidden_act")
        self.fc2 = nn.Linear(vision.intermediate_size, vision.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class _Layer(nn.Module):
    def __init__(self, vision) -> None:
        super().__init__()
        hidden = int(vision.hidden_size)
        self.attention = _Attention(vision)
        self.mlp = _MLP(vision)
        self.layernorm_before = _norm(vision, hidden)
        self.layernorm_after = _norm(vision, hidden)
        self.lambda_1 = nn.Parameter(torch.ones(hidden))  # layer scale: the checkpoint's values
        self.lambda_2 = nn.Parameter(torch.ones(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.lambda_1 * self.attention(self.layernorm_before(x))
        return x + self.lambda_2 * self.mlp(self.layernorm_after(x))


class _PatchEmbeddings(nn.Module):
    def __init__(self, vision, patch: int) -> None:
        super().__init__()
        self.projection = nn.Conv2d(vision.num_channels, vision.hidden_size, patch, stride=patch)


class _Embeddings(nn.Module):
    def __init__(self, vision, side: int, patch: int) -> None:
        super().__init__()
        hidden = int(vision.hidden_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, hidden))
        self.patch_embeddings = _PatchEmbeddings(vision, patch)
        self.position_embeddings = (
            nn.Parameter(torch.zeros(1, side * side + 1, hidden))
            if vision.use_absolute_position_embeddings
            else None
        )

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [T, C, S, S] -> [T, 1 + L, D]
        x = self.patch_embeddings.projection(pixels).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], 1, -1), x], dim=1)
        return x if self.position_embeddings is None else x + self.position_embeddings


class _Encoder(nn.Module):
    def __init__(self, vision, num_layers: int) -> None:
        super().__init__()
        self.layer = nn.ModuleList(_Layer(vision) for _ in range(num_layers))


class _VisionTower(nn.Module):
    """HF's InternVLVisionModel up to the hidden state read (its weight names kept)."""

    def __init__(self, vision, num_layers: int, final_norm: bool, side: int) -> None:
        super().__init__()
        patch = _square(vision, "patch_size")
        self.embeddings = _Embeddings(vision, side, patch)
        self.encoder = _Encoder(vision, num_layers)
        # `layernorm` (always a LayerNorm) is Identity in HF under use_mean_pooling
        self.layernorm = (
            nn.LayerNorm(vision.hidden_size, eps=vision.layer_norm_eps) if final_norm else None
        )

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixels)
        for layer in self.encoder.layer:
            x = layer(x)
        return x if self.layernorm is None else self.layernorm(x)


class _Projector(nn.Module):
    """layer_norm -> linear_1 (width -> inner) -> act -> linear_2 (inner -> text hidden);
    inner defaults to the text hidden size (NVLM-D: its intermediate size, no biases)."""

    def __init__(self, config, width: int, inner: int | None = None, bias: bool = True) -> None:
        super().__init__()
        text = int(config.text_config.hidden_size)
        inner = text if inner is None else inner
        self.layer_norm = nn.LayerNorm(width)  # torch's default eps 1e-5, as HF builds it
        self.linear_1 = nn.Linear(width, inner, bias=bias)
        self.act = get_act_fn(config.projector_hidden_act, "projector_hidden_act")
        self.linear_2 = nn.Linear(inner, text, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(self.layer_norm(x))))


class InternVLImageEncoder(nn.Module):
    """Images (each its tiles) -> rows of the text model's input embedding, one a placeholder."""

    vision_type = "internvl_vision"  # vision_config.model_type

    def __init__(self, config) -> None:
        super().__init__()
        vision = config.vision_config
        model_type = getattr(vision, "model_type", None)
        if model_type != self.vision_type:
            raise ValueError(
                f"vision_config.model_type={model_type!r} is not supported: {self.vision_type!r}"
            )
        if vision.norm_type not in _NORMS:
            raise ValueError(
                f"vision_config.norm_type={vision.norm_type!r} is not supported: {_NORMS}"
            )
        strategy = config.vision_feature_select_strategy
        if strategy != "default":  # HF's square reshape fails with the CLS token kept
            raise ValueError(
                f"vision_feature_select_strategy={strategy!r} is not supported: 'default'"
            )
        self.side, self.scale = _grid(config)
        self.image_size = _square(vision, "image_size")
        self.num_channels = int(vision.num_channels)
        self.vision_tower = self.build_tower(config, feature_layer(config))
        width = int(vision.hidden_size) * self.scale**2
        self.multi_modal_projector = self.build_projector(config, width)

    def build_projector(self, config, width: int) -> nn.Module:
        """The projector from `width` pixel-shuffled features (NVLM-D: its own sizes)."""
        return _Projector(config, width)

    def build_tower(self, config, layer: int) -> nn.Module:
        """The tower up to hidden state `layer`; HF takes last_hidden_state (through
        `layernorm`) only for the literal -1."""
        vision = config.vision_config
        final_norm = config.vision_feature_layer == -1 and not vision.use_mean_pooling
        return _VisionTower(vision, layer, final_norm, self.side)

    def forward(self, tiles: torch.Tensor) -> torch.Tensor:  # [T, C, S, S] -> [T, n, text D]
        states = self.vision_tower(tiles)[:, 1:]  # "default": the CLS token dropped
        return self.multi_modal_projector(pixel_shuffle(states, self.scale))

    def encode(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        """Each image's rows [tiles * patch_tokens, text hidden] (its pixel values
        [tiles, C, S, S]), tiles in order; all tiles of all images in one tower batch."""
        if not images:
            return []
        pixels = [m.pixel_values for m in images]
        want = (self.num_channels, self.image_size, self.image_size)
        for x in pixels:
            if x is None or x.dim() != 4 or tuple(x.shape[1:]) != want or not x.shape[0]:
                shape = None if x is None else tuple(x.shape)
                dims = ", ".join(map(str, want))
                raise ValueError(f"pixel_values {shape}: expected [tiles, {dims}]")
        weight = self.multi_modal_projector.linear_1.weight
        out = self(torch.cat(pixels).to(weight.device, weight.dtype))
        return [rows.flatten(0, 1) for rows in out.split([x.shape[0] for x in pixels])]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's `[model.]vision_tower.*` and `[model.]multi_modal_projector.*`
        tensors in HF's names (any other name is passed over; so are the layers after the one
        read, an unused `layernorm` and `mask_token`); ValueError naming a missing or unexpected
        one."""
        named = ((n.removeprefix("model."), t) for n, t in weights)
        return self._load_tower(named, _LAYERS, len(self.vision_tower.encoder.layer))

    def _load_tower(
        self, weights: Iterable[tuple[str, torch.Tensor]], layers: str, built: int
    ) -> set[str]:
        """The tower's and projector's tensors among `weights` (in transformers' names,
        `model.` dropped), passing over the layers under `layers` from index `built` on (after
        the one read), an unused `layernorm` and `mask_token`; ValueError naming a missing or
        unexpected one (shared with Qianfan-OCR, whose layers sit elsewhere)."""
        has_norm = self.vision_tower.layernorm is not None

        def ours(name: str) -> str | None:
            if not name.startswith(("vision_tower.", "multi_modal_projector.")):
                return None
            if name == "vision_tower.embeddings.mask_token":
                return None  # masked image modelling only
            if name.startswith("vision_tower.layernorm.") and not has_norm:
                return None
            index = name[len(layers) :].split(".")[0] if name.startswith(layers) else ""
            if index.isdigit() and int(index) >= built:
                return None  # after the layer read
            return name

        picked = ((n, t) for n, t in ((ours(n), t) for n, t in weights) if n is not None)
        return load_named_weights(self, picked)
