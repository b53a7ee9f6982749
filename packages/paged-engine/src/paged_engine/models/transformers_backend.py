"""Transformers modeling backend: any transformers decoder-only causal LM run by paged's engine.

vLLM's `model_impl="transformers"` (its `TransformersForCausalLM`): HF's own modeling code builds
the backbone (`AutoModel.from_config`: embeddings, decoder layers, rotary, norms untouched), and
only the attention is swapped: the model is built with `attn_implementation="paged"`, a function
registered in transformers' `AttentionInterface`, which hands each HF attention module's q / k / v
to a paged `Attention` layer (writes the step's K/V into that layer's paged cache, attends through
the block tables, with HF's softmax scale and the sliding window and `softcap` HF's forward
passes). The step's flattened tokens run as one HF batch row, `input_ids` [1, T] with
`position_ids` [1, T]; no HF cache and no HF mask (paged's attention is causal per sequence, and
transformers builds no mask for an attention function without a mask function of its own). The
LM head is paged's (`CausalLMBase`), tied to HF's input embedding where the config ties it;
`compute_logits` applies what HF's `*ForCausalLM` applies to the head's output (vLLM's
`LogitsProcessor(scale=logit_scale, soft_cap=final_logit_softcapping)`): the final soft cap, then
`logit_scale` (a factor: Cohere) and `logits_scaling` (a divisor for Granite, a factor for
HyperCLOVA X: the same name means opposite things, so it is read only for the model types in
`_LOGITS_SCALING`).

Weights load by HF name: the backbone keeps HF's module tree under the model's
`base_model_prefix`, so checkpoint names map 1:1 (MoE experts aside: below).

`model_impl="auto"` (the default) falls back to this class for an architecture the registry does not
serve when transformers has it as a causal LM whose class supports custom attention
(`_supports_attention_backend`, vLLM's rule). What cannot run this way is refused by name:
encoder-decoders, multimodal configs (but the vision-language wrappers
models/transformers_multimodal.py serves), token-dropping expert capacities (`expert_capacity`),
multi-head latent attention (`kv_lora_rank`), tensor / pipeline parallelism, LoRA, speculative
decoding, prompt embeddings, attention sinks, bidirectional attention, `logits_scaling`
of a model type not in `_LOGITS_SCALING`, and layers other than full / sliding attention.
`select_model_impl` decides at engine start and marks the config (`IMPL_FIELD`);
`models.get_model_class` reads the mark.

Mixture-of-experts decoders (Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE's shared experts) run HF's own
sparse blocks: their routing is per token (top-k of each token's router logits; HF's jitter noise
applies only in training, and the model runs in eval mode), so the flattened [1, T] row routes every
token as HF's batch would. Their checkpoints' per-expert linears are stacked into HF's 3D
expert parameters at load as transformers converts them (models/transformers_experts.py; an MoE
model type converted some other way is refused). vLLM's TransformersMoEForCausalLM swaps
in fused experts for speed only; paged has no such class, and the same `TransformersForCausalLM`
serves both.

Pooling (embeddings, `*ForSequenceClassification`, vLLM's `Transformers*EmbeddingModel` /
`Transformers*ForSequenceClassification` names) runs on the same backbone:
models/transformers_pooling.py. Encoder-only models (an attention module with `is_causal=False`:
BERT's family) run on paged's encoder path instead: models/transformers_encoder.py."""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from paged_engine.distributed.parallel_state import get_parallel_state
from paged_engine.layers.attention import Attention, AttentionMetadata
from paged_engine.models.transformers_experts import (
    ExpertStacker,
    expert_renames,
    unsupported_layout,
)
from paged_engine.models.utils import CausalLMBase, cfg_get, soft_cap

logger = logging.getLogger(__name__)

ARCH = "TransformersForCausalLM"  # vLLM's name for this class
ATTN_IMPL = "paged"  # the attention function's name in transformers' AttentionInterface
IMPL_FIELD = "paged_model_impl"  # set on the engine's hf_config: "transformers" selects ARCH
STEP_KWARG = "paged_step"  # (kv_caches, attn_metadata), passed through HF's forward kwargs
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
_LOGITS_SCALING = {"granite": True, "hyperclovax": False}


def _refuse(why: str) -> ValueError:
    return ValueError(f"model_impl='transformers': {why}")


def transformers_class(hf_config) -> type | None:
    """HF's `*ForCausalLM` class of the config's architecture, None where transformers has no
    causal LM of that name."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    archs = list(getattr(hf_config, "architectures", None) or [])
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    for arch in archs:
        if arch in causal:
            return getattr(transformers, arch, None)
    from paged_engine.models.transformers_pooling import causal_class

    return causal_class(hf_config)  # a pooling architecture: the causal LM of its model type


def check_transformers_config(hf_config) -> type:
    """HF's causal LM class for `hf_config`, or ValueError naming what this backend refuses."""
    from paged_engine.models.multimodal_text import MARKER

    archs = ", ".join(getattr(hf_config, "architectures", None) or []) or "none"
    if getattr(hf_config, MARKER, None) is not None:  # a VLM wrapper's language model
        from paged_engine.models.transformers_multimodal import check_multimodal

        check_multimodal(hf_config)
    elif hf_config.get_text_config() is not hf_config:
        raise _refuse(f"multimodal models are not supported ({archs})")
    if getattr(hf_config, "is_encoder_decoder", False):
        raise _refuse(f"encoder-decoder models are not supported ({archs})")
    from paged_engine.models.transformers_encoder import check_encoder_config, is_encoder_only

    if is_encoder_only(hf_config):  # BERT-family: the encoder path (transformers_encoder.py)
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
    if scaling != 1.0 and model_type not in _LOGITS_SCALING:
        raise _refuse(
            f"config.logits_scaling={scaling!r} is not supported for model_type {model_type!r} "
            f"(only {sorted(_LOGITS_SCALING)})"
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
    from paged_engine.models.transformers_pooling import vllm_arch

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


def _paged_attention(
    module: nn.Module,
    query: torch.Tensor,  # [1, H, T, D]
    key: torch.Tensor,  # [1, Hkv, T, D]
    value: torch.Tensor,  # [1, Hkv, T, D]
    attention_mask: torch.Tensor | None,  # None: paged's attention is causal itself
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: the output [1, T, H, D], no weights."""
    step = kwargs.get(STEP_KWARG)
    if step is None:
        raise RuntimeError(f"attn_implementation={ATTN_IMPL!r} runs only inside paged's engine")
    kv_caches, attn_metadata = step
    attn: Attention = module.paged_attn
    if kwargs.get("s_aux") is not None:  # gpt-oss style sinks (refused at build where seen)
        raise RuntimeError(f"layer {module.layer_idx}: attention sinks are not supported")
    # HF's window of this layer, as its forward hands it to a flash-attention function (HF's
    # eager / sdpa paths window through the mask instead, which is not built here)
    attn.sliding_window = kwargs.get("sliding_window") or None
    # HF's attention-logit soft cap, passed at call time (Gemma 2: attn_logit_softcapping); a
    # model that does not pass it (Gemma 3) does not cap, here as in HF
    attn.soft_cap = kwargs.get("softcap") or None
    num_tokens, head_dim = query.shape[2], query.shape[3]
    q = query[0].transpose(0, 1).reshape(num_tokens, -1)
    k = key[0].transpose(0, 1).reshape(num_tokens, -1)
    v = value[0].transpose(0, 1).reshape(num_tokens, -1)
    out = attn(q, k, v, kv_caches[module.layer_idx], attn_metadata)  # [T, H*D]
    return out.view(1, num_tokens, -1, head_dim), None


def register_attention() -> None:
    """Register the "paged" attention function with transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPL, _paged_attention)


def _attention_modules(backbone: nn.Module) -> list[nn.Module]:
    """HF's attention modules: those with a layer index and a softmax scale."""
    return [
        m
        for m in backbone.modules()
        if isinstance(getattr(m, "layer_idx", None), int) and hasattr(m, "scaling")
    ]


class TransformersForCausalLM(CausalLMBase):
    """HF's backbone with paged attention and paged's LM head (see the module docstring)."""

    ignored_weights = ("rotary_emb.inv_freq",)

    def __init__(self, config) -> None:
        from transformers import AutoModel

        hf_class = check_transformers_config(config)
        state = get_parallel_state()
        if state.tp_size != 1 or state.pp_size != 1:
            raise _refuse("tensor and pipeline parallelism are not supported")
        register_attention()
        with torch.device("meta"):  # HF's whole *ForCausalLM, only to read its LM head
            full = hf_class(copy.deepcopy(config))
        head = full.get_output_embeddings()
        if not isinstance(head, nn.Linear) or getattr(full, self.head_name, None) is not head:
            raise _refuse(f"{hf_class.__name__}'s LM head is not a plain `lm_head` linear layer")
        self.head_bias = head.bias is not None
        # what HF's *ForCausalLM does to the head's logits (see the module docstring)
        self.final_soft_cap: float | None = cfg_get(config, "final_logit_softcapping", None)
        self.logit_scale = float(cfg_get(config, "logit_scale", 1.0))
        scaling = float(cfg_get(config, "logits_scaling", 1.0))
        divides = _LOGITS_SCALING.get(config.model_type, True)
        self.logits_divisor = scaling if divides else 1.0
        self.logit_scale *= 1.0 if divides else scaling
        hf_config = copy.deepcopy(config)  # from_config sets _attn_implementation on it
        backbone = AutoModel.from_config(
            hf_config, attn_implementation=ATTN_IMPL, dtype=torch.get_default_dtype()
        )
        # checkpoint names: "<base_model_prefix>.layers.0...", as HF's *ForCausalLM saves them
        self.inner_name = hf_class.base_model_prefix or "model"
        embed = backbone.get_input_embeddings()
        embed_name = next(n for n, m in backbone.named_modules() if m is embed)
        self.embed_path = f"{self.inner_name}.{embed_name}"
        super().__init__(config, backbone)
        self._bind_attention(backbone, config)
        # MoE checkpoints' per-expert names -> HF's module tree (see the module docstring)
        self.renames = expert_renames(config)

    @staticmethod
    def _bind_attention(backbone: nn.Module, config) -> None:
        """One paged `Attention` per decoder layer, a child of HF's attention module of that
        layer; the layer's cache is kv_caches[layer_idx], of the shape the cache engine reads
        from the config (num_key_value_heads, head_dim)."""
        num_layers = int(config.num_hidden_layers)
        num_heads = int(config.num_attention_heads)
        num_kv_heads = int(getattr(config, "num_key_value_heads", None) or num_heads)
        cache_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        modules = _attention_modules(backbone)
        if sorted(m.layer_idx for m in modules) != list(range(num_layers)):
            raise _refuse("its attention modules do not map one to one onto the decoder layers")
        for m in modules:
            head_dim = int(getattr(m, "head_dim", cache_dim))
            if head_dim != cache_dim or not getattr(m, "is_causal", True):
                raise _refuse(
                    f"attention layer {m.layer_idx} is not a causal one of head_dim {cache_dim}"
                )
            if getattr(m, "sinks", None) is not None:
                raise _refuse("attention sinks are not supported")
            m.paged_attn = Attention(
                num_heads,
                head_dim,
                num_kv_heads,
                scale=float(m.scaling),
                sliding_window=None,  # set at each call from what HF's forward passes
                soft_cap=None,  # likewise
            )

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True
    ) -> set[str]:
        """`CausalLMBase.load_weights`, with each expert's checkpoint linear copied into its slice
        of HF's stacked expert parameter (transformers_experts.ExpertStacker)."""
        stacker = ExpertStacker(self)
        renamed = ((self.rename_weight(n), w) for n, w in weights)  # (the rename is idempotent)
        loaded = super().load_weights(stacker.others(renamed), strict=False)
        loaded |= stacker.complete(strict)
        params = stacker.params
        missing = sorted(n for n in params if n not in loaded) if strict else []
        if missing:
            raise ValueError(
                f"{type(self).__name__}: checkpoint does not match: missing weights {missing[:8]}"
            )
        return loaded

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn_metadata: AttentionMetadata,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [T, D]
        if hidden is not None:
            raise _refuse("prompt embeddings and pipeline stages are not supported")
        backbone = getattr(self, self.inner_name)
        out = backbone(
            input_ids=input_ids[None],
            position_ids=positions[None],
            use_cache=False,
            **{STEP_KWARG: (kv_caches, attn_metadata)},
        )
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, V] fp32
        logits = soft_cap(super().compute_logits(hidden), self.final_soft_cap)
        if self.logit_scale != 1.0:
            logits = logits * self.logit_scale
        if self.logits_divisor != 1.0:
            logits = logits / self.logits_divisor
        return logits


__all__ = [
    "ARCH",
    "IMPL_FIELD",
    "TransformersForCausalLM",
    "check_transformers_config",
    "select_model_impl",
]
