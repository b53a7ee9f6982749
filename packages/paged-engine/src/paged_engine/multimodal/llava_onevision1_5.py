"""LLaVA-OneVision-1.5's image path (LlavaOnevision15ForConditionalGeneration): the RICE-ViT
tower at native resolution, a 2 x 2 patch merger, and a Qwen3 decoder at plain 1-D positions.

    image -> Qwen2VLImageProcessor(Pil) (the auto class transformers 5.25 names for
        llava_onevision1_5) with temporal_patch_size 1: smart resize to multiples of
        patch * merge pixels, patch rows [t*h*w, 3 * p * p] in merge-block order, grid (1, h, w)
    -> the vision encoder ("visual": RiceVisionEncoder, transformers' LlavaOnevision15VisionModel)
        patch_embed.proj (a bias-free Conv2d whose kernel is the whole patch: one matmul)
        each frame's rows prefixed by one class row (class_embedding), whose rotary angles are
            class_pos_emb repeated twice; the patches' are Qwen2.5-VL's axial 2-D ones
            (head_dim / 4 row and as many column frequencies, float32)
        -> pre_layernorm -> blocks: x = x + attn(norm1(x), rope); x = x + mlp(norm2(x))
           (LayerNorms of layer_norm_eps, fc1 -> hidden_act -> fc2, attention within a frame
           and its class row)
        -> class rows dropped -> merger: LayerNorm per patch, each m*m consecutive patches
           concatenated -> Linear -> GELU -> Linear -> [t*h*w / m^2, text hidden]
    prompt (Exaone4_5_Processor, Qwen2-VL's replace_image_token): the chat template's lone
        <|image_pad|> repeated once per merged patch, between <|vision_start|> / <|vision_end|>

Text positions: LlavaOnevision15Model builds position_ids as arange (no M-RoPE, no
rope_deltas), so the layout has no position table and the decoder is models/qwen3.py's
through models/text_wrappers.py.

Weights: what transformers 5.25 saves (its reverse conversion: `visual.class_embedding`,
`visual.class_pos_emb`, `visual.merger.ln_q`, `visual.merger.mlp.{0,2}`, the decoder under
`model.model.`) and the Hub's original names are ours; transformers' in-memory names
(`cls_embeddings.*`, `merger.norm`, `merger.linear_fc{1,2}`, `merger.fc{1,2}`) are mapped to
them, under `visual.` or `model.visual.`.

Refused by name: vision_config.model_type other than llava_onevision1_5_vision, a head_dim
not divisible by 4, rope_type other than axial, an image processor whose temporal_patch_size
is not 1 (transformers' tower reads one frame a patch row). Videos are refused by the input
processor (multi_modal_data['video']).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from paged_engine.models.utils import load_named_weights
from paged_engine.multimodal import qwen2_vl_vision as qwen
from paged_engine.multimodal.layouts import Loaded, Run, Size
from paged_engine.multimodal.layouts_qwen import Exaone45Layout
from paged_engine.multimodal.qwen2_vl import QwenImageEncoder

MODEL_TYPE = "llava_onevision1_5_vision"
# transformers' module names -> the saved ones we keep (first match wins)
_RENAMES = (
    ("cls_embeddings.class_embedding", "class_embedding"),
    ("cls_embeddings.class_pos_emb", "class_pos_emb"),
    ("merger.norm.", "merger.ln_q."),
    ("merger.linear_fc1.", "merger.mlp.0."),
    ("merger.linear_fc2.", "merger.mlp.2."),
    ("merger.fc1.", "merger.mlp.0."),
    ("merger.fc2.", "merger.mlp.2."),
)


def _eps(config: Any) -> float:
    eps = getattr(config, "layer_norm_eps", 1e-5)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0:
        raise ValueError(f"vision_config.layer_norm_eps={eps!r} is not supported")
    return float(eps)


def patch_dim(config: Any) -> int:
    """Width of a pixel row: channels x patch x patch (one frame a patch)."""
    v = config.vision_config
    return qwen._int_field(v, "in_channels", 3) * qwen._int_field(v, "patch_size") ** 2


class _Block(qwen._Block):
    """Qwen2-VL's block (its forward) with LayerNorms of the config's eps."""

    def __init__(self, dim: int, num_heads: int, hidden: int, act: str, eps: float) -> None:
        nn.Module.__init__(self)
        self.norm1, self.norm2 = nn.LayerNorm(dim, eps), nn.LayerNorm(dim, eps)
        self.attn = qwen._Attention(dim, num_heads)
        self.mlp = qwen._MLP(dim, hidden, act)


class _PatchEmbed(nn.Module):
    """A bias-free Conv2d whose kernel is the whole patch, one matmul on flattened patches."""

    def __init__(self, in_channels: int, patch: int, dim: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(in_channels, dim, patch, stride=patch, bias=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [P, C*p*p] -> [P, D]
        weight = self.proj.weight
        return pixels.to(weight.device, weight.dtype) @ weight.flatten(1).T


def _positions(grids: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """[P, 2] (row, column) of every patch, in merge-block order, frames repeated."""
    out = []
    for t, h, w in grids:
        shape = (h // merge, w // merge, merge, merge)
        rows = torch.arange(h).view(h // merge, 1, merge, 1).expand(shape)
        cols = torch.arange(w).view(1, w // merge, 1, merge).expand(shape)
        out.append(torch.stack([rows, cols], dim=-1).reshape(-1, 2).repeat(t, 1))
    return torch.cat(out)


class RiceVisionEncoder(nn.Module):
    """`visual` of HF's LlavaOnevision15ForConditionalGeneration (RICE-ViT)."""

    def __init__(self, vision_config: Any) -> None:
        super().__init__()
        config = vision_config
        model_type = getattr(config, "model_type", None)
        if model_type != MODEL_TYPE:
            raise ValueError(
                f"vision_config.model_type={model_type!r} is not supported; supported: "
                f"{MODEL_TYPE!r}"
            )
        width = qwen._int_field(config, "hidden_size")
        num_heads = qwen._int_field(config, "num_heads")
        depth = qwen._int_field(config, "depth")
        hidden = qwen._int_field(config, "intermediate_size")
        self.patch_size = qwen._int_field(config, "patch_size")
        self.in_channels = qwen._int_field(config, "in_channels", 3)
        self.merge = qwen._int_field(config, "spatial_merge_size")
        out_dim = qwen._int_field(config, "out_hidden_size")
        self.head_dim = qwen._head_dim(config, width, num_heads)
        rope = getattr(config, "rope_parameters", None) or {}
        if rope.get("rope_type", "axial") != "axial":  # transformers raises on any other
            raise ValueError(
                f"vision_config.rope_parameters.rope_type={rope['rope_type']!r} is not "
                "supported: 'axial'"
            )
        self.rope_theta = qwen._rope_theta(config)
        act = getattr(config, "hidden_act", None)
        if not isinstance(act, str):
            raise ValueError(f"vision_config.hidden_act={act!r} is not supported")
        eps = _eps(config)

        self.patch_embed = _PatchEmbed(self.in_channels, self.patch_size, width)
        self.class_embedding = nn.Parameter(torch.empty(width))
        self.class_pos_emb = nn.Parameter(torch.empty(1, self.head_dim // 2))
        self.pre_layernorm = nn.LayerNorm(width, eps)
        self.blocks = nn.ModuleList(
            _Block(width, num_heads, hidden, act, eps) for _ in range(depth)
        )
        self.merger = qwen._PatchMerger(width, out_dim, self.merge, rms=False)
        self.merger.ln_q = nn.LayerNorm(width, eps)  # layer_norm_eps, not Qwen's 1e-6

    def forward(
        self, pixel_values: torch.Tensor, grid_thw: Sequence[tuple[int, int, int]]
    ) -> torch.Tensor:
        """pixel_values [sum t*h*w, C*p*p] (images concatenated); grid_thw: each image's
        (t, h, w) in patches -> [sum t*h*w / m**2, out_dim]."""
        row_width = self.in_channels * self.patch_size**2
        grids = qwen._check_grids(pixel_values, grid_thw, self.merge, row_width)
        x = self.patch_embed(pixel_values)  # [P, D]
        device, rows = x.device, x.shape[0]
        frames = [h * w for t, h, w in grids for _ in range(t)]
        # the sequence: | cls | frame 0 | cls | frame 1 | ...; patch i sits at i + (its frame
        # number + 1), frame f's class row at the start of its span. Index tensors are built
        # on the CPU (no device sync) and moved once.
        spans = torch.tensor(frames) + 1
        starts = torch.cumsum(spans, 0) - spans
        frame_of = torch.repeat_interleave(torch.arange(len(frames)), spans - 1)
        patch_at = (torch.arange(rows) + frame_of + 1).to(device)
        cls_at = starts.to(device)
        seq = x.new_empty(rows + len(frames), x.shape[1])
        seq[patch_at] = x
        seq[cls_at] = self.class_embedding.to(x.dtype)

        cos_p, sin_p = qwen._rotary_tables(
            _positions(grids, self.merge), self.head_dim, self.rope_theta, device
        )  # [P, 1, D] float32
        cls_angles = self.class_pos_emb.float().repeat(1, 2)[:, None]  # [1, 1, D]
        cos = cos_p.new_empty(seq.shape[0], 1, self.head_dim)
        sin = torch.empty_like(cos)
        cos[patch_at], sin[patch_at] = cos_p, sin_p
        cos[cls_at], sin[cls_at] = cls_angles.cos(), cls_angles.sin()

        # attention within each frame and its class row
        spans_of = zip(starts.tolist(), spans.tolist(), strict=True)
        segments = [torch.arange(s, s + n) for s, n in spans_of]
        groups = [g.to(device) for g in qwen._group_by_length(segments)]
        h = self.pre_layernorm(seq)
        for block in self.blocks:
            h = block(h, cos, sin, groups)
        return self.merger(h[patch_at])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's `visual.*` / `model.visual.*` tensors (any other name is passed
        over); ValueError naming a missing or unexpected one."""

        def inner(name: str) -> str:
            name = name.removeprefix("model.").removeprefix("visual.")
            for old, new in _RENAMES:
                if name.startswith(old):
                    return new + name[len(old) :]
            return name

        picked = ((n, t) for n, t in weights if n.removeprefix("model.").startswith("visual."))
        return load_named_weights(self, picked, rename=inner)


class LlavaOnevision15ImageEncoder(QwenImageEncoder):
    """Images -> rows of the text model's input embedding, one per placeholder."""

    def __init__(self, config: Any) -> None:
        nn.Module.__init__(self)
        self.visual = RiceVisionEncoder(config.vision_config)


class LlavaOnevision15Layout(Exaone45Layout):
    """Qwen2-VL's runs at 1-D positions over one-frame patch rows [t*h*w, C * p * p]."""

    def __init__(self, config: Any, placeholder: int, tokenizer: Any) -> None:
        super().__init__(config, placeholder, tokenizer)
        self.row_width = patch_dim(config)

    def pixel_shape(self, size: Size) -> tuple[int, ...]:
        assert size is not None and len(size) == 3
        return (size[0] * size[1] * size[2], self.row_width)

    def load(self, run: Run, image: Any, count: int) -> Loaded:
        out = run([image])
        width = out["pixel_values"].shape[-1]
        if width != self.row_width and width % self.row_width == 0:
            raise ValueError(
                f"preprocessor_config.json temporal_patch_size={width // self.row_width} is not "
                f"supported for {self.config.architectures[0]}: its tower reads one frame a "
                "patch row (temporal_patch_size 1)"
            )
        return super().load(lambda images, **kw: out, image, count)
