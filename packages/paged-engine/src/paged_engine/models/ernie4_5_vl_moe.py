"""ERNIE 4.5 VL's language model (`Ernie4_5_VLMoeTextForCausalLM`, text_config
"ernie4_5_vl_moe_text" of Ernie4_5_VLMoeForConditionalGeneration: ERNIE-4.5-VL-28B-A3B,
424B-A47B): ERNIE 4.5's decoder (models/ernie4_5.py: interleaved rope, `use_bias`) whose sparse
layers hold two expert sets, one per modality, beside shared experts.

    layers   text_config.mlp_layer_types[i]: "dense" (gated SiLU MLP of intermediate_size) or
             "sparse" (below); HF's default: the first dense, the rest sparse
    sparse   text_moe: moe_num_experts experts of moe_intermediate_size[0]; vision_moe: as many
             of moe_intermediate_size[1]; each with ERNIE 4.5's float32 router (softmax, top
             moe_k by p + e_score_correction_bias, unbiased p renormalized; models/ernie4_5_moe.py)
             and shared experts of moe_num_shared_experts * moe_intermediate_size[0] for every
             token. A row goes to vision_moe when it is a prompt token whose id is an image /
             video placeholder or start / end marker (HF's processor's moe_mm_token_type_ids);
             every other row, generated tokens included (HF generate drops the ids after the
             prefill), to text_moe. The runner hands the rows over per step
             (`vision_token_ids` -> StepInputs.vision_rows, worker/step_inputs.py).
    rope     ERNIE's 3-D variant (HF's Ernie4_5_VLMoeTextRotaryEmbedding): with mrope_section
             (s, s, t) over the head_dim / 2 frequencies, frequency f < 2s turns by the height
             row when f is even and the width row when odd, f >= 2s by the temporal row; pairs
             rotate interleaved. Text tokens carry one position on all rows: ERNIE 4.5's rope.
             Positions: Qwen2-VL's table (multimodal/mrope.py, multimodal/ernie4_5_vl.py).

Checkpoint names: the Hub's (what transformers 5 saves): `mlp.gate.weight` [H, E] (text) and
`mlp.gate.weight_1` (vision), transposed into our routers; `mlp.moe_statics.
e_score_correction_bias` [2, E] (text row, vision row); `mlp.experts.j.*` with j < E text and
j >= E vision expert j - E. transformers 5's in-memory names (`mlp.text_moe.gate.weight` [E, H],
`mlp.*_moe.gate.moe_statics.*` [1, E], fused `mlp.*_moe.experts.gate_up_proj`) load too.
Tensor parallelism: DeepseekMoe's (one all-reduce for both sets and the shared experts).

Refused by name: a rope_type other than "default", mrope_section not (s, s, t) over
head_dim / 2, moe_intermediate_size not two sizes, moe_num_experts not one int, an
mlp_layer_types entry other than dense / sparse, hidden_act other than SiLU.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from torch import nn

from paged_engine.distributed.communication import tp_all_reduce
from paged_engine.layers.deepseek_moe import DeepseekMoe, SharedExpertsMLP
from paged_engine.layers.rotary import MRotaryEmbedding, rope_config
from paged_engine.models.ernie4_5 import ernie_layer_flags
from paged_engine.models.llama import LlamaForCausalLM, LlamaMLP, LlamaModel, llama_head_dim
from paged_engine.models.mixtral import MoeDecoderLayer, check_silu, expert_rules
from paged_engine.models.utils import CausalLMBase, cfg_get

# top-level config fields naming the tokens HF's processor routes to the vision experts
VISION_TOKEN_FIELDS = (
    "image_token_id",
    "image_start_token_id",
    "image_end_token_id",
    "video_token_id",
    "video_start_token_id",
    "video_end_token_id",
)

_HUB = "@hub"  # a Hub router name, renamed, before its transpose


class ErnieVLRotaryEmbedding(MRotaryEmbedding):
    """M-RoPE whose frequency f reads height (f < 2s, even), width (f < 2s, odd) or temporal
    (f >= 2s) positions; interleaved pairs (see the module docstring)."""

    def __init__(self, *args: Any, mrope_section: list[int], **kwargs: Any) -> None:
        super().__init__(*args, mrope_section=mrope_section, **kwargs)
        if mrope_section[0] != mrope_section[1]:
            raise ValueError(
                f"text_config.rope_parameters mrope_section={mrope_section}: its height and "
                "width sections must be equal (they interleave)"
            )
        f = torch.arange(self.rotary_dim // 2)
        spatial = f < 2 * mrope_section[0]
        rows = torch.where(spatial, 1 + f % 2, torch.zeros_like(f))  # 1 height, 2 width, 0 t
        self.section_row.copy_(rows)


def ernie_vl_rope(config: Any, head_dim: int) -> ErnieVLRotaryEmbedding:
    theta, scaling, partial = rope_config(config)
    kind = scaling and (scaling.get("rope_type") or scaling.get("type"))
    if kind not in (None, "default"):
        raise ValueError(f"text_config.rope_parameters.rope_type={kind!r}: only 'default'")
    params = getattr(config, "rope_parameters", None) or {}
    section = [int(n) for n in (params.get("mrope_section") or (22, 22, 20))]
    if partial != 1.0:
        raise ValueError(f"text_config partial_rotary_factor={partial}: only 1.0")
    return ErnieVLRotaryEmbedding(
        head_dim=head_dim,
        rotary_dim=head_dim,
        max_position=int(config.max_position_embeddings),
        base=theta,
        is_neox_style=False,
        mrope_section=section,
    )


class VisionRows:
    """The rows of one forward that go to the vision experts ([T] bool); None: all text.
    One instance shared by the model and its MoE blocks."""

    mask: torch.Tensor | None = None


class ErnieVLMoe(nn.Module):
    """HF's Ernie4_5_VLMoeMoeBlock: text_moe on text rows, vision_moe on vision rows, the
    shared experts on all; one all-reduce. [T, H] -> [T, H]."""

    def __init__(self, config: Any, routing: VisionRows) -> None:
        super().__init__()
        sizes = cfg_get(config, "moe_intermediate_size", None)
        if not isinstance(sizes, list | tuple) or len(sizes) != 2:
            raise ValueError(
                f"text_config.moe_intermediate_size={sizes!r}: two sizes (text, vision) expected"
            )
        experts, k = num_experts(config), int(config.moe_k)
        h = config.hidden_size

        def block(inter: int) -> DeepseekMoe:
            return DeepseekMoe(
                experts, k, h, int(inter), 0, sigmoid=False, correction_bias=True, renormalize=True
            )

        self.text_moe, self.vision_moe = block(sizes[0]), block(sizes[1])
        shared = int(cfg_get(config, "moe_num_shared_experts", 0) or 0)
        self.shared_experts = None
        if shared:
            bias = bool(getattr(config, "use_bias", False))
            self.shared_experts = SharedExpertsMLP(h, shared * int(sizes[0]), bias=bias)
        self.routing = routing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = self.routing.mask
        if mask is None:
            out = self.text_moe.partial_sum(x)
        else:  # (both sets see only their rows: the routers' top-k is per row anyway)
            out = torch.empty_like(x)
            text = ~mask
            out[text] = self.text_moe.partial_sum(x[text])
            out[mask] = self.vision_moe.partial_sum(x[mask])
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return tp_all_reduce(out) if self.text_moe.experts.tp_size > 1 else out


def num_experts(config: Any) -> int:
    """Experts a set (text and vision have as many)."""
    value = getattr(config, "moe_num_experts", None)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"text_config.moe_num_experts={value!r}: one positive int (each expert set's size)"
        )
    return value


def _layer_types(config: Any) -> list[str]:
    types = cfg_get(config, "mlp_layer_types", None)
    if types is None:
        types = ["dense"] + ["sparse"] * (config.num_hidden_layers - 1)
    types = list(types)
    bad = [t for t in types if t not in ("dense", "sparse")]
    if bad or len(types) != config.num_hidden_layers:
        raise ValueError(
            f"text_config.mlp_layer_types={types!r}: one 'dense' or 'sparse' per layer expected"
        )
    return types


class Ernie4_5_VLMoeTextForCausalLM(CausalLMBase):
    tie_default = True  # HF ties the embeddings unless told otherwise
    stacked_params = LlamaForCausalLM.stacked_params
    ignored_weights = ("rotary_emb.inv_freq",)

    def __init__(self, config: Any) -> None:
        check_silu(config, type(self).__name__)
        flags = ernie_layer_flags(config)
        types = _layer_types(config)
        routing = VisionRows()
        rope = ernie_vl_rope(config, llama_head_dim(config))

        def build_layer(i: int, _plain: Any) -> nn.Module:
            if types[i] == "sparse":
                mlp: nn.Module = ErnieVLMoe(config, routing)
            else:
                mlp = LlamaMLP(config, bias=flags["mlp_bias"])
            return MoeDecoderLayer(config, i, flags, rope, mlp)

        inner = LlamaModel(config, flags, build_layer, is_neox_style=False)
        inner.rotary_emb = rope  # the layers' rope (LlamaModel built a plain one)
        super().__init__(config, inner)
        self.routing = routing
        ids = [getattr(config, f, None) for f in VISION_TOKEN_FIELDS]
        # prompt tokens of these ids go to the vision experts (worker/step_inputs.py)
        self.vision_token_ids = np.array(sorted({int(i) for i in ids if i is not None}))
        self.vision_rows: torch.Tensor | None = None  # set by the runner for one forward
        experts = self.num_experts = num_experts(config)
        rules = expert_rules(experts, "gate_proj", "up_proj", "down_proj")
        self.stacked_params = (*rules, *type(self).stacked_params)

    def forward(self, input_ids, positions, kv_caches, attn_metadata, hidden=None) -> torch.Tensor:
        self.routing.mask = self.vision_rows
        try:
            return super().forward(input_ids, positions, kv_caches, attn_metadata, hidden)
        finally:
            self.routing.mask = None

    def rename_weight(self, name: str) -> str:
        # the Hub's routers are [H, E]: marked for convert_weight to transpose
        name = name.replace(".mlp.gate.weight_1", ".mlp.vision_moe.gate.weight" + _HUB)
        if name.endswith(".mlp.gate.weight"):
            name = name.replace(".mlp.gate.weight", ".mlp.text_moe.gate.weight" + _HUB)
        name = name.replace("_moe.gate.moe_statics.", "_moe.gate.")
        head, sep, tail = name.partition(".mlp.experts.")
        if sep:  # the Hub's one list: text experts 0 .. E-1, then vision ones E .. 2E-1
            index, rest = tail.split(".", 1)
            j, e = int(index), self.num_experts
            which = "text" if j < e else "vision"
            name = f"{head}.mlp.{which}_moe.experts.{j % e}.{rest}"
        return name

    def convert_weight(self, name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if name.endswith(".mlp.moe_statics.e_score_correction_bias"):  # [2, E]: text, vision
            base = name.removesuffix("moe_statics.e_score_correction_bias")
            yield base + "text_moe.gate.e_score_correction_bias", w[0]
            yield base + "vision_moe.gate.e_score_correction_bias", w[1]
            return
        if name.endswith("_moe.gate.e_score_correction_bias"):
            w = w.reshape(-1)  # [1, E] -> [E]
        elif name.endswith(_HUB):
            name, w = name.removesuffix(_HUB), w.T  # the Hub's [H, E]
        yield name, w
