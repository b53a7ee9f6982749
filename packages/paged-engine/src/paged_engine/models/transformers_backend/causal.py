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
`LOGITS_SCALING`, selection.py).

Weights load by HF name: the backbone keeps HF's module tree under the model's
`base_model_prefix`, so checkpoint names map 1:1 (MoE experts aside: below). Which checkpoints
run here, and what is refused by name, is decided at engine start: selection.py.

Mixture-of-experts decoders (Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE's shared experts) run HF's own
sparse blocks: their routing is per token (top-k of each token's router logits; HF's jitter noise
applies only in training, and the model runs in eval mode), so the flattened [1, T] row routes every
token as HF's batch would. Their checkpoints' per-expert linears are stacked into HF's 3D
expert parameters at load as transformers converts them (experts.py; an MoE model type converted
some other way is refused). vLLM's TransformersMoEForCausalLM swaps in fused experts for speed
only; paged has no such class, and the same `TransformersForCausalLM` serves both.

Pooling (embeddings, `*ForSequenceClassification`, vLLM's `Transformers*EmbeddingModel` /
`Transformers*ForSequenceClassification` names) runs on the same backbone: pooling.py;
vision-language checkpoints: multimodal.py. Encoder-only models (an attention module with
`is_causal=False`: BERT's family) run on paged's encoder path instead: encoder.py."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from paged_engine.distributed.parallel_state import get_parallel_state
from paged_engine.layers.attention import Attention, AttentionMetadata
from paged_engine.models.transformers_backend.experts import ExpertStacker, expert_renames
from paged_engine.models.transformers_backend.selection import (
    LOGITS_SCALING,
    _refuse,
    check_transformers_config,
)
from paged_engine.models.utils import CausalLMBase, cfg_get, soft_cap

ARCH = "TransformersForCausalLM"  # vLLM's name for this class
ATTN_IMPL = "paged"  # the attention function's name in transformers' AttentionInterface
STEP_KWARG = "paged_step"  # (kv_caches, attn_metadata), passed through HF's forward kwargs


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
    # whether `forward` takes the step's input embeddings as HF's `inputs_embeds` (multimodal.py's
    # decoder: token embeddings with image rows in place); refused otherwise
    takes_embeddings: ClassVar[bool] = False

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
        divides = LOGITS_SCALING.get(config.model_type, True)
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
        of HF's stacked expert parameter (experts.ExpertStacker)."""
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
        hidden: torch.Tensor | None = None,  # [T, D]: input embeddings (`takes_embeddings`)
    ) -> torch.Tensor:  # [T, D]
        if hidden is not None and not self.takes_embeddings:
            raise _refuse("prompt embeddings and pipeline stages are not supported")
        inputs = {"input_ids": input_ids} if hidden is None else {"inputs_embeds": hidden}
        backbone = getattr(self, self.inner_name)
        out = backbone(
            **{name: x[None] for name, x in inputs.items()},  # [1, T] or [1, T, D]
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


__all__ = ["ARCH", "ATTN_IMPL", "STEP_KWARG", "TransformersForCausalLM", "register_attention"]
