"""Meituan LongCat-Flash (`LongcatFlashForCausalLM`): DeepSeek-V3's multi-head latent attention
(models/deepseek_v2.py) twice a layer, a shortcut-connected MoE with "zero-computation"
experts, as transformers runs it.

    layer    each of the `num_layers` decoder layers holds two attention + dense-MLP sublayers
             and one MoE (HF's `num_hidden_layers` is 2 * num_layers, one per attention):
                 x += attn0(input_layernorm0(x));  y = post_attention_layernorm0(x)
                 m = moe(y);  x += mlps0(y)
                 x += attn1(input_layernorm1(x));  x += mlps1(post_attention_layernorm1(x)) + m
             so the MoE reads the first half's stream and its output joins the second half's
    MLA      DeepSeek-V3's, always with the q bottleneck, plus LoRA scalings: the queries times
             sqrt(hidden_size / q_lora_rank) (we scale the absorbed queries, the same scores)
             and the normalized latent times sqrt(hidden_size / kv_lora_rank) before it is
             cached (it is both the keys' and the values' latent, as HF caches it). Each
             attention has its own latent cache entry: layer i's two use entries 2i and 2i + 1
    router   softmax over n_routed_experts + zero_expert_num scores (float32, `router.classifier`
             without its bias); the choice ranks scores + e_score_correction_bias, the weights
             are the chosen unbiased scores, never renormalized, times routed_scaling_factor
    zero     a chosen id >= n_routed_experts is a zero expert: the identity, so it adds x times
             its weight; the real experts see it as weight 0 (FusedMoE, any valid id)
    rope     interleaved (GPT-J pairs) over head_dim, which must equal qk_rope_head_dim

Refused by name: `router_bias` (HF builds the bias and never adds it), `qk_head_dim` other than
qk_nope_head_dim + qk_rope_head_dim, `head_dim` other than qk_rope_head_dim, a hidden_act other
than SiLU. Pipeline stages split the `num_layers` layers (`decoder_layer_count`, also what
VLLM_PP_LAYER_PARTITION sums to) and each stage caches its layers' pairs of entries. The
multi-token-prediction weights (`model.mtp.*`) are skipped, as HF skips them (models/mtp_more.py
runs them as a draft).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from paged_engine.distributed.communication import tp_all_reduce
from paged_engine.layers.attention import AttentionMetadata
from paged_engine.layers.deepseek_moe import DeepseekRouter
from paged_engine.layers.embedding import VocabParallelEmbedding
from paged_engine.layers.fused_moe import FusedMoE
from paged_engine.layers.norm import RMSNorm
from paged_engine.layers.rotary import RotaryEmbedding, get_rope
from paged_engine.models.deepseek_v2 import MlaAttention
from paged_engine.models.llama import LlamaMLP, StreamCapture, run_layers, stage_input
from paged_engine.models.mixtral import check_silu, expert_rules
from paged_engine.models.utils import (
    CausalLMBase,
    cfg_get,
    make_layers,
)

KVPair = tuple[torch.Tensor, torch.Tensor]


class ScaledRMSNorm(RMSNorm):
    """RMSNorm whose output is multiplied by a constant (MLA's latent LoRA scaling)."""

    def __init__(self, hidden_size: int, eps: float, scale: float) -> None:
        super().__init__(hidden_size, eps)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


class LongcatMla(MlaAttention):
    """DeepSeek-V3's MLA with LongCat's LoRA scalings (module docstring)."""

    def __init__(self, config, rope: RotaryEmbedding) -> None:
        super().__init__(config, rope)
        self.q_scale = (config.hidden_size / config.q_lora_rank) ** 0.5
        kv_scale = (config.hidden_size / config.kv_lora_rank) ** 0.5
        self.kv_a_layernorm = ScaledRMSNorm(self.rank, self.kv_a_layernorm.eps, kv_scale)

    def scale_queries(self, positions: torch.Tensor, q_full: torch.Tensor) -> torch.Tensor:
        # Linear in q: scaling HF's q_pass and q_rot scales the absorbed queries alike.
        return q_full * self.q_scale


class LongcatMoe(nn.Module):
    """Routed experts plus zero (identity) experts; [T, H] -> [T, H], all-reduced."""

    def __init__(self, config) -> None:
        super().__init__()
        self.num_experts = int(config.n_routed_experts)
        self.num_zero = int(config.zero_expert_num or 0)
        self.router = DeepseekRouter(
            self.num_experts + self.num_zero,
            config.hidden_size,
            int(config.moe_topk),
            sigmoid=False,
            correction_bias=True,
            renormalize=False,
            scale=float(config.routed_scaling_factor),
        )
        self.experts = FusedMoE(
            self.num_experts, config.hidden_size, int(config.expert_ffn_hidden_size)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, H]
        weights, ids = self.router(x)  # [T, k] float32, [T, k]
        identity = None
        if self.num_zero:
            zero = ids >= self.num_experts  # identity experts: weight 0 for FusedMoE
            identity = weights.masked_fill(~zero, 0.0).sum(dim=-1, keepdim=True)  # [T, 1]
            weights = weights.masked_fill(zero, 0.0)
            ids = torch.where(zero, ids % self.num_experts, ids)
        out = self.experts(x, weights, ids)
        if self.experts.tp_size > 1:
            out = tp_all_reduce(out)
        if identity is not None:  # x and the routing are whole on every rank: added once
            out = out + x * identity.to(x.dtype)
        return out


class LongcatDecoderLayer(nn.Module):
    """Two attention + MLP sublayers and the shortcut MoE (module docstring); HF's names."""

    def __init__(self, config, rope: RotaryEmbedding) -> None:
        super().__init__()
        eps = cfg_get(config, "rms_norm_eps", 1e-6)
        hidden = config.hidden_size
        self.self_attn = nn.ModuleList(LongcatMla(config, rope) for _ in range(2))
        self.mlps = nn.ModuleList(LlamaMLP(config, bias=False) for _ in range(2))
        self.input_layernorm = nn.ModuleList(RMSNorm(hidden, eps) for _ in range(2))
        self.post_attention_layernorm = nn.ModuleList(RMSNorm(hidden, eps) for _ in range(2))
        self.mlp = LongcatMoe(config)

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        x: torch.Tensor,  # [T, D]
        kv_cache: tuple[KVPair, KVPair],  # the two attentions' latent caches
        md: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.self_attn[0](positions, self.input_layernorm[0](x), kv_cache[0], md)
        y = self.post_attention_layernorm[0](x)
        shortcut = self.mlp(y)
        x = x + self.mlps[0](y)
        x = x + self.self_attn[1](positions, self.input_layernorm[1](x), kv_cache[1], md)
        return x + self.mlps[1](self.post_attention_layernorm[1](x)) + shortcut


class LongcatModel(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.embedding_multiplier = None
        self.rotary_emb = get_rope(config, config.qk_rope_head_dim, is_neox_style=False)
        self.layers, self.stage = make_layers(
            config.num_layers, lambda i: LongcatDecoderLayer(config, self.rotary_emb)
        )
        self.norm = RMSNorm(config.hidden_size, cfg_get(config, "rms_norm_eps", 1e-6))

    # Set by an EAGLE-3 draft runner for the engine's life (spec_decode/eagle.py)
    stream_capture: StreamCapture | None = None

    def forward(self, input_ids, positions, kv_caches, md, hidden=None) -> torch.Tensor:
        x = stage_input(self, input_ids, hidden)
        layers = list(self.stage.layers(self.layers))
        pairs = list(zip(kv_caches[0::2], kv_caches[1::2], strict=True))  # caches 2i, 2i + 1
        norm = self.norm if self.stage.is_last else None
        return run_layers(layers, False, positions, x, pairs, md, norm, None, self.stream_capture)


def check_config(config) -> None:
    """ValueError naming the config field LongCat-Flash's support refuses."""
    if getattr(config, "router_bias", False):
        raise ValueError("LongcatFlashForCausalLM: router_bias=True is not supported")
    nope, rope = int(config.qk_nope_head_dim), int(config.qk_rope_head_dim)
    qk = getattr(config, "qk_head_dim", None)
    if qk is not None and int(qk) != nope + rope:
        raise ValueError(f"qk_head_dim={qk} must be qk_nope_head_dim + qk_rope_head_dim")
    head_dim = getattr(config, "head_dim", None)
    if head_dim is not None and int(head_dim) != rope:  # HF's rope spans head_dim
        raise ValueError(f"head_dim={head_dim} must equal qk_rope_head_dim={rope}")
    if config.q_lora_rank is None:
        raise ValueError("LongcatFlashForCausalLM needs q_lora_rank (HF always has q_a_proj)")


class LongcatFlashForCausalLM(CausalLMBase):
    """LongCat-Flash (module docstring)."""

    stacked_params = (
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    )
    renames = ((".mlp.router.classifier.weight", ".mlp.router.weight"),)
    ignored_weights = ("rotary_emb.inv_freq",)

    def __init__(self, config) -> None:
        check_silu(config, type(self).__name__)
        check_config(config)
        super().__init__(config, LongcatModel(config))
        # Expert rules first: the dense MLPs' ".gate_proj" also matches an expert's.
        rules = expert_rules(int(config.n_routed_experts), "gate_proj", "up_proj", "down_proj")
        self.stacked_params = (*rules, *type(self).stacked_params)

    @staticmethod
    def decoder_layer_count(config) -> int:
        """`num_layers`: HF's num_hidden_layers counts the attention sublayers (two a layer).
        Pipeline stages split these; a stage's caches are its layers' pairs
        (worker/cache_engine.py: kv_layers)."""
        return int(config.num_layers)

    def num_decoder_layers(self) -> int:
        return self.decoder_layer_count(self.config)

    def convert_weight(self, name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if name.startswith("model.mtp."):  # multi-token prediction: unused, as in HF
            return ()
        return ((name, w),)
