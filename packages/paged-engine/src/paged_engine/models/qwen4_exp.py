"""Qwen4-Exp (`Qwen4ExpForCausalLM`; `Qwen4ExpForConditionalGeneration` served text-only).

Qwen3.5-MoE's hybrid stack (models/qwen3_next.py: Gated DeltaNet "linear_attention" layers,
gated full attention, Qwen2-MoE's softmax top-k experts with a sigmoid-gated shared expert in
every layer) with four changes, each as transformers runs it:

    streams    the residual is hc_count streams side by side ([T, n * D]); there are no
               input / post-attention / final norms. Before each sublayer a hyper-connection
               normalizes every stream (one (1 + w) RMSNorm per D-wide group, float32), mixes
               them into the sublayer's input
                   w = sigmoid(up(silu(down(h) / n)));  input = mean_i(w_i * h_i)
               and adds the sublayer's output y back to stream i scaled by
               2 * sigmoid(inject(h) / n)_i. The embedding enters every stream; the model's
               output is a last mix (`hyper_connection_mixer`, no injection).
    indexed    "indexed_attention" layers (config "full_attention" reads so) attend to chosen
               keys only (QSA). A query at position p sees its p + 1 keys as blocks of
               indexer_compress_ratio c: the complete blocks' mean raw index keys go through
               the indexer's (1 + w) k norm and RoPE at the block's first position, score
               sum_h relu(q_h . k_block) / sqrt(indexer_head_dim) against the query's index
               heads (index_qk_proj, (1 + w) q norm, RoPE at p), and the top
               indexer_budget / c blocks (torch.topk over the query's complete blocks: relu
               leaves ties at 0, broken as topk breaks them) plus the incomplete tail block
               are kept.
    PLE        the linear layers of ple_layer_ids (1-based) first add to every stream a value
               of hashed n-grams of the token and its predecessors, gated per stream and
               passed through a dilated causal conv (models/qwen4_exp_ple.py).
    linear     the gated DeltaNet's output norm is gated by output_gate_type (silu or sigmoid;
               default hidden_act).

What a sequence carries: the attention layers' paged KV, and beside each indexed layer's KV an
entry for its raw index keys ([1, indexer_head_dim] a token, `kv_cache_layout`; the value half
holds the same keys, unread). The linear layers' recurrent state (worker/recurrent_state.py)
and, for a PLE layer, its conv window and its last ngram_size - 1 token ids.

The indexed layers choose and attend in float32 torch, one sequence at a time, reading their
keys back from the cache (quadratic in the context, as transformers is). Tensor parallelism
splits attention and DeltaNet heads and the experts; the hyper-connections, the indexer and the
PLE projections are replicated (every rank chooses the same keys), the n-gram table split by
rows. Refused by name: a config without the indexer fields (`indexer_n_heads`, ...), an
indexer with indexer_kv_heads != 1, output_gate_type other than silu / sigmoid, CUDA graphs
(the choice reads the batch's lengths on the host: enforce_eager), images (the wrapper's). Not
served correctly: prompt_embeds rows on a model with PLE layers (the hashes read the rows'
placeholder ids). The n-gram hash tables' sizes and multipliers are recomputed from the config
(transformers' buffers are not loaded); multi-token-prediction weights (`mtp.*`) are skipped.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.attention.cpu_backend import read_rows
from paged_engine.layers.attention import AttentionMetadata
from paged_engine.layers.gated_delta_net import GatedDeltaNet, GatedRMSNorm
from paged_engine.layers.norm import GemmaRMSNorm
from paged_engine.layers.rotary import RotaryEmbedding, get_rope
from paged_engine.layers.torch_attention import attend, block_view, gather, step_sequences
from paged_engine.models.hybrid import LINEAR_LAYER_TYPES, HybridModel, layer_types
from paged_engine.models.llama import llama_head_dim, stage_input
from paged_engine.models.mixtral import check_silu, expert_rules, num_experts
from paged_engine.models.qwen2_moe import shared_expert_block
from paged_engine.models.qwen3_next import GatedAttention, Qwen3NextForCausalLM
from paged_engine.models.qwen4_exp_ple import GroupRMSNorm, PLELayer, replicated
from paged_engine.models.utils import CausalLMBase, cfg_get

_INDEXER_FIELDS = (
    "indexer_n_heads",
    "indexer_kv_heads",
    "indexer_head_dim",
    "indexer_budget",
    "indexer_compress_ratio",
)


class HyperConnection(nn.Module):
    """transformers' `Qwen4ExpTextGatedResidual` (module docstring, "streams")."""

    def __init__(self, config, inject: bool = True) -> None:
        super().__init__()
        n, d = int(config.hc_count), config.hidden_size
        self.n, self.d = n, d
        self.hc_norm = GroupRMSNorm(n * d, d, cfg_get(config, "rms_norm_eps", 1e-6))
        self.input_mix_weight_down = replicated(n * d, int(config.hc_lowrank))
        self.input_mix_weight_up = replicated(int(config.hc_lowrank), n * d)
        self.block_inject_weight = replicated(n * d, n) if inject else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [T, n*D] -> (the sublayer's input [T, D], injection weights [T, n] or None)."""
        h = self.hc_norm(x)
        w = F.silu(self.input_mix_weight_down(h) / self.n)
        w = torch.sigmoid(self.input_mix_weight_up(w)).unflatten(-1, (self.n, self.d))
        mixed = (w * h.unflatten(-1, (self.n, self.d))).mean(dim=-2)
        if self.block_inject_weight is None:
            return mixed, None
        return mixed, 2 * torch.sigmoid(self.block_inject_weight(h) / self.n)

    @staticmethod
    def add(x: torch.Tensor, y: torch.Tensor, inject: torch.Tensor) -> torch.Tensor:
        """Stream i += inject_i * y: x [T, n*D], y [T, D], inject [T, n]."""
        return x + (y.unsqueeze(-2) * inject.unsqueeze(-1)).flatten(-2)


def _rope_tables(rope: RotaryEmbedding, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """cos, sin [T, 1, rotary_dim / 2] of `rope` at positions [T] (or M-RoPE's [3, T])."""
    if positions.dim() == 2:
        cos, sin = rope._gather(positions)  # type: ignore[attr-defined]
    else:
        cos, sin = rope.cos[positions], rope.sin[positions]
    return cos.unsqueeze(1), sin.unsqueeze(1)


class QsaIndexer(nn.Module):
    """transformers' `Qwen4ExpTextQSAIndexer` (module docstring, "indexed"): chooses each
    query's keys."""

    def __init__(self, config, rope: RotaryEmbedding) -> None:
        super().__init__()
        missing = [f for f in _INDEXER_FIELDS if getattr(config, f, None) is None]
        if missing:
            raise ValueError(f"Qwen4-Exp indexed attention needs the config's {missing}")
        if int(config.indexer_kv_heads) != 1:
            raise ValueError(f"indexer_kv_heads={config.indexer_kv_heads}: only 1 is supported")
        self.num_heads, self.head_dim = int(config.indexer_n_heads), int(config.indexer_head_dim)
        self.ratio = int(config.indexer_compress_ratio)
        self.topk = int(config.indexer_budget) // self.ratio  # blocks
        if rope.rotary_dim > self.head_dim:
            raise ValueError(
                f"indexer_head_dim={self.head_dim} is narrower than the rotary dims "
                f"({rope.rotary_dim})"
            )
        self.rope = rope
        eps = cfg_get(config, "rms_norm_eps", 1e-6)
        self.index_qk_proj = replicated(config.hidden_size, (self.num_heads + 1) * self.head_dim)
        self.q_layernorm = GemmaRMSNorm(self.head_dim, eps)
        self.k_layernorm = GemmaRMSNorm(self.head_dim, eps)

    def project(self, x: torch.Tensor, positions: torch.Tensor):
        """x [T, D] -> (queries [T, Hi, Di] normed and rotated, raw keys [T, Di])."""
        t, d = x.shape[0], self.head_dim
        q, k = self.index_qk_proj(x).split([self.num_heads * d, d], dim=-1)
        q = self.q_layernorm(q.view(t, self.num_heads, d))
        return self.rope._rotate(q, *_rope_tables(self.rope, positions)), k

    def choose(self, q: torch.Tensor, keys: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """The keys [R, L] that R queries [R, Hi, Di] of one sequence attend to, given its raw
        index keys [L, Di] and each query's visible count `lengths` [R] (its position + 1)."""
        c, n = self.ratio, lengths[:, None]
        positions = torch.arange(keys.shape[0], device=keys.device)
        visible = positions < n
        num_blocks = keys.shape[0] // c
        if num_blocks <= self.topk:
            return visible
        pooled = keys[: num_blocks * c].float().unflatten(0, (num_blocks, c)).mean(1)
        pooled = self.k_layernorm(pooled.to(keys.dtype))[:, None]  # [B, 1, Di]
        starts = torch.arange(num_blocks, device=keys.device) * c
        pooled = self.rope._rotate(pooled, *_rope_tables(self.rope, starts))[:, 0]
        scores = torch.einsum("rhd,bd->rbh", q.float(), pooled.float()).relu().sum(-1)
        scores = scores / math.sqrt(self.head_dim)  # [R, B]
        # torch.topk over each query's complete blocks, as transformers calls it (relu leaves
        # many ties at 0: a query picks among them as topk does over its own blocks)
        complete = (lengths // c).tolist()
        chosen = torch.zeros_like(scores, dtype=torch.bool)
        for m in sorted(set(complete)):
            rows = torch.tensor([i for i, x in enumerate(complete) if x == m], device=q.device)
            if m <= self.topk:
                chosen[rows, :m] = True
                continue
            picked = scores[rows, :m].topk(self.topk, dim=-1).indices
            chosen[rows[:, None], picked] = True
        chosen = chosen.repeat_interleave(c, dim=-1)
        chosen = F.pad(chosen, (0, keys.shape[0] - chosen.shape[1]))
        tail = positions >= (n // c) * c
        return (chosen | tail) & visible


class IndexedAttention(GatedAttention):
    """Qwen3.5's gated attention over the keys its indexer chooses: writes the step's K/V and
    raw index keys to the paged cache, then per sequence reads them back and attends in float32.
    Its kv_cache is the pair (attention's (k, v), the index keys' (k, k))."""

    def __init__(self, config, rope: RotaryEmbedding) -> None:
        super().__init__(config, rope)
        self.indexer = QsaIndexer(config, rope)

    def forward(self, positions, x, kv_cache, md: AttentionMetadata) -> torch.Tensor:
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise ValueError("Qwen4-Exp's indexed attention cannot run in a CUDA graph")
        (key_cache, value_cache), (index_cache, index_copy) = kv_cache
        t, h, hkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qg, k, v = self.qkv_proj(x).split([2 * h * d, hkv * d, hkv * d], dim=-1)
        q, gate = qg.view(t, h, 2 * d).split([d, d], dim=-1)
        q = self.q_norm(q).reshape(t, h * d)
        k = self.k_norm(k.reshape(t, hkv, d)).reshape(t, hkv * d)
        q, k = self.rotary_emb(positions, q, k)
        index_q, index_k = self.indexer.project(x, positions)
        scales = {"k_scale": self.attn.k_scale, "v_scale": self.attn.v_scale}
        backend = md.backend
        backend.write_kv(
            k.view(t, hkv, d), v.view(t, hkv, d), key_cache, value_cache, md.slot_mapping, **scales
        )
        index_k = index_k[:, None]
        backend.write_kv(index_k, index_k, index_cache, index_copy, md.slot_mapping)
        keys, values = block_view(key_cache, backend), block_view(value_cache, backend)
        index_keys = block_view(index_cache, backend)
        q = q.view(t, h, d)
        out = torch.zeros_like(q)
        for _, first, end, length, blocks in step_sequences(md, keys.shape[1]):
            seq_k = read_rows(gather(keys, blocks, length), scales["k_scale"], q.dtype)
            seq_v = read_rows(gather(values, blocks, length), scales["v_scale"], q.dtype)
            seq_i = read_rows(index_keys[blocks].flatten(0, 1)[:length, 0], 1.0, q.dtype)
            # the sequence's last queries: row j sits at position length - end + j
            lengths = torch.arange(first, end, device=q.device) + (length - end + 1)
            keep = self.indexer.choose(index_q[first:end], seq_i, lengths)
            out[first:end] = attend(q[first:end], seq_k, seq_v, keep, self.attn.scale)
        out = out.view(t, h * d) * torch.sigmoid(gate.reshape(t, h * d))
        return self.o_proj(out)


class SigmoidGatedRMSNorm(GatedRMSNorm):
    """The DeltaNet output norm gated by sigmoid(z) (output_gate_type "sigmoid")."""

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        y = torch.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)
        return (self.weight * y * torch.sigmoid(z.float())).to(x.dtype)


class Qwen4ExpDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, rope: RotaryEmbedding, eos_id: int) -> None:
        super().__init__()
        self.is_linear = layer_types(config)[layer_idx] in LINEAR_LAYER_TYPES
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(config, layer_idx)
            if (config.output_gate_type or config.hidden_act) == "sigmoid":
                self.linear_attn.norm = SigmoidGatedRMSNorm(
                    self.linear_attn.head_v, cfg_get(config, "rms_norm_eps", 1e-6)
                )
        else:
            self.self_attn = IndexedAttention(config, rope)
        self.mlp = shared_expert_block(config, renormalize_default=True)
        ple_ids = list(config.ple_layer_ids or ())
        self.ple = (
            PLELayer(config, ple_ids.index(layer_idx + 1), eos_id)
            if layer_idx + 1 in ple_ids
            else None
        )
        self.attn_hyper_connection = HyperConnection(config)
        self.mlp_hyper_connection = HyperConnection(config)

    def forward(self, positions, x, kv_cache, md, input_ids) -> torch.Tensor:  # x: [T, n*D]
        if self.ple is not None:
            x = x + self.ple(x, input_ids, md)
        h, inject = self.attn_hyper_connection(x)
        if self.is_linear:
            h = self.linear_attn(h, md)
        else:
            h = self.self_attn(positions, h, kv_cache, md)
        x = HyperConnection.add(x, h, inject)
        h, inject = self.mlp_hyper_connection(x)
        return HyperConnection.add(x, self.mlp(h), inject)


def _check(config) -> int:
    """Refusals by name; returns the eos id PLE pads with."""
    check_silu(config, "Qwen4ExpForCausalLM")
    gate = config.output_gate_type or config.hidden_act
    if gate not in ("silu", "sigmoid"):
        raise ValueError(f"output_gate_type={gate!r}: only 'silu' and 'sigmoid' are supported")
    bad = set(layer_types(config)) - {"linear_attention", "indexed_attention", "full_attention"}
    if bad:
        raise ValueError(f"Qwen4-Exp layer_types: unsupported {sorted(bad)}")
    eos = config.eos_token_id
    eos = eos[0] if isinstance(eos, list) and eos else eos
    if config.ple_layer_ids and eos is None:
        raise ValueError("ple_layer_ids: PLE layers need the config's eos_token_id")
    return -1 if eos is None else int(eos)


class Qwen4ExpModel(HybridModel):
    """Embedding into every stream, the layers, the last mix (`norm`). kv_caches holds two
    entries per indexed layer (attention's, then its index keys')."""

    def __init__(self, config) -> None:
        eos_id = _check(config)
        rope = get_rope(config, llama_head_dim(config))
        super().__init__(
            config,
            lambda i: Qwen4ExpDecoderLayer(config, i, rope, eos_id),
            HyperConnection(config, inject=False),
            rope,
        )
        self.kv_index = [2 * i if i >= 0 else -1 for i in self.kv_index]
        self.hc_count = int(config.hc_count)

    def forward(self, input_ids, positions, kv_caches, md, hidden=None) -> torch.Tensor:
        x = stage_input(self, input_ids, hidden).repeat(1, self.hc_count)  # [T, n*D]
        self.rotary_emb.begin_forward(positions)
        for layer, i in zip(self.layers, self.kv_index, strict=True):
            kv = (kv_caches[i], kv_caches[i + 1]) if i >= 0 else None
            x = layer(positions, x, kv, md, input_ids)
        return self.norm(x)[0]


class Qwen4ExpForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5-MoE's checkpoint names and loading (Gated DeltaNet projections, experts, `mtp.*`
    skipped) over the Qwen4-Exp stack."""

    # the final mix is the stack's `norm` (HybridModel's place for it)
    renames = (("model.hyper_connection_mixer.", "model.norm."),)
    # transformers' n-gram hash buffers, recomputed from the config (NGramEmbedding)
    ignored_weights = (
        *Qwen3NextForCausalLM.ignored_weights,
        "ple_embedding.layer_multipliers",
        "ple_embedding.ngram_heads_vocab_sizes",
        "ple_embedding.ngram_heads_offsets",
    )

    def __init__(self, config) -> None:
        CausalLMBase.__init__(self, config, Qwen4ExpModel(config))
        rules = expert_rules(num_experts(config), "gate_proj", "up_proj", "down_proj")
        pieces = tuple(
            (".ngram_embedding.weight", f".ngram_embedding.shard_{i}.weight", i)
            for i in range(int(config.split_ngram_parts))
        )
        self.stacked_params = (*rules, *pieces, *type(self).stacked_params)

    @classmethod
    def kv_cache_layout(cls, config) -> list[tuple[int, int]]:
        """Per indexed layer: (num_kv_heads, head_dim), then (1, indexer_head_dim)."""
        attn = (int(config.num_key_value_heads), llama_head_dim(config))
        index = (1, int(config.indexer_head_dim))
        kinds = [t for t in layer_types(config) if t not in LINEAR_LAYER_TYPES]
        return [shape for _ in kinds for shape in (attn, index)]
