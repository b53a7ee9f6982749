"""The decoder stack shared by hybrid models: layers of linear attention or state-space mixing
(`config.layer_types`: "linear_attention", "mamba" in older configs, LFM2's short "conv")
among attention layers (any other type but Nemotron-H's feed-forward-only "mlp" / "moe"
layers), or of "hybrid" layers running attention and a linear mixer side by side (Falcon-H1's,
every layer of a "falcon_h1" model). Only the layers with attention hold a paged KV cache: the
model's `kv_caches` list has one entry per such layer, in order; the linear and hybrid ones carry
a recurrent state per sequence (worker/recurrent_state.py).

Used by Qwen3-Next / Qwen3.5 (models/qwen3_next.py), Granite 4.0-H (models/granitemoehybrid.py),
Bamba (models/bamba.py), Nemotron-H (models/nemotron_h.py), LFM2 / LFM2-MoE (models/lfm2.py),
Falcon-H1 (models/falcon_h1.py), Kimi Linear (models/kimi_linear.py), Jamba
(models/jamba.py) and Zamba2 (models/zamba2.py; its "hybrid" layers run a shared transformer
block before their mixer). Pure state-space models (every layer a mixer, no KV: Mamba,
Mamba2) have a stack of their own (models/mamba.py) but the same layer types.

Pipeline parallelism (`PIPELINE_MODEL_TYPES`): a stage builds its decoder layers only
(make_layers), so its state pools hold only its linear layers' state (the pools are the built
layers' own), and its `kv_caches` only its attention layers' (`stage_kv_range`), in order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from paged_engine.layers.embedding import VocabParallelEmbedding
from paged_engine.layers.rotary import RotaryEmbedding
from paged_engine.models.llama import stage_input
from paged_engine.models.utils import make_layers

LINEAR_LAYER_TYPES = ("linear_attention", "mamba", "conv")
# Layers with neither KV nor state (Nemotron-H's MLP-only and MoE-only layers).
FEED_FORWARD_LAYER_TYPES = ("mlp", "moe")
# Layers with both KV and a state: attention and a linear mixer in parallel (Falcon-H1's), or a
# shared transformer block before the mixer (Zamba2's).
PARALLEL_LAYER_TYPES = ("hybrid",)
# Model types whose every layer is a parallel one, whatever their config lists (transformers 5's
# FalconH1Config says "hybrid" for each layer; earlier ones say nothing).
_PARALLEL_MODEL_TYPES = ("falcon_h1",)
# Pure state-space models (models/mamba.py): every layer a mixer, whatever their config lists
# (transformers 5 names each layer "linear_attention"; earlier ones nothing).
_STATE_SPACE_MODEL_TYPES = ("mamba", "falcon_mamba", "mamba2")


def layer_types(config) -> list[str]:
    model_type = getattr(config, "model_type", None)
    if model_type in _PARALLEL_MODEL_TYPES:
        return [PARALLEL_LAYER_TYPES[0]] * int(config.num_hidden_layers)
    if model_type in _STATE_SPACE_MODEL_TYPES:
        return ["mamba"] * int(config.num_hidden_layers)
    types = getattr(config, "layer_types", None) or getattr(config, "layers_block_type", None)
    if not types and getattr(config, "attn_type_list", None):  # MiniMax-01's releases' configs
        types = ["linear_attention" if t == 0 else "full_attention" for t in config.attn_type_list]
    return list(types or ())


def is_hybrid(config) -> bool:
    """Whether some layers carry a recurrent state (linear ones: instead of KV; parallel ones:
    besides it)."""
    return any(t in LINEAR_LAYER_TYPES + PARALLEL_LAYER_TYPES for t in layer_types(config))


def has_kv(layer_type: str) -> bool:
    return layer_type not in LINEAR_LAYER_TYPES + FEED_FORWARD_LAYER_TYPES


def num_kv_layers(config) -> int:
    """Layers with a paged KV cache: a hybrid's attention (and parallel) ones."""
    return sum(map(has_kv, layer_types(config)))


# Model types served at pipeline_parallel_size > 1: stacks of HybridModel's own forward whose
# stages give the single-process engine's tokens (tests/distributed/test_hybrid_pp.py); other
# hybrids are refused by name (worker/recurrent_state.py: hybrid_engine_config). What the
# others would carry across a stage boundary besides the [T, hidden_size] hidden states:
#   GLM-5-Next: hc_mult residual streams, and the last full indexer's choice its shared
#     layers reuse; Qwen4-Exp: hc_count residual streams, and two KV entries an indexed layer;
#   Zamba / Zamba2: the token embeddings every hybrid layer reads, and a shared block named
#     and loaded under the first layer running it (a later stage does not build it);
#   ZAYA: the previous layer's router state, and a float32 residual stream;
#   Inkling 2: every earlier layer's output (block residuals), and looped passes' KV entries;
#   Mamba / Mamba2 / Falcon Mamba (pure state space, models/mamba.py's stack): no layer caches
#     KV, so every stage would be one without attention, which _check_pipeline refuses.
PIPELINE_MODEL_TYPES = frozenset(
    {
        "jamba",
        "granitemoehybrid",
        "nemotron_h",
        "qwen3_next",
        "qwen3_5_text",
        "qwen3_5_moe_text",
        "bamba",
        "falcon_h1",
        "lfm2",
        "lfm2_moe",
        "lfm3",
        "kimi_linear",
        "minimax",
        "minimax_text_01",
        "minimax_m1",
        "plamo2",
        "olmo_hybrid",
        "bailing_hybrid",
        "inkling_text",
        "recurrent_gemma",
        "lara_mini",
    }
)


def stage_kv_range(config, start: int, end: int) -> tuple[int, int]:
    """The entries [a, b) of the model's per-KV-layer list that decoder layers [start, end)
    cache: the KV layers before `start`, and before `end`."""
    kv = [has_kv(t) for t in layer_types(config)]
    return sum(kv[:start]), sum(kv[:end])


class HybridModel(nn.Module):
    """Embedding (times `embedding_multiplier`), the layers (`build_layer(i)`, each called
    with `(positions, x, kv_cache or None, md)`), the final norm."""

    def __init__(
        self,
        config,
        build_layer: Callable[[int], nn.Module],
        norm: nn.Module,
        rope: RotaryEmbedding | None,
        embedding_multiplier: float | None = None,
    ) -> None:
        super().__init__()
        types = layer_types(config)
        if len(types) != config.num_hidden_layers or num_kv_layers(config) == 0:
            raise ValueError(
                f"layer_types must name each of the {config.num_hidden_layers} layers, at least "
                f"one full attention, got {types!r}"
            )
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.embedding_multiplier = embedding_multiplier
        self.rotary_emb = rope
        self.layers, self.stage = make_layers(config.num_hidden_layers, build_layer)
        self.norm = norm
        # Each layer's entry in kv_caches; -1: no KV (a linear or feed-forward layer).
        self.kv_index: list[int] = []
        for t in types:
            n = sum(i >= 0 for i in self.kv_index)
            self.kv_index.append(n if has_kv(t) else -1)
        # kv_caches holds this stage's KV layers only: the first is the model's KV layer
        # `kv_first` (0 but on a later pipeline stage)
        self.kv_first = sum(i >= 0 for i in self.kv_index[: self.stage.start])

    def forward(self, input_ids, positions, kv_caches, md, hidden=None) -> torch.Tensor:
        """This stage's layers over x; `kv_caches` holds this stage's KV layers' caches only
        (its first is KV layer `kv_first` of the model). The final norm on the last stage."""
        x = stage_input(self, input_ids, hidden)
        if self.rotary_emb is not None:
            self.rotary_emb.begin_forward(positions)
        first = self.kv_first
        for i in range(self.stage.start, self.stage.end):
            k = self.kv_index[i]
            x = self.layers[i](positions, x, kv_caches[k - first] if k >= 0 else None, md)
        return self.norm(x) if self.stage.is_last else x
