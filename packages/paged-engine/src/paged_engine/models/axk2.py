"""SK Telecom A.X K2 (`AXK2ForCausalLM`, model_type "axk2": A.X-K2, A.X-K2-Light).

DeepSeek-V3.2 (models/deepseek_v32.py: V3's absorbed MLA, a DSA indexer on every layer with
NeoX rope on its first qk_rope_head_dim dims, V3's MoE) in A.X K1's layout (models/axk1.py:
`mlp_layer_types`, derived from first_k_dense_replace / moe_layer_freq without it), with these
differences, each as transformers runs it:

    queries    no q_b_proj: one `q_gate_proj` [H * (qk_head_dim + v_head_dim), 2 q_lora_rank]
               reads [q_a_layernorm(c_q) | c_q] (c_q = q_a_proj(x), the normed bottleneck
               first); each head's rows give its query, then an output gate. The indexer still
               reads the normed bottleneck alone
    gate       head h's attention output times sigmoid(gate_h) in float32, before o_proj
    norms      `input_layernorm` on every layer and `post_attention_layernorm` on sparse layers
               are gated: y = RMSNorm(x), y * sigmoid(fc2(silu(fc1(y)))) (fc1 to
               gated_norm_rank, float32 sigmoid); dense layers keep a plain post norm
    router     V3's biased sigmoid top-k; with n_group set (A.X-K2) the dropped groups' experts
               score 0.0 rather than -inf (transformers follows the reference), so they can
               still be chosen when the kept groups' scores plus bias fall below 0; n_group None
               (A.X-K2-Light) routes over all experts

We load `q_gate_proj` (the release's `q_b_proj`) split by head into a q_b_proj of
H * qk_head_dim rows and an `output_gate` of H * v_head_dim rows (both over the 2 q_lora_rank
input), so tensor parallelism splits them by head like V3.2's q_b_proj. The cache and the
sparse attention are V3.2's.

Refused by name: as V3.2 (q_lora_rank None, CUDA graphs, speculative_config method "mtp").
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.layers.deepseek_moe import DeepseekMoe, DeepseekRouter
from paged_engine.layers.linear import ColumnParallelLinear
from paged_engine.layers.norm import RMSNorm
from paged_engine.layers.rotary import RotaryEmbedding
from paged_engine.models.axk1 import axk1_mlp_layer_types
from paged_engine.models.deepseek_v2 import DeepseekDecoderLayer
from paged_engine.models.deepseek_v32 import Choices, DeepseekV32ForCausalLM, DsaAttention
from paged_engine.models.llama import LlamaMLP


def _replicated(in_features: int, out_features: int) -> ColumnParallelLinear:
    return ColumnParallelLinear(in_features, out_features, bias=False, tp_rank=0, tp_size=1)


class GatedRMSNorm(nn.Module):
    """`AXK2GatedRMSNorm`: y = norm(x), y * sigmoid(mlp.fc2(silu(mlp.fc1(y)))). [T, D]."""

    def __init__(self, config) -> None:
        super().__init__()
        d, rank = int(config.hidden_size), int(config.gated_norm_rank)
        self.norm = RMSNorm(d, float(config.rms_norm_eps))
        self.mlp = nn.Module()
        self.mlp.fc1, self.mlp.fc2 = _replicated(d, rank), _replicated(rank, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        gate = self.mlp.fc2(F.silu(self.mlp.fc1(y)))
        return (y * torch.sigmoid(gate.float())).to(y.dtype)


class ZeroFilledGroupRouter(DeepseekRouter):
    """V3's grouped sigmoid router whose dropped groups score 0.0, not -inf (the module
    docstring). x [T, H] -> (weights [T, k] float32, ids [T, k])."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.sigmoid(F.linear(x.float(), self.weight.float()))  # [T, E]
        choice = scores + self.e_score_correction_bias
        t, e = choice.shape
        grouped = choice.view(t, self.n_group, e // self.n_group)
        kept = grouped.topk(2, dim=-1).values.sum(dim=-1).topk(self.topk_group, dim=-1).indices
        keep = torch.zeros(t, self.n_group, dtype=torch.bool, device=x.device)
        keep.scatter_(1, kept, True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), 0.0).view(t, e)
        ids = choice.topk(self.top_k, dim=-1, sorted=False).indices  # as transformers
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scale, ids


class AXK2Attention(DsaAttention):
    """V3.2's DSA attention with A.X K2's fused query / gate projection and output gate."""

    def __init__(
        self, config, rope: RotaryEmbedding, full: bool, choices: Choices, neox: bool
    ) -> None:
        super().__init__(config, rope, full, choices, neox)
        heads, rank = int(config.num_attention_heads), int(config.q_lora_rank)
        qk = self.nope + self.rope_dim
        self.q_b_proj = ColumnParallelLinear(2 * rank, heads * qk, bias=False)
        self.output_gate = ColumnParallelLinear(2 * rank, heads * self.v_dim, bias=False)

    def project_q(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q_c = self.q_a_proj(x)
        q_resid = self.q_a_layernorm(q_c)
        both = torch.cat((q_resid, q_c), dim=-1)  # [T, 2 q_lora_rank]
        return self.q_b_proj(both), q_resid, both

    def gate_heads(self, gate_in: torch.Tensor, o: torch.Tensor) -> torch.Tensor:  # [T, H, v]
        gate = self.output_gate(gate_in).view(o.shape).float()
        return (o.float() * torch.sigmoid(gate)).to(o.dtype)


class AXK2ForCausalLM(DeepseekV32ForCausalLM):
    """V3.2's stack with A.X K2's attention, gated norms and router (module docstring)."""

    dsa_attention_cls = AXK2Attention
    # The release's names (its fused q_b_proj, the gate MLPs' W_down / W_up), then ours
    renames = (
        (".self_attn.q_b_proj.", ".self_attn.q_gate_proj."),
        ("W_down", "mlp.fc1"),
        ("W_up", "mlp.fc2"),
    )

    def __init__(self, config) -> None:
        super().__init__(config)
        types = axk1_mlp_layer_types(config)
        for i, layer in enumerate(self.model.layers):
            if isinstance(layer, DeepseekDecoderLayer):  # this pipeline stage's
                layer.input_layernorm = GatedRMSNorm(config)
                if types[i] == "sparse":
                    layer.post_attention_layernorm = GatedRMSNorm(config)
        qk = int(config.qk_nope_head_dim) + int(config.qk_rope_head_dim)
        self.q_widths = (qk, int(config.v_head_dim))  # a head's rows of q_gate_proj: q, gate

    @classmethod
    def build_mlp(cls, config, layer_idx: int) -> nn.Module:
        if axk1_mlp_layer_types(config)[layer_idx] == "dense":
            return LlamaMLP(config, bias=False)
        moe = DeepseekMoe.from_config(config)
        if moe.gate.n_group > 1:
            moe.gate.__class__ = ZeroFilledGroupRouter  # same parameters, transformers' fill
        return moe

    def convert_weight(self, name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if not name.endswith(".self_attn.q_gate_proj.weight"):  # renamed from q_b_proj too
            return super().convert_weight(name, w)
        qk, v = self.q_widths
        rows = w.view(-1, qk + v, w.shape[-1])  # [H, qk + v, 2 q_lora_rank]
        prefix = name.removesuffix("q_gate_proj.weight")
        return (
            (prefix + "q_b_proj.weight", rows[:, :qk].reshape(-1, w.shape[-1])),
            (prefix + "output_gate.weight", rows[:, qk:].reshape(-1, w.shape[-1])),
        )
