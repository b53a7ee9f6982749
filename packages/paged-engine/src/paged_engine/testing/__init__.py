"""Tiny HF-format models for tests and benchmarks.

`write_tiny_model(path, arch)` writes config.json, model.safetensors (weights of the HF
transformers class itself, so names and layouts are exactly HF's), a byte-level BPE tokenizer
trained in code (tokenizer.json + tokenizer_config.json with a chat template) and
generation_config.json. Everything is deterministic given `seed`.

    tiny_archs.py   every architecture's tiny config (`_ARCH_DEFAULTS`), token ids, template
    tokenizer.py    the tiny tokenizer
    models.py       causal LMs, classifiers, encoders; the shared randomize-and-save steps
    spec_heads.py   EAGLE / EAGLE-3 heads and MTP targets beside a tiny target
    multimodal.py   vision-language models with their processor files
    lora.py         PEFT-format adapters and their merged reference
    video.py        video bytes from frames

The underscored names exported here (`_COMMON`, `_save_random`, ...) are the building blocks
test files use to write a tiny model of a class no table entry covers.
"""

from paged_engine.testing.lora import LORA_TARGETS, merge_lora_adapter, write_lora_adapter
from paged_engine.testing.models import (
    ENCODER_CONFIGS,
    _quiet_progress,
    _randomize,
    _save_random,
    tiny_config,
    tiny_model_info,
    write_tiny_classifier,
    write_tiny_encoder,
    write_tiny_model,
)
from paged_engine.testing.multimodal import (
    GEMMA3_CHAT_TEMPLATE,
    GEMMA3_IMAGE_TOKENS,
    IDEFICS3_CHAT_TEMPLATE,
    INTERNVL_CHAT_TEMPLATE,
    LLAVA_CHAT_TEMPLATE,
    MISTRAL3_CHAT_TEMPLATE,
    QWEN2_VL_CHAT_TEMPLATE,
    write_tiny_gemma3,
    write_tiny_idefics3,
    write_tiny_internvl,
    write_tiny_llava,
    write_tiny_mistral3,
    write_tiny_qwen2_vl,
)
from paged_engine.testing.spec_heads import (
    write_tiny_eagle3_head,
    write_tiny_eagle_head,
    write_tiny_mtp_target,
)
from paged_engine.testing.tiny_archs import (
    _ARCH_DEFAULTS,
    _COMMON,
    _LLAMA_LIKE,
    BOS_ID,
    CHAT_TEMPLATE,
    EOS_ID,
    MORE_TINY_ARCHS,
    PAD_ID,
    SPECIAL_TOKENS,
    SUPPORTED_TINY_ARCHS,
    TINY_VOCAB_SIZE,
)
from paged_engine.testing.tokenizer import build_tiny_tokenizer
from paged_engine.testing.video import encode_video

__all__ = [
    "BOS_ID",
    "CHAT_TEMPLATE",
    "ENCODER_CONFIGS",
    "EOS_ID",
    "GEMMA3_CHAT_TEMPLATE",
    "GEMMA3_IMAGE_TOKENS",
    "IDEFICS3_CHAT_TEMPLATE",
    "INTERNVL_CHAT_TEMPLATE",
    "LLAVA_CHAT_TEMPLATE",
    "LORA_TARGETS",
    "MISTRAL3_CHAT_TEMPLATE",
    "MORE_TINY_ARCHS",
    "PAD_ID",
    "QWEN2_VL_CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "SUPPORTED_TINY_ARCHS",
    "TINY_VOCAB_SIZE",
    "_ARCH_DEFAULTS",
    "_COMMON",
    "_LLAMA_LIKE",
    "_quiet_progress",
    "_randomize",
    "_save_random",
    "build_tiny_tokenizer",
    "encode_video",
    "merge_lora_adapter",
    "tiny_config",
    "tiny_model_info",
    "write_lora_adapter",
    "write_tiny_classifier",
    "write_tiny_eagle3_head",
    "write_tiny_eagle_head",
    "write_tiny_encoder",
    "write_tiny_gemma3",
    "write_tiny_idefics3",
    "write_tiny_internvl",
    "write_tiny_llava",
    "write_tiny_mistral3",
    "write_tiny_model",
    "write_tiny_mtp_target",
    "write_tiny_qwen2_vl",
]
