"""Config fields away from the tiny models' defaults, a few a case, on the most-served
architectures: each variant, served by `LLM` (float32), gives HF transformers' greedy tokens and
top-3 logprobs (1e-3, hf_reference.assert_matches) on prompts shorter and longer than any
sliding window (or, for longrope, all longer than its original context: paged keeps the long
factors for every sequence, layers/rotary.py). A few variants run again with chunked prefill
(16-token steps) and prefix caching, twice (the second pass from cached blocks). A config
transformers cannot run, or that paged does not serve, is refused at load by a ValueError
naming the field.

Regressions: partial_rotary_factor on the Llama-family model types whose transformers rope
turns whole heads (layers/rotary.py WHOLE_HEAD_ROPE_MODEL_TYPES) once rotated part of each
head; attention_bias / mlp_bias, which HF's Mistral and Phi-3 never read, once asked for bias
weights the checkpoints do not hold (Mixtral's attention_bias too).
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
PAST_32 = (40, 70)  # past a 32-token original context (longrope's long factors)


def _longrope(n: int) -> dict[str, Any]:
    return {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.01 * i for i in range(n)],
        "long_factor": [1.0 + 0.5 * i for i in range(n)],
    }


_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
_LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
_QWEN_WINDOW = {"use_sliding_window": True, "sliding_window": 8}

# id -> (tiny arch, config overrides, prompt lengths)
CASES: dict[str, tuple[str, dict[str, Any], tuple[int, ...]]] = {
    # Llama: heads, biases, activation, every rope scaling
    "llama-tied": ("llama", {"tie_word_embeddings": True}, LENGTHS),
    "llama-head_dim-8": ("llama", {"head_dim": 8}, LENGTHS),
    "llama-mqa-head_dim-32": ("llama", {"num_key_value_heads": 1, "head_dim": 32}, LENGTHS),
    "llama-biases": ("llama", {"attention_bias": True, "mlp_bias": True}, LENGTHS),
    "llama-gelu_pytorch_tanh": ("llama", {"hidden_act": "gelu_pytorch_tanh"}, LENGTHS),
    "llama-rms_norm_eps": ("llama", {"rms_norm_eps": 0.1}, LENGTHS),
    "llama-linear": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, LENGTHS),
    "llama-yarn-attention_factor": (
        "llama",
        {"rope_scaling": {**_YARN, "attention_factor": 1.3}},
        LENGTHS,
    ),
    "llama-yarn-mscale": (
        "llama",
        {"rope_scaling": {**_YARN, "mscale": 0.8, "mscale_all_dim": 1.0}},
        LENGTHS,
    ),
    "llama-yarn-no-truncate": (
        "llama",
        {"rope_scaling": {**_YARN, "beta_fast": 8.0, "beta_slow": 2.0, "truncate": False}},
        LENGTHS,
    ),
    "llama-llama3": ("llama", {"rope_scaling": _LLAMA3}, LENGTHS),
    "llama-longrope": (
        "llama",
        {
            "rope_scaling": {**_longrope(8), "original_max_position_embeddings": 32},
            "max_position_embeddings": 128,
        },
        PAST_32,
    ),
    # regression: transformers' Llama turns whole heads whatever partial_rotary_factor says
    "llama-partial_rotary_factor": ("llama", {"partial_rotary_factor": 0.5}, LENGTHS),
    # Qwen 2 / 3: which layers slide
    "qwen2-max_window_layers-1": ("qwen2", {**_QWEN_WINDOW, "max_window_layers": 1}, LENGTHS),
    "qwen2-window-off": ("qwen2", {"use_sliding_window": False, "sliding_window": 8}, LENGTHS),
    "qwen2-layer_types": (
        "qwen2",
        {**_QWEN_WINDOW, "layer_types": ["full_attention", "sliding_attention"]},
        LENGTHS,
    ),
    "qwen2-untied-yarn": (
        "qwen2",
        {"tie_word_embeddings": False, "rope_scaling": _YARN},
        LENGTHS,
    ),
    "qwen2-partial_rotary_factor": ("qwen2", {"partial_rotary_factor": 0.5}, LENGTHS),
    "qwen3-bias-window": (
        "qwen3",
        {**_QWEN_WINDOW, "attention_bias": True, "max_window_layers": 1},
        LENGTHS,
    ),
    "qwen3-mqa-head_dim-8": ("qwen3", {"num_key_value_heads": 1, "head_dim": 8}, LENGTHS),
    # Qwen MoE routing and layer placement
    "qwen3_moe-top1-unnormalized": (
        "qwen3_moe",
        {"num_experts_per_tok": 1, "norm_topk_prob": False},
        LENGTHS,
    ),
    "qwen3_moe-sparse_step-2": ("qwen3_moe", {"decoder_sparse_step": 2}, LENGTHS),
    "qwen3_moe-mlp_only_layers": ("qwen3_moe", {"mlp_only_layers": [0]}, LENGTHS),
    "qwen3_moe-partial_rotary_factor": ("qwen3_moe", {"partial_rotary_factor": 0.5}, LENGTHS),
    "qwen2_moe-normalized-top1": (
        "qwen2_moe",
        {"norm_topk_prob": True, "num_experts_per_tok": 1},
        LENGTHS,
    ),
    "qwen2_moe-sparse_step-2": (
        "qwen2_moe",
        {"decoder_sparse_step": 2, "mlp_only_layers": []},
        LENGTHS,
    ),
    "qwen2_moe-window": ("qwen2_moe", {**_QWEN_WINDOW, "max_window_layers": 1}, LENGTHS),
    # Mistral / Mixtral
    "mistral-no-window": ("mistral", {"sliding_window": None}, LENGTHS),
    "mistral-layer_types": (
        "mistral",
        {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
        LENGTHS,
    ),
    # regression: HF's Mistral has no biases, whatever attention_bias / mlp_bias say
    "mistral-bias-flags-ignored": (
        "mistral",
        {"attention_bias": True, "mlp_bias": True},
        LENGTHS,
    ),
    "mixtral-top1-window": (
        "mixtral",
        {"num_experts_per_tok": 1, "sliding_window": 8},
        LENGTHS,
    ),
    # regression: HF's Mixtral has no attention biases, whatever attention_bias says
    "mixtral-attention_bias-ignored": ("mixtral", {"attention_bias": True}, LENGTHS),
    "mixtral-top3-of-8": ("mixtral", {"num_local_experts": 8, "num_experts_per_tok": 3}, LENGTHS),
    # Gemma 2 / 3
    "gemma2-no-softcaps": (
        "gemma2",
        {"attn_logit_softcapping": None, "final_logit_softcapping": None},
        LENGTHS,
    ),
    "gemma2-query_pre_attn_scalar": ("gemma2", {"query_pre_attn_scalar": 7}, LENGTHS),
    "gemma2-gelu-untied": (
        "gemma2",
        {"hidden_activation": "gelu", "tie_word_embeddings": False},
        LENGTHS,
    ),
    "gemma2-partial_rotary_factor": ("gemma2", {"partial_rotary_factor": 0.5}, LENGTHS),
    "gemma3-yarn-full-layers": (
        "gemma3",
        {"rope_scaling": {**_YARN, "beta_fast": 8.0, "beta_slow": 2.0}},
        LENGTHS,
    ),
    "gemma3-softcaps-local-base": (
        "gemma3",
        {
            "attn_logit_softcapping": 20.0,
            "final_logit_softcapping": 5.0,
            "rope_local_base_freq": 100.0,
        },
        LENGTHS,
    ),
    # Phi-3: longrope past its original context, partial rotary, no window
    "phi3-longrope": (
        "phi3",
        {
            "rope_scaling": _longrope(6),
            "original_max_position_embeddings": 32,
            "max_position_embeddings": 128,
        },
        PAST_32,
    ),
    "phi3-longrope-attention_factor": (
        "phi3",
        {
            "rope_scaling": {**_longrope(6), "attention_factor": 1.3},
            "original_max_position_embeddings": 32,
            "max_position_embeddings": 128,
        },
        PAST_32,
    ),
    "phi3-half-rotary-no-window": (
        "phi3",
        {"partial_rotary_factor": 0.5, "sliding_window": None},
        LENGTHS,
    ),
    # regression: HF's Phi-3 has no biases, whatever attention_bias / mlp_bias say
    "phi3-bias-flags-ignored": ("phi3", {"attention_bias": True, "mlp_bias": True}, LENGTHS),
    # OLMo 2, Granite
    "olmo2-llama3-bias": ("olmo2", {"rope_scaling": _LLAMA3, "attention_bias": True}, LENGTHS),
    "olmo2-partial_rotary_factor": ("olmo2", {"partial_rotary_factor": 0.5}, LENGTHS),
    "granite-multipliers-1": (
        "granite",
        {
            "embedding_multiplier": 1.0,
            "residual_multiplier": 1.0,
            "attention_multiplier": 1.0,
            "logits_scaling": 1.0,
        },
        LENGTHS,
    ),
    "granite-untied-biases-logits_scaling": (
        "granite",
        {
            "tie_word_embeddings": False,
            "attention_bias": True,
            "mlp_bias": True,
            "logits_scaling": 0.25,
        },
        LENGTHS,
    ),
    "granite-partial_rotary_factor": ("granite", {"partial_rotary_factor": 0.5}, LENGTHS),
    # DeepSeek-V3: routing fields, latent attention shapes, rope layout
    "deepseek_v3-one-group-top1-unnormalized": (
        "deepseek_v3",
        {
            "n_group": 1,
            "topk_group": 1,
            "num_experts_per_tok": 1,
            "norm_topk_prob": False,
            "routed_scaling_factor": 1.0,
        },
        LENGTHS,
    ),
    "deepseek_v3-all-moe-2-shared": (
        "deepseek_v3",
        {"first_k_dense_replace": 0, "n_shared_experts": 2, "n_group": 2, "topk_group": 1},
        LENGTHS,
    ),
    "deepseek_v3-no-q-lora-no-interleave-plain-rope": (
        "deepseek_v3",
        {"q_lora_rank": None, "rope_interleave": False, "rope_scaling": None},
        LENGTHS,
    ),
    "deepseek_v3-wide-rope-narrow-v-bias": (
        "deepseek_v3",
        {"qk_nope_head_dim": 8, "qk_rope_head_dim": 16, "v_head_dim": 8, "attention_bias": True},
        LENGTHS,
    ),
    # gpt-oss: layer kinds, routing, rope
    "gpt_oss-full-layers-top1-no-bias": (
        "gpt_oss",
        {
            "layer_types": ["full_attention", "full_attention"],
            "num_experts_per_tok": 1,
            "attention_bias": False,
        },
        LENGTHS,
    ),
    "gpt_oss-sliding-layers-mqa-linear": (
        "gpt_oss",
        {
            "layer_types": ["sliding_attention", "sliding_attention"],
            "num_key_value_heads": 1,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        },
        LENGTHS,
    ),
    "gpt_oss-yarn-attention_factor-swiglu_limit-7": (
        "gpt_oss",
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "attention_factor": 1.2,
            },
            "swiglu_limit": 7.0,
        },
        LENGTHS,
    ),
    # GPT-2: attention scalings, activation, untied head
    "gpt2-unscaled-relu-untied": (
        "gpt2",
        {"scale_attn_weights": False, "activation_function": "relu", "tie_word_embeddings": False},
        LENGTHS,
    ),
    "gpt2-inverse-layer-idx-upcast": (
        "gpt2",
        {"scale_attn_by_inverse_layer_idx": True, "reorder_and_upcast_attn": True, "n_inner": 32},
        LENGTHS,
    ),
}

# variants run again with chunked prefill and prefix caching
CHUNKED = [
    "qwen2-max_window_layers-1",
    "gemma3-softcaps-local-base",
    "phi3-longrope",
    "llama-yarn-mscale",
    "qwen3_moe-top1-unnormalized",
    "deepseek_v3-all-moe-2-shared",
    "gpt_oss-sliding-layers-mqa-linear",
]


@pytest.mark.parametrize("case", list(CASES))
def test_config_variant_matches_hf(case, tmp_path):
    arch, overrides, lengths = CASES[case]
    path = write_tiny_model(tmp_path, arch, seed=1, **overrides)
    prompts, refs = hf_refs(path, lengths)
    serve_and_compare(case, path, prompts, refs)


@pytest.mark.parametrize("case", CHUNKED)
def test_config_variant_chunked_prefill_and_prefix_cache(case, tmp_path):
    arch, overrides, lengths = CASES[case]
    path = write_tiny_model(tmp_path, arch, seed=1, **overrides)
    prompts, refs = hf_refs(path, lengths)
    serve_and_compare(case, path, prompts, refs, passes=2, **CHUNKED_PREFIX_CACHE)


# id -> (tiny arch, overrides HF builds, config.json edits after saving, what the error names)
REFUSED: dict[str, tuple[str, dict[str, Any], dict[str, Any], str]] = {
    # transformers' Llama cannot run a partial rotary factor under a scaled rope
    "llama-partial-with-linear-rope": (
        "llama",
        {},
        {
            "rope_parameters": {
                "rope_type": "linear",
                "factor": 2.0,
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
            }
        },
        "partial_rotary_factor=0.5 with a 'linear' rope scaling",
    ),
    "gpt_oss-partial-with-yarn": (
        "gpt_oss",
        {},
        {"partial_rotary_factor": 0.5},
        "partial_rotary_factor=0.5 with a 'yarn' rope scaling",
    ),
    "qwen3-unknown-rope-type": (
        "qwen3",
        {},
        {"rope_parameters": {"rope_type": "bogus", "factor": 2.0, "rope_theta": 10000.0}},
        "unsupported rope_scaling type 'bogus'",
    ),
    # DeepSeek-V3's correction-bias routing takes sigmoid scores only (as vLLM's)
    "deepseek_v3-softmax-scoring": (
        "deepseek_v3",
        {},
        {"scoring_func": "softmax"},
        "scoring_func='softmax'",
    ),
    "gpt2-cross-attention": (
        "gpt2",
        {"add_cross_attention": True},
        {},
        "add_cross_attention=True",
    ),
    "gemma2-unknown-activation": (
        "gemma2",
        {},
        {"hidden_activation": "bogus"},
        "hidden_activation='bogus' is not supported",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unservable_config_is_refused_by_name(case, tmp_path):
    assert_refused(tmp_path, *REFUSED[case])
