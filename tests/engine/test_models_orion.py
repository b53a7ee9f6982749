"""Orion-14B (models/orion.py), a remote-code release, against transformers'
StableLmForCausalLM with rope over whole heads, no q / k / v biases, sequential residuals and no
q / k norms (the same model: Llama with LayerNorms): the tiny StableLM checkpoint under Orion's
config.json (its LayerNorms' epsilon named rms_norm_eps; its config class loaded with
trust_remote_code) gives HF's greedy tokens and top-5 logprobs (1e-3, float32)."""

from __future__ import annotations

import json

import pytest
from hf_parity import assert_llm_matches
from hf_reference import hf_greedy, load_hf_model, random_token_prompts

from paged_engine import LLM
from paged_engine.testing import write_tiny_model

pytest.importorskip("transformers.models.stablelm")

_EPS = 0.05  # far from the default, so the LayerNorms' epsilon must come from rms_norm_eps

# The release's config class, as its repository ships it (loaded with trust_remote_code).
_RELEASE_CONFIG = """
from transformers import PretrainedConfig


class OrionConfig(PretrainedConfig):
    model_type = "orion"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
"""


def test_release_checkpoint_matches_hf_stablelm(tmp_path):
    path = write_tiny_model(
        tmp_path,
        "stablelm",
        seed=2,
        partial_rotary_factor=1.0,
        use_qkv_bias=False,
        use_parallel_residual=False,
        qk_layernorm=False,
        layer_norm_eps=_EPS,
    )
    hf = load_hf_model(path)
    hf_config = json.loads((path / "config.json").read_text())
    release = {  # Orion-14B-Base's config.json fields, at the tiny model's sizes
        "architectures": ["OrionForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_orion.OrionConfig"},
        "model_type": "orion",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "max_sequence_length": 1024,
        "pretraining_tp": 1,
        "rms_norm_eps": _EPS,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_cache": True,
        **{
            k: hf_config[k]
            for k in (
                "hidden_size",
                "intermediate_size",
                "max_position_embeddings",
                "num_attention_heads",
                "num_hidden_layers",
                "num_key_value_heads",
                "vocab_size",
            )
        },
    }
    (path / "config.json").write_text(json.dumps(release))
    (path / "configuration_orion.py").write_text(_RELEASE_CONFIG)
    prompts = random_token_prompts("orion", 3)
    refs = [hf_greedy(hf, p, 10, 5) for p in prompts]
    llm = LLM(
        model=str(path), dtype="float32", max_model_len=128, block_size=16, trust_remote_code=True
    )
    assert type(llm.llm_engine.model_runner.model).__name__ == "OrionForCausalLM"
    assert_llm_matches("orion", llm, prompts, refs)
