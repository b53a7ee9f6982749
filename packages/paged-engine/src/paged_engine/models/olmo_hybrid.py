"""OLMo Hybrid (`OlmoHybridForCausalLM`, model_type "olmo_hybrid": Olmo-Hybrid-7B): OLMo 3's
attention layers among Gated DeltaNet linear-attention layers (layers/gated_delta_net.py),
`config.layer_types` saying which is which ("linear_attention" / "full_attention"; HF's default
makes every fourth layer full, 3 linear : 1 full in the released model).

The two layer kinds, as transformers runs them:

    full_attention:   x += post_attn_norm(attn(x));  x += post_ffw_norm(mlp(x))      (OLMo 2's)
    linear_attention: x += mixer(input_norm(x));     x += mlp(post_attn_norm(x))     (Llama's)

every norm OLMo 2's RMSNorm (the weight product in float32, models/olmo2.py), the final one
too. The attention layers are OLMo 2's (whole-projection q / k RMSNorms before RoPE), without a
sliding window, all sharing one rope; a config whose rope_parameters has no rope_theta (the
released checkpoints', says HF) runs them without positional encoding (NoPE), as HF does.

The mixer is Qwen3-Next's Gated DeltaNet (q / k / v through one causal conv and SiLU, GVA, the
L2-normalised delta rule, an RMSNorm gated by silu(gate), each value head) with three changes:
the projections are separate modules (q_proj, k_proj, v_proj, g_proj for the output gate,
b_proj, a_proj; they load as segments of our in_proj_qkvz = q | k | v | z and in_proj_ba =
b | a), beta is doubled when `linear_allow_neg_eigval` is true (the default), and the gated
norm's eps is 1e-5 whatever rms_norm_eps says (FLA's FusedRMSNormGated default, which HF keeps).
The MLPs are Llama's gated SiLU.

Checkpoint names (OLMo-core's, which transformers converts on load and back on save): the
mixer's q_conv1d / k_conv1d / v_conv1d load as segments of our conv1d (transformers' in-memory
fused conv1d, and what transformers saves under those three names, load too: `_load_conv`),
o_proj / o_norm are our out_proj / norm, and `attention_layer_norm` / `feedforward_layer_norm`
are input_layernorm / post_attention_layernorm (transformers saves every
post_attention_layernorm, the attention layers' too, as feedforward_layer_norm).

Tensor parallelism is the two families': the mixer splits key and value heads, the attention
layers their heads (the q / k norms summing their squares over the ranks). Refused by name:
layer_types other than the two above, hidden_act other than SiLU.
"""

from __future__ import annotations

import torch
from torch import nn

from paged_engine.layers.attention import AttentionMetadata
from paged_engine.layers.gated_delta_net import GatedDeltaNet
from paged_engine.layers.linear import copy_checked
from paged_engine.layers.rotary import RotaryEmbedding, get_rope
from paged_engine.models.hybrid import HybridModel, layer_types
from paged_engine.models.kimi_linear import NoRope
from paged_engine.models.llama import LlamaForCausalLM, LlamaMLP, llama_head_dim
from paged_engine.models.mixtral import check_silu
from paged_engine.models.olmo2 import Olmo2DecoderLayer, Olmo2RMSNorm
from paged_engine.models.utils import CausalLMBase, cfg_get

_LAYER_TYPES = ("linear_attention", "full_attention")
_GATED_NORM_EPS = 1e-5

# The mixer's separate projections and convs routed into its merged ones (the linear_attn
# prefix keeps them apart from the attention layers' q_proj / k_proj / v_proj).
OLMO_GDN_RULES = (
    (".linear_attn.in_proj_qkvz.", ".linear_attn.q_proj.", "q"),
    (".linear_attn.in_proj_qkvz.", ".linear_attn.k_proj.", "k"),
    (".linear_attn.in_proj_qkvz.", ".linear_attn.v_proj.", "v"),
    (".linear_attn.in_proj_qkvz.", ".linear_attn.g_proj.", "z"),
    (".linear_attn.in_proj_ba.", ".linear_attn.b_proj.", "b"),
    (".linear_attn.in_proj_ba.", ".linear_attn.a_proj.", "a"),
    (".linear_attn.conv1d.", ".linear_attn.q_conv1d.", "q"),
    (".linear_attn.conv1d.", ".linear_attn.k_conv1d.", "k"),
    (".linear_attn.conv1d.", ".linear_attn.v_conv1d.", "v"),
)


class OlmoGatedDeltaNet(GatedDeltaNet):
    """Gated DeltaNet loading separate q / k / v projections; gated norm eps 1e-5."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.norm.eps = _GATED_NORM_EPS
        fk, _, fv, _ = self.qkvz_sizes
        # LoRA (lora/model.py): each of q / k / v / g_proj adapts its own segment.
        self.in_proj_qkvz.lora_segments = {
            None: (0, sum(self.qkvz_sizes)),
            "q": (0, fk),
            "k": (1, fk),
            "v": (2, fv),
            "z": (3, fv),
        }

    def _load_rows(self, param, w: torch.Tensor, start: int, what: str) -> None:
        """`w`: rows [start, start + len(w)) of the whole-model q | k | v | z layout -> this
        rank's share of them (each segment split by heads) in `param`'s rows."""
        dst = 0  # the local offset of the segment's rows in `param`
        seg_start = 0  # its whole-model offset
        for n in self.qkvz_sizes:
            per = n // self.tp_size
            lo = seg_start + self.tp_rank * per  # the first whole-model row this rank holds
            a, b = max(lo, start), min(lo + per, start + w.shape[0])
            if a < b:
                copy_checked(
                    param.data.narrow(0, dst + a - lo, b - a), w[a - start : b - start], what
                )
            dst, seg_start = dst + per, seg_start + n

    def _load_segment(self, param, w: torch.Tensor, shard_id: str, what: str) -> None:
        """The whole q, k or v segment (`shard_id`) of q | k | v | z."""
        i = "qkv".index(shard_id)
        if w.shape[0] != self.qkvz_sizes[i]:
            raise ValueError(f"{what} has {w.shape[0]} rows, expected {self.qkvz_sizes[i]}")
        self._load_rows(param, w, sum(self.qkvz_sizes[:i]), what)

    def _load_qkvz(self, param, w: torch.Tensor, shard_id: str | None = None) -> None:
        if shard_id in ("q", "k", "v"):
            self._load_segment(param, w, shard_id, f"{shard_id}_proj")
        else:
            super()._load_qkvz(param, w, shard_id)

    def _load_conv(self, param, w: torch.Tensor, shard_id: str | None = None) -> None:
        """transformers' in-memory fused conv1d (shard None); OLMo-core's q / k / v_conv1d; or
        what transformers saves under those names: the fused conv1d cut by torch.chunk into
        three of ceil(C / 3) channels, which are q, k and v only when Hk * Dk == Hv * Dv (a
        chunk has the segment's size exactly when the two layouts coincide)."""
        if shard_id is None:
            super()._load_conv(param, w)
            return
        i = "qkv".index(shard_id)
        chunk = -(-sum(self.qkvz_sizes[:3]) // 3)
        if w.shape[0] != self.qkvz_sizes[i] and w.shape[0] == min(
            chunk, sum(self.qkvz_sizes[:3]) - i * chunk
        ):
            self._load_rows(param, w, i * chunk, f"{shard_id}_conv1d")
        else:
            self._load_segment(param, w, shard_id, f"{shard_id}_conv1d")


class OlmoHybridLinearLayer(nn.Module):
    """A linear-attention layer: norms before the mixer and the MLP."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        eps = cfg_get(config, "rms_norm_eps", 1e-6)
        self.linear_attn = OlmoGatedDeltaNet(config, layer_idx)
        self.mlp = LlamaMLP(config, bias=False)
        self.input_layernorm = Olmo2RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = Olmo2RMSNorm(config.hidden_size, eps)

    def forward(self, positions, x, kv_cache, md: AttentionMetadata) -> torch.Tensor:  # [T, D]
        x = x + self.linear_attn(self.input_layernorm(x), md)
        return x + self.mlp(self.post_attention_layernorm(x))


def olmo_hybrid_rope(config) -> RotaryEmbedding | None:
    """The attention layers' rope; None (NoPE) when rope_parameters names no rope_theta."""
    params = getattr(config, "rope_parameters", None)
    if params is None or params.get("rope_theta") is None:
        return None
    return get_rope(config, llama_head_dim(config), is_neox_style=True)


class OlmoHybridForCausalLM(CausalLMBase):
    stacked_params = (*OLMO_GDN_RULES, *LlamaForCausalLM.stacked_params)
    renames = (
        (".linear_attn.o_proj.", ".linear_attn.out_proj."),
        (".linear_attn.o_norm.", ".linear_attn.norm."),
        (".attention_layer_norm.", ".input_layernorm."),
        (".feedforward_layer_norm.", ".post_attention_layernorm."),
    )
    ignored_weights = ("rotary_emb.inv_freq",)

    def __init__(self, config) -> None:
        check_silu(config, type(self).__name__)
        types = layer_types(config)
        if not set(types) <= set(_LAYER_TYPES):
            raise ValueError(
                f"{type(self).__name__} supports layer_types {_LAYER_TYPES} only, got {types!r}"
            )
        rope = olmo_hybrid_rope(config)
        attn_rope = NoRope() if rope is None else rope

        def build(i: int) -> nn.Module:
            if types[i] == "linear_attention":
                return OlmoHybridLinearLayer(config, i)
            return Olmo2DecoderLayer(config, attn_rope)  # type: ignore[arg-type]

        eps = cfg_get(config, "rms_norm_eps", 1e-6)
        inner = HybridModel(config, build, Olmo2RMSNorm(config.hidden_size, eps), rope)
        super().__init__(config, inner)
