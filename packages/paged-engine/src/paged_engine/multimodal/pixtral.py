"""The image encoder of Pixtral checkpoints: Mistral3ForConditionalGeneration (Mistral Small 3.1)
and LlavaForConditionalGeneration with a `pixtral` vision tower (Pixtral-12B's HF form).

    each image [3, H, W] (its own size) -> patch_conv (bias-free, kernel = stride = p)
        -> its h x w patches row-major; all images packed into one sequence -> ln_pre
        -> layers: x = x + attention(attention_norm(x), 2-D rope)      (within each image)
                   x = x + down(act(gate(ffn_norm(x))) * up(ffn_norm(x)))
        -> hidden_states[vision_feature_layer] (a list: concatenated on the feature axis)
        -> Mistral3 projector: norm -> patch_merger -> linear_1 -> act -> linear_2
           LLaVA projector:                            linear_1 -> act -> linear_2
        -> per image [(h / m) * (w / m), text hidden_size], merged grid row-major

hidden_states follows transformers' indexing: entry 0 is ln_pre's output, entry i the output of
layer i; the tower has no CLS token and no final norm. Only the layers up to the deepest one read
are built. The tower's norms are RMSNorms with eps 1e-5 (hard-coded by HF); Mistral3's projector
norm uses text_config.rms_norm_eps (a native checkpoint's config: `projector_rms_norm_eps`,
vLLM's 1e-5, mistral_vision.py).

Rotary: inv_freq = theta ** -(2j / head_dim), j < head_dim / 2; a patch at (row, col) rotates by
row * inv_freq[0::2] and col * inv_freq[1::2], those head_dim / 2 angles [rows | cols] repeated
over both halves of the head (rotate-half pairing). Angles, cos and sin are float32, cast to the
activation dtype before they are applied (as HF does). Positions are not bounded by image_size.

Patch merger (Mistral3, m = spatial_merge_size): merged token (i, j) concatenates the m x m
patches (i*m + a, j*m + b) channel-major, feature c * m * m + a * m + b (torch's unfold order),
then merging_layer (bias-free) maps d * m * m -> d.
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

_TOWER_EPS = 1e-5  # every norm inside HF's PixtralVisionModel
_WRAPPERS = ("mistral3", "llava")
_LAYERS = "vision_tower.transformer.layers."


def is_pixtral(config) -> bool:
    """Whether the wrapper config's vision tower is Pixtral's."""
    vision = getattr(config, "vision_config", None)
    return getattr(vision, "model_type", None) == "pixtral"


def _positive_int(owner, name: str, prefix: str) -> int:
    value = getattr(owner, name, None)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{prefix}{name}={value!r} is not supported: a positive int")
    return value


def _wrapper(config) -> str:
    kind = getattr(config, "model_type", None)
    if kind not in _WRAPPERS:
        raise ValueError(f"model_type={kind!r} is not supported; supported: {_WRAPPERS}")
    return kind


def merge_size(config) -> int:
    """Patches merged per side into one feature row: Mistral3's spatial_merge_size, LLaVA's 1."""
    if _wrapper(config) == "mistral3":
        return _positive_int(config, "spatial_merge_size", "")
    return 1


def patch_size(config) -> int:
    return _positive_int(config.vision_config, "patch_size", "vision_config.")


def _rope_theta(vision) -> float:
    rope = getattr(vision, "rope_parameters", None) or {}
    kind = rope.get("rope_type", "axial")
    if kind != "axial":
        raise ValueError(
            f"vision_config.rope_parameters.rope_type={kind!r} is not supported: 'axial'"
        )
    return float(rope.get("rope_theta", getattr(vision, "rope_theta", 10000.0)))


def _feature_layers(config, total: int) -> list[int]:
    """vision_feature_layer as non-negative hidden_states indices (0 <= i <= total)."""
    layer = config.vision_feature_layer
    layers = [layer] if isinstance(layer, int) else list(layer)
    if not layers or not all(isinstance(i, int) and -(total + 1) <= i <= total for i in layers):
        raise ValueError(
            f"vision_feature_layer={layer!r} is not supported: hidden_states indices of a "
            f"{total}-layer tower"
        )
    return [i + total + 1 if i < 0 else i for i in layers]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos, sin: [T, 1, D] in x's dtype. Rotate-half rope."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class _Attention(nn.Module):
    def __init__(self, hidden: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]
    ) -> torch.Tensor:  # x: [T, D], the images' patches packed
        rows = x.shape[0]
        q, k, v = (
            p(x).view(rows, self.num_heads, -1) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = torch.cat(
            [
                # [H, L, D] per image: patches see only their own image; scale 1/sqrt(D)
                F.scaled_dot_product_attention(
                    qi.transpose(0, 1), ki.transpose(0, 1), vi.transpose(0, 1)
                ).transpose(0, 1)
                for qi, ki, vi in zip(q.split(lengths), k.split(lengths), v.split(lengths))
            ]
        )
        return self.o_proj(out.reshape(rows, -1))


class _FeedForward(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act = get_act_fn(act, "vision_config.hidden_act")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, vision, hidden: int, num_heads: int) -> None:
        super().__init__()
        intermediate = _positive_int(vision, "intermediate_size", "vision_config.")
        self.attention_norm = RMSNorm(hidden, _TOWER_EPS)
        self.attention = _Attention(hidden, num_heads)
        self.ffn_norm = RMSNorm(hidden, _TOWER_EPS)
        self.feed_forward = _FeedForward(hidden, intermediate, vision.hidden_act)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int]
    ) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, lengths)
        return x + self.feed_forward(self.ffn_norm(x))


class _Transformer(nn.Module):  # the checkpoint's `transformer.layers` nesting
    def __init__(self, layers: Iterable[_Layer]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)


class PixtralVisionTower(nn.Module):
    """HF's PixtralVisionModel (weight names kept), its first `num_layers` layers."""

    def __init__(self, vision, num_layers: int) -> None:
        super().__init__()
        hidden = _positive_int(vision, "hidden_size", "vision_config.")
        num_heads = _positive_int(vision, "num_attention_heads", "vision_config.")
        self.patch_size = _positive_int(vision, "patch_size", "vision_config.")
        self.num_channels = _positive_int(vision, "num_channels", "vision_config.")
        head_dim = hidden // num_heads
        if hidden % num_heads or head_dim % 4:
            raise ValueError(
                f"vision_config.hidden_size={hidden} / num_attention_heads={num_heads} must be "
                "a head_dim divisible by 4 (rope: head_dim / 4 frequencies per axis)"
            )
        if getattr(vision, "head_dim", None) not in (None, head_dim):
            raise ValueError(f"vision_config.head_dim={vision.head_dim} is not {head_dim}")
        if not isinstance(getattr(vision, "hidden_act", None), str):
            raise ValueError(f"vision_config.hidden_act={vision.hidden_act!r} is not supported")
        theta = _rope_theta(vision)
        # [head_dim / 2] float32 (no buffer: stays float32 whatever the module's dtype)
        self.inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)
        p = self.patch_size
        self.patch_conv = nn.Conv2d(self.num_channels, hidden, p, stride=p, bias=False)
        self.ln_pre = RMSNorm(hidden, _TOWER_EPS)
        layers = (_Layer(vision, hidden, num_heads) for _ in range(num_layers))
        self.transformer = _Transformer(layers)

    def _rope(
        self, grids: list[tuple[int, int]], dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, head_dim] for the packed patches of images with these grids."""
        positions = torch.cat(  # (row, col) per patch, row-major per image
            [
                torch.stack(
                    torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij"), -1
                ).view(-1, 2)
                for h, w in grids
            ]
        )
        inv = self.inv_freq
        angles = torch.cat(
            [positions[:, :1].float() * inv[0::2], positions[:, 1:].float() * inv[1::2]], dim=-1
        ).repeat(1, 2)[:, None]
        return angles.cos().to(device, dtype), angles.sin().to(device, dtype)

    def forward(
        self, pixels: Sequence[torch.Tensor], layers: list[int]
    ) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
        """Images [C, H, W] (sizes multiples of patch_size) -> (hidden_states[i] [T, D] for each
        i in `layers`, packed over the images; each image's (h, w) patch grid)."""
        weight = self.patch_conv.weight
        embeds = [self.patch_conv(x.to(weight.device, weight.dtype)[None])[0] for x in pixels]
        grids = [(e.shape[1], e.shape[2]) for e in embeds]
        x = self.ln_pre(torch.cat([e.flatten(1).t() for e in embeds]))  # [T, D]
        cos, sin = self._rope(grids, x.dtype, x.device)
        lengths = [h * w for h, w in grids]
        states = {0: x}
        for i, layer in enumerate(self.transformer.layers, start=1):
            x = layer(x, cos, sin, lengths)
            states[i] = x
        return [states[i] for i in layers], grids


class _PatchMerger(nn.Module):
    def __init__(self, hidden: int, merge: int) -> None:
        super().__init__()
        self.merge = merge
        self.merging_layer = nn.Linear(hidden * merge * merge, hidden, bias=False)

    def forward(self, x: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        """x: [T, d] packed h x w grids (multiples of m) -> [T / m**2, d], each image's merged
        grid row-major, features channel-major (see the module docstring)."""
        m, d, out = self.merge, x.shape[-1], []
        for part, (h, w) in zip(x.split([h * w for h, w in grids]), grids):
            blocks = part.view(h // m, m, w // m, m, d).permute(0, 2, 4, 1, 3)
            out.append(blocks.reshape(-1, d * m * m))
        return self.merging_layer(torch.cat(out))


class _Projector(nn.Module):
    """multi_modal_projector: Mistral3's (norm, patch_merger first) or LLaVA's."""

    def __init__(self, config, mistral3: bool, num_feature_layers: int) -> None:
        super().__init__()
        vision = config.vision_config.hidden_size
        text = _positive_int(config.text_config, "hidden_size", "text_config.")
        bias = bool(getattr(config, "multimodal_projector_bias", not mistral3))
        if mistral3:
            eps = getattr(config, "projector_rms_norm_eps", None)  # (mistral_vision.py's)
            eps = float(eps or config.text_config.rms_norm_eps)
            self.norm: RMSNorm | None = RMSNorm(vision, eps)
            self.patch_merger: _PatchMerger | None = _PatchMerger(vision, merge_size(config))
        else:
            self.norm = self.patch_merger = None
        self.linear_1 = nn.Linear(vision * num_feature_layers, text, bias=bias)
        self.act = get_act_fn(config.projector_hidden_act, "projector_hidden_act")
        self.linear_2 = nn.Linear(text, text, bias=bias)

    def forward(self, x: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        if self.norm is not None and self.patch_merger is not None:
            x = self.patch_merger(self.norm(x), grids)
        return self.linear_2(self.act(self.linear_1(x)))


class PixtralImageEncoder(nn.Module):
    """Images -> rows of the text model's input embedding (one row per placeholder)."""

    def __init__(self, config) -> None:
        super().__init__()
        mistral3 = _wrapper(config) == "mistral3"
        vision = config.vision_config
        if not is_pixtral(config):
            raise ValueError(
                f"vision_config.model_type={getattr(vision, 'model_type', None)!r} is not "
                "supported: 'pixtral'"
            )
        if not mistral3:
            strategy = getattr(config, "vision_feature_select_strategy", None)
            if strategy != "full":  # "default" would drop the first patch of the packed images
                raise ValueError(
                    f"vision_feature_select_strategy={strategy!r} is not supported with a "
                    "pixtral vision tower: 'full'"
                )
        total = _positive_int(vision, "num_hidden_layers", "vision_config.")
        self.layers = _feature_layers(config, total)
        if mistral3 and len(self.layers) != 1:  # HF's norm and merger take one layer's width
            raise ValueError(
                f"vision_feature_layer={config.vision_feature_layer!r} is not supported for "
                "mistral3: one layer"
            )
        self.merge = merge_size(config)
        self.vision_tower = PixtralVisionTower(vision, max(self.layers))
        self.multi_modal_projector = _Projector(config, mistral3, len(self.layers))
        self.patch_size = self.vision_tower.patch_size

    def encode(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        """Each image's feature rows [(H / (p*m)) * (W / (p*m)), text hidden] (its pixel values
        [3, H, W], H and W multiples of p*m), merged grid row-major."""
        if not images:
            return []
        step = self.patch_size * self.merge
        pixels = [m.pixel_values for m in images]
        for x in pixels:
            if x.dim() != 3 or x.shape[0] != self.vision_tower.num_channels:
                raise ValueError(f"pixel_values {tuple(x.shape)}: expected [3, H, W]")
            if x.shape[1] % step or x.shape[2] % step or not x.shape[1] or not x.shape[2]:
                raise ValueError(
                    f"pixel_values {tuple(x.shape)}: H and W must be positive multiples of "
                    f"patch_size * merge {step}"
                )
        states, grids = self.vision_tower(pixels, self.layers)
        features = states[0] if len(states) == 1 else torch.cat(states, dim=-1)
        out = self.multi_modal_projector(features, grids)
        rows = [(h // self.merge) * (w // self.merge) for h, w in grids]
        return list(out.split(rows))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's `[model.]vision_tower.*` and `[model.]multi_modal_projector.*`
        tensors (any other name is passed over; so are the layers after the deepest one read);
        raises ValueError naming a missing or unexpected one."""
        built = len(self.vision_tower.transformer.layers)

        def ours(name: str) -> str | None:
            name = name.removeprefix("model.")
            if not name.startswith(("vision_tower.", "multi_modal_projector.")):
                return None
            if name.startswith("vision_tower.patch_positional_embedding."):
                return None  # a rotary buffer some saves carry: recomputed here
            index = name[len(_LAYERS) :].split(".")[0] if name.startswith(_LAYERS) else ""
            if index.isdigit() and int(index) >= built:
                return None  # after the deepest layer read
            return name

        picked = ((n, t) for n, t in ((ours(n), t) for n, t in weights) if n is not None)
        return load_named_weights(self, picked)
