"""MiniMax-M2 / M2.1 (`MiniMaxM2ForCausalLM`, model_type "minimax_m2"): a full-attention MoE
(62 layers, 256 experts of which 8 per token). Llama's pre-norm decoder with two changes:

    attention  GQA, no biases; q and k are RMS-normalized right after their projections, each
               over the whole projection (one weight of H*D / Hkv*D entries, as OLMo 2's), then
               rotated over the first rotary_dim dims of each head (partial rotary, NeoX style;
               the released configs' `rotary_dim`, which transformers 5 turns into
               partial_rotary_factor). The normalized q / k are rounded to the activation dtype
               before the weight multiplies them (Llama's RMSNorm order)
    mlp        a MoE block in every layer, no shared experts:
               s = sigmoid(x @ W_g^T) (float32); the k = num_experts_per_tok experts with the
               largest s + e_score_correction_bias are chosen and weighted by their unbiased s
               renormalized to sum 1 (always; no groups, no scaling factor), experts gated SiLU
               MLPs of `intermediate_size` (layers/deepseek_moe.py's DeepseekMoe)

HF computes the router logits in the router weight's dtype (the model's); ours are float32, as
vLLM's (the same in float32). Checkpoint names: released checkpoints hold
`block_sparse_moe.gate.weight`, `block_sparse_moe.experts.M.{w1,w3,w2}.weight` (gate, up, down)
and `block_sparse_moe.e_score_correction_bias`; transformers 5 `mlp.gate.weight`,
`mlp.experts.gate_up_proj` / `down_proj` (fused) and `mlp.e_score_correction_bias`. Both load;
multi-token-prediction layers past num_hidden_layers are skipped (CausalLMBase.load_weights).
Tensor parallelism: the q / k norms add up the ranks' sums of squares (OLMo 2's), the MoE block
splits its experts and reduces once.
"""

from __future__ import annotations

import torch
from torch import nn

from paged_engine.distributed.communication import tp_all_reduce
from paged_engine.layers.deepseek_moe import DeepseekMoe
from paged_engine.layers.rotary import get_rope
from paged_engine.models.deepseek_v2 import DeepseekModel
from paged_engine.models.llama import llama_head_dim
from paged_engine.models.mixtral import MixtralForCausalLM, check_silu, expert_rules, num_experts
from paged_engine.models.olmo2 import Olmo2Attention
from paged_engine.models.utils import CausalLMBase


class MiniMaxM2Attention(Olmo2Attention):
    """OLMo 2's attention (whole-projection q / k norms before RoPE) with Llama's rounding:
    round(x / rms(x)) * weight. No biases: config_ignored.py sets attention_bias, which HF's
    MiniMax-M2 never reads."""

    def _norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        qf, kf = q.float(), k.float()
        sums = torch.stack((qf.pow(2).sum(-1), kf.pow(2).sum(-1)), dim=-1)  # [T, 2]
        if self.tp_size > 1:  # this rank's heads only: add up the other ranks' squares
            sums = tp_all_reduce(sums)
        q_var = sums[:, :1] / self.q_full + self.q_norm.eps
        k_var = sums[:, 1:] / (self.k_full * self.kv_replicas) + self.k_norm.eps
        q = (qf * q_var.rsqrt()).to(q.dtype) * self.q_norm.weight
        k = (kf * k_var.rsqrt()).to(k.dtype) * self.k_norm.weight
        return q, k


class MiniMaxM2ForCausalLM(MixtralForCausalLM):
    """Mixtral's weight names and expert loading (w1 / w3 / w2, `block_sparse_moe` renamed to
    `mlp`) over DeepSeek's decoder stack with MiniMax's attention and router."""

    def __init__(self, config):
        check_silu(config, type(self).__name__)
        rope = get_rope(config, llama_head_dim(config))  # partial rotary from the config
        inner = DeepseekModel(config, type(self).build_mlp, MiniMaxM2Attention, rope)
        CausalLMBase.__init__(self, config, inner)
        rules = expert_rules(num_experts(config), *self.expert_names)
        self.stacked_params = (*rules, *type(self).stacked_params)

    @classmethod
    def build_mlp(cls, config, layer_idx: int) -> nn.Module:
        return DeepseekMoe(
            num_experts(config),
            int(config.num_experts_per_tok),
            config.hidden_size,
            int(config.intermediate_size),
            0,  # no shared experts
            sigmoid=True,
            correction_bias=True,
            renormalize=True,
        )

    def rename_weight(self, name: str) -> str:
        # the balance bias sits beside the router in HF's block, in ours inside it
        name = super().rename_weight(name)  # block_sparse_moe -> mlp
        return name.replace(".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias")
