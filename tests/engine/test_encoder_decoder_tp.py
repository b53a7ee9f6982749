"""Every encoder-decoder refuses, at engine start, a tensor_parallel_size that does not divide
its attention heads (models/encoder_decoder.py `tp_divides_heads`), naming the config field;
each tiny checkpoint below has 4 decoder heads (BART's encoder too), so 3 ranks cannot split them.
Mllama's own rule (its KV heads too) is tested with Mllama."""

from __future__ import annotations

import pytest
from test_bart import write_tiny as write_bart
from test_cohere_asr import write_tiny_cohere_asr
from test_donut import write_tiny as write_donut
from test_florence2 import write_tiny as write_florence2
from test_moonshine import write_tiny_moonshine
from test_whisper import write_tiny_whisper

from paged_engine import LLM

CASES = [
    (write_bart, r"4 attention heads of config\.encoder_attention_heads"),
    (write_florence2, r"4 attention heads of config\.encoder_attention_heads"),
    (write_donut, r"4 attention heads of decoder\.decoder_attention_heads"),
    (write_tiny_whisper, r"4 attention heads of config\.decoder_attention_heads"),
    (write_tiny_moonshine, r"4 attention heads of config\.decoder_num_attention_heads"),
    (write_tiny_cohere_asr, r"4 attention heads of config\.num_attention_heads"),
]


@pytest.mark.parametrize(("write", "why"), CASES, ids=[w.__module__ for w, _ in CASES])
def test_tensor_parallel_size_must_divide_heads(tmp_path, write, why):
    path = write(tmp_path / "model")
    with pytest.raises(ValueError, match=rf"tensor_parallel_size=3 does not divide the {why}"):
        LLM(model=str(path), dtype="float32", tensor_parallel_size=3)
