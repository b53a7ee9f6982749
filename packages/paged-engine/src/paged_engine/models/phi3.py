"""Phi-3 / Phi-3.5 / Phi-4-mini (`Phi3ForCausalLM`).

The Llama decoder (models/llama.py); the checkpoint fuses q | k | v into `qkv_proj` and
gate | up into `gate_up_proj`, which are split here into the pieces our tensor-parallel layers
shard. Partial rotary (Phi-4-mini rotates 3/4 of each head), longrope scaling and the sliding
window come from the config through layers/rotary.py and `layer_sliding_window`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from paged_engine.models.llama import LlamaForCausalLM, llama_head_dim
from paged_engine.models.utils import cfg_get


class Phi3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def layer_flags(cls, config) -> dict[str, bool]:
        """Llama's, with the sliding window; no biases (config_ignored.py sets attention_bias
        / mlp_bias, which HF's Phi-3 never reads)."""
        return {**super().layer_flags(config), "sliding": True}

    def convert_weight(self, name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if ".qkv_proj." in name:  # rows [q: H*D | k: Hkv*D | v: Hkv*D]
            cfg = self.config
            d = llama_head_dim(cfg)
            q = cfg.num_attention_heads * d
            kv = cfg_get(cfg, "num_key_value_heads", cfg.num_attention_heads) * d
            if w.shape[0] != q + 2 * kv:
                raise ValueError(f"{name}: {w.shape[0]} rows, expected q {q} + k, v {kv} each")
            parts = w.split([q, kv, kv], dim=0)
            for piece, part in zip(("q_proj", "k_proj", "v_proj"), parts, strict=True):
                yield name.replace(".qkv_proj.", f".{piece}."), part
        elif ".gate_up_proj." in name:  # rows [gate: I | up: I]
            gate, up = w.chunk(2, dim=0)
            yield name.replace(".gate_up_proj.", ".gate_proj."), gate
            yield name.replace(".gate_up_proj.", ".up_proj."), up
        else:
            yield name, w
