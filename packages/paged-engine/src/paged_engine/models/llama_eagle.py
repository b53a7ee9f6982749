"""EAGLE (EAGLE-1 / EAGLE-2) draft heads for speculative decoding
(speculative_config={"method": "eagle", "model": HEAD, "num_speculative_tokens": k}).

An EAGLE head is a Llama decoder layer (or a few) that extrapolates the target's last hidden
state. At position p it reads the embedding of token p + 1 (the target's own embedding) and a
feature of position p: the target's final normed hidden state, or at its own later passes the
head's previous output. `fc` maps [embedding, feature] to the model width; the first layer has
no input norm; the output (the last layer's sum, no final norm) goes through the target's LM
head as it is and is also the next pass's feature. The HASS variant (`add_para_norm`) RMS-norms
the embedding and the feature before `fc`.

Checkpoints: the EAGLE authors' layout (a Llama config; weights `fc.weight`, `fc.bias` where
trained with one, `layers.{i}.*` without `layers.0.input_layernorm`); `embed_tokens` and
`lm_head` tensors in it are not used (the target's serve, as in vLLM).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from paged_engine.layers.attention import AttentionMetadata
from paged_engine.layers.linear import ColumnParallelLinear
from paged_engine.layers.norm import RMSNorm
from paged_engine.layers.rotary import get_rope
from paged_engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM, llama_head_dim
from paged_engine.models.utils import FeatureHead, cfg_get

# What a missing tensor of an EAGLE head's own checkpoint is reported as ("... lacks [...]")
EAGLE_CHECKPOINT = "speculative_config.model: the EAGLE checkpoint"


class EagleLlamaHead(FeatureHead):
    """`forward` returns (output, output): the LM head's input and the next feature [T, D]."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        d, eps = config.hidden_size, cfg_get(config, "rms_norm_eps", 1e-6)
        # A bias of zeros where the checkpoint has none: the same as no bias.
        self.fc = ColumnParallelLinear(2 * d, d, bias=True, tp_rank=0, tp_size=1)
        self.para_norm = bool(cfg_get(config, "add_para_norm", False))  # HASS
        if self.para_norm:
            self.embedding_layernorm = RMSNorm(d, eps)
            self.hidden_states_layernorm = RMSNorm(d, eps)
        self.rotary_emb = get_rope(config, llama_head_dim(config))
        flags = LlamaForCausalLM.layer_flags(config)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, flags, self.rotary_emb)
            for i in range(int(config.num_hidden_layers))
        )
        self.layers[0].input_layernorm = nn.Identity()  # EAGLE's first layer reads fc's output
        # the target's, set by the loader
        self.embed_tokens: nn.Module | None = None
        self.lm_head: nn.Module | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        md: AttentionMetadata,
        feature: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.embed_tokens is not None
        self.rotary_emb.begin_forward(positions)
        embeds = self.embed_tokens(input_ids).to(feature.dtype)
        if self.para_norm:
            embeds = self.embedding_layernorm(embeds)
            feature = self.hidden_states_layernorm(feature)
        h, residual = self.fc(torch.cat([embeds, feature], dim=-1)), None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            h, residual = layer.forward_residual(positions, h, residual, kv_cache, md)
        out = h + residual
        return out, out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # no norm: EAGLE's head
        assert self.lm_head is not None
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The head's tensors (a `model.` prefix dropped; embedding and LM head copies
        skipped); ValueError naming what is missing."""
        loaded = self.load_own_weights(
            ((n.removeprefix("model."), w) for n, w in weights),
            EAGLE_CHECKPOINT,
            stacked=LlamaForCausalLM.stacked_params,
            skip=lambda n: n.startswith(("embed_tokens.", "lm_head.")) or n.endswith("inv_freq"),
            optional=frozenset({"fc.bias"}),
        )
        if "fc.bias" not in loaded:
            self.fc.bias.data.zero_()
        return loaded
