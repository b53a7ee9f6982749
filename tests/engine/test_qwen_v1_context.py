"""Qwen v1's context (models/qwen_v1.py) as vLLM derives max_model_len: the smallest of the
config's length keys present (max_position_embeddings, seq_length), whatever use_dynamic_ntk /
use_logn_attn say; 2048 when neither is there. The model's maths within that context is
test_models_remote_aliases.py's test_qwen_v1."""

from __future__ import annotations

import pytest

from paged_engine.models.qwen_v1 import qwen_v1_config

BASE = {
    "architectures": ["QWenLMHeadModel"],
    "model_type": "qwen",
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_hidden_layers": 1,
    "intermediate_size": 128,
    "vocab_size": 512,
}


@pytest.mark.parametrize(
    ("fields", "context"),
    [
        # Qwen-14B's config.json: vLLM's 2048 (its seq_length), not max_position_embeddings
        (
            {
                "max_position_embeddings": 8192,
                "seq_length": 2048,
                "use_dynamic_ntk": True,
                "use_logn_attn": True,
            },
            2048,
        ),
        # the flags off: still the smaller key, as vLLM
        (
            {
                "max_position_embeddings": 8192,
                "seq_length": 2048,
                "use_dynamic_ntk": False,
                "use_logn_attn": False,
            },
            2048,
        ),
        ({"max_position_embeddings": 1024, "seq_length": 4096}, 1024),
        ({"max_position_embeddings": 32768, "seq_length": 32768, "use_dynamic_ntk": True}, 32768),
        ({"seq_length": 512}, 512),
        ({}, 2048),  # vLLM's default when no length key is present
    ],
)
def test_qwen_v1_context_is_vllms_max_model_len(fields: dict, context: int) -> None:
    assert qwen_v1_config({**BASE, **fields}).max_position_embeddings == context


def test_qwen_v1_bad_length_field_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="seq_length"):
        qwen_v1_config({**BASE, "max_position_embeddings": 8192, "seq_length": "2048"})
