"""BART and mBART (`BartForConditionalGeneration`, `BartModel`, `MBartForConditionalGeneration`):
a text encoder and a text decoder that cross-attends to it.

    encoder prompts' ids [L_i] -> shared embedding * embed_scale + learned position (p + 2,
        p counted from each prompt's start) -> layernorm_embedding -> per layer: bidirectional
        self-attention within each prompt, MLP -> [sum L_i, D] (mBART: then the encoder's
        final layer_norm)
    decoder token t at position p: shared embedding * embed_scale + learned position (p + 2)
        -> layernorm_embedding -> per layer: self-attention (causal, paged KV cache) ->
        cross-attention to the L encoder rows -> MLP -> (mBART: final layer_norm)
        -> the head tied to the shared embedding, + final_logits_bias

BART's layers are post-norm (x = LN(x + f(x)) after each block), mBART's pre-norm
(x = x + f(LN(x))) with a final layer_norm on both stacks: `pre_norm` picks one.
embed_scale is sqrt(d_model) where config.scale_embedding, else 1 (transformers'
`*ScaledWordEmbedding`); the position tables have max_position_embeddings + 2 rows and are read
at p + 2 (transformers' `*LearnedPositionalEmbedding` offset). vLLM 0.10 serves `BartModel`
checkpoints (no "model." prefix, no final_logits_bias) with the same class: so does this one.

Served as Whisper and Moonshine are (models/whisper.py, models/moonshine.py): the encoder
runs once per encoder prompt, when a sequence holding it first runs a step (the step's new
prompts in one batch: their rows packed one prompt after another through the projections and
MLPs, padded to [B, Lmax] with a key padding mask only for SDPA, `PaddedBatch`), and each decoder
layer's cross K / V go to a slot of the cross-attention pool (worker/cross_attention.py) through
the `cross_plan` / `encode_cross` / `cross_dims` hooks. The encoder prompt's ids reach the
worker as the sequence's one item (modality "text", engine/encoder_prompt.py builds it): a slot
holds max_position_embeddings rows, a sequence's plan names its prompt's L rows. Heads of both
stacks are split over TP ranks (the encoder runs on every rank, each its heads, reduced by its
row-parallel projections).

Refused by name (`bart_engine_config`, called from worker/cross_attention.py): a max_model_len
over config.max_position_embeddings, tensor_parallel_size not dividing either stack's heads,
tie_word_embeddings=False (an untied head, which no BART release ships: not checked against
transformers). transformers adds final_logits_bias to the logits: so does this class.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.layers.activation import get_act_fn
from paged_engine.layers.attention import Attention
from paged_engine.layers.embedding import VocabParallelEmbedding
from paged_engine.layers.linear import ColumnParallelLinear, RowParallelLinear
from paged_engine.layers.norm import LayerNorm
from paged_engine.models.encoder_decoder import CrossPlan, fit_decoder_length, tp_divides_heads
from paged_engine.models.utils import CausalLMBase
from paged_engine.multimodal.inputs import ImageInput

if TYPE_CHECKING:
    from paged_engine.worker.cross_attention import CrossBatch

ARCHITECTURES = ("BartForConditionalGeneration", "BartModel", "MBartForConditionalGeneration")
POSITION_OFFSET = 2  # transformers' learned position tables start at row 2


def is_bart(hf_config: Any) -> bool:
    return any(a in ARCHITECTURES for a in getattr(hf_config, "architectures", None) or ())


def bart_engine_config(config: Any, hf_config: Any) -> None:
    """Refuse (ValueError naming the field) what BART cannot run; set max_model_len."""
    fit_decoder_length(
        config, int(hf_config.max_position_embeddings), "config.max_position_embeddings"
    )
    for field in ("encoder_attention_heads", "decoder_attention_heads"):
        tp_divides_heads(config, int(getattr(hf_config, field)), f"config.{field}")
    if not getattr(hf_config, "tie_word_embeddings", True):
        raise ValueError(
            "config.tie_word_embeddings=False is not supported for BART / mBART: the head is "
            "the shared embedding"
        )


def decoder_start_id(hf_config: Any) -> int:
    """config.decoder_start_token_id, else config.bos_token_id (as vLLM and HF fall back)."""
    start = getattr(hf_config, "decoder_start_token_id", None)
    start = getattr(hf_config, "bos_token_id", None) if start is None else start
    if start is None:
        raise ValueError("config.decoder_start_token_id (or bos_token_id) must be set for BART")
    return int(start)


@dataclass(slots=True)
class PaddedBatch:
    """Where B prompts' packed rows [N = sum L_i, ...] sit in a padded [B, Lmax] batch: the
    4-D layout SDPA's fused CPU kernel takes (a 3-D [H, L, Dh] call runs the unfused math
    path, several times slower). index / mask None: no padding (equal lengths, one prompt)."""

    index: torch.Tensor | None  # [N] int64: packed row -> its place in the flat [B * Lmax]
    mask: torch.Tensor | None  # [B, 1, 1, Lmax] bool: True where the key is its prompt's row
    batch: int
    width: int  # Lmax

    @classmethod
    def of(cls, lengths: list[int], device: torch.device) -> PaddedBatch:
        width = max(lengths)
        if min(lengths) == width:
            return cls(None, None, len(lengths), width)
        keep = torch.arange(width, device=device) < torch.tensor(lengths, device=device)[:, None]
        index = keep.reshape(-1).nonzero().squeeze(1)  # row-major: prompt by prompt, in order
        return cls(index, keep[:, None, None, :], len(lengths), width)

    def pad(self, x: torch.Tensor) -> torch.Tensor:  # [N, H, Dh] -> [B, H, Lmax, Dh]
        if self.index is not None:
            x = x.new_zeros(self.batch * self.width, *x.shape[1:]).index_copy_(0, self.index, x)
        return x.view(self.batch, self.width, *x.shape[1:]).transpose(1, 2)

    def unpad(self, o: torch.Tensor) -> torch.Tensor:  # [B, H, Lmax, Dh] -> [N, H * Dh]
        o = o.transpose(1, 2).reshape(self.batch * self.width, -1)
        return o if self.index is None else o.index_select(0, self.index)


class BartAttention(nn.Module):
    """q / k / v / out_proj of one attention, all with biases, heads split over TP ranks."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.head_dim = d // heads
        self.q_proj = ColumnParallelLinear(d, d, bias=True)
        self.k_proj = ColumnParallelLinear(d, d, bias=True)
        self.v_proj = ColumnParallelLinear(d, d, bias=True)
        self.out_proj = RowParallelLinear(d, d, bias=True)
        self.num_heads = self.q_proj.out_local // self.head_dim  # this rank's heads
        self.scale = self.head_dim**-0.5

    def split(self, x: torch.Tensor) -> torch.Tensor:  # [L, H*Dh] -> [L, H, Dh]
        return x.view(x.shape[0], self.num_heads, self.head_dim)

    def kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[L, D] encoder rows -> (k, v) each [L, H, Dh] (the cache's token-major rows)."""
        return self.split(self.k_proj(x)), self.split(self.v_proj(x))

    def bidirectional(self, x: torch.Tensor, pad: PaddedBatch) -> torch.Tensor:
        """Prompts' packed rows [N, D], each seeing all rows of its own prompt -> [N, D]."""
        q, (k, v) = self.split(self.q_proj(x)), self.kv(x)
        # padded queries see their prompt's rows too (no all-masked row) and are dropped
        o = F.scaled_dot_product_attention(
            pad.pad(q), pad.pad(k), pad.pad(v), attn_mask=pad.mask, scale=self.scale
        )  # [B, H, Lmax, Dh]
        return self.out_proj(pad.unpad(o))


class BartLayer(nn.Module):
    """What both stacks' layers share: the MLP fc1 -> act -> fc2 (the checkpoint's names)."""

    def _init_mlp(self, d: int, ffn: int, act: str) -> None:
        self.fc1 = ColumnParallelLinear(d, ffn, bias=True)
        self.fc2 = RowParallelLinear(ffn, d, bias=True)
        self.act = get_act_fn(act, "activation_function")

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def _block(x: torch.Tensor, norm: LayerNorm, f, pre_norm: bool) -> torch.Tensor:
    """One residual block: mBART's x + f(LN(x)), BART's LN(x + f(x))."""
    return x + f(norm(x)) if pre_norm else norm(x + f(x))


class BartEncoderLayer(BartLayer):
    def __init__(self, config: Any, pre_norm: bool) -> None:
        super().__init__()
        d = int(config.d_model)
        self.pre_norm = pre_norm
        self.self_attn = BartAttention(d, int(config.encoder_attention_heads))
        self.self_attn_layer_norm = LayerNorm(d)
        self._init_mlp(d, int(config.encoder_ffn_dim), config.activation_function)
        self.final_layer_norm = LayerNorm(d)

    def forward(self, x: torch.Tensor, pad: PaddedBatch) -> torch.Tensor:
        def attention(h: torch.Tensor) -> torch.Tensor:  # h: [N, D], the prompts' packed rows
            return self.self_attn.bidirectional(h, pad)

        x = _block(x, self.self_attn_layer_norm, attention, self.pre_norm)
        return _block(x, self.final_layer_norm, self.mlp, self.pre_norm)


class BartDecoderLayer(BartLayer):
    def __init__(self, config: Any, index: int, pre_norm: bool) -> None:
        super().__init__()
        d = int(config.d_model)
        self.index, self.pre_norm = index, pre_norm  # index: its cross K / V in a CrossBatch
        self.self_attn = BartAttention(d, int(config.decoder_attention_heads))
        a = self.self_attn
        self.attn = Attention(a.num_heads, a.head_dim, a.num_heads, a.scale)
        self.self_attn_layer_norm = LayerNorm(d)
        self.encoder_attn = BartAttention(d, int(config.decoder_attention_heads))
        self.encoder_attn_layer_norm = LayerNorm(d)
        self._init_mlp(d, int(config.decoder_ffn_dim), config.activation_function)
        self.final_layer_norm = LayerNorm(d)

    def forward(self, x, kv_cache, md, cross: CrossBatch | None) -> torch.Tensor:  # x: [T, D]
        a, c = self.self_attn, self.encoder_attn

        def self_attention(h: torch.Tensor) -> torch.Tensor:
            return a.out_proj(self.attn(a.q_proj(h), a.k_proj(h), a.v_proj(h), kv_cache, md))

        def cross_attention(h: torch.Tensor) -> torch.Tensor:
            assert cross is not None
            return c.out_proj(cross.attend(self.index, c.q_proj(h), c.scale))

        x = _block(x, self.self_attn_layer_norm, self_attention, self.pre_norm)
        if cross is not None:  # None only in the memory profiler's forward
            x = _block(x, self.encoder_attn_layer_norm, cross_attention, self.pre_norm)
        return _block(x, self.final_layer_norm, self.mlp, self.pre_norm)


class BartStack(nn.Module):
    """What the encoder and the decoder share: position table, embedding norm, final norm."""

    def __init__(self, config: Any, layers: list[nn.Module], pre_norm: bool) -> None:
        super().__init__()
        d = int(config.d_model)
        self.embed_positions = nn.Embedding(int(config.max_position_embeddings) + 2, d)
        self.layernorm_embedding = LayerNorm(d)
        self.layers = nn.ModuleList(layers)
        # mBART's final norm; BART's post-norm layers end normalized already
        self.layer_norm = LayerNorm(d) if pre_norm else None

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.layernorm_embedding(tokens + self.embed_positions(positions + POSITION_OFFSET))

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.layer_norm is None else self.layer_norm(x)


class BartModel(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        pre_norm = "MBartForConditionalGeneration" in (config.architectures or ())
        d = int(config.d_model)
        self.embed_scale = math.sqrt(d) if getattr(config, "scale_embedding", False) else 1.0
        self.shared = VocabParallelEmbedding(config.vocab_size, d)
        enc = [BartEncoderLayer(config, pre_norm) for _ in range(int(config.encoder_layers))]
        dec = [BartDecoderLayer(config, i, pre_norm) for i in range(int(config.decoder_layers))]
        self.encoder = BartStack(config, enc, pre_norm)
        self.decoder = BartStack(config, dec, pre_norm)
        # the step's cross-attention inputs, bound by the runner for one forward
        self.cross: CrossBatch | None = None

    def encode(self, ids: torch.Tensor, prefix: torch.Tensor | None = None) -> torch.Tensor:
        """One encoder prompt's ids [L] -> its encoder output [L, D]; `prefix` [P, D]: rows
        put before the ids' embeddings, positions counted from them (Florence-2's image rows,
        multimodal/florence2.py) -> [P + L, D]."""
        return self.encode_batch([ids], [prefix])

    def encode_batch(
        self, ids: list[torch.Tensor], prefixes: Sequence[torch.Tensor | None] | None = None
    ) -> torch.Tensor:
        """B encoder prompts' ids [L_i] (and each one's optional prefix [P_i, D], as `encode`)
        in one run -> their encoder outputs, one prompt after another: [sum (P_i + L_i), D].
        Each row is what `encode` gives its prompt alone (to float rounding)."""
        x = self.shared(torch.cat(ids)) * self.embed_scale  # [sum L_i, D]
        lengths = [len(t) for t in ids]
        if prefixes is not None and any(p is not None for p in prefixes):
            rows = []
            for prefix, piece in zip(prefixes, x.split(lengths), strict=True):
                rows += [piece] if prefix is None else [prefix.to(x.dtype), piece]
            x = torch.cat(rows)
            lengths = [n + (0 if p is None else len(p)) for n, p in zip(lengths, prefixes)]
        n = torch.tensor(lengths, device=x.device)
        starts = (n.cumsum(0) - n).repeat_interleave(n, output_size=x.shape[0])
        positions = torch.arange(x.shape[0], device=x.device) - starts  # from each prompt's start
        x = self.encoder.embed(x, positions)
        pad = PaddedBatch.of(lengths, x.device)
        for layer in self.encoder.layers:
            x = layer(x, pad)
        return self.encoder.finish(x)

    def forward(self, input_ids, positions, kv_caches, md, hidden=None) -> torch.Tensor:
        assert hidden is None, "BART runs in one pipeline stage"
        x = self.decoder.embed(self.shared(input_ids) * self.embed_scale, positions)  # [T, D]
        for layer, kv_cache in zip(self.decoder.layers, kv_caches, strict=True):
            x = layer(x, kv_cache, md, self.cross)
        return self.decoder.finish(x)


class BartForConditionalGeneration(CausalLMBase):
    embed_path = "model.shared"
    head_bias = True  # final_logits_bias (zero where the checkpoint has none: BartModel)
    tie_default = True
    # the shared embedding's tied copies (transformers ties both stacks' embed_tokens to it)
    ignored_weights = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")

    def __init__(self, config: Any) -> None:
        super().__init__(config, BartModel(config))

    @staticmethod
    def kv_cache_layout(config: Any) -> list[tuple[int, int]]:
        """The decoder's self-attention layers."""
        heads = int(config.decoder_attention_heads)
        return [(heads, int(config.d_model) // heads)] * int(config.decoder_layers)

    def num_decoder_layers(self) -> int:
        # weight names index encoder and decoder layers; one pipeline stage holds both
        return max(int(self.config.encoder_layers), int(self.config.decoder_layers))

    def rename_weight(self, name: str) -> str:
        if name == "final_logits_bias":
            return "lm_head.bias"
        if not name.startswith(("model.", "lm_head.")):  # a BartModel checkpoint
            name = "model." + name
        return name

    def convert_weight(self, name: str, w: torch.Tensor):
        if name == "lm_head.bias":
            return ((name, w.reshape(-1)),)  # [1, V] -> [V]
        return ((name, w),)

    def load_weights(self, weights, strict: bool = True) -> set[str]:
        # a whole checkpoint without final_logits_bias (BartModel's) loads it as zeros
        return super().load_weights(
            _with_bias(weights, self.config.vocab_size) if strict else weights, strict
        )

    def cross_dims(self) -> tuple[int, int, int, int]:
        """(cross-attention layers, this rank's query heads and K / V heads, head_dim)."""
        layers = self.model.decoder.layers
        a = layers[0].encoder_attn
        return len(layers), a.num_heads, a.num_heads, a.head_dim

    def cross_plan(self, items: Sequence[ImageInput]) -> CrossPlan:
        """A sequence's encoder prompt (its ids) as a slot's content: its L rows, all seen by
        every decoder row."""
        prompts = [m for m in items if m.modality == "text"]
        if len(prompts) != 1:
            raise RuntimeError(f"a sequence reached the worker with {len(prompts)} encoder prompts")
        m = prompts[0]
        rows = int(m.pixel_values.numel())  # type: ignore[union-attr]
        return CrossPlan(m.mm_hash, rows, (rows,), 0, rows, m.pixel_values)

    def encode_cross(self, payloads: list[torch.Tensor]) -> Iterator[tuple[torch.Tensor, ...]]:
        """Encoder prompts' ids -> per decoder layer (k, v) [their rows, H, Dh], the prompts'
        rows one after another; all the step's prompts in one encoder run."""
        dev = self.model.shared.weight.device
        rows = self.model.encode_batch([p.to(dev) for p in payloads])
        for layer in self.model.decoder.layers:
            yield layer.encoder_attn.kv(rows)


def _with_bias(weights, vocab_size: int):
    """The checkpoint's tensors, then zeros for final_logits_bias where it had none (a
    BartModel checkpoint: transformers' generation model starts it at zero)."""
    seen = False
    for name, w in weights:
        seen = seen or name.endswith("final_logits_bias")
        yield name, w
    if not seen:
        yield "final_logits_bias", torch.zeros(1, vocab_size)
