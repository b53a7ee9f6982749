"""Ultravox's config (`model_type` "ultravox", architecture `UltravoxModel`), read without the
checkpoint's remote code: transformers has no Ultravox class, so `register()` teaches
AutoConfig the model type (called where the loader reads config.json; idempotent).

The fields are fixie-ai's UltravoxConfig's (vLLM's transformers_utils/configs/ultravox.py
reads the same): `audio_config` (a Whisper config), `text_config` (the language model's; Llama
when its model_type is missing), `audio_token_index`, `hidden_size` (the projector's width
before its activation, not the text model's), `stack_factor`, `norm_init`, `projector_act`,
`projector_ln_mid`, and vLLM's `num_projector_layers` (0: the feed-forward projector).

`text_model_id` / `audio_model_id` (the language model / the Whisper model living in their own
repos, as fixie-ai's releases name them): each id's config.json becomes text_config /
audio_config here (over an inline one, as fixie's and vLLM's configs do), its weights stream
after the checkpoint's own (models/ultravox_linked.py).

Refused by name when the config is read, what paged does not run: an id that cannot be
resolved, a tower other than Whisper's (audio_config.model_type), `num_projector_layers` > 0
(the transformer projector), `audio_latency_block_size` (fixie's block-causal streaming mask
over the tower), a `stack_factor` under 1. A top-level `tie_word_embeddings` is dropped: the
language model ties its head by its own config (fixie's `tie_weights` is the language model's).
"""

from __future__ import annotations

from typing import Any, ClassVar

from transformers import AutoConfig, PreTrainedConfig
from transformers.configuration_utils import SubConfigSpec

from paged_engine.models.ultravox_linked import AUDIO, MODEL_TYPE, TEXT, linked_config


class UltravoxConfig(PreTrainedConfig):
    model_type = MODEL_TYPE
    sub_configs_defaults: ClassVar[dict[str, SubConfigSpec]] = {
        "text_config": SubConfigSpec(config_class=AutoConfig, model_type="llama"),
        "audio_config": SubConfigSpec(config_class=AutoConfig, model_type="whisper"),
    }

    audio_config: dict | PreTrainedConfig | None = None
    text_config: dict | PreTrainedConfig | None = None
    audio_model_id: str | None = None
    text_model_id: str | None = None
    ignore_index: int = -100
    audio_token_index: int = 32000
    hidden_size: int = 4096
    stack_factor: int = 8
    norm_init: float = 0.4
    projector_act: str = "swiglu"
    projector_ln_mid: bool = False
    num_projector_layers: int = 0
    audio_latency_block_size: int | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        kwargs.pop("tie_word_embeddings", None)
        if self.text_model_id is not None:  # (before the sub-configs are built from dicts)
            self.text_config = linked_config(TEXT, self.text_model_id)
        if self.audio_model_id is not None:
            self.audio_config = linked_config(AUDIO, self.audio_model_id)
        super().__post_init__(**kwargs)
        check(self)


def check(config: Any) -> None:
    """ValueError naming the first field of an Ultravox config that paged does not run."""
    tower = getattr(config.audio_config, "model_type", None)
    if tower != "whisper":
        raise ValueError(
            f"Ultravox: audio_config.model_type={tower!r} is not supported (paged runs "
            "Ultravox's Whisper tower)"
        )
    if int(getattr(config, "num_projector_layers", 0) or 0) > 0:
        raise ValueError(
            f"Ultravox: num_projector_layers={config.num_projector_layers} (the transformer "
            "projector) is not supported; the feed-forward projector (0) is"
        )
    if getattr(config, "audio_latency_block_size", None) is not None:
        raise ValueError(
            f"Ultravox: audio_latency_block_size={config.audio_latency_block_size} (a "
            "block-causal mask over the audio tower) is not supported"
        )
    if int(config.stack_factor) < 1:
        raise ValueError(f"Ultravox: stack_factor={config.stack_factor} must be at least 1")


def register() -> None:
    """AutoConfig reads `model_type: "ultravox"` as UltravoxConfig (once per process)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if MODEL_TYPE not in CONFIG_MAPPING:
        AutoConfig.register(MODEL_TYPE, UltravoxConfig)
