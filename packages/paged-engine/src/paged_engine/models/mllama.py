"""Llama 3.2 Vision (`MllamaForConditionalGeneration`): a Llama 3 decoder whose layers in
text_config.cross_attention_layers cross-attend to the image tower's output instead of
attending to the text (multimodal/mllama.py has the tower).

    self-attention layer i: Llama's (RMSNorm, GQA with RoPE, gated SiLU MLP; paged KV cache)
    cross-attention layer:  x += tanh(attn_gate) * o(attn(q_norm(q(n1(x))), K, V))
                            x += tanh(mlp_gate) * row_mask * mlp(n2(x))
        K = k_norm(k(states)), V = v(states) of the sequence's images (no RoPE, GQA), written
        once per sequence into a cross-attention slot (worker/cross_attention.py)

Which image rows a text row reads (HF's cross_attention_mask as MllamaProcessor builds it,
for a prompt whose <|image|> tokens are one run, the only form served): the row of the j-th
<|image|> sees the real tiles of images 0..j, the rows after the run every image's real
tiles; rows before the first <|image|> are "fully masked", and HF then
lets them attend to *every* row of every image, padded tiles included, and zeroes only their
MLP branch (`full_text_row_masked_out_mask`); the same here. So a slot holds the sequence's
images' real tile rows first, their padded tile rows after (`cross_plan`): either set of
keys is a prefix of the slot. Generated rows see what the last prompt row sees (HF repeats
its mask row). A text-only prompt skips the cross-attention layers entirely (HF's text path);
in a batch mixing both, only the rows of sequences with images run those layers.

KV cache: only the self-attention layers have one (`kv_cache_layout`). Checkpoint names:
`model.language_model.*` (transformers 5) or `language_model.model.*`, `lm_head.*`, the tower's
`model.vision_model.*` / `model.multi_modal_projector.*`; the embedding has vocab_size + 8 rows
(the image token's id is past the head's vocab_size in Meta's checkpoints).

Tensor parallelism: the self-attention layers are Llama's; a cross-attention layer splits its
heads the same way (`MllamaCrossAttention`: q / k / v column-parallel, o row-parallel, q_norm /
k_norm per head and replicated; with fewer KV heads than ranks a rank holds its query heads' one
KV head, as `QKVParallelLinear` does), so each rank's slots hold its own KV heads. The vision
tower and projector run whole on every rank, as every tower here does (Whisper's encoder too):
each rank projects the same image rows to its KV heads, with no collective in the tower; the
cost is its weights and compute on every rank (under 1B parameters, run once per new set of
images). vLLM splits the tower's heads and MLP over the ranks instead (two all-reduces a layer).

Refused by name (`mllama_engine_config`, beside the encoder-decoder refusals of
worker/cross_attention.py): a tensor_parallel_size that does not split the text model's
attention heads and KV heads (each a multiple of it, or the KV heads a divisor of it), a
max_model_len over text_config.max_position_embeddings. limit_mm_per_prompt's image count
sizes the slots (one image when unset).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from paged_engine.distributed.parallel_state import get_tp_rank, get_tp_size
from paged_engine.layers.embedding import VocabParallelEmbedding
from paged_engine.layers.linear import ColumnParallelLinear, RowParallelLinear
from paged_engine.layers.norm import RMSNorm
from paged_engine.layers.rotary import get_rope
from paged_engine.models.encoder_decoder import CrossPlan, fit_decoder_length
from paged_engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from paged_engine.models.utils import QKV_PROJ_RULES, CausalLMBase, cfg_get, load_named_weights
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.multimodal.mllama import MllamaVisionTower, num_patches

if TYPE_CHECKING:
    from paged_engine.worker.cross_attention import CrossBatch

logger = logging.getLogger(__name__)

ARCH = "MllamaForConditionalGeneration"
_TEXT_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "num_hidden_layers",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_parameters",
    "intermediate_size",
)


def image_limit(config: Any) -> int:
    """Images a prompt may hold: limit_mm_per_prompt["image"], one when unset."""
    limit = config.image_limit
    return 1 if limit is None else max(int(limit), 1)


def slot_rows(hf_config: Any, limit: int) -> int:
    """Rows of a cross-attention slot: `limit` images of max_num_tiles tiles of P rows."""
    vision = hf_config.vision_config
    return limit * int(vision.max_num_tiles) * num_patches(vision)


def mllama_engine_config(config: Any, hf_config: Any) -> None:
    """Refuse (ValueError naming the option) or set what Mllama needs beyond the
    encoder-decoder defaults: TP ranks that split the text model's heads, max_model_len within
    the text model's positions."""
    text = hf_config.text_config
    tp = config.tensor_parallel_size
    heads = int(text.num_attention_heads)
    kv = int(cfg_get(text, "num_key_value_heads", heads))
    if heads % tp or (kv % tp if tp <= kv else tp % kv):
        raise ValueError(
            f"tensor_parallel_size={tp} does not split the text model's {heads} attention heads "
            f"and {kv} KV heads (text_config.num_attention_heads / num_key_value_heads: each "
            "a multiple of it, or the KV heads a divisor of it)"
        )
    for name in _TEXT_FIELDS:  # the engine reads the text model's sizes at the top level
        if not hasattr(hf_config, name) and hasattr(text, name):
            setattr(hf_config, name, getattr(text, name))
    limit = int(text.max_position_embeddings)
    fit_decoder_length(config, limit, "text_config.max_position_embeddings")
    if config.image_limit is None:  # the slots' size: one image unless told
        logger.info("%s: one image a prompt (limit_mm_per_prompt={'image': n} for more)", ARCH)
        config.limit_mm_per_prompt = {**(config.limit_mm_per_prompt or {}), "image": 1}


class MllamaCrossAttention(nn.Module):
    """q / k / v / o with the heads split over TP ranks as Llama's self-attention splits them
    (`QKVParallelLinear`): rank r holds query heads [r * H / tp, (r + 1) * H / tp) and the KV
    heads they read; with fewer KV heads than ranks each rank holds the one KV head of its query
    heads (replicated over tp / Hkv ranks). q_norm / k_norm act per head: replicated."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        d, eps = int(config.hidden_size), float(config.rms_norm_eps)
        heads = int(config.num_attention_heads)
        kv_heads = int(cfg_get(config, "num_key_value_heads", heads))
        self.head_dim = d // heads
        rank, tp = get_tp_rank(), get_tp_size()
        # (checkpoint q_proj / k_proj / v_proj: renamed, so that Llama's qkv fusing skips them)
        self.to_q = ColumnParallelLinear(d, heads * self.head_dim, bias=False)
        # KV shards: Hkv ranks' worth when tp >= Hkv (rank r loads KV head r // (tp / Hkv))
        kv_rank, kv_tp = (rank * kv_heads // tp, kv_heads) if tp >= kv_heads else (rank, tp)
        self.to_k, self.to_v = (
            ColumnParallelLinear(d, kv_heads * self.head_dim, False, kv_rank, kv_tp)
            for _ in range(2)
        )
        self.o_proj = RowParallelLinear(heads * self.head_dim, d, bias=False)
        self.num_heads = self.to_q.out_local // self.head_dim  # this rank's
        self.num_kv_heads = self.to_k.out_local // self.head_dim
        self.q_norm, self.k_norm = RMSNorm(self.head_dim, eps), RMSNorm(self.head_dim, eps)
        self.scale = self.head_dim**-0.5

    def kv(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[R, D] image rows -> (k, v) each [R, Hkv, Dh]."""
        r = states.shape[0]
        k = self.k_norm(self.to_k(states).view(r, self.num_kv_heads, self.head_dim))
        return k, self.to_v(states).view(r, self.num_kv_heads, self.head_dim)


class MllamaCrossLayer(nn.Module):
    def __init__(self, config: Any, index: int) -> None:
        super().__init__()
        d, eps = int(config.hidden_size), float(config.rms_norm_eps)
        self.index = index  # its K / V in a CrossBatch
        self.cross_attn = MllamaCrossAttention(config)
        self.input_layernorm = RMSNorm(d, eps)
        self.cross_attn_attn_gate = nn.Parameter(torch.zeros(1))
        self.mlp = LlamaMLP(config, bias=False)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.cross_attn_mlp_gate = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor, cross: CrossBatch) -> torch.Tensor:  # x: [R, D]
        a = self.cross_attn
        q = a.to_q(self.input_layernorm(x))
        q = a.q_norm(q.view(-1, a.num_heads, a.head_dim)).reshape(q.shape)
        x = x + self.cross_attn_attn_gate.tanh() * a.o_proj(cross.attend(self.index, q, a.scale))
        h = self.mlp(self.post_attention_layernorm(x))
        if cross.row_scale is not None:  # rows before the first image: no MLP branch
            h = h * cross.row_scale
        return x + self.cross_attn_mlp_gate.tanh() * h


class MllamaTextModel(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        text = config.text_config
        self.embed_tokens = VocabParallelEmbedding(int(text.vocab_size) + 8, text.hidden_size)
        self.rotary_emb = get_rope(text, int(text.hidden_size) // int(text.num_attention_heads))
        flags = LlamaForCausalLM.layer_flags(text)
        crossed = [int(i) for i in text.cross_attention_layers]
        layers: list[nn.Module] = []
        for i in range(int(text.num_hidden_layers)):
            if i in crossed:
                layers.append(MllamaCrossLayer(text, crossed.index(i)))
            else:
                layers.append(LlamaDecoderLayer(text, i, flags, self.rotary_emb))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(text.hidden_size, float(text.rms_norm_eps))
        self.cross: CrossBatch | None = None  # the step's images, bound by the runner

    def forward(self, input_ids, positions, kv_caches, md, hidden=None) -> torch.Tensor:
        assert hidden is None, "Mllama runs in one pipeline stage"
        x = self.embed_tokens(input_ids)  # [T, D]
        self.rotary_emb.begin_forward(positions)
        cross = self.cross
        caches = iter(kv_caches)
        for layer in self.layers:
            if not isinstance(layer, MllamaCrossLayer):
                x = layer(positions, x, next(caches), md)
            elif cross is None or cross.num_rows == 0:  # text-only rows skip the layer
                continue
            elif cross.rows is None:
                x = layer(x, cross)
            else:  # only the rows of sequences with images
                x = x.index_copy(0, cross.rows, layer(x.index_select(0, cross.rows), cross))
        return self.norm(x)


class MllamaForConditionalGeneration(CausalLMBase):
    stacked_params = (
        *QKV_PROJ_RULES,
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    )
    renames = (
        ("model.language_model.", "model."),
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
        ("cross_attn.q_proj", "cross_attn.to_q"),
        ("cross_attn.k_proj", "cross_attn.to_k"),
        ("cross_attn.v_proj", "cross_attn.to_v"),
    )
    ignored_weights = ("rotary_emb.inv_freq",)
    ties_head = False  # HF keeps lm_head apart whatever tie_word_embeddings says

    def __init__(self, config: Any) -> None:
        text = config.text_config
        text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        super().__init__(text, MllamaTextModel(config))
        self.wrapper_config = config
        self.vision = MllamaVisionTower(config)
        self.image_token_id = int(config.image_token_index)
        self.tiles = int(config.vision_config.max_num_tiles)
        self.patches = num_patches(config.vision_config)

    @staticmethod
    def kv_cache_layout(config: Any) -> list[tuple[int, int]]:
        """The self-attention layers' (the cross-attention layers keep no KV cache)."""
        text = config.text_config
        heads = int(text.num_attention_heads)
        kv = int(cfg_get(text, "num_key_value_heads", heads))
        n = int(text.num_hidden_layers) - len(text.cross_attention_layers)
        return [(kv, int(text.hidden_size) // heads)] * n

    def cross_dims(self) -> tuple[int, int, int, int]:
        """(cross-attention layers, this rank's query heads and K / V heads, head_dim)."""
        layers = [m for m in self.model.layers if isinstance(m, MllamaCrossLayer)]
        a = layers[0].cross_attn
        return len(layers), a.num_heads, a.num_kv_heads, a.head_dim

    def cross_plan(self, items: Sequence[ImageInput]) -> CrossPlan | None:
        """A sequence's images as a slot's content (None: a text-only prompt); each item's
        image_size is (real tiles, aspect ratio id, its <|image|> position)."""
        images = [m for m in items if m.pixel_values is not None]
        if not images:
            return None
        every = self.tiles * self.patches * len(images)
        real = [m.image_size[0] * self.patches for m in images]  # type: ignore[index]
        seen = tuple(int(n) for n in np.cumsum(real))  # <|image|> j's row: images 0..j
        key = hashlib.sha256("".join(m.mm_hash for m in images).encode()).hexdigest()[:32]
        start = images[0].image_size[2]  # type: ignore[index]
        return CrossPlan(key, every, seen, start, every, images)

    def encode_cross(
        self, payloads: list[list[ImageInput]]
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Each sequence's images -> per cross-attention layer (k, v) [rows, Hkv, Dh] of all
        the sequences, each sequence's real tile rows first, then its padded ones."""
        images = [m for p in payloads for m in p]
        w = self.vision.multi_modal_projector.weight
        pixels = torch.stack([m.pixel_values for m in images]).to(w.device)  # type: ignore[misc]
        size = torch.tensor([m.image_size[:2] for m in images], device=w.device)  # type: ignore
        # one image a tower call: its [T * Pp]^2 attention is the largest activation
        states = torch.cat(
            [
                self.vision(pixels[i : i + 1], size[i : i + 1, 1], size[i : i + 1, 0])
                for i in range(len(images))
            ]
        )  # [N, T * P, D]
        width = states.shape[1]  # T * P rows an image
        order: list[torch.Tensor] = []
        at = 0
        for p in payloads:  # the sequence's images' real tile rows, then their padded rows
            first = [(at + i) * width for i in range(len(p))]
            cut = [a + m.image_size[0] * self.patches for a, m in zip(first, p)]  # type: ignore
            order += [torch.arange(a, c) for a, c in zip(first, cut)]
            order += [torch.arange(c, a + width) for a, c in zip(first, cut)]
            at += len(p)
        rows = states.flatten(0, 1)[torch.cat(order).to(w.device)]
        for layer in self.model.layers:
            if isinstance(layer, MllamaCrossLayer):
                yield layer.cross_attn.kv(rows)

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True
    ) -> set[str]:
        tower: list[tuple[str, torch.Tensor]] = []

        def text_only() -> Iterator[tuple[str, torch.Tensor]]:
            for name, w in weights:
                ours = MllamaVisionTower.checkpoint_name(name)
                if ours is None:
                    yield name, w
                else:
                    tower.append((ours, w))

        loaded = super().load_weights(text_only(), strict=False)
        params = {n for n, _ in self.named_parameters() if not n.startswith("vision.")}
        missing = sorted(params - loaded)
        if strict and missing:
            raise ValueError(f"{ARCH}: checkpoint does not match: missing weights {missing[:12]}")
        return loaded | {
            f"vision.{n}" for n in load_named_weights(self.vision, tower, strict=strict)
        }
