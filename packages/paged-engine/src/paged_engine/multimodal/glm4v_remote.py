"""GLM-4V (THUDM/glm-4v-9b; remote code; vLLM's GLM4VForCausalLM, glm4v.py): the prompt layout
and the image encoder. The config: models/glm4v_remote_config.py; the decoder: ChatGLM / GLM-4
(models/chatglm.py) under the same `transformer.` names, flat (models/text_wrappers.py's row).

    image (PIL, made RGB) -> resized to image_size x image_size (PIL bicubic), x / 255,
        (x - mean) / std with CLIP's mean / std (the release's transform: Qwen-VL's processor)
    prompt: each "<|begin_of_image|><|endoftext|><|end_of_image|>" (boi, pad, eoi) -> boi,
        (grid / 2)^2 pads, eoi; the whole span takes the encoder's rows (its first and last
        are the learned boi / eoi rows), at 1-D positions as vLLM runs it (the release's own
        code gives every pad one position; vLLM's does not, and neither do we)
    `transformer.vision`: patch_embedding (conv with bias, a cls_embedding row first, the
        whole position_embedding table added) -> transformer.layers, each post-norm inside the
        residual: x + input_layernorm(attention(x)), then h + post_attention_layernorm(mlp(h))
        (attention: query_key_value as [q | k | v], full, scale head_dim^-1/2, dense; mlp: fc1,
        exact GELU, fc2) -> the cls row dropped, the grid [W, g, g] through conv (2 x 2,
        stride 2, into the text width) -> linear_proj (GLU: linear_proj without bias,
        LayerNorm eps 1e-5, exact GELU, silu(gate_proj) * dense_h_to_4h, dense_4h_to_h to
        the text width) -> [boi, rows, eoi] / scaling_factor.

Refused by name: more than one image a prompt (vLLM's limit, and the release's code reads one),
any mm_processor_kwargs, image embeddings as input, a prompt whose boi / pad / eoi triples do
not number the images.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.models.glm4v_remote_config import image_tokens
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.layouts import Loaded, digest, replace_tokens
from paged_engine.multimodal.qwen_vl_v1 import SquareImageEncoder, SquareImageLayout

PREFIX = "transformer.vision."


class Glm4vRemoteLayout(SquareImageLayout):
    """Each boi, pad, eoi triple -> boi, (grid / 2)^2 pads, eoi, one `ImageInput` over all of
    it (the module doc)."""

    family = "GLM-4V"

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        self.config = config
        self.placeholder = placeholder  # pad_token_id: <|endoftext|>
        self.boi, self.eoi = int(config.boi_token_id), int(config.eoi_token_id)
        self.side = int(config.vision_config.image_size)
        self.rows = image_tokens(config.vision_config)
        self.fixed = self.rows + 2  # the span: boi, the pads, eoi

    def segment(self, loaded: Loaded) -> list[int]:
        return [self.boi, *[self.placeholder] * self.rows, self.eoi]

    def span(self, m: ImageInput) -> list[int]:
        return [self.boi, *[self.placeholder] * (m.length - 2), self.eoi]

    def place(self, loaded: Loaded, at: int, segment: list[int]) -> list[ImageInput]:
        pixels = loaded[0]
        return [ImageInput(pixels, at, self.fixed, digest(pixels, None), None)]

    def splice(self, ids: list[int], segments: list[list[int]]) -> tuple[list[int], list[int]]:
        """Each boi, pad, eoi triple replaced by its image's segment; ValueError naming
        multi_modal_data unless there is one triple an image and no other pad."""
        self.finish(ids, segments)  # one image (before counting triples: the clearer error)
        triple = [self.boi, self.placeholder, self.eoi]
        at = [i for i in range(len(ids) - 2) if ids[i : i + 3] == triple]
        if len(at) != len(segments) or ids.count(self.placeholder) != len(at):
            raise ValueError(
                f"multi_modal_data['image'] has {len(segments)} image(s) but the prompt has "
                f"{len(at)} '<|begin_of_image|><|endoftext|><|end_of_image|>' placeholder(s) "
                f"and {ids.count(self.placeholder)} <|endoftext|> token(s): put the three "
                "tokens once where the image belongs"
            )
        return replace_tokens(ids, at, segments, width=3)

    def finish(self, ids: list[int], images: Sequence[Any]) -> tuple[Any, ...]:
        """The prompt's images as they are; ValueError naming multi_modal_data for more than
        one (every path: images processed here or ahead)."""
        if len(images) > 1:
            raise ValueError(
                f"multi_modal_data['image'] has {len(images)} images; GLM-4V takes one a "
                "prompt (vLLM's limit; the release's code reads one)"
            )
        return tuple(images)


class _Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.query_key_value = nn.Linear(width, 3 * width)  # [q | k | v], heads inside each
        self.dense = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, L, W] -> [N, L, W]: full attention."""
        q, k, v = (
            t.unflatten(-1, (self.heads, -1)).transpose(1, 2)
            for t in self.query_key_value(x).chunk(3, dim=-1)
        )
        return self.dense(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))


class _Layer(nn.Module):
    """EVA2-CLIP's layer: each sublayer's output normed before its residual add."""

    def __init__(self, v: Any) -> None:
        super().__init__()
        width, eps = int(v.hidden_size), float(v.layer_norm_eps)
        self.input_layernorm = nn.LayerNorm(width, eps=eps)
        self.attention = _Attention(width, int(v.num_heads))
        self.mlp = nn.ModuleDict(
            {
                "fc1": nn.Linear(width, int(v.intermediate_size)),
                "fc2": nn.Linear(int(v.intermediate_size), width),
            }
        )
        self.post_attention_layernorm = nn.LayerNorm(width, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.input_layernorm(self.attention(x))
        mlp = self.mlp["fc2"](F.gelu(self.mlp["fc1"](x)))
        return x + self.post_attention_layernorm(mlp)


class _PatchEmbedding(nn.Module):
    def __init__(self, v: Any) -> None:
        super().__init__()
        width, patch = int(v.hidden_size), int(v.patch_size)
        self.proj = nn.Conv2d(int(v.in_channels), width, patch, patch)
        self.cls_embedding = nn.Parameter(torch.empty(1, width))
        self.position_embedding = nn.Embedding(int(v.num_positions), width)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[N, 3, S, S] -> [N, 1 + grid^2, W]: the cls row, then the patches row-major."""
        x = self.proj(pixels).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_embedding.expand(x.shape[0], -1, -1), x], dim=1)
        return x + self.position_embedding.weight


class _GLU(nn.Module):
    """`linear_proj`: the downsampled rows into the text width through a SwiGLU."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.linear_proj = nn.Linear(hidden, hidden, bias=False)
        self.norm1 = nn.LayerNorm(hidden)  # eps 1e-5 (torch's default, as the release)
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.dense_h_to_4h = nn.Linear(hidden, ffn, bias=False)
        self.dense_4h_to_h = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.norm1(self.linear_proj(x)))
        return self.dense_4h_to_h(F.silu(self.gate_proj(x)) * self.dense_h_to_4h(x))


class Glm4vRemoteImageEncoder(SquareImageEncoder):
    """Images [3, S, S] -> (grid / 2)^2 + 2 rows each of the text model's input embedding."""

    family, prefix = "GLM-4V", PREFIX

    def __init__(self, config: Any) -> None:
        super().__init__()
        v = config.vision_config
        hidden = int(config.hidden_size)
        self.patch_embedding = _PatchEmbedding(v)
        self.transformer = nn.Module()
        self.transformer.layers = nn.ModuleList(
            [_Layer(v) for _ in range(int(v.num_hidden_layers))]
        )
        self.conv = nn.Conv2d(int(v.hidden_size), hidden, kernel_size=2, stride=2)
        self.linear_proj = _GLU(hidden, int(config.ffn_hidden_size))
        self.boi = nn.Parameter(torch.empty(1, 1, hidden))
        self.eoi = nn.Parameter(torch.empty(1, 1, hidden))
        self.scaling_factor = float(v.scaling_factor)
        self.grid = int(v.image_size) // int(v.patch_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[N, 3, S, S] -> [N, (grid / 2)^2 + 2, D]."""
        x = self.patch_embedding(pixels)
        for layer in self.transformer.layers:
            x = layer(x)
        x = x[:, 1:].transpose(1, 2).unflatten(-1, (self.grid, self.grid))  # [N, W, g, g]
        x = self.linear_proj(self.conv(x).flatten(2).transpose(1, 2))  # [N, (g / 2)^2, D]
        n = x.shape[0]
        x = torch.cat([self.boi.expand(n, -1, -1), x, self.eoi.expand(n, -1, -1)], dim=1)
        return x / self.scaling_factor
