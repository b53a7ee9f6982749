"""DeepSeek-VL hybrid's image path (DeepseekVLHybridForConditionalGeneration: SigLIP beside a SAM
high-resolution tower, a two-branch aligner, Llama).

    image -> DeepseekVLHybrid's image processor: pixel_values [3, S, S] (SigLIP's size, mean /
        std) and high_res_pixel_values [3, R, R] (SAM's, CLIP mean / std), both longest side
        resized and padded square with their mean colour
    low:  SigLIP (every layer, post_layernorm) -> [o * o, Dv], o = S / patch
    high: SAM ViT on R / p x R / p patches (+ abs positions): layers
              x = x + proj(attn(layer_norm1(x)))    (windows of window_size, zero-padded, or
                                                     global on global_attn_indexes; decomposed
                                                     relative position biases per axis)
              x = x + lin2(act(lin1(layer_norm2(x))))
          y = proj(neck(last layer)) + alpha * proj(high_res_vision_neck(hidden_states[g + 1]))
              (g = global_attn_indexes[0]; hidden_states[0] is the embedding; neck: 1x1 conv,
              channel LayerNorm, 3x3 conv, channel LayerNorm; proj: bilinear resize to 4o x 4o,
              two stride-2 3x3 convs -> [4 C, o, o]) -> [o * o, 4 C] row-major
    aligner: proj(GELU(concat[high_res_vision_proj(high), vision_proj(low)])) -> [o * o, D]
    prompt: DeepSeek-VL's: a run of num_image_tokens (= o * o) `<image_placeholder>` an image

Host side: one `ImageInput` an image whose pixel_values are both images flattened and
concatenated ([3 S S + 3 R R]: one tensor per image, split again by the encoder). Weights:
multimodal/deepseek_vl.py's names plus `[model.]high_res_vision_model.vision_encoder.*`,
`[model.]high_res_vision_neck.*`, `[model.]high_res_vision_proj.*` and
`[model.]high_res_vision_alpha`. Refused by name: a high-resolution tower that is not SAM's, no
global layer, an odd text hidden size. Image embeddings (vLLM's features input: the aligner's
rows) are taken as a run of their rows, as for DeepSeek-VL.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.layers.activation import get_act_fn
from paged_engine.models.utils import load_named_weights
from paged_engine.multimodal.deepseek_vl import DeepseekVLLayout, image_tokens, tower_name
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.layouts import Loaded, Run, Size
from paged_engine.multimodal.vision_transformer import FinalNormTower

ARCH = "DeepseekVLHybridForConditionalGeneration"
_OURS = (
    "vision_model.",
    "aligner.",
    "high_res_vision_model.",
    "high_res_vision_neck.",
    "high_res_vision_proj.",
    "high_res_vision_alpha",
)


def _sides(config: Any) -> tuple[int, int]:
    """(S, R): the SigLIP and SAM image sides; ValueError naming a SAM config we do not run."""
    high = getattr(config, "high_res_vision_config", None)
    kind = getattr(high, "model_type", None)
    if kind != "sam_vision_model":
        raise ValueError(
            f"high_res_vision_config.model_type={kind!r} is not supported: 'sam_vision_model'"
        )
    if not list(high.global_attn_indexes):
        raise ValueError("high_res_vision_config.global_attn_indexes=[] is not supported")
    return int(config.vision_config.image_size), int(high.image_size)


class DeepseekVLHybridLayout(DeepseekVLLayout):
    """DeepSeek-VL's run; pixels: both images flattened, [3 S S + 3 R R]."""

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        super().__init__(config, placeholder, tokenizer)
        self.sides = _sides(config)

    def _more_sides(self) -> dict[str, int]:
        return {"high_res_size": self.sides[1]}

    def pixel_shape(self, size: Size) -> tuple[int, ...]:
        return (sum(3 * s * s for s in self.sides),)

    def load(self, run: Run, image: Any, count: int) -> Loaded:
        out = run([image])
        low, high = out["pixel_values"][0], out["high_res_pixel_values"][0]
        for x, s in zip((low, high), self.sides, strict=True):
            if tuple(x.shape) != (3, s, s):
                raise ValueError(
                    f"multi_modal_data['image']: the image processor gave pixel values of shape "
                    f"{tuple(x.shape)}, not {(3, s, s)}: check preprocessor_config.json"
                )
        return torch.cat([low.flatten(), high.flatten()]).float(), None


def _rel_table(size: int, table: torch.Tensor) -> torch.Tensor:
    """[size, size, d]: entry (i, j) the learned row for offset i - j (table [2 size - 1, d])."""
    if table.shape[0] != 2 * size - 1:
        raise ValueError(f"a relative position table of {table.shape[0]} rows for {size} tokens")
    idx = torch.arange(size, device=table.device)
    return table[idx[:, None] - idx[None, :] + size - 1]


class _SamAttention(nn.Module):
    def __init__(self, high: Any, tokens: int) -> None:
        super().__init__()
        hidden = int(high.hidden_size)
        self.num_heads = int(high.num_attention_heads)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=bool(high.qkv_bias))
        self.proj = nn.Linear(hidden, hidden)
        self.use_rel_pos = bool(high.use_rel_pos)
        if self.use_rel_pos:  # tokens per side: the window's, or the whole grid's
            head_dim = hidden // self.num_heads
            self.rel_pos_h = nn.Parameter(torch.zeros(2 * tokens - 1, head_dim))
            self.rel_pos_w = nn.Parameter(torch.zeros(2 * tokens - 1, head_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, h, w, C]
        b, h, w, c = x.shape
        q, k, v = self.qkv(x).view(b, h * w, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        bias = None
        if self.use_rel_pos:  # from the unscaled queries, added to the scaled scores
            grid = q.reshape(b, self.num_heads, h, w, -1)
            rel_h = torch.einsum("bnhwc,hkc->bnhwk", grid, _rel_table(h, self.rel_pos_h))
            rel_w = torch.einsum("bnhwc,wkc->bnhwk", grid, _rel_table(w, self.rel_pos_w))
            bias = (rel_h[..., :, None] + rel_w[..., None, :]).reshape(b, -1, h * w, h * w)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)  # [B, heads, L, d]
        return self.proj(out.transpose(1, 2).reshape(b, h, w, c))


class _SamMlp(nn.Module):
    def __init__(self, high: Any) -> None:
        super().__init__()
        self.lin1 = nn.Linear(int(high.hidden_size), int(high.mlp_dim))
        self.act = get_act_fn(high.hidden_act, "high_res_vision_config.hidden_act")
        self.lin2 = nn.Linear(int(high.mlp_dim), int(high.hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(self.act(self.lin1(x)))


class _SamLayer(nn.Module):
    def __init__(self, high: Any, window: int) -> None:
        super().__init__()
        eps = float(high.layer_norm_eps)
        self.window = window  # 0: global attention over the whole grid
        grid = int(high.image_size) // int(high.patch_size)
        self.layer_norm1 = nn.LayerNorm(int(high.hidden_size), eps=eps)
        self.attn = _SamAttention(high, window or grid)
        self.layer_norm2 = nn.LayerNorm(int(high.hidden_size), eps=eps)
        self.mlp = _SamMlp(high)

    def _attend(self, x: torch.Tensor) -> torch.Tensor:  # [B, h, w, C]
        n = self.window
        if not n:
            return self.attn(x)
        b, h, w, c = x.shape
        ph, pw = -h % n, -w % n  # zero padding at the bottom / right, cut after
        x = F.pad(x, (0, 0, 0, pw, 0, ph))
        hh, ww = (h + ph) // n, (w + pw) // n
        win = x.view(b, hh, n, ww, n, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, n, n, c)
        out = self.attn(win).view(b, hh, ww, n, n, c).permute(0, 1, 3, 2, 4, 5)
        return out.reshape(b, hh * n, ww * n, c)[:, :h, :w]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._attend(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class _ChannelNorm(nn.LayerNorm):
    """LayerNorm over the channels of [B, C, H, W] (HF's SamLayerNorm, channels_first)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class _SamNeck(nn.Module):
    def __init__(self, high: Any) -> None:
        super().__init__()
        hidden, out = int(high.hidden_size), int(high.output_channels)
        self.conv1 = nn.Conv2d(hidden, out, kernel_size=1, bias=False)
        self.layer_norm1 = _ChannelNorm(out, eps=1e-6)  # SamLayerNorm's default, not the config's
        self.conv2 = nn.Conv2d(out, out, kernel_size=3, padding=1, bias=False)
        self.layer_norm2 = _ChannelNorm(out, eps=1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, h, w, C] -> [B, out, h, w]
        x = self.layer_norm1(self.conv1(x.permute(0, 3, 1, 2)))
        return self.layer_norm2(self.conv2(x))


class _PatchEmbed(nn.Module):
    def __init__(self, high: Any) -> None:
        super().__init__()
        p = int(high.patch_size)
        self.projection = nn.Conv2d(int(high.num_channels), int(high.hidden_size), p, stride=p)


class _SamEncoder(nn.Module):
    """HF's SamVisionEncoder (names kept): -> (neck(last layer), hidden_states[g + 1])."""

    def __init__(self, high: Any) -> None:
        super().__init__()
        grid = int(high.image_size) // int(high.patch_size)
        self.patch_embed = _PatchEmbed(high)
        self.pos_embed = (
            nn.Parameter(torch.zeros(1, grid, grid, int(high.hidden_size)))
            if high.use_abs_pos
            else None
        )
        glob = set(high.global_attn_indexes)
        windows = [0 if i in glob else int(high.window_size) for i in range(high.num_hidden_layers)]
        self.layers = nn.ModuleList(_SamLayer(high, n) for n in windows)
        self.neck = _SamNeck(high)
        self.tap = int(high.global_attn_indexes[0]) + 1  # hidden_states[0]: the embedding

    def forward(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.patch_embed.projection(pixels).permute(0, 2, 3, 1)  # [B, h, w, C]
        if self.pos_embed is not None:
            x = x + self.pos_embed
        tapped = x
        for i, layer in enumerate(self.layers, start=1):
            x = layer(x)
            if i == self.tap:
                tapped = x
        return self.neck(x), tapped


class _SamTower(nn.Module):  # the checkpoint's `high_res_vision_model.vision_encoder` nesting
    def __init__(self, high: Any) -> None:
        super().__init__()
        self.vision_encoder = _SamEncoder(high)


class _SamProj(nn.Module):
    def __init__(self, high: Any, side: int) -> None:
        super().__init__()
        c = int(high.output_channels)
        self.side = side  # o: the SigLIP grid's side
        self.conv1 = nn.Conv2d(c, 2 * c, kernel_size=3, stride=2, padding=1, bias=False)
        self.conv2 = nn.Conv2d(2 * c, 4 * c, kernel_size=3, stride=2, padding=1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, h, w] -> [B, 4C, o, o]
        x = F.interpolate(x, size=(4 * self.side,) * 2, mode="bilinear", align_corners=False)
        return self.conv2(self.conv1(x))


class _Aligner(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        text = int(config.text_config.hidden_size)
        high = 4 * int(config.high_res_vision_config.output_channels)
        self.vision_proj = nn.Linear(int(config.vision_config.hidden_size), text // 2)
        self.high_res_vision_proj = nn.Linear(high, text // 2)
        self.act = get_act_fn("gelu")
        self.proj = nn.Linear(text, text)

    def forward(self, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.high_res_vision_proj(high), self.vision_proj(low)], dim=-1)
        return self.proj(self.act(x))


class DeepseekVLHybridImageEncoder(nn.Module):
    """Images -> rows of the text model's input embedding (one row per placeholder)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.sides = _sides(config)
        if int(config.text_config.hidden_size) % 2:
            raise ValueError("text_config.hidden_size must be even (two aligner halves)")
        side = int(image_tokens(config) ** 0.5)
        high = config.high_res_vision_config
        self.vision_model = FinalNormTower(config.vision_config)
        self.high_res_vision_model = _SamTower(high)
        self.high_res_vision_neck = _SamNeck(high)
        self.high_res_vision_proj = _SamProj(high, side)
        self.high_res_vision_alpha = nn.Parameter(torch.zeros(1))
        self.aligner = _Aligner(config)

    def forward(self, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
        """low [N, 3, S, S], high [N, 3, R, R] -> [N, o * o, D]."""
        last, tapped = self.high_res_vision_model.vision_encoder(high)
        proj = self.high_res_vision_proj
        y = proj(last) + proj(self.high_res_vision_neck(tapped)) * self.high_res_vision_alpha
        return self.aligner(self.vision_model.last(low), y.flatten(2).transpose(1, 2))

    def encode(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        weight = self.aligner.proj.weight
        s, r = self.sides
        pixels = [m.pixel_values for m in images]  # [3 S S + 3 R R] each
        flat = torch.stack(pixels).to(weight.device, weight.dtype)  # type: ignore[misc]
        low, high = flat.split([3 * s * s, 3 * r * r], dim=1)
        return list(self(low.view(-1, 3, s, s), high.view(-1, 3, r, r)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """multimodal/deepseek_vl.py's tensors and the SAM branch's (see the module doc);
        ValueError naming a missing or unexpected one."""

        def ours(name: str) -> str | None:
            name = tower_name(name)
            return name if name is not None and name.startswith(_OURS) else None

        picked = ((n, t) for n, t in ((ours(n), t) for n, t in weights) if n is not None)
        return load_named_weights(self, picked)
