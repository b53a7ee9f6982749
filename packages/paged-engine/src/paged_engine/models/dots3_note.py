"""rednote dots3 note (`Dots3NoteForCausalLM`, model_type "dots3_note_text": dots3-note-prev's
language model; its omni wrapper `Dots3NoteForConditionalGeneration` is served text-only
through models/text_wrappers.py).

DeepSeek-V3's absorbed MLA and MoE (models/deepseek_v2.py) with DeepSeek Sparse Attention on
some layers (models/deepseek_v32.py), per config.layer_types, each as transformers runs it:

    layers     "indexed_attention": MLA plus GLM-5's indexer (interleaved rope on the first
               qk_rope_head_dims, key LayerNorm eps 1e-6), each query attending to its
               index_topk best keys; "full_attention": plain MLA; "sliding_attention": MLA over
               the last `sliding_window` keys. `per_layer_config` (by layer index; the sliding
               layers' own heads, ranks and head dims, from the checkpoint's `swa_*` fields)
               sets each layer's attention shape, its rope the layer type's rope_parameters
               entry (rope_theta; partial_rotary_factor = qk_rope_head_dim / head_dim, so the
               rotary part is qk_rope_head_dim wide)
    latents    q_resid = q_a_layernorm(q_a_proj(x)) * sqrt(hidden / q_lora_rank) (what q_b_proj
               and the indexer read); c = kv_a_layernorm(c) * sqrt(hidden / kv_lora_rank);
               the shared rotary key RMSNorm'd (`k_rope_only_layernorm`) before its rope; all
               three norms at rms_norm_eps (DeepSeek's latent norms keep 1e-6). Rope on MLA's
               q / k in (even, odd) pairs. Softmax scale (nope + rope)^-0.5, no YaRN mscale
    gate       head h's output times sigmoid(g_proj(x))[h] before o_proj
    mlp        "dense" (mlp_layer_types): a gated SiLU MLP of intermediate_size; "sparse":
               V3's grouped sigmoid router with its correction bias (renormalized when
               norm_topk_prob, times routed_scaling_factor), experts of moe_intermediate_size,
               and n_shared_experts * shared_experts_intermediate_size of shared expert

The cache is one latent row a token and layer, each layer its own width (`kv_cache_layout`):
[c | rope(k_pe)], an indexed layer's widened by its indexer key as V3.2's. The checkpoint's
multi-token-prediction layer (`model.layers.<num_hidden_layers>.*`, `model.mtp.*`) is skipped
as transformers skips it.

The indexer's ties (keys scoring the same, e.g. 0 after every head's relu) go to the earlier key,
as V3.2's; transformers' topk leaves them open. The sliding layers' rows wider than the Triton
kernels take run in float32 torch on CUDA (`WindowLatentAttention`).

Refused by name: q_lora_rank None on any layer (transformers cannot build such a layer either),
a layer type other than the three, and, as V3.2, CUDA graphs on indexed layers and
speculative_config method "mtp".
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
from torch import nn

from paged_engine.attention.cpu_backend import read_rows
from paged_engine.layers.attention import AttentionMetadata, LatentAttention
from paged_engine.layers.deepseek_moe import DeepseekMoe, SharedExpertsMLP, num_routed_experts
from paged_engine.layers.linear import ColumnParallelLinear
from paged_engine.layers.norm import RMSNorm
from paged_engine.layers.rotary import RotaryEmbedding, get_rope
from paged_engine.layers.torch_attention import (
    TorchAttention,
    attend,
    block_view,
    gather,
    step_sequences,
)
from paged_engine.models.deepseek_v2 import DeepseekDecoderLayer, DeepseekModel, MlaAttention
from paged_engine.models.deepseek_v32 import Choices, DeepseekV32ForCausalLM, DsaAttention
from paged_engine.models.llama import LlamaMLP
from paged_engine.models.mixtral import check_silu, expert_rules
from paged_engine.models.utils import CausalLMBase

LAYER_TYPES = ("full_attention", "sliding_attention", "indexed_attention")
_MAX_SCORES = 2**24  # float32 scores the torch window path holds at once: rows x heads x keys


def layer_types(config) -> list[str]:
    types = list(config.layer_types)
    bad = sorted(set(types) - set(LAYER_TYPES))
    if len(types) != config.num_hidden_layers or bad:
        raise ValueError(f"dots3 note: config.layer_types must name one of {LAYER_TYPES} a layer")
    return types


def layer_config(config, i: int):
    """Layer i's attention config: `per_layer_config[i]` (transformers' resolved view) with
    rope_parameters its type's entry, the partial factor dropped (the rope is built
    qk_rope_head_dim wide)."""
    per_layer = getattr(config, "per_layer_config", None)
    view = copy.copy(per_layer[i] if per_layer is not None else config)
    kind = config.layer_types[i]
    params = dict((config.rope_parameters or {}).get(kind) or {})
    params.pop("partial_rotary_factor", None)
    view.rope_parameters = params
    if getattr(view, "q_lora_rank", None) is None:
        raise ValueError(f"dots3 note: layer {i} has q_lora_rank None (its MLA needs one)")
    return view


class WindowLatentAttention(TorchAttention, LatentAttention):
    """MLA's latent attention over the last `sliding_window` keys: the latent cache as the one
    KV head of the backend's ordinary attention (a D-wide output, the first latent_dim columns
    each head's value). A row wider than the Triton kernels take (the release's sliding rows:
    1024 + 64 > MAX_HEAD_DIM 512) runs in float32 torch over the sequence's rows read back
    (`torch_path`), as layers/torch_attention.py's reference paths do, and refuses CUDA graphs."""

    torch_path: bool | None = None  # None: torch exactly for a CUDA row too wide for the kernels

    def run(self, q, k, v, kv_cache, attn_metadata: AttentionMetadata) -> torch.Tensor:
        t = q.shape[0]  # q: [T, H * W], k: [T, W] the rows to write
        latent, cache, md = k.view(t, 1, self.head_dim), kv_cache[0], attn_metadata
        scales = {"k_scale": self.k_scale, "v_scale": self.k_scale}
        md.backend.write_kv(latent, latent, cache, cache, md.slot_mapping, **scales)
        q = q.view(t, self.num_heads, self.head_dim)
        if self._in_torch(q):
            return self._attend_torch(q, cache, md).reshape(t, -1)
        out = md.backend.attend(
            q, cache, cache, md, scale=self.scale, sliding_window=self.sliding_window,
            soft_cap=None, alibi_slopes=None, **scales,
        )  # fmt: skip
        return out.reshape(t, -1)

    def _in_torch(self, q: torch.Tensor) -> bool:
        if self.torch_path is not None:
            return self.torch_path
        if not q.is_cuda:
            return False
        from paged_kernels._utils import MAX_HEAD_DIM  # (imports triton: CUDA hosts only)

        return self.head_dim > MAX_HEAD_DIM

    def _attend_torch(
        self, q: torch.Tensor, cache: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:  # q [T, H, W] -> [T, H, W]
        if q.is_cuda and torch.cuda.is_current_stream_capturing():
            raise ValueError("dots3 note's wide sliding layers cannot run in a CUDA graph")
        rows, out = block_view(cache, md.backend), torch.zeros_like(q)
        for _, first, end, length, blocks in step_sequences(md, rows.shape[1]):
            seq = read_rows(gather(rows, blocks, length), self.k_scale, q.dtype)  # [L, 1, W]
            keys = torch.arange(length, device=q.device)
            step = max(1, _MAX_SCORES // (self.num_heads * length))
            for row0 in range(first, end, step):
                row1 = min(row0 + step, end)
                # row j sits at position length - end + j: it sees the window's keys up to it
                pos = torch.arange(row0, row1, device=q.device) + (length - end)
                keep = (keys <= pos[:, None]) & (keys > pos[:, None] - self.sliding_window)
                out[row0:row1] = attend(q[row0:row1], seq, seq, keep, self.scale)
        return out


class Dots3NoteAttention(DsaAttention):
    """One layer's MLA (module docstring): the indexer on indexed layers, a window on sliding
    ones, the scaled latents, the normed rotary key and the per-head gate everywhere."""

    def __init__(self, config, rope: RotaryEmbedding, kind: str, choices: Choices) -> None:
        if kind == "indexed_attention":
            super().__init__(config, rope, True, choices, neox_index_rope=False)
        else:
            MlaAttention.__init__(self, config, rope)
            self.indexer = None
            if kind == "sliding_attention":
                base = self.attn
                self.attn = WindowLatentAttention(
                    base.num_heads, base.head_dim, self.rank, base.scale
                )
                self.attn.sliding_window = int(config.sliding_window)
        self.attn.scale = (self.nope + self.rope_dim) ** -0.5  # no YaRN mscale
        eps, hidden = float(config.rms_norm_eps), int(config.hidden_size)
        self.q_a_layernorm.eps = self.kv_a_layernorm.eps = eps
        self.k_rope_only_layernorm = RMSNorm(self.rope_dim, eps)
        self.q_lora_scale = (hidden / int(config.q_lora_rank)) ** 0.5
        self.kv_lora_scale = (hidden / self.rank) ** 0.5
        self.g_proj = ColumnParallelLinear(hidden, int(config.num_attention_heads), bias=False)

    def forward(self, positions, x, kv_cache, md: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]  # x: [T, D]
        q_resid = self.q_a_layernorm(self.q_a_proj(x)) * self.q_lora_scale
        q = self.q_b_proj(q_resid).view(t, self.heads, -1)
        q_nope, q_pe = q.split([self.nope, self.rope_dim], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)
        c = self.kv_a_layernorm(c.contiguous()) * self.kv_lora_scale
        k_pe = self.k_rope_only_layernorm(k_pe.contiguous())
        q_pe, k_pe = self.rotary_emb(positions, q_pe.reshape(t, -1), k_pe)
        w_uk, w_uv = self.kv_b_proj.heads().split([self.nope, self.v_dim], dim=1)
        # q_nope [H, T, nope] @ W_UK [H, nope, rank] -> the queries in latent space
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, rank]
        q_full = torch.cat((q_latent, q_pe.view(t, self.heads, -1)), dim=-1).reshape(t, -1)
        k, v = self.cache_rows(positions, x, q_resid, torch.cat((c, k_pe), dim=-1))
        out = self.attn(q_full, k, v, kv_cache, md).view(t, self.heads, -1)
        # o' [H, T, rank] @ W_UV^T [H, rank, v] -> each head's output [T, H, v], gated
        o = torch.bmm(out[..., : self.rank].transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
        o = o * torch.sigmoid(self.g_proj(x)).unsqueeze(-1)
        return self.o_proj(o.reshape(t, -1))


class Dots3NoteForCausalLM(DeepseekV32ForCausalLM):
    def __init__(self, config) -> None:
        check_silu(config, type(self).__name__)
        types = layer_types(config)
        views = [layer_config(config, i) for i in range(config.num_hidden_layers)]
        ropes: dict[str, RotaryEmbedding] = {}
        for kind, view in zip(types, views):
            if kind not in ropes:  # (even, odd) pairs, qk_rope_head_dim wide
                dim = int(view.qk_rope_head_dim)
                ropes[kind] = get_rope(view, dim, is_neox_style=False)
        choices: Choices = {}  # each indexed layer's own choice, no sharing

        def layer(config, i, _rope, mlp, _attention_cls) -> DeepseekDecoderLayer:
            def attention(_config, _r) -> Dots3NoteAttention:
                return Dots3NoteAttention(views[i], ropes[types[i]], types[i], choices)

            return DeepseekDecoderLayer(config, i, _rope, mlp, attention)  # type: ignore[arg-type]

        first = next(iter(ropes.values()))
        inner = DeepseekModel(config, type(self).build_mlp, Dots3NoteAttention, first, layer)  # type: ignore[arg-type]
        CausalLMBase.__init__(self, config, inner)
        # Expert rules first: the dense and shared MLPs' ".gate_proj" also matches an expert's.
        rules = expert_rules(num_routed_experts(config), "gate_proj", "up_proj", "down_proj")
        self.stacked_params = (*rules, *type(self).stacked_params)

    @classmethod
    def build_mlp(cls, config, layer_idx: int) -> nn.Module:
        kind = config.mlp_layer_types[layer_idx]
        if kind not in ("dense", "sparse"):
            raise ValueError(f"dots3 note: mlp_layer_types[{layer_idx}]={kind!r}")
        if kind == "dense":
            return LlamaMLP(config, bias=False)
        moe = DeepseekMoe.from_config(config)
        shared = int(config.shared_experts_intermediate_size) * int(config.n_shared_experts)
        moe.shared_experts = SharedExpertsMLP(config.hidden_size, shared)
        return moe

    @classmethod
    def kv_cache_layout(cls, config) -> list[tuple[int, int]]:
        """One latent "head" a layer: [c | rope(k_pe)] of the layer's own widths, an indexed
        layer's with its indexer key."""
        out = []
        for i, kind in enumerate(layer_types(config)):
            view = layer_config(config, i)
            width = int(view.kv_lora_rank) + int(view.qk_rope_head_dim)
            out.append(
                (1, width + (int(view.index_head_dim) if kind == "indexed_attention" else 0))
            )
        return out

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True
    ) -> set[str]:
        kept = ((n, w) for n, w in weights if not n.startswith(("mtp.", "model.mtp.")))
        return super().load_weights(kept, strict)
