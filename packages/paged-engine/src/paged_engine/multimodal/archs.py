"""The vision-language wrappers whose images paged runs, and which image path each takes.

    LlavaForConditionalGeneration                 "llava"       multimodal/llava.py
    LlavaNextForConditionalGeneration,            "llava_next"  multimodal/llava_next.py
      LlavaOnevisionForConditionalGeneration (anyres_max)
    Qwen2VLForConditionalGeneration,              "qwen2_vl"    multimodal/qwen2_vl.py
      Qwen2_5_VLForConditionalGeneration, Qwen3VLForConditionalGeneration,
      Qwen3VLMoeForConditionalGeneration (Qwen3-VL: its own tower, deepstack),
      Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration (its tower)
    Glm4vForConditionalGeneration,                "glm4v"       multimodal/glm4v.py
      Glm4vMoeForConditionalGeneration, Glm46VForConditionalGeneration
    Qwen2_5OmniThinkerForConditionalGeneration,   "qwen_omni"   multimodal/qwen_omni.py
      Qwen3OmniMoeThinkerForConditionalGeneration (their towers: Qwen2.5-VL's, Qwen3-VL's)
    GlmOcrForConditionalGeneration                "glm_ocr"     multimodal/glm_ocr.py
    HunYuanVLForConditionalGeneration             "hunyuan_vl"  multimodal/hunyuan_vl.py
    Idefics3ForConditionalGeneration,             "idefics3"    multimodal/idefics3.py
      SmolVLMForConditionalGeneration
    InternVLForConditionalGeneration              "internvl"    multimodal/internvl.py
    Mistral3ForConditionalGeneration,             "pixtral"     multimodal/pixtral.py
      LlavaForConditionalGeneration with a Pixtral tower (Pixtral-12B)
    Gemma3ForConditionalGeneration                "gemma3"      multimodal/gemma3.py
    Gemma4ForConditionalGeneration                "gemma4"      multimodal/gemma4.py
    Gemma4UnifiedForConditionalGeneration  "gemma4_unified"  multimodal/gemma4_unified.py
    Llama4ForConditionalGeneration                "llama4"      multimodal/llama4.py
    AyaVisionForConditionalGeneration             "aya_vision"  multimodal/aya_vision.py
    Cohere2VisionForConditionalGeneration         "cohere2_vision"  multimodal/aya_vision.py
    Idefics2ForConditionalGeneration              "idefics2"    multimodal/idefics2.py
    Kimi_K25ForConditionalGeneration              "kimi_k25"    multimodal/kimi_k25.py
    MiniCPMV4_6ForConditionalGeneration           "minicpmv"    multimodal/minicpmv.py
    MiniCPMV4_7ForConditionalGeneration     "minicpmv_canvas"   multimodal/minicpmv.py
    Lfm2VlForConditionalGeneration                "lfm2_vl"     multimodal/lfm2_vl.py
    Ovis2_5ForConditionalGeneration               "ovis2_5"     multimodal/ovis2_5.py
    Exaone4_5_ForConditionalGeneration            "exaone4_5"   multimodal/exaone4_5.py

Other wrappers serve their text model only (models/multimodal_text.py).
"""

from __future__ import annotations

from typing import Any

from torch import nn

LLAVA = "LlavaForConditionalGeneration"
LLAVA_NEXT = "LlavaNextForConditionalGeneration"
LLAVA_ONEVISION = "LlavaOnevisionForConditionalGeneration"
QWEN2_VL = (
    "Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
)
IDEFICS3 = ("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration")
MISTRAL3 = "Mistral3ForConditionalGeneration"
INTERNVL = "InternVLForConditionalGeneration"
GEMMA3 = "Gemma3ForConditionalGeneration"
GEMMA4 = "Gemma4ForConditionalGeneration"
GEMMA4_UNIFIED = "Gemma4UnifiedForConditionalGeneration"
LLAMA4 = "Llama4ForConditionalGeneration"
GLM4V = (
    "Glm4vForConditionalGeneration",
    "Glm4vMoeForConditionalGeneration",
    "Glm46VForConditionalGeneration",
)
GLM_OCR = "GlmOcrForConditionalGeneration"
HUNYUAN_VL = "HunYuanVLForConditionalGeneration"
QWEN_OMNI = (
    "Qwen2_5OmniThinkerForConditionalGeneration",
    "Qwen3OmniMoeThinkerForConditionalGeneration",
    "Qwen2_5OmniForConditionalGeneration",
    "Qwen3OmniMoeForConditionalGeneration",
)
AYA_VISION = ("AyaVisionForConditionalGeneration", "Cohere2VisionForConditionalGeneration")
IDEFICS2 = "Idefics2ForConditionalGeneration"
KIMI_K25 = "Kimi_K25ForConditionalGeneration"
MINICPMV = "MiniCPMV4_6ForConditionalGeneration"
MINICPMV_CANVAS = "MiniCPMV4_7ForConditionalGeneration"
LFM2_VL = "Lfm2VlForConditionalGeneration"
OVIS2_5 = "Ovis2_5ForConditionalGeneration"
EXAONE4_5 = "Exaone4_5_ForConditionalGeneration"
IMAGE_ARCHS = (
    LLAVA,
    LLAVA_NEXT,
    LLAVA_ONEVISION,
    *QWEN2_VL,
    *GLM4V,
    *QWEN_OMNI,
    GLM_OCR,
    HUNYUAN_VL,
    *IDEFICS3,
    MISTRAL3,
    INTERNVL,
    GEMMA3,
    GEMMA4,
    GEMMA4_UNIFIED,
    LLAMA4,
    *AYA_VISION,
    IDEFICS2,
    KIMI_K25,
    MINICPMV,
    MINICPMV_CANVAS,
    LFM2_VL,
    OVIS2_5,
    EXAONE4_5,
)
# the checkpoints whose videos run (multimodal/qwen_video.py, qwen3_video.py), for messages
VIDEO_MODELS = "Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5"


def image_kind(config: Any) -> str:
    """The image path of a wrapper config of IMAGE_ARCHS: "llava", "llava_next", "qwen2_vl",
    "glm4v", "glm_ocr", "hunyuan_vl", "idefics3", "pixtral", "internvl", "gemma3", "gemma4",
    "llama4", "aya_vision", "cohere2_vision", "idefics2", "kimi_k25", "lfm2_vl", "minicpmv",
    "minicpmv_canvas", "exaone4_5", "ovis2_5", "gemma4_unified" or "qwen_omni"."""
    archs = getattr(config, "architectures", None) or []
    if LLAVA_NEXT in archs or LLAVA_ONEVISION in archs:
        return "llava_next"
    if any(a in QWEN2_VL for a in archs):
        return "qwen2_vl"
    if any(a in GLM4V for a in archs):
        return "glm4v"
    if any(a in QWEN_OMNI for a in archs):
        return "qwen_omni"
    if GLM_OCR in archs:
        return "glm_ocr"
    if HUNYUAN_VL in archs:
        return "hunyuan_vl"
    if any(a in IDEFICS3 for a in archs):
        return "idefics3"
    if MISTRAL3 in archs or vision_tower_type(config) == "pixtral":
        return "pixtral"
    if INTERNVL in archs:
        return "internvl"
    if GEMMA3 in archs:
        return "gemma3"
    if GEMMA4 in archs:
        return "gemma4"
    if GEMMA4_UNIFIED in archs:
        return "gemma4_unified"
    if LLAMA4 in archs:
        return "llama4"
    if any(a in AYA_VISION for a in archs):
        return "cohere2_vision" if AYA_VISION[1] in archs else "aya_vision"
    if IDEFICS2 in archs:
        return "idefics2"
    if KIMI_K25 in archs:
        return "kimi_k25"
    if MINICPMV in archs:
        return "minicpmv"
    if MINICPMV_CANVAS in archs:
        return "minicpmv_canvas"
    if LFM2_VL in archs:
        return "lfm2_vl"
    if OVIS2_5 in archs:
        return "ovis2_5"
    if EXAONE4_5 in archs:
        return "exaone4_5"
    assert LLAVA in archs, archs
    return "llava"


def vision_tower_type(config: Any) -> str | None:
    return getattr(config.vision_config, "model_type", None)


def supported_tower(config: Any) -> bool:
    """Whether paged runs the wrapper's vision tower (LLaVA's may be a Pixtral one: not yet)."""
    kind = image_kind(config)
    if kind == "gemma4":
        return vision_tower_type(config) == "gemma4_vision"
    if kind == "gemma4_unified":  # no tower: its encoder-free embedder
        return vision_tower_type(config) == "gemma4_unified_vision"
    if kind in ("gemma3", "aya_vision", "cohere2_vision"):
        return vision_tower_type(config) == "siglip_vision_model"
    if kind in ("qwen2_vl", "glm4v", "glm_ocr", "idefics3", "pixtral", "internvl", "llama4"):
        return True
    if kind == "hunyuan_vl":
        return vision_tower_type(config) == "hunyuan_vl_vision"
    if kind == "qwen_omni":
        return True
    if kind == "kimi_k25":
        return vision_tower_type(config) == "kimi_k25_vision"
    if kind in ("minicpmv", "minicpmv_canvas"):
        return vision_tower_type(config) in ("minicpmv4_6_vision", "minicpmv4_7_vision")
    if kind == "lfm2_vl":
        return vision_tower_type(config) == "siglip2_vision_model"
    if kind == "ovis2_5":
        return vision_tower_type(config) == "ovis2_5_vision"
    if kind == "exaone4_5":
        return vision_tower_type(config) == "exaone4_5_vision"
    from paged_engine.multimodal.vision_transformer import TOWERS

    return vision_tower_type(config) in TOWERS


def build_encoder(config: Any) -> nn.Module:
    """The wrapper's image encoder (tower and projector), with `encode(images)` and
    `load_weights(weights)`; built in the current default dtype and device."""
    kind = image_kind(config)
    if kind == "lfm2_vl":
        from paged_engine.multimodal.lfm2_vl import Lfm2VlImageEncoder

        return Lfm2VlImageEncoder(config)
    if kind == "ovis2_5":
        from paged_engine.multimodal.ovis2_5 import Ovis2_5ImageEncoder

        return Ovis2_5ImageEncoder(config)
    if kind == "exaone4_5":
        from paged_engine.multimodal.exaone4_5 import Exaone45ImageEncoder

        return Exaone45ImageEncoder(config)
    if kind in ("minicpmv", "minicpmv_canvas"):
        from paged_engine.multimodal.minicpmv import MiniCPMVImageEncoder

        return MiniCPMVImageEncoder(config)
    if kind == "kimi_k25":
        from paged_engine.multimodal.kimi_k25 import KimiImageEncoder

        return KimiImageEncoder(config)
    if kind == "glm4v":
        from paged_engine.multimodal.glm4v import Glm4vImageEncoder

        return Glm4vImageEncoder(config)
    if kind == "qwen_omni":
        from paged_engine.multimodal import qwen_omni

        return qwen_omni.build_encoder(config)
    if kind == "glm_ocr":
        from paged_engine.multimodal.glm_ocr import GlmOcrImageEncoder

        return GlmOcrImageEncoder(config)
    if kind == "hunyuan_vl":
        from paged_engine.multimodal.hunyuan_vl import HunyuanImageEncoder

        return HunyuanImageEncoder(config)
    if kind == "idefics2":
        from paged_engine.multimodal.idefics2 import Idefics2ImageEncoder

        return Idefics2ImageEncoder(config)
    if kind in ("aya_vision", "cohere2_vision"):
        from paged_engine.multimodal.aya_vision import AyaVisionImageEncoder

        return AyaVisionImageEncoder(config)
    if kind == "llama4":
        from paged_engine.multimodal.llama4 import Llama4ImageEncoder

        return Llama4ImageEncoder(config)
    if kind == "gemma4":
        from paged_engine.multimodal.gemma4 import Gemma4ImageEncoder

        return Gemma4ImageEncoder(config)
    if kind == "gemma4_unified":
        from paged_engine.multimodal.gemma4_unified import Gemma4UnifiedImageEncoder

        return Gemma4UnifiedImageEncoder(config)
    if kind == "gemma3":
        from paged_engine.multimodal.gemma3 import Gemma3ImageEncoder

        return Gemma3ImageEncoder(config)
    if kind == "internvl":
        from paged_engine.multimodal.internvl import InternVLImageEncoder

        return InternVLImageEncoder(config)
    if kind == "pixtral":
        from paged_engine.multimodal.pixtral import PixtralImageEncoder

        return PixtralImageEncoder(config)
    if kind == "idefics3":
        from paged_engine.multimodal.idefics3 import Idefics3ImageEncoder

        return Idefics3ImageEncoder(config)
    if kind == "qwen2_vl":
        from paged_engine.multimodal.qwen2_vl import (
            QWEN3_ARCHS,
            Qwen3ImageEncoder,
            QwenImageEncoder,
        )

        if any(a in QWEN3_ARCHS for a in config.architectures):  # Qwen3-VL's tower
            return Qwen3ImageEncoder(config)
        return QwenImageEncoder(config)
    if kind == "llava_next":
        from paged_engine.multimodal.llava_next import LlavaNextImageEncoder

        return LlavaNextImageEncoder(config)
    from paged_engine.multimodal.llava import LlavaImageEncoder

    return LlavaImageEncoder(config)
