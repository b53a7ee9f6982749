"""JetMoE (`JetMoeForCausalLM`: JetMoE-8B).

Mixtral's pre-RMSNorm decoder (models/mixtral.py) with a mixture of attention heads (MoA) in
place of the attention, as transformers runs it:
- one router (`experts.router.layer`, no bias) per attention block picks top-k of E attention
  experts per token: softmax over the k best logits (Mixtral's renormalized routing);
- each expert owns a query projection [kv_heads * D, H] (`experts.input_linear`) and an output
  projection [H, kv_heads * D] (`experts.output_linear`); k and v come from one shared projection
  `kv_proj` (k rows, then v rows), kv_heads heads of D = `kv_channels`;
- the k chosen experts' queries make k * kv_heads heads (so num_attention_heads is
  num_key_value_heads * num_experts_per_tok); HF repeats the k / v heads whole, so query head
  slot * kv_heads + j reads kv head j; full NeoX RoPE on q and k; scale D^-0.5;
- each slot's attention output goes through its expert's output projection, times its gate; the
  sum plus a bias of the block (`experts.bias` [H]) is the attention's output.
The MLP is a sparse MoE of gated SiLU experts (`input_linear` [E, 2I, H] gate rows then up rows,
`output_linear` [E, H, I]) routed like the attention, plus a bias of the block (`mlp.bias`). The
layers' two RMSNorms use eps 1e-6 whatever the config says (HF builds them without it); the final
norm uses `rms_norm_eps`. The LM head is tied by default.

Here the query heads are held grouped by kv head (head j * k + slot), so grouped-query attention
reads kv head j for each; all E experts' queries are computed in one matmul and the chosen ones
gathered, and the output projections run as one matmul over the gated slots scattered to their
experts' columns. Under tensor parallelism a rank holds whole kv heads: its rows of every query
expert and of k / v, its columns of every output expert (partial sums all-reduced).
Refused by name: an `activation_function` other than silu.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.distributed.communication import tp_all_reduce
from paged_engine.distributed.parallel_state import get_tp_rank, get_tp_size
from paged_engine.layers.attention import Attention, AttentionMetadata
from paged_engine.layers.fused_moe import MoeRouter, SparseMoeBlock, route
from paged_engine.layers.linear import MergedColumnParallelLinear, copy_checked
from paged_engine.layers.norm import RMSNorm
from paged_engine.layers.rotary import RotaryEmbedding
from paged_engine.models.llama import LlamaModel, PreNormDecoderLayer
from paged_engine.models.utils import CausalLMBase, cfg_get

_LAYER_NORM_EPS = 1e-6  # HF's JetMoeRMSNorm default: the layers' norms ignore rms_norm_eps

# (HF's name fragment, ours), applied in order
_RENAMES = (
    (".self_attention.experts.router.layer.", ".self_attn.router."),
    (".self_attention.experts.input_linear.weight", ".self_attn.q_experts"),
    (".self_attention.experts.output_linear.weight", ".self_attn.o_experts"),
    (".self_attention.experts.bias", ".self_attn.bias"),
    (".self_attention.", ".self_attn."),
    (".mlp.router.layer.", ".mlp.gate."),
    (".mlp.input_linear.weight", ".mlp.experts.gate_up_proj"),
    (".mlp.output_linear.weight", ".mlp.experts.down_proj"),
)


class JetMoeAttention(nn.Module):
    """Mixture of attention heads: [T, H] -> [T, H] (see the module docstring)."""

    def __init__(self, config, rope: RotaryEmbedding):
        super().__init__()
        hidden, d = config.hidden_size, config.kv_channels
        kv_heads, self.top_k = config.num_key_value_heads, config.num_experts_per_tok
        self.num_experts = config.num_local_experts
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        if kv_heads % self.tp_size:
            raise ValueError(
                f"JetMoE's num_key_value_heads={kv_heads} is not divisible by "
                f"tensor_parallel_size={self.tp_size}"
            )
        self.head_dim, self.kv_heads = d, kv_heads // self.tp_size  # this rank's kv heads
        self.width = self.kv_heads * d  # one expert's query rows on this rank
        self.router = MoeRouter(self.num_experts, hidden)  # replicated
        # every expert's query rows for this rank's kv heads [E, width, H]
        self.q_experts = nn.Parameter(torch.empty(self.num_experts, self.width, hidden))
        self.q_experts.weight_loader = self._load_q
        # every expert's output columns [H, E * width] (HF's [E, H, kv_heads * D] permuted)
        self.o_experts = nn.Parameter(torch.empty(hidden, self.num_experts * self.width))
        self.o_experts.weight_loader = self._load_o
        self.bias = nn.Parameter(torch.empty(hidden))  # added once, after the all-reduce
        full = kv_heads * d
        self.kv_proj = MergedColumnParallelLinear(hidden, [full, full], bias=False)
        self.rotary_emb = rope
        heads = self.top_k * self.kv_heads
        self.attn = Attention(heads, d, self.kv_heads, d**-0.5)

    def _load_q(self, param: nn.Parameter, w: torch.Tensor) -> None:  # w [E, kv_heads * D, H]
        begin = self.tp_rank * self.width
        copy_checked(param.data, w[:, begin : begin + self.width], "attention query experts")

    def _load_o(self, param: nn.Parameter, w: torch.Tensor) -> None:  # w [E, H, kv_heads * D]
        begin = self.tp_rank * self.width
        dst = param.data.view(param.shape[0], self.num_experts, self.width).transpose(0, 1)
        copy_checked(dst, w[:, :, begin : begin + self.width], "attention output experts")

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,  # [T, H]
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        md: AttentionMetadata,
    ) -> torch.Tensor:
        t, e, k, w = x.shape[0], self.num_experts, self.top_k, self.width
        gates, ids = route(self.router(x), k, renormalize=True)  # [T, k] each, best first
        slots = ids[:, :, None].expand(t, k, w)
        q_all = F.linear(x, self.q_experts.view(e * w, -1)).view(t, e, w)
        q = q_all.gather(1, slots)  # [T, slot, kv head * D]
        # heads grouped by kv head: head j * k + slot reads kv head j
        q = q.view(t, k, self.kv_heads, self.head_dim).transpose(1, 2).reshape(t, -1)
        key, value = self.kv_proj(x).chunk(2, dim=-1)
        q, key = self.rotary_emb(positions, q, key)
        o = self.attn(q, key, value, kv_cache, md)  # [T, kv head * slot * D]
        o = o.view(t, self.kv_heads, k, self.head_dim).transpose(1, 2).reshape(t, k, w)
        gated = (o * gates[:, :, None].to(o.dtype)).to(x.dtype)
        spread = x.new_zeros(t, e, w).scatter_(1, slots, gated)  # each slot at its expert
        out = F.linear(spread.view(t, e * w), self.o_experts)
        if self.tp_size > 1:
            out = tp_all_reduce(out)
        return out + self.bias


class JetMoeMoE(SparseMoeBlock):
    """Mixtral's sparse MoE block plus a bias [H] added after the all-reduce (HF's `mlp.bias`)."""

    def __init__(self, config):
        super().__init__(
            config.num_local_experts,
            config.num_experts_per_tok,
            config.hidden_size,
            config.intermediate_size,
            renormalize=True,
        )
        self.bias = nn.Parameter(torch.empty(config.hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.bias


class JetMoeDecoderLayer(PreNormDecoderLayer):
    def __init__(self, config, rope: RotaryEmbedding):
        super().__init__()
        self.self_attn = JetMoeAttention(config, rope)
        self.mlp = JetMoeMoE(config)
        self.input_layernorm = RMSNorm(config.hidden_size, _LAYER_NORM_EPS)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, _LAYER_NORM_EPS)


class JetMoeForCausalLM(CausalLMBase):
    tie_default = True
    renames = _RENAMES
    # HF's fused kv_proj [k rows | v rows], split by convert_weight, into our merged halves
    stacked_params = ((".kv_proj.", ".k_proj.", 0), (".kv_proj.", ".v_proj.", 1))
    ignored_weights = ("rotary_emb.inv_freq",)

    def __init__(self, config):
        act = cfg_get(config, "activation_function", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(
                f"JetMoeForCausalLM supports activation_function='silu' only, got {act!r}"
            )
        inner = LlamaModel(config, {}, lambda i, rope: JetMoeDecoderLayer(config, rope))
        super().__init__(config, inner)

    def convert_weight(self, name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if ".self_attn.kv_proj." not in name:
            yield name, w
            return
        k, v = w.chunk(2, dim=0)
        yield name.replace(".kv_proj.", ".k_proj."), k
        yield name.replace(".kv_proj.", ".v_proj."), v
