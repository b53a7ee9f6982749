"""xAI's Grok-1 (hpcai-tech/grok-1, keyfan/grok-1-hf; remote code, `Grok1ModelForCausalLM` or
`Grok1ForCausalLM`) and Grok-2 (xai-org/grok-2: `Grok1ForCausalLM` with model_type "git"),
served as vLLM's grok1.py serves them (its `GrokForCausalLM`, Grok-1 / Grok-2 paths).

    embedding  embed_tokens(ids) * embedding_multiplier_scale
    attention  GQA with NeoX RoPE (rope_theta), head_dim = hidden_size / num_attention_heads;
               scores q.k * head_dim^-0.5 soft-capped at attn_logit_softcapping (30 when
               absent, 0 none); o_proj's output times attn_output_multiplier (1 when absent)
    layer      four RMSNorms: x += post_attn_norm(attn(pre_attn_norm(x)));
               x += post_moe_norm(ffn(pre_moe_norm(x)))
    ffn        Grok-1: moe(h). Grok-2 (`residual_moe`): (moe(h) + mlp(h)) / sqrt(2), mlp a dense
               down(gelu(gate h) * up h) of intermediate_size, the experts moe_intermediate_size
    MoE        router logits soft-capped at router_logit_softcapping (30 when absent), softmax,
               top num_experts_per_tok, renormalized unless residual_moe (moe_router_renormalize
               / moe_renormalize say otherwise); experts down(gelu(gate x) * up x), all GELUs
               the exact (erf) one
    logits     soft_cap(lm_head(h), final_logit_softcapping) * output_multiplier_scale (cap,
               then scale: vLLM's LogitsProcessor order); the head tied when
               tie_word_embeddings, by default for Grok-1 and not for model_type "git" (Grok-2:
               transformers reads its config as GitConfig, whose default is untied)

The release's own code scales the scores by attn_output_multiplier and leaves o_proj's output
alone, caps the scores at `max_attn_value`, and neither caps nor renormalizes the router: on
the release's config (attn_output_multiplier = 128^-0.5 = head_dim^-0.5) vLLM's extra output
factor and renormalization are per-token scales the next RMSNorm removes up to its eps, and the
router cap is near the identity. We follow vLLM; a `max_attn_value` other than the cap vLLM
applies is refused by name.

Grok-2 as vLLM reads it, where SGLang (xAI's reference engine) differs: rope_type "original"
is plain rope at rope_theta (its YaRN fields, scaling_factor and the rest, unused, as in
SGLang's "original" method); `attn_temperature_len` (SGLang's query temperature past that
position) is ignored; the dense MLP's GELU is exact (SGLang's the tanh form); the final cap
applies before the output scale (SGLang's after).

Checkpoint names: Grok-1's `attn.{q,k,v,o}_proj`, `moe_block.gate`, `moe_block.experts.M.
{linear,linear_v,linear_1}` (gate, up, down), the norms' `scale` (ours `weight`); Grok-2's
`self_attn.`, `block_sparse_moe.experts.M.{w1,w3,w2}`, `mlp.{gate,up,down}_proj`. Grok-2's
release splits the expert (and any dense MLP) matrices over its `*-TP-NNN.safetensors` files
under one name; `join_tp_slices` concatenates the slices in file order (rank order) along the
intermediate dimension (any order shared by a matrix's gate, up and down slices serves the same
model: it permutes the intermediate units). Rope scaling, other rope types, sliding windows
(`sliding_window_size`, `global_attn_every_n`) and other soft-cap methods are refused by name.

The experts run through the fused MoE (`MoeActivation("gelu")`, paged_kernels' erf branch).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from paged_engine.layers.attention import AttentionMetadata
from paged_engine.layers.embedding import VocabParallelEmbedding
from paged_engine.layers.fused_moe import SparseMoeBlock, route
from paged_engine.layers.norm import RMSNorm
from paged_engine.layers.rotary import RotaryEmbedding, get_rope
from paged_engine.models.gemma2 import GemmaAttention
from paged_engine.models.llama import LlamaMLP
from paged_engine.models.mixtral import expert_rules
from paged_engine.models.remote_aliases import field, llama_fields, refuse_unless
from paged_engine.models.utils import QKV_PROJ_RULES, CausalLMBase, make_layers, soft_cap
from paged_kernels import MoeActivation

# vLLM's defaults for the fields a Grok config may omit (the release's values)
_EMBEDDING_SCALE = 78.38367176906169
_OUTPUT_SCALE = 0.5773502691896257
_CAP = 30.0
_RESIDUAL_MOE_SCALE = 1 / math.sqrt(2.0)


def _cap(raw: dict[str, Any], name: str) -> float:
    """A soft cap as vLLM reads it: absent 30, negative 0; 0 means none."""
    return max(field(raw, name, float, _CAP), 0.0)


def grok1_config(raw: dict[str, Any]) -> PretrainedConfig:
    """Grok-1's or Grok-2's config.json under the names our classes read, vLLM's defaults."""
    arch = next(a for a in raw["architectures"] if a.startswith("Grok1"))
    for name in ("rope_scaling", "quantization_config"):
        refuse_unless(raw, arch, name, (None,))
    refuse_unless(raw, arch, "rope_type", (None, "default", "original"))
    refuse_unless(raw, arch, "attn_logit_softcapping_method", (None, "tanh"))
    refuse_unless(raw, arch, "sliding_window_size", (None, -1))  # Grok-2's: no window
    refuse_unless(raw, arch, "global_attn_every_n", (None, 1))
    sizes = llama_fields(raw, max_positions=8192, rms_norm_eps=1e-5)
    # vLLM's, whatever a head_dim field says: refused if it differs
    head_dim = sizes["hidden_size"] // sizes["num_attention_heads"]
    refuse_unless(raw, arch, "head_dim", (None, head_dim))
    attn_cap = _cap(raw, "attn_logit_softcapping")
    if raw.get("max_attn_value") is not None and field(raw, "max_attn_value", float) != attn_cap:
        raise ValueError(
            f"{arch}: config.json field 'max_attn_value'={raw['max_attn_value']!r} is not "
            f"supported: vLLM caps the attention scores at attn_logit_softcapping ({attn_cap})"
        )
    final_cap = field(raw, "final_logit_softcapping", float, 0.0)
    if raw.get("final_logit_softcapping") is not None and final_cap <= 0:
        raise ValueError(
            f"{arch}: config.json field 'final_logit_softcapping'={final_cap!r} must be positive"
        )
    residual_moe = field(raw, "residual_moe", bool, False)  # Grok-2: a dense MLP beside the MoE
    renormalize = not residual_moe  # vLLM's default; an explicit field wins (this order)
    for name in ("moe_router_renormalize", "moe_renormalize"):
        if raw.get(name) is not None:
            renormalize = field(raw, name, bool)
            break
    # the release's num_experts, else num_local_experts (vLLM's order)
    name = "num_experts" if raw.get("num_experts") is not None else "num_local_experts"
    fields = {
        **sizes,
        "head_dim": head_dim,
        "hidden_act": "gelu",  # the dense MLP's (LlamaMLP reads it): exact, vLLM's GeluAndMul
        "rope_theta": field(raw, "rope_theta", float, 10000.0),
        # GitConfig (model_type "git", Grok-2's) unties by default, Grok-1's config ties
        "tie_word_embeddings": field(
            raw, "tie_word_embeddings", bool, raw.get("model_type") != "git"
        ),
        "num_local_experts": field(raw, name, int, 8),
        "num_experts_per_tok": field(raw, "num_experts_per_tok", int, 2),
        "moe_intermediate_size": field(
            raw, "moe_intermediate_size", int, sizes["intermediate_size"]
        ),
        "residual_moe": residual_moe,
        "moe_renormalize": renormalize,
        "attn_logit_softcapping": attn_cap,
        "router_logit_softcapping": _cap(raw, "router_logit_softcapping"),
        "final_logit_softcapping": final_cap,
        "attn_output_multiplier": field(raw, "attn_output_multiplier", float, 1.0),
        "embedding_multiplier_scale": field(
            raw, "embedding_multiplier_scale", float, _EMBEDDING_SCALE
        ),
        "output_multiplier_scale": field(raw, "output_multiplier_scale", float, _OUTPUT_SCALE),
    }
    config = PretrainedConfig(**fields)
    config.model_type = "grok-1"
    return config


class Grok1MoE(SparseMoeBlock):
    """Softmax top-k over soft-capped router logits, renormalized unless config.moe_renormalize
    is false (Grok-2); exact-GELU gated experts. [T, H] -> [T, H]."""

    def __init__(self, config) -> None:
        e, h, i = config.num_local_experts, config.hidden_size, config.moe_intermediate_size
        act, renormalize = MoeActivation("gelu"), config.moe_renormalize
        super().__init__(
            e, config.num_experts_per_tok, h, i, renormalize=renormalize, activation=act
        )
        self.router_cap = config.router_logit_softcapping or None

    def select_experts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(soft_cap(self.gate(x), self.router_cap), self.top_k, self.renormalize)


class Grok1DecoderLayer(nn.Module):
    def __init__(self, config, rope: RotaryEmbedding) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        cap = config.attn_logit_softcapping or None
        # scores scaled by query_pre_attn_scalar^-0.5: head_dim^-0.5 (no such field here)
        self.attn = GemmaAttention(config, None, rope, qk_norm=False, soft_cap=cap)
        self.attn_output_multiplier = float(config.attn_output_multiplier)
        self.moe_block = Grok1MoE(config)
        # Grok-2's residual MoE: a dense MLP beside the experts, the sum scaled by 1/sqrt(2)
        self.mlp = LlamaMLP(config, bias=False) if config.residual_moe else None
        self.pre_attn_norm = RMSNorm(d, eps)
        self.post_attn_norm = RMSNorm(d, eps)
        self.pre_moe_norm = RMSNorm(d, eps)
        self.post_moe_norm = RMSNorm(d, eps)

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        x: torch.Tensor,  # [T, D]
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        md: AttentionMetadata,
    ) -> torch.Tensor:
        attn = self.attn(positions, self.pre_attn_norm(x), kv_cache, md)
        x = x + self.post_attn_norm(attn * self.attn_output_multiplier)
        h = self.pre_moe_norm(x)
        ffn = self.moe_block(h)
        if self.mlp is not None:
            ffn = (ffn + self.mlp(h)) * _RESIDUAL_MOE_SCALE
        return x + self.post_moe_norm(ffn)


class Grok1Model(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        d = config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, d)
        self.embedding_multiplier_scale = float(config.embedding_multiplier_scale)
        rope = get_rope(config, config.head_dim, is_neox_style=True)  # shared by the layers
        self.layers, self.stage = make_layers(
            config.num_hidden_layers, lambda i: Grok1DecoderLayer(config, rope)
        )
        self.norm = RMSNorm(d, config.rms_norm_eps)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, D]
        return self.embed_tokens(input_ids) * self.embedding_multiplier_scale

    def forward(self, input_ids, positions, kv_caches, md, hidden=None) -> torch.Tensor:
        # hidden: the previous stage's output or input embeddings
        x = self.embed_input_ids(input_ids) if hidden is None else hidden
        for layer, kv_cache in zip(self.stage.layers(self.layers), kv_caches, strict=True):
            x = layer(positions, x, kv_cache, md)
        return self.norm(x) if self.stage.is_last else x


class Grok1ForCausalLM(CausalLMBase):
    tie_default = True
    ignored_weights = ("rotary_emb.inv_freq",)
    # Grok-2's names -> Grok-1's (ours)
    renames = ((".self_attn.", ".attn."), (".block_sparse_moe.", ".moe_block."))

    def __init__(self, config) -> None:
        super().__init__(config, Grok1Model(config))
        self.output_multiplier_scale = float(config.output_multiplier_scale)
        self.final_cap = config.final_logit_softcapping or None
        e = config.num_local_experts
        self.stacked_params = (
            *expert_rules(e, "linear", "linear_v", "linear_1"),  # Grok-1's
            *expert_rules(e, "w1", "w3", "w2"),  # Grok-2's
            *QKV_PROJ_RULES,
            (".mlp.gate_up_proj", ".mlp.gate_proj", 0),
            (".mlp.gate_up_proj", ".mlp.up_proj", 1),
        )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, V] fp32
        logits = soft_cap(super().compute_logits(hidden), self.final_cap)  # cap, then scale
        return logits * self.output_multiplier_scale

    def rename_weight(self, name: str) -> str:
        name = super().rename_weight(name)
        return name[: -len(".scale")] + ".weight" if name.endswith("norm.scale") else name

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True
    ) -> set[str]:
        config = self.config
        sizes = {"experts": config.moe_intermediate_size, "mlp": config.intermediate_size}
        return super().load_weights(join_tp_slices(weights, sizes), strict)


# the intermediate dimension of each split matrix: 0 for gate / up, 1 for down
_SLICE_DIMS = dict.fromkeys(("linear", "linear_v", "w1", "w3", "gate_proj", "up_proj"), 0)
_SLICE_DIMS.update(dict.fromkeys(("linear_1", "w2", "down_proj"), 1))


def join_tp_slices(
    weights: Iterable[tuple[str, torch.Tensor]], sizes: dict[str, int]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Grok-2's presharded checkpoint: an expert or dense-MLP matrix narrower than its
    intermediate size (`sizes`: "experts" / "mlp") arrives as slices under one name, one per
    TP file in rank order; each is held until the slices add up to the whole, then yielded
    concatenated. Any other tensor passes through. ValueError for slices left incomplete."""
    pending: dict[str, list[torch.Tensor]] = {}
    for name, w in weights:
        parts = name.split(".")
        dim = _SLICE_DIMS.get(parts[-2]) if len(parts) > 2 and parts[-1] == "weight" else None
        kind = "experts" if ".experts." in name else "mlp" if ".mlp." in name else None
        if dim is None or kind is None or w.dim() != 2 or w.shape[dim] == sizes[kind]:
            yield name, w
            continue
        held = pending.setdefault(name, [])
        held.append(w)
        have = sum(p.shape[dim] for p in held)
        if have > sizes[kind]:
            raise ValueError(f"{name}: TP slices add up to {have} > {sizes[kind]} (dim {dim})")
        if have == sizes[kind]:
            yield name, torch.cat(pending.pop(name), dim=dim)
    if pending:
        raise ValueError(f"incomplete TP slices in the checkpoint: {sorted(pending)[:4]}")
