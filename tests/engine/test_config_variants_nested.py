"""The text_config of composite (vision-language) checkpoints away from the tiny wrappers'
defaults, a few fields a case, as the family's released checkpoints vary them (Gemma 3 / 3n /
4, LLaVA / LLaVA-NeXT / OneVision, Mistral 3, Idefics2 / 3, SmolVLM, InternVL, Aya Vision,
Qwen2-VL / 2.5-VL / 3-VL / 3-VL-MoE, Llama 4, Llama 3.2 Vision, PaliGemma 2): each tiny random
`*ForConditionalGeneration` (a one-layer vision tower beside its text model), served by `LLM`
(float32) on token prompts shorter and longer than any sliding window, gives the wrapper's HF
`generate` greedy tokens and top-5 logprobs (1e-3, hf_parity.assert_serves_like_hf) on the same
weights; a few again in 16-token chunks with prefix caching, twice (config_variant_check), and
a few in the forms released config.json files hold (Qwen2-VL's flat fields and "mrope"
rope_scaling, Gemma 3's sliding_window_pattern and rope_local_base_freq). Gemma 3n's towers
need timm: its wrapper checkpoint is its text model's weights under the wrapper's names, the
reference test_models_gemma3n's emulation of the wrapper. Then one image case per family where
a cheap one exists: M-RoPE over other sections and head sizes, Gemma 3 / 4 and PaliGemma 2's
two-way image attention beside their windows, Mllama's cross-attention layers moved.

Regressions: LLaVA-family wrappers around Gemma (Intel/llava-gemma-*), Phi-3
(xtuner/llava-phi-3-mini-hf), Qwen3 (VARCO-VISION-2.0, LLaVA-OneVision) and Granite
(granite-vision-3.x, LLaVA-NeXT), and InternVL around gpt-oss
(InternVL3_5-GPT-OSS-20B-A4B-Preview-HF), which transformers runs, were refused at load
("text-only serving knows: ..."). Granite's logits_scaling is kept (vLLM's and transformers 4's
logits), where transformers 5's LLaVA-NeXT head drops it: same greedy tokens, logprobs of
its logits / logits_scaling. LLaVA-family and InternVL wrappers around any other text model
transformers and vLLM build from text_config (OLMo 2, Cohere 2, GraniteMoE, Qwen2-MoE,
StableLM) were refused the same way; each now serves as its registered class, its logits rules
kept (GraniteMoE's division, Cohere 2's logit_scale), and a type paged serves as no causal LM
(or whose decoder is not under `model.`) is refused by name. Mistral 3, LightOnOCR and LFM2-VL
around Llama, Command A Vision and Voxtral around Qwen2, BLIP-2 around OLMo 2 (wrappers
transformers and vLLM build from any text_config) were refused by their fixed tables the same
way. Image prompts through LLaVA / InternVL / Mistral 3 around text models whose embedding is
not Llama's (Gemma / Gemma 2 scaled by sqrt(hidden): image rows spliced after the scale, as
transformers 5's scaled embedding module leaves them, where vLLM's Gemma scales them too;
Granite / GraniteMoE's embedding_multiplier on every row; Cohere, OLMo 2, Qwen2-MoE, StableLM,
Phi-3) give HF's wrapper's tokens and logprobs.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from config_variant_check import CHUNKED_PREFIX_CACHE, serve_and_compare
from hf_parity import (
    assert_llm_matches,
    assert_serves_like_hf,
    load_hf_as_saved,
    write_hf_checkpoint,
)
from hf_reference import assert_matches, hf_greedy
from image_checks import engine, greedy, hf_refs, noise_image, qwen2_vl_hf_inputs
from test_models_vlm_text import _LLAMA_LIKE, _PIXTRAL_VISION, _QWEN_VISION, _SMALL_VISION, _text
from vlm_checkpoints import load_hf_vlm

from paged_engine import LLM, SamplingParams
from paged_engine.testing import (
    _COMMON,
    _save_random,
    write_tiny_gemma3,
    write_tiny_model,
    write_tiny_qwen2_vl,
)

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

MAX_TOKENS = 6


def _prompts(seed: str) -> list[list[int]]:
    """A short and a long prompt (the tiny windows are 8 to 32 tokens) of ids below the
    wrappers' reserved media ids."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 480) for _ in range(n)] for n in (7, 45)]


Builder = Callable[[], tuple[type, Any]]


def _gemma3(text: dict, **top: Any) -> tuple[type, Any]:
    config = transformers.Gemma3Config(
        text_config=_text("gemma3", **text),
        vision_config={**_SMALL_VISION, "model_type": "siglip_vision_model"},
        mm_tokens_per_image=4,
        boi_token_index=509,
        eoi_token_index=510,
        image_token_index=511,
        **top,
    )
    return transformers.Gemma3ForConditionalGeneration, config


def _gemma4(arch: str, text: dict, **top: Any) -> tuple[type, Any]:
    vision = transformers.Gemma4VisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
    )
    config = transformers.Gemma4Config(
        text_config=_text(arch, **text), vision_config=vision.to_dict(), audio_config=None, **top
    )
    return transformers.Gemma4ForConditionalGeneration, config


def _llava(name: str, arch: str, text: dict, **top: Any) -> tuple[type, Any]:
    vision = transformers.CLIPVisionConfig(**_SMALL_VISION, projection_dim=32).to_dict()
    config = getattr(transformers, f"{name}Config")(
        text_config=_text(arch, **text), vision_config=vision, image_token_index=500, **top
    )
    return getattr(transformers, f"{name}ForConditionalGeneration"), config


def _onevision(arch: str, text: dict, **top: Any) -> tuple[type, Any]:
    vision = {**_SMALL_VISION, "model_type": "siglip_vision_model"}
    config = transformers.LlavaOnevisionConfig(
        text_config=_text(arch, **text), vision_config=vision, image_token_index=500, **top
    )
    return transformers.LlavaOnevisionForConditionalGeneration, config


def _mistral3(arch: str, text: dict, **top: Any) -> tuple[type, Any]:
    config = transformers.Mistral3Config(
        text_config=_text(arch, **text),
        vision_config=_PIXTRAL_VISION,
        image_token_index=511,
        **top,
    )
    return transformers.Mistral3ForConditionalGeneration, config


def _lfm2_vl(arch: str, text: dict, **top: Any) -> tuple[type, Any]:
    vision = {**_SMALL_VISION, "model_type": "siglip2_vision_model"}
    del vision["image_size"]
    config = transformers.Lfm2VlConfig(
        text_config=_text(arch, **text), vision_config=vision, image_token_id=500, **top
    )
    return transformers.Lfm2VlForConditionalGeneration, config


def _lighton_ocr(arch: str, text: dict, **top: Any) -> tuple[type, Any]:
    vision = {"model_type": "pixtral", "hidden_size": 32, "intermediate_size": 48}
    vision |= {"num_hidden_layers": 1, "num_attention_heads": 2, "head_dim": 16}
    config = transformers.LightOnOcrConfig(
        text_config=_text(arch, **text), vision_config=vision, image_token_id=500, **top
    )
    return transformers.LightOnOcrForConditionalGeneration, config


def _cohere2_vision(arch: str, text: dict, **top: Any) -> tuple[type, Any]:
    config = transformers.Cohere2VisionConfig(
        text_config=_text(arch, **text),
        vision_config={**_SMALL_VISION, "model_type": "siglip_vision_model"},
        image_token_id=500,
        alignment_intermediate_size=64,
        **top,
    )
    return transformers.Cohere2VisionForConditionalGeneration, config


def _voxtral(arch: str, text: dict, **top: Any) -> tuple[type, Any]:
    audio = {"model_type": "voxtral_encoder", "hidden_size": 16, "intermediate_size": 64}
    audio |= {"num_hidden_layers": 1, "num_attention_heads": 2, "num_mel_bins": 16}
    config = transformers.VoxtralConfig(
        text_config=_text(arch, **text), audio_config=audio, audio_token_id=500, **top
    )
    return transformers.VoxtralForConditionalGeneration, config


def _idefics3(name: str, text: dict, **top: Any) -> tuple[type, Any]:
    vision = {**_SMALL_VISION, "model_type": f"{name.lower()}_vision"}
    config = getattr(transformers, f"{name}Config")(
        text_config=_text("llama", **text),
        vision_config=vision,
        image_token_id=500,
        scale_factor=2,
        **top,
    )
    return getattr(transformers, f"{name}ForConditionalGeneration"), config


def _internvl(arch: str, text: dict, **top: Any) -> tuple[type, Any]:
    vision = {**_SMALL_VISION, "image_size": [28, 28], "patch_size": [14, 14]}
    config = transformers.InternVLConfig(
        text_config=_text(arch, **text), vision_config=vision, image_token_id=500, **top
    )
    return transformers.InternVLForConditionalGeneration, config


def _aya_vision(text: dict, **top: Any) -> tuple[type, Any]:
    config = transformers.AyaVisionConfig(
        text_config=_text("cohere2", **text),
        vision_config={**_SMALL_VISION, "model_type": "siglip_vision_model"},
        image_token_index=500,
        alignment_intermediate_size=64,
        **top,
    )
    return transformers.AyaVisionForConditionalGeneration, config


def _llama4(text: dict, **top: Any) -> tuple[type, Any]:
    widths = {"vision_output_dim": 32, "projector_input_dim": 32, "projector_output_dim": 32}
    vision = transformers.Llama4VisionConfig(**_SMALL_VISION, **widths)
    config = transformers.Llama4Config(
        text_config=_text("llama4", **text), vision_config=vision.to_dict(), **top
    )
    return transformers.Llama4ForConditionalGeneration, config


def _idefics2(text: dict, **top: Any) -> tuple[type, Any]:
    vision = {**_SMALL_VISION, "model_type": "idefics2_vision"}
    perceiver = {"resampler_n_latents": 4, "resampler_depth": 1, "resampler_n_heads": 2}
    perceiver |= {"resampler_head_dim": 16, "num_key_value_heads": 1}
    config = transformers.Idefics2Config(
        text_config=_text("mistral", **text),
        vision_config=vision,
        perceiver_config=perceiver,
        image_token_id=500,
        **top,
    )
    return transformers.Idefics2ForConditionalGeneration, config


def _aya_vision_cohere() -> tuple[type, Any]:
    text = _text("cohere", use_qk_norm=False, logit_scale=0.25, layer_norm_eps=1e-5)
    config = transformers.AyaVisionConfig(
        text_config=text,
        vision_config={**_SMALL_VISION, "model_type": "siglip_vision_model"},
        image_token_index=500,
        alignment_intermediate_size=64,
    )
    return transformers.AyaVisionForConditionalGeneration, config


def _qwen_vl(version: str, text: dict, rope: dict, **top: Any) -> tuple[type, Any]:
    """Qwen2-VL ("2"), Qwen2.5-VL ("2_5") or Qwen3-VL ("3") around a tiny text model with
    `rope` (mrope_section and the like) and `text`'s fields."""
    name = {"2": "Qwen2VL", "2_5": "Qwen2_5_VL", "3": "Qwen3VL"}[version]
    rope = {"rope_type": "default", "rope_theta": 10_000.0, **rope}
    text_config = getattr(transformers, f"{name}TextConfig")(
        **{**_LLAMA_LIKE, **text}, rope_parameters=rope
    )
    if version == "2":
        vision = {"depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2}
        vision |= {"patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}
    elif version == "2_5":
        vision = {**_QWEN_VISION, "fullatt_block_indexes": [0], "window_size": 56}
    else:
        vision = {**_QWEN_VISION, "num_position_embeddings": 16, "deepstack_visual_indexes": [0]}
    config = getattr(transformers, f"{name}Config")(
        text_config=text_config.to_dict(), vision_config=vision, **top
    )
    return getattr(transformers, f"{name}ForConditionalGeneration"), config


def _qwen3_vl_moe(text: dict, **top: Any) -> tuple[type, Any]:
    rope = {
        "rope_type": "default",
        "rope_theta": 10_000.0,
        "mrope_section": [6, 5, 5],
        "mrope_interleaved": True,
    }
    moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    text_config = transformers.Qwen3VLMoeTextConfig(
        **{**_LLAMA_LIKE, "head_dim": 32, **moe, **text}, rope_parameters=rope
    )
    vision = {**_QWEN_VISION, "num_position_embeddings": 16, "deepstack_visual_indexes": [0]}
    config = transformers.Qwen3VLMoeConfig(
        text_config=text_config.to_dict(), vision_config=vision, **top
    )
    return transformers.Qwen3VLMoeForConditionalGeneration, config


def _mllama(text: dict, **top: Any) -> tuple[type, Any]:
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
    vision |= {"num_global_layers": 1, "attention_heads": 4, "image_size": 16, "patch_size": 8}
    vision |= {"max_num_tiles": 2, "supported_aspect_ratios": [[1, 1], [1, 2], [2, 1]]}
    vision |= {"intermediate_layers_indices": [0, 1], "vision_output_dim": 96}
    base = {**_LLAMA_LIKE, "num_hidden_layers": 3, "cross_attention_layers": [1]}
    config = transformers.MllamaConfig(
        text_config={**base, **text},
        vision_config=vision,
        image_token_index=511,
        **top,
    )
    return transformers.MllamaForConditionalGeneration, config


_HALF_ROPE_FULL = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {
        "rope_type": "proportional",
        "partial_rotary_factor": 0.5,
        "rope_theta": 1_000_000.0,
    },
}

# id -> builder of (wrapper class, config); each varies what released checkpoints of the
# family vary in their text_config
CASES: dict[str, Builder] = {
    # Gemma 3 27B: query_pre_attn_scalar (hidden / heads) unlike head_dim; MQA
    "gemma3-27b-scalar": lambda: _gemma3(
        {
            "num_attention_heads": 8,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "query_pre_attn_scalar": 8,
        }
    ),
    # Gemma 3 1B-style layout from the legacy pattern field, no rope scaling, another window
    "gemma3-pattern-no-scaling": lambda: _gemma3(
        {
            "layer_types": None,
            "sliding_window_pattern": 2,
            "rope_scaling": None,
            "rope_parameters": None,
            "rope_theta": 500_000.0,
            "rope_local_base_freq": 20_000.0,
            "sliding_window": 16,
        }
    ),
    # attention soft-cap and an untied head (the wrapper ties by its top-level flag)
    "gemma3-softcap-untied": lambda: _gemma3(
        {"attn_logit_softcapping": 5.0, "rms_norm_eps": 1e-5}, tie_word_embeddings=False
    ),
    # Gemma 4 31B-style: no per-layer inputs, no KV sharing, k = v on full layers
    "gemma4-dense-k_eq_v": lambda: _gemma4(
        "gemma4",
        {
            "hidden_size_per_layer_input": 0,
            "num_kv_shared_layers": 0,
            "attention_k_eq_v": True,
            "use_double_wide_mlp": False,
        },
    ),
    # half the full layers' heads rotated; the default 5:1 pattern (its last layer forced full)
    "gemma4-layer-pattern-rope": lambda: _gemma4(
        "gemma4",
        {
            "num_hidden_layers": 4,
            "layer_types": None,
            "num_kv_shared_layers": 0,
            "rope_parameters": _HALF_ROPE_FULL,
            "final_logit_softcapping": None,
            "sliding_window": 16,
        },
    ),
    # k = v on full layers with their KV heads from num_key_value_heads (no global count)
    "gemma4-k_eq_v-no-global-kv": lambda: _gemma4(
        "gemma4",
        {"attention_k_eq_v": True, "num_global_key_value_heads": None, "num_kv_shared_layers": 3},
    ),
    # Gemma 4 26B-A4B: experts beside the dense MLP
    "gemma4-moe": lambda: _gemma4("gemma4_moe", {"global_head_dim": 16}),
    # LLaVA-1.5 around Vicuna (Llama) with an untied head and biases
    "llava-llama-bias": lambda: _llava(
        "Llava", "llama", {"attention_bias": True, "mlp_bias": True, "head_dim": 32}
    ),
    # LLaVA around Qwen2 (tied, its sliding window on the later layers)
    "llava-qwen2-window": lambda: _llava(
        "Llava",
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
        tie_word_embeddings=True,
    ),
    # LLaVA-NeXT around Mistral 7B v0.2 (no window) with head_dim unlike hidden / heads
    "llava_next-mistral-head_dim": lambda: _llava(
        "LlavaNext", "mistral", {"sliding_window": None, "head_dim": 32}
    ),
    # LLaVA-NeXT around Llama 3 (llama3 rope scaling)
    "llava_next-llama3-rope": lambda: _llava(
        "LlavaNext",
        "llama",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500_000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        },
    ),
    # Intel/llava-gemma-2b: LLaVA around Gemma (MQA, head_dim unlike hidden / heads)
    "llava-gemma": lambda: _llava("Llava", "gemma", {"num_key_value_heads": 1, "head_dim": 32}),
    # xtuner/llava-phi-3-mini-hf: LLaVA around Phi-3 (fused projections, a sliding window)
    "llava-phi3": lambda: _llava("Llava", "phi3", {"sliding_window": 16}),
    # granite-vision-3.x: LLaVA-NeXT around Granite (embedding, residual and attention
    # multipliers; logits_scaling 1: transformers 5's wrapper drops it, see the report)
    "llava_next-granite": lambda: _llava(
        "LlavaNext", "granite", {"logits_scaling": 1.0}, tie_word_embeddings=True
    ),
    # LLaVA-OneVision around Qwen2 (its 0.5B ties)
    "llava_onevision-qwen2": lambda: _onevision(
        "qwen2", {"num_key_value_heads": 1, "rope_theta": 1_000_000.0}, tie_word_embeddings=True
    ),
    # NCSOFT/VARCO-VISION-2.0: LLaVA-OneVision around Qwen3 (q / k norms, head_dim 32)
    "llava_onevision-qwen3": lambda: _onevision("qwen3", {}, tie_word_embeddings=False),
    # Mistral Small 3.1: head_dim unlike hidden / heads, no window, a large rope base
    "mistral3-mistral-small": lambda: _mistral3(
        "mistral",
        {"head_dim": 32, "sliding_window": None, "rope_theta": 1_000_000_000.0},
        tie_word_embeddings=False,
    ),
    # Idefics3 8B (Llama 3): a large rope base, GQA 4:1
    "idefics3-llama3": lambda: _idefics3(
        "Idefics3", {"rope_theta": 500_000.0, "num_key_value_heads": 1}
    ),
    # SmolVLM-256M: tied head, head_dim unlike hidden / heads
    "smolvlm-tied-head_dim": lambda: _idefics3(
        "SmolVLM", {"head_dim": 32, "rope_theta": 100_000.0}, tie_word_embeddings=True
    ),
    # InternVL3 (Qwen2 text: biased q / k / v, untied)
    "internvl-qwen2": lambda: _internvl("qwen2", {}, tie_word_embeddings=False),
    # InternVL3.5-GPT-OSS-20B-A4B: gpt-oss text (sinks, a window, YaRN, experts)
    "internvl-gpt_oss": lambda: _internvl("gpt_oss", {}),
    # InternVL3.5 (Qwen3 text) with head_dim 16
    "internvl-qwen3-head_dim": lambda: _internvl("qwen3", {"head_dim": 16}),
    # text models no released checkpoint pairs them with, which transformers' and vLLM's
    # LLaVA / InternVL wrappers build from text_config as any other (refused before: see the
    # module doc); logit scales at 1 where transformers 5's wrapper head drops them
    "llava-olmo2": lambda: _llava("Llava", "olmo2", {}),
    "llava-cohere2-window": lambda: _llava(
        "Llava", "cohere2", {"logit_scale": 1.0}, tie_word_embeddings=True
    ),
    "llava_next-granitemoe": lambda: _llava(
        "LlavaNext", "granitemoe", {"logits_scaling": 1.0}, tie_word_embeddings=True
    ),
    "llava_onevision-qwen2_moe": lambda: _onevision("qwen2_moe", {}),
    "internvl-stablelm": lambda: _internvl("stablelm", {"qk_layernorm": True}),
    "internvl-olmo2": lambda: _internvl("olmo2", {}, tie_word_embeddings=True),
    # Mistral 3, LightOnOCR, LFM2-VL, Command A Vision and Voxtral around text models
    # transformers' (AutoModel) and vLLM's (init_vllm_registered_model) wrappers build from
    # text_config as any other (refused before: see the module doc)
    "mistral3-llama": lambda: _mistral3("llama", {}, tie_word_embeddings=False),
    "lighton_ocr-llama": lambda: _lighton_ocr("llama", {}, tie_word_embeddings=True),
    "lfm2_vl-llama": lambda: _lfm2_vl("llama", {}),
    "cohere2_vision-qwen2": lambda: _cohere2_vision("qwen2", {}, tie_word_embeddings=False),
    "voxtral-qwen2": lambda: _voxtral("qwen2", {}, tie_word_embeddings=False),
    # Aya Vision 8B: Cohere 2 with a window on 3 of 4 layers
    "aya_vision-window": lambda: _aya_vision(
        {
            "num_hidden_layers": 4,
            "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
            "sliding_window": 8,
        }
    ),
    # Qwen2-VL 2B: tied, GQA 6:1 (here 4:1), another section split, a larger base
    "qwen2_vl-sections": lambda: _qwen_vl(
        "2",
        {"num_key_value_heads": 1, "rms_norm_eps": 1e-6},
        {"mrope_section": [4, 2, 2], "rope_theta": 1_000_000.0},
        tie_word_embeddings=True,
    ),
    # the sliding window on layers from max_window_layers on (the Hub's keep it off)
    "qwen2_vl-sliding": lambda: _qwen_vl(
        "2",
        {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
        {"mrope_section": [2, 3, 3]},
    ),
    # Qwen2.5-VL 7B: untied, the older "mrope" rope type (HF's config class renames it;
    # qwen2_5_vl-hub-flat saves it)
    "qwen2_5_vl-mrope-type": lambda: _qwen_vl(
        "2_5",
        {"num_hidden_layers": 3},
        {"rope_type": "mrope", "mrope_section": [2, 2, 4]},
        tie_word_embeddings=False,
    ),
    # Qwen3-VL 8B: head_dim unlike hidden / heads, untied, no biases
    "qwen3_vl-head_dim": lambda: _qwen_vl(
        "3",
        {"head_dim": 8, "attention_bias": False},
        {"mrope_section": [2, 1, 1], "mrope_interleaved": True, "rope_theta": 5_000_000.0},
        tie_word_embeddings=False,
    ),
    # Qwen3-VL-30B-A3B: every layer sparse, top-k of 4
    "qwen3_vl_moe-all-sparse": lambda: _qwen3_vl_moe(
        {"num_experts_per_tok": 4, "decoder_sparse_step": 1}
    ),
    # Llama 4 Scout: every layer MoE, q / k norms, every second layer NoPE (unchunked), tied
    "llama4-scout": lambda: _llama4(
        {"interleave_moe_layer_step": 1, "use_qk_norm": True, "no_rope_layer_interval": 2},
        tie_word_embeddings=True,
    ),
    # Llama 4 Maverick-style: no q / k norm, NoPE layers listed, no temperature tuning
    "llama4-maverick": lambda: _llama4(
        {"use_qk_norm": False, "no_rope_layers": [1, 1, 0, 1], "attn_temperature_tuning": False}
    ),
    # Idefics2 8B (Mistral 7B v0.1: a window of 4096, here 8)
    "idefics2-mistral-window": lambda: _idefics2({"sliding_window": 8, "head_dim": 32}),
    # Aya Vision 32B: Command R (Cohere) text, no q / k norm, a logit scale
    "aya_vision-cohere": lambda: _aya_vision_cohere(),
    # Ministral 3 (Mistral3 wrapper): another YaRN and llama 4 scaling beta
    "mistral3-ministral3-yarn": lambda: _mistral3(
        "ministral3",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 100_000_000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "beta_fast": 16.0,
                "beta_slow": 2.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "llama_4_scaling_beta": 0.5,
            }
        },
    ),
    # Llama 3.2 Vision 11B: cross-attention on the first layer, llama3 rope, untied
    "mllama-llama3": lambda: _mllama(
        {
            "cross_attention_layers": [0],
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500_000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
        tie_word_embeddings=False,
    ),
    # two cross-attention layers of four, the default rope
    "mllama-two-cross": lambda: _mllama({"num_hidden_layers": 4, "cross_attention_layers": [1, 3]}),
    # MQA, the cross-attention layer last, tied
    "mllama-mqa-tied": lambda: _mllama(
        {"num_key_value_heads": 1, "cross_attention_layers": [2], "rms_norm_eps": 1e-6},
        tie_word_embeddings=True,
    ),
}


def _qwen_hub_flat(saved: dict) -> None:
    """Qwen2-VL / 2.5-VL as released: the text fields at the top level, the rope as the
    older rope_scaling of type "mrope" beside rope_theta."""
    text = saved.pop("text_config")
    rope = text.pop("rope_parameters")
    for key in ("model_type", "architectures", "dtype", "tie_word_embeddings"):
        text.pop(key, None)
    saved |= text
    saved["rope_theta"] = rope["rope_theta"]
    saved["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}


def _gemma3_hub_legacy(saved: dict) -> None:
    """Gemma 3 as released: no layer_types (sliding_window_pattern), the rope as rope_theta,
    rope_local_base_freq and a linear rope_scaling."""
    text = saved["text_config"]
    del text["layer_types"], text["rope_parameters"]
    text |= {"sliding_window_pattern": 2, "rope_theta": 200_000.0}
    text |= {
        "rope_local_base_freq": 5_000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 4.0},
    }


# config.json edits after the save: the forms released checkpoints hold (HF reads them back)
HUB_FORMS: dict[str, tuple[str, Callable[[dict], None]]] = {
    "qwen2_vl-hub-flat": ("qwen2_vl-sections", _qwen_hub_flat),
    "qwen2_5_vl-hub-flat": ("qwen2_5_vl-mrope-type", _qwen_hub_flat),
    "gemma3-hub-legacy-rope": ("gemma3-softcap-untied", _gemma3_hub_legacy),
}


@pytest.mark.parametrize("name", list(CASES) + list(HUB_FORMS))
def test_text_config_variant_matches_hf(name, tmp_path):
    case, edit = HUB_FORMS.get(name, (name, None))
    cls, config = CASES[case]()
    path = write_hf_checkpoint(tmp_path, cls, config, seed=1)
    if edit is not None:
        saved = json.loads((path / "config.json").read_text())
        edit(saved)
        (path / "config.json").write_text(json.dumps(saved))
    if name not in CHUNKED:
        assert_serves_like_hf(name, path, _prompts(name), MAX_TOKENS)
        return
    hf = load_hf_as_saved(path)
    prompts = _prompts(name)
    refs = [hf_greedy(hf, p, MAX_TOKENS, 3) for p in prompts]
    serve_and_compare(
        name, path, prompts, refs, max_tokens=MAX_TOKENS, passes=2, **CHUNKED_PREFIX_CACHE
    )


# windows, KV sharing and layer patterns again in 16-token chunks with prefix caching, twice
CHUNKED = {
    "gemma3-pattern-no-scaling",
    "gemma4-layer-pattern-rope",
    "gemma4-k_eq_v-no-global-kv",
    "llava-phi3",
    "llava-qwen2-window",
    "aya_vision-window",
    "qwen2_vl-sliding",
    "llava-cohere2-window",
}


# Gemma 3n: (text overrides) as E2B / E4B vary them
GEMMA3N: dict[str, dict[str, Any]] = {
    # E4B-like: no KV sharing, dense MLPs of one width, a wider Laurel
    "gemma3n-no-sharing-dense": {
        "num_kv_shared_layers": 0,
        "activation_sparsity_pattern": None,
        "intermediate_size": 96,
        "laurel_rank": 16,
    },
    # three KV-sharing layers (each reads the last earlier layer of its type), wider Laurel
    "gemma3n-kv-sharing-3": {"num_kv_shared_layers": 3, "laurel_rank": 4, "sliding_window": 16},
    # AltUp predicting from stream 1 with a tight coefficient clip and no output scale
    "gemma3n-altup": {
        "altup_active_idx": 1,
        "altup_coef_clip": 0.5,
        "altup_correct_scale": False,
        "altup_num_inputs": 2,
    },
}

_MEDIA = (("vision_config", (480, 16, 24)), ("audio_config", (496, 16, 40)))


def _gemma3n_wrapper(text_dir: Path, path: Path) -> tuple[Path, list]:
    """`text_dir`'s Gemma 3n as a Gemma3nForConditionalGeneration checkpoint: the language
    model under `model.language_model.`, random vision / audio token embedders (returned: HF's,
    for the reference)."""
    from test_models_gemma3n import _hf_embedders

    path.mkdir()
    for f in text_dir.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, path / f.name)
    fields = ("vocab_offset", "vocab_size", "hidden_size")
    towers = {key: dict(zip(fields, v, strict=True)) for key, v in _MEDIA}
    config = transformers.Gemma3nConfig(
        text_config=json.loads((text_dir / "config.json").read_text()), **towers
    )
    config.architectures = ["Gemma3nForConditionalGeneration"]
    config.save_pretrained(path)
    state = safetensors_torch.load_file(str(text_dir / "model.safetensors"))
    weights = {
        "model.language_model." + k.removeprefix("model.") if k.startswith("model.") else k: v
        for k, v in state.items()
    }
    embedders = _hf_embedders(config, seed=4)
    for name, embedder in embedders:
        weights.update({f"model.{name}.{k}": v for k, v in embedder.state_dict().items()})
    safetensors_torch.save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path, embedders


@pytest.mark.parametrize("name", list(GEMMA3N))
def test_gemma3n_text_config_variant_matches_hf(name, tmp_path):
    """HF's wrapper as its forward computes it on ids (test_models_gemma3n's reference: the
    text model, media ids embedded by the towers' embedders, generated ones included)."""
    from test_models_gemma3n import _hf_wrapper_greedy

    text_dir = write_tiny_model(tmp_path / "text", "gemma3n", seed=1, **GEMMA3N[name])
    path, embedders = _gemma3n_wrapper(text_dir, tmp_path / "wrapper")
    hf = transformers.Gemma3nForCausalLM.from_pretrained(text_dir, dtype=torch.float32).eval()
    prompts = _prompts(name)
    refs = [_hf_wrapper_greedy(hf, embedders, p) for p in prompts]
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, block_size=16)
    assert_llm_matches(name, llm, prompts, refs)


# --- one image case per family: the text_config fields the image path reads too (M-RoPE over
# head_dim, the two-way image / prefix masks beside sliding windows, cross-attention layers)


def _resave_text(path: Path, cls: type, seed: int, **text: Any) -> Path:
    """`path`'s checkpoint with `text`'s fields set on its text_config, random weights made
    again for the new shapes."""
    config = transformers.AutoConfig.from_pretrained(path)
    for key, value in text.items():
        setattr(config.text_config, key, value)
    _save_random(cls, config, seed, path)
    return path


def _check_images(
    path: Path, cls: type, cases: list, inputs: Callable, name: str, **engine_kwargs: Any
) -> None:
    """HF's `cls` on `cases` (prompt text, its images; HF's ids and inputs by `inputs`) gives
    the engine's prompt ids, greedy tokens and top-5 logprobs."""
    refs = hf_refs(load_hf_vlm(cls, path), cases, inputs, n=MAX_TOKENS)
    prompts = [{"prompt": t, "multi_modal_data": {"image": imgs}} for t, imgs in cases]
    outs = engine(path, **engine_kwargs).generate(prompts, greedy(n=MAX_TOKENS), use_tqdm=False)
    for (ids, ref), out in zip(refs, outs, strict=True):
        assert out.prompt_token_ids == ids, name
        assert_matches(name, out, ref)


def _processor_inputs(path: Path, *keys: str) -> Callable:
    processor = transformers.AutoProcessor.from_pretrained(path)

    def inputs(text: str, images: list) -> tuple[list[int], dict]:
        out = processor(text=[text], images=[images], return_tensors="pt")
        return out["input_ids"][0].tolist(), {k: out[k] for k in keys}

    return inputs


_GEMMA = "<|bos|><start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n"


def test_gemma3_image_with_text_variant(tmp_path):
    """Gemma 3 27B-style scalar, MQA, a window of 4 (shorter than an image's run of 4 soft
    tokens and its markers) on a 1:1 pattern, an attention soft-cap."""
    text = {"num_key_value_heads": 1, "head_dim": 16, "query_pre_attn_scalar": 24}
    text |= {"layer_types": ["sliding_attention", "full_attention"] * 2, "sliding_window": 4}
    text |= {"num_hidden_layers": 4}
    text |= {"attn_logit_softcapping": 5.0}
    path = write_tiny_gemma3(tmp_path, seed=3, image_size=48, patch_size=6, mm_tokens_per_image=4)
    _resave_text(path, transformers.Gemma3ForConditionalGeneration, 3, **text)
    cases = [
        (_GEMMA.format("<start_of_image>What is in it?"), [noise_image(1, (40, 52))]),
        (
            _GEMMA.format("<start_of_image>and<start_of_image>Which is it, and why?"),
            [noise_image(2, (64, 30)), noise_image(3, (30, 30))],
        ),
    ]
    inputs = _processor_inputs(path, "pixel_values", "token_type_ids")
    _check_images(path, transformers.Gemma3ForConditionalGeneration, cases, inputs, "gemma3")


_V = "<|vision_start|><|image_pad|><|vision_end|>"
_CHATML = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
_QWEN_CASES = [
    (_CHATML.format(f"{_V}What is in it?"), [(40, 56)]),
    (_CHATML.format(f"{_V} and {_V}Which?"), [(72, 24), (33, 47)]),
]


def _rope(theta: float, sections: list[int]) -> dict[str, Any]:
    return {"rope_type": "default", "rope_theta": theta, "mrope_section": sections}


QWEN_IMAGES: dict[str, tuple[str, str, dict[str, Any]]] = {
    # Qwen2-VL: other sections of head_dim 16, a larger base
    "qwen2_vl": (
        "2",
        "Qwen2VLForConditionalGeneration",
        {"rope_parameters": _rope(1e6, [4, 2, 2])},
    ),
    # Qwen2.5-VL: MQA, the rope saved as the older rope_scaling of type "mrope"
    "qwen2_5_vl": (
        "2.5",
        "Qwen2_5_VLForConditionalGeneration",
        {"num_key_value_heads": 1, "rope_parameters": _rope(1e4, [2, 2, 4])},
    ),
    # Qwen2-VL with its sliding window on (layer 1 on), shorter than an image's run
    "qwen2_vl-window": (
        "2",
        "Qwen2VLForConditionalGeneration",
        {
            "use_sliding_window": True,
            "sliding_window": 8,
            "max_window_layers": 1,
            "layer_types": ["full_attention", "sliding_attention"],
        },
    ),
    # Qwen3-VL: head_dim 8 (unlike hidden / heads), sections of its 4 frequencies
    "qwen3_vl": (
        "3",
        "Qwen3VLForConditionalGeneration",
        {
            "head_dim": 8,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 5e6,
                "mrope_section": [2, 1, 1],
                "mrope_interleaved": True,
            },
        },
    ),
}


@pytest.mark.parametrize("name", list(QWEN_IMAGES))
def test_qwen_vl_images_with_text_variant(name, tmp_path):
    """M-RoPE's image positions over other sections / head sizes."""
    version, cls_name, text = QWEN_IMAGES[name]
    cls = getattr(transformers, cls_name)
    path = _resave_text(write_tiny_qwen2_vl(tmp_path, version=version, seed=2), cls, 2, **text)
    if version == "2.5":
        saved = json.loads((path / "config.json").read_text())
        rope = saved["text_config"].pop("rope_parameters")
        saved["text_config"]["rope_theta"] = rope["rope_theta"]
        saved["text_config"]["rope_scaling"] = {"type": "mrope", "mrope_section": [2, 2, 4]}
        (path / "config.json").write_text(json.dumps(saved))
    images = transformers.AutoImageProcessor.from_pretrained(path)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    pad = transformers.AutoConfig.from_pretrained(path).image_token_id

    def inputs(text: str, imgs: list) -> tuple[list[int], dict]:
        ids = tok.encode(text, add_special_tokens=False)
        return qwen2_vl_hf_inputs(ids, imgs, images, pad)

    cases = [
        (t, [noise_image(i + k, size) for k, size in enumerate(sizes)])
        for i, (t, sizes) in enumerate(_QWEN_CASES)
    ]
    _check_images(path, cls, cases, inputs, name)


GEMMA4_IMAGES: dict[str, dict[str, Any]] = {
    # 31B-style text: no per-layer inputs or KV sharing, full layers' values from their keys
    "dense": {
        "hidden_size_per_layer_input": 0,
        "num_kv_shared_layers": 0,
        "attention_k_eq_v": True,
        "use_double_wide_mlp": False,
    },
    # images causal like text (no two-way image attention), a window of 16
    "causal-images": {"use_bidirectional_attention": None, "sliding_window": 16},
}


@pytest.mark.parametrize("name", list(GEMMA4_IMAGES))
def test_gemma4_images_with_text_variant(name, tmp_path):
    from test_gemma4_images import PROMPT, TWO, _hf_inputs, write_tiny_gemma4_vlm

    cls = transformers.Gemma4ForConditionalGeneration
    path = write_tiny_gemma4_vlm(tmp_path, seed=3)
    _resave_text(path, cls, 3, **GEMMA4_IMAGES[name])
    cases = [
        (PROMPT, [noise_image(1, (40, 90))]),
        (TWO, [noise_image(2, (100, 30)), noise_image(3, (20, 24))]),
    ]
    _check_images(path, cls, cases, lambda *case: _hf_inputs(path, *case), f"gemma4-{name}")


def test_paligemma2_image_with_text_variant(tmp_path):
    """PaliGemma 2 (Gemma 2 text) with query_pre_attn_scalar unlike head_dim, MQA and a
    window of 48: the longer prompt's two-way prefix (48 tokens) fills it, its continuation
    slides."""
    from test_paligemma_images import LONG, SHORT, write_tiny_paligemma

    cls = transformers.PaliGemmaForConditionalGeneration
    path = write_tiny_paligemma(tmp_path, "gemma2", seed=5)
    text = {"query_pre_attn_scalar": 24, "num_key_value_heads": 1, "sliding_window": 48}
    _resave_text(path, cls, 5, **text)
    cases = [(SHORT, [noise_image(1, (40, 90))]), (LONG, [noise_image(2, (20, 24))])]
    inputs = _processor_inputs(path, "pixel_values", "token_type_ids")
    _check_images(path, cls, cases, inputs, "paligemma2")


def test_mllama_image_with_text_variant(tmp_path):
    """Llama 3.2 Vision with its cross-attention layer first, llama3 rope scaling, MQA."""
    from test_mllama_images import IMAGE, write_tiny_mllama

    cls = transformers.MllamaForConditionalGeneration
    path = write_tiny_mllama(tmp_path, seed=3, kv_heads=1)
    rope = {"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0}
    rope |= {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
    rope |= {"original_max_position_embeddings": 32}
    _resave_text(path, cls, 3, cross_attention_layers=[0], rope_parameters=rope)
    processor = transformers.AutoProcessor.from_pretrained(path)
    bos = processor.tokenizer.bos_token

    def inputs(text: str, images: list) -> tuple[list[int], dict]:
        out = processor(text=[text], images=[images], return_tensors="pt")
        extra = {k: out[k] for k in out if k not in ("input_ids", "attention_mask")}
        return out["input_ids"][0].tolist(), extra

    cases = [
        (f"{bos}user: What is in {IMAGE}it?\nassistant:", [noise_image(1, (20, 40))]),
        (f"{bos}{IMAGE}Which colour is it?", [noise_image(2, (40, 20))]),
    ]
    _check_images(path, cls, cases, inputs, "mllama")


# text model_type -> its logits rule that transformers 5's wrapper head drops (paged keeps it,
# as vLLM: test_llava_keeps_its_text_models_logit_rules), neutral here to compare images
_NEUTRAL_LOGITS: dict[str, dict[str, Any]] = {
    "granite": {"logits_scaling": 1.0},
    "granitemoe": {"logits_scaling": 1.0},
    "cohere": {"logit_scale": 1.0},
    "gemma2": {"final_logit_softcapping": None},
}


_LLAVA_BACKBONES = ["gemma", "gemma2", "phi3", "granite", "granitemoe", "olmo2", "cohere"]
_LLAVA_BACKBONES += ["qwen2_moe", "stablelm"]


@pytest.mark.parametrize("text", _LLAVA_BACKBONES)
def test_llava_images_with_other_text_backbones(text, tmp_path):
    """LLaVA around Gemma / Gemma 2 (their scaled embedding: image rows spliced unscaled, as
    transformers 5's scaled embedding module leaves them), Phi-3, OLMo 2, Cohere, Qwen2-MoE,
    StableLM and GraniteMoE (built from text_config as any text model; GraniteMoE's
    embedding_multiplier on the image rows too, as in HF); LLaVA-NeXT around Granite (the
    same)."""
    from paged_engine.testing import write_tiny_llava

    pinpoints = {"grid_pinpoints": [[30, 60], [60, 30]]} if text == "granite" else {}
    path = write_tiny_llava(tmp_path, text=text, seed=3, **pinpoints)
    cases = [
        ("USER: <image>\nWhat is in it?\nASSISTANT:", [noise_image(1, (40, 52))]),
        (
            "USER: <image>\nand <image>\nWhich?\nASSISTANT:",
            [noise_image(2, (64, 30)), noise_image(3, (30, 30))],
        ),
    ]
    name = "LlavaNext" if pinpoints else "Llava"
    cls = getattr(transformers, f"{name}ForConditionalGeneration")
    if text in _NEUTRAL_LOGITS:
        _resave_text(path, cls, 3, **_NEUTRAL_LOGITS[text])
    keys = ("pixel_values", "image_sizes") if pinpoints else ("pixel_values",)
    _check_images(path, cls, cases, _processor_inputs(path, *keys), f"llava-{text}")


# (wrapper, text model_type, its logits field, value, factor on the wrapper head's logits)
TEXT_LOGIT_RULES = {
    "granite": ("LlavaNext", "granite", "logits_scaling", 4.0, 1 / 4.0),
    "granitemoe": ("Llava", "granitemoe", "logits_scaling", 4.0, 1 / 4.0),
    "cohere2": ("Llava", "cohere2", "logit_scale", 0.5, 0.5),
}


@pytest.mark.parametrize("name", list(TEXT_LOGIT_RULES))
def test_llava_keeps_its_text_models_logit_rules(name, tmp_path):
    """granite-vision's logits are divided by text_config.logits_scaling as Granite's are
    (vLLM's choice, and transformers 4's, whose wrapper held a whole GraniteForCausalLM);
    transformers 5's wrapper head drops the division: its greedy tokens, its logits / 4. Any
    other text model's logits rules likewise (GraniteMoE's division, Cohere 2's logit_scale:
    vLLM's language model is the whole registered class)."""
    wrapper, text, field, value, factor = TEXT_LOGIT_RULES[name]
    cls, config = _llava(wrapper, text, {field: value})
    path = write_hf_checkpoint(tmp_path, cls, config, seed=1)
    hf = load_hf_vlm(cls, path)
    prompt = _prompts("granite-scale")[1]
    ref = hf_greedy(hf, prompt, MAX_TOKENS)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + ref.tokens[:-1]])).logits[0, len(prompt) - 1 :]
    want = torch.log_softmax(logits * factor, -1)
    want = [want[i, t].item() for i, t in enumerate(ref.tokens)]
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    got = out.outputs[0]
    assert got.token_ids == ref.tokens
    assert [e[t].logprob for e, t in zip(got.logprobs, got.token_ids)] == pytest.approx(
        want, abs=1e-3
    )


def _internvl_clip_text() -> tuple[type, Any]:
    text = transformers.CLIPTextConfig(hidden_size=32, intermediate_size=64, num_attention_heads=2)
    vision = {**_SMALL_VISION, "image_size": [28, 28], "patch_size": [14, 14]}
    config = transformers.InternVLConfig(text_config=text.to_dict(), vision_config=vision)
    return transformers.InternVLForConditionalGeneration, config


# name -> (builder, why): a text model paged serves as no causal LM (CLIP's text tower), or
# whose decoder its class keeps elsewhere than `model.` (GPT-2's `transformer.`)
REFUSED_TEXT: dict[str, tuple[Builder, str]] = {
    "llava-gpt2": (lambda: _llava("Llava", "gpt2", {}), "'gpt2'.* under `transformer.`"),
    "internvl-clip_text": (_internvl_clip_text, r"'clip_text_model'.* serves no causal LM"),
}


@pytest.mark.parametrize("name", list(REFUSED_TEXT))
def test_text_model_paged_cannot_serve_is_refused_by_name(name):
    from paged_engine.models.multimodal_text import text_only_config

    build, why = REFUSED_TEXT[name]
    cls, config = build()
    config.architectures = [cls.__name__]
    with pytest.raises(ValueError, match=rf"{cls.__name__} with a text_config .*{why}"):
        text_only_config(config)


def test_blip2_with_any_text_model_is_its_language_model(tmp_path):
    """BLIP-2 around OLMo 2 (transformers' AutoModelForCausalLM and vLLM build any text model
    from text_config; refused before): on text alone it is its nested language model, HF's
    `language_model` the reference (the wrapper's generate needs pixel_values)."""
    qformer = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1}
    qformer |= {"num_attention_heads": 2}
    config = transformers.Blip2Config(
        text_config=_text("olmo2"),
        vision_config=_SMALL_VISION,
        qformer_config=qformer,
        num_query_tokens=2,
        image_token_index=500,
    )
    path = write_hf_checkpoint(tmp_path, transformers.Blip2ForConditionalGeneration, config, seed=1)
    hf = load_hf_as_saved(path).language_model
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    assert_serves_like_hf("blip2-olmo2", path, _prompts("blip2-olmo2"), MAX_TOKENS, hf=hf)


def test_internvl_images_with_gpt_oss_text(tmp_path):
    """InternVL3.5-GPT-OSS's layout: InternVL's tower and tiles around gpt-oss (the image rows
    spliced before its sinks, window and experts)."""
    from test_internvl_images import PROMPT, TWO
    from vlm_checkpoints import tiled_context_inputs

    from paged_engine.testing import write_tiny_internvl

    cls = transformers.InternVLForConditionalGeneration
    path = write_tiny_internvl(tmp_path, seed=2)
    saved = transformers.AutoConfig.from_pretrained(path)
    config = transformers.InternVLConfig(
        text_config=_text("gpt_oss", vocab_size=saved.text_config.vocab_size),
        vision_config=saved.vision_config.to_dict(),
        image_token_id=saved.image_token_id,
        downsample_ratio=saved.downsample_ratio,
        **_COMMON,
    )
    _save_random(cls, config, 2, path)
    cases = [
        (PROMPT, [noise_image(1, (40, 90))]),
        (TWO, [noise_image(2, (100, 30)), noise_image(3, (20, 24))]),
    ]
    inputs = lambda *case: tiled_context_inputs(path, *case)
    _check_images(path, cls, cases, inputs, "internvl-gpt_oss", max_model_len=256)


def _retext(path: Path, cls: type, arch: str, seed: int) -> Path:
    """`path`'s wrapper checkpoint around a tiny `arch` text model of the same vocabulary (its
    logits rule neutral: _NEUTRAL_LOGITS), random weights made again."""
    config = transformers.AutoConfig.from_pretrained(path)
    text = _text(arch, vocab_size=config.text_config.vocab_size, **_NEUTRAL_LOGITS.get(arch, {}))
    config.text_config = transformers.AutoConfig.for_model(**text)
    _save_random(cls, config, seed, path)
    return path


def _internvl_retexted(arch: str, tmp_path: Path) -> None:
    from test_internvl_images import PROMPT
    from vlm_checkpoints import tiled_context_inputs

    from paged_engine.testing import write_tiny_internvl

    cls = transformers.InternVLForConditionalGeneration
    path = _retext(write_tiny_internvl(tmp_path, seed=2), cls, arch, 2)
    inputs = lambda *case: tiled_context_inputs(path, *case)
    cases = [(PROMPT, [noise_image(1, (40, 90))])]
    _check_images(path, cls, cases, inputs, f"internvl-{arch}", max_model_len=256)


def _mistral3_retexted(arch: str, tmp_path: Path) -> None:
    from test_mistral3_images import PROMPT, _hf_inputs

    from paged_engine.testing import write_tiny_mistral3

    cls = transformers.Mistral3ForConditionalGeneration
    path = _retext(write_tiny_mistral3(tmp_path, arch="mistral3", seed=2), cls, arch, 2)
    cases = [(PROMPT, [noise_image(1, (40, 56))])]
    _check_images(path, cls, cases, lambda *case: _hf_inputs(path, 2, *case), f"mistral3-{arch}")


# other any-text wrappers' images around a text model whose embedding path is not Llama's:
# Gemma 2's scaled embedding (image rows unscaled, as transformers 5's wrappers splice them
# after its scaled embedding module), GraniteMoE's embedding_multiplier (on the image rows too)
RETEXTED_IMAGES: dict[str, Callable[[Path], None]] = {
    "internvl-gemma2": lambda p: _internvl_retexted("gemma2", p),
    "internvl-granitemoe": lambda p: _internvl_retexted("granitemoe", p),
    "mistral3-gemma": lambda p: _mistral3_retexted("gemma", p),
    "mistral3-granite": lambda p: _mistral3_retexted("granite", p),
}


@pytest.mark.parametrize("name", list(RETEXTED_IMAGES))
def test_any_text_wrapper_images_with_other_embeddings(name, tmp_path):
    RETEXTED_IMAGES[name](tmp_path)
