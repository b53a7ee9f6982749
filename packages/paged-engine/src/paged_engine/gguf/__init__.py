"""Our own GGUF support: container reader, dequantizers, HF config / weight / tokenizer conversion.

No dependency on the `gguf` PyPI package (tests use it only as a reference).
"""

from paged_engine.gguf.convert import GGUF_ARCHS, gguf_to_hf_config, gguf_weights, hf_tensor_name
from paged_engine.gguf.dequant import GGML_TYPES, dequantize
from paged_engine.gguf.reader import GGUFFile, GGUFTensorInfo
from paged_engine.gguf.tokenizer import gguf_tokenizer

__all__ = [
    "GGML_TYPES",
    "GGUF_ARCHS",
    "GGUFFile",
    "GGUFTensorInfo",
    "dequantize",
    "gguf_to_hf_config",
    "gguf_tokenizer",
    "gguf_weights",
    "hf_tensor_name",
]
