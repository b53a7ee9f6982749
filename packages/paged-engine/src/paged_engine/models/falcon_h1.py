"""TII Falcon-H1 (`FalconH1ForCausalLM`: Falcon-H1-0.5B / 1.5B / 3B / 7B / 34B, Falcon-H1R,
Falcon-H1-Tiny): a parallel hybrid. Every layer runs grouped-query attention (RoPE) and a Mamba2
mixer (layers/mamba2.py) side by side on the same normed input and adds their outputs:

    h = rmsnorm(x)
    x += attn(h * attention_in_multiplier) * attention_out_multiplier
         + mamba(h * ssm_in_multiplier) * ssm_out_multiplier
    x += down(up(h') * silu(gate(h') * mlp_multipliers[0])) * mlp_multipliers[1],  h' = rmsnorm(x)

with the embedding times `embedding_multiplier` and the logits times `lm_head_multiplier`.
`key_multiplier` scales the keys; as q . (m k) = m (q . k) it goes into the attention's softmax
scale. `ssm_multipliers` scale the mixer's in_proj output per segment (z, x, B, C, dt: HF's
`mup_vector`, recomputed from the config as HF does). The mixer's inner width is `mamba_d_ssm`
(else `mamba_expand * hidden_size`), its gated RMSNorm optional (`mamba_rms_norm`; without it
y * silu(z)), before or after the gate (`mamba_norm_before_gate`); in_proj's bias is
`mamba_proj_bias`, out_proj's `projectors_bias`.

Every layer holds paged KV and a recurrent state (its layer type is "hybrid": models/hybrid.py).
Tensor parallelism splits the attention heads, the mixer's heads (and its groups, or replicates
a single one) and the MLP as the other models do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from paged_engine.layers.mamba2 import Mamba2Mixer, Mamba2Spec
from paged_engine.layers.norm import RMSNorm
from paged_engine.layers.rotary import RotaryEmbedding, get_rope
from paged_engine.models.granitemoehybrid import mamba_spec
from paged_engine.models.hybrid import HybridModel
from paged_engine.models.llama import LlamaAttention, LlamaForCausalLM, llama_head_dim
from paged_engine.models.utils import cfg_get


def _multiplier(config, name: str) -> float:
    value = getattr(config, name, None)
    return 1.0 if value is None else float(value)


def _multipliers(config, name: str, count: int) -> tuple[float, ...]:
    values = getattr(config, name, None)
    if values is None:
        return (1.0,) * count
    values = tuple(float(v) for v in values)
    if len(values) != count:
        raise ValueError(f"{name} must have {count} entries, got {list(values)}")
    return values


def falcon_h1_mamba2(config) -> Mamba2Spec:
    """Falcon-H1's mamba_* config fields (mamba_d_ssm: the inner width, if set)."""
    d_ssm = getattr(config, "mamba_d_ssm", None)
    inner = int(d_ssm) if d_ssm is not None else int(config.mamba_expand * config.hidden_size)
    return mamba_spec(
        config,
        inner,
        "Falcon-H1's Mamba2",
        1e-5,
        in_multipliers=_multipliers(config, "ssm_multipliers", 5),
        rms_norm=bool(getattr(config, "mamba_rms_norm", False)),
        norm_before_gate=bool(getattr(config, "mamba_norm_before_gate", True)),
        out_bias=bool(getattr(config, "projectors_bias", False)),
    )


class FalconH1MLP(nn.Module):
    """down(up(x) * silu(gate(x) * gate_multiplier)) * down_multiplier: [T, D] -> [T, D]."""

    def __init__(self, config, bias: bool) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], bias)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias)
        self.gate_multiplier, self.down_multiplier = _multipliers(config, "mlp_multipliers", 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # this rank's halves
        return self.down_proj(up * F.silu(gate * self.gate_multiplier)) * self.down_multiplier


class FalconH1DecoderLayer(nn.Module):
    def __init__(
        self, config, layer_idx: int, flags: dict[str, bool], rope: RotaryEmbedding
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, flags, rope)
        # q . (key_multiplier * k) = key_multiplier * (q . k): the keys' multiplier in the scale
        head_dim = llama_head_dim(config)
        self.self_attn.attn.scale = head_dim**-0.5 * _multiplier(config, "key_multiplier")
        self.mamba = Mamba2Mixer(falcon_h1_mamba2(config))
        self.feed_forward = FalconH1MLP(config, flags["mlp_bias"])
        eps = cfg_get(config, "rms_norm_eps", 1e-5)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, eps)
        self.attn_in = _multiplier(config, "attention_in_multiplier")
        self.attn_out = _multiplier(config, "attention_out_multiplier")
        self.ssm_in = _multiplier(config, "ssm_in_multiplier")
        self.ssm_out = _multiplier(config, "ssm_out_multiplier")

    def forward(self, positions, x, kv_cache, md) -> torch.Tensor:  # x: [T, D]
        h = self.input_layernorm(x)
        m = self.mamba(h * self.ssm_in, md) * self.ssm_out
        a = self.self_attn(positions, h * self.attn_in, kv_cache, md) * self.attn_out
        x = x + (m + a)
        return x + self.feed_forward(self.pre_ff_layernorm(x))


class FalconH1ForCausalLM(LlamaForCausalLM):
    # HF's mup_vector is a buffer it recomputes from the config (so do we)
    ignored_weights = ("rotary_emb.inv_freq", "mup_vector")

    def __init__(self, config) -> None:
        act = cfg_get(config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"FalconH1 supports hidden_act='silu' only, got {act!r}")
        flags = self.layer_flags(config)
        rope = get_rope(config, llama_head_dim(config))
        inner = HybridModel(
            config,
            lambda i: FalconH1DecoderLayer(config, i, flags, rope),
            RMSNorm(config.hidden_size, cfg_get(config, "rms_norm_eps", 1e-5)),
            rope,
            embedding_multiplier=_multiplier(config, "embedding_multiplier"),
        )
        super(LlamaForCausalLM, self).__init__(config, inner)
        self.lm_head_multiplier = _multiplier(config, "lm_head_multiplier")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, V] fp32
        return super().compute_logits(hidden) * self.lm_head_multiplier

    def rename_weight(self, name: str) -> str:
        if name.startswith("model.final_layernorm."):
            return "model.norm." + name[len("model.final_layernorm.") :]
        return name
