"""EAGLE-1 draft heads for MiniCPM targets (vLLM's `EagleMiniCPMForCausalLM`,
models/minicpm_eagle.py there): speculative_config={"method": "eagle", "model": HEAD, ...} with
a head whose config names `MiniCPMForCausalLM` (vLLM prefixes "Eagle") or
`EagleMiniCPMForCausalLM`. spec_decode/head_loader.py picks this class for those names.

Like the Llama EAGLE-1 head (models/llama_eagle.py) it runs at position p on the embedding of
token p + 1 and a feature of position p (the target's final normed hidden state, or the head's
previous output), but with MiniCPM's scalars from the head's own config:

    e = input_norm1(embed(token) * scale_emb)          # [T, D]
    f = input_norm2(feature)                            # [T, D]
    x = fc([e, f])                                      # bias-free Linear 2D -> D
    x = layer_i(x) for each layer                       # MiniCPM layers: both residual adds
                                                        # times scale_depth / sqrt(mup_denominator
                                                        # or num_hidden_layers); every layer has
                                                        # its input norm
    out = x / (hidden_size / dim_model_base)            # no final norm
    logits = lm_head(out); next feature = out

Checkpoint names (vLLM's): `model.fc.weight`, `model.input_norm1.weight`,
`model.input_norm2.weight`, `model.eagle_layers.{i}.*` (Llama layer names), maybe
`model.embed_tokens.weight` and `lm_head.weight` (the head's own, used when present, as vLLM's
proposer does; else the target's serve), `model.norm.weight` (unused by vLLM's forward:
skipped). A `model.` prefix may be absent. MiniCPM-MoE heads (`num_experts` > 0) and activations
other than SiLU are refused by name.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable

import torch
from torch import nn

from paged_engine.layers.attention import AttentionMetadata
from paged_engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from paged_engine.layers.linear import ColumnParallelLinear
from paged_engine.layers.norm import RMSNorm
from paged_engine.layers.rotary import get_rope
from paged_engine.models.granite import GraniteDecoderLayer
from paged_engine.models.llama import LlamaForCausalLM, llama_head_dim
from paged_engine.models.utils import FeatureHead, cfg_get

# the head config's architectures that select this head (vLLM prefixes "Eagle" to the name)
MINICPM_EAGLE_ARCHITECTURES = ("MiniCPMForCausalLM", "EagleMiniCPMForCausalLM")


def is_minicpm_eagle_config(config) -> bool:
    return any(a in MINICPM_EAGLE_ARCHITECTURES for a in getattr(config, "architectures", []) or [])


def _positive(config, name: str, default: float | None = None) -> float:
    value = cfg_get(config, name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError(
            f"speculative_config.model: the MiniCPM EAGLE head's config field {name!r} must be "
            f"a positive number, got {value!r}"
        )
    return float(value)


def layer_config(config):
    """A copy of the head's config with MiniCPM's layer scalars under Granite's names (read by
    GraniteDecoderLayer); ValueError naming a field paged does not serve."""
    if int(cfg_get(config, "num_experts", 0) or 0) > 0:
        raise ValueError(
            "speculative_config.model: MiniCPM-MoE EAGLE heads (config field 'num_experts' > 0) "
            "are not supported"
        )
    act = cfg_get(config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(
            f"speculative_config.model: the MiniCPM EAGLE head's config field 'hidden_act'="
            f"{act!r} is not supported (silu only)"
        )
    layers = int(config.num_hidden_layers)
    denominator = _positive(config, "mup_denominator", layers)
    out = copy.copy(config)
    out.residual_multiplier = _positive(config, "scale_depth") / math.sqrt(denominator)
    out.attention_multiplier = llama_head_dim(config) ** -0.5
    return out


class EagleMiniCPMHead(FeatureHead):
    """`forward` returns (output, output) [T, D]: the LM head's input and the next feature."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        d, eps = config.hidden_size, cfg_get(config, "rms_norm_eps", 1e-6)
        self.scale_emb = _positive(config, "scale_emb")
        self.scale_width = d / _positive(config, "dim_model_base")
        layer_cfg = layer_config(config)
        self.fc = ColumnParallelLinear(2 * d, d, bias=False, tp_rank=0, tp_size=1)
        self.input_norm1 = RMSNorm(d, eps)  # on the scaled embedding
        self.input_norm2 = RMSNorm(d, eps)  # on the feature
        self.rotary_emb = get_rope(layer_cfg, llama_head_dim(layer_cfg))
        flags = LlamaForCausalLM.layer_flags(layer_cfg)
        self.eagle_layers = nn.ModuleList(
            GraniteDecoderLayer(layer_cfg, i, flags, self.rotary_emb)
            for i in range(int(config.num_hidden_layers))
        )
        # the head's own copies, replaced by the target's where the checkpoint has none
        self.embed_tokens: nn.Module = VocabParallelEmbedding(
            config.vocab_size, d, tp_rank=0, tp_size=1
        )
        self.lm_head: nn.Module = ParallelLMHead(config.vocab_size, d, tp_rank=0, tp_size=1)
        self.shares_target_embedding = self.shares_target_head = True  # set by load_weights

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        md: AttentionMetadata,
        feature: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.rotary_emb.begin_forward(positions)
        embeds = self.embed_tokens(input_ids).to(feature.dtype) * self.scale_emb
        x = self.fc(torch.cat([self.input_norm1(embeds), self.input_norm2(feature)], dim=-1))
        for layer, kv_cache in zip(self.eagle_layers, kv_caches, strict=True):
            x = layer(positions, x, kv_cache, md)
        out = x / self.scale_width
        return out, out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # no norm, as vLLM's
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The head's tensors (`model.` prefix dropped; `norm.weight` skipped); ValueError
        naming what is missing (the embedding and LM head may be: the target's serve)."""
        loaded = self.load_own_weights(
            ((n.removeprefix("model."), w) for n, w in weights),
            "speculative_config.model: the MiniCPM EAGLE checkpoint",
            stacked=LlamaForCausalLM.stacked_params,
            skip=lambda n: n == "norm.weight" or n.endswith("inv_freq"),
            optional=frozenset({"embed_tokens.weight", "lm_head.weight"}),
        )
        self.shares_target_embedding = "embed_tokens.weight" not in loaded
        self.shares_target_head = "lm_head.weight" not in loaded
        return loaded


__all__ = ["MINICPM_EAGLE_ARCHITECTURES", "EagleMiniCPMHead", "is_minicpm_eagle_config"]
