"""openPangu's multi-token-prediction (MTP) layer as a draft head
(speculative_config={"method": "mtp", "num_speculative_tokens": k}) of a PanguUltraMoEForCausalLM
/ PanguProMoEV2ForCausalLM target (models/openpangu_moe.py), as vLLM serves it
(vllm/model_executor/models/openpangu_mtp.py, OpenPanguMTPModel: DeepSeek's MTP layer around
an openPangu decoder layer).

The checkpoint's `num_nextn_predict_layers` (the release: `num_mtp_layers`) layers lie past
the stack, `model.layers.{L}.*` for L = num_hidden_layers, under DeepSeek-V3's names
(`enorm`, `hnorm`, `eh_proj`, `shared_head.{norm, head}`, maybe `embed_tokens`, the rest the
block's). At position p the layer reads the embedding of token p + 1 (zeroed at position 0)
and a feature of position p:

    x   = eh_proj(cat([enorm(embedding), hnorm(feature)]))
    pre = block(x)              # the target's layer L: MLA, the MoE, sandwich norms if set
    logits = shared_head.head(shared_head.norm(pre));   the next pass's feature = pre

Where it differs from DeepSeek-V3's head (models/mtp.py, whose module this subclasses): the
block is openPangu's (sandwich norms), and the target's feature is its final stream BEFORE the
final norm: vLLM's OpenPanguModel returns the un-normed stream and norms it in compute_logits
only, so its MTP layer reads that (DeepSeek's returns the normed one). The stream comes from
the target's forward through a `StreamCapture` of id num_hidden_layers, read by the EAGLE-3
runner, as MiMo's MTP does (models/mimo_mtp.py). Embedding and head are the layer's own
copies where the checkpoint has them, else the target's.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from torch import nn

from paged_engine.models.deepseek_v2 import DeepseekV2ForCausalLM
from paged_engine.models.llama import LlamaMLP
from paged_engine.models.mtp import DeepseekMtpHead
from paged_engine.models.openpangu_moe import (
    PanguUltraMoEForCausalLM,
    decoder_layer_cls,
    openpangu_moe_block,
)
from paged_engine.models.utils import mla_rope

if TYPE_CHECKING:
    from paged_engine.loader import ResolvedModel
    from paged_engine.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def is_openpangu_mtp(hf_config) -> bool:
    """Whether the target is an openPangu MoE model (its MTP layer is this file's)."""
    from paged_engine.models import get_model_class

    try:
        cls = get_model_class(hf_config)
    except ValueError:
        return False
    return cls is not None and issubclass(cls, PanguUltraMoEForCausalLM)


class OpenPanguMtpHead(DeepseekMtpHead):
    """DeepSeek's MTP head (forward, logits, loading) around openPangu's decoder layer L: a MoE
    layer where the config has routed experts (L is past the dense layers), with sandwich norms
    where the config says so."""

    def __init__(self, config) -> None:
        super().__init__(config, PanguUltraMoEForCausalLM)

    def build_block(self, config, layer: int, target_cls) -> tuple[nn.Module, nn.Module, tuple]:
        rope = mla_rope(config, target_cls)
        experts = int(getattr(config, "n_routed_experts", None) or 0)
        mlp = openpangu_moe_block(config) if experts else LlamaMLP(config, bias=False)
        block = decoder_layer_cls(config)(config, layer, rope, mlp, target_cls.attention_cls)
        return block, rope, DeepseekV2ForCausalLM.stacked_params

    def load_weights(self, weights):
        # the release's correction bias sits beside the router (openpangu_moe.py)
        renamed = (
            (n.replace(".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"), w)
            for n, w in weights
        )
        return super().load_weights(renamed)


def attach_openpangu_mtp_head(
    runner: ModelRunner, resolved: ResolvedModel, quantization: str | None
) -> None:
    """Build the target's first MTP layer on the runner's device and dtype, load it from the
    target's own checkpoint (its tensors only), share the target's embedding and LM head where
    it has none, and set `runner.draft`: the EAGLE-3 runner over the stream leaving the
    target's stack (its pre-norm final hidden state)."""
    from paged_engine.models.mtp import mtp_cache_config, mtp_weight_name
    from paged_engine.spec_decode.eagle import Eagle3Runner
    from paged_engine.spec_decode.head_loader import load_mtp_layer

    hf_config, target = runner.hf_config, runner.model
    logger.info(
        "loading the target's MTP layer (openPangu: model.layers.%d)", hf_config.num_hidden_layers
    )
    head = load_mtp_layer(
        runner,
        resolved,
        quantization,
        lambda: OpenPanguMtpHead(hf_config),
        lambda name: mtp_weight_name(hf_config, name),
    )
    if runner.config.load_format == "dummy":  # dummy weights: no copies of its own
        head.shares_target_embedding = head.shares_target_head = True
    if head.shares_target_embedding:
        head.embed_tokens = target.get_submodule(target.embed_path)
    if head.shares_target_head:
        head.shared_head.head = target.get_submodule(target.head_name)
    stack_out = (int(hf_config.num_hidden_layers),)  # run_layers: the stream leaving the stack
    runner.draft = Eagle3Runner(
        head.eval().requires_grad_(False), mtp_cache_config(hf_config), runner, stack_out
    )
