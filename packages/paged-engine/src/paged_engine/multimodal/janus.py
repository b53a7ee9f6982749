"""Janus' image understanding path (JanusForConditionalGeneration: a SigLIP-style tower, an MLP
aligner, Llama): DeepSeek Janus and Janus-Pro, text out.

    image -> the checkpoint's Janus image processor (DeepSeek-VL's: longest side resized to S,
        padded to S x S with the background colour) -> pixels [3, S, S]
        -> JanusVisionModel: SigLIP's layers (its attention output named `projection_layer`,
           the MLP's width hidden_size * mlp_ratio), post_layernorm (transformers'
           last_hidden_state; the pooled output unused) -> (S / patch)^2 rows
        -> aligner: fc1, then (GELU -> hidden_layers[i]) for each of depth - 1 layers
        -> (S / patch)^2 rows of text hidden_size
    prompt: JanusProcessor replaces each image token (`<image_placeholder>`) by
        <begin_of_image>, a run of num_image_tokens of it, <end_of_image> (576 = (384 / 16)^2
        for the released checkpoints: HF's model needs it to equal the tower's patches, so the
        tower decides here)
    text model: Llama (models/text_wrappers.py)

JanusProcessor's `use_default_system_prompt` (processor_config.json; True in transformers'
converted checkpoints, the chat template has no system turn): its default system prompt's text goes
before a prompt's text, the two tokenized as one. paged does the same for a prompt with images (its
text decoded, the system prompt put before it unless there already, encoded again; the bos the
tokenizer adds kept first), so its ids are HF's; a prompt holding its images' segments already (an
HF processor's ids) is taken as it is, and a text-only prompt as written (vLLM has no Janus of its
own, and its processors run only with multi_modal_data).

Weights: `[model.]vision_model.*` and `[model.]aligner.*`; the image generation half
(`vqmodel.`, `generation_embeddings.`, `generation_aligner.`, `generation_head.`) is never
loaded. Refused by name: a tower other than Janus' (vision_config.model_type), its q/k norms
(use_qk_norm) or unbiased projections (attention_bias=False), a projection_dim other than the
text hidden_size; image generation (mm_processor_kwargs['generation_mode']: `refused_kwargs`,
which processor.py reads; the server takes text modalities only).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import torch
from torch import nn

from paged_engine.layers.activation import get_act_fn
from paged_engine.models.utils import load_named_weights
from paged_engine.multimodal.deepseek_vl import DeepseekVLLayout
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.layouts import Loaded, token_ids
from paged_engine.multimodal.vision_transformer import FinalNormTower

ARCH = "JanusForConditionalGeneration"
_TOWER, _ALIGNER = "vision_model.", "aligner."
_BOUNDS = ("<begin_of_image>", "<end_of_image>")  # the Hub tokenizer's boi / eoi


def image_tokens(config: Any) -> int:
    """Placeholders (= feature rows) of one image: the tower's patches."""
    vision = getattr(config, "vision_config", None)
    kind = getattr(vision, "model_type", None)
    if kind != "janus_vision_model":
        raise ValueError(
            f"vision_config.model_type={kind!r} is not supported: 'janus_vision_model'"
        )
    side, patch = vision.image_size, vision.patch_size
    if not isinstance(side, int) or not isinstance(patch, int) or patch <= 0 or side % patch:
        raise ValueError(
            f"vision_config.image_size={side!r} must be an int multiple of patch_size={patch!r}"
        )
    return (side // patch) ** 2


class JanusLayout(DeepseekVLLayout):
    """Each image token -> boi, a run of (S / patch)^2 placeholders, eoi; pixels [3, S, S]
    (DeepSeek-VL's processor and its mm_processor_kwargs bounds)."""

    # JanusProcessor's generation_mode="image" prompts for image generation (VQ codes out)
    refused_kwargs: ClassVar[dict[str, str]] = {
        "generation_mode": "Janus' image generation is not served (text out only: leave "
        "generation_mode unset)"
    }

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        self.config = config
        self.placeholder = placeholder
        self.fixed = image_tokens(config)
        boi = getattr(tokenizer, "boi_token", None) or _BOUNDS[0]
        eoi = getattr(tokenizer, "eoi_token", None) or _BOUNDS[1]
        self.bounds = token_ids(tokenizer, boi, eoi)
        self.tokenizer = tokenizer
        self.system: str | None = (
            None  # the default system prompt's text, where the processor adds it
        )

    def read_saved(self, path: Path) -> None:
        """processor_config.json's use_default_system_prompt (absent: False, HF's default)."""
        saved = Path(path) / "processor_config.json"
        settings = json.loads(saved.read_text()) if saved.is_file() else {}
        if settings.get("use_default_system_prompt", False):
            from transformers.models.janus.processing_janus import DEFAULT_SYSTEM_PROMPT

            self.system = DEFAULT_SYSTEM_PROMPT

    def splice(self, ids: list[int], segments: list[list[int]]) -> tuple[list[int], list[int]]:
        """The segments in place, in the prompt with the default system prompt before its text
        (when the processor adds one; see the module)."""
        if self.system is not None:
            # the bos the tokenizer adds stays first; one written in the text follows the system
            # prompt, as in HF's string concatenation
            bos = getattr(self.tokenizer, "bos_token_id", None)
            adds = bos is not None and self.tokenizer.encode("a")[:1] == [bos]
            lead = ids[:1] if adds and ids[:1] == [bos] else []
            text = self.tokenizer.decode(ids[len(lead) :], skip_special_tokens=False)
            if not text.startswith(self.system):
                text = self.system + text
                ids = [*lead, *self.tokenizer.encode(text, add_special_tokens=False)]
        return super().splice(ids, segments)

    def segment(self, loaded: Loaded) -> list[int]:
        start, end = self.bounds
        return [start, *([self.placeholder] * self.fixed), end]

    def place(self, loaded: Loaded, at: int, segment: list[int]) -> list[ImageInput]:
        return super().place(loaded, at + 1, segment)  # the run starts after boi

    def features_segment(self, rows: int) -> tuple[list[int], int]:
        start, end = self.bounds
        return [start, *([self.placeholder] * rows), end], 1


def _tower_config(vision: Any) -> SimpleNamespace:
    """vision_config as vision_transformer.py's SigLIP tower reads it; ValueError naming the
    fields it does not run."""
    image_tokens(SimpleNamespace(vision_config=vision))
    if getattr(vision, "use_qk_norm", False):
        raise ValueError(
            "vision_config.use_qk_norm=True is not supported (Janus' checkpoints: False)"
        )
    if not getattr(vision, "attention_bias", True):
        raise ValueError("vision_config.attention_bias=False is not supported (q/k/v biases)")
    return SimpleNamespace(
        model_type="siglip_vision_model",  # the same layers; only the names differ
        hidden_size=int(vision.hidden_size),
        intermediate_size=int(vision.hidden_size * vision.mlp_ratio),
        num_hidden_layers=int(vision.num_hidden_layers),
        num_attention_heads=int(vision.num_attention_heads),
        num_channels=int(vision.num_channels),
        image_size=int(vision.image_size),
        patch_size=int(vision.patch_size),
        hidden_act=vision.hidden_act,
        layer_norm_eps=float(vision.layer_norm_eps),
    )


class _Aligner(nn.Module):
    """fc1, then (act -> layer) for each hidden layer (HF's JanusVisionAlignerMLP)."""

    def __init__(self, vision: Any, text_hidden: int) -> None:
        super().__init__()
        width = int(vision.projection_dim)
        if width != text_hidden:
            raise ValueError(
                f"vision_config.projection_dim={width} must equal text_config.hidden_size="
                f"{text_hidden} (the aligner's rows are text embeddings)"
            )
        depth = int(vision.depth)
        if depth < 1:
            raise ValueError(f"vision_config.depth={depth} must be >= 1")
        self.fc1 = nn.Linear(int(vision.hidden_size), width)
        self.hidden_layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth - 1))
        self.act = get_act_fn(vision.hidden_act, "vision_config.hidden_act")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, P, Dv] -> [N, P, Dt]
        x = self.fc1(x)
        for layer in self.hidden_layers:
            x = layer(self.act(x))
        return x


def _ours(name: str) -> str | None:
    """A checkpoint name as this encoder's (None: not the tower's or the aligner's)."""
    name = name.removeprefix("model.")
    if not name.startswith((_TOWER, _ALIGNER)):
        return None
    return name.replace(".self_attn.projection_layer.", ".self_attn.out_proj.")


class JanusImageEncoder(nn.Module):
    """Images -> rows of the text model's input embedding (one row per placeholder)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.tokens = image_tokens(config)
        self.vision_model = FinalNormTower(_tower_config(config.vision_config))
        self.aligner = _Aligner(config.vision_config, int(config.text_config.hidden_size))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [N, 3, S, S] -> [N, P, D]
        return self.aligner(self.vision_model.last(pixels))

    def encode(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        weight = self.aligner.fc1.weight
        pixels = torch.stack([m.pixel_values for m in images])  # type: ignore[misc]
        return list(self(pixels.to(weight.device, weight.dtype)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's `[model.]vision_model.*` and `[model.]aligner.*` tensors (the
        generation half and the text model passed over); ValueError naming a missing or
        unexpected one."""
        picked = ((n, t) for n, t in ((_ours(n), t) for n, t in weights) if n is not None)
        return load_named_weights(self, picked)
