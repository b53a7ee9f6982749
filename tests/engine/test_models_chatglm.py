"""ChatGLM2 / 3 and GLM-4 as their remote-code releases ship them (models/chatglm.py) against
transformers' GlmForCausalLM, the same model (glm-4-9b-chat-hf is glm-4-9b-chat converted):
HF's tiny Glm checkpoint rewritten into ChatGLM's tensor names (merged query_key_value, merged
dense_h_to_4h) and config.json (num_layers, kv_channels, multi_query_group_num, rope_ratio, ...;
its config class loaded with trust_remote_code) gives HF's greedy tokens and top-5 logprobs
(1e-3, float32). The variants without an exact reference are refused by name."""

from __future__ import annotations

import json

import pytest
from hf_parity import assert_llm_matches, fuse_qkv
from hf_reference import assert_matches, hf_greedy, load_hf_model, random_token_prompts

from paged_engine import LLM, SamplingParams
from paged_engine.testing import write_tiny_model

pytest.importorskip("transformers.models.glm")

_ROPE_RATIO = 3.0  # ChatGLM's base is 10000 x rope_ratio

# The releases' config class, as their repositories ship it (loaded with trust_remote_code).
_RELEASE_CONFIG = """
from transformers import PretrainedConfig


class ChatGLMConfig(PretrainedConfig):
    model_type = "chatglm"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
"""

_RENAMES = (
    ("model.embed_tokens.", "transformer.embedding.word_embeddings."),
    ("model.layers.", "transformer.encoder.layers."),
    ("model.norm.", "transformer.encoder.final_layernorm."),
    ("lm_head.", "transformer.output_layer."),
    (".self_attn.o_proj.", ".self_attention.dense."),
    (".mlp.gate_up_proj.", ".mlp.dense_h_to_4h."),  # [gate | up] rows in both
    (".mlp.down_proj.", ".mlp.dense_4h_to_h."),
)


def _release_config(**changes) -> dict:
    """chatglm3-6b's config.json fields, at the tiny model's sizes."""
    config = {
        "architectures": ["ChatGLMModel"],
        "auto_map": {"AutoConfig": "configuration_chatglm.ChatGLMConfig"},
        "model_type": "chatglm",
        "add_bias_linear": False,
        "add_qkv_bias": True,
        "apply_query_key_layer_scaling": True,
        "apply_residual_connection_post_layernorm": False,
        "attention_dropout": 0.0,
        "attention_softmax_in_fp32": True,
        "bias_dropout_fusion": True,
        "ffn_hidden_size": 128,
        "fp32_residual_connection": False,
        "hidden_dropout": 0.0,
        "hidden_size": 64,
        "kv_channels": 32,  # not hidden_size / num_attention_heads: the heads are this wide
        "layernorm_epsilon": 1e-5,
        "multi_query_attention": True,
        "multi_query_group_num": 2,
        "num_attention_heads": 4,
        "num_layers": 2,
        "original_rope": True,
        "padded_vocab_size": 512,
        "post_layer_norm": True,
        "pre_seq_len": None,
        "prefix_projection": False,
        "quantization_bit": 0,
        "rmsnorm": True,
        "rope_ratio": _ROPE_RATIO,
        "seq_length": 1024,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_cache": True,
        "eos_token_id": 1,
        "pad_token_id": 2,
    }
    return {**config, **changes}


@pytest.fixture(scope="module")
def chatglm(tmp_path_factory):
    """(the ChatGLM-layout dir, the HF Glm model it was converted from)."""
    import torch
    from safetensors.torch import load_file, save_file

    path = write_tiny_model(
        tmp_path_factory.mktemp("chatglm"),
        "glm",
        seed=3,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0 * _ROPE_RATIO},
    )
    hf = load_hf_model(path)
    assert hf.config.head_dim == 32 and hf.config.rope_parameters["partial_rotary_factor"] == 0.5
    state = load_file(str(path / "model.safetensors"))
    out = {}
    for name, w in fuse_qkv(state, ".self_attention.query_key_value.").items():
        for ours, theirs in _RENAMES:
            name = name.replace(ours, theirs)
        out[name] = w
    out["transformer.rotary_pos_emb.inv_freq"] = torch.ones(8)  # the releases carry it
    assert not any(n.startswith("model.") for n in out)
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(_release_config()))
    (path / "configuration_chatglm.py").write_text(_RELEASE_CONFIG)
    return path, hf


def _llm(path) -> LLM:
    return LLM(
        model=str(path),
        dtype="float32",
        max_model_len=128,
        block_size=16,
        trust_remote_code=True,
    )


def test_release_checkpoint_matches_hf_glm(chatglm):
    path, hf = chatglm
    prompts = random_token_prompts("chatglm", 3)
    refs = [hf_greedy(hf, p, 10, 5) for p in prompts]
    llm = _llm(path)
    assert type(llm.llm_engine.model_runner.model).__name__ == "ChatGLMForCausalLM"
    assert_llm_matches("chatglm", llm, prompts, refs)


def test_glm4_release_names(chatglm, tmp_path):
    """glm-4-9b-chat's config: ChatGLMForConditionalGeneration, num_hidden_layers beside
    num_layers; the same model."""
    import shutil

    path, hf = chatglm
    glm4 = tmp_path / "glm4"
    shutil.copytree(path, glm4)
    config = _release_config(architectures=["ChatGLMForConditionalGeneration"], num_hidden_layers=2)
    (glm4 / "config.json").write_text(json.dumps(config))
    prompt = random_token_prompts("glm-4", 1)[0]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)
    out = _llm(glm4).generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert_matches("glm-4", out, hf_greedy(hf, prompt, 6, 5))


@pytest.mark.parametrize(
    "change",
    [
        {"rmsnorm": False},
        {"apply_residual_connection_post_layernorm": True},
        {"post_layer_norm": False},
        {"add_bias_linear": True},
        {"original_rope": False},
        {"quantization_bit": 4},
        {"pre_seq_len": 8},
    ],
    ids=lambda change: next(iter(change)),
)
def test_variants_without_a_reference_are_refused(chatglm, change):
    from paged_engine.loader import load_hf_config, resolve_model
    from paged_engine.models import get_model_class

    path, _ = chatglm
    (path / "config.json").write_text(json.dumps(_release_config(**change)))
    try:
        config = load_hf_config(resolve_model(str(path)), trust_remote_code=True)
        cls = get_model_class(config)
        with pytest.raises(ValueError, match=next(iter(change))):
            cls(config)
    finally:
        (path / "config.json").write_text(json.dumps(_release_config()))
