"""Llama family: Llama 2/3 (incl. Llama 3 rope scaling), SmolLM2; base of Mistral, Qwen2, Qwen3.

Pre-norm decoder: x += attn(rmsnorm(x)); x += mlp(rmsnorm(x)); gated SiLU MLP; RoPE (NeoX
style); grouped-query attention. Subclasses switch on qkv bias, per-head q/k norm and sliding
windows through the class attributes below.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from paged_engine.layers.activation import ActAndMul, SiluAndMul, get_act_fn
from paged_engine.layers.attention import Attention, AttentionMetadata
from paged_engine.layers.embedding import VocabParallelEmbedding
from paged_engine.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from paged_engine.layers.norm import RMSNorm
from paged_engine.layers.rotary import RotaryEmbedding, get_rope
from paged_engine.models.utils import (
    QKV_PROJ_RULES,
    CausalLMBase,
    cfg_get,
    layer_sliding_window,
    make_layers,
)


def llama_head_dim(config) -> int:
    return cfg_get(config, "head_dim", config.hidden_size // config.num_attention_heads)


class LlamaAttention(nn.Module):
    """`rope` None: a NoPE layer (SmolLM3's), q and k used as projected."""

    def __init__(
        self, config, layer_idx: int, flags: dict[str, bool], rope: RotaryEmbedding | None
    ):
        super().__init__()
        hidden = config.hidden_size
        num_heads = config.num_attention_heads
        num_kv_heads = cfg_get(config, "num_key_value_heads", num_heads)
        head_dim = llama_head_dim(config)
        self.head_dim = head_dim
        self.qkv_proj = QKVParallelLinear(
            hidden, head_dim, num_heads, num_kv_heads, bias=flags["qkv_bias"]
        )
        # This rank's heads (all of them outside tensor parallelism).
        local_heads, local_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = local_heads * head_dim, local_kv_heads * head_dim
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden, bias=flags["o_bias"])
        self.rotary_emb = rope  # one instance shared by all layers (its cos/sin tables are big)
        self.qk_norm = flags["qk_norm"]
        if self.qk_norm:
            eps = cfg_get(config, "rms_norm_eps", 1e-6)
            self.q_norm = RMSNorm(head_dim, eps)
            self.k_norm = RMSNorm(head_dim, eps)
        self.attn = Attention(
            local_heads,
            head_dim,
            local_kv_heads,
            head_dim**-0.5,
            sliding_window=layer_sliding_window(config, layer_idx) if flags["sliding"] else None,
        )

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        md: AttentionMetadata,
        attn: Attention | None = None,  # another paged attention over these weights (Ouro's)
    ) -> torch.Tensor:
        attn = self.attn if attn is None else attn
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.rotary_emb is None:  # NoPE
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            return self.o_proj(attn(q, k, v, kv_cache, md))
        heads, kv_heads = self.q_size // self.head_dim, self.kv_size // self.head_dim
        norms = (self.q_norm, self.k_norm) if self.qk_norm else (None, None)
        write = attn.fused_kv_write(kv_cache, md)  # (None: the attention writes K/V)
        if self.rotary_emb.rotate_qkv_(positions, qkv, heads, kv_heads, *norms, write):
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)  # one kernel
            return self.o_proj(attn(q, k, v, kv_cache, md, kv_written=write is not None))
        if not self.qk_norm:  # q and k heads rotated in one go from the model's tables
            qk = qkv[:, : self.q_size + self.kv_size].view(t, -1, self.head_dim)
            rotated = self.rotary_emb.rotate_heads(positions, qk)
            if rotated is not None:
                q = rotated[:, :heads].reshape(t, -1)  # views: no copy
                k = rotated[:, heads:].reshape(t, -1)
                v = qkv[:, self.q_size + self.kv_size :]
                return self.o_proj(attn(q, k, v, kv_cache, md))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm:  # per-head RMSNorm before RoPE (Qwen3)
            q = self.q_norm(q.reshape(t, -1, self.head_dim)).reshape(t, -1, self.head_dim)
            k = self.k_norm(k.reshape(t, -1, self.head_dim)).reshape(t, -1, self.head_dim)
            if self.rotary_emb.has_tables(positions):  # the normed heads rotated in one go
                rotated = self.rotary_emb.rotate_heads(positions, torch.cat((q, k), dim=1))
                assert rotated is not None
                q, k = rotated[:, :heads].reshape(t, -1), rotated[:, heads:].reshape(t, -1)
                return self.o_proj(attn(q, k, v, kv_cache, md))
            q, k = q.reshape(t, -1), k.reshape(t, -1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(attn(q, k, v, kv_cache, md))


class LlamaMLP(nn.Module):
    def __init__(self, config, bias: bool, intermediate_size: int | None = None):
        super().__init__()
        act = cfg_get(config, "hidden_act", "silu")
        inter = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], bias)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias)
        # down(act(gate) * up) with the config's activation, as HF's LlamaMLP gates any of them
        silu = act in ("silu", "swish")
        self.act_fn = SiluAndMul() if silu else ActAndMul(get_act_fn(act, "hidden_act"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, D] -> [T, D]
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


def add_norm(
    norm: nn.Module, h: torch.Tensor, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(h + x), h + x): one kernel through an RMSNorm's `add_forward`, else an add and
    the norm (a LayerNorm some models swap in)."""
    if isinstance(norm, RMSNorm):
        return norm.add_forward(h, x)
    total = h + x
    return norm(total), total


class PreNormDecoderLayer(nn.Module):
    """A pre-norm decoder layer: x += attn(input_layernorm(x)); x += mlp(post_attention_layernorm
    (x)) over `self_attn`, `mlp` and two norms a subclass builds (RMSNorms fuse each add with
    the norm after it). `forward_residual` is the same layer with the stream kept apart
    (`run_layers`)."""

    self_attn: nn.Module
    mlp: nn.Module
    input_layernorm: nn.Module
    post_attention_layernorm: nn.Module

    def forward(self, positions, x, kv_cache, md) -> torch.Tensor:  # x: [T, D]
        h = self.self_attn(positions, self.input_layernorm(x), kv_cache, md)
        y, x = add_norm(self.post_attention_layernorm, h, x)  # x += h; y = norm(x)
        return x + self.mlp(y)

    def forward_residual(
        self, positions, h: torch.Tensor, residual: torch.Tensor | None, kv_cache, md
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` with the stream kept apart: the stream is residual + h (h alone for the
        first layer, residual None); returns (this layer's MLP output, the stream before it),
        so each residual add runs inside the norm after it (RMSNorm.add_forward). The same
        sums in the same order as `forward`."""
        if residual is None:
            y, residual = self.input_layernorm(h), h
        else:
            y, residual = add_norm(self.input_layernorm, h, residual)
        h = self.self_attn(positions, y, kv_cache, md)
        y, residual = add_norm(self.post_attention_layernorm, h, residual)
        return self.mlp(y), residual


def keeps_stream_apart(layers: Iterable[nn.Module]) -> bool:
    """Whether every layer is a PreNormDecoderLayer running its own forward (a subclass that
    overrides it, Granite's multipliers, GLM-4's extra norms, computes something else)."""
    return all(
        isinstance(layer, PreNormDecoderLayer)
        and type(layer).forward is PreNormDecoderLayer.forward
        and type(layer).forward_residual is PreNormDecoderLayer.forward_residual
        for layer in layers
    )


def run_layers(
    layers: list[nn.Module],
    apart: bool,
    positions,
    x,
    kv_caches,
    md,
    norm: nn.Module | None,
    additions: LayerAdditions | None = None,
    capture: StreamCapture | None = None,
) -> torch.Tensor:
    """The decoder stack over x, then `norm` (None: a pipeline stage that is not the last).
    `apart` (keeps_stream_apart): the stream kept apart from each layer's output, every
    residual add fused into the norm after it, the final norm's included. `additions`: rows
    added to the stream after the first layers (Qwen3-VL's deepstack). `capture`: keeps the
    stream entering the layers it names (id len(layers): the stream leaving the stack, before
    the final norm: MiMo's MTP layer reads it)."""
    if apart and layers:
        h, residual = x, None
        for i, (layer, kv_cache) in enumerate(zip(layers, kv_caches, strict=True)):
            if capture is not None and i in capture.layer_ids:
                capture.keep(i, h if residual is None else h + residual)
            h, residual = layer.forward_residual(positions, h, residual, kv_cache, md)
            if additions is not None and i < len(additions.rows):
                h = additions.add(i, h)  # the stream is h + residual
        assert residual is not None
        if capture is not None and len(layers) in capture.layer_ids:  # leaving the stack
            capture.keep(len(layers), h + residual)
        return h + residual if norm is None else add_norm(norm, h, residual)[0]
    for i, (layer, kv_cache) in enumerate(zip(layers, kv_caches, strict=True)):
        if capture is not None and i in capture.layer_ids:
            capture.keep(i, x)
        x = layer(positions, x, kv_cache, md)
        if additions is not None and i < len(additions.rows):
            x = additions.add(i, x)
    if capture is not None and len(layers) in capture.layer_ids:  # leaving the stack
        capture.keep(len(layers), x)
    return x if norm is None else norm(x)


def stage_input(model: nn.Module, input_ids, hidden) -> torch.Tensor:
    """What a stack's first layer reads: on the first pipeline stage the token embedding, or
    `hidden` there (the embedding with image / audio rows spliced in, worker/image_embeds.py),
    times the model's `embedding_multiplier` when it has one (HF multiplies its merged input
    embeddings, media rows too: Granite Speech); on a later stage `hidden`, the previous
    stage's output."""
    stage = getattr(model, "stage", None)
    if hidden is not None and (stage is None or stage.start > 0):
        return hidden
    x = model.embed_tokens(input_ids) if hidden is None else hidden  # [T, D]
    if model.embedding_multiplier is not None:
        x = x * model.embedding_multiplier
    return x


@dataclass(frozen=True, eq=False)
class LayerAdditions:
    """Rows added to the residual stream after the first len(rows) decoder layers, at token
    rows `index` of the step: Qwen3-VL's deepstack image features (worker/image_embeds.py)."""

    index: torch.Tensor  # [N] int64 token rows
    rows: list[torch.Tensor]  # per layer [N, D]

    def add(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return x.index_add(0, self.index, self.rows[layer].to(x.dtype))


class StreamCapture:
    """The residual stream [T, D] entering chosen decoder layers, side by side in the order of
    `layer_ids` (an id may repeat), copied into one buffer [rows, len(layer_ids) * D] that
    lives as long as the capture: a CUDA graph captured with it replays its copies into the
    same storage. An EAGLE-3 head reads it after each target forward (spec_decode/eagle.py).
    Invariant: rows >= the tokens of any forward (the buffer is never reallocated)."""

    def __init__(self, layer_ids: tuple[int, ...], rows: int) -> None:
        self.layer_ids = frozenset(layer_ids)
        self.columns = {i: [j for j, k in enumerate(layer_ids) if k == i] for i in layer_ids}
        self.width = len(layer_ids)
        self.rows = rows
        self.buffer: torch.Tensor | None = None  # allocated by the first forward

    def keep(self, layer: int, stream: torch.Tensor) -> None:
        t, d = stream.shape
        if self.buffer is None:
            self.buffer = stream.new_empty((self.rows, self.width * d))
        if t > self.rows:
            raise RuntimeError(f"a forward of {t} tokens exceeds the stream buffer's {self.rows}")
        for j in self.columns[layer]:
            self.buffer[:t, j * d : (j + 1) * d].copy_(stream)

    def features(self, num_tokens: int) -> torch.Tensor:
        """The last forward's streams, [num_tokens, len(layer_ids) * D]."""
        assert self.buffer is not None, "no forward has run"
        return self.buffer[:num_tokens]


class LlamaDecoderLayer(PreNormDecoderLayer):
    def __init__(
        self,
        config,
        layer_idx: int,
        flags: dict[str, bool],
        rope: RotaryEmbedding | None,
        attention_cls: type[LlamaAttention] = LlamaAttention,  # a subclass with the same weights
    ):
        super().__init__()
        eps = cfg_get(config, "rms_norm_eps", 1e-6)
        self.self_attn = attention_cls(config, layer_idx, flags, rope)
        self.mlp = LlamaMLP(config, flags["mlp_bias"])
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)


class LlamaModel(nn.Module):
    """The Llama stack: embedding, decoder layers (`build_layer(i, rope)`, LlamaDecoderLayer by
    default), final norm. `embedding_multiplier` scales the embedding (Granite);
    `is_neox_style=False` rotates interleaved pairs (GLM-4, Cohere)."""

    def __init__(
        self,
        config,
        flags: dict[str, bool],
        build_layer: Callable[[int, RotaryEmbedding], nn.Module] | None = None,
        embedding_multiplier: float | None = None,
        is_neox_style: bool = True,
    ):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.embedding_multiplier = embedding_multiplier
        rope = get_rope(config, llama_head_dim(config), is_neox_style=is_neox_style)
        self.rotary_emb = rope  # the layers' shared instance: its tables are set per forward
        if build_layer is None:
            build_layer = lambda i, rope: LlamaDecoderLayer(config, i, flags, rope)
        self.layers, self.stage = make_layers(
            config.num_hidden_layers, lambda i: build_layer(i, rope)
        )
        self.norm = RMSNorm(config.hidden_size, cfg_get(config, "rms_norm_eps", 1e-6))
        # plain pre-norm layers keep the residual stream apart (run_layers); others add it
        self.stream_apart = keeps_stream_apart(self.stage.layers(self.layers))

    # Set by the runner for one forward that runs Qwen3-VL image rows (worker/step_execution.py)
    layer_additions: LayerAdditions | None = None
    # Set by an EAGLE-3 draft runner for the engine's life (spec_decode/eagle.py)
    stream_capture: StreamCapture | None = None

    def forward(self, input_ids, positions, kv_caches, md, hidden=None) -> torch.Tensor:
        x = stage_input(self, input_ids, hidden)
        self.rotary_emb.begin_forward(positions)
        layers = list(self.stage.layers(self.layers))
        norm = self.norm if self.stage.is_last else None
        additions, capture = self.layer_additions, self.stream_capture
        return run_layers(
            layers, self.stream_apart, positions, x, kv_caches, md, norm, additions, capture
        )


class LlamaForCausalLM(CausalLMBase):
    stacked_params = (
        *QKV_PROJ_RULES,
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    )
    ignored_weights = ("rotary_emb.inv_freq",)

    def __init__(self, config):
        super().__init__(config, LlamaModel(config, self.layer_flags(config)))

    @classmethod
    def layer_flags(cls, config) -> dict[str, bool]:
        """qkv / o / MLP biases, per-head q/k norms, and `sliding`: whether config.sliding_window
        applies (HF's Llama attends to the whole context whatever the config says)."""
        bias = bool(getattr(config, "attention_bias", False))
        return {
            "qkv_bias": bias,
            "o_bias": bias,
            "qk_norm": False,
            "mlp_bias": bool(getattr(config, "mlp_bias", False)),
            "sliding": False,
        }
