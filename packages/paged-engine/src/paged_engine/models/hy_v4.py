"""Tencent Hy-V4 (`HYV4ForCausalLM`, model_type "hy_v4": Hy4-preview).

GLM-5's DeepSeek Sparse Attention model (models/deepseek_v32.py: V3's absorbed MLA, a DSA
indexer on "full" `indexer_types` layers whose choice "shared" layers reuse, V3's MoE after
dense layers by `mlp_layer_types`) with these differences, each as transformers runs it:

    streams    hc_mult residual streams [T, N, D], the embedding copied into each. Before each
               sublayer `attn_hc` / `ffn_hc` map the flattened streams in float32:
               m = (fn @ flat) * rsqrt(mean(flat^2) + rms_norm_eps), fn [2N, N * D];
               pre = sigmoid(m[:N] * scale[0] + base[:N]) + hc_eps, post = hc_magnitude *
               sigmoid(m[N:] * scale[1] + base[N:]) + hc_eps. The sublayer (after its RMSNorm)
               runs on sum_i pre_i x_i and the streams become post_j * out + x_j: DeepSeek-V4's
               hyper-connection without the comb mixing and its Sinkhorn steps. `hc_head`
               (V4's, models/hyper_connections.py) collapses them before the final norm
    attention  a sigmoid output gate: head h's output times sigmoid(gate_proj(x))[h]
               ([H * v_head_dim] a token) before o_proj; a learned float32 sink logit a head
               (`sinks`) joins each query's softmax (over its chosen keys) and is dropped
    indexer    its rope rotates the LAST qk_rope_head_dim dims of the indexer queries and key
               ((even, odd) pairs, the model's cos / sin), not the first; the key's LayerNorm
               uses rms_norm_eps (not 1e-6). The score is GLM-5's (transformers folds
               index_head_dim^-0.5 into the head weights: relu commutes with it)
    experts    the routed experts clamp SwiGLU: silu(min(gate, L)) * clamp(up, -L, L),
               L = swiglu_limit; the dense MLPs and the shared expert do not
    router     V3's biased sigmoid top-k over one group (n_group 1), renormalized by
               norm_topk_prob, times routed_scaling_factor

The cache is V3.2's widened latent row ([c | rope(k_pe) | indexer key] on full layers). Under
tensor parallelism the gate rows and the sinks split by head like q_b_proj's.

Refused by name: pipeline parallelism (the streams stay on one stage), swiglu_limit <= 0
(transformers' config says it disables the clamp, its experts clamp at it anyway), and, as
V3.2: q_lora_rank None, bad `indexer_types`, CUDA graphs and speculative_config method "mtp".
transformers keeps lm_head in float32; we run it in the model dtype. The checkpoint's
`model.mtp_layers.*` are skipped, as transformers skips them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.distributed.parallel_state import get_parallel_state, get_tp_rank
from paged_engine.layers.activation import ClampedSiluAndMul
from paged_engine.layers.attention import AttentionMetadata
from paged_engine.layers.deepseek_moe import DeepseekMoe, num_routed_experts
from paged_engine.layers.embedding import VocabParallelEmbedding
from paged_engine.layers.fused_moe import ActExperts
from paged_engine.layers.linear import ColumnParallelLinear
from paged_engine.layers.norm import RMSNorm
from paged_engine.layers.rotary import RotaryEmbedding
from paged_engine.models.deepseek_v32 import (
    Choices,
    DsaAttention,
    DsaIndexer,
    GlmMoeDsaForCausalLM,
    SparseLatentAttention,
    indexer_types,
)
from paged_engine.models.hyper_connections import HyperHead, fp32_param, unit_rms
from paged_engine.models.mixtral import check_silu, expert_rules
from paged_engine.models.utils import CausalLMBase, make_layers


class HyV4Indexer(DsaIndexer):
    """V3.2's indexer with rope on the last dims and the key norm at rms_norm_eps."""

    rope_tail = True

    def __init__(self, config, rope: RotaryEmbedding, neox: bool) -> None:
        super().__init__(config, rope, neox)
        self.k_norm.eps = float(config.rms_norm_eps)


class SinkSparseLatentAttention(SparseLatentAttention):
    """The sparse latent attention with a float32 sink logit a head (this rank's heads)."""

    def __init__(self, num_heads: int, *args, **kwargs) -> None:
        super().__init__(num_heads, *args, **kwargs)
        self.sinks = fp32_param(num_heads)
        self.sinks.weight_loader = self._load_sinks
        self.tp_rank = get_tp_rank()

    def _load_sinks(self, param: nn.Parameter, w: torch.Tensor) -> None:
        n = param.shape[0]
        if w.shape[0] < (self.tp_rank + 1) * n:
            raise ValueError(f"sinks: {tuple(w.shape)} holds fewer than {n} heads a rank")
        param.data.copy_(w[self.tp_rank * n : (self.tp_rank + 1) * n])

    def attend_rows(self, q, latent, keep) -> torch.Tensor:  # [R, H, W] over [L, 1, W]
        r = q.shape[0]
        scores = torch.einsum("rhd,ld->rhl", q.float(), latent[:, 0].float()) * self.scale
        scores = scores.masked_fill(~keep[:, None], float("-inf"))
        sink = self.sinks.float().view(1, -1, 1).expand(r, -1, 1)
        probs = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1]
        return torch.einsum("rhl,ld->rhd", probs, latent[:, 0].float()).to(q.dtype)


class HyV4Attention(DsaAttention):
    """DSA attention with Hy-V4's indexer, sinks and sigmoid output gate."""

    indexer_cls = HyV4Indexer
    sparse_cls = SinkSparseLatentAttention

    def __init__(self, config, rope: RotaryEmbedding, full: bool, choices: Choices) -> None:
        super().__init__(config, rope, full, choices, neox_index_rope=False)
        heads = int(config.num_attention_heads)
        # HF's `gate_proj`: renamed apart from the MLPs' gate_proj, which stack into gate_up_proj
        self.output_gate = ColumnParallelLinear(config.hidden_size, heads * self.v_dim, bias=False)

    def gate_heads(self, gate_in: torch.Tensor, o: torch.Tensor) -> torch.Tensor:  # [T, H, v]
        return o * torch.sigmoid(self.output_gate(gate_in).view(o.shape))  # gate_in: x [T, D]


class IndependentHyperConnection(nn.Module):
    """`attn_hc` / `ffn_hc` (models/hyper_connections.py's without comb): streams [T, N, D] ->
    (post [T, N] float32, collapsed [T, D])."""

    def __init__(self, config) -> None:
        super().__init__()
        n = self.n = int(config.hc_mult)
        self.hc_eps, self.eps = float(config.hc_eps), float(config.rms_norm_eps)
        self.magnitude = float(config.hc_magnitude)
        self.fn = fp32_param(2 * n, n * config.hidden_size)
        self.base, self.scale = fp32_param(2 * n), fp32_param(2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mixes = F.linear(unit_rms(x.flatten(1).float(), self.eps), self.fn.float())
        pre_w, post_w = mixes.split(self.n, dim=-1)
        pre_b, post_b = self.base.split(self.n)
        pre = torch.sigmoid(pre_w * self.scale[0] + pre_b) + self.hc_eps
        post = self.magnitude * torch.sigmoid(post_w * self.scale[1] + post_b) + self.hc_eps
        return post, (pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)


class HyV4DecoderLayer(nn.Module):
    """`attn_hc` -> norm -> DSA attention, `ffn_hc` -> norm -> MLP; streams [T, N, D]."""

    def __init__(
        self, config, rope: RotaryEmbedding, full: bool, choices: Choices, mlp: nn.Module
    ) -> None:
        super().__init__()
        eps = float(config.rms_norm_eps)
        self.self_attn = HyV4Attention(config, rope, full, choices)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.attn_hc = IndependentHyperConnection(config)
        self.ffn_hc = IndependentHyperConnection(config)

    def forward(self, positions, streams, kv_cache, md: AttentionMetadata) -> torch.Tensor:
        dtype = streams.dtype
        post, x = self.attn_hc(streams)
        h = self.self_attn(positions, self.input_layernorm(x), kv_cache, md)
        streams = (post.unsqueeze(-1) * h.float().unsqueeze(1) + streams.float()).to(dtype)
        post, x = self.ffn_hc(streams)
        h = self.mlp(self.post_attention_layernorm(x))
        return (post.unsqueeze(-1) * h.float().unsqueeze(1) + streams.float()).to(dtype)


class HyV4Model(nn.Module):
    def __init__(self, config, rope: RotaryEmbedding, build_mlp) -> None:
        super().__init__()
        if get_parallel_state().pp_size > 1:
            raise ValueError(
                "Hy-V4 does not support pipeline parallelism (its hyper-connection streams "
                "stay on one stage)"
            )
        types, choices = indexer_types(config), {}
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = rope
        self.layers, self.stage = make_layers(
            config.num_hidden_layers,
            lambda i: HyV4DecoderLayer(
                config, rope, types[i] == "full", choices, build_mlp(config, i)
            ),
        )
        self.hc_head = HyperHead(config)
        self.norm = RMSNorm(config.hidden_size, float(config.rms_norm_eps))
        self.streams = int(config.hc_mult)

    def forward(self, input_ids, positions, kv_caches, md, hidden=None) -> torch.Tensor:
        x = self.embed_tokens(input_ids) if hidden is None else hidden  # [T, D]
        streams = x.unsqueeze(1).expand(-1, self.streams, -1).contiguous()
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            streams = layer(positions, streams, kv_cache, md)
        return self.norm(self.hc_head(streams))


class HYV4ForCausalLM(GlmMoeDsaForCausalLM):
    """GLM-5's rope, cache layout and MTP refusal; Hy-V4's stack (module docstring)."""

    # The release's names (transformers' conversion mapping), then transformers' own.
    renames = (
        (".hc_pre.hc_", ".hc_"),
        (".hc_attn_layer.hc_", ".attn_hc."),
        (".hc_mlp_layer.hc_", ".ffn_hc."),
        (".hc_head_", ".hc_"),
        (".learnable_sink_param", ".attn.sinks"),
        (".self_attn.linear_gate.", ".self_attn.output_gate."),
        (".linear_gate.", ".gate_proj."),
        (".self_attn.sinks", ".self_attn.attn.sinks"),
        (".self_attn.gate_proj.", ".self_attn.output_gate."),  # not the MLPs' stacked gate
    )

    def __init__(self, config) -> None:
        check_silu(config, type(self).__name__)
        if float(config.swiglu_limit) <= 0:
            raise ValueError(
                f"swiglu_limit={config.swiglu_limit}: a clamp at or below 0 is not supported "
                "(transformers' config calls it disabled, its experts clamp at it)"
            )
        inner = HyV4Model(config, self.build_rope(config), type(self).build_mlp)
        CausalLMBase.__init__(self, config, inner)
        # Expert rules first: the dense and shared MLPs' ".gate_proj" also matches an expert's.
        rules = expert_rules(num_routed_experts(config), "gate_proj", "up_proj", "down_proj")
        self.stacked_params = (*rules, *type(self).stacked_params)

    @classmethod
    def build_mlp(cls, config, layer_idx: int) -> nn.Module:
        """GLM-4.7-Flash's dense / sparse MLP by `mlp_layer_types`, routed experts clamped."""
        mlp = super().build_mlp(config, layer_idx)
        if isinstance(mlp, DeepseekMoe):
            e = mlp.experts
            act = ClampedSiluAndMul(float(config.swiglu_limit))
            mlp.experts = ActExperts(act, e.num_experts, e.hidden_size, e.intermediate_size)
        return mlp

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True
    ) -> set[str]:
        kept = ((n, w) for n, w in weights if ".mtp_layers." not in n)
        return super().load_weights(kept, strict)
