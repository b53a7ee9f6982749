"""Upstage Solar Pro (`SolarForCausalLM`, model_type "solar", remote code; vLLM's solar.py):
Llama's decoder with block skip connections. Not SolarOpenForCausalLM (models/glm4_moe.py),
a different model.

    save    the residual stream entering layer i is kept when i is in `bskcn_1` (slot 1) or
            `bskcn_2` (slot 2); a later save to the same slot replaces the earlier one
    blend   the stream entering layer i becomes tv * slot 1 + (1 - tv) * stream when i is in
            `bskcn_3`, then likewise with slot 2 when i is in `bskcn_4` (saves before blends)
    tv      `bskcn_tv` = [training weight, inference weight]: vLLM (not training) uses the
            second, and so do we
    logits  times `logit_scale` where the config has one (vLLM's LogitsProcessor scale)

vLLM mixes its (hidden, residual) pair with the same weights, which mixes their sum, the stream;
we mix the stream itself. The config's `sliding_window` (2047 in Solar's config class) is not
applied, as vLLM's Solar attention attends to the whole context.

Refused by name: bskcn lists that are not lists of layer indices of this model, a blend layer
with no save at or before it (vLLM would multiply None), `bskcn_tv` other than two numbers, and
pipeline parallelism (the saved streams cross stages).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PretrainedConfig

from paged_engine.distributed.parallel_state import get_parallel_state
from paged_engine.models.llama import LlamaForCausalLM, LlamaModel, add_norm, stage_input
from paged_engine.models.llama_remote import llama_config
from paged_engine.models.remote_aliases import field
from paged_engine.models.utils import CausalLMBase

# vLLM's SolarConfig defaults, for a config.json that leaves a field out
_SKIP_DEFAULTS = {
    "bskcn_1": [12, 20, 32, 44],
    "bskcn_2": [20, 32],
    "bskcn_3": [16, 24, 36, 48],
    "bskcn_4": [28, 40],
}
_TV_DEFAULT = [0.9, 0.8]


def _layer_list(raw: dict[str, Any], name: str, num_layers: int) -> list[int]:
    value = raw.get(name)
    value = _SKIP_DEFAULTS[name] if value is None else value
    if not isinstance(value, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers for i in value
    ):
        raise ValueError(
            f"config.json field {name!r} must be a list of layer indices below "
            f"num_hidden_layers ({num_layers}), got {value!r}"
        )
    return value


def solar_config(raw: dict[str, Any]) -> PretrainedConfig:
    """Solar's config.json: Llama's fields (`attention_bias` or `bias` on q / k / v / o, as
    vLLM reads them), the four bskcn layer lists, `bskcn_tv` and an optional `logit_scale`."""
    num_layers = field(raw, "num_hidden_layers", int)
    skips = {name: _layer_list(raw, name, num_layers) for name in _SKIP_DEFAULTS}
    for blend, save in (("bskcn_3", "bskcn_1"), ("bskcn_4", "bskcn_2")):
        first = min(skips[save], default=num_layers)
        if any(i < first for i in skips[blend]):
            raise ValueError(
                f"config.json field {blend!r} ({skips[blend]}) blends a layer before any "
                f"layer of {save!r} ({skips[save]}) saves the stream"
            )
    tv = raw.get("bskcn_tv")
    tv = _TV_DEFAULT if tv is None else tv
    if not (
        isinstance(tv, list)
        and len(tv) == 2
        and all(isinstance(w, int | float) and not isinstance(w, bool) for w in tv)
    ):
        raise ValueError(
            f"config.json field 'bskcn_tv' must be [training, inference] weights, got {tv!r}"
        )
    bias = field(raw, "attention_bias", bool, False) or field(raw, "bias", bool, False)
    return llama_config(
        raw,
        **skips,
        bskcn_tv=[float(w) for w in tv],
        attention_bias=bias,
        logit_scale=field(raw, "logit_scale", float, 1.0),
    )


class SolarModel(LlamaModel):
    """LlamaModel whose forward saves and blends the stream at the config's bskcn layers."""

    def __init__(self, config, flags: dict[str, bool]) -> None:
        if get_parallel_state().pp_size > 1:
            raise ValueError(
                "SolarForCausalLM does not support pipeline parallelism (its skip connections "
                "carry the stream across layers)"
            )
        super().__init__(config, flags)
        self.saves = (frozenset(config.bskcn_1), frozenset(config.bskcn_2))
        self.blends = (frozenset(config.bskcn_3), frozenset(config.bskcn_4))
        self.skip_layers = self.saves[0] | self.saves[1] | self.blends[0] | self.blends[1]
        self.tv = float(config.bskcn_tv[1])  # the inference weight

    def forward(self, input_ids, positions, kv_caches, md, hidden=None) -> torch.Tensor:
        x = stage_input(self, input_ids, hidden)  # [T, D]
        self.rotary_emb.begin_forward(positions)
        capture = self.stream_capture
        kept = capture.layer_ids if capture is not None else frozenset()
        # the stream is h + residual (h alone while residual is None), as in run_layers
        h, residual = x, None
        saved: list[torch.Tensor | None] = [None, None]
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if i in self.skip_layers or i in kept:
                stream = h if residual is None else h + residual
                for slot in (0, 1):
                    if i in self.saves[slot]:
                        saved[slot] = stream
                for slot in (0, 1):
                    if i in self.blends[slot]:
                        # solar_config: a save at or before every blend layer
                        assert saved[slot] is not None
                        stream = saved[slot] * self.tv + stream * (1.0 - self.tv)
                if capture is not None and i in kept:
                    capture.keep(i, stream)
                h, residual = stream, None
            h, residual = layer.forward_residual(positions, h, residual, kv_cache, md)
        assert residual is not None
        if capture is not None and len(self.layers) in kept:  # the stream leaving the stack
            capture.keep(len(self.layers), h + residual)
        return add_norm(self.norm, h, residual)[0]


class SolarForCausalLM(LlamaForCausalLM):
    def __init__(self, config) -> None:
        CausalLMBase.__init__(self, config, SolarModel(config, self.layer_flags(config)))
        self.logit_scale = float(getattr(config, "logit_scale", 1.0))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, V] fp32
        logits = super().compute_logits(hidden)
        return logits if self.logit_scale == 1.0 else logits * self.logit_scale
