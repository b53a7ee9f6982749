"""Molmo v1's vision backbone (the release's OLMoPretrainedVisionBackbone; vLLM's
MolmoVisionBackbone): an image's views -> one row per token of its prompt segment (the host
side: multimodal/molmo_v1.py, molmo_v1_processor.py).

    views [V, 3, S, S] -> OpenAI CLIP ViT (transformers' CLIPVisionModel maths: patch conv
        without bias, CLS, position table, pre-layernorm, quick_gelu layers:
        vision_transformer.VisionTransformer) -> the outputs of the layers of vit_layers
        (the release's list counts layer outputs only: k < 0 is transformers' hidden_states
        index k too), side by side, CLS dropped: [V, cp * cp, D * len(vit_layers)]
    padding embeddings (image_padding_embed "pad_and_partial_pad", hard-coded by the
        release): + pad_embed[0] on patches whose mask is 0, + pad_embed[1] where it is
        below 1 otherwise (the release's masks as it pairs them with the views:
        molmo_v1_processor.Geometry.masks)
    each <im_patch>'s 2 x 2 window (Geometry.windows): attention pooling whose query is the
        window's mean, then the SwiGLU projector (w2(silu(w1 x) * w3 x)): transformers'
        Molmo2Adapter maths over full windows (molmo2_encoder.Adapter)
    segment rows: every token's own embedding (its row of the token table: the image tokens
        lie in the 128 rows after embedding_size for the release tokenizer), plus the pooled
        feature on each <im_patch> in order (the release adds them)

Only the tower layers up to the deepest one read are built (the others' weights skipped).
Weight names: the release's (`model.vision_backbone.image_vit.transformer.resblocks.N.
attention.wq`, `feed_forward.w1`, `attention_norm`, `pre_ln`, `positional_embedding`, a
Linear patch_embedding over (row, col, channel) pixels, `image_pooling_2d.wq`,
`image_projector.w1 / w2 / w3`, `pad_embed`; the token table `model.transformer.wte.embedding`
+ `new_embedding`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from paged_engine.models.utils import load_named_weights
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.molmo2_encoder import Adapter
from paged_engine.multimodal.molmo_v1_processor import Geometry
from paged_engine.multimodal.vision_transformer import VisionTransformer

_PREFIX = "model.vision_backbone."
_TABLE = "model.transformer.wte."
_NAMES = (  # the release's name piece -> ours, applied in order
    ("image_vit.transformer.resblocks.", "image_vit.encoder.layers."),
    ("image_vit.class_embedding", "image_vit.embeddings.class_embedding"),
    ("image_vit.positional_embedding", "image_vit.embeddings.position_embedding.weight"),
    ("image_vit.patch_embedding.", "image_vit.embeddings.patch_embedding."),
    ("image_vit.pre_ln.", "image_vit.pre_layrnorm."),
    (".attention.wq.", ".self_attn.q_proj."),
    (".attention.wk.", ".self_attn.k_proj."),
    (".attention.wv.", ".self_attn.v_proj."),
    (".attention.wo.", ".self_attn.out_proj."),
    (".attention_norm.", ".layer_norm1."),
    (".ffn_norm.", ".layer_norm2."),
    (".feed_forward.w1.", ".mlp.fc1."),
    (".feed_forward.w2.", ".mlp.fc2."),
    ("image_pooling_2d.wq.", "adapter.image_pooling_2d.q_proj."),
    ("image_pooling_2d.wk.", "adapter.image_pooling_2d.k_proj."),
    ("image_pooling_2d.wv.", "adapter.image_pooling_2d.v_proj."),
    ("image_pooling_2d.wo.", "adapter.image_pooling_2d.o_proj."),
    ("image_projector.w1.", "adapter.image_projector.gate_proj."),
    ("image_projector.w2.", "adapter.image_projector.down_proj."),
    ("image_projector.w3.", "adapter.image_projector.up_proj."),
)
_LAYER = re.compile(r"image_vit\.encoder\.layers\.(\d+)\.")


class MolmoV1ImageEncoder(nn.Module):
    """Images (`ImageInput`s of molmo_v1.MolmoV1Layout) -> each one's segment rows [L, D]."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        vision, text = config.vision_config, config.text_config
        n = int(vision.num_hidden_layers)
        self.states = [k + 1 if k >= 0 else n + 1 + k for k in config.vit_layers]
        self.depth = max(self.states)
        self.image_vit = VisionTransformer(vision, self.depth)
        d, heads = int(vision.hidden_size), int(vision.num_attention_heads)
        width = d * len(self.states)
        adapter = SimpleNamespace(
            num_attention_heads=heads,
            num_key_value_heads=heads,
            head_dim=d // heads,
            attention_bias=True,
            hidden_size=d,
            intermediate_size=int(text.intermediate_size),
            mlp_bias=False,
            text_hidden_size=int(text.hidden_size),
            hidden_act="silu",
        )
        self.adapter = Adapter(adapter, width)
        self.pad_embed = nn.Parameter(torch.zeros(2, width))
        self.ids = [int(i) for i in config.image_tokens]  # patch, start, end, col
        self.register_buffer("token_rows", torch.zeros(4, int(text.hidden_size)), persistent=False)

    def image_rows(self, m: ImageInput) -> torch.Tensor:
        g = Geometry(*m.image_size)  # type: ignore[misc]
        weight = self.image_vit.embeddings.patch_embedding.weight
        views = m.pixel_values.to(weight.device, weight.dtype)  # type: ignore[union-attr]
        states = self.image_vit(views, self.states)
        features = torch.cat(states, dim=-1)[:, 1:]  # [V, cp * cp, width], CLS dropped
        masks = g.masks().to(weight.device)[..., None]  # [V, cp * cp, 1]
        full = (masks == 0).to(features.dtype)
        partial = ((masks < 1) & (masks != 0)).to(features.dtype)
        features = features + self.pad_embed[0] * full + self.pad_embed[1] * partial
        windows = g.windows().to(weight.device)
        pooled = self.adapter(features.reshape(-1, features.shape[-1]), windows)
        ids = torch.tensor(g.tokens(*self.ids), device=weight.device)
        rows = self.token_rows[_index(ids, self.ids)].clone()
        is_patch = ids == self.ids[0]
        rows[is_patch] = rows[is_patch] + pooled.to(rows.dtype)
        return rows

    def encode(self, images: Sequence[ImageInput]) -> list[torch.Tensor]:
        return [self.image_rows(m) for m in images]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The backbone's tensors and the image tokens' table rows (any other name is passed
        over); ValueError naming a missing or unexpected one."""
        table: dict[str, torch.Tensor] = {}

        def picked() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith(_TABLE):
                    table[name.removeprefix(_TABLE)] = tensor
                    continue
                if not name.startswith(_PREFIX):
                    continue
                ours = name.removeprefix(_PREFIX)
                for theirs, mine in _NAMES:
                    ours = ours.replace(theirs, mine)
                layer = _LAYER.search(ours)
                if layer is not None and int(layer.group(1)) >= self.depth:
                    continue  # a layer past the deepest one read
                if ours == "image_vit.embeddings.patch_embedding.weight":
                    d, p = tensor.shape[0], self.image_vit.embeddings.patch_embedding.kernel_size[0]
                    tensor = tensor.reshape(d, p, p, -1).permute(0, 3, 1, 2)  # (row, col, ch)
                yield ours, tensor

        loaded = load_named_weights(self, picked())
        if set(table) != {"embedding", "new_embedding"}:
            raise ValueError(
                f"the checkpoint has no token table ({_TABLE}embedding / new_embedding)"
            )
        base, extra = table["embedding"], table["new_embedding"]
        total = base.shape[0] + extra.shape[0]
        if max(self.ids) >= total:
            raise ValueError(f"image token id {max(self.ids)} past the token table's {total} rows")
        for row, i in enumerate(self.ids):  # four rows, read from the mapped parts
            self.token_rows[row].copy_(base[i] if i < base.shape[0] else extra[i - base.shape[0]])
        return loaded


def _index(ids: torch.Tensor, which: list[int]) -> torch.Tensor:
    """Each id's row in `which` (every id is one of them)."""
    return (ids[:, None] == torch.tensor(which, device=ids.device)).int().argmax(-1)
