"""The checkpoints whose videos paged runs, and which video processor each takes.

    Glm4vForConditionalGeneration, Glm4vMoe..., Glm46V...   multimodal/glm4v_video.py
    Gemma4ForConditionalGeneration                          multimodal/gemma4_video.py
    Qwen2_5OmniThinker..., Qwen3OmniMoeThinker... (and the
      whole Omni models, read as their thinker_config)      multimodal/omni_video.py
    Qwen3VL..., Qwen3VLMoe..., Qwen3_5..., Qwen3_5Moe...    multimodal/qwen3_video.py
    Qwen2VLForConditionalGeneration, Qwen2_5_VL...          multimodal/qwen_video.py
    LlavaNextVideoForConditionalGeneration                  multimodal/llava_next_video.py
    Kimi_K25ForConditionalGeneration                        multimodal/kimi_k25_video.py
    Tarsier2ForConditionalGeneration (Qwen2-VL's videos)    models/tarsier2_config.py
    Ovis2_5 (the Hub release; one video per prompt)         multimodal/ovis2_5_hub_video.py

Every processor is built the same way, cls(path, config, tokenizer, limit, engine_config):
the checkpoint's directory, its wrapper config, the engine's tokenizer, videos per prompt
(limit_mm_per_prompt["video"], None for any) and the EngineConfig; each raises ValueError where
the checkpoint's settings give no videos it can process (the engine then serves images only).
Other wrappers refuse multi_modal_data['video'] by name (archs.VIDEO_MODELS).
"""

from __future__ import annotations

from collections.abc import Iterable

from paged_engine.models.tarsier2_config import ARCH as TARSIER2
from paged_engine.models.tarsier2_config import Tarsier2VideoProcessor
from paged_engine.multimodal import (
    gemma4_video,
    glm4v_video,
    kimi_k25_video,
    llava_next_video,
    omni_video,
    ovis2_5_hub_video,
    qwen2_vl,
    qwen3_video,
)
from paged_engine.multimodal.gemma4_video import Gemma4VideoProcessor
from paged_engine.multimodal.glm4v_video import Glm4vVideoProcessor
from paged_engine.multimodal.kimi_k25_video import KimiVideoProcessor
from paged_engine.multimodal.llava_next_video import LlavaNextVideoProcessor
from paged_engine.multimodal.omni_video import OmniVideoProcessor
from paged_engine.multimodal.ovis2_5_hub_video import Ovis2_5HubVideoProcessor
from paged_engine.multimodal.qwen3_video import Qwen3VideoProcessor
from paged_engine.multimodal.qwen_video import QwenVideoProcessor, VideoProcessor

# (architectures, the processor class), the first row naming one of a config's wins
VIDEO_PROCESSORS: tuple[tuple[tuple[str, ...], type[VideoProcessor]], ...] = (
    (glm4v_video.ARCHS, Glm4vVideoProcessor),
    (gemma4_video.ARCHS, Gemma4VideoProcessor),
    (omni_video.ARCHS, OmniVideoProcessor),
    (qwen3_video.ARCHS, Qwen3VideoProcessor),
    (qwen2_vl.ARCHS, QwenVideoProcessor),
    (llava_next_video.ARCHS, LlavaNextVideoProcessor),
    (kimi_k25_video.ARCHS, KimiVideoProcessor),
    ((TARSIER2,), Tarsier2VideoProcessor),
    (ovis2_5_hub_video.ARCHS, Ovis2_5HubVideoProcessor),
)
VIDEO_ARCHS = tuple(a for archs, _ in VIDEO_PROCESSORS for a in archs)


def video_processor_class(architectures: Iterable[str]) -> type[VideoProcessor] | None:
    """The video processor of a wrapper config's architectures; None where none runs videos."""
    names = set(architectures)
    return next((cls for archs, cls in VIDEO_PROCESSORS if names.intersection(archs)), None)
