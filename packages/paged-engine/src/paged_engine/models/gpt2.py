"""GPT-2: learned absolute positions, pre-LayerNorm, GELU (tanh) MLP, tied LM head.

HF stores GPT-2's projections as Conv1D with weight [in, out], the transpose of nn.Linear;
`c_attn` holds q | k | v stacked along its output dim.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from paged_engine.checkpoint_checks import check_heads_divide
from paged_engine.layers.activation import get_act_fn
from paged_engine.layers.attention import Attention
from paged_engine.layers.embedding import VocabParallelEmbedding
from paged_engine.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from paged_engine.layers.norm import LayerNorm
from paged_engine.models.utils import CausalLMBase, cfg_get, make_layers

_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


class GPT2Attention(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        d, heads = config.hidden_size, config.num_attention_heads
        head_dim = check_heads_divide(d, heads, "n_embd", "n_head")
        scale = head_dim**-0.5 if cfg_get(config, "scale_attn_weights", True) else 1.0
        if cfg_get(config, "scale_attn_by_inverse_layer_idx", False):
            scale /= layer_idx + 1
        self.c_attn = QKVParallelLinear(d, head_dim, heads, heads, bias=True)
        self.c_proj = RowParallelLinear(d, d, bias=True)
        self.attn = Attention(self.c_attn.num_heads, head_dim, self.c_attn.num_kv_heads, scale)

    def forward(self, x, kv_cache, md) -> torch.Tensor:  # x: [T, D]
        q, k, v = self.c_attn(x).chunk(3, dim=-1)
        return self.c_proj(self.attn(q, k, v, kv_cache, md))


class GPT2MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        d = config.hidden_size
        inner = cfg_get(config, "n_inner", 4 * d)
        self.c_fc = ColumnParallelLinear(d, inner, bias=True)
        self.c_proj = RowParallelLinear(inner, d, bias=True)
        self.act = get_act_fn(
            cfg_get(config, "activation_function", "gelu_new"), "activation_function"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        eps = cfg_get(config, "layer_norm_epsilon", 1e-5)
        self.ln_1 = LayerNorm(config.hidden_size, eps=eps)
        self.attn = GPT2Attention(config, layer_idx)
        self.ln_2 = LayerNorm(config.hidden_size, eps=eps)
        self.mlp = GPT2MLP(config)

    def forward(self, x, kv_cache, md) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), kv_cache, md)
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    """Token and learned position embeddings, the blocks (`build_block(i)`, GPT2Block by
    default; GPT-Neo's its own), the final LayerNorm."""

    def __init__(self, config, build_block: Callable[[int], nn.Module] | None = None):
        super().__init__()
        d = config.hidden_size
        self.wte = VocabParallelEmbedding(config.vocab_size, d)
        self.wpe = nn.Embedding(config.max_position_embeddings, d)
        build = build_block or (lambda i: GPT2Block(config, i))
        self.h, self.stage = make_layers(config.num_hidden_layers, build)
        self.ln_f = LayerNorm(d, eps=cfg_get(config, "layer_norm_epsilon", 1e-5))

    def forward(self, input_ids, positions, kv_caches, md, hidden=None) -> torch.Tensor:
        # hidden: the previous pipeline stage's output (None on the first stage)
        x = self.wte(input_ids) + self.wpe(positions) if hidden is None else hidden  # [T, D]
        for block, kv_cache in zip(self.stage.layers(self.h), kv_caches, strict=True):
            x = block(x, kv_cache, md)
        return self.ln_f(x) if self.stage.is_last else x


class GPT2LMHeadModel(CausalLMBase):
    inner_name = "transformer"
    embed_path = "transformer.wte"
    tie_default = True
    stacked_params = (
        (".c_attn.", ".c_attn_q.", "q"),
        (".c_attn.", ".c_attn_k.", "k"),
        (".c_attn.", ".c_attn_v.", "v"),
    )
    ignored_weights = (".attn.bias", ".attn.masked_bias")  # HF's causal-mask buffers

    def __init__(self, config):
        if getattr(config, "add_cross_attention", False):  # an encoder-decoder's decoder
            raise ValueError(
                f"{type(self).__name__}: config add_cross_attention=True (cross-attention "
                "layers over an encoder's states) is not supported"
            )
        super().__init__(config, GPT2Model(config))

    def rename_weight(self, name: str) -> str:  # the original checkpoints lack "transformer."
        if name.startswith(("transformer.", "lm_head.")):
            return name
        return "transformer." + name

    def convert_lora_b(self, name: str, b: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """A LoRA B is [out, r] even on a Conv1D module (PEFT keeps its A / B as linear
        layers): stored the Conv1D way round, it splits as the weight does."""
        return self.convert_weight(name, b.t() if name.endswith(_CONV1D) else b)

    def convert_weight(self, name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if name.endswith(_CONV1D):
            w = w.t()
        if ".attn.c_attn." in name:  # q | k | v along the output dim
            for shard, part in zip("qkv", w.chunk(3, dim=0)):
                yield name.replace(".c_attn.", f".c_attn_{shard}."), part
        else:
            yield name, w
