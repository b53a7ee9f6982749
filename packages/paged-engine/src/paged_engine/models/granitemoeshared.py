"""IBM Granite MoE with a shared MLP (`GraniteMoeSharedForCausalLM`, e.g. PowerMoE / granite
MoE variants with `shared_intermediate_size` > 0): GraniteMoe (models/granitemoe.py) whose MoE
layers add an ungated dense MLP every token goes through.

    mlp(x) = experts(x) + shared_mlp(x)      (then times residual_multiplier, as in GraniteMoe)

`shared_mlp` is a gated SiLU MLP of `shared_intermediate_size`; 0 means none (plain GraniteMoe).
Its checkpoint fuses gate | up rows in `shared_mlp.input_linear.weight` [2S, H] (split here into
the gate and up pieces our merged projection shards) beside `shared_mlp.output_linear.weight`
[H, S]; it loads as the block's `shared_expert` (Qwen2-MoE's SharedExpertMoeBlock, ungated).
Tensor parallelism splits it like a dense MLP; its partial sum joins the experts' before the
block's single all-reduce.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from paged_engine.models.granitemoe import GraniteMoeForCausalLM
from paged_engine.models.mixtral import num_experts
from paged_engine.models.qwen2_moe import SharedExpertMoeBlock
from paged_engine.models.utils import cfg_get


class GraniteMoeSharedForCausalLM(GraniteMoeForCausalLM):
    @classmethod
    def build_mlp(cls, config) -> nn.Module:
        shared = int(cfg_get(config, "shared_intermediate_size", 0))
        if not shared:
            return super().build_mlp(config)
        return SharedExpertMoeBlock(
            num_experts(config),
            config.num_experts_per_tok,
            config.hidden_size,
            config.intermediate_size,
            shared,
            renormalize=True,
            gated=False,
        )

    def rename_weight(self, name: str) -> str:
        return rename_shared_mlp(name) or super().rename_weight(name)

    def convert_weight(self, name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        return split_shared_input_linear(name, w)


def rename_shared_mlp(name: str) -> str | None:
    """A checkpoint's `shared_mlp.*` name -> the block's `mlp.shared_expert.*` (else None)."""
    if ".shared_mlp." not in name:
        return None
    name = name.replace(".shared_mlp.", ".mlp.shared_expert.")
    return name.replace(".output_linear.", ".down_proj.")


def split_shared_input_linear(name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
    """The shared MLP's fused input_linear (rows [gate: S | up: S]) as gate and up."""
    if ".shared_expert.input_linear." in name:
        gate, up = w.chunk(2, dim=0)
        yield name.replace(".input_linear.", ".gate_proj."), gate
        yield name.replace(".input_linear.", ".up_proj."), up
    else:
        yield name, w
