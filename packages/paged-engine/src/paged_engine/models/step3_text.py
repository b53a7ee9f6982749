"""StepFun Step3's language model (`Step3TextForCausalLM`, remote code, model_type "step3_text";
the text part of `Step3VLForConditionalGeneration`, stepfun-ai/step3), as vLLM's step3_text.py
computes it. transformers has no class for it (its `step3p7` is Step 3.5 / 3.7 Flash, another
design: models/step3p7.py).

A pre-norm decoder (RMSNorm, x += attn(norm(x)); x += mlp(norm(x))) whose attention is Step3's
"MFA": one shared low-rank query and a single KV head.

    attention  [q | k | v] = qkv(x), q of share_q_dim, k and v of head_dim (one KV head);
               q = wq(inter_norm(q)) -> num_attention_heads heads of head_dim; NeoX RoPE
               (rope_theta) over the whole head on q and k; scores scaled by head_dim^-0.5;
               o_proj back to hidden_size
    mlp        layers listed in `moe_layers_enum`: softmax over moe_num_experts router logits,
               the top moe_top_k (renormalized when norm_expert_weight), experts of
               moe_intermediate_size, plus an ungated shared expert of share_expert_dim;
               every other layer: a gated SiLU MLP of intermediate_size

Checkpoint names are the release's: `self_attn.{q,k,v}_proj` (fused here into a replicated
`qkv_proj`), `self_attn.inter_norm`, `self_attn.wq`, `self_attn.o_proj`, `moe.gate.weight`
[E, H], the experts stacked per layer `moe.{gate,up,down}_proj.weight` [E, I, H] / [E, H, I],
`share_expert.{gate,up,down}_proj`, dense `mlp.*`; the head is never tied (vLLM loads
`lm_head.weight` whatever the config says). The VL release keeps these names at the top level
(`model.`, `lm_head.`) beside `vision_model.` / `vit_downsampler*.` / `vit_large_projector.`,
which its text-wrappers row drops (models/text_wrappers.py; its images: multimodal/step3_vl.py,
config models/step3_vl_config.py).

Tensor parallelism: the query's low-rank part and the KV head are replicated (as vLLM's
ReplicatedLinear); `wq` splits the heads, `o_proj` reduces.
config.json is translated by `step3_text_config` (models/remote_aliases.py names it); fields
with no tested path are refused by name (num_attention_groups != 1, rope_scaling,
quantization_config, hidden_act other than SiLU).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from paged_engine.layers.attention import Attention, AttentionMetadata
from paged_engine.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from paged_engine.layers.norm import RMSNorm
from paged_engine.layers.rotary import RotaryEmbedding
from paged_engine.models.llama import LlamaMLP, LlamaModel
from paged_engine.models.mixtral import MoeDecoderLayer, expert_rules
from paged_engine.models.qwen2_moe import SharedExpertMoeBlock
from paged_engine.models.remote_aliases import common_fields, field, refuse_unless
from paged_engine.models.utils import CausalLMBase

_ARCH = "Step3TextForCausalLM"
# the release's MoE names -> ours (SharedExpertMoeBlock's `gate` / `shared_expert` under `mlp`)
_RENAMES = ((".moe.gate.weight", ".mlp.gate.weight"), (".share_expert.", ".mlp.shared_expert."))
# the release's per-layer expert stacks -> each expert's HF-style matrix
_STACKS = {
    ".moe.gate_proj.weight": "gate_proj",
    ".moe.up_proj.weight": "up_proj",
    ".moe.down_proj.weight": "down_proj",
}


def moe_layers(config) -> frozenset[int]:
    """The MoE layer indices of `moe_layers_enum` ("4,5,6" as the release writes it, or a list)."""
    raw = config.moe_layers_enum
    try:
        items = raw.strip().split(",") if isinstance(raw, str) else list(raw)
        layers = frozenset(int(i) for i in items)
    except (TypeError, ValueError):
        raise ValueError(f"moe_layers_enum={raw!r} must list layer indices") from None
    bad = sorted(i for i in layers if not 0 <= i < int(config.num_hidden_layers))
    if bad:
        raise ValueError(
            f"moe_layers_enum names layers {bad} outside 0..{int(config.num_hidden_layers) - 1}"
        )
    return layers


class Step3TextAttention(nn.Module):
    """MFA (module docstring): a replicated [q_low | k | v] projection, the query expanded per
    head through inter_norm and wq, one KV head. [T, D] -> [T, D]."""

    def __init__(self, config, rope: RotaryEmbedding) -> None:
        super().__init__()
        hidden, head_dim = int(config.hidden_size), int(config.head_dim)
        heads, self.share_q = int(config.num_attention_heads), int(config.share_q_dim)
        self.head_dim = head_dim
        sizes = [self.share_q, head_dim, head_dim]
        # replicated on every tensor-parallel rank (tp_size=1: no split)
        self.qkv_proj = MergedColumnParallelLinear(hidden, sizes, False, tp_rank=0, tp_size=1)
        self.inter_norm = RMSNorm(self.share_q, float(config.rms_norm_eps))
        self.wq = ColumnParallelLinear(self.share_q, heads * head_dim, bias=False)
        self.o_proj = RowParallelLinear(heads * head_dim, hidden, bias=False)
        self.rotary_emb = rope  # the model's shared instance
        self.attn = Attention(self.wq.out_local // head_dim, head_dim, 1, head_dim**-0.5)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,  # [T, D]
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        md: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.share_q, self.head_dim, self.head_dim], dim=-1)
        q = self.wq(self.inter_norm(q.contiguous()))  # [T, local heads * head_dim]
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, md))


class Step3TextForCausalLM(CausalLMBase):
    ties_head = False  # vLLM's Step3 never ties its head
    # the release's q / k / v into qkv_proj's segments; a dense MLP's gate / up
    stacked_params = (
        (".qkv_proj", ".q_proj", 0),
        (".qkv_proj", ".k_proj", 1),
        (".qkv_proj", ".v_proj", 2),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    )
    renames = _RENAMES
    ignored_weights = ("rotary_emb.inv_freq",)

    def __init__(self, config) -> None:
        act = getattr(config, "hidden_act", None) or "silu"
        if act not in ("silu", "swish"):
            raise ValueError(f"{type(self).__name__} supports hidden_act='silu' only, got {act!r}")
        if int(getattr(config, "num_key_value_heads", None) or 1) != 1:
            raise ValueError("Step3's attention has one KV head (num_attention_groups must be 1)")
        sparse = moe_layers(config)

        def build_layer(i: int, rope: RotaryEmbedding) -> nn.Module:
            mlp = self.moe_block(config) if i in sparse else LlamaMLP(config, bias=False)
            return MoeDecoderLayer(config, i, {}, rope, mlp, Step3TextAttention(config, rope))

        super().__init__(config, LlamaModel(config, {}, build_layer))
        # expert rules first: a dense ".gate_proj" would also match an expert's name
        rules = expert_rules(int(config.moe_num_experts), "gate_proj", "up_proj", "down_proj")
        self.stacked_params = (*rules, *type(self).stacked_params)

    @staticmethod
    def moe_block(config) -> SharedExpertMoeBlock:
        return SharedExpertMoeBlock(
            int(config.moe_num_experts),
            int(config.moe_top_k),
            int(config.hidden_size),
            int(config.moe_intermediate_size),
            int(config.share_expert_dim),
            renormalize=bool(config.norm_expert_weight),
            gated=False,
        )

    def convert_weight(self, name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """A release expert stack [E, ...] -> `mlp.experts.M.<matrix>.weight` per expert."""
        for suffix, matrix in _STACKS.items():
            if name.endswith(suffix):
                base = name[: -len(suffix)] + ".mlp.experts"
                return ((f"{base}.{m}.{matrix}.weight", w[m]) for m in range(w.shape[0]))
        return ((name, w),)


def step3_text_config(raw: dict[str, Any]) -> PretrainedConfig:
    """Step3's config.json (flat, or the VL release's `text_config`) under the names our class
    reads, with vLLM's Step3TextConfig defaults."""
    arch = next((a for a in raw.get("architectures") or () if a.startswith("Step3")), _ARCH)
    text = raw
    if arch == "Step3VLForConditionalGeneration":
        text = field(raw, "text_config", dict)
    for name in ("rope_scaling", "quantization_config"):
        refuse_unless(text, arch, name, (None,))
        refuse_unless(raw, arch, name, (None,))
    refuse_unless(text, arch, "num_attention_groups", (None, 1))
    refuse_unless(text, arch, "hidden_act", (None, "silu"))
    if "moe_layers_enum" not in text:  # vLLM's code cannot read its config class's default
        raise ValueError(f"{arch}: config.json field 'moe_layers_enum' is required")
    head_dim = field(text, "head_dim", int, 256)
    max_positions = field(text, "max_position_embedding", int, 65536)
    # null: no low-rank query (vLLM's q_size falls back to head_dim); absent: 2048
    null = "share_q_dim" in text and text["share_q_dim"] is None
    share_q = head_dim if null else field(text, "share_q_dim", int, 2048)
    fields = {
        **common_fields(raw),
        "vocab_size": field(text, "vocab_size", int, 128815),
        "hidden_size": field(text, "hidden_size", int, 7168),
        "intermediate_size": field(text, "intermediate_size", int, 18432),
        "num_hidden_layers": field(text, "num_hidden_layers", int, 61),
        "num_attention_heads": field(text, "num_attention_heads", int, 64),
        "num_key_value_heads": 1,
        "head_dim": head_dim,
        # null: the query is not low-rank (vLLM's q_size falls back to head_dim)
        "share_q_dim": share_q,
        "rms_norm_eps": field(text, "rms_norm_eps", float, 1e-5),
        "max_position_embeddings": max_positions,
        "rope_theta": field(text, "rope_theta", float, 500000.0),
        "hidden_act": "silu",
        "moe_num_experts": field(text, "moe_num_experts", int, 48),
        "moe_top_k": field(text, "moe_top_k", int, 3),
        "moe_intermediate_size": field(text, "moe_intermediate_size", int, 5120),
        "share_expert_dim": field(text, "share_expert_dim", int, 5120),
        "norm_expert_weight": field(text, "norm_expert_weight", bool, False),
        "moe_layers_enum": text["moe_layers_enum"],
        "tie_word_embeddings": False,
    }
    config = PretrainedConfig(**fields)
    config.model_type = "step3_text"
    moe_layers(config)  # a bad list fails here, naming the field
    if not 1 <= config.moe_top_k <= config.moe_num_experts:
        raise ValueError(
            f"{arch}: config.json field moe_top_k={config.moe_top_k} must be between 1 and "
            f"moe_num_experts={config.moe_num_experts}"
        )
    return config
