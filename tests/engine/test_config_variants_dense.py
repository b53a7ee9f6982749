"""Config fields away from the tiny models' defaults, a few a case, on more dense architectures
(test_config_variants.py's method): each variant, served by `LLM` (float32), gives HF
transformers' greedy tokens and top-3 logprobs (1e-3, hf_reference.assert_matches) on prompts
shorter and longer than any sliding window. A few variants run again with chunked prefill
(16-token steps) and prefix caching, twice. A config transformers cannot run, or that paged does
not serve, is refused at load by a ValueError naming the field.

A `sliding_window` the HF model never reads is checked against HF without its KV cache:
transformers' generate builds a windowed DynamicCache from any config.sliding_window, so its
decode steps drop keys its prefill attended to (the model itself attends to everything).

Regressions:
- partial_rotary_factor on Cohere, Cohere 2, Falcon, OLMo 3, Seed-OSS, ERNIE 4.5, Helium and
  Hunyuan dense, whose transformers rope turns whole heads (layers/rotary.py
  WHOLE_HEAD_ROPE_MODEL_TYPES), once rotated part of each head;
- mlp_bias, which HF's GLM / GLM-4 MLPs never read, and attention_bias / mlp_bias, which HF's
  EXAONE 4 never reads, once asked for bias weights the checkpoints do not hold (Helium's MLP
  keeps reading mlp_bias);
- a head_dim whose heads do not make up hidden_size once crashed GPT-NeoX's requests (the KV
  cache sized by head_dim, the model by hidden / heads) and was served by StableLM, Phi and
  Helium, which transformers cannot run: now refused by name;
- Falcon's multi-head layout (neither new_decoder_architecture nor multi_query) with
  num_kv_heads != num_attention_heads, which transformers cannot run, was served;
- Cohere 2 and OLMo 3 sliding_attention layers without a sliding_window, which transformers
  cannot run, were served (Cohere 2's as NoPE full layers, OLMo 3's as full ones);
- MPT's attn_config.alibi_bias_max, GPT-J's rope_theta / rope_scaling, and a Gemma 1
  hidden_activation unlike its hidden_act (transformers 5 reads none of them; vLLM does) gave
  other outputs than transformers: now refused by name.
"""

from __future__ import annotations

from typing import Any

import pytest
from config_variant_check import (
    CHUNKED_PREFIX_CACHE,
    assert_refused,
    hf_refs,
    serve_and_compare,
)

from paged_engine.testing import write_tiny_model

pytest.importorskip("transformers")

LENGTHS = (5, 20, 60)  # the windows below are 8 tokens: the later two prompts slide

_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
_LINEAR = {"rope_type": "linear", "factor": 2.0}
_DYNAMIC = {"rope_type": "dynamic", "factor": 2.0}
_LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
_DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
_HALF = {"partial_rotary_factor": 0.5}
# Falcon-RW's layout: multi-head attention on per-head fused rows, sequential layers
_FALCON_MHA = {"new_decoder_architecture": False, "multi_query": False, "num_kv_heads": None}

# id -> (tiny arch, config overrides)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    # Gemma 1
    "gemma-mqa-head_dim-8": ("gemma", {"num_key_value_heads": 1, "head_dim": 8}),
    "gemma-legacy-gelu-untied": (
        "gemma",
        {
            "hidden_act": "gelu",
            "hidden_activation": "gelu_pytorch_tanh",
            "tie_word_embeddings": False,
        },
    ),
    # Cohere / Cohere 2
    "cohere-plain-mqa": (
        "cohere",
        {
            "use_qk_norm": False,
            "attention_bias": False,
            "logit_scale": 1.0,
            "num_key_value_heads": 1,
        },
    ),
    "cohere-yarn-head_dim-8": ("cohere", {"rope_scaling": _YARN, "head_dim": 8}),
    # regression: transformers' Cohere turns whole heads whatever partial_rotary_factor says
    "cohere-partial_rotary_factor": ("cohere", _HALF),
    "cohere2-partial_rotary_factor": ("cohere2", _HALF),
    "cohere2-all-sliding-bias-mqa": (
        "cohere2",
        {
            "layer_types": ["sliding_attention", "sliding_attention"],
            "attention_bias": True,
            "num_key_value_heads": 1,
        },
    ),
    "cohere2-window-pattern-2-linear": (
        "cohere2",
        {"layer_types": None, "sliding_window_pattern": 2, "rope_scaling": _LINEAR},
    ),
    # Falcon: 7B's, RW's, 11B's layouts, ALiBi, rope scalings
    "falcon-7b-multi_query-parallel": (
        "falcon",
        {"new_decoder_architecture": False, "multi_query": True, "num_kv_heads": None},
    ),
    "falcon-rw-alibi-sequential-bias": (
        "falcon",
        {**_FALCON_MHA, "parallel_attn": False, "alibi": True, "bias": True},
    ),
    "falcon-mha-parallel-rope": ("falcon", {**_FALCON_MHA, "parallel_attn": True}),
    "falcon-one-ln-alibi": ("falcon", {"num_ln_in_parallel_attn": 1, "alibi": True}),
    "falcon-dynamic-relu-untied": (
        "falcon",
        {"rope_scaling": _DYNAMIC, "activation": "relu", "tie_word_embeddings": False},
    ),
    "falcon-partial_rotary_factor": ("falcon", _HALF),  # regression: whole heads
    # StarCoder2
    "starcoder2-no-bias-no-window": ("starcoder2", {"use_bias": False, "sliding_window": None}),
    "starcoder2-mqa-gelu-linear": (
        "starcoder2",
        {"num_key_value_heads": 1, "hidden_act": "gelu", "rope_scaling": _LINEAR},
    ),
    # GPT-NeoX, GPT-J, BLOOM, MPT, OPT, GPT-BigCode
    "gpt_neox-sequential-full-rotary": (
        "gpt_neox",
        {"use_parallel_residual": False, "rotary_pct": 1.0},
    ),
    "gpt_neox-no-bias-tied-linear": (
        "gpt_neox",
        {"attention_bias": False, "tie_word_embeddings": True, "rope_scaling": _LINEAR},
    ),
    "gpt_neox-quarter-rotary-yarn": (
        "gpt_neox",
        {"rotary_pct": 0.25, "rope_scaling": _YARN, "hidden_act": "gelu_new"},
    ),
    "gptj-rotary_dim-16-gelu-tied": (
        "gptj",
        {"rotary_dim": 16, "activation_function": "gelu", "tie_word_embeddings": True},
    ),
    "bloom-4-heads-untied": ("bloom", {"n_head": 4, "tie_word_embeddings": False}),
    "mpt-clip-softmax_scale": ("mpt", {"attn_config": {"clip_qkv": 0.5, "softmax_scale": 0.3}}),
    # transformers' MPT reads none of these (no biases, 4 x hidden MLP, unscaled logits)
    "mpt-fields-transformers-ignores": (
        "mpt",
        {"no_bias": False, "expansion_ratio": 2, "logit_scale": 0.5},
    ),
    "opt-post-ln-proj-dim": ("opt", {"do_layer_norm_before": False, "word_embed_proj_dim": 32}),
    "opt-no-bias-no-affine-gelu": (
        "opt",
        {
            "enable_bias": False,
            "layer_norm_elementwise_affine": False,
            "activation_function": "gelu",
        },
    ),
    "opt-no-final-ln-untied": (
        "opt",
        {"_remove_final_layer_norm": True, "tie_word_embeddings": False},
    ),
    "gpt_bigcode-mha-unscaled-relu": (
        "gpt_bigcode",
        {"multi_query": False, "scale_attn_weights": False, "activation_function": "relu"},
    ),
    # StableLM, Phi, Nemotron: partial rotary, q / k LayerNorms, parallel residuals
    "stablelm-qk_ln-parallel-mqa": (
        "stablelm",
        {"qk_layernorm": True, "use_parallel_residual": True, "num_key_value_heads": 1},
    ),
    "stablelm-no-bias-full-rotary-dynamic": (
        "stablelm",
        {"use_qkv_bias": False, "partial_rotary_factor": 1.0, "rope_scaling": _DYNAMIC},
    ),
    "phi-full-rotary-no-qk_ln-tied": (
        "phi",
        {"partial_rotary_factor": 1.0, "qk_layernorm": False, "tie_word_embeddings": True},
    ),
    "phi-mqa-yarn": ("phi", {"num_key_value_heads": 1, "rope_scaling": _YARN}),
    "nemotron-quarter-rotary-biases": (
        "nemotron",
        {"partial_rotary_factor": 0.25, "attention_bias": True, "mlp_bias": True},
    ),
    "nemotron-full-rotary-linear-tied": (
        "nemotron",
        {"partial_rotary_factor": 1.0, "rope_scaling": _LINEAR, "tie_word_embeddings": True},
    ),
    # EXAONE 4, OLMo 3, SmolLM3: which layers slide and rotate
    "exaone4-layer_types-default-rope-tied": (
        "exaone4",
        {
            "layer_types": [
                "full_attention",
                "sliding_attention",
                "sliding_attention",
                "full_attention",
            ],
            "rope_parameters": _DEFAULT_ROPE,
            "tie_word_embeddings": True,
        },
    ),
    "exaone4-mqa-head_dim-8": ("exaone4", {"num_key_value_heads": 1, "head_dim": 8}),
    # regression: HF's EXAONE 4 has no biases, whatever attention_bias / mlp_bias say
    "exaone4-bias-flags-ignored": ("exaone4", {"attention_bias": True, "mlp_bias": True}),
    "olmo3-partial_rotary_factor": ("olmo3", {**_HALF, "rope_scaling": None}),  # regression
    "olmo3-per-type-ropes-bias": (
        "olmo3",
        {
            "rope_scaling": None,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                "full_attention": {**_YARN, "rope_theta": 10000.0},
            },
            "attention_bias": True,
        },
    ),
    "smollm3-interval-1-window": (
        "smollm3",
        {"no_rope_layer_interval": 1, "use_sliding_window": True, "sliding_window": 8},
    ),
    "smollm3-no_rope_layers-yarn-untied": (
        "smollm3",
        {"no_rope_layers": [0, 1], "rope_scaling": _YARN, "tie_word_embeddings": False},
    ),
    # GLM-4, GLM, Helium
    "glm4-quarter-rotary-no-bias-mqa-yarn": (
        "glm4",
        {
            "partial_rotary_factor": 0.25,
            "attention_bias": False,
            "num_key_value_heads": 1,
            "rope_scaling": _YARN,
        },
    ),
    # regression: HF's GLM-4 / GLM MLPs have no biases, whatever mlp_bias says
    "glm4-mlp_bias-ignored": ("glm4", {"mlp_bias": True}),
    "glm-mlp_bias-ignored-full-rotary": ("glm", {"mlp_bias": True, "partial_rotary_factor": 1.0}),
    "helium-mlp_bias-tied-mqa": (
        "helium",
        {"mlp_bias": True, "tie_word_embeddings": True, "num_key_value_heads": 1},
    ),
    "helium-partial_rotary_factor": ("helium", _HALF),  # regression: whole heads
    # Seed-OSS, ERNIE 4.5, Hunyuan dense
    "seed_oss-o_proj-bias-only-llama3": (
        "seed_oss",
        {
            "attention_out_bias": True,
            "attention_bias": False,
            "mlp_bias": False,
            "rope_scaling": _LLAMA3,
        },
    ),
    "seed_oss-partial_rotary_factor": ("seed_oss", _HALF),  # regression: whole heads
    "ernie4_5-no-bias-mqa-linear": (
        "ernie4_5",
        {"use_bias": False, "num_key_value_heads": 1, "rope_scaling": _LINEAR},
    ),
    "ernie4_5-partial_rotary_factor": ("ernie4_5", _HALF),  # regression: whole heads
    "hunyuan_v1_dense-default-rope-mlp_bias": (
        "hunyuan_v1_dense",
        {"rope_parameters": _DEFAULT_ROPE, "attention_bias": False, "mlp_bias": True},
    ),
    # regression: whole heads
    "hunyuan_v1_dense-partial_rotary_factor": (
        "hunyuan_v1_dense",
        {**_HALF, "rope_parameters": _DEFAULT_ROPE},
    ),
}

# sliding_window set where the HF model never reads it (checked against HF without its cache)
WINDOW_IGNORED = ["gemma", "falcon"]

# variants run again with chunked prefill and prefix caching
CHUNKED = [
    "falcon-rw-alibi-sequential-bias",
    "cohere2-window-pattern-2-linear",
    "exaone4-layer_types-default-rope-tied",
]


@pytest.mark.parametrize("case", list(CASES))
def test_dense_config_variant_matches_hf(case, tmp_path):
    arch, overrides = CASES[case]
    path = write_tiny_model(tmp_path, arch, seed=1, **overrides)
    prompts, refs = hf_refs(path, LENGTHS)
    serve_and_compare(case, path, prompts, refs)


@pytest.mark.parametrize("arch", WINDOW_IGNORED)
def test_sliding_window_hf_never_reads_is_ignored(arch, tmp_path):
    path = write_tiny_model(tmp_path, arch, seed=1, sliding_window=8)
    prompts, refs = hf_refs(path, LENGTHS, use_cache=False)
    serve_and_compare(f"{arch}-sliding_window-ignored", path, prompts, refs)


@pytest.mark.parametrize("case", CHUNKED)
def test_dense_config_variant_chunked_prefill_and_prefix_cache(case, tmp_path):
    arch, overrides = CASES[case]
    path = write_tiny_model(tmp_path, arch, seed=1, **overrides)
    prompts, refs = hf_refs(path, LENGTHS)
    serve_and_compare(case, path, prompts, refs, passes=2, **CHUNKED_PREFIX_CACHE)


# id -> (tiny arch, overrides HF builds, config.json edits after saving, what the error names)
REFUSED: dict[str, tuple[str, dict[str, Any], dict[str, Any], str]] = {
    # transformers' Cohere cannot run a partial rotary factor under a scaled rope
    "cohere-partial-with-linear-rope": (
        "cohere",
        {**_HALF, "rope_scaling": _LINEAR},
        {},
        "partial_rotary_factor=0.5 with a 'linear' rope scaling",
    ),
    # regression: transformers 5 runs hidden_act, vLLM hidden_activation
    "gemma-hidden_activation-unlike-hidden_act": (
        "gemma",
        {"hidden_activation": "gelu"},
        {},
        "hidden_activation='gelu' beside hidden_act='gelu_pytorch_tanh'",
    ),
    # regression: multi-head rows carry a KV head per head (HF fails on it)
    "falcon-mha-num_kv_heads-2": (
        "falcon",
        {"new_decoder_architecture": False, "multi_query": False},
        {},
        "num_kv_heads=2 != num_attention_heads=4",
    ),
    # regression: transformers' MPT builds its slopes with 8 whatever the config says
    "mpt-alibi_bias_max-4": (
        "mpt",
        {},
        {"attn_config": {"alibi_bias_max": 4}},
        "attn_config.alibi_bias_max=4",
    ),
    # regression: transformers' GPT-J rotates by base 10000, unscaled
    "gptj-rope_theta": ("gptj", {}, {"rope_theta": 100.0}, "rope_theta=100.0"),
    "gptj-rope_scaling": ("gptj", {"rope_scaling": _LINEAR}, {}, "rope_scaling="),
    # regression: heads that do not make up hidden_size (HF ignores or fails on head_dim)
    "gpt_neox-head_dim-8": ("gpt_neox", {"head_dim": 8}, {}, "head_dim=8"),
    "stablelm-head_dim-8": ("stablelm", {"head_dim": 8}, {}, "head_dim=8"),
    "phi-head_dim-8": ("phi", {"head_dim": 8}, {}, "head_dim=8"),
    "helium-head_dim-8": ("helium", {"head_dim": 8}, {}, "head_dim=8"),
    # regression: transformers cannot build a sliding layer's mask without a window
    "cohere2-sliding-layers-without-window": (
        "cohere2",
        {"sliding_window": None},
        {},
        "sliding_attention layers and sliding_window=None",
    ),
    "olmo3-sliding-layers-without-window": (
        "olmo3",
        {"sliding_window": None},
        {},
        "sliding_attention layers and sliding_window=None",
    ),
    "bloom-residual-after-layernorm": (
        "bloom",
        {"apply_residual_connection_post_layernorm": True},
        {},
        "apply_residual_connection_post_layernorm=True",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unservable_dense_config_is_refused_by_name(case, tmp_path):
    assert_refused(tmp_path, *REFUSED[case])
