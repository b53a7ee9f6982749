"""GLM-5.3-Flash's linear attention (transformers' `Glm5NextTextLinearAttention`), also Ling /
Ring 2.5's (`BailingHybridDeltaAttention`): Kimi Delta Attention (layers/kda.py) with its
forget gate and output gate made hooks, as transformers runs them.

    forget gate  raw = f_b_proj(f_a_proj(x)) + dt_bias, float32 [T, H, D]; with
                 `linear_lower_bound` L set (the release: -5, "safe gate")
                     g = L * sigmoid(exp(A_log[h]) * raw)
                 so every per-channel log decay lies in (L, 0); with L None, Kimi's
                 g = -exp(A_log[h]) * softplus(raw)
    output gate  sigmoid(g_b_proj(g_a_proj(x))) on the RMS-normed heads (Kimi's)

Everything else (q / k / v with one fused depthwise conv and SiLU, L2-normed q and k, the
per-head write strength beta, the delta rule, the state pools, tensor parallelism, the
checkpoint names under `self_attn.` and `self_attn.forget_gate.`) is KimiDeltaAttention's.
`Glm5NextDeltaAttention.decay` / `.output_gate` are what a variant overrides (models/
bailing_hybrid.py: one f_proj and one g_proj instead of the bottlenecks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paged_engine.attention.backend import AttentionMetadata
from paged_engine.layers.kda import KimiDeltaAttention


class Glm5NextDeltaAttention(KimiDeltaAttention):
    def __init__(self, config, layer_idx: int, lower_bound: float | None) -> None:
        super().__init__(config, layer_idx)
        self.lower_bound = None if lower_bound is None else float(lower_bound)

    def gate_input(self, x: torch.Tensor) -> torch.Tensor:
        """The forget gate's pre-activation before dt_bias, [T, H_local * D]."""
        return self.f_b_proj(self.f_a_proj(x))

    def decay(self, x: torch.Tensor) -> torch.Tensor:
        """The per-channel log decay g [T, H, D] float32 (module docstring)."""
        t = x.shape[0]
        raw = (self.gate_input(x).float() + self.dt_bias.float()).view(t, self.heads, -1)
        rate = self.A_log.float().exp()[:, None]
        if self.lower_bound is not None:
            return self.lower_bound * torch.sigmoid(rate * raw)
        return -rate * F.softplus(raw)

    def output_gate(self, x: torch.Tensor) -> torch.Tensor:
        """The output norm's gate logits [T, H_local * D]."""
        return self.g_b_proj(self.g_a_proj(x))

    def forward(self, x: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:  # [T, D] -> [T, D]
        assert self.conv_state is not None and self.ssm_state is not None, "allocate_state() first"
        t, h, d = x.shape[0], self.heads, self.head_dim
        slots, has_state = md.state_rows()
        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        mixed = self.run_conv(self.conv1d, mixed, md, slots, has_state)
        q, k, v = (part.reshape(t, h, d) for part in mixed.split([self.dim] * 3, dim=-1))
        beta = self.b_proj(x).sigmoid()
        o = md.backend.gated_delta_rule(
            q, k, v, self.decay(x), beta, self.ssm_state, md.cu_seqlens_q, slots, has_state
        )
        o = self.o_norm(o, self.output_gate(x).view(t, h, d))
        return self.o_proj(o.reshape(t, self.dim))
