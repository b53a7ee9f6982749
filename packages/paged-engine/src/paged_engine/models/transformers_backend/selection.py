"""Which checkpoints the Transformers modeling backend (causal.py) runs, decided at engine start.

`model_impl="auto"` (the default) falls back to the backend for an architecture the registry does
not serve when transformers has it as a causal LM whose class supports custom attention
(`_supports_attention_backend`, vLLM's rule). What cannot run this way is refused by name:
encoder-decoders, multimodal configs (but the vision-language wrappers multimodal.py serves),
token-dropping expert capacities (`expert_capacity`), multi-head latent attention
(`kv_lora_rank`), tensor / pipeline parallelism, LoRA, speculative decoding, prompt embeddings,
attention sinks, bidirectional attention, `logits_scaling` of a model type not in
`LOGITS_SCALING`, and layers other than full / sliding attention. `select_model_impl` decides at
engine start and marks the config (`IMPL_FIELD`); `models.get_model_class` reads the mark
(pooling.py's `transformers_model_class` picks the class)."""

from __future__ import annotations

import logging

from paged_engine.models.transformers_backend.experts import unsupported_layout
from paged_engine.models.utils import cfg_get

logger = logging.getLogger(__name__)

IMPL_FIELD = "paged_model_impl"  # set on the engine's hf_config: "transformers" selects the backend
_LAYER_TYPES = ("full_attention", "sliding_attention")
# config fields this wrapper cannot express, and the value that means "off"
_REFUSED_FIELDS = {
    "use_bidirectional_attention": False,  # EmbeddingGemma's (paged attends causally)
    # tokens over an expert's capacity are dropped: routing depends on the whole batch
    "expert_capacity": None,
    # MLA (DeepSeek V2 / V3): q/k and v head dims differ, paged's Attention takes one
    "kv_lora_rank": None,
}
# model_type -> whether HF's *ForCausalLM divides its logits by config.logits_scaling (True:
# Granite) or multiplies them by it (False: HyperCLOVA X); any other model type with a
# logits_scaling other than 1 is refused
LOGITS_SCALING = {"granite": True, "hyperclovax": False}


HEAD_NAMES = ("classifier", "score")  # HF's classification head's names, in vLLM's order


def _refuse(why: str) -> ValueError:
    return ValueError(f"model_impl='transformers': {why}")


def architectures(hf_config) -> list[str]:
    return list(getattr(hf_config, "architectures", None) or [])


def transformers_class(hf_config) -> type | None:
    """HF's `*ForCausalLM` class of the config's architecture, None where transformers has no
    causal LM of that name."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    archs = architectures(hf_config)
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    for arch in archs:
        if arch in causal:
            return getattr(transformers, arch, None)
    from paged_engine.models.transformers_backend.pooling import causal_class

    return causal_class(hf_config)  # a pooling architecture: the causal LM of its model type


def check_transformers_config(hf_config) -> type:
    """HF's causal LM class for `hf_config`, or ValueError naming what this backend refuses."""
    from paged_engine.models.multimodal_text import MARKER

    archs = ", ".join(getattr(hf_config, "architectures", None) or []) or "none"
    if getattr(hf_config, MARKER, None) is not None:  # a VLM wrapper's language model
        from paged_engine.models.transformers_backend.multimodal import check_multimodal

        check_multimodal(hf_config)
    elif hf_config.get_text_config() is not hf_config:
        raise _refuse(f"multimodal models are not supported ({archs})")
    if getattr(hf_config, "is_encoder_decoder", False):
        raise _refuse(f"encoder-decoder models are not supported ({archs})")
    from paged_engine.models.transformers_backend.encoder import (
        check_encoder_config,
        is_encoder_only,
    )

    if is_encoder_only(hf_config):  # BERT-family: the encoder path (encoder.py)
        return check_encoder_config(hf_config)
    cls = transformers_class(hf_config)
    if cls is None:
        raise _refuse(f"architectures {archs} name no transformers *ForCausalLM class")
    if not getattr(cls, "_supports_attention_backend", False):
        raise _refuse(
            f"{cls.__name__} does not support custom attention (_supports_attention_backend)"
        )
    why = unsupported_layout(hf_config)
    if why is not None:
        raise _refuse(why)
    for name, off in _REFUSED_FIELDS.items():
        value = getattr(hf_config, name, off)
        if value is not None and value != off:
            raise _refuse(f"config.{name}={value!r} is not supported")
    scaling = cfg_get(hf_config, "logits_scaling", 1.0)
    model_type = getattr(hf_config, "model_type", None)
    if scaling != 1.0 and model_type not in LOGITS_SCALING:
        raise _refuse(
            f"config.logits_scaling={scaling!r} is not supported for model_type {model_type!r} "
            f"(only {sorted(LOGITS_SCALING)})"
        )
    kinds = set(getattr(hf_config, "layer_types", None) or ()) - set(_LAYER_TYPES)
    if kinds:
        raise _refuse(f"config.layer_types {sorted(kinds)} are not supported (only {_LAYER_TYPES})")
    return cls


def select_model_impl(config, hf_config) -> None:
    """Engine start: mark `hf_config` for this backend where `config.model_impl` asks for it, or
    where "auto" finds no native class and transformers serves the architecture; refuse the
    engine options this backend cannot run (each by name)."""
    from paged_engine.models import get_model_class
    from paged_engine.models.transformers_backend.pooling import vllm_arch

    # vLLM's own names for this backend's classes ask for it whatever model_impl says
    impl = "transformers" if vllm_arch(hf_config) is not None else config.model_impl
    if impl == "vllm":
        return
    if impl == "auto":
        try:
            get_model_class(hf_config)
            return
        except ValueError:
            pass
        try:
            check_transformers_config(hf_config)
        except ValueError:
            return  # neither serves it: the registry's error comes where the engine asks it
        logger.info(
            "no native class for %s: the Transformers modeling backend serves it",
            ", ".join(hf_config.architectures),
        )
    else:
        check_transformers_config(hf_config)
    options = {
        "tensor_parallel_size": config.tensor_parallel_size != 1,
        "pipeline_parallel_size": config.pipeline_parallel_size != 1,
        "enable_lora": config.enable_lora,
        "speculative_config": config.speculative_config is not None,
        "enable_prompt_embeds": config.enable_prompt_embeds,
    }
    for name, refused in options.items():
        if refused:
            raise _refuse(f"{name}={getattr(config, name)!r} is not supported")
    setattr(hf_config, IMPL_FIELD, "transformers")
    # HF's forward runs eagerly: no CPU torch.compile, no CUDA graphs
    config.enforce_eager = True
    config.compilation_config = 0


__all__ = ["IMPL_FIELD", "check_transformers_config", "select_model_impl", "transformers_class"]
