"""LLaVA's image path: vision tower, feature selection, projector into the text model's space.

    pixels [N, 3, H, W] -> VisionTransformer hidden_states[vision_feature_layer]
        (a list of layers: their states concatenated on the feature axis)
        -> "default" strategy drops the first token (CLIP's CLS); "full" keeps every token
        -> multi_modal_projector: linear_1 -> projector_hidden_act -> linear_2
        -> [N, tokens_per_image, text hidden_size]

The language model is the text model of models/multimodal_text.py, built and loaded as for
text-only serving; this module is the rest of LlavaForConditionalGeneration. Its weights are
the checkpoint's `[model.]vision_tower.[vision_model.]*` and `[model.]multi_modal_projector.*`
(the vision tower's post_layernorm and SigLIP's pooling head are never used, nor the layers
after the deepest one read). Replicated on every tensor-parallel rank: the tower is small next
to the decoder and runs once per image.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from paged_engine.layers.activation import get_act_fn
from paged_engine.models.utils import load_named_weights
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.vision_transformer import TOWERS, VisionTransformer

_STRATEGIES = ("default", "full")
_TOWER = "vision_tower.vision_model."  # older saves; transformers 5 writes vision_tower.X


def feature_layers(config) -> list[int]:
    layer = config.vision_feature_layer
    return [layer] if isinstance(layer, int) else list(layer)


def image_token_id(config) -> int:
    if getattr(config, "model_type", None) in ("clip", "siglip"):  # a dual encoder's
        from paged_engine.models.dual_encoder_text import PLACEHOLDER

        return PLACEHOLDER
    value = getattr(config, "image_token_id", None)
    if value is None and not hasattr(config, "image_token_index"):  # Phi-4-multimodal's
        value = config.vision_config.image_token_id
    return int(value if value is not None else config.image_token_index)


def select_strategy(config) -> str:
    """vision_feature_select_strategy; ViP-LLaVA's config has none: it always drops the first
    token ("default")."""
    return getattr(config, "vision_feature_select_strategy", "default")


def tokens_per_image(config) -> int:
    """Placeholders an image takes in the prompt: the tower's patches, plus CLIP's CLS token
    under the "full" strategy ("default" drops the first token whatever it is, as HF does)."""
    vision = config.vision_config
    strategy = select_strategy(config)
    if strategy not in _STRATEGIES:
        raise ValueError(
            f"vision_feature_select_strategy={strategy!r} is not supported; supported: "
            f"{_STRATEGIES}"
        )
    model_type = getattr(vision, "model_type", None)
    if model_type not in TOWERS:
        raise ValueError(
            f"vision_config.model_type={model_type!r} is not supported; supported: {sorted(TOWERS)}"
        )
    tokens = (vision.image_size // vision.patch_size) ** 2 + int(TOWERS[model_type])
    return tokens - 1 if strategy == "default" else tokens


class _VisionTower(nn.Module):  # the checkpoint's `vision_tower.vision_model` nesting
    def __init__(self, vision_config, num_layers: int) -> None:
        super().__init__()
        self.vision_model = VisionTransformer(vision_config, num_layers)


class Projector(nn.Module):
    def __init__(self, config, num_feature_layers: int) -> None:
        super().__init__()
        vision, text = config.vision_config.hidden_size, config.text_config.hidden_size
        bias = bool(getattr(config, "multimodal_projector_bias", True))
        self.linear_1 = nn.Linear(vision * num_feature_layers, text, bias=bias)
        self.act = get_act_fn(config.projector_hidden_act, "projector_hidden_act")
        self.linear_2 = nn.Linear(text, text, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaImageEncoder(nn.Module):
    """Images -> rows of the text model's input embedding (one row per placeholder)."""

    own_weights: tuple[str, ...] = ()  # the wrapper's tensors outside tower and projector
    projector_class: type[nn.Module] = Projector  # built (config, feature layers); a linear_1

    def __init__(self, config) -> None:
        super().__init__()
        self.tokens_per_image = tokens_per_image(config)
        self.image_token_id = image_token_id(config)
        total = int(config.vision_config.num_hidden_layers)
        layers = feature_layers(config)
        self.layers = [i + total + 1 if i < 0 else i for i in layers]  # transformers' indexing
        if not all(0 <= i <= total for i in self.layers):
            raise ValueError(
                f"vision_feature_layer={config.vision_feature_layer} is outside the vision "
                f"tower's {total} layers"
            )
        self.drop_first = select_strategy(config) == "default"
        self.vision_tower = _VisionTower(config.vision_config, max(self.layers))
        self.multi_modal_projector = self.projector_class(config, len(layers))
        self.image_size = self.vision_tower.vision_model.image_size

    def features(self, pixels: torch.Tensor) -> torch.Tensor:  # [N, 3, H, W] -> [N, L, k * C]
        """The selected tower states before the projector (k feature layers concatenated)."""
        states = self.vision_tower.vision_model(pixels, self.layers)
        if self.drop_first:
            states = [s[:, 1:] for s in states]
        return states[0] if len(states) == 1 else torch.cat(states, dim=-1)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [N, 3, H, W] -> [N, L, D]
        return self.multi_modal_projector(self.features(pixels))

    def encode(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        """Each image's feature rows [length, D] (its pixel values [3, H, W])."""
        weight = self.multi_modal_projector.linear_1.weight
        pixels = torch.stack([m.pixel_values for m in images]).to(weight.device, weight.dtype)
        return list(self(pixels))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's vision tower and projector tensors and `own_weights` (any other name
        is passed over);
        raises ValueError naming a missing or unexpected one."""
        built = len(self.vision_tower.vision_model.encoder.layers)

        def ours(name: str) -> str | None:
            name = name.removeprefix("model.")
            if name in self.own_weights:
                return name
            if not name.startswith(("vision_tower.", "multi_modal_projector.")):
                return None
            if name.startswith("vision_tower.") and not name.startswith(_TOWER):
                name = _TOWER + name.removeprefix("vision_tower.")  # transformers 5's saves
            inner = name.removeprefix(_TOWER)
            if inner.startswith(("post_layernorm.", "head.")):
                return None
            if inner.startswith("encoder.layers.") and int(inner.split(".")[2]) >= built:
                return None  # after the deepest layer read
            return name

        picked = ((n, t) for n, t in ((ours(n), t) for n, t in weights) if n is not None)
        return load_named_weights(self, picked)
