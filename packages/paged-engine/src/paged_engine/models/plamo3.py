"""Preferred Networks PLaMo 3 (`Plamo3ForCausalLM`, remote code: pfnet/plamo-3-nict-2b-base,
8b, 31b), as vLLM's plamo3.py serves it: an attention-only decoder, sliding-window layers among
full ones, with PLaMo 2's sandwich norms (models/plamo2.py, the same offsets):

    x += post_mixer_norm(mixer(pre_mixer_norm(x)))       offsets 1 and 1/5
    x += post_mlp_norm(mlp(pre_mlp_norm(x)))             offsets 1 and 1/5^1.5

(final norm: offset 1; norm(x) = rmsnorm(x) * (offset + weight), the stored weight the
difference). The mixer: a fused qkv_proj, per-head RMSNorm of q and k with offset 1 (eps
rms_norm_eps), NeoX RoPE, grouped KV heads, scale head_dim^-0.5, no biases; the MLP:
down(silu(gate) * up) from a fused gate_up_proj. Layer i is full attention when
(i + 1) % sliding_window_pattern == 0, else it sees a window of `window_size` positions, its
own included (vLLM's per-layer sliding_window, as SGLang and llama.cpp count it; mlx-lm's port
counts window_size + 1 for configs without rope_scaling_factor). Full layers rotate with
rope_theta (YaRN when rope_scaling_factor != 1: original length initial_context_length,
beta_fast 32, beta_slow 1, untruncated), sliding layers with rope_local_theta, unscaled: the
remote config's per-layer-type rope_parameters. `scale_embedding` multiplies the token
embedding by sqrt(hidden_size) (the newer remote config's field; vLLM reads none).

Checkpoint names: model.layers.layers.{i}.* (the remote decoder nests its layer list, as
PLaMo 2's); an untied lm_head may hold rows up to the next multiple of 16, dropped at load.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from paged_engine.layers.embedding import VocabParallelEmbedding
from paged_engine.layers.norm import RMSNorm
from paged_engine.layers.rotary import RotaryEmbedding, get_rope
from paged_engine.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from paged_engine.models.phi3 import Phi3ForCausalLM
from paged_engine.models.plamo2 import NORM_OFFSETS
from paged_engine.models.remote_aliases import common_fields, field, refuse_unless
from paged_engine.models.utils import CausalLMBase, make_layers

ARCH = "Plamo3ForCausalLM"
# the remote config's defaults (config.json normally states every field)
DEFAULT_ROPE_THETA = 150_000.0
ATTENTION_FLAGS = {"qkv_bias": False, "o_bias": False, "qk_norm": True, "sliding": True}


def plamo3_layer_types(layers: int, pattern: int) -> list[str]:
    """Each layer's kind, as the remote `is_full_attn`: every `pattern`-th layer full."""
    return [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)
    ]


def _window_size(raw: dict[str, Any]) -> int:
    """window_size, or the older configs' `sliding_window` (an int, or one window per layer with
    null on full layers), as the remote config reads them."""
    window = field(raw, "window_size", int, 128)
    legacy = raw.get("sliding_window")
    if isinstance(legacy, bool) or not isinstance(legacy, (int, list, type(None))):
        raise ValueError(f"{ARCH}: config.json field 'sliding_window'={legacy!r} is not supported")
    if isinstance(legacy, int):
        window = field(raw, "sliding_window", int)
    elif isinstance(legacy, list):
        sizes = {w for w in legacy if w is not None}
        if len(sizes) > 1 or not all(isinstance(w, int) and w > 0 for w in sizes):
            raise ValueError(
                f"{ARCH}: config.json field 'sliding_window'={legacy!r} is not supported "
                "(one window size for every sliding layer)"
            )
        window = next(iter(sizes), window)
    return window


def _rope_parameters(raw: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The remote config's rope per layer type (its `rope_parameters` property)."""
    theta = field(raw, "rope_theta", float, DEFAULT_ROPE_THETA)
    legacy = raw.get("rope_global_theta")  # older configs' name, read where rope_theta is default
    if legacy is not None and theta == DEFAULT_ROPE_THETA:
        theta = field(raw, "rope_global_theta", float)
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    factor = field(raw, "rope_scaling_factor", float, 1.0)
    if factor != 1.0:
        if factor < 1.0:
            raise ValueError(f"{ARCH}: config.json field 'rope_scaling_factor'={factor} is below 1")
        full = {
            "rope_type": "yarn",
            "rope_theta": theta,
            "factor": factor,
            "original_max_position_embeddings": field(raw, "initial_context_length", int),
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        }
    local = {"rope_type": "default", "rope_theta": field(raw, "rope_local_theta", float, 1e4)}
    return {"full_attention": full, "sliding_attention": local}


def plamo3_config(raw: dict[str, Any]) -> PretrainedConfig:
    """PLaMo 3's config.json as our fields; ValueError naming any field this module does not
    serve (fp8 linears, image inputs, biases, another activation)."""
    refuse_unless(raw, ARCH, "linear_type", ("normal", None))
    refuse_unless(raw, ARCH, "attention_bias", (False, None))
    refuse_unless(raw, ARCH, "hidden_activation", ("swiglu", None))
    for name in ("image_token_id", "eval_attention_n_bit", "eval_mlp_n_bit", "rope_scaling"):
        refuse_unless(raw, ARCH, name, (None,))
    layers = field(raw, "num_hidden_layers", int)
    heads = field(raw, "num_attention_heads", int)
    kv_heads = field(raw, "num_key_value_heads", int, 4)
    if heads % kv_heads:
        raise ValueError(
            f"{ARCH}: config.json field 'num_key_value_heads' ({kv_heads}) must divide "
            f"num_attention_heads ({heads})"
        )
    pattern = field(raw, "sliding_window_pattern", int, 8)
    fields = {
        **common_fields(raw),
        "vocab_size": field(raw, "vocab_size", int),
        "hidden_size": field(raw, "hidden_size", int),
        "intermediate_size": field(raw, "intermediate_size", int),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": field(raw, "head_dim", int, 128),
        "rms_norm_eps": field(raw, "rms_norm_eps", float, 1e-6),
        "max_position_embeddings": field(raw, "max_position_embeddings", int, 2048),
        "sliding_window": _window_size(raw),
        "sliding_window_pattern": pattern,
        "layer_types": plamo3_layer_types(layers, pattern),
        "rope_parameters": _rope_parameters(raw),
        "hidden_act": "silu",
        "scale_embedding": field(raw, "scale_embedding", bool, False),
        "tie_word_embeddings": field(raw, "tie_word_embeddings", bool, True),
    }
    config = PretrainedConfig(**fields)
    config.model_type = "plamo3"
    return config


class Plamo3DecoderLayer(nn.Module):
    """The mixer (Llama's attention with per-head q / k norms of offset 1 and this layer's
    window), Llama's gated SiLU MLP, the four sandwich norms."""

    def __init__(self, config, layer_idx: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.mixer = LlamaAttention(config, layer_idx, ATTENTION_FLAGS, rope)
        # the release stores the q / k norm weights as offsets from 1 (the fused rope kernel
        # reads weight_offset too)
        self.mixer.q_norm.weight_offset = self.mixer.k_norm.weight_offset = 1.0
        self.mlp = LlamaMLP(config, False)
        eps = float(config.rms_norm_eps)
        for name, offset in NORM_OFFSETS.items():
            setattr(self, name, RMSNorm(config.hidden_size, eps, weight_offset=offset))

    def forward(self, positions, x, kv_cache, md) -> torch.Tensor:  # x: [T, D]
        h = self.mixer(positions, self.pre_mixer_norm(x), kv_cache, md)
        x = x + self.post_mixer_norm(h)
        return x + self.post_mlp_norm(self.mlp(self.pre_mlp_norm(x)))


class Plamo3Model(nn.Module):
    """Embedding (scaled by sqrt(D) with scale_embedding), the layers, the final norm; one rope
    instance per layer type, shared by its layers."""

    def __init__(self, config) -> None:
        super().__init__()
        d, eps = config.hidden_size, float(config.rms_norm_eps)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, d)
        self.embed_scale = d**0.5 if getattr(config, "scale_embedding", False) else None
        types = list(config.layer_types)
        ropes = {t: get_rope(config, int(config.head_dim), True, layer_type=t) for t in set(types)}
        self.layers, self.stage = make_layers(
            config.num_hidden_layers, lambda i: Plamo3DecoderLayer(config, i, ropes[types[i]])
        )
        self.norm = RMSNorm(d, eps, weight_offset=1.0)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, D]
        x = self.embed_tokens(input_ids)
        return x if self.embed_scale is None else x * self.embed_scale

    def forward(self, input_ids, positions, kv_caches, md, hidden=None) -> torch.Tensor:
        x = self.embed_input_ids(input_ids) if hidden is None else hidden
        for layer, kv_cache in zip(self.stage.layers(self.layers), kv_caches, strict=True):
            x = layer(positions, x, kv_cache, md)
        return self.norm(x) if self.stage.is_last else x


class Plamo3ForCausalLM(CausalLMBase):
    stacked_params = LlamaForCausalLM.stacked_params
    renames = (("model.layers.layers.", "model.layers."),)
    ignored_weights = ("rotary_emb.inv_freq",)
    tie_default = True

    def __init__(self, config) -> None:
        super().__init__(config, Plamo3Model(config))

    def convert_weight(self, name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        vocab = int(self.config.vocab_size)
        if name == "lm_head.weight" and w.shape[0] == -(-vocab // 16) * 16:
            w = w[:vocab]  # the release pads an untied head to a multiple of 16 rows
        # fused qkv_proj / gate_up_proj split into the pieces our layers shard (Phi-3's layout)
        return Phi3ForCausalLM.convert_weight(self, name, w)  # type: ignore[arg-type]
