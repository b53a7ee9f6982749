"""PaddleOCR-VL's language model (`PaddleOCRTextForCausalLM`, text_config "paddleocr_vl_text" of
PaddleOCRVLForConditionalGeneration): ERNIE 4.5's decoder (models/ernie4_5.py: `use_bias` on
every attention and MLP projection, an explicit head_dim) rotated as transformers'
PaddleOCRAttention does, by NeoX halves (rotate_half), not ERNIE 4.5's interleaved pairs.

Its rope is Qwen2-VL's M-RoPE (text_config.rope_parameters.mrope_section, contiguous sections):
layers/rotary.py's get_rope builds it from the config; text tokens carry one position on all
three rows (the ordinary rope), an image's tokens the rows multimodal/paddleocr_vl.py's layout
writes (multimodal/mrope.py).
"""

from __future__ import annotations

from paged_engine.models.ernie4_5 import ernie_layer_flags
from paged_engine.models.llama import LlamaForCausalLM


class PaddleOCRTextForCausalLM(LlamaForCausalLM):
    tie_default = True  # PaddleOCRTextConfig ties the embeddings unless told otherwise

    @classmethod
    def layer_flags(cls, config) -> dict[str, bool]:
        return ernie_layer_flags(config)
