"""InternLM2 with visual experts (`InternLM2VEForCausalLM`, the LLM of Mono-InternVL's remote
InternVLChatModel; vLLM's internlm2_ve.py): InternLM2 (models/llama_variants.py) whose every
layer holds a second feed-forward, `feed_forward_ve` (w1 / w3 / w2 like `feed_forward`, the
same sizes), that replaces `feed_forward` on image rows. Attention, norms, embedding and head
are shared by both modalities.

    row routing   a prompt token whose id is the image context token (<IMG_CONTEXT>,
                  config `visual_token_id`: multimodal/internvl_chat.py sets it from the
                  tokenizer) goes through feed_forward_ve in every layer, every other row
                  (text, <img> / </img>, generated tokens) through feed_forward. vLLM's mask is
                  input_ids == img_context_token_id on the step's tokens; the remote model's
                  is the same on its one-shot prefill (its cached decode steps run
                  feed_forward alone). The runner hands the rows over per step
                  (`vision_token_ids` -> StepInputs.vision_rows, worker/step_inputs.py).
                  By id alone: a prompt's <IMG_CONTEXT> that no image fills (written in the
                  text or given as ids) takes the experts too, as vLLM's mask over a step
                  that holds an image does.

Weights: `feed_forward_ve.w1 / w3 / w2` -> `mlp.visual.gate_proj / up_proj / down_proj`
(gate and up stacked into `gate_up_proj`, as the text MLP's); InternLM2's names otherwise.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from paged_engine.models.llama import LlamaDecoderLayer, LlamaMLP, LlamaModel
from paged_engine.models.llama_variants import InternLM2ForCausalLM
from paged_engine.models.utils import CausalLMBase


class VisualRows:
    """One forward's image rows and text rows ([n] int64 indices each); None: all text. Shared
    by the model and its layers' MLPs."""

    visual: torch.Tensor | None = None
    text: torch.Tensor | None = None


class VisualExpertMLP(LlamaMLP):
    """InternLM2's feed_forward (this module's own weights) on text rows, `visual`
    (feed_forward_ve) on image rows. [T, D] -> [T, D]."""

    def __init__(self, config: Any, bias: bool, rows: VisualRows) -> None:
        super().__init__(config, bias)
        self.visual = LlamaMLP(config, bias)
        self.rows = rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        visual, text = self.rows.visual, self.rows.text
        if visual is None or text is None:
            return super().forward(x)
        out = torch.empty_like(x)
        out.index_copy_(0, visual, self.visual(x.index_select(0, visual)))
        out.index_copy_(0, text, super().forward(x.index_select(0, text)))
        return out


class InternLM2VEForCausalLM(InternLM2ForCausalLM):
    renames = (
        *InternLM2ForCausalLM.renames,
        (".feed_forward_ve.w1.", ".mlp.visual.gate_proj."),
        (".feed_forward_ve.w3.", ".mlp.visual.up_proj."),
        (".feed_forward_ve.w2.", ".mlp.visual.down_proj."),
    )

    def __init__(self, config: Any) -> None:
        token = getattr(config, "visual_token_id", None)
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(
                f"visual_token_id={token!r}: InternLM2VEForCausalLM needs the image context "
                "token's id (set from the tokenizer's <IMG_CONTEXT> for InternVLChatModel)"
            )
        flags = self.layer_flags(config)
        rows = VisualRows()

        def build_layer(i: int, rope: Any) -> LlamaDecoderLayer:
            layer = LlamaDecoderLayer(config, i, flags, rope)
            layer.mlp = VisualExpertMLP(config, flags["mlp_bias"], rows)
            return layer

        CausalLMBase.__init__(self, config, LlamaModel(config, flags, build_layer))
        self.rows = rows
        # prompt tokens of this id take the visual experts (worker/step_inputs.py)
        self.vision_token_ids = np.array([token])
        self.vision_rows: torch.Tensor | None = None  # [T] bool, set by the runner per forward

    def forward(self, input_ids, positions, kv_caches, attn_metadata, hidden=None) -> torch.Tensor:
        mask = self.vision_rows
        if mask is not None:  # one host sync a forward (eager image prefills only)
            self.rows.visual = mask.nonzero().squeeze(1)
            self.rows.text = (~mask).nonzero().squeeze(1)
        try:
            return super().forward(input_ids, positions, kv_caches, attn_metadata, hidden)
        finally:
            self.rows.visual = self.rows.text = None
