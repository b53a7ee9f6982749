"""BLIP-2's image path (Blip2ForConditionalGeneration with a decoder-only text model: OPT, or a
Llama / Mistral / Qwen2 text_config; models/text_wrappers.py serves the decoder).

    image -> the checkpoint's BlipImageProcessor: resized to S x S, pixels [3, S, S]
        -> Blip2VisionModel: patch conv, a CLS row, learned positions; pre-norm layers whose
           attention is one fused `qkv` (q / v biases, k's zero) and `projection`;
           post_layernorm -> [1 + (S / patch)^2, Dv]
        -> the Q-Former (Blip2QFormerModel; qformer.QFormer, which is HF's query
           path): LayerNorm over the `num_query_tokens` learned `query_tokens`, then BERT
           layers: self-attention among the queries, cross-attention to the image rows every
           `cross_attention_frequency` layers (from layer 0), the query feed-forward
        -> language_projection -> [num_query_tokens, text hidden]
    prompt: HF's Blip2Processor writes "<image>" x num_query_tokens before the tokenized prompt
        (so before its BOS); HF's model fills the image-token positions with the rows in order
        (masked_scatter). A paged prompt holds no image token (vLLM's form: the images' runs
        go first, one after another), one lone image token per image where that image's run
        goes, or the runs already expanded (HF's processor output). Several images a prompt
        are HF's model's reading (vLLM takes one; HF's processor writes one run).
    text: the rows replace the token embedding's output at the placeholders; the decoder's own
        steps after its lookup follow (OPT: project_in and learned positions, models/opt.py),
        as HF's masked_scatter into get_input_embeddings' output.

The Q-Former runs in the model's dtype (HF keeps it in float32; the same in a float32 run).
The Q-Former's text half (`use_qformer_text_input`: `intermediate.` / `output.` of each layer,
never run for an image) is not loaded. Refused by name: a vision tower other than BLIP-2's
(archs.TOWER_TYPES), an OPT word_embed_proj_dim other than its hidden size (HF's rows would not
fit the token embedding); encoder-decoder text models (Flan-T5) are refused where the text model
is built (models/multimodal_text.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.layers.activation import get_act_fn
from paged_engine.models.utils import load_named_weights
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.layouts import Layout
from paged_engine.multimodal.qformer import QFormer

ARCH = "Blip2ForConditionalGeneration"
# the Q-Former layers' text half: HF builds it with use_qformer_text_input, images never run it
_TEXT_HALF = re.compile(r"qformer\.encoder\.layer\.\d+\.(intermediate|output)\.")


def image_tokens(config: Any) -> int:
    """Placeholders (= Q-Former query rows) of one image."""
    return int(config.num_query_tokens)


# ---- the vision tower (Blip2VisionModel) -----------------------------------------------------
class VisionEmbeddings(nn.Module):
    def __init__(self, v: Any) -> None:
        super().__init__()
        d, patch = int(v.hidden_size), int(v.patch_size)
        self.class_embedding = nn.Parameter(torch.zeros(1, 1, d))
        self.patch_embedding = nn.Conv2d(3, d, kernel_size=patch, stride=patch)
        positions = (int(v.image_size) // patch) ** 2 + 1
        self.position_embedding = nn.Parameter(torch.zeros(1, positions, d))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [N, 3, S, S] -> [N, 1 + P, D]
        x = self.patch_embedding(pixels).flatten(2).transpose(1, 2)
        x = torch.cat([self.class_embedding.expand(x.shape[0], 1, -1), x], dim=1)
        return x + self.position_embedding


class VisionAttention(nn.Module):
    def __init__(self, v: Any) -> None:
        super().__init__()
        d = int(v.hidden_size)
        self.heads = int(v.num_attention_heads)
        if d % self.heads:
            raise ValueError(
                f"vision_config.hidden_size={d} is not a multiple of num_attention_heads="
                f"{self.heads}"
            )
        # the checkpoint's qkv.bias is q_bias, zeros, v_bias (HF's qkv_bias); none without it
        self.qkv = nn.Linear(d, 3 * d, bias=bool(getattr(v, "qkv_bias", True)))
        self.projection = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, L, D]
        n, length, d = x.shape
        q, k, v = self.qkv(x).view(n, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v)  # both ways, scale head_dim^-0.5
        return self.projection(o.transpose(1, 2).reshape(n, length, d))


class VisionMLP(nn.Module):
    def __init__(self, v: Any) -> None:
        super().__init__()
        self.fc1 = nn.Linear(int(v.hidden_size), int(v.intermediate_size))
        self.fc2 = nn.Linear(int(v.intermediate_size), int(v.hidden_size))
        self.act = get_act_fn(v.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionLayer(nn.Module):
    def __init__(self, v: Any) -> None:
        super().__init__()
        d, eps = int(v.hidden_size), float(v.layer_norm_eps)
        self.layer_norm1 = nn.LayerNorm(d, eps=eps)
        self.self_attn = VisionAttention(v)
        self.layer_norm2 = nn.LayerNorm(d, eps=eps)
        self.mlp = VisionMLP(v)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionModel(nn.Module):
    """Blip2VisionModel's last_hidden_state (after post_layernorm): every row, CLS first."""

    def __init__(self, v: Any) -> None:
        super().__init__()
        self.embeddings = VisionEmbeddings(v)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(VisionLayer(v) for _ in range(v.num_hidden_layers))
        self.post_layernorm = nn.LayerNorm(int(v.hidden_size), eps=float(v.layer_norm_eps))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [N, 3, S, S] -> [N, 1 + P, Dv]
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


# ---- the encoder -----------------------------------------------------------------------------
class Blip2ImageEncoder(nn.Module):
    """Images -> rows of the text model's input embedding (num_query_tokens an image)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        text, q = config.text_config, config.qformer_config
        proj = getattr(text, "word_embed_proj_dim", None)  # OPT's token-embedding width
        if proj is not None and int(proj) != int(text.hidden_size):
            raise ValueError(
                f"text_config.word_embed_proj_dim={proj} differs from text_config.hidden_size="
                f"{text.hidden_size}: BLIP-2's image rows (hidden_size wide) would not fit the "
                "token embedding (not supported)"
            )
        if int(q.encoder_hidden_size) != int(config.vision_config.hidden_size):
            raise ValueError(
                f"qformer_config.encoder_hidden_size={q.encoder_hidden_size} must equal "
                f"vision_config.hidden_size={config.vision_config.hidden_size}"
            )
        self.vision_model = VisionModel(config.vision_config)
        self.query_tokens = nn.Parameter(torch.zeros(1, image_tokens(config), int(q.hidden_size)))
        self.qformer = QFormer(q)
        self.language_projection = nn.Linear(int(q.hidden_size), int(text.hidden_size))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [N, 3, S, S] -> [N, Q, D]
        rows = self.vision_model(pixels)
        queries = self.qformer(self.query_tokens.expand(rows.shape[0], -1, -1), rows)
        return self.language_projection(queries)

    def encode(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        weight = self.language_projection.weight
        pixels = torch.stack([m.pixel_values for m in images])  # type: ignore[misc]
        return list(self(pixels.to(weight.device, weight.dtype)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's `vision_model.*`, `query_tokens`, `qformer.*` (its text half
        passed over) and `language_projection.*` (the language model's passed over);
        ValueError naming a missing or unexpected one."""
        mine = ("vision_model.", "query_tokens", "qformer.", "language_projection.")

        def ours(name: str) -> str | None:
            name = name.removeprefix("model.")
            if not name.startswith(mine) or _TEXT_HALF.match(name):
                return None
            return name

        picked = ((n, t) for n, t in ((ours(n), t) for n, t in weights) if n is not None)
        return load_named_weights(self, picked)


# ---- the prompt ------------------------------------------------------------------------------
class Blip2Layout(Layout):
    """A run of num_query_tokens image tokens an image, pixels [3, S, S]; with no image token
    in the prompt, the runs go first (before its BOS), as Blip2Processor puts them."""

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        self.config = config
        self.placeholder = placeholder
        self.fixed = image_tokens(config)

    def segment(self, loaded: Any) -> list[int]:  # (not Layout's: `splice` places the runs)
        return [self.placeholder] * self.fixed

    def splice(self, ids: list[int], segments: list[list[int]]) -> tuple[list[int], list[int]]:
        """No image token: the runs first; else Layout's (one lone token per image)."""
        if self.placeholder in ids:
            return super().splice(ids, segments)
        runs = [t for s in segments for t in s]
        return [*runs, *ids], [i * self.fixed for i in range(len(segments))]
