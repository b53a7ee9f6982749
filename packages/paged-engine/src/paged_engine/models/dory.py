"""NVIDIA Nemotron-Labs Dory (`DoryForCausalLM`, model_type "dory"): a looped nGPT.

Gemma 2's sandwich layer (models/gemma2.py: a norm before and after each sublayer, sliding and
full layers from `layer_types`, each type with its own rope base) holding AFMoE's gated
attention (models/afmoe.py), every hidden state kept on the unit sphere, as transformers runs it:

    norms      weightless L2 norms, x / sqrt(sum(x^2) + 1e-6) in float32 (norm 1, not RMS 1),
               in place of every RMSNorm, and as sub-norms before o_proj and down_proj
    residual   the stream is replaced by its normalized self and then moved towards the
               normalized sublayer output at a learned per-channel rate:
               x = n(x); x += |lambda_1 * a| * (n(attn(x)) - x); the same for the MLP with
               lambda_2 (a = ngpt_alpha_init / initializer_range)
    attention  q and k heads L2-normalized, rotated (on every layer), q times
               (sqk * sqrt(head_dim) / initializer_range)^2 per channel; scores scaled by
               head_dim^-0.5; output times sigmoid(gate_proj(x) * (s_gate * s)^2)
               (s = hidden_size^0.25 / initializer_range)
    mlp        act(gate * suv_gate * sqrt(d)) * (up * suv_up * sqrt(d)), sub-normed, down
    loops      `n_input_layers` layers once, the next `n_recurrent_layers` `n_recurrent_loops`
               times (each loop starts from n(x) + n(input section's output)), the last
               `n_output_layers` once, a final L2 norm
    logits     lm_head in float32 times logit_scale / initializer_range, per vocabulary entry

KV caches: `recurrent_kv_cache_mode` "per_loop" gives each loop of a recurrent layer its own
cache (extra caches after the model's own, HF's order); "last_loop" gives the loops one cache,
which every loop writes in turn and the last loop's keys and values end up in (earlier loops
read the past the last loop wrote, as HF's read-only view does). Under tensor parallelism the
sub-norms add their squares over the ranks. Pipeline parallelism is refused (the loops run one
section several times on one stage).
"""

from __future__ import annotations

import copy
import math
import re

import torch
from torch import nn

from paged_engine.distributed.communication import tp_all_reduce
from paged_engine.distributed.parallel_state import get_parallel_state
from paged_engine.layers.attention import AttentionMetadata
from paged_engine.layers.embedding import VocabParallelEmbedding
from paged_engine.layers.linear import ColumnParallelLinear
from paged_engine.layers.rotary import RotaryEmbedding
from paged_engine.models.gemma2 import gemma_layer_types
from paged_engine.models.gemma3 import Gemma3ForCausalLM
from paged_engine.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, llama_head_dim
from paged_engine.models.utils import CausalLMBase, cfg_get, make_layers

L2_EPS = 1e-6  # HF's DoryL2Norm() default


def l2_norm(x: torch.Tensor, sharded: bool = False) -> torch.Tensor:  # [..., D]
    """x / sqrt(sum(x^2) + eps) in float32, rounded to x's dtype; `sharded`: x is this rank's
    slice of the normalized dimension (the sum runs over every rank)."""
    xf = x.float()
    sq = xf.pow(2).sum(-1, keepdim=True)
    if sharded:
        sq = tp_all_reduce(sq)
    return (xf * torch.rsqrt(sq + L2_EPS)).to(x.dtype)


def sharded_vector(full: int, local: int, shard: int, fill: float) -> nn.Parameter:
    """A per-channel parameter of `full` entries of which this rank holds [shard * local,
    (shard + 1) * local) (the channels of its heads, or of its MLP slice)."""
    param = nn.Parameter(torch.full((local,), fill))

    def load(p: nn.Parameter, w: torch.Tensor, shard_id=None) -> None:
        if tuple(w.shape) != (full,):
            raise ValueError(f"expected [{full}], got {tuple(w.shape)}")
        p.data.copy_(w[shard * local : (shard + 1) * local])

    param.weight_loader = load
    return param


class DoryAttention(LlamaAttention):
    """Llama's projections (qkv, o; the window on "sliding_attention" layers) with nGPT's unit
    q / k heads, the per-channel query scale, and AFMoE's output gate scaled by s_gate. One
    paged Attention a loop that has its own cache (`num_caches`)."""

    def __init__(self, config, layer_idx: int, rope: RotaryEmbedding, num_caches: int) -> None:
        bias = bool(getattr(config, "attention_bias", False))
        flags = {"qkv_bias": bias, "o_bias": bias, "qk_norm": False, "sliding": True}
        super().__init__(config, layer_idx, flags, rope)
        init, d = float(config.initializer_range), self.head_dim
        heads, shard = config.num_attention_heads, self.qkv_proj.tp_rank
        self.out_gate = ColumnParallelLinear(config.hidden_size, heads * d, bias=False)
        self.sqk = sharded_vector(heads * d, self.q_size, shard, init)
        self.s_gate = sharded_vector(heads * d, self.q_size, shard, init)
        self.sqk_scale = math.sqrt(d) / init
        self.s_gate_scale = config.hidden_size**0.25 / init
        self.sharded = self.qkv_proj.tp_size > 1
        # the cache of loop i >= 1 (per_loop) is attended by its own paged layer, so that each
        # Attention module keeps one cache (what compiled forwards and fp8 scales assume)
        self.loop_attn = nn.ModuleList(copy.deepcopy(self.attn) for _ in range(num_caches - 1))

    def forward(self, positions, x, kv_cache, md: AttentionMetadata, cache: int = 0):
        t, d = x.shape[0], self.head_dim  # x: [T, D]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = l2_norm(q.view(t, -1, d)).view(t, -1)
        k = l2_norm(k.view(t, -1, d)).view(t, -1)
        q, k = self.rotary_emb(positions, q, k)
        q = q * (self.sqk * self.sqk_scale).square()
        attn = self.attn if cache == 0 else self.loop_attn[cache - 1]
        out = attn(q, k, v, kv_cache, md)  # [T, H*D]
        gate = torch.sigmoid(self.out_gate(x) * (self.s_gate * self.s_gate_scale).square())
        return self.o_proj(l2_norm(out * gate, self.sharded))


class DoryMLP(LlamaMLP):
    """Llama's gated MLP with nGPT's scales on gate and up, sub-normed before down_proj."""

    def __init__(self, config) -> None:
        super().__init__(config, bool(getattr(config, "mlp_bias", False)))
        full, local = config.intermediate_size, self.down_proj.in_local
        shard = self.down_proj.tp_rank
        self.suv_gate = sharded_vector(full, local, shard, 1.0)
        self.suv_up = sharded_vector(full, local, shard, 1.0)
        self.suv_scale = math.sqrt(config.hidden_size)
        self.sharded = self.down_proj.tp_size > 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, D] -> [T, D]
        scales = torch.cat((self.suv_gate, self.suv_up)) * self.suv_scale  # [2 * I / tp]
        act = self.act_fn(self.gate_up_proj(x) * scales)  # act(gate) * up
        return self.down_proj(l2_norm(act, self.sharded))


class DoryDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, rope: RotaryEmbedding, num_caches: int) -> None:
        super().__init__()
        self.self_attn = DoryAttention(config, layer_idx, rope, num_caches)
        self.mlp = DoryMLP(config)
        init = float(config.initializer_range)
        self.lambda_1 = nn.Parameter(torch.full((config.hidden_size,), init))
        self.lambda_2 = nn.Parameter(torch.full((config.hidden_size,), init))
        self.lambda_scale = float(cfg_get(config, "ngpt_alpha_init", 0.05)) / init

    def forward(self, positions, x, kv_cache, md, cache: int = 0) -> torch.Tensor:  # [T, D]
        x = l2_norm(x)
        h = l2_norm(self.self_attn(positions, x, kv_cache, md, cache))
        x = x + (self.lambda_1 * self.lambda_scale).abs() * (h - x)
        x = l2_norm(x)
        h = l2_norm(self.mlp(x))
        return x + (self.lambda_2 * self.lambda_scale).abs() * (h - x)


def loop_layout(config) -> tuple[int, int, int, int, bool]:
    """(n_input_layers, n_recurrent_layers, n_output_layers, n_recurrent_loops, per_loop),
    checked as HF's config checks them."""
    n = config.num_hidden_layers
    n_in = int(cfg_get(config, "n_input_layers", 8))
    n_out = int(cfg_get(config, "n_output_layers", 8))
    n_rec = int(cfg_get(config, "n_recurrent_layers", n - n_in - n_out))
    loops = int(cfg_get(config, "n_recurrent_loops", 2))
    if n_in + n_rec + n_out != n:
        raise ValueError(
            f"n_input_layers + n_recurrent_layers + n_output_layers = {n_in + n_rec + n_out} "
            f"must equal num_hidden_layers = {n}"
        )
    if loops < 1:
        raise ValueError(f"n_recurrent_loops must be at least 1, got {loops}")
    mode = cfg_get(config, "recurrent_kv_cache_mode", "per_loop")
    if mode not in ("per_loop", "last_loop"):
        raise ValueError(f"recurrent_kv_cache_mode={mode!r} is not supported")
    return n_in, n_rec, n_out, loops, mode == "per_loop"


class DoryModel(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        if get_parallel_state().pp_size > 1:
            raise ValueError(
                "Dory does not support pipeline parallelism (its recurrent section runs "
                "n_recurrent_loops times on one stage)"
            )
        n_in, n_rec, _, loops, per_loop = loop_layout(config)
        types = gemma_layer_types(config, 4)
        ropes = Gemma3ForCausalLM.make_ropes(config, llama_head_dim(config), types)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)

        def build(i: int) -> DoryDecoderLayer:
            caches = loops if per_loop and n_in <= i < n_in + n_rec else 1
            return DoryDecoderLayer(config, i, ropes[types[i]], caches)

        self.layers, self.stage = make_layers(config.num_hidden_layers, build)
        n = config.num_hidden_layers
        self.sections = (range(n_in), range(n_in, n_in + n_rec), range(n_in + n_rec, n))
        self.loops, self.per_loop = loops, per_loop

    def cache_index(self, layer: int, loop: int) -> int:
        """The cache of `layer` in loop `loop`: HF's order, the model's own caches first, then
        (per_loop) those of loops 1, 2, ... of the recurrent layers."""
        rec = self.sections[1]
        if not self.per_loop or loop == 0:
            return layer
        return len(self.layers) + (loop - 1) * len(rec) + layer - rec.start

    def forward(self, input_ids, positions, kv_caches, md, hidden=None) -> torch.Tensor:
        x = self.embed_tokens(input_ids) if hidden is None else hidden  # [T, D]
        first, recurrent, last = self.sections
        for i in first:
            x = self.layers[i](positions, x, kv_caches[i], md)
        start = l2_norm(x)  # every loop restarts from the input section's output
        for loop in range(self.loops):
            x = l2_norm(x) + start
            for i in recurrent:
                cache = loop if self.per_loop else 0
                kv = kv_caches[self.cache_index(i, loop)]
                x = self.layers[i](positions, x, kv, md, cache)
        for i in last:
            x = self.layers[i](positions, x, kv_caches[i], md)
        return l2_norm(x)


# The released layout's blocks: layers.2i the attention ("mixer") of layer i, layers.2i+1 its
# MLP, each with its residual rate (HF's LayerPairCollapse)
_BLOCK = re.compile(r"layers\.(\d+)\.(mixer|attn_alpha|mlp_alpha)(?=\.|$)")


class DoryForCausalLM(CausalLMBase):
    stacked_params = LlamaForCausalLM.stacked_params
    ignored_weights = LlamaForCausalLM.ignored_weights
    # HF's checkpoint names (what transformers saves too), then the attention's gate
    # (".gate_proj" would stack into the MLP's gate_up_proj)
    renames = (
        (".self_attn.g_proj.", ".self_attn.gate_proj."),
        (".embeddings.", ".embed_tokens."),
        (".self_attn.gate_proj.", ".self_attn.out_gate."),
    )

    def __init__(self, config) -> None:
        super().__init__(config, DoryModel(config))
        init = float(config.initializer_range)
        self.logit_scale = nn.Parameter(torch.full((config.vocab_size,), init))
        self.logit_scale_factor = 1.0 / init

    @classmethod
    def kv_cache_layout(cls, config) -> list[tuple[int, int]]:
        """One cache per layer, and with per_loop one more per later loop of each recurrent
        layer (HF's extra cache layers)."""
        _, n_rec, _, loops, per_loop = loop_layout(config)
        heads = config.num_attention_heads
        kv_heads = cfg_get(config, "num_key_value_heads", heads)
        extra = (loops - 1) * n_rec if per_loop else 0
        return [(kv_heads, llama_head_dim(config))] * (config.num_hidden_layers + extra)

    def rename_weight(self, name: str) -> str:
        if name == "lm_head.logit_scale":  # a parameter of ours beside the shared LM head
            return "logit_scale"
        block = _BLOCK.search(name)
        if block is not None:
            i, part = int(block[1]), block[2]
            part = {"attn_alpha": "lambda_1", "mlp_alpha": "lambda_2"}.get(part)
            part = part or ("self_attn", "mlp")[i % 2]
            name = f"{name[: block.start()]}layers.{i // 2}.{part}{name[block.end() :]}"
        if name.startswith("backbone."):
            name = "model." + name.removeprefix("backbone.")
        return super().rename_weight(name)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, V] fp32
        logits = super().compute_logits(hidden)
        return logits * (self.logit_scale.float() * self.logit_scale_factor)
