"""Databricks DBRX (`DbrxForCausalLM`: dbrx-base / dbrx-instruct, 132B total, 36B active).

A pre-norm decoder, x += attn(ln1(x)); x += moe(ln2(x)), with LayerNorms without a bias (eps
1e-5, the final norm too) and:

    attention  one fused projection `Wqkv` [q: H*D | k: Hkv*D | v: Hkv*D], every entry clamped
               to [-clip_qkv, clip_qkv] (attn_config.clip_qkv; 8 in the released models) before
               RoPE (full, NeoX style); GQA with attn_config.kv_n_heads; no biases
    moe        every layer: softmax over ffn_config.moe_num_experts router logits, the top
               moe_top_k, divided by their p-norm with p = moe_normalize_expert_weights (1: a
               renormalization to sum 1; None: kept as they are); gated experts
               w2^T(act(w1 x) * v1 x) of ffn_hidden_size (act: ffn_act_fn, SiLU)

The released configs keep the rope base in attn_config.rope_theta (500000), which transformers
5 does not read (its DBRX config falls back to a 10000 `rope_parameters` default); it is used
here when present, as the model was trained.

Checkpoint names are DBRX's own: `transformer.wte`, `transformer.blocks.N.norm_attn_norm.
{norm_1, attn.Wqkv, attn.out_proj, norm_2}`, `transformer.blocks.N.ffn.router.layer`,
`transformer.norm_f`, `lm_head`, and the experts stacked per matrix as
`ffn.experts.mlp.{w1, v1, w2}` [E * I, H] each (w2 too: expert e's down projection is its
[I, H] rows transposed). They are renamed to the Llama stack's names and the stacked experts
split per expert into FusedMoE's loaders (Mixtral's rules); the head is never tied.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from paged_engine.layers.fused_moe import SparseMoeBlock
from paged_engine.layers.norm import LayerNorm
from paged_engine.layers.rotary import RotaryEmbedding, plain_rope, rope_config
from paged_engine.models.llama import LlamaAttention, llama_head_dim
from paged_engine.models.mixtral import expert_rules
from paged_engine.models.phi3 import Phi3ForCausalLM
from paged_engine.models.starcoder2 import LayerNormDecoderLayer, LayerNormLlamaModel
from paged_engine.models.utils import QKV_PROJ_RULES, CausalLMBase, sub_cfg_get

_EPS = 1e-5  # nn.LayerNorm's default, which DBRX's norms keep

# checkpoint name fragment -> ours
_RENAMES = (
    ("transformer.wte.", "model.embed_tokens."),
    ("transformer.norm_f.", "model.norm."),
    ("transformer.blocks.", "model.layers."),
    (".norm_attn_norm.norm_1.", ".input_layernorm."),
    (".norm_attn_norm.norm_2.", ".post_attention_layernorm."),
    (".norm_attn_norm.attn.Wqkv.", ".self_attn.qkv_proj."),
    (".norm_attn_norm.attn.out_proj.", ".self_attn.o_proj."),
    (".ffn.router.layer.", ".mlp.gate."),
    (".ffn.experts.mlp.", ".mlp.experts."),
)


_NO_BIAS = {"qkv_bias": False, "o_bias": False, "qk_norm": False, "sliding": False}


class ClipQKVAttention(LlamaAttention):
    """Llama's attention clamping q / k / v to +-clip before RoPE (DBRX, OLMo; before ALiBi,
    MPT; clip None: Llama's)."""

    def __init__(
        self, config, layer_idx: int, flags: dict, rope: RotaryEmbedding, clip: float | None
    ) -> None:
        super().__init__(config, layer_idx, flags, rope)
        self.clip = None if clip is None else float(clip)

    def forward(self, positions, x, kv_cache, md) -> torch.Tensor:  # x: [T, D]
        if self.clip is None:
            return super().forward(positions, x, kv_cache, md)
        qkv = self.qkv_proj(x).clamp(-self.clip, self.clip)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, md))


class DbrxMoe(SparseMoeBlock):
    """SparseMoeBlock routing as DBRX does: the top-k softmax weights divided by their p-norm
    (`p` None: left as they are)."""

    def __init__(self, config) -> None:
        super().__init__(
            int(sub_cfg_get(config, "ffn_config", "moe_num_experts")),
            int(sub_cfg_get(config, "ffn_config", "moe_top_k")),
            config.hidden_size,
            int(sub_cfg_get(config, "ffn_config", "ffn_hidden_size")),
            renormalize=False,
        )
        p = sub_cfg_get(config, "ffn_config", "moe_normalize_expert_weights")
        self.p = None if p is None else float(p)

    def select_experts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.p is not None:
            weights = weights / torch.norm(weights, p=self.p, dim=-1, keepdim=True)
        return weights, ids


class DbrxForCausalLM(CausalLMBase):
    renames = _RENAMES
    ignored_weights = ("rotary_emb.inv_freq",)

    def __init__(self, config) -> None:
        act = sub_cfg_get(config, "ffn_config", "ffn_act_fn", {}) or {}
        act = act.get("name", "silu") if isinstance(act, dict) else act
        if act not in ("silu", "swish"):
            raise ValueError(f"DbrxForCausalLM supports ffn_act_fn silu only, got {act!r}")
        if getattr(config, "tie_word_embeddings", False):
            raise ValueError("DBRX does not tie its head (config.tie_word_embeddings=True)")
        d = config.hidden_size
        head_dim = llama_head_dim(config)
        theta = sub_cfg_get(config, "attn_config", "rope_theta")
        if theta is None:
            theta = rope_config(config)[0]
        rope = plain_rope(head_dim, head_dim, int(config.max_position_embeddings), theta)

        clip = sub_cfg_get(config, "attn_config", "clip_qkv")

        def build(i: int, _: RotaryEmbedding) -> nn.Module:
            attn = ClipQKVAttention(config, i, _NO_BIAS, rope, clip)
            layer = LayerNormDecoderLayer(d, _EPS, attn, DbrxMoe(config), parallel=False)
            layer.input_layernorm = LayerNorm(d, eps=_EPS, bias=False)
            layer.post_attention_layernorm = LayerNorm(d, eps=_EPS, bias=False)
            return layer

        inner = LayerNormLlamaModel(config, _EPS, build)
        inner.rotary_emb = rope  # the layers' rope (attn_config's base), set up per forward
        inner.norm = LayerNorm(d, eps=_EPS, bias=False)
        super().__init__(config, inner)
        self.num_experts = int(sub_cfg_get(config, "ffn_config", "moe_num_experts"))
        rules = expert_rules(self.num_experts, "w1", "v1", "w2")
        self.stacked_params = (*rules, *QKV_PROJ_RULES)

    def convert_weight(self, name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if ".qkv_proj." in name:  # Wqkv rows [q | k | v]: split like Phi-3's qkv_proj
            yield from Phi3ForCausalLM.convert_weight(self, name, w)
            return
        base, _, matrix = name.rpartition(".experts.")
        if not base or matrix not in ("w1", "v1", "w2"):
            yield name, w
            return
        e = self.num_experts
        if w.dim() != 2 or w.shape[0] % e:
            raise ValueError(f"{name}: {tuple(w.shape)} is not {e} experts' stacked rows")
        per_expert = w.view(e, w.shape[0] // e, w.shape[1])  # [E, I, H]
        for m in range(e):
            part = per_expert[m].t() if matrix == "w2" else per_expert[m]  # down: [H, I]
            yield f"{base}.experts.{m}.{matrix}.weight", part
