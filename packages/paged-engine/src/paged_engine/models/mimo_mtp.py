"""Xiaomi MiMo-7B's multi-token-prediction (MTP) layer as a draft head
(speculative_config={"method": "mtp", "num_speculative_tokens": k}), as vLLM serves it
(vllm/model_executor/models/mimo_mtp.py, the draft of a MiMoForCausalLM target).

MiMo-7B checkpoints (Base, SFT, RL) carry `num_nextn_predict_layers` layers under
`model.mtp_layers.{i}.*` that the target's own forward never reads (models/llama_variants.py
skips them). At position p the layer reads the embedding of token p + 1 (zeroed at position 0:
no token precedes it) and a feature of position p: the target's final hidden state there
BEFORE its final norm (vLLM's MiMoModel returns the stream and norms it for the logits only),
or on later passes the layer's own previous output:

    x   = input_proj(cat([hidden_layernorm(feature), token_layernorm(embedding)]))  # [T, D]
    out = final_layernorm(qwen2_decoder_layer(x))     # one full-attention Qwen2 layer
    logits = lm_head(out);   the next pass's feature = out

The concat order is feature first, embedding second (DeepSeek's MTP puts the embedding
first). Embedding and LM head are the target's (the checkpoint has no copies of its own; vLLM
loads the same tensors). As in vLLM, every pass runs the first layer (`mtp_layers.0`), however
many the config declares; the others are not loaded.

The target's pre-norm stream comes from its forward through a `StreamCapture` of id
num_hidden_layers (run_layers keeps the stream leaving the stack there), read by the EAGLE-3
runner (spec_decode/eagle.py): a buffer that outlives CUDA graphs, like EAGLE-3's streams.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from paged_engine.layers.attention import AttentionMetadata
from paged_engine.layers.linear import ColumnParallelLinear
from paged_engine.layers.norm import RMSNorm
from paged_engine.layers.rotary import get_rope
from paged_engine.models.llama import LlamaDecoderLayer, llama_head_dim
from paged_engine.models.mtp import MTP_LAYER
from paged_engine.models.utils import FeatureHead, cfg_get

if TYPE_CHECKING:
    from paged_engine.loader import ResolvedModel
    from paged_engine.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_PREFIX = "model.mtp_layers.0."
# The layer's own parts; every other tensor under the prefix is its decoder block's
_OWN = ("token_layernorm.", "hidden_layernorm.", "input_proj.", "final_layernorm.")


def is_mimo_mtp(hf_config) -> bool:
    """A MiMo-7B target (its MTP layers under `model.mtp_layers.*`)."""
    return "MiMoForCausalLM" in (getattr(hf_config, "architectures", None) or ())


def mimo_mtp_weight_name(name: str) -> str | None:
    """Our name for a checkpoint tensor of the first MTP layer, None for any other tensor."""
    if not name.startswith(_PREFIX):
        return None
    rest = name[len(_PREFIX) :]
    return rest if rest.startswith(_OWN) else "mtp_block." + rest


class MiMoMtpHead(FeatureHead):
    """MiMo's first MTP layer over the target's pre-norm final hidden states (see the module
    docstring). `forward` returns (out, out): the logits' input and the next pass's feature."""

    def __init__(self, config) -> None:
        super().__init__()
        from paged_engine.models.mtp import mtp_cache_config
        from paged_engine.models.qwen2 import Qwen2ForCausalLM

        if cfg_get(config, "use_sliding_window", False):
            raise ValueError(
                "speculative_config method 'mtp': MiMo's MTP layer with use_sliding_window "
                "true is not supported (MiMo-7B releases attend to the whole context)"
            )
        self.config = config
        d, eps = config.hidden_size, cfg_get(config, "rms_norm_eps", 1e-6)
        one = mtp_cache_config(config)  # one full-attention layer: the MTP block's cache
        self.token_layernorm = RMSNorm(d, eps)
        self.hidden_layernorm = RMSNorm(d, eps)
        self.input_proj = ColumnParallelLinear(2 * d, d, bias=False, tp_rank=0, tp_size=1)
        self.rotary_emb = get_rope(one, llama_head_dim(one))
        flags = {**Qwen2ForCausalLM.layer_flags(one), "sliding": False}
        self.mtp_block = LlamaDecoderLayer(one, 0, flags, self.rotary_emb)
        self.final_layernorm = RMSNorm(d, eps)
        self.stacked = Qwen2ForCausalLM.stacked_params
        # the target's, set by attach_mimo_mtp_head
        self.embed_tokens: nn.Module | None = None
        self.lm_head: nn.Module | None = None

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] token p + 1 of each entry p
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        md: AttentionMetadata,
        feature: torch.Tensor,  # [T, D] pre-norm target stream, or the previous pass's out
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.embed_tokens is not None
        self.rotary_emb.begin_forward(positions)
        embeds = self.embed_tokens(input_ids).to(feature.dtype)
        embeds = embeds.masked_fill((positions == 0).unsqueeze(-1), 0.0)
        x = torch.cat([self.hidden_layernorm(feature), self.token_layernorm(embeds)], dim=-1)
        out = self.final_layernorm(self.mtp_block(positions, self.input_proj(x), kv_caches[0], md))
        return out, out

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, V] fp32
        assert self.lm_head is not None
        return self.lm_head(normed)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """`model.mtp_layers.0.*`, named as `mimo_mtp_weight_name` gives them; ValueError
        naming what is missing."""
        return self.load_own_weights(
            weights,
            f"{MTP_LAYER} {_PREFIX}*",
            stacked=self.stacked,
            skip=lambda name: name.endswith("rotary_emb.inv_freq"),
        )


def attach_mimo_mtp_head(
    runner: ModelRunner, resolved: ResolvedModel, quantization: str | None
) -> None:
    """Build MiMo's first MTP layer on the runner's device and dtype, load it from the target's
    own checkpoint (its tensors only), share the target's embedding and LM head, and set
    `runner.draft`: the EAGLE-3 runner over the stream leaving the target's stack."""
    from paged_engine.models.mtp import mtp_cache_config
    from paged_engine.spec_decode.eagle import Eagle3Runner
    from paged_engine.spec_decode.head_loader import load_mtp_layer

    hf_config, target = runner.hf_config, runner.model
    logger.info("loading the target's MTP layer (MiMo: model.mtp_layers.0)")
    head = load_mtp_layer(
        runner, resolved, quantization, lambda: MiMoMtpHead(hf_config), mimo_mtp_weight_name
    )
    head.embed_tokens = target.get_submodule(target.embed_path)
    head.lm_head = target.get_submodule(target.head_name)
    stack_out = (int(hf_config.num_hidden_layers),)  # run_layers: the stream leaving the stack
    runner.draft = Eagle3Runner(
        head.eval().requires_grad_(False), mtp_cache_config(hf_config), runner, stack_out
    )
