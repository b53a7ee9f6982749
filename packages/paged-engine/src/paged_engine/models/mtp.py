"""A model's own multi-token prediction (MTP) layer as a draft head
(speculative_config={"method": "mtp", "num_speculative_tokens": k}): DeepSeek-V3's and
GLM-4.5's (`DeepseekMtpHead`, below) and Qwen3-Next / Qwen3.5's (`Qwen3NextMtpHead`, at the
end).

DeepSeek-V3 / R1 checkpoints carry `num_nextn_predict_layers` (1) layers past the decoder
stack, `model.layers.{L}.*` for L = num_hidden_layers, trained to predict one token further.
At position p the layer reads the embedding of token p + 1 and a feature of position p: the
target's final (normed) hidden state there, or on later passes the layer's own previous
output. With both RMS-normed (`enorm`, `hnorm`), `eh_proj` maps [embedding, feature] to the
model width, one full decoder layer (MLA and the MoE) runs over it, and `shared_head` (a norm
and an LM head) gives the logits; the layer's pre-norm output is the next pass's feature. The
embedding of position 0 is zeroed (as vLLM runs it: no token precedes it). Embedding and head
are the layer's own copies in the checkpoint, else the target's.

The weights load from the target's own checkpoint (`mtp_weight_name` keeps only layer L's);
the target's load skips them (they lie past its layers).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
from torch import nn

from paged_engine.layers.attention import AttentionMetadata
from paged_engine.layers.deepseek_moe import DeepseekMoe
from paged_engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from paged_engine.layers.linear import ColumnParallelLinear
from paged_engine.layers.norm import RMSNorm
from paged_engine.layers.rotary import get_rope
from paged_engine.models.deepseek_v2 import DeepseekDecoderLayer, DeepseekV2ForCausalLM
from paged_engine.models.llama import LlamaMLP, llama_head_dim
from paged_engine.models.mixtral import expert_rules
from paged_engine.models.utils import FeatureHead, cfg_get, mla_rope

# Checkpoint names of the layer's own parts (not its decoder block's)
_OWN = ("embed_tokens.", "enorm.", "hnorm.", "eh_proj.", "shared_head.")
# What a missing tensor of a target's MTP layer is reported as ("... lacks [...]")
MTP_LAYER = "speculative_config method 'mtp': the checkpoint's MTP layer"


def num_mtp_layers(hf_config) -> int:
    """MTP layers the config declares (DeepSeek's num_nextn_predict_layers, Qwen3-Next's
    mtp_num_hidden_layers); 0 for none. LongCat-Flash's default is 1, as vLLM reads it."""
    for key in ("num_nextn_predict_layers", "mtp_num_hidden_layers"):
        value = cfg_get(hf_config, key, None)
        if value:
            return int(value)
    from paged_engine.models.mtp_more import more_mtp_family

    longcat = more_mtp_family(hf_config) == "longcat"
    return int(longcat and cfg_get(hf_config, "num_nextn_predict_layers", None) is None)


def is_qwen_mtp(hf_config) -> bool:
    """Qwen3-Next / Qwen3.5 (`mtp.*` weights) rather than DeepSeek / GLM-4.5
    (`model.layers.{L}.*`)."""
    return str(getattr(hf_config, "model_type", "")).startswith(("qwen3_next", "qwen3_5"))


def _decoder_block(config, layer: int, target_cls) -> tuple[nn.Module, nn.Module, tuple]:
    """(the target's decoder layer for index `layer`, its rope, the stacked weight rules):
    DeepSeek's (MLA) or GLM-4.5's (Llama attention over DeepSeek's MoE)."""
    from paged_engine.models.glm4_moe import Glm4MoeForCausalLM
    from paged_engine.models.llama import LlamaForCausalLM
    from paged_engine.models.mixtral import MoeDecoderLayer

    if issubclass(target_cls, Glm4MoeForCausalLM):
        rope = get_rope(config, llama_head_dim(config))
        flags = target_cls.layer_flags(config)
        mlp = target_cls.build_mlp(config, layer)
        return (
            MoeDecoderLayer(config, layer, flags, rope, mlp),
            rope,
            LlamaForCausalLM.stacked_params,
        )
    rope = mla_rope(config, target_cls)
    # The MTP layers of V3 and its kin are MoE layers (past first_k_dense_replace).
    experts = int(getattr(config, "n_routed_experts", None) or 0)
    mlp = DeepseekMoe.from_config(config) if experts else LlamaMLP(config, bias=False)
    block = DeepseekDecoderLayer(config, layer, rope, mlp, target_cls.attention_cls)
    return block, rope, DeepseekV2ForCausalLM.stacked_params


def mtp_cache_config(hf_config):
    """The target's config for a cache of one (full-attention) layer: the MTP layer's."""
    one = copy.deepcopy(hf_config)
    one.num_hidden_layers = 1
    if cfg_get(hf_config, "layer_types", None) is not None:
        one.layer_types = ["full_attention"]
        one.full_attention_interval = 1
    return one


def mtp_weight_name(hf_config, name: str) -> str | None:
    """Our name for a checkpoint tensor of the first MTP layer, None for any other tensor."""
    if is_qwen_mtp(hf_config):
        if not name.startswith("mtp."):
            return None
        rest = name[len("mtp.") :]
        if rest.startswith("layers.0."):
            return "layer." + rest[len("layers.0.") :]
        return None if rest.startswith("layers.") else rest
    prefix = f"model.layers.{int(hf_config.num_hidden_layers)}."
    if not name.startswith(prefix):
        return None
    rest = name[len(prefix) :]
    return rest if rest.startswith(_OWN) else "block." + rest


class _SharedHead(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, cfg_get(config, "rms_norm_eps", 1e-6))
        self.head = ParallelLMHead(config.vocab_size, config.hidden_size)


class DeepseekMtpHead(FeatureHead):
    """The first MTP layer of a DeepSeek-V3 or GLM-4.5 target (`target_cls`: its model class,
    whose decoder layer, attention and rope the layer shares; a subclass builds another
    family's in `build_block`). `forward` returns (normed, pre-norm) [T, D]: the logits' input
    and the next pass's feature."""

    def __init__(self, config, target_cls) -> None:
        super().__init__()
        self.config = config
        d, eps = config.hidden_size, cfg_get(config, "rms_norm_eps", 1e-6)
        layer = int(config.num_hidden_layers)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, d)
        self.enorm = RMSNorm(d, eps)
        self.hnorm = RMSNorm(d, eps)
        self.eh_proj = ColumnParallelLinear(2 * d, d, bias=False, tp_rank=0, tp_size=1)
        self.block, self.rope, self.stacked = self.build_block(config, layer, target_cls)
        self.num_experts = int(getattr(config, "n_routed_experts", None) or 0)
        self.shared_head = _SharedHead(config)
        self.shares_target_embedding = False  # set by load_weights
        self.shares_target_head = False

    def build_block(self, config, layer: int, target_cls) -> tuple[nn.Module, nn.Module, tuple]:
        """(decoder layer `layer`, its rope, the stacked weight rules) of the target's family."""
        return _decoder_block(config, layer, target_cls)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        md: AttentionMetadata,
        feature: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.rope.begin_forward(positions)
        embeds = self.embed_tokens(input_ids).to(feature.dtype)
        embeds = embeds.masked_fill((positions == 0).unsqueeze(-1), 0.0)
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(feature)], dim=-1))
        h, residual = self.block.forward_residual(positions, x, None, kv_caches[0], md)
        pre = h + residual
        return self.shared_head.norm(pre), pre

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, V] fp32
        return self.shared_head.head(normed)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Layer L's tensors, named as `mtp_weight_name` gives them; ValueError naming what
        is missing (embedding and head may be absent: the target's are shared)."""
        rules = expert_rules(self.num_experts, "gate_proj", "up_proj", "down_proj")
        loaded = self.load_own_weights(
            weights,
            f"{MTP_LAYER} model.layers.{self.config.num_hidden_layers}",
            stacked=(*rules, *self.stacked),
            skip=lambda name: name.endswith("rotary_emb.inv_freq"),
            optional=frozenset({"embed_tokens.weight", "shared_head.head.weight"}),
        )
        self.shares_target_embedding = "embed_tokens.weight" not in loaded
        self.shares_target_head = "shared_head.head.weight" not in loaded
        return loaded


class Qwen3NextMtpHead(FeatureHead):
    """The MTP layer of Qwen3-Next / Qwen3.5 (`mtp.*`): GemmaRMSNorm-ed embedding (token p + 1)
    and feature, side by side through `fc`, one full-attention hybrid layer (the target's
    gated attention and its MLP for layer 0), then `norm`. Its output is both the logits'
    input (through the target's LM head) and the next pass's feature, as vLLM runs it; the
    embedding and head are the target's (set by the loader)."""

    def __init__(self, config, target_cls) -> None:
        super().__init__()
        from paged_engine.layers.norm import GemmaRMSNorm
        from paged_engine.models.qwen3_next import HybridDecoderLayer

        self.config = config
        d, eps = config.hidden_size, cfg_get(config, "rms_norm_eps", 1e-6)
        self.pre_fc_norm_embedding = GemmaRMSNorm(d, eps)
        self.pre_fc_norm_hidden = GemmaRMSNorm(d, eps)
        self.fc = ColumnParallelLinear(2 * d, d, bias=False, tp_rank=0, tp_size=1)
        self.rotary_emb = get_rope(config, llama_head_dim(config))
        self.layer = HybridDecoderLayer(
            mtp_cache_config(config), 0, self.rotary_emb, target_cls.build_mlp(config, 0)
        )
        self.norm = GemmaRMSNorm(d, eps)
        self.num_experts = int(getattr(config, "num_experts", None) or 0)
        # the target's, shared by the loader
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
        x = torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(feature)], -1)
        out = self.norm(self.layer(positions, self.fc(x), kv_caches[0], md))
        return out, out

    def compute_logits(self, normed: torch.Tensor) -> torch.Tensor:
        assert self.lm_head is not None
        return self.lm_head(normed)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        from paged_engine.models.qwen3_next import Qwen3_5ForCausalLM

        rules = expert_rules(self.num_experts, "gate_proj", "up_proj", "down_proj")
        stacked = (*rules, *Qwen3_5ForCausalLM.stacked_params)
        return self.load_own_weights(weights, f"{MTP_LAYER} (mtp.*)", stacked=stacked)
