"""GLM-4.1V / GLM-4.5V / GLM-4.6V's image path: Qwen2-VL's host side with GLM's tower.

    image -> the checkpoint's image processor (Glm4vImageProcessor: Qwen2-VL's patch rows,
        resized to multiples of patch * merge pixels) -> pixel rows [t*h*w, 3 * tp * p * p]
    -> the vision encoder ("visual", multimodal/glm4v_vision.py)
        -> [t*h*w / merge^2, text hidden]
    prompt: <|begin_of_image|> <|image|> x (t*h*w / merge^2) <|end_of_image|>
        (Glm4vProcessor repeats the chat template's lone <|image|>: a run layout, QwenLayout)

The decoder's positions are Qwen2-VL's M-RoPE table (multimodal/mrope.py; Glm4vModel's
get_rope_index gives the same rows for images). The text models rotate by it as transformers
does: GLM-4.1V / 4.6V's decoder (models/glm4.py) pairs interleaved dims, each frequency of
mrope_section's contiguous blocks turned by its row; GLM-4.5V's (models/glm4_moe.py) the NeoX
halves. Refused by name: a text rope without mrope_section (HF falls back to [8, 12, 12]
silently), sections not covering half the rotary dims (qwen2_vl.check_config), and the
tower's fields in glm4v_vision.py. Videos enter as timestamped frame pairs that this encoder
reads as images (multimodal/glm4v_video.py).
"""

from __future__ import annotations

from torch import nn

from paged_engine.multimodal.glm4v_vision import Glm4vVisionEncoder
from paged_engine.multimodal.qwen2_vl import QwenImageEncoder


class Glm4vImageEncoder(QwenImageEncoder):
    """Images -> rows of the text model's input embedding, one per placeholder."""

    def __init__(self, config) -> None:
        nn.Module.__init__(self)
        self.visual = Glm4vVisionEncoder(config.vision_config)
