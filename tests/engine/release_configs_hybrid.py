"""config.json of hybrid (attention beside Mamba / short-conv / linear-attention layers),
state-space and more MoE releases as their authors published them (every field that reaches the
math, odd ones included), and `shrink_hybrid`, which makes a tiny model of one by changing only
size fields: widths, layers (a prefix of the release's layer pattern that shows each layer kind),
heads, SSM heads / state / chunk, experts, vocab. The companion of release_configs.py (whose
`shrink` does the attention-only fields here)."""

from __future__ import annotations

import copy
from typing import Any

from release_configs import HEAD_DIM, TINY_VOCAB, _remap_token_ids, shrink

INF = float("inf")


def _pattern(n: int, marks: dict[int, str], default: str) -> list[str]:
    """n layer kinds: `default`, `marks` (index -> kind) excepted."""
    return [marks.get(i, default) for i in range(n)]


_JAMBA = {
    "architectures": ["JambaForCausalLM"],
    "attention_dropout": 0.0,
    "attn_layer_offset": 4,
    "attn_layer_period": 8,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "expert_layer_offset": 1,
    "expert_layer_period": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "mamba_conv_bias": True,
    "mamba_d_conv": 4,
    "mamba_d_state": 16,
    "mamba_dt_rank": 256,
    "mamba_expand": 2,
    "mamba_proj_bias": False,
    "max_position_embeddings": 262144,
    "model_type": "jamba",
    "num_attention_heads": 32,
    "num_experts": 16,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_logits_to_keep": 1,
    "output_router_logits": False,
    "pad_token_id": 0,
    "rms_norm_eps": 1e-06,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.40.0.dev0",
    "use_cache": True,
    "use_mamba_kernels": True,
    "vocab_size": 65536,
}

_FALCON_H1 = {
    "architectures": ["FalconH1ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_layer_indices": None,
    "bos_token_id": 1,
    "eos_token_id": 11,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "mamba_chunk_size": 128,
    "mamba_conv_bias": True,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_n_groups": 1,
    "mamba_norm_before_gate": False,
    "mamba_proj_bias": False,
    "mamba_use_mlp": True,
    "mlp_bias": False,
    "mlp_expansion_factor": 8,
    "model_type": "falcon_h1",
    "num_logits_to_keep": 1,
    "pad_token_id": 0,
    "projectors_bias": False,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.52.0.dev0",
    "use_cache": True,
}

_NEMOTRON_H = {
    "architectures": ["NemotronHForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attention_head_dim": 128,
    "bos_token_id": 1,
    "chunk_size": 128,
    "conv_kernel": 4,
    "expand": 2,
    "hidden_dropout": 0.0,
    "initializer_range": 0.02,
    "layer_norm_epsilon": 1e-05,
    "mamba_hidden_act": "silu",
    "mamba_num_heads": 128,
    "mamba_proj_bias": False,
    "mlp_bias": False,
    "mlp_hidden_act": "relu2",
    "model_type": "nemotron_h",
    "n_groups": 8,
    "num_key_value_heads": 8,
    "num_logits_to_keep": 1,
    "pad_token_id": 0,
    "rescale_prenorm_residual": True,
    "residual_in_fp32": False,
    "rms_norm_eps": 1e-05,
    "sliding_window": None,
    "ssm_state_size": 128,
    "tie_word_embeddings": False,
    "time_step_floor": 0.0001,
    "time_step_limit": [0.0, INF],
    "time_step_max": 0.1,
    "time_step_min": 0.001,
    "time_step_rank": 256,
    "torch_dtype": "bfloat16",
    "use_bias": False,
    "use_cache": True,
    "use_conv_bias": True,
    "use_mamba_kernels": True,
    "vocab_size": 131072,
}

_GRANITE4 = {
    "architectures": ["GraniteMoeHybridForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 100257,
    "embedding_multiplier": 12,
    "eos_token_id": 100257,
    "hidden_act": "silu",
    "init_method": "mup",
    "initializer_range": 0.1,
    "logits_scaling": 6,
    "mamba_chunk_size": 256,
    "mamba_conv_bias": True,
    "mamba_d_conv": 4,
    "mamba_d_head": 64,
    "mamba_d_state": 128,
    "mamba_expand": 2,
    "mamba_n_groups": 1,
    "mamba_proj_bias": False,
    "max_position_embeddings": 131072,
    "model_type": "granitemoehybrid",
    "normalization_function": "rmsnorm",
    "num_hidden_layers": 40,
    "output_router_logits": False,
    "pad_token_id": 100256,
    "residual_multiplier": 0.22,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "router_aux_loss_coef": 0.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.56.0",
    "use_cache": True,
    "vocab_size": 100352,
}

_LFM2 = {
    "bos_token_id": 1,
    "conv_L_cache": 3,
    "conv_bias": False,
    "eos_token_id": 7,
    "initializer_range": 0.02,
    "max_position_embeddings": 128000,
    "norm_eps": 1e-05,
    "num_key_value_heads": 8,
    "pad_token_id": 0,
    "rope_theta": 1000000.0,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 65536,
}

_QWEN3_MOE_2507 = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 262144,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 10000000,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

_DEEPSEEK_V3_ARCH = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "bos_token_id": 163584,
    "eos_token_id": 163585,
    "ep_size": 1,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "kv_lora_rank": 512,
    "model_type": "deepseek_v3",
    "moe_layer_freq": 1,
    "n_group": 1,
    "norm_topk_prob": True,
    "num_nextn_predict_layers": 0,
    "pretraining_tp": 1,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-05,
    "rope_theta": 50000.0,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 163840,
}

# name -> the release's config.json (per-layer lists written out by `_pattern`; the first few
# entries of per-dimension rope lists, as release_configs.py keeps them)
HYBRID_RELEASES: dict[str, dict[str, Any]] = {
    "jamba-v0.1": _JAMBA,
    "ai21-jamba-mini-1.7": {**_JAMBA, "transformers_version": "4.48.1"},
    "falcon-h1-0.5b-instruct": {
        **_FALCON_H1,
        "attention_in_multiplier": 1.0,
        "attention_out_multiplier": 0.9375,
        "embedding_multiplier": 5.656854249492381,
        "head_dim": 64,
        "hidden_size": 1024,
        "intermediate_size": 2048,
        "key_multiplier": 0.39062499999999994,
        "lm_head_multiplier": 0.0390625,
        "mamba_d_head": 64,
        "mamba_d_ssm": 1536,
        "mamba_d_state": 128,
        "mamba_n_heads": 24,
        "mamba_rms_norm": False,
        "max_position_embeddings": 16384,
        "mlp_multipliers": [0.8838834764831844, 0.5859375],
        "num_attention_heads": 8,
        "num_hidden_layers": 36,
        "num_key_value_heads": 2,
        "rope_theta": 100000000000.0,
        "ssm_in_multiplier": 1.25,
        "ssm_multipliers": [
            0.3535533905932738,
            0.25,
            0.3535533905932738,
            0.5,
            0.3535533905932738,
        ],
        "ssm_out_multiplier": 0.23570226039551587,
        "vocab_size": 32784,
    },
    "falcon-h1-1.5b-deep-instruct": {
        **_FALCON_H1,
        "attention_in_multiplier": 1.0,
        "attention_out_multiplier": 0.5,
        "embedding_multiplier": 7.0,
        "head_dim": 128,
        "hidden_size": 1280,
        "intermediate_size": 3072,
        "key_multiplier": 0.5,
        "lm_head_multiplier": 0.01953125,
        "mamba_d_head": 64,
        "mamba_d_ssm": 3072,
        "mamba_d_state": 256,
        "mamba_n_heads": 48,
        "mamba_rms_norm": True,
        "max_position_embeddings": 131072,
        "mlp_multipliers": [0.5, 0.25],
        "num_attention_heads": 6,
        "num_hidden_layers": 66,
        "num_key_value_heads": 2,
        "rope_theta": 100000000000.0,
        "ssm_in_multiplier": 1.0,
        "ssm_multipliers": [0.5, 0.25, 0.3535533905932738, 0.5, 0.3535533905932738],
        "ssm_out_multiplier": 0.3535533905932738,
        "vocab_size": 65537,
    },
    "nemotron-h-8b-base-8k": {
        **_NEMOTRON_H,
        "eos_token_id": 2,
        "hidden_size": 4096,
        "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
        "intermediate_size": 21504,
        "mamba_head_dim": 64,
        "max_position_embeddings": 8192,
        "num_attention_heads": 32,
        "num_hidden_layers": 52,
        "transformers_version": "4.48.0.dev0",
    },
    "nvidia-nemotron-nano-9b-v2": {
        **_NEMOTRON_H,
        "eos_token_id": 12,
        "hidden_size": 4480,
        "hybrid_override_pattern": "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-",
        "intermediate_size": 15680,
        "mamba_head_dim": 80,
        "max_position_embeddings": 131072,
        "num_attention_heads": 40,
        "num_hidden_layers": 56,
        "transformers_version": "4.55.0",
    },
    "nvidia-nemotron-3-nano-30b-a3b": {
        **_NEMOTRON_H,
        "eos_token_id": 2,
        "head_dim": 128,
        "hidden_size": 2688,
        "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
        "intermediate_size": 1856,
        "mamba_head_dim": 64,
        "mamba_num_heads": 64,
        "max_position_embeddings": 262144,
        "moe_intermediate_size": 1856,
        "moe_shared_expert_intermediate_size": 3712,
        "n_group": 1,
        "n_routed_experts": 128,
        "n_shared_experts": 1,
        "norm_eps": 1e-05,
        "norm_topk_prob": True,
        "num_attention_heads": 32,
        "num_experts_per_tok": 6,
        "num_hidden_layers": 52,
        "num_key_value_heads": 2,
        "partial_rotary_factor": 1.0,
        "rope_theta": 10000,
        "routed_scaling_factor": 2.5,
        "topk_group": 1,
        "transformers_version": "4.57.1",
    },
    "granite-4.0-h-tiny": {
        **_GRANITE4,
        "attention_multiplier": 0.0078125,
        "hidden_size": 1536,
        "intermediate_size": 512,
        "layer_types": _pattern(40, dict.fromkeys((5, 15, 25, 35), "attention"), "mamba"),
        "mamba_n_heads": 48,
        "num_attention_heads": 12,
        "num_experts_per_tok": 6,
        "num_key_value_heads": 4,
        "num_local_experts": 64,
        "position_embedding_type": "nope",
        "rope_theta": 10000,
        "shared_intermediate_size": 1024,
    },
    "granite-4.0-h-micro": {
        **_GRANITE4,
        "attention_multiplier": 0.0078125,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "layer_types": _pattern(40, dict.fromkeys((10, 13, 26, 36), "attention"), "mamba"),
        "mamba_n_heads": 64,
        "num_attention_heads": 32,
        "num_experts_per_tok": 0,
        "num_key_value_heads": 8,
        "num_local_experts": 0,
        "position_embedding_type": "nope",
        "rope_theta": 10000,
        "shared_intermediate_size": 8192,
    },
    "granite-4.0-micro": {
        **_GRANITE4,
        "attention_multiplier": 0.015625,
        "embedding_multiplier": 12,
        "hidden_size": 2560,
        "intermediate_size": 8192,
        "layer_types": ["attention"] * 40,
        "logits_scaling": 10,
        "mamba_n_heads": 128,
        "num_attention_heads": 40,
        "num_experts_per_tok": 0,
        "num_key_value_heads": 8,
        "num_local_experts": 0,
        "position_embedding_type": "rope",
        "rope_theta": 10000000,
        "shared_intermediate_size": 8192,
    },
    "bamba-9b": {
        "architectures": ["BambaForCausalLM"],
        "attention_dropout": 0.0,
        "attn_layer_indices": [9, 18, 27],
        "attn_rotary_emb": 64,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "mamba_chunk_size": 256,
        "mamba_conv_bias": True,
        "mamba_d_conv": 4,
        "mamba_d_head": 64,
        "mamba_d_state": 128,
        "mamba_dt_rank": 256,
        "mamba_expand": 2,
        "mamba_n_groups": 1,
        "mamba_n_heads": 128,
        "mamba_proj_bias": False,
        "max_position_embeddings": 262144,
        "model_type": "bamba",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "num_logits_to_keep": 1,
        "pad_token_id": 0,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.45.0",
        "use_cache": True,
        "use_mamba_kernels": True,
        "vocab_size": 128256,
    },
    "zamba2-1.2b": {
        "adapter_rank": 128,
        "add_bias_linear": False,
        "architectures": ["Zamba2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "chunk_size": 256,
        "eos_token_id": 2,
        "ffn_hidden_size": 8192,
        "hidden_act": "gelu",
        "hidden_size": 2048,
        "hybrid_layer_ids": [6, 12, 18, 24, 30, 36],
        "initializer_range": 0.02,
        "intermediate_size": 8192,
        "kv_channels": 128,
        "layers_block_type": _pattern(38, dict.fromkeys(range(6, 38, 6), "hybrid"), "mamba"),
        "mamba_d_conv": 4,
        "mamba_d_state": 128,
        "mamba_expand": 2,
        "mamba_headdim": 64,
        "mamba_ngroups": 1,
        "max_position_embeddings": 4096,
        "model_type": "zamba2",
        "n_mamba_heads": 64,
        "num_attention_heads": 32,
        "num_hidden_layers": 38,
        "num_key_value_heads": 32,
        "num_logits_to_keep": 1,
        "num_mem_blocks": 1,
        "num_query_groups": 32,
        "pad_token_id": 0,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000,
        "time_step_floor": 0.0001,
        "time_step_limit": None,
        "time_step_max": 0.1,
        "time_step_min": 0.001,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.48.0.dev0",
        "use_cache": True,
        "use_conv_bias": True,
        "use_long_context": False,
        "use_mem_rope": True,
        "use_shared_attention_adapter": False,
        "use_shared_mlp_adapter": True,
        "vocab_size": 32000,
    },
    "lfm2-1.2b": {
        **_LFM2,
        "architectures": ["Lfm2ForCausalLM"],
        "block_auto_adjust_ff_dim": True,
        "block_dim": 2048,
        "block_ff_dim": 12288,
        "block_ffn_dim_multiplier": 1.0,
        "block_mlp_init_scale": 1.0,
        "block_multiple_of": 256,
        "block_norm_eps": 1e-05,
        "block_out_init_scale": 1.0,
        "block_use_swiglu": True,
        "block_use_xavier_init": True,
        "conv_dim": 2048,
        "conv_dim_out": 2048,
        "conv_use_xavier_init": True,
        "hidden_size": 2048,
        "intermediate_size": 12288,
        "layer_types": _pattern(16, dict.fromkeys((2, 5, 8, 10, 12, 14), "full_attention"), "conv"),
        "model_type": "lfm2",
        "num_attention_heads": 32,
        "num_heads": 32,
        "num_hidden_layers": 16,
        "transformers_version": "4.54.0.dev0",
        "use_pos_enc": True,
    },
    "lfm2-8b-a1b": {
        **_LFM2,
        "architectures": ["Lfm2MoeForCausalLM"],
        "hidden_size": 2048,
        "intermediate_size": 7168,
        "layer_types": _pattern(
            24, dict.fromkeys((2, 6, 10, 14, 18, 21), "full_attention"), "conv"
        ),
        "model_type": "lfm2_moe",
        "moe_intermediate_size": 1792,
        "norm_topk_prob": True,
        "num_attention_heads": 32,
        "num_dense_layers": 2,
        "num_experts": 32,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 24,
        "routed_scaling_factor": 1.0,
        "transformers_version": "4.57.0.dev0",
        "use_expert_bias": True,
    },
    "mamba-codestral-7b-v0.1": {
        "architectures": ["Mamba2ForCausalLM"],
        "bos_token_id": 0,
        "chunk_size": 256,
        "conv_kernel": 4,
        "eos_token_id": 0,
        "expand": 2,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.1,
        "layer_norm_epsilon": 1e-05,
        "model_type": "mamba2",
        "n_groups": 8,
        "norm_before_gate": True,
        "num_heads": 128,
        "num_hidden_layers": 64,
        "pad_token_id": 0,
        "rescale_prenorm_residual": False,
        "residual_in_fp32": True,
        "rms_norm": True,
        "state_size": 128,
        "tie_word_embeddings": False,
        "time_step_floor": 0.0001,
        "time_step_limit": [0.0, INF],
        "time_step_max": 0.1,
        "time_step_min": 0.001,
        "time_step_rank": 256,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.44.0.dev0",
        "use_bias": False,
        "use_cache": True,
        "use_conv_bias": True,
        "vocab_size": 32768,
    },
    "falcon-mamba-7b": {
        "architectures": ["FalconMambaForCausalLM"],
        "bos_token_id": 0,
        "conv_kernel": 4,
        "eos_token_id": 11,
        "expand": 2,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.1,
        "intermediate_size": 8192,
        "layer_norm_epsilon": 1e-05,
        "mixer_rms_eps": 1e-06,
        "model_type": "falcon_mamba",
        "num_hidden_layers": 64,
        "pad_token_id": 11,
        "rescale_prenorm_residual": False,
        "residual_in_fp32": True,
        "state_size": 16,
        "tie_word_embeddings": False,
        "time_step_floor": 0.0001,
        "time_step_init_scheme": "random",
        "time_step_max": 0.1,
        "time_step_min": 0.001,
        "time_step_rank": 256,
        "time_step_scale": 1.0,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.43.0.dev0",
        "use_bias": False,
        "use_cache": True,
        "use_conv_bias": True,
        "use_mambapy": False,
        "vocab_size": 65024,
    },
    "mamba-130m-hf": {
        "architectures": ["MambaForCausalLM"],
        "bos_token_id": 0,
        "conv_kernel": 4,
        "d_inner": 1536,
        "d_model": 768,
        "eos_token_id": 0,
        "expand": 2,
        "fused_add_norm": True,
        "hidden_act": "silu",
        "hidden_size": 768,
        "initializer_range": 0.1,
        "intermediate_size": 1536,
        "layer_norm_epsilon": 1e-05,
        "model_type": "mamba",
        "n_layer": 24,
        "num_hidden_layers": 24,
        "pad_token_id": 0,
        "pad_vocab_size_multiple": 8,
        "rescale_prenorm_residual": False,
        "residual_in_fp32": True,
        "rms_norm": True,
        "ssm_cfg": {},
        "state_size": 16,
        "time_step_floor": 0.0001,
        "time_step_init_scheme": "random",
        "time_step_max": 0.1,
        "time_step_min": 0.001,
        "time_step_rank": 48,
        "time_step_scale": 1.0,
        "torch_dtype": "float32",
        "transformers_version": "4.39.0.dev0",
        "use_bias": False,
        "use_cache": True,
        "use_conv_bias": True,
        "vocab_size": 50280,
    },
    "qwen3-30b-a3b-instruct-2507": {**_QWEN3_MOE_2507, "transformers_version": "4.51.0"},
    "qwen3-coder-30b-a3b-instruct": {
        **_QWEN3_MOE_2507,
        "qkv_bias": False,
        "shared_expert_intermediate_size": 0,
        "transformers_version": "4.51.3",
    },
    "llama-4-scout-17b-16e-instruct-text": {
        "architectures": ["Llama4ForCausalLM"],
        "attention_bias": False,
        "attention_chunk_size": 8192,
        "attention_dropout": 0.0,
        "attn_scale": 0.1,
        "attn_temperature_tuning": True,
        "bos_token_id": 200000,
        "eos_token_id": [200001, 200007, 200008],
        "floor_scale": 8192,
        "for_llm_compressor": False,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 5120,
        "initializer_range": 0.02,
        "interleave_moe_layer_step": 1,
        "intermediate_size": 8192,
        "intermediate_size_mlp": 16384,
        "max_position_embeddings": 10485760,
        "model_type": "llama4_text",
        "moe_layers": list(range(48)),
        "no_rope_layers": [0 if i % 4 == 3 else 1 for i in range(48)],
        "num_attention_heads": 40,
        "num_experts_per_tok": 1,
        "num_hidden_layers": 48,
        "num_key_value_heads": 8,
        "num_local_experts": 16,
        "output_router_logits": False,
        "pad_token_id": 200018,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": 16.0,
            "high_freq_factor": 1.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "router_aux_loss_coef": 0.001,
        "router_jitter_noise": 0.0,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_qk_norm": True,
        "vocab_size": 202048,
    },
    "olmoe-1b-7b-0924": {
        "architectures": ["OlmoeForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "clip_qkv": None,
        "eos_token_id": 50279,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 1024,
        "max_position_embeddings": 4096,
        "model_type": "olmoe",
        "norm_topk_prob": False,
        "num_attention_heads": 16,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 16,
        "num_key_value_heads": 16,
        "output_router_logits": False,
        "pad_token_id": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "router_aux_loss_coef": 0.01,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.43.0.dev0",
        "use_cache": True,
        "vocab_size": 50304,
    },
    "phi-3.5-moe-instruct": {
        "architectures": ["PhiMoEForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "auto_map": {
            "AutoConfig": "configuration_phimoe.PhiMoEConfig",
            "AutoModelForCausalLM": "modeling_phimoe.PhiMoEForCausalLM",
        },
        "bos_token_id": 1,
        "eos_token_id": 32000,
        "hidden_act": "silu",
        "hidden_dropout": 0.0,
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "input_jitter_noise": 0.01,
        "intermediate_size": 6400,
        "lm_head_bias": True,
        "max_position_embeddings": 131072,
        "model_type": "phimoe",
        "num_attention_heads": 32,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 16,
        "original_max_position_embeddings": 4096,
        "output_router_logits": False,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "long_factor": [
                1.0199999809265137,
                1.0299999713897705,
                1.0399999618530273,
                1.0499999523162842,
                1.0499999523162842,
                1.0499999523162842,
                1.059999942779541,
                1.0800000429153442,
            ],
            "long_mscale": 1.243163121016122,
            "original_max_position_embeddings": 4096,
            "short_factor": [
                1.0,
                1.0399999618530273,
                1.0399999618530273,
                1.0399999618530273,
                1.0499999523162842,
                1.0499999523162842,
                1.0499999523162842,
                1.0499999523162842,
            ],
            "short_mscale": 1.243163121016122,
            "type": "longrope",
        },
        "rope_theta": 10000.0,
        "router_aux_loss_coef": 0.0,
        "router_jitter_noise": 0.01,
        "sliding_window": 131072,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.43.3",
        "use_cache": True,
        "vocab_size": 32064,
    },
    "moonlight-16b-a3b-instruct": {
        **_DEEPSEEK_V3_ARCH,
        "hidden_size": 2048,
        "intermediate_size": 11264,
        "max_position_embeddings": 8192,
        "moe_intermediate_size": 1408,
        "n_routed_experts": 64,
        "n_shared_experts": 2,
        "num_attention_heads": 16,
        "num_experts_per_tok": 6,
        "num_hidden_layers": 27,
        "num_key_value_heads": 16,
        "q_lora_rank": None,
        "rope_scaling": None,
        "routed_scaling_factor": 2.446,
        "transformers_version": "4.48.2",
    },
    "kimi-k2-instruct": {
        **_DEEPSEEK_V3_ARCH,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "max_position_embeddings": 131072,
        "moe_intermediate_size": 2048,
        "n_routed_experts": 384,
        "n_shared_experts": 1,
        "num_attention_heads": 64,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 61,
        "num_key_value_heads": 64,
        "q_lora_rank": 1536,
        "rope_scaling": {
            "beta_fast": 1.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
        "routed_scaling_factor": 2.827,
        "transformers_version": "4.48.3",
    },
    "minimax-m2": {
        "architectures": ["MiniMaxM2ForCausalLM"],
        "attn_type_list": [1] * 62,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 3072,
        "intermediate_size": 1536,
        "max_position_embeddings": 196608,
        "model_type": "minimax_m2",
        "mtp_transformer_layers": 1,
        "num_attention_heads": 48,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 62,
        "num_key_value_heads": 8,
        "num_local_experts": 256,
        "num_mtp_modules": 3,
        "output_router_logits": False,
        "qk_norm_type": "per_layer",
        "rms_norm_eps": 1e-06,
        "rope_theta": 5000000,
        "rotary_dim": 64,
        "router_aux_loss_coef": 0.001,
        "router_jitter_noise": 0.0,
        "scoring_func": "sigmoid",
        "shared_intermediate_size": 0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.46.1",
        "use_cache": True,
        "use_mtp": True,
        "use_qk_norm": True,
        "use_routing_bias": True,
        "vocab_size": 200064,
    },
    "kimi-linear-48b-a3b-instruct": {
        "architectures": ["KimiLinearForCausalLM"],
        "bos_token_id": 163584,
        "dtype": "bfloat16",
        "eos_token_id": 163586,
        "first_k_dense_replace": 1,
        "head_dim": 72,
        "hidden_act": "silu",
        "hidden_size": 2304,
        "initializer_range": 0.02,
        "intermediate_size": 9216,
        "kv_lora_rank": 512,
        "linear_attn_config": {
            "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
            "head_dim": 128,
            "kda_layers": [i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)],
            "num_heads": 32,
            "short_conv_kernel_size": 4,
        },
        "mla_use_nope": True,
        "model_max_length": 1048576,
        "model_type": "kimi_linear",
        "moe_intermediate_size": 1024,
        "moe_layer_freq": 1,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "num_attention_heads": 32,
        "num_expert_group": 1,
        "num_experts": 256,
        "num_experts_per_token": 8,
        "num_hidden_layers": 27,
        "num_key_value_heads": 32,
        "num_nextn_predict_layers": 0,
        "num_shared_experts": 1,
        "pad_token_id": 163839,
        "q_lora_rank": None,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "routed_scaling_factor": 2.446,
        "tie_word_embeddings": False,
        "topk_group": 1,
        "transformers_version": "4.56.2",
        "use_cache": True,
        "use_grouped_topk": True,
        "v_head_dim": 128,
        "vocab_size": 163840,
    },
    "gpt-oss-120b": {
        "architectures": ["GptOssForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "eos_token_id": 200002,
        "experts_per_token": 4,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 2880,
        "initial_context_length": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 2880,
        "layer_types": ["sliding_attention", "full_attention"] * 18,
        "max_position_embeddings": 131072,
        "model_type": "gpt_oss",
        "num_attention_heads": 64,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 36,
        "num_key_value_heads": 8,
        "num_local_experts": 128,
        "output_router_logits": False,
        "pad_token_id": 199999,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "rope_type": "yarn",
            "truncate": False,
        },
        "rope_theta": 150000,
        "router_aux_loss_coef": 0.9,
        "sliding_window": 128,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.55.0.dev0",
        "use_cache": True,
        "vocab_size": 201088,
    },
    "dbrx-instruct": {
        "architectures": ["DbrxForCausalLM"],
        "attn_config": {
            "clip_qkv": 8,
            "kv_n_heads": 8,
            "model_type": "",
            "rope_theta": 500000,
        },
        "d_model": 6144,
        "emb_pdrop": 0.0,
        "ffn_config": {
            "ffn_hidden_size": 10752,
            "model_type": "",
            "moe_jitter_eps": 0,
            "moe_loss_weight": 0.05,
            "moe_num_experts": 16,
            "moe_top_k": 4,
        },
        "initializer_range": 0.02,
        "max_seq_len": 32768,
        "model_type": "dbrx",
        "n_heads": 48,
        "n_layers": 40,
        "output_router_logits": False,
        "resid_pdrop": 0.0,
        "router_aux_loss_coef": 0.05,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.38.2",
        "use_cache": True,
        "vocab_size": 100352,
    },
}

SSM_STATE = 16  # tiny Mamba state (the releases': 16-256)
SSM_CHUNK = 16  # below the longer prompts, so the chunked scan runs over several chunks
SSM_HEADS = 8


def shrink_hybrid(c: dict[str, Any]) -> dict[str, Any]:
    """`c` with only its size fields made tiny: release_configs.shrink's attention fields, then
    each family's own (SSM heads / head size / state / chunk / dt rank, layer patterns cut to
    the prefix that shows every layer kind, nested or renamed widths)."""
    kind = c["model_type"]
    if kind in _OWN:
        return _OWN[kind](copy.deepcopy(c))
    tiny = shrink(c)
    fix = _AFTER.get(kind)
    if fix is not None:
        fix(c, tiny)
    return tiny


def _layers(tiny: dict[str, Any], n: int, *keys: str) -> None:
    """n layers, the per-layer lists `keys` cut to them."""
    tiny["num_hidden_layers"] = n
    for key in keys:
        tiny[key] = tiny[key][:n]


def _mamba2(tiny: dict[str, Any], heads: str, head: str, expand: float = 2) -> None:
    """SSM_HEADS heads whose width together is `expand` x hidden (as each release's is)."""
    tiny[heads] = SSM_HEADS
    tiny[head] = int(expand * tiny["hidden_size"]) // SSM_HEADS


def _dt_rank(hidden: int) -> int:
    return -(-hidden // 16)  # mamba's "auto"


def _jamba(full: dict[str, Any], tiny: dict[str, Any]) -> None:
    # through the first attention layer (an expert layer before it)
    tiny["num_hidden_layers"] = full["attn_layer_offset"] + 1
    tiny["mamba_dt_rank"] = _dt_rank(tiny["hidden_size"])


def _falcon_h1(full: dict[str, Any], tiny: dict[str, Any]) -> None:
    # d_ssm: heads x head size, narrower than expand x hidden in the releases
    tiny["mamba_n_heads"], tiny["mamba_d_head"] = 4, HEAD_DIM
    tiny["mamba_d_ssm"] = 4 * HEAD_DIM
    tiny["mamba_d_state"], tiny["mamba_chunk_size"] = SSM_STATE, SSM_CHUNK


def _nemotron_h(full: dict[str, Any], tiny: dict[str, Any]) -> None:
    pattern = full["hybrid_override_pattern"]
    n = max(pattern.index(k) for k in set(pattern)) + 1
    tiny["hybrid_override_pattern"] = pattern[:n]
    tiny["num_hidden_layers"] = n
    if "head_dim" in full:  # heads of their own width (16 x 16 for Nemotron 3's 32 / 2 GQA)
        tiny["hidden_size"] = 64
    _mamba2(tiny, "mamba_num_heads", "mamba_head_dim", full["expand"])
    tiny["ssm_state_size"], tiny["chunk_size"] = SSM_STATE, SSM_CHUNK
    tiny["time_step_rank"] = _dt_rank(tiny["hidden_size"])
    if full.get("moe_shared_expert_intermediate_size"):  # Nemotron 3's MoE layers ("E")
        tiny["moe_shared_expert_intermediate_size"] = 64


def _granite4(full: dict[str, Any], tiny: dict[str, Any]) -> None:
    _mamba2(tiny, "mamba_n_heads", "mamba_d_head", full["mamba_expand"])
    tiny["mamba_d_state"], tiny["mamba_chunk_size"] = SSM_STATE, SSM_CHUNK
    same = full["shared_intermediate_size"] == full["intermediate_size"]
    tiny["shared_intermediate_size"] = 128 if same else 64


def _bamba(full: dict[str, Any], tiny: dict[str, Any]) -> None:
    tiny["num_hidden_layers"], tiny["attn_layer_indices"] = 3, [1]
    # the release's rotary share of the head (64 of 128)
    tiny["attn_rotary_emb"] = HEAD_DIM * full["attn_rotary_emb"] // 128
    _mamba2(tiny, "mamba_n_heads", "mamba_d_head", full["mamba_expand"])
    tiny["mamba_d_state"], tiny["mamba_chunk_size"] = SSM_STATE, SSM_CHUNK
    tiny["mamba_dt_rank"] = _dt_rank(tiny["hidden_size"])


def _zamba2(full: dict[str, Any], tiny: dict[str, Any]) -> None:
    first = full["hybrid_layer_ids"][0]
    _layers(tiny, first + 1, "layers_block_type")
    tiny["hybrid_layer_ids"] = [first]
    heads = tiny["num_attention_heads"]
    tiny["num_query_groups"] = tiny["num_key_value_heads"]
    tiny["kv_channels"] = 2 * tiny["hidden_size"] // heads  # attention reads [x, embeddings]
    tiny["ffn_hidden_size"] = tiny["intermediate_size"]
    tiny["adapter_rank"] = 8
    _mamba2(tiny, "n_mamba_heads", "mamba_headdim", full["mamba_expand"])
    tiny["mamba_d_state"], tiny["chunk_size"] = SSM_STATE, SSM_CHUNK


def _lfm2(full: dict[str, Any], tiny: dict[str, Any]) -> None:
    if full.get("num_dense_layers"):  # a conv layer past the dense ones, beside its experts
        kinds = full["layer_types"]
        n = max(kinds.index("full_attention"), full["num_dense_layers"] + 1) + 1
        _layers(tiny, n, "layer_types")
        tiny["layer_types"] = full["layer_types"][:n]
    for key in ("block_dim", "conv_dim", "conv_dim_out"):
        if key in tiny:
            tiny[key] = tiny["hidden_size"]
    if "block_ff_dim" in tiny:
        tiny["block_ff_dim"] = tiny["intermediate_size"]
    if "num_heads" in tiny:
        tiny["num_heads"] = tiny["num_attention_heads"]


def _llama4(full: dict[str, Any], tiny: dict[str, Any]) -> None:
    n = full["no_rope_layers"].index(0) + 1  # through the first NoPE (global) layer
    tiny["num_hidden_layers"] = n
    tiny["no_rope_layers"] = full["no_rope_layers"][:n]
    tiny["moe_layers"] = [i for i in full["moe_layers"] if i < n]
    tiny["intermediate_size_mlp"] = 2 * tiny["intermediate_size"]
    # positions: the local-attention chunk and the attention-temperature floor, as the window
    tiny["attention_chunk_size"] = tiny["floor_scale"] = 8


def _minimax_m2(full: dict[str, Any], tiny: dict[str, Any]) -> None:
    tiny["attn_type_list"] = full["attn_type_list"][: tiny["num_hidden_layers"]]
    tiny["rotary_dim"] = HEAD_DIM * full["rotary_dim"] // full["head_dim"]


def _kimi_linear(full: dict[str, Any], tiny: dict[str, Any]) -> None:
    lin = full["linear_attn_config"]
    n = min(lin["full_attn_layers"])  # 1-based: through the first full-attention layer
    tiny["num_hidden_layers"] = n
    tiny["num_experts"] = 16
    tiny["linear_attn_config"] = {
        **lin,
        "full_attn_layers": [i for i in lin["full_attn_layers"] if i <= n],
        "kda_layers": [i for i in lin["kda_layers"] if i <= n],
        "head_dim": HEAD_DIM,
        "num_heads": tiny["num_attention_heads"],
    }


def _own_mamba(c: dict[str, Any]) -> dict[str, Any]:
    """Mamba (v1), Falcon-Mamba, Mamba2: no attention fields."""
    hidden = 64
    for key in ("hidden_size", "d_model"):
        if key in c:
            c[key] = hidden
    for key in ("num_hidden_layers", "n_layer"):
        if key in c:
            c[key] = 2
    for key in ("intermediate_size", "d_inner"):
        if key in c:
            c[key] = int(c["expand"] * hidden)
    if "num_heads" in c:  # mamba2
        _mamba2(c, "num_heads", "head_dim", c["expand"])
        c["chunk_size"] = SSM_CHUNK
    c["state_size"] = min(c["state_size"], SSM_STATE)
    c["time_step_rank"] = _dt_rank(hidden)
    c["vocab_size"] = TINY_VOCAB
    _remap_token_ids(c)
    return c


def _own_dbrx(c: dict[str, Any]) -> dict[str, Any]:
    heads, kv = c["n_heads"], c["attn_config"]["kv_n_heads"]
    c["attn_config"]["kv_n_heads"] = 1
    c["n_heads"] = heads // kv
    c["d_model"] = c["n_heads"] * HEAD_DIM
    c["n_layers"] = 2
    ffn = c["ffn_config"]
    ffn["ffn_hidden_size"] = 32
    ffn["moe_num_experts"] = max(8, 2 * ffn["moe_top_k"])
    c["vocab_size"] = TINY_VOCAB
    _remap_token_ids(c)
    return c


_AFTER = {
    "jamba": _jamba,
    "falcon_h1": _falcon_h1,
    "nemotron_h": _nemotron_h,
    "granitemoehybrid": _granite4,
    "bamba": _bamba,
    "zamba2": _zamba2,
    "lfm2": _lfm2,
    "lfm2_moe": _lfm2,
    "llama4_text": _llama4,
    "minimax_m2": _minimax_m2,
    "kimi_linear": _kimi_linear,
}
_OWN = {"mamba": _own_mamba, "falcon_mamba": _own_mamba, "mamba2": _own_mamba, "dbrx": _own_dbrx}


def release_hybrid(name: str) -> dict[str, Any]:
    """The release config.json of `name` (a copy)."""
    return copy.deepcopy(HYBRID_RELEASES[name])
