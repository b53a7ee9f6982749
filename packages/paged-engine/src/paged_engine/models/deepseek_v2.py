"""DeepSeek-V2 / V3 (`DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`: DeepSeek-V2-Lite, V2,
V2.5, V3, R1, Moonlight, Kimi K2): multi-head latent attention (MLA) and DeepSeek's MoE.

MLA compresses a token's keys and values into one latent vector c = norm(W_DKV x) of
kv_lora_rank entries (512) plus one rotary key k_pe of qk_rope_head_dim entries (64) shared by
all heads. Head h's key is [W_UK[h] c, k_pe] and its value W_UV[h] c (kv_b_proj holds W_UK and
W_UV, [H * (nope + v), kv_lora_rank]); its query [q_nope, q_pe] comes from x directly (q_proj)
or through a low-rank bottleneck (q_a_proj, q_a_layernorm, q_b_proj).

We cache the latent, not the per-head keys and values ("absorbed" MLA, as the paper's
inference section describes): the cache holds [c, rope(k_pe)] a token (576 entries for V3
instead of 128 heads x 2 x 128), one tensor per layer that is both its key and value cache
(worker/cache_engine.py `latent_kv`). A query head becomes q' = [W_UK[h]^T q_nope, rope(q_pe)],
so q' . [c, k_pe] = q_nope . (W_UK[h] c) + q_pe . k_pe, the same score; attention over the
latent as one KV head gives o' = sum_j p_j [c_j, k_pe_j], whose first kv_lora_rank entries
times W_UV[h] are head h's output. The paged attention kernels run it unchanged (one KV head,
head size kv_lora_rank + qk_rope_head_dim, values read from the key cache): on CUDA
paged_kernels.mla_attention, which holds the 512 latent and 64 rope columns as two tiles.

RoPE rotates (even, odd) pairs (GPT-J style): HF's V3 `rope_interleave` permutes the rotated
dims of q and k alike, and V2's complex rotation is pair-wise, so the scores equal ours; a V3
config with `rope_interleave: false` rotates NeoX halves, as HF does then. YaRN's
`mscale_all_dim` scales the softmax by mscale^2 on top of qk_head_dim^-0.5.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from paged_engine.distributed.parallel_state import get_tp_rank, get_tp_size
from paged_engine.layers.attention import AttentionMetadata, LatentAttention
from paged_engine.layers.deepseek_moe import DeepseekMoe, is_dense_layer, num_routed_experts
from paged_engine.layers.embedding import VocabParallelEmbedding
from paged_engine.layers.linear import ColumnParallelLinear, RowParallelLinear
from paged_engine.layers.norm import RMSNorm
from paged_engine.layers.rotary import RotaryEmbedding, rope_config
from paged_engine.models.llama import (
    LlamaMLP,
    PreNormDecoderLayer,
    StreamCapture,
    keeps_stream_apart,
    run_layers,
    stage_input,
)
from paged_engine.models.mixtral import check_silu, expert_rules
from paged_engine.models.utils import CausalLMBase, cfg_get, deepseek_rope, make_layers


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def mla_softmax_scale(config) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (DeepSeek's)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    _, scaling, _ = rope_config(config)
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        mscale_all = scaling.get("mscale_all_dim", 0)
        if kind != "default" and mscale_all:
            scale *= _yarn_mscale(float(scaling["factor"]), float(mscale_all)) ** 2
    return scale


class _HeadRows(nn.Module):
    """kv_b_proj's weight, this rank's heads' rows [H_local * (nope + v), kv_lora_rank], used
    as two batched matrices (W_UK, W_UV) and never as a linear layer (so never quantized)."""

    def __init__(self, num_heads: int, rows_per_head: int, rank: int, tp_rank: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_heads * rows_per_head, rank))
        self.weight.weight_loader = self._load
        self.num_heads, self.rows_per_head, self.tp_rank = num_heads, rows_per_head, tp_rank

    def _load(self, param: nn.Parameter, w: torch.Tensor, shard_id=None) -> None:
        n = param.shape[0]
        if w.shape[1:] != param.shape[1:] or w.shape[0] < (self.tp_rank + 1) * n:
            raise ValueError(f"kv_b_proj weight {tuple(w.shape)} does not fit {tuple(param.shape)}")
        param.data.copy_(w[self.tp_rank * n : (self.tp_rank + 1) * n])

    def heads(self) -> torch.Tensor:  # [H_local, nope + v, kv_lora_rank]
        return self.weight.view(self.num_heads, self.rows_per_head, -1)


class MlaAttention(nn.Module):
    def __init__(self, config, rope: RotaryEmbedding) -> None:
        super().__init__()
        hidden = config.hidden_size
        num_heads = config.num_attention_heads
        tp_size, tp_rank = get_tp_size(), get_tp_rank()
        if num_heads % tp_size:
            raise ValueError(f"num_attention_heads={num_heads} not divisible by tp_size={tp_size}")
        self.heads = num_heads // tp_size  # this rank's
        self.nope, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.rank = config.v_head_dim, config.kv_lora_rank
        qk = self.nope + self.rope_dim
        bias = bool(getattr(config, "attention_bias", False))
        # The latent norms keep RMSNorm's default eps whatever rms_norm_eps says, as every
        # transformers MLA model (DeepSeek V2 / V3, GLM-4.7-Flash, MiniCPM3, Kimi...) builds them.
        eps = 1e-6
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, num_heads * qk, bias=False)
        else:  # the bottleneck is replicated; q_b_proj's rows split by head
            self.q_a_proj = ColumnParallelLinear(
                hidden, self.q_lora_rank, bias=bias, tp_rank=0, tp_size=1
            )
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, num_heads * qk, bias=False)
        # The latent and the rotary key: computed whole on every rank (the cache is replicated).
        self.kv_a_proj_with_mqa = ColumnParallelLinear(
            hidden, self.rank + self.rope_dim, bias=bias, tp_rank=0, tp_size=1
        )
        self.kv_a_layernorm = RMSNorm(self.rank, eps)
        self.kv_b_proj = _HeadRows(self.heads, self.nope + self.v_dim, self.rank, tp_rank)
        self.o_proj = RowParallelLinear(num_heads * self.v_dim, hidden, bias=bias)
        self.rotary_emb = rope  # shared by all layers
        latent = self.rank + self.rope_dim  # one KV "head" of the latent and the rotary key
        self.attn = LatentAttention(self.heads, latent, self.rank, mla_softmax_scale(config))

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        x: torch.Tensor,  # [T, D]
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # one latent tensor twice
        md: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        q, q_resid, gate_in = self.project_q(x)
        q_nope, q_pe = q.view(t, self.heads, -1).split([self.nope, self.rope_dim], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)
        c = self.kv_a_layernorm(c.contiguous())
        q_pe, k_pe = self.rotary_emb(positions, q_pe.reshape(t, -1), k_pe.contiguous())
        w_uk, w_uv = self.kv_b_proj.heads().split([self.nope, self.v_dim], dim=1)
        # q_nope [H, T, nope] @ W_UK [H, nope, rank] -> the queries in latent space
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, rank]
        q_full = torch.cat((q_latent, q_pe.view(t, self.heads, -1)), dim=-1).reshape(t, -1)
        q_full = self.scale_queries(positions, q_full)
        latent = torch.cat((c, k_pe), dim=-1)  # [T, rank + rope]
        k, v = self.cache_rows(positions, x, q_resid, latent)
        out = self.attn(q_full, k, v, kv_cache, md).view(t, self.heads, -1)
        # o' [H, T, rank] @ W_UV^T [H, rank, v] -> each head's output
        o = torch.bmm(out[..., : self.rank].transpose(0, 1), w_uv.transpose(1, 2))
        o = self.gate_heads(gate_in, o.transpose(0, 1))  # [T, H, v]
        return self.o_proj(o.reshape(t, -1))

    def project_q(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """x [T, D] -> (q [T, H_local * (nope + rope)], the normed bottleneck q_resid [T,
        q_lora_rank] (None without one), what `gate_heads` reads: x here)."""
        if self.q_lora_rank is None:
            return self.q_proj(x), None, x
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        return self.q_b_proj(q_resid), q_resid, x

    def cache_rows(
        self, positions: torch.Tensor, x: torch.Tensor, q_resid, latent: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What the attention gets as keys and values: the latent row [T, rank + rope] it
        caches, twice, here (DeepSeek Sparse Attention widens the row with its indexer key)."""
        return latent, latent

    def gate_heads(self, gate_in: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """Each head's output o [T, H_local, v] before o_proj: unchanged here."""
        return o

    def scale_queries(self, positions: torch.Tensor, q_full: torch.Tensor) -> torch.Tensor:
        """The absorbed queries [T, H_local * (rank + rope)] before attention: unchanged here.
        A subclass may scale them per token (scaling all of a token's q' scales its scores as
        scaling HF's q would)."""
        return q_full


class DeepseekDecoderLayer(PreNormDecoderLayer):
    def __init__(
        self,
        config,
        layer_idx: int,
        rope: RotaryEmbedding,
        mlp: nn.Module,
        attention_cls: type[MlaAttention] = MlaAttention,
    ) -> None:
        super().__init__()
        eps = cfg_get(config, "rms_norm_eps", 1e-6)
        self.self_attn = attention_cls(config, rope)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)


class DeepseekModel(nn.Module):
    def __init__(
        self,
        config,
        build_mlp,
        attention_cls: type[MlaAttention] = MlaAttention,
        rope: RotaryEmbedding | None = None,  # None: DeepSeek's, over qk_rope_head_dim
        layer_cls: type[DeepseekDecoderLayer] | None = None,
        embedding_multiplier: float | None = None,  # MiniCPM3's scale_emb
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.embedding_multiplier = embedding_multiplier
        layer_cls = layer_cls or DeepseekDecoderLayer
        rope = deepseek_rope(config) if rope is None else rope
        self.rotary_emb = rope
        self.layers, self.stage = make_layers(
            config.num_hidden_layers,
            lambda i: layer_cls(config, i, rope, build_mlp(config, i), attention_cls),
        )
        self.norm = RMSNorm(config.hidden_size, cfg_get(config, "rms_norm_eps", 1e-6))
        self.stream_apart = keeps_stream_apart(self.stage.layers(self.layers))

    # Set by an EAGLE-3 draft runner for the engine's life (spec_decode/eagle.py)
    stream_capture: StreamCapture | None = None

    def forward(self, input_ids, positions, kv_caches, md, hidden=None) -> torch.Tensor:
        x = stage_input(self, input_ids, hidden)
        layers = list(self.stage.layers(self.layers))
        norm = self.norm if self.stage.is_last else None
        return run_layers(
            layers, self.stream_apart, positions, x, kv_caches, md, norm, None, self.stream_capture
        )


class DeepseekV2ForCausalLM(CausalLMBase):
    """DeepSeek-V2 / V2.5 (softmax routers: `topk_method` greedy or group_limited_greedy); V3
    and its descendants differ only in the router (layers/deepseek_moe.py reads it from the
    config). Layers before first_k_dense_replace have a dense MLP, the rest DeepSeek's MoE."""

    # Only the MLPs stack (gate | up); MLA's projections load one by one.
    stacked_params = (
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    )
    ignored_weights = ("rotary_emb.inv_freq",)
    attention_cls: type[MlaAttention] = MlaAttention  # a subclass's may scale the queries

    def __init__(self, config) -> None:
        check_silu(config, type(self).__name__)
        cls = type(self)
        inner = DeepseekModel(config, cls.build_mlp, cls.attention_cls, cls.build_rope(config))
        super().__init__(config, inner)
        # Expert rules first: the dense and shared MLPs' ".gate_proj" also matches an expert's.
        rules = expert_rules(num_routed_experts(config), "gate_proj", "up_proj", "down_proj")
        self.stacked_params = (*rules, *type(self).stacked_params)

    @classmethod
    def build_rope(cls, config) -> RotaryEmbedding | None:
        """The rope all layers share; None: DeepseekModel's (GPT-J style, qk_rope_head_dim)."""
        return None

    @classmethod
    def build_mlp(cls, config, layer_idx: int) -> nn.Module:
        if is_dense_layer(config, layer_idx):
            return LlamaMLP(config, bias=False)
        return DeepseekMoe.from_config(config)


def head_dim_sized_rope(config) -> RotaryEmbedding:
    """deepseek_rope for a model whose HF rope tables are head_dim wide (Youtu, A.X K1): a
    head_dim other than qk_rope_head_dim would not fit q_pe there, and is refused."""
    head_dim = getattr(config, "head_dim", None)
    if head_dim is not None and head_dim != config.qk_rope_head_dim:
        raise ValueError(
            f"config head_dim={head_dim} is not supported for model_type "
            f"{config.model_type!r}: it must be qk_rope_head_dim={config.qk_rope_head_dim}"
        )
    return deepseek_rope(config)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3 / R1, Moonlight, Kimi K2: sigmoid routers with a correction bias."""


class Glm4MoeLiteForCausalLM(DeepseekV2ForCausalLM):
    """GLM-4.7-Flash: DeepSeek-V3's attention and MoE; `mlp_layer_types` names each layer's MLP
    ("dense" or "sparse") instead of first_k_dense_replace."""

    @classmethod
    def build_mlp(cls, config, layer_idx: int) -> nn.Module:
        types = getattr(config, "mlp_layer_types", None)
        if types is None:
            return super().build_mlp(config, layer_idx)
        if len(types) != config.num_hidden_layers or types[layer_idx] not in ("dense", "sparse"):
            raise ValueError(f"mlp_layer_types must be 'dense' / 'sparse' a layer, got {types}")
        if types[layer_idx] == "dense":
            return LlamaMLP(config, bias=False)
        return DeepseekMoe.from_config(config)

    @classmethod
    def build_rope(cls, config) -> RotaryEmbedding:
        rope = deepseek_rope(config)
        if rope.rotary_dim != config.qk_rope_head_dim:  # HF's cos / sin would not fit q_pe
            raise ValueError(
                f"config partial_rotary_factor={rope_config(config)[2]} is not supported for "
                f"model_type {config.model_type!r}: its rope turns all qk_rope_head_dim="
                f"{config.qk_rope_head_dim} dims"
            )
        return rope
