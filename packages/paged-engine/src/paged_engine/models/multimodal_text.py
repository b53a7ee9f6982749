"""The language model inside a vision-language checkpoint, served text-only.

A VLM wrapper (`*ForConditionalGeneration`) is a vision encoder and projector around a text
decoder that is, on text-only input, exactly a text `*ForCausalLM` we already build; which
class serves which wrapper, and what each drops, is models/text_wrappers.py's table. The
LLaVA-family, InternVL, Mistral 3 / LightOnOCR, LFM2-VL, Command A Vision, BLIP-2 and Voxtral
wrappers (`Wrapper.any_text`) take any decoder-only text model, as transformers (AutoModel /
AutoModelForCausalLM from text_config) and vLLM (init_vllm_registered_model) do: the
registered class of transformers' causal LM for text_config.model_type
(`registered_text_arch`), its logits rules (Granite's logits_scaling, Cohere's logit_scale,
soft caps) its own, as vLLM's language model.

Config (`text_only_config`, called where the loader reads config.json): the wrapper's
text_config, with `architectures` naming our class and the fields that live at the wrapper's
top level: `tie_word_embeddings` (transformers 5 ties the wrapper's lm_head by the top-level
flag, BLIP-2's and Llama 4's nested text model by text_config's: `wrapper_ties_head`; a
checkpoint that contradicts the flag loads as tied_weights.py says), `quantization_config`,
the dtype, and bos / eos / pad ids the wrapper sets. Per wrapper: Gemma 3's wrapper applies no
final logit soft-cap (its forward is lm_head alone, unlike Gemma3ForCausalLM), so the copy drops
`final_logit_softcapping`; Phi-4-multimodal's config is flat (its decoder's fields at the top
level), so the copy is of the whole config (`Wrapper.flat`); Gemma 3n's wrapper embeds its
vision and audio token ids with the
towers' token embedders (`embed_vision`, `embed_audio`: kept, the towers dropped), so the copy
names them with their vocab offsets and sizes (models/gemma3n.py); a Qwen "mrope" rope type
(older configs) becomes "default";
Qwen3-VL-MoE's router always renormalizes its top-k weights (transformers 5's config has no
`norm_topk_prob`, and its router reads none), so the copy sets `norm_topk_prob` True.
Command A Vision's wrapper (Cohere2Vision) returns lm_head's logits unscaled, so the copy's
`logit_scale` is 1 (Aya Vision's multiplies by it, as Cohere's text models do). GLM-4.1V /
4.6V's text attention always has q / k / v biases (the copy sets `attention_bias`) and splits
heads of hidden_size // num_attention_heads (a text_config.head_dim that differs is refused by
name); GLM-4.5V's never has q / k norms (the copy sets `use_qk_norm` False). HunyuanOCR's
"xdrope" (four rope axes: models/hunyuan_vl.py) keeps its `mrope_section`. Qwen Omni: the
whole model's flags and text_config live in its `thinker_config`; Qwen3-Omni's thinker
attention ignores `sliding_window` while transformers' cache, built from the same config, keeps
only that many tokens, so a set text_config.sliding_window is refused by name (the Hub's is
null).

Weights (`text_model_weights`): the language model's names map to ours whichever way the
checkpoint was saved: `model.language_model.X` (transformers 5) and `language_model.model.X`
(older Gemma 3 / Mistral 3 saves) -> `model.X`; `language_model.lm_head.X` -> `lm_head.X`;
`model.X` and `lm_head.X` (Qwen2-VL / Qwen2.5-VL saves) stay; Idefics2 / Idefics3 / SmolVLM's
`model.text_model.X` -> `model.X`. Per wrapper, before those: Ovis 2.5's Hub names (what
transformers 5 saves too) `llm.model.X` / `llm.lm_head.X`; Kimi K2.5's
`[model.]language_model[.model].blocks.N` (transformers 5 saves its vision tower's `layers` ->
`blocks` rename on the decoder too) -> `model.layers.N`; the whole Qwen Omni model's
`thinker.model.[language_model.]X` / `thinker.lm_head.X`; Cosmos3 Edge's release
(what transformers 5.25 saves) keeps its decoder at the top level: `embed_tokens.` / `layers.` /
`norm.` -> `model.`. The vision tower and projector
(`[model.]vision_tower.`, `[model.]multi_modal_projector.`, `[model.]visual.`, LLaVA-NeXT's
`image_newline`, Llama 4's `[model.]vision_model.`, Idefics3's `[model.]vision_model.` /
`[model.]connector.`, Kimi K2.5's `mm_projector.`, MiniCPM-V's `merger.`, Ovis 2.5's
`visual_tokenizer.` / `vte.`, HunyuanOCR's `vit.`, PaddleOCR-VL's `[model.]projector.` /
`mlp_AR.`, Qwen Omni's `audio_tower.` and the whole
model's `talker.` / `token2wav.` / `code2wav.` (speech output, not served)) are dropped by name
before their bytes are touched (tensors are views of memory-mapped files until copied).

Qwen3-VL-MoE's fused experts (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`; per-expert
matrices load as for Qwen3-MoE) come in one of two layouts, with H = hidden_size and
I = moe_intermediate_size: ours, which is transformers 5's in memory and what its save_pretrained
writes ([E, 2I, H] and [E, H, I]), or the Hub's, written by transformers 4.57 for the published
checkpoints ([E, H, 2I] and [E, I, H], the transpose of dims 1 and 2). The shape decides: a
tensor whose last two dims are ours reversed is transposed (a view), any other passes on for
the loader to check. Where H == 2I (gate_up) or H == I (down) both layouts have one shape; then
the writer decides: config.json's `transformers_version` 5 or later means ours (transformers 5
itself transposes on a shape mismatch only), an older or missing one the Hub's layout.

Why text-only is exact (checked against transformers' modeling code): with no image, every
wrapper embeds the tokens with the text model's embedding (Kimi K2.5 embeds its image / video
placeholder ids as id 0; only media prompts, refused, hold them), runs the text decoder with its
own causal / sliding masks, and applies lm_head; no vision path runs (Gemma 3's bidirectional
image mask needs token_type_ids, Qwen3-VL's deepstack needs visual positions). Qwen's M-RoPE
gives each rotary frequency the position id of one of three sections (temporal, height, width:
in contiguous blocks of mrope_section for Qwen2-VL / 2.5-VL, interleaved for Qwen3-VL); text
tokens get the same id in all three sections (their 1-D position, rope_deltas 0 without images),
so every frequency sees the token's position and M-RoPE is the ordinary NeoX-style RoPE over
head_dim with the same inv_freq.

Not handled here: images (the wrappers of multimodal/archs.py's IMAGE_ARCHS run them through
multimodal/, which loads the vision encoder apart; other wrappers' images are refused) and
audio, LoRA adapters trained on the wrapper's module names.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from paged_engine.models.text_wrappers import WRAPPERS

logger = logging.getLogger(__name__)


MARKER = "text_only_of"
# Set with `hub_experts`: whether a fused expert tensor of either layout's shape is the Hub's.
SQUARE_EXPERTS_HUB = "text_only_square_experts_hub"

# (checkpoint prefix, our prefix), first match wins
_RENAMES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.text_model.", "model."),  # Idefics3 / SmolVLM
)
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def wrapper_arch(config: Any) -> str | None:
    """The VLM wrapper `config.architectures` names, or None."""
    archs = getattr(config, "architectures", None) or []
    return next((a for a in archs if a in WRAPPERS), None)


def text_only_config(config: Any) -> Any:
    """`config` itself unless it is a known VLM wrapper's; then a copy of its text_config set
    up to build and load our text model (see the module doc)."""
    arch = wrapper_arch(config)
    if arch is None:
        return config
    spec = WRAPPERS[arch]
    outer = config
    if spec.sub_config is not None:
        config = getattr(config, spec.sub_config, None)
        if config is None:
            raise ValueError(f"{arch}: the config has no {spec.sub_config}")
    text = config if spec.flat else getattr(config, "text_config", None)
    model_type = getattr(text, "model_type", None)
    target = spec.text_archs.get(model_type) if text is not None else None
    if target is None and getattr(text, "is_encoder_decoder", False):  # BLIP-2's Flan-T5
        raise ValueError(
            f"{arch} with a text_config of model_type {model_type!r} (an encoder-decoder "
            "text model) is not supported: paged serves decoder-only text models"
        )
    if target is None and spec.any_text and text is not None:
        target = registered_text_arch(arch, text)
    if target is None:
        known = ", ".join(sorted(spec.text_archs))
        raise ValueError(
            f"{arch} with a text_config of model_type {model_type!r} is not supported "
            f"(text-only serving knows: {known})"
        )
    if spec.head_dim_from_heads:
        _check_head_dim(arch, text)
    for key in spec.refused:
        if getattr(text, key, None) is not None:
            raise ValueError(
                f"{arch}: text_config.{key} is set, which the wrapper's text model reads "
                "inconsistently (not supported)"
            )
    text = copy.deepcopy(text)
    text.architectures = [target]
    text.tie_word_embeddings = wrapper_ties_head(
        getattr(config, "tie_word_embeddings", None),
        getattr(text, "tie_word_embeddings", None),
        spec.nested_head,
    )
    if getattr(text, "quantization_config", None) is None:
        quant = getattr(config, "quantization_config", None) or getattr(
            outer, "quantization_config", None
        )
        if quant is not None:
            text.quantization_config = quant
    attrs, top, whole = vars(text), vars(config), vars(outer)
    if attrs.get("dtype") is None and attrs.get("torch_dtype") is None:
        dtype = next(
            (c[k] for c in (top, whole) for k in ("dtype", "torch_dtype") if c.get(k)), None
        )
        if dtype is not None:
            text.dtype = dtype
    for key in _TOKEN_IDS:
        value = getattr(config, key, None)
        if value is not None:
            setattr(text, key, value)
    if spec.no_final_soft_cap:
        text.final_logit_softcapping = None
    if spec.mrope:
        _mrope_as_default(text)
    if spec.renormalized_topk:
        text.norm_topk_prob = True
    if spec.no_logit_scale:
        text.logit_scale = 1.0
    for key, value in spec.fixed:
        setattr(text, key, value)
    for key in spec.carried:
        if getattr(config, key, None) is not None:
            setattr(text, key, getattr(config, key))
    if spec.extra_vocab:
        text.head_vocab_size = int(text.vocab_size)
        extra = int(getattr(text, "additional_vocab_size", 0) or 0)
        text.vocab_size = int(text.vocab_size) + extra  # the head's rows stay head_vocab_size
    if spec.hub_experts:
        setattr(text, SQUARE_EXPERTS_HUB, _written_before_5(config))
    if spec.media_embedders:
        from paged_engine.models.gemma3n import MEDIA_EMBEDDERS

        setattr(text, MEDIA_EMBEDDERS, _media_embedders(config, spec.media_embedders))
    setattr(text, MARKER, arch)
    from paged_engine.multimodal.archs import IMAGE_ARCHS
    from paged_engine.multimodal.audio_archs import AUDIO_ARCHS

    media = [m for m, archs in (("images", IMAGE_ARCHS), ("audio", AUDIO_ARCHS)) if arch in archs]
    if media:
        logger.info(
            "%s: its language model (%s), %s through multimodal/", arch, target, " and ".join(media)
        )
    else:
        logger.info(
            "%s: serving its language model (%s) text-only; the media towers are not loaded",
            arch,
            target,
        )
    return text


def registered_text_arch(arch: str, text: Any) -> str:
    """The registered class that serves `text` (a wrapper's text_config) as a causal LM:
    transformers' causal LM for its model_type (what transformers 4's wrapper built; 5's builds
    that class's base model, under the same names), else text_config.architectures' (vLLM
    builds the language model from them). ValueError naming `arch` and the type where paged
    serves no causal LM for it, or the class keeps its decoder elsewhere than `model.` (the
    wrapper saves it as `model.language_model.`, renamed to `model.`)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from paged_engine.models import MODEL_REGISTRY  # late: models/ imports this module

    model_type = getattr(text, "model_type", None)
    hf_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    names = [hf_name] if hf_name else []
    names += [a for a in getattr(text, "architectures", None) or [] if a.endswith("ForCausalLM")]
    target = next((n for n in names if n in MODEL_REGISTRY and n not in WRAPPERS), None)
    if target is None:
        raise ValueError(
            f"{arch} with a text_config of model_type {model_type!r} is not supported: paged "
            f"serves no causal LM for it (transformers' class: {hf_name or 'none'})"
        )
    prefix = getattr(getattr(transformers, target, None), "base_model_prefix", "model")
    if prefix != "model":
        raise ValueError(
            f"{arch} with a text_config of model_type {model_type!r} is not supported: its "
            f"{target} keeps its decoder under `{prefix}.`, the wrapper's names map to `model.`"
        )
    return target


def wrapper_ties_head(top: bool | None, text: bool | None, nested: bool) -> bool:
    """Whether a wrapper's text model ties lm_head to its token embedding, as transformers 5
    loads it. `top` / `text`: tie_word_embeddings of the wrapper's config and of its
    text_config (None: unset). A `nested` wrapper (`Wrapper.nested_head`) holds a whole
    *ForCausalLM that ties by its own config, text_config; any other wrapper's lm_head is its
    own, tied by the top-level flag (text_config's where the config sets none; LLaVA's config
    class already folds text_config's in). What the checkpoint then holds decides as for any
    causal LM (tied_weights.py: a head of other values than the embedding is untied, a head
    alone becomes the embedding); untied with no head, the load refuses the missing lm_head
    (transformers would start it random)."""
    flag = text if nested or top is None else top
    return bool(flag)


def text_model_weights(
    weights: Iterable[tuple[str, Any]], config: Any
) -> Iterable[tuple[str, Any]]:
    """`weights` with a VLM wrapper's language-model names mapped to ours and its vision
    weights dropped (and fused experts in our layout, see the module doc); unchanged for any
    other config."""
    arch = getattr(config, MARKER, None)
    if arch is None:
        return weights
    spec = WRAPPERS[arch]
    if spec.remote_phi4mm:
        from paged_engine.multimodal.phi4mm_remote import hf_weights

        weights = hf_weights(weights)
    mapped = _mapped(weights, spec.skipped, spec.renames + _RENAMES)
    return _experts_as_ours(mapped, config) if spec.hub_experts else mapped


def _mapped(
    weights: Iterable[tuple[str, Any]],
    skipped: tuple[str, ...],
    renames: tuple[tuple[str, str], ...],
) -> Iterator[tuple[str, Any]]:
    for name, tensor in weights:
        if name.startswith(skipped):
            continue  # never read: only the name was looked at
        for old, new in renames:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        yield name, tensor


def hub_layout(shape: tuple[int, ...], ours: tuple[int, int], square_is_hub: bool) -> bool:
    """Whether a fused expert tensor of `shape` [E, a, b] is the Hub's transpose of our
    [E, *ours]; a square `ours` fits both layouts, and `square_is_hub` decides."""
    if len(shape) != 3 or tuple(shape[1:]) != ours[::-1]:
        return False  # ours, or neither layout: the loader reports a wrong shape
    return ours[0] != ours[1] or square_is_hub


def _experts_as_ours(weights: Iterable[tuple[str, Any]], config: Any) -> Iterator[tuple[str, Any]]:
    h, i = config.hidden_size, config.moe_intermediate_size
    ours = {".mlp.experts.gate_up_proj": (2 * i, h), ".mlp.experts.down_proj": (h, i)}
    square_is_hub = bool(getattr(config, SQUARE_EXPERTS_HUB, True))
    for name, tensor in weights:
        suffix = next((s for s in ours if name.endswith(s)), None)
        if suffix is not None and hub_layout(tuple(tensor.shape), ours[suffix], square_is_hub):
            tensor = tensor.transpose(1, 2)
        yield name, tensor


def _media_embedders(config: Any, towers: tuple[tuple[str, str], ...]) -> list[tuple]:
    """(module, vocab_offset, vocab_size, hidden_size, rms_norm_eps) of each tower config the
    wrapper has (a tower left out of the config embeds no ids)."""
    out = []
    for key, module in towers:
        tower = getattr(config, key, None)
        if tower is None:
            continue
        fields = ("vocab_offset", "vocab_size", "hidden_size")
        offset, size, width = (int(getattr(tower, f)) for f in fields)
        out.append((module, offset, size, width, float(getattr(tower, "rms_norm_eps", 1e-6))))
    return out


def _check_head_dim(arch: str, text: Any) -> None:
    """GLM-4.1V's attention splits heads of hidden_size // num_attention_heads whatever
    text_config.head_dim says, while its rope reads head_dim: refused where the two differ."""
    head_dim = getattr(text, "head_dim", None)
    if head_dim is not None and head_dim != text.hidden_size // text.num_attention_heads:
        raise ValueError(
            f"{arch}: text_config.head_dim {head_dim} differs from hidden_size // "
            "num_attention_heads, which the wrapper's attention uses (not supported)"
        )


def _written_before_5(config: Any) -> bool:
    """Whether config.json names a transformers older than 5 as its writer, or none."""
    version = str(getattr(config, "transformers_version", None))
    try:
        return int(version.split(".")[0]) < 5
    except ValueError:
        return True


def _mrope_as_default(text: Any) -> None:
    """An "mrope" rope type (configs of older transformers) is the default rope for text."""
    for key in ("rope_parameters", "rope_scaling"):
        params = getattr(text, key, None)
        if isinstance(params, dict) and "mrope" in (params.get("rope_type"), params.get("type")):
            params = dict(params)
            params["rope_type"] = "default"
            params.pop("type", None)
            setattr(text, key, params)


def processor_chat_template(path: Path) -> str | None:
    """The chat template a VLM repo keeps for its processor only (chat_template.json), which
    the tokenizer does not read; None where there is none."""
    file = path / "chat_template.json"
    if not file.is_file():
        return None
    try:
        template = json.loads(file.read_text()).get("chat_template")
    except (OSError, ValueError, AttributeError):
        return None
    return template if isinstance(template, str) else None
