"""MolmoE-1B's text decoder (`MolmoForCausalLM` with block_type "moe", remote code:
allenai/MolmoE-1B-0924), served inside the Molmo v1 wrapper (models/text_wrappers.py; config:
models/molmoe_config.py; images: multimodal/molmo_v1.py, as Molmo v1's).

The decoder is OLMoE's (models/olmoe.py: pre-norm layers, q / k RMS-normed over the whole
projection, a softmax top-k MoE of gated SiLU experts in every layer) under the release's
OLMo / megablocks names, with Molmo v1's wider token table (the 128 image ids past the head's
rows, their logits -inf: models/molmo2.py's MolmoTableMixin, shared):

    model.transformer.blocks.N.att_proj (q | k | v stacked)     -> self_attn.q / k / v_proj
    .attn_out -> self_attn.o_proj     .q_norm / .k_norm -> self_attn.q_norm / k_norm
    .attn_norm / .ff_norm -> input_layernorm / post_attention_layernorm
    .ffn.router.layer -> mlp.gate (the router, [E, D])
    .ffn.experts.mlp.w1 / .v1 [E*I, D] (expert m's gate / up: rows [m*I, (m+1)*I))
                                     -> mlp.experts.m.gate_proj / up_proj
    .ffn.experts.mlp.w2 [E*I, D] (expert m's down, transposed)  -> mlp.experts.m.down_proj
    model.transformer.wte.embedding, then new_embedding -> model.embed_tokens (stacked)
    model.transformer.ln_f -> model.norm      model.transformer.ff_out -> lm_head

Per-expert names (`mlp.experts.m.{gate,up,down}_proj`, `mlp.gate`: transformers' OLMoE
layout under the same blocks) load too, through OLMoE's expert rules.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from paged_engine.models.molmo2 import MolmoTableMixin
from paged_engine.models.olmoe import OlmoeForCausalLM
from paged_engine.models.utils import CausalLMBase

_EXPERTS = ".ffn.experts.mlp."
# megablocks' matrix -> (our per-expert name, transposed in the checkpoint)
_EXPERT_MATS = {"w1": ("gate_proj", False), "v1": ("up_proj", False), "w2": ("down_proj", True)}


class MolmoeTextForCausalLM(MolmoTableMixin, OlmoeForCausalLM):
    renames = (
        ("model.transformer.ff_out.", "lm_head."),
        ("model.transformer.blocks.", "model.layers."),
        ("model.transformer.ln_f.", "model.norm."),
        (".att_proj.", ".self_attn.att_proj."),
        (".attn_out.", ".self_attn.o_proj."),
        (".q_norm.", ".self_attn.q_norm."),
        (".k_norm.", ".self_attn.k_norm."),
        (".attn_norm.", ".input_layernorm."),
        (".ff_norm.", ".post_attention_layernorm."),
        (".ffn.router.layer.", ".mlp.gate."),
    )

    def __init__(self, config) -> None:
        super().__init__(config)
        self._init_table(config)

    def rename_weight(self, name: str) -> str:  # our renames, not Mixtral's
        return CausalLMBase.rename_weight(self, name)

    def convert_weight(self, name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """The two table parts stacked, att_proj split into q / k / v, megablocks' expert
        matrices split per expert."""
        done = self._table_or_qkv(name, w)
        if done is not None:
            return done
        if _EXPERTS in name:
            return self._split_experts(name, w)
        return ((name, w),)

    def _split_experts(self, name: str, w: torch.Tensor) -> tuple[tuple[str, torch.Tensor], ...]:
        """`...ffn.experts.mlp.{w1,v1,w2}` [E*I, D] -> each expert's HF matrix."""
        base, mat = name.split(_EXPERTS)
        mat = mat.removesuffix(".weight")
        if mat not in _EXPERT_MATS:
            return ((name, w),)  # not an expert matrix: reported as unexpected
        ours, transposed = _EXPERT_MATS[mat]
        count, inner = int(self.config.num_experts), int(self.config.intermediate_size)
        if w.dim() != 2 or w.shape[0] != count * inner:
            raise ValueError(
                f"{name}: shape {tuple(w.shape)} is not [moe_num_experts * expert width "
                f"({count} * {inner}), d_model]"
            )
        rows = w.reshape(count, inner, -1)
        return tuple(
            (f"{base}.mlp.experts.{m}.{ours}.weight", rows[m].t() if transposed else rows[m])
            for m in range(count)
        )
