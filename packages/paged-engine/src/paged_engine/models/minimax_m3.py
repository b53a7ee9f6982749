"""MiniMax M3's text decoder (`MiniMaxM3VLForCausalLM`, model_type "minimax_m3_vl_text"; the
`MiniMaxM3SparseForConditionalGeneration` wrapper's text model through models/text_wrappers.py,
its images through multimodal/minimax_m3_vl.py). Llama's pre-norm decoder, each piece as
transformers runs it:

    norms      every RMSNorm is Gemma's: x / rms(x) * (1 + w) in float32 (layers, final, the
               per-head q / k norms and the indexer's)
    attention  GQA without biases; per-head q / k norms, then RoPE over the first
               head_dim * partial_rotary_factor dims (NeoX halves; transformers reads
               rope_parameters and ignores the config's `rotary_dim`)
    sparse     `layer_types` "minimax_m3_sparse" layers add a lightning indexer: index queries
               index_q_norm(index_q_proj(x)) [index_n_heads, index_head_dim] and one index key
               index_k_norm(index_k_proj(x)) [index_head_dim] a token, both rotated like q / k.
               For a query at position p and index head h the score of key j <= p is
               q_h . k_j (float32); keys form blocks of index_block_size by absolute position,
               a block scores its best key; the blocks p // bs - i (i < index_local_blocks,
               clamped at 0) always win, then the best up to index_topk_blocks in all. Query
               head g attends to the visible keys of its index head's blocks (head
               g // (num_attention_heads / index_n_heads)).
    mlp        `mlp_layer_types`: "dense" a SwiGLU-OAI MLP of dense_intermediate_size,
               "sparse" a MoE: sigmoid router with e_score_correction_bias for the choice,
               the chosen sigmoids renormalized and times routed_scaling_factor, experts and
               one shared expert (shared_intermediate_size) all SwiGLU-OAI
               ((clamp(u, +-limit) + 1) * g' * sigmoid(alpha g'), g' = min(g, limit); gate
               rows first in the fused gate_up weights, not interleaved)

The cache: each sparse layer has a second entry beside its KV for its index keys
([1, index_head_dim] a token, `kv_cache_layout`; the value half holds them again, unread), so
prefix caching, chunked prefill and preemption carry them with the KV. A sparse layer writes both
and then, per sequence, reads them back and chooses and attends in float32 torch (a reference
path, quadratic in the context as transformers is; the choice depends only on keys up to each
query, so chunking does not change it). Tensor parallelism splits heads and experts; the indexer
is replicated and every rank makes the same choice.

Checkpoints: transformers 5's names (`self_attn.indexer.*`, fused `gate_up_proj`s,
`mlp.experts.*` 3-D) and the release's (`self_attn.index_{q,k}_{proj,norm}`,
`block_sparse_moe.experts.M.w1/w3/w2`, `block_sparse_moe.e_score_correction_bias`, split
`gate_proj` / `up_proj`); `mtp.*` weights are skipped. HF computes the router logits in the
router weight's dtype (the model's); ours are float32, as vLLM's (the same in float32).
Refused by name: unknown layer_types / mlp_layer_types; with sparse layers,
num_attention_heads not a multiple of index_n_heads, index_local_blocks > index_topk_blocks
(transformers' choice among the tied local blocks is then arbitrary), index_head_dim narrower
than the rotary dims, pipeline parallelism, an fp8 KV cache (the index keys) and CUDA graphs
(the choice reads lengths on the host: enforce_eager). Under a CPU torch.compile the runner
falls back to eager (the sparse layers' attention runs outside the compiled operator).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from paged_engine.attention.cpu_backend import read_rows
from paged_engine.distributed.parallel_state import get_parallel_state
from paged_engine.layers.attention import AttentionMetadata
from paged_engine.layers.deepseek_moe import DeepseekMoe, DeepseekRouter, SharedExpertsMLP
from paged_engine.layers.fused_moe import FusedMoE
from paged_engine.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from paged_engine.layers.norm import GemmaRMSNorm
from paged_engine.layers.rotary import RotaryEmbedding
from paged_engine.layers.torch_attention import block_view, gather, step_sequences
from paged_engine.models.llama import (
    LlamaAttention,
    LlamaForCausalLM,
    LlamaModel,
    PreNormDecoderLayer,
    llama_head_dim,
    run_layers,
    stage_input,
)
from paged_engine.models.mixtral import expert_rules, num_experts
from paged_engine.models.qwen4_exp_ple import replicated
from paged_engine.models.utils import CausalLMBase, cfg_get
from paged_kernels.reference import MoeActivation, moe_activation

SPARSE = "minimax_m3_sparse"
_FLAGS = {"qkv_bias": False, "o_bias": False, "qk_norm": True, "mlp_bias": False, "sliding": False}
_MAX_SCORES = 2**24  # float32 scores held at once: rows x heads x keys


def attention_types(config) -> list[str]:
    """Each layer's attention, "full_attention" or SPARSE (refuses others by name)."""
    n = config.num_hidden_layers
    types = list(cfg_get(config, "layer_types", ["full_attention"] * n))
    bad = sorted(set(types) - {"full_attention", SPARSE})
    if bad or len(types) != n:
        raise ValueError(f"MiniMax M3 layer_types: unsupported {bad or types}")
    return types


def mlp_types(config) -> list[str]:
    """Each layer's MLP, "dense" or "sparse" (MoE)."""
    n = config.num_hidden_layers
    types = list(cfg_get(config, "mlp_layer_types", ["sparse"] * n))
    bad = sorted(set(types) - {"dense", "sparse"})
    if bad or len(types) != n:
        raise ValueError(f"MiniMax M3 mlp_layer_types: unsupported {bad or types}")
    return types


def _check_sparse(config, rope: RotaryEmbedding) -> None:
    heads, index_heads = int(config.num_attention_heads), int(config.index_n_heads)
    if heads % index_heads:
        raise ValueError(
            f"index_n_heads={index_heads} must divide num_attention_heads={heads} (each index "
            "head chooses for a group of query heads)"
        )
    if int(config.index_local_blocks) > int(config.index_topk_blocks):
        raise ValueError(
            f"index_local_blocks={config.index_local_blocks} > index_topk_blocks="
            f"{config.index_topk_blocks}: which local blocks win is left open"
        )
    if int(config.index_topk_blocks) < 1 or int(config.index_block_size) < 1:
        raise ValueError("index_topk_blocks and index_block_size must be at least 1")
    if int(config.index_head_dim) < rope.rotary_dim:
        raise ValueError(
            f"index_head_dim={config.index_head_dim} is narrower than the rotary dims "
            f"({rope.rotary_dim})"
        )
    if get_parallel_state().pp_size > 1:
        raise ValueError("MiniMax M3's sparse layers are not supported with pipeline parallelism")


class SwigluOaiAndMul(nn.Module):
    """[.., 2I] gate | up halves -> [.., I]: SwiGLU-OAI (the experts' activation)."""

    def __init__(self, alpha: float, limit: float) -> None:
        super().__init__()
        self.act = MoeActivation("swigluoai", alpha, limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return moe_activation(gate, up, self.act)


def _swiglu(config) -> SwigluOaiAndMul:
    return SwigluOaiAndMul(float(config.swiglu_alpha), float(config.swiglu_limit))


class MiniMaxM3MLP(nn.Module):
    """A dense layer's MLP: down(swiglu_oai(gate_up(x)))."""

    def __init__(self, config, intermediate_size: int) -> None:
        super().__init__()
        d, i = config.hidden_size, intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(d, [i, i], False)
        self.down_proj = RowParallelLinear(i, d, False)
        self.act_fn = _swiglu(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class MiniMaxM3Moe(DeepseekMoe):
    """DeepSeek's MoE block (its forward: sigmoid + bias choice, renormalized, scaled; one
    all-reduce) built with SwiGLU-OAI routed and shared experts (no SiLU set made first)."""

    def __init__(self, config) -> None:
        nn.Module.__init__(self)
        e, d, inter = num_experts(config), config.hidden_size, int(config.intermediate_size)
        scale = float(cfg_get(config, "routed_scaling_factor", 1.0))
        self.gate = DeepseekRouter(e, d, int(config.num_experts_per_tok), scale=scale)
        act = MoeActivation("swigluoai", float(config.swiglu_alpha), float(config.swiglu_limit))
        self.experts = FusedMoE(e, d, inter, activation=act)
        shared = int(cfg_get(config, "shared_intermediate_size", 0))
        self.shared_experts = SharedExpertsMLP(d, shared) if shared else None
        if self.shared_experts is not None:
            self.shared_experts.act_fn = _swiglu(config)


def _gemma_qk_norms(attn: LlamaAttention, config) -> None:
    eps = cfg_get(config, "rms_norm_eps", 1e-6)
    attn.q_norm = GemmaRMSNorm(attn.head_dim, eps)
    attn.k_norm = GemmaRMSNorm(attn.head_dim, eps)


class MiniMaxM3Attention(LlamaAttention):
    """A full layer: Llama's attention with Gemma per-head q / k norms."""

    def __init__(self, config, layer_idx: int, rope: RotaryEmbedding) -> None:
        super().__init__(config, layer_idx, _FLAGS, rope)
        _gemma_qk_norms(self, config)


def attend_heads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [R, H, D] over keys / values [L, Hkv, D] where keep [R, H, L], float32 -> [R, H, D]."""
    r, h, d = q.shape
    qg = q.float().view(r, k.shape[1], -1, d)  # [R, Hkv, G, D]
    scores = torch.einsum("rkgd,lkd->rkgl", qg, k.float()) * scale
    scores = scores.masked_fill(~keep.view(r, k.shape[1], -1, keep.shape[-1]), float("-inf"))
    out = torch.einsum("rkgl,lkd->rkgd", torch.softmax(scores, dim=-1), v.float())
    return out.reshape(r, h, d).to(q.dtype)


class MiniMaxM3SparseAttention(MiniMaxM3Attention):
    """A sparse layer: the full layer's projections plus the lightning indexer (module
    docstring, "sparse"). Its kv_cache is the pair (attention's (k, v), index keys' (k, k))."""

    def __init__(self, config, layer_idx: int, rope: RotaryEmbedding) -> None:
        super().__init__(config, layer_idx, rope)
        _check_sparse(config, rope)
        d, eps = config.hidden_size, cfg_get(config, "rms_norm_eps", 1e-6)
        self.index_heads, self.index_dim = int(config.index_n_heads), int(config.index_head_dim)
        self.block, self.topk = int(config.index_block_size), int(config.index_topk_blocks)
        self.local = int(config.index_local_blocks)
        self.index_q_proj = replicated(d, self.index_heads * self.index_dim)
        self.index_k_proj = replicated(d, self.index_dim)
        self.index_q_norm = GemmaRMSNorm(self.index_dim, eps)
        self.index_k_norm = GemmaRMSNorm(self.index_dim, eps)
        # this rank's query head j is global head rank * H_local + j; its index head:
        local, heads = self.q_size // self.head_dim, int(config.num_attention_heads)
        first = get_parallel_state().tp_rank * local
        group = heads // self.index_heads
        self.register_buffer("head_index", (torch.arange(local) + first) // group, persistent=False)

    def _index(self, positions: torch.Tensor, x: torch.Tensor):
        """x [T, D] -> (index queries [T, Hi, Di], keys [T, 1, Di]), normed and rotated."""
        t, rope = x.shape[0], self.rotary_emb
        assert rope is not None
        q = self.index_q_norm(self.index_q_proj(x).view(t, self.index_heads, self.index_dim))
        k = self.index_k_norm(self.index_k_proj(x).view(t, 1, self.index_dim))
        cos, sin = rope.cos[positions].unsqueeze(1), rope.sin[positions].unsqueeze(1)
        return rope._rotate(q, cos, sin), rope._rotate(k, cos, sin)

    def choose(self, q: torch.Tensor, keys: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """The keys [Hi, R, L] each index head lets R queries [R, Hi, Di] at positions `pos`
        [R] attend to, given their sequence's index keys [L, Di]."""
        length, bs = keys.shape[0], self.block
        visible = torch.arange(length, device=q.device) <= pos[:, None]  # [R, L]
        scores = torch.einsum("rhd,ld->hrl", q.float(), keys.float())
        scores = scores.masked_fill(~visible, float("-inf"))
        nb = -(-length // bs)
        scores = torch.nn.functional.pad(scores, (0, nb * bs - length), value=float("-inf"))
        blocks = scores.unflatten(-1, (nb, bs)).amax(-1)  # [Hi, R, nb]
        if self.local:
            near = (pos[:, None] // bs - torch.arange(self.local, device=q.device)).clamp(min=0)
            blocks.scatter_(-1, near.expand(self.index_heads, -1, -1), float("inf"))
        top = blocks.topk(min(self.topk, nb), dim=-1)
        chosen = torch.zeros_like(blocks, dtype=torch.bool)
        chosen.scatter_(-1, top.indices, top.values > float("-inf"))
        return chosen.repeat_interleave(bs, dim=-1)[..., :length] & visible

    def forward(self, positions, x, kv_cache, md: AttentionMetadata) -> torch.Tensor:
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise ValueError(
                "MiniMax M3's sparse attention cannot run in a CUDA graph (enforce_eager=True)"
            )
        (key_cache, value_cache), (index_cache, index_copy) = kv_cache
        t, d, rope = x.shape[0], self.head_dim, self.rotary_emb
        assert rope is not None
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(t, -1, d)).reshape(t, -1)
        k = self.k_norm(k.reshape(t, -1, d)).reshape(t, -1)
        q, k = rope(positions, q, k)
        index_q, index_k = self._index(positions, x)
        hkv = self.kv_size // d
        scales = {"k_scale": self.attn.k_scale, "v_scale": self.attn.v_scale}
        backend = md.backend
        backend.write_kv(
            k.view(t, hkv, d), v.view(t, hkv, d), key_cache, value_cache, md.slot_mapping, **scales
        )
        backend.write_kv(index_k, index_k, index_cache, index_copy, md.slot_mapping)
        keys, values = block_view(key_cache, backend), block_view(value_cache, backend)
        index_keys = block_view(index_cache, backend)
        q = q.view(t, -1, d)
        out = torch.zeros_like(q)
        for _, first, end, length, blocks in step_sequences(md, keys.shape[1]):
            seq_k = read_rows(gather(keys, blocks, length), scales["k_scale"], q.dtype)
            seq_v = read_rows(gather(values, blocks, length), scales["v_scale"], q.dtype)
            seq_i = read_rows(gather(index_keys, blocks, length)[:, 0], 1.0, q.dtype)
            step = max(1, _MAX_SCORES // (max(q.shape[1], self.index_heads) * length))
            for row0 in range(first, end, step):
                rows = slice(row0, min(row0 + step, end))
                # the sequence's last queries: row j sits at position length - end + j
                pos = torch.arange(rows.start, rows.stop, device=q.device) + (length - end)
                keep = self.choose(index_q[rows], seq_i, pos)[self.head_index]  # [Hl, R, L]
                out[rows] = attend_heads(
                    q[rows], seq_k, seq_v, keep.transpose(0, 1), self.attn.scale
                )
        return self.o_proj(out.view(t, -1))


class MiniMaxM3DecoderLayer(PreNormDecoderLayer):
    def __init__(self, config, layer_idx: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        eps = cfg_get(config, "rms_norm_eps", 1e-6)
        sparse = attention_types(config)[layer_idx] == SPARSE
        attention = MiniMaxM3SparseAttention if sparse else MiniMaxM3Attention
        self.self_attn = attention(config, layer_idx, rope)
        if mlp_types(config)[layer_idx] == "sparse":
            self.mlp = MiniMaxM3Moe(config)
        else:
            self.mlp = MiniMaxM3MLP(config, int(config.dense_intermediate_size))
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)


class MiniMaxM3Model(LlamaModel):
    """Llama's stack of MiniMax M3 layers with a Gemma final norm. kv_caches holds one entry per
    full layer and two per sparse layer (its KV, then its index keys)."""

    def __init__(self, config) -> None:
        super().__init__(config, _FLAGS, lambda i, rope: MiniMaxM3DecoderLayer(config, i, rope))
        self.norm = GemmaRMSNorm(config.hidden_size, cfg_get(config, "rms_norm_eps", 1e-6))
        self.sparse = [t == SPARSE for t in attention_types(config)]

    def forward(self, input_ids, positions, kv_caches, md, hidden=None) -> torch.Tensor:
        if not any(self.sparse):  # one entry a layer (pipeline stages included)
            return super().forward(input_ids, positions, kv_caches, md, hidden)
        grouped, i = [], 0
        for sparse in self.sparse:  # one stage: every layer is here
            grouped.append((kv_caches[i], kv_caches[i + 1]) if sparse else kv_caches[i])
            i += 2 if sparse else 1
        x = stage_input(self, input_ids, hidden)
        self.rotary_emb.begin_forward(positions)
        layers = list(self.stage.layers(self.layers))
        return run_layers(layers, self.stream_apart, positions, x, grouped, md, self.norm)


class MiniMaxM3ForCausalLM(CausalLMBase):
    """transformers 5's and the release's checkpoint names (module docstring)."""

    stacked_params = LlamaForCausalLM.stacked_params
    ignored_weights = ("rotary_emb.inv_freq",)
    renames = (
        (".block_sparse_moe.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"),
        (".block_sparse_moe.", ".mlp."),
        (".self_attn.indexer.q_proj.", ".self_attn.index_q_proj."),
        (".self_attn.indexer.k_proj.", ".self_attn.index_k_proj."),
        (".self_attn.indexer.q_norm.", ".self_attn.index_q_norm."),
        (".self_attn.indexer.k_norm.", ".self_attn.index_k_norm."),
    )

    def __init__(self, config) -> None:
        super().__init__(config, MiniMaxM3Model(config))
        rules = expert_rules(num_experts(config), "w1", "w3", "w2")
        self.stacked_params = (*rules, *type(self).stacked_params)
        # the index keys would be rounded to fp8 with no scale of their own
        self.fp8_kv_cache = SPARSE not in attention_types(config)
        self.fp8_kv_refusal = "its sparse layers cache index keys beside the KV"

    @classmethod
    def kv_cache_layout(cls, config) -> list[tuple[int, int]]:
        """Per layer (num_kv_heads, head_dim), and after a sparse layer's (1, index_head_dim)."""
        attn = (int(config.num_key_value_heads), llama_head_dim(config))
        layout = []
        for kind in attention_types(config):
            layout.append(attn)
            if kind == SPARSE:
                layout.append((1, int(config.index_head_dim)))
        return layout

    def convert_weight(self, name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if w.numel() == 0 and ".shared_experts." in name:  # shared_intermediate_size 0: none
            return ()
        # transformers' fused dense / shared-expert gate_up [2I, D]: gate rows, then up rows
        if name.endswith(".gate_up_proj.weight") and ".experts." not in name:
            gate, up = w.chunk(2, dim=0)
            stem = name[: -len(".gate_up_proj.weight")]
            return ((f"{stem}.gate_proj.weight", gate), (f"{stem}.up_proj.weight", up))
        return ((name, w),)

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True
    ) -> set[str]:
        # the multi-token-prediction module (transformers ignores it too)
        kept = ((n, w) for n, w in weights if not n.startswith(("mtp.", "model.mtp.")))
        return super().load_weights(kept, strict)
