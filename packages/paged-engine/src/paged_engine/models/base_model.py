"""`<Stem>Model`: the headless base checkpoint of a registered decoder, served as an embedding
model (vLLM's `LlamaModel` / `MistralModel` / `Qwen2Model` / `Gemma2Model` / `Gemma3TextModel`
rows of its embedding registry: e5-mistral-7b-instruct, gte-Qwen2, bge-multilingual-gemma2).

HF saves such a model as its `<Stem>ForCausalLM` sibling's decoder without the decoder prefix
(`layers.0.self_attn.q_proj.weight`, not `model.layers.0...`) and without an LM head. The class
here is that sibling with the prefix put back on each name (HF's `base_model_prefix` of the
causal class: `model.` for most, `transformer.` for Bloom / Falcon / GPT-J / MPT; names that
already carry it load as they are, as vLLM accepts both) and `ZeroLogits` for a head, so the
engine's one throwaway token per pooling request needs no [vocab, hidden] weight.

It only pools, as in vLLM (whose `*Model` suffix means runner "pooling", convert "embed", and
whose embedding models refuse runner "generate"): `LLM.embed` / `LLM.encode` (tasks "embed",
"token_embed"); a generation request is refused by name (llm_engine.py `_refuse`). Pooling: the
final normed hidden state of the last token, L2-normalized (vLLM's default for a decoder turned
into an embedding model), unless sentence-transformers' files say otherwise (`modules.json`,
its Pooling module's `config.json`: last token, mean or CLS; normalized when a Normalize module
follows) or the engine's `pooler_config` does. Dense modules run after the pooling
(models/st_modules.py); sentence-transformers modules paged does not run are refused by name.

`Gemma3TextModel` with `use_bidirectional_attention` (EmbeddingGemma) is this headless class
run as an encoder (models/gemma3_encoder.py), as vLLM runs it; the flag on any other base model
is refused by name (vLLM reads it for Gemma 3 only).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paged_engine.models.gemma3_encoder import bidirectional_gemma3
from paged_engine.models.sequence_classifier import ZeroLogits
from paged_engine.models.st_modules import check_st_modules

logger = logging.getLogger(__name__)

SUFFIX = "Model"
# the base models whose use_bidirectional_attention paged runs (as an encoder)
_BIDIRECTIONAL = {"Gemma3TextModel": bidirectional_gemma3}


def causal_candidates(arch: str) -> tuple[str, ...]:
    """The causal architectures a `<Stem>Model` may be the decoder of, in the order to try;
    () for an architecture without the suffix. A text model of a multimodal family
    (Gemma3TextModel) shares its text-only causal LM's."""
    if not arch.endswith(SUFFIX) or arch.endswith(("LMHeadModel", "ForRewardModel")):
        return ()
    stem = arch.removesuffix(SUFFIX)
    names = (stem + "ForCausalLM", stem + "LMHeadModel")
    if stem.endswith("Text"):
        names += (stem.removesuffix("Text") + "ForCausalLM",)
    return names


def base_model_class(hf_config: Any, arch: str, registry: dict[str, type]) -> type | None:
    """The headless class for `arch` when it is the base model of a registered causal LM (None
    otherwise); ValueError naming what paged cannot serve exactly."""
    causal = next((n for n in causal_candidates(arch) if n in registry), None)
    if causal is None:
        return None
    if getattr(hf_config, "vision_config", None) is not None:
        raise ValueError(
            f"{arch}: the base model of a multimodal family (config.vision_config) is not "
            f"supported; serve its {causal} text model"
        )
    if getattr(hf_config, "use_bidirectional_attention", False):
        if arch not in _BIDIRECTIONAL:
            raise ValueError(
                f"{arch} with use_bidirectional_attention=True is not supported: paged runs "
                f"this decoder causally (bidirectional: {sorted(_BIDIRECTIONAL)})"
            )
        return _BIDIRECTIONAL[arch](headless(registry[causal], causal))
    return headless(registry[causal], causal)


class HeadlessLM:
    """Mixin before a CausalLMBase subclass: its base model without an LM head (a zero-logits
    stand-in; the model only pools), loading a base checkpoint (names without the decoder
    prefix, `decoder_prefix()`, which is put back) or a causal one (its LM head skipped)."""

    pooling_only = "a base model without an LM head"

    def __init__(self, config) -> None:
        super().__init__(config)
        setattr(self, self.head_name, ZeroLogits(config.vocab_size))
        self.tie_word_embeddings = False  # no head to tie, nor a copy of it to skip

    def decoder_prefix(self) -> str:
        """The causal LM's name for its decoder (HF's `base_model_prefix`)."""
        raise NotImplementedError

    def rename_weight(self, name: str) -> str:
        # the causal sibling's names: the decoder prefix put back where it is missing
        prefix = self.decoder_prefix() + "."
        return super().rename_weight(name if name.startswith(prefix) else prefix + name)

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True
    ) -> set[str]:
        head = f"{self.head_name}."  # a causal checkpoint's head: nothing to load it into
        kept = ((n, w) for n, w in weights if not n.startswith(("lm_head.", head)))
        return super().load_weights(kept, strict)


@functools.cache
def headless(base: type[nn.Module], causal: str) -> type[nn.Module]:
    """`base` (a CausalLMBase subclass) loading a base-model checkpoint, without an LM head.
    The decoder prefix is looked up when weights load, not here: modules build these classes
    at import, and transformers' causal class costs ~1.4 s to import (masking_utils, dynamo)."""

    class BaseModel(HeadlessLM, base):  # type: ignore[misc, valid-type]
        def decoder_prefix(self) -> str:
            return _hf_prefix(causal)

    BaseModel.__name__ = BaseModel.__qualname__ = causal.removesuffix("ForCausalLM") + "Model"
    return BaseModel


@functools.cache
def _hf_prefix(causal: str) -> str:
    """transformers' `base_model_prefix` of the causal class (what HF itself strips from a base
    checkpoint's names); "model" when transformers has no such class."""
    import transformers

    try:
        cls = getattr(transformers, causal, None)
    except Exception:  # a lazy import failing (an optional dependency): the common prefix
        cls = None
    prefix = getattr(cls, "base_model_prefix", None)
    return prefix if isinstance(prefix, str) and prefix else "model"


def pooling_only(hf_config: Any) -> str | None:
    """What kind of pooling-only model this is ("a base model without an LM head"), None for a
    model that may also generate (or one paged does not serve: the loader says so later)."""
    from paged_engine.models import get_model_class

    try:
        cls = get_model_class(hf_config)
    except ValueError:
        return None
    return getattr(cls, "pooling_only", None)


def base_model_engine_config(config: Any, hf_config: Any, model_dir: Path | None) -> None:
    """For a base model: refuse sentence-transformers modules paged does not run, and take the
    pooling its files describe when `pooler_config` is not given (else LAST, normalized)."""
    if pooling_only(hf_config) is None or model_dir is None:
        return
    from paged_engine.models import get_model_class

    own = getattr(get_model_class(hf_config), "pooled_rows", False)
    st_engine_config(config, hf_config, model_dir, own_pooling=own)


def causal_st_engine_config(config: Any, hf_config: Any, model_dir: Path | None) -> None:
    """For a model that may also generate (a `*ForCausalLM` such as Qwen3-Embedding) served
    for embeddings: its sentence-transformers files read as a base model's (vLLM reads them
    for any model; max_seq_length bounds its generation too, as in vLLM)."""
    if model_dir is not None:
        st_engine_config(config, hf_config, model_dir)


def st_engine_config(
    config: Any, hf_config: Any, model_dir: Path, own_pooling: bool = False
) -> None:
    """sentence-transformers' files of an embedding model, as vLLM reads them: max_seq_length
    as its context length; unless the model pools its own way (`own_pooling`: a class whose
    every row is its pooled vector, SPLADE / GritLM, whose files hold other modules), modules
    paged does not run refused and the Pooling module's pooling (and Normalize) taken when
    `pooler_config` is not given."""
    from paged_engine.engine.encoder import (
        sentence_transformers_max_len,
        sentence_transformers_pooling,
    )

    sentence_transformers_max_len(config, hf_config, model_dir)
    if own_pooling:
        return
    arch = ", ".join(getattr(hf_config, "architectures", None) or ["this model"])
    check_st_modules(model_dir, arch)
    if config.pooler_config is None:
        found = sentence_transformers_pooling(model_dir)
        if found is not None:
            config.pooler_config = found
            logger.info("%s: pooling %s (sentence-transformers)", arch, found)
