"""Molmo2's tower and adapter (transformers' Molmo2VisionModel and Molmo2Adapter): an image's
views -> one row per token of its prompt segment (the host side: multimodal/molmo2.py,
molmo2_processor.py).

    views [n, cp * cp, p * p * 3] -> patch_embedding (a Linear) + positional_embedding
        -> ViT layers: x += attn(LN1(x)); x += fc2(act(fc1(LN2(x))))  (all patches, both ways)
        -> hidden_states[k] for each k of adapter_config.vision_feature_layer (transformers'
           indexing: entry 0 the embeddings, entry i + 1 layer i's output; negative from the
           end), side by side: features [n * cp * cp, D * len(layers)]
    each pooled token (Geometry.pooling's window of patch indices, -1 padding):
        query = mean of its window's valid patches; one attention (image_pooling_2d: q from the
        query, k / v from the window's patches, padding keys masked) -> image_projector
        (down(silu(gate(x)) * up(x))) -> a text hidden row
    segment rows (each image of an `ImageInput`'s run in turn): every token's own embedding
        (the checkpoint's rows of the extra vocabulary, text_config.additional_vocab_size ids
        after vocab_size, which Molmo2's image tokens are), plus the pooled row on each
        <im_patch> in order (transformers adds the features to the placeholders' embeddings)

Only the layers up to the deepest one read are built. Weight names: the Hub's (what
transformers' save_pretrained writes back: `model.vision_backbone.image_vit.transformer.
resblocks.N.attention.wq`, `image_pooling_2d.wq`, `image_projector.w1 / w2 / w3` for gate /
down / up, `model.transformer.wte.embedding` + `new_embedding` for the token table) and
transformers' in-memory ones (`model.vision_tower.layers.N.self_attn.q_proj`,
`model.multi_modal_projector.*`, `model.language_model.embed_tokens.weight`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.layers.activation import get_act_fn
from paged_engine.models.utils import load_named_weights
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.molmo2_processor import Geometry, geometries

_HUB = (  # Hub name piece -> transformers' (ours), applied in order
    ("model.vision_backbone.image_vit.transformer.resblocks.", "vision_tower.layers."),
    ("model.vision_backbone.image_vit.", "vision_tower."),
    ("model.vision_backbone.", "multi_modal_projector."),
    (".attention.wq.", ".self_attn.q_proj."),
    (".attention.wk.", ".self_attn.k_proj."),
    (".attention.wv.", ".self_attn.v_proj."),
    (".attention.wo.", ".self_attn.o_proj."),
    (".attention_norm.", ".layer_norm1."),
    (".ffn_norm.", ".layer_norm2."),
    (".feed_forward.w1.", ".mlp.fc1."),
    (".feed_forward.w2.", ".mlp.fc2."),
    ("image_pooling_2d.wq.", "image_pooling_2d.q_proj."),
    ("image_pooling_2d.wk.", "image_pooling_2d.k_proj."),
    ("image_pooling_2d.wv.", "image_pooling_2d.v_proj."),
    ("image_pooling_2d.wo.", "image_pooling_2d.o_proj."),
    ("image_projector.w1.", "image_projector.gate_proj."),
    ("image_projector.w2.", "image_projector.down_proj."),
    ("image_projector.w3.", "image_projector.up_proj."),
)
_TABLE = "model.transformer.wte."  # the Hub's token table, in two parts
_TABLE_T5 = "model.language_model.embed_tokens.weight"


class Attention(nn.Module):
    """transformers' Molmo2VisionAttention: q from `x`, k / v from `context` (itself when
    None), grouped heads, scale head_dim^-0.5, `mask` [.., Lq, Lk] True where a key counts."""

    def __init__(self, c: Any, width: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (
            int(c.num_attention_heads),
            int(c.num_key_value_heads),
            int(c.head_dim),
        )
        if self.heads % self.kv_heads:
            raise ValueError(
                f"num_attention_heads={self.heads} is not a multiple of "
                f"num_key_value_heads={self.kv_heads}"
            )
        bias, d = bool(c.attention_bias), self.head_dim
        self.q_proj = nn.Linear(width, self.heads * d, bias=bias)
        self.k_proj = nn.Linear(width, self.kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(width, self.kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.heads * d, int(c.hidden_size), bias=bias)

    def forward(
        self, x: torch.Tensor, context: torch.Tensor | None = None, mask: torch.Tensor | None = None
    ) -> torch.Tensor:  # x: [N, Lq, W], context: [N, Lk, W]
        context = x if context is None else context
        n, lq, lk = x.shape[0], x.shape[1], context.shape[1]
        q = self.q_proj(x).view(n, lq, self.heads, -1).transpose(1, 2)
        k = self.k_proj(context).view(n, lk, self.kv_heads, -1).transpose(1, 2)
        v = self.v_proj(context).view(n, lk, self.kv_heads, -1).transpose(1, 2)
        group = self.heads // self.kv_heads  # kv head j serves q heads [j * group, (j+1) * group)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(n, lq, -1))


class _Layer(nn.Module):
    def __init__(self, c: Any) -> None:
        super().__init__()
        d, eps = int(c.hidden_size), float(c.layer_norm_eps)
        self.layer_norm1 = nn.LayerNorm(d, eps=eps)
        self.self_attn = Attention(c, d)
        self.layer_norm2 = nn.LayerNorm(d, eps=eps)
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(d, int(c.intermediate_size))
        self.mlp.fc2 = nn.Linear(int(c.intermediate_size), d)
        self.act = get_act_fn(c.hidden_act, "vision_config.hidden_act")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp.fc2(self.act(self.mlp.fc1(self.layer_norm2(x))))


class Tower(nn.Module):
    """Molmo2VisionModel up to layer `depth - 1`: views -> hidden_states (embeddings first)."""

    def __init__(self, c: Any, depth: int) -> None:
        super().__init__()
        p, d = int(c.patch_size), int(c.hidden_size)
        self.positional_embedding = nn.Parameter(torch.empty(int(c.num_position_embeddings), d))
        self.patch_embedding = nn.Linear(p * p * int(c.num_channels), d)
        self.layers = nn.ModuleList(_Layer(c) for _ in range(depth))

    def forward(self, views: torch.Tensor) -> list[torch.Tensor]:  # [n, L, p * p * 3]
        if views.shape[1] != self.positional_embedding.shape[0]:
            raise ValueError(
                f"a view of {views.shape[1]} patches for a tower of "
                f"{self.positional_embedding.shape[0]} positions"
            )
        x = self.patch_embedding(views) + self.positional_embedding
        states = [x]
        for layer in self.layers:
            x = layer(x)
            states.append(x)
        return states


class Adapter(nn.Module):
    """Molmo2Adapter: attention pooling over each token's window, then the projector MLP."""

    def __init__(self, c: Any, width: int) -> None:
        super().__init__()
        self.image_pooling_2d = Attention(c, width)
        inner, bias = int(c.intermediate_size), bool(c.mlp_bias)
        self.image_projector = nn.Module()
        self.image_projector.gate_proj = nn.Linear(int(c.hidden_size), inner, bias=bias)
        self.image_projector.up_proj = nn.Linear(int(c.hidden_size), inner, bias=bias)
        self.image_projector.down_proj = nn.Linear(inner, int(c.text_hidden_size), bias=False)
        self.act = get_act_fn(c.hidden_act, "adapter_config.hidden_act")

    def forward(self, features: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
        """features [patches, W], windows [T, k] (-1 padding) -> [T, text hidden]."""
        valid = windows >= 0  # every window holds a patch (padding < a window a side)
        patches = features[windows.clamp(min=0)] * valid[..., None].to(features.dtype)
        count = valid.sum(-1).clamp(min=1).to(features.dtype)  # [T]
        query = patches.sum(-2, keepdim=True) / count[:, None, None]  # [T, 1, W]
        pooled = self.image_pooling_2d(query, patches, valid[:, None, None, :])[:, 0]
        mlp = self.image_projector
        return mlp.down_proj(self.act(mlp.gate_proj(pooled)) * mlp.up_proj(pooled))


def _renamed(name: str) -> str | None:
    """A checkpoint name in this module's names, or None (not the tower's or adapter's)."""
    for theirs, ours in _HUB:
        name = name.replace(theirs, ours)
    name = name.removeprefix("model.")
    return name if name.startswith(("vision_tower.", "multi_modal_projector.")) else None


class Molmo2ImageEncoder(nn.Module):
    """Images (`ImageInput`s of molmo2.Molmo2Layout) -> each one's segment rows [length, D]."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        vision, adapter, text = config.vision_config, config.adapter_config, config.text_config
        n = int(vision.num_hidden_layers)
        self.feature_layers = [int(k) for k in adapter.vision_feature_layer]
        if not all(-n <= k < n for k in self.feature_layers):
            raise ValueError(
                f"adapter_config.vision_feature_layer={self.feature_layers} must index the "
                f"{n} layers of vision_config"
            )
        # hidden_states index of each: k >= 0 -> k + 1; k < 0 -> n + 1 + k
        self.states = [k + 1 if k >= 0 else n + 1 + k for k in self.feature_layers]
        self.vision_tower = Tower(vision, max(self.states))
        width = int(vision.hidden_size) * len(self.feature_layers)
        self.multi_modal_projector = Adapter(adapter, width)
        self.base = int(text.vocab_size)  # the extra vocabulary's first id
        self.extra = int(getattr(text, "additional_vocab_size", 0) or 0)
        self.total = self.base + self.extra
        d = int(text.hidden_size)
        self.register_buffer("extra_rows", torch.zeros(self.extra, d), persistent=False)
        self.patch, self.start = int(config.image_patch_id), int(config.image_start_token_id)
        self.end = int(config.image_end_token_id)

    def image_rows(self, m: ImageInput) -> torch.Tensor:
        """An `ImageInput`'s rows [m.length, D]: each image of its run in turn."""
        found = geometries(m.image_size)
        views = m.pixel_values.split([g.views for g in found])  # type: ignore[union-attr]
        return torch.cat([self._rows(g, v) for g, v in zip(found, views, strict=True)])

    def _rows(self, g: Geometry, views: torch.Tensor) -> torch.Tensor:
        """One image's segment rows; views [g.views, cp * cp, p * p * 3]."""
        ids = torch.tensor(g.segment(self.patch, self.start, self.end))
        if int(ids.min()) < self.base or int(ids.max()) >= self.total:
            raise ValueError(
                "Molmo2's image tokens must lie in the extra vocabulary [text_config.vocab_size, "
                "+ additional_vocab_size)"
            )
        weight = self.vision_tower.patch_embedding.weight
        states = self.vision_tower(views.to(weight.device, weight.dtype))
        features = torch.cat([states[i] for i in self.states], dim=-1)
        windows = g.pooling().to(weight.device)
        pooled = self.multi_modal_projector(features.reshape(-1, features.shape[-1]), windows)
        rows = self.extra_rows[ids.to(weight.device) - self.base].clone()
        is_patch = ids.to(weight.device) == self.patch
        if int(is_patch.sum()) != pooled.shape[0]:
            raise RuntimeError(f"{pooled.shape[0]} pooled rows for {int(is_patch.sum())} patches")
        rows[is_patch] = rows[is_patch] + pooled.to(rows.dtype)
        return rows

    def encode(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        return [self.image_rows(m) for m in images]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The tower's and adapter's tensors and the token table's extra rows (any other name
        is passed over); ValueError naming a missing or unexpected one."""
        parts: dict[str, torch.Tensor] = {}

        def picked() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith(_TABLE) or name == _TABLE_T5:
                    parts[name] = tensor  # (a view of the mapped file: rows read below)
                    continue
                ours = _renamed(name)
                if ours is not None:
                    yield ours, tensor

        loaded = load_named_weights(self, picked())
        self._load_extra_rows(parts)
        return loaded

    def _load_extra_rows(self, parts: dict[str, torch.Tensor]) -> None:
        """Rows [vocab_size, vocab_size + additional_vocab_size) of the token table: the Hub's
        `embedding` then `new_embedding` stacked (transformers' Concatenate), or one table."""
        if _TABLE_T5 in parts:
            pieces = [parts[_TABLE_T5]]
        else:
            found = [parts.get(_TABLE + k) for k in ("embedding", "new_embedding")]
            if found[0] is None or found[1] is None:
                raise ValueError(
                    f"the checkpoint has no token table ({_TABLE}embedding / new_embedding)"
                )
            pieces = [found[0], found[1]]
        if sum(p.shape[0] for p in pieces) != self.total:
            rows = sum(p.shape[0] for p in pieces)
            raise ValueError(f"a token table of {rows} rows for {self.total} ids")
        taken, at = [], 0  # the rows [base, total) of the stacked pieces, read piece by piece
        for p in pieces:
            lo, hi = max(self.base, at), min(self.total, at + p.shape[0])
            if lo < hi:
                taken.append(p[lo - at : hi - at])
            at += p.shape[0]
        if taken:
            self.extra_rows.copy_(torch.cat(taken))
