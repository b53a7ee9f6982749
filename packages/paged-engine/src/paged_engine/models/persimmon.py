"""Persimmon (`PersimmonForCausalLM`: Adept Persimmon-8B base / chat).

Phi's attention (models/phi.py: biased q / k / v and output projection `dense`, partial NeoX RoPE,
half of each head by default, and with `qk_layernorm`, the default, one LayerNorm with weight and
bias shared by all q heads and one by all k heads, applied per head before RoPE) in a sequential
pre-LayerNorm layer as transformers runs it: x += attn(ln1(x)); x += mlp(ln2(x)) (StarCoder2's
layer, models/starcoder2.py). The MLP is the non-gated dense_4h_to_h(relu2(dense_h_to_4h(x))) with
biases (relu(x)^2, the config's `hidden_act`); a final LayerNorm (`final_layernorm`); an untied LM
head without bias by default.

HF's fused `query_key_value` interleaves per head like GPT-NeoX's (rows [H, q|k|v, D]); it is split
at load into q / k / v rows of our QKV projection. All heads attend (no grouped-query attention).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from paged_engine.models.bloom import per_head_qkv
from paged_engine.models.phi import PhiForCausalLM, phi_model
from paged_engine.models.utils import QKV_PROJ_RULES, CausalLMBase, cfg_get


class PersimmonForCausalLM(CausalLMBase):
    # Phi's names but for the MLP's (HF's fragment, ours)
    renames = (
        (".mlp.dense_h_to_4h.", ".mlp.c_fc."),
        (".mlp.dense_4h_to_h.", ".mlp.c_proj."),
        *PhiForCausalLM.renames,
    )
    stacked_params = QKV_PROJ_RULES
    ignored_weights = ("rotary_emb.inv_freq",)

    def __init__(self, config):
        heads = config.num_attention_heads
        kv_heads = cfg_get(config, "num_key_value_heads", heads)
        if kv_heads != heads:  # HF's fused projection holds as many k / v heads as q heads
            raise ValueError(
                f"PersimmonForCausalLM needs num_key_value_heads == num_attention_heads "
                f"({heads}), got {kv_heads}"
            )
        # Phi's stack, its layers sequential; c_fc / c_proj are HF's dense_h_to_4h / 4h_to_h
        super().__init__(config, phi_model(config, qk_layernorm=True, parallel=False))

    def convert_weight(self, name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """`query_key_value` rows [H, q|k|v, D] (weight or bias) -> q_proj / k_proj / v_proj."""
        if ".query_key_value." not in name:
            yield name, w
            return
        q, k, v = per_head_qkv(w, self.config.num_attention_heads)
        for shard, part in zip("qkv", (q, k, v), strict=True):
            yield name.replace(".query_key_value.", f".{shard}_proj."), part
