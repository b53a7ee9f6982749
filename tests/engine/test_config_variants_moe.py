"""Config fields away from the tiny models' defaults, a few a case, on the MoE and hybrid
(Mamba / linear attention / short conv) architectures: each variant, served by `LLM` (float32),
gives HF transformers' greedy tokens and top-3 logprobs (1e-3, hf_reference.assert_matches).
Routing (top-k, renormalization, grouped routing, shared experts, dense-layer placement),
attention shapes and rope, and the hybrids' layer patterns, state sizes, groups, conv widths and
chunk sizes vary, fields the config fuzz (config_draws*.py) does not draw among them
(partial_rotary_factor, moe_norm_min, moe_layer_freq, per-layer moe_topk, rope scalings on the
hybrids' attention). Prompts run past the scans' chunks and PhiMoE's window. A few
variants run again with chunked prefill (16-token steps) and prefix caching, twice (the second
pass from cached blocks). A config transformers cannot run, or that paged does not serve, is
refused at load by a ValueError naming the field.

Regressions: partial_rotary_factor on model types whose transformers rope turns whole heads
(layers/rotary.py WHOLE_HEAD_ROPE_MODEL_TYPES: GraniteMoeShared, GraniteMoeHybrid, PhiMoE,
HunYuan-MoE, ERNIE 4.5 MoE, DeepSeek-V2 / V3, LFM2 / LFM2-MoE, Falcon-H1, Zamba2) once rotated
part of each head, and with a scaled rope once served what transformers cannot run; HunYuan's
alpha rope with it was refused though transformers turns whole heads there too. ERNIE 4.5 MoE
once ignored moe_norm_min (its router divides the top-k weights by max(sum, moe_norm_min)).
OLMoE with head_dim * heads != hidden_size (transformers' q norm spans hidden_size: it cannot
run it) was once served with part of each norm weight.
"""

from __future__ import annotations

from pathlib import Path
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

LENGTHS = (5, 20, 60)  # the phimoe window below is 8 tokens: the later two prompts slide
HYBRID = (5, 20, 40)  # past the 8- and 16-token scan chunks (transformers' scans are slow)

_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
_HALF = {"partial_rotary_factor": 0.5}
_PLAIN_ROPE = {"rope_type": "default", "rope_theta": 10000.0}

# id -> (tiny arch, config overrides, prompt lengths)
CASES: dict[str, tuple[str, dict[str, Any], tuple[int, ...]]] = {
    # OLMoE: routing, q / k norms over the whole projection with clip_qkv, rope
    "olmoe-top1-normalized": ("olmoe", {"num_experts_per_tok": 1, "norm_topk_prob": True}, LENGTHS),
    "olmoe-mqa-clip_qkv-bias": (
        "olmoe",
        {"num_key_value_heads": 1, "clip_qkv": 0.5, "attention_bias": True},
        LENGTHS,
    ),
    "olmoe-heads8-yarn-tied": (
        "olmoe",
        {
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "rope_scaling": _YARN,
            "tie_word_embeddings": True,
        },
        LENGTHS,
    ),
    # Granite MoE (shared)
    "granitemoe-top3-of-8-no-bias-untied": (
        "granitemoe",
        {
            "num_local_experts": 8,
            "num_experts_per_tok": 3,
            "attention_bias": False,
            "tie_word_embeddings": False,
        },
        LENGTHS,
    ),
    "granitemoeshared-no-shared-mlp": (
        "granitemoeshared",
        {"shared_intermediate_size": 0},
        LENGTHS,
    ),
    "granitemoeshared-top1-mqa-bias": (
        "granitemoeshared",
        {"num_experts_per_tok": 1, "num_key_value_heads": 1, "attention_bias": True},
        LENGTHS,
    ),
    "granitemoe-mqa-linear": (
        "granitemoe",
        {"num_key_value_heads": 1, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
        LENGTHS,
    ),
    # regression: whole heads
    "granitemoeshared-partial_rotary_factor": ("granitemoeshared", _HALF, LENGTHS),
    # DeepSeek-V2: HF's router ignores the groups under greedy, norm_topk_prob always, and
    # moe_layer_freq; latent attention shapes
    "deepseek_v2-greedy-groups-normalization-ignored": (
        "deepseek_v2",
        {"topk_method": "greedy", "n_group": 4, "topk_group": 1, "norm_topk_prob": True},
        LENGTHS,
    ),
    "deepseek_v2-q_lora-group-per-expert-top1": (
        "deepseek_v2",
        {"q_lora_rank": 16, "n_group": 8, "topk_group": 1, "num_experts_per_tok": 1},
        LENGTHS,
    ),
    "deepseek_v2-dense-2-scaling-1-moe_layer_freq-ignored": (
        "deepseek_v2",
        {"first_k_dense_replace": 2, "routed_scaling_factor": 1.0, "moe_layer_freq": 2},
        LENGTHS,
    ),
    "deepseek_v2-wide-rope-wide-v-yarn-mscale": (
        "deepseek_v2",
        {
            "qk_nope_head_dim": 8,
            "qk_rope_head_dim": 16,
            "v_head_dim": 24,
            "kv_lora_rank": 16,
            "rope_scaling": {**_YARN, "mscale": 1.0, "mscale_all_dim": 0.707},
        },
        LENGTHS,
    ),
    # regression: whole (rope) heads, DeepSeek-V3 too
    "deepseek_v2-partial_rotary_factor": (
        "deepseek_v2",
        {**_HALF, "rope_scaling": None},
        LENGTHS,
    ),
    "deepseek_v3-partial_rotary_factor": (
        "deepseek_v3",
        {**_HALF, "rope_scaling": None},
        LENGTHS,
    ),
    # GLM-4.5 MoE: grouped sigmoid routing, shared experts, dense layers, attention options
    "glm4_moe-4-groups-keep-1-top1": (
        "glm4_moe",
        {"n_group": 4, "topk_group": 1, "num_experts_per_tok": 1},
        LENGTHS,
    ),
    "glm4_moe-all-moe-unnormalized-1-shared": (
        "glm4_moe",
        {
            "first_k_dense_replace": 0,
            "norm_topk_prob": False,
            "routed_scaling_factor": 1.0,
            "n_shared_experts": 1,
        },
        LENGTHS,
    ),
    "glm4_moe-dense-2-yarn": (
        "glm4_moe",
        {"first_k_dense_replace": 2, "rope_scaling": _YARN},
        LENGTHS,
    ),
    "glm4_moe-no-qk-norm-no-bias-full-rotary": (
        "glm4_moe",
        {"use_qk_norm": False, "attention_bias": False, "partial_rotary_factor": 1.0},
        LENGTHS,
    ),
    "glm4_moe-mqa-head_dim-16-linear-quarter-rotary": (
        "glm4_moe",
        {
            "num_key_value_heads": 1,
            "head_dim": 16,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0},
            "partial_rotary_factor": 0.25,
        },
        LENGTHS,
    ),
    # ERNIE 4.5 MoE: sparse-layer placement, shared experts
    "ernie4_5_moe-no-shared-top1-interval-2": (
        "ernie4_5_moe",
        {
            "moe_num_shared_experts": 0,
            "moe_k": 1,
            "moe_layer_start_index": 0,
            "moe_layer_interval": 2,
        },
        LENGTHS,
    ),
    "ernie4_5_moe-end-index-no-bias-untied": (
        "ernie4_5_moe",
        {"moe_layer_end_index": 1, "use_bias": False, "tie_word_embeddings": False},
        LENGTHS,
    ),
    "ernie4_5_moe-2-shared-mqa-yarn": (
        "ernie4_5_moe",
        {"moe_num_shared_experts": 2, "num_key_value_heads": 1, "rope_scaling": _YARN},
        LENGTHS,
    ),
    # regression: the top-2 of 8 softmax weights sum below 0.9: divided by 0.9, not their sum
    "ernie4_5_moe-moe_norm_min": ("ernie4_5_moe", {"moe_norm_min": 0.9}, LENGTHS),
    # regression: whole heads
    "ernie4_5_moe-partial_rotary_factor": ("ernie4_5_moe", _HALF, LENGTHS),
    # HunYuan-MoE
    "hunyuan_v1_moe-top1-plain-rope": (
        "hunyuan_v1_moe",
        {"moe_topk": 1, "rope_parameters": _PLAIN_ROPE},
        LENGTHS,
    ),
    "hunyuan_v1_moe-bias-mqa-head_dim-8": (
        "hunyuan_v1_moe",
        {"attention_bias": True, "num_key_value_heads": 1, "head_dim": 8},
        LENGTHS,
    ),
    "hunyuan_v1_moe-4-experts-per-layer-topk": (
        "hunyuan_v1_moe",
        {"num_experts": 4, "moe_topk": [3, 1]},
        LENGTHS,
    ),
    # regression: whole heads under the alpha rope (once refused)
    "hunyuan_v1_moe-alpha-partial_rotary_factor": ("hunyuan_v1_moe", _HALF, LENGTHS),
    # PhiMoE, DBRX
    "phimoe-8-experts-no-biases-window": (
        "phimoe",
        {
            "num_local_experts": 8,
            "attention_bias": False,
            "lm_head_bias": False,
            "sliding_window": 8,
        },
        LENGTHS,
    ),
    "phimoe-jitter-0.01-mqa": (
        "phimoe",
        {"router_jitter_noise": 0.01, "num_key_value_heads": 1},
        LENGTHS,
    ),
    "phimoe-partial_rotary_factor": ("phimoe", _HALF, LENGTHS),  # regression: whole heads
    "dbrx-top1-unnormalized-mqa": (
        "dbrx",
        {
            "attn_config": {"kv_n_heads": 1, "clip_qkv": 8.0, "rope_theta": 10000.0},
            "rope_parameters": _PLAIN_ROPE,
            "ffn_config": {
                "ffn_hidden_size": 32,
                "moe_num_experts": 4,
                "moe_top_k": 1,
                "moe_normalize_expert_weights": None,
            },
        },
        LENGTHS,
    ),
    "dbrx-top3-p2-norm": (
        "dbrx",
        {
            "ffn_config": {
                "ffn_hidden_size": 32,
                "moe_num_experts": 8,
                "moe_top_k": 3,
                "moe_normalize_expert_weights": 2.0,
            }
        },
        LENGTHS,
    ),
    # Jamba: layer periods, Mamba (v1) shapes
    "jamba-attn-period-2-all-moe-top1": (
        "jamba",
        {
            "attn_layer_period": 2,
            "attn_layer_offset": 0,
            "expert_layer_period": 1,
            "expert_layer_offset": 0,
            "num_experts_per_tok": 1,
        },
        HYBRID,
    ),
    "jamba-mamba-shapes-auto-dt-rank": (
        "jamba",
        {
            "mamba_d_state": 8,
            "mamba_d_conv": 2,
            "mamba_expand": 1,
            "mamba_dt_rank": "auto",
            "mamba_conv_bias": False,
            "mamba_proj_bias": True,
        },
        HYBRID,
    ),
    # Mamba2 hybrids: attention placement, groups, state, chunks, rope
    "bamba-attn-0-3-one-group-chunk-8": (
        "bamba",
        {
            "attn_layer_indices": [0, 3],
            "mamba_n_groups": 1,
            "mamba_d_state": 8,
            "mamba_chunk_size": 8,
            "mamba_d_conv": 2,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        },
        HYBRID,
    ),
    "bamba-expand-1-4-heads-mqa-tied-yarn": (
        "bamba",
        {
            "mamba_expand": 1,
            "mamba_n_heads": 4,
            "mamba_d_head": 16,
            "num_key_value_heads": 1,
            "tie_word_embeddings": True,
            "rope_scaling": _YARN,
        },
        HYBRID,
    ),
    "bamba-biases-dt-limit": (
        "bamba",
        {
            "attention_bias": True,
            "mlp_bias": True,
            "time_step_limit": (0.0, 0.9),
            "mamba_proj_bias": True,
            "mamba_conv_bias": False,
        },
        HYBRID,
    ),
    "falcon_h1-rms-norm-after-gate": (
        "falcon_h1",
        {"mamba_rms_norm": True, "mamba_norm_before_gate": False},
        HYBRID,
    ),
    "falcon_h1-d_ssm-none-expand-1-chunk-8-yarn": (
        "falcon_h1",
        {
            "mamba_d_ssm": None,
            "mamba_expand": 1,
            "mamba_n_heads": 4,
            "mamba_d_head": 16,
            "mamba_chunk_size": 8,
            "rope_scaling": _YARN,
        },
        HYBRID,
    ),
    "falcon_h1-mqa-head_dim-16-biases": (
        "falcon_h1",
        {
            "num_key_value_heads": 1,
            "head_dim": 16,
            "attention_bias": True,
            "mlp_bias": True,
            "projectors_bias": True,
        },
        HYBRID,
    ),
    "falcon_h1-partial_rotary_factor": ("falcon_h1", _HALF, HYBRID),  # regression: whole heads
    "granitemoehybrid-dense-rope-yarn": (
        "granitemoehybrid",
        {"num_local_experts": 0, "position_embedding_type": "rope", "rope_scaling": _YARN},
        HYBRID,
    ),
    "granitemoehybrid-top1-attention-heavy-mqa": (
        "granitemoehybrid",
        {
            "num_experts_per_tok": 1,
            "layer_types": ["attention", "mamba", "attention", "attention"],
            "num_key_value_heads": 1,
            "attention_bias": True,
        },
        HYBRID,
    ),
    "granitemoehybrid-one-group-state-8-chunk-8": (
        "granitemoehybrid",
        {"mamba_n_groups": 1, "mamba_d_state": 8, "mamba_chunk_size": 8, "mamba_d_conv": 2},
        HYBRID,
    ),
    # regression: whole heads
    "granitemoehybrid-partial_rotary_factor": (
        "granitemoehybrid",
        {**_HALF, "position_embedding_type": "rope"},
        HYBRID,
    ),
    "nemotron_h-one-group-state-8-chunk-8-conv-2": (
        "nemotron_h",
        {"n_groups": 1, "ssm_state_size": 8, "chunk_size": 8, "conv_kernel": 2},
        HYBRID,
    ),
    "nemotron_h-moe-groups-latent-shared": (
        "nemotron_h",
        {
            "layers_block_type": ["mamba", "moe", "attention", "mamba", "moe"],
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "n_group": 4,
            "topk_group": 2,
            "moe_intermediate_size": 16,
            "n_shared_experts": 1,
            "moe_shared_expert_intermediate_size": 48,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
            "moe_latent_size": 16,
        },
        HYBRID,
    ),
    "nemotron_h-moe-no-shared-unnormalized-top1": (
        "nemotron_h",
        {
            "layers_block_type": ["mamba", "moe", "attention", "mamba", "moe"],
            "n_routed_experts": 4,
            "num_experts_per_tok": 1,
            "n_group": 1,
            "topk_group": 1,
            "moe_intermediate_size": 16,
            "n_shared_experts": 0,
            "norm_topk_prob": False,
        },
        HYBRID,
    ),
    "nemotron_h-head_dim-32-mqa-biases-proj-bias": (
        "nemotron_h",
        {
            "head_dim": 32,
            "num_key_value_heads": 1,
            "attention_bias": True,
            "mlp_bias": True,
            "use_bias": True,
            "use_conv_bias": False,
        },
        HYBRID,
    ),
    "zamba2-one-block-no-adapter-no-rope": (
        "zamba2",
        {"num_mem_blocks": 1, "use_shared_attention_adapter": False, "use_mem_rope": False},
        HYBRID,
    ),
    "zamba2-silu-one-group-chunk-8-conv-2-long-context": (
        "zamba2",
        {
            "hidden_act": "silu",
            "mamba_ngroups": 1,
            "chunk_size": 8,
            "mamba_d_conv": 2,
            "use_long_context": True,
        },
        HYBRID,
    ),
    # regression: whole heads
    "zamba2-partial_rotary_factor": (
        "zamba2",
        {
            **_HALF,
            "num_hidden_layers": 2,
            "layers_block_type": ["mamba", "hybrid"],
            "num_mem_blocks": 1,
        },
        HYBRID,
    ),
    # Qwen3-Next: gated delta net heads without GVA, a narrow conv
    "qwen3_next-no-gva-conv-2": (
        "qwen3_next",
        {
            "linear_num_value_heads": 2,
            "linear_key_head_dim": 8,
            "linear_value_head_dim": 32,
            "linear_conv_kernel_dim": 2,
            "num_experts_per_tok": 1,
            "norm_topk_prob": False,
        },
        HYBRID,
    ),
    "qwen3_next-sparse_step-2-bias-full-rotary": (
        "qwen3_next",
        {
            "decoder_sparse_step": 2,
            "mlp_only_layers": [],
            "attention_bias": True,
            "partial_rotary_factor": 1.0,
        },
        HYBRID,
    ),
    "qwen3_next-yarn-half-rotary-mqa": (
        "qwen3_next",
        {"rope_scaling": _YARN, "partial_rotary_factor": 0.5, "num_key_value_heads": 1},
        HYBRID,
    ),
    # LFM2 / LFM2-MoE: short convs
    "lfm2-no-auto-adjust-conv-bias-L-2": (
        "lfm2",
        {"block_auto_adjust_ff_dim": False, "conv_bias": True, "conv_L_cache": 2},
        HYBRID,
    ),
    "lfm2-ffn-multiplier-mqa-attention-heavy-untied-linear": (
        "lfm2",
        {
            "block_ffn_dim_multiplier": 1.5,
            "num_key_value_heads": 1,
            "layer_types": ["full_attention", "conv", "full_attention", "full_attention"],
            "tie_word_embeddings": False,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        },
        HYBRID,
    ),
    "lfm2-partial_rotary_factor": ("lfm2", _HALF, HYBRID),  # regression: whole heads
    "lfm2_moe-no-expert-bias-unnormalized-top1": (
        "lfm2_moe",
        {"use_expert_bias": False, "norm_topk_prob": False, "num_experts_per_tok": 1},
        HYBRID,
    ),
    "lfm2_moe-no-dense-top3-L-4-conv-bias": (
        "lfm2_moe",
        {"num_dense_layers": 0, "num_experts_per_tok": 3, "conv_L_cache": 4, "conv_bias": True},
        HYBRID,
    ),
    "lfm2_moe-dense-2-scaling-1-yarn": (
        "lfm2_moe",
        {"num_dense_layers": 2, "routed_scaling_factor": 1.0, "rope_scaling": _YARN},
        HYBRID,
    ),
    "lfm2_moe-partial_rotary_factor": ("lfm2_moe", _HALF, HYBRID),  # regression: whole heads
    # Mamba / Mamba2
    "mamba-auto-dt-rank-state-8-conv-2-biases": (
        "mamba",
        {
            "time_step_rank": "auto",
            "state_size": 8,
            "conv_kernel": 2,
            "use_bias": True,
            "use_conv_bias": False,
        },
        HYBRID,
    ),
    "mamba-expand-1-untied-fp32-residual-off": (
        "mamba",
        {"expand": 1, "tie_word_embeddings": False, "residual_in_fp32": False},
        HYBRID,
    ),
    "mamba2-expand-1-head-8-state-32-groups-8": (
        "mamba2",
        {"expand": 1, "num_heads": 8, "head_dim": 8, "state_size": 32, "n_groups": 8},
        HYBRID,
    ),
    "mamba2-one-group-chunk-8-biases": (
        "mamba2",
        {"n_groups": 1, "chunk_size": 8, "use_bias": True, "use_conv_bias": False},
        HYBRID,
    ),
}

# variants run again with chunked prefill and prefix caching
CHUNKED = [
    "olmoe-top1-normalized",
    "ernie4_5_moe-moe_norm_min",
    "glm4_moe-4-groups-keep-1-top1",
    "jamba-attn-period-2-all-moe-top1",
    "qwen3_next-no-gva-conv-2",
    "nemotron_h-one-group-state-8-chunk-8-conv-2",
    "deepseek_v2-q_lora-group-per-expert-top1",
    "bamba-attn-0-3-one-group-chunk-8",
    "falcon_h1-d_ssm-none-expand-1-chunk-8-yarn",
    "granitemoehybrid-one-group-state-8-chunk-8",
    "lfm2_moe-no-dense-top3-L-4-conv-bias",
    "zamba2-silu-one-group-chunk-8-conv-2-long-context",
    "mamba2-one-group-chunk-8-biases",
]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """case -> (checkpoint, prompts, HF's greedy references), made once for both tests."""
    cache: dict[str, tuple[Path, list, list]] = {}

    def refs(case: str) -> tuple[Path, list, list]:
        if case not in cache:
            arch, overrides, lengths = CASES[case]
            path = write_tiny_model(tmp_path_factory.mktemp("variant"), arch, seed=1, **overrides)
            cache[case] = (path, *hf_refs(path, lengths))
        return cache[case]

    return refs


@pytest.mark.parametrize("case", list(CASES))
def test_moe_hybrid_config_variant_matches_hf(case, references):
    path, prompts, refs = references(case)
    serve_and_compare(case, path, prompts, refs)


@pytest.mark.parametrize("case", CHUNKED)
def test_moe_hybrid_config_variant_chunked_prefill_and_prefix_cache(case, references):
    path, prompts, refs = references(case)
    serve_and_compare(case, path, prompts, refs, passes=2, **CHUNKED_PREFIX_CACHE)


# id -> (tiny arch, overrides HF builds, config.json edits after saving, what the error names)
REFUSED: dict[str, tuple[str, dict[str, Any], dict[str, Any], str]] = {
    # regression: transformers' OLMoE q norm spans hidden_size (it cannot run this)
    "olmoe-head_dim-apart-from-hidden": ("olmoe", {"head_dim": 8}, {}, "head_dim=8"),
    # regression: transformers turns whole heads by default and fails under a scaled rope
    "falcon_h1-partial-with-linear-rope": (
        "falcon_h1",
        {**_HALF, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
        {},
        "partial_rotary_factor=0.5 with a 'linear' rope scaling",
    ),
    "deepseek_v2-partial-with-yarn": (
        "deepseek_v2",
        {**_HALF, "rope_scaling": _YARN},
        {},
        "partial_rotary_factor=0.5 with a 'yarn' rope scaling",
    ),
    # PhiMoE's SparseMixer routes to two experts
    "phimoe-top1": ("phimoe", {}, {"num_experts_per_tok": 1}, "num_experts_per_tok=1"),
    "nemotron_h-silu-mlp": (
        "nemotron_h",
        {},
        {"mlp_hidden_act": "silu"},
        "mlp_hidden_act='relu2' only, got 'silu'",
    ),
    "jamba-gelu": ("jamba", {}, {"hidden_act": "gelu"}, "hidden_act='silu' only, got 'gelu'"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unservable_moe_hybrid_config_is_refused_by_name(case, tmp_path):
    assert_refused(tmp_path, *REFUSED[case])
