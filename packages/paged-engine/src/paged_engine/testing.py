"""Tiny HF-format models for tests and benchmarks.

`write_tiny_model(path, arch)` writes config.json, model.safetensors (weights of the HF
transformers class itself, so names and layouts are exactly HF's), a byte-level BPE tokenizer
trained in code (tokenizer.json + tokenizer_config.json with a chat template) and
generation_config.json. Everything is deterministic given `seed`.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch

SUPPORTED_TINY_ARCHS = ["llama", "mistral", "qwen2", "qwen3", "opt", "gpt2", "gpt_neox"]
# Architectures added later: tested against HF in their own test files, kept out of the
# suite-wide parametrizations over SUPPORTED_TINY_ARCHS (TP/PP parity, async, speculation).
MORE_TINY_ARCHS: list[str] = [
    "qwen3_moe",
    "mixtral",
    "gemma2",
    "gemma3",
    "phi3",
    "gemma",
    "granite",
    "olmo2",
    "qwen2_moe",
    "gpt_oss",
    "smollm3",
    "olmo3",
    "ministral3",
    "glm4_moe",
    "deepseek_v3",
    "deepseek_v2",
    "minicpm3",
    "jais2",
    "flex_olmo",
    "minicpm5_moe",
    "hy_v3",
    "granite_swa",
    "hyperclovax",
    "afmoe",
    "beam",
    "ergo",
    "dory",
    "bitnet",
    "laguna",
    "mellum",
    "exaone",
    "cwm",
    "lfm3",
    "cohere2_moe",
    "solar_open",
    "glm4_moe_lite",
    "mistral4",
    "youtu",
    "axk1",
    "deepseek_v32",
    "glm_moe_dsa",
    "hy_v4",
    "axk2",
    "granitemoe",
    "granitemoeshared",
    "granitemoe_swa",
    "ernie4_5",
    "ernie4_5_moe",
    "seed_oss",
    "starcoder2",
    "stablelm",
    "phi",
    "persimmon",
    "jetmoe",
    "glm4",
    "cohere",
    "cohere2",
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen4_exp",
    "granitemoehybrid",
    "nemotron_h",
    "lfm2",
    "lfm2_moe",
    "inkling",
    "falcon_h1",
    "zaya",
    "mamba",
    "falcon_mamba",
    "mamba2",
    "jamba",
    "kimi_linear",
    "bailing_hybrid",
    "olmo_hybrid",
    "bamba",
    "zamba2",
    "zamba",
    "exaone4",
    "apertus",
    "apertus1p5",
    "arcee",
    "olmoe",
    "minimax",
    "minimax_m2",
    "hunyuan_v1_dense",
    "hunyuan_v1_moe",
    "dots1",
    "gpt_bigcode",
    "falcon",
    "gptj",
    "codegen",
    "biogpt",
    "xglm",
    "bloom",
    "mpt",
    "gpt_neo",
    "olmo",
    "glm",
    "helium",
    "ministral",
    "vaultgemma",
    "phimoe",
    "nanochat",
    "gemma4",
    "gemma4_moe",
    "gemma4_unified",
    "gemma3n",
    "llama4",
    "nemotron",
    "dbrx",
    "internlm3",
    "exaone_moe",
    "kolibri1",
    "kolibri1_1",
    "flint",
    "lara_mini",
    "mimo_v2_flash",
    "longcat_flash",
    "deepseek_v4",
    "recurrent_gemma",
]

TINY_VOCAB_SIZE = 512
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_COMMON = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
_LLAMA_LIKE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
}
_HYBRID_LIKE = {
    **_LLAMA_LIKE,
    "num_hidden_layers": 4,
    "head_dim": 16,
    "layer_types": ["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "partial_rotary_factor": 0.25,
    "tie_word_embeddings": False,
}
# DeepSeek-V3's layout, tiny: MLA with a q bottleneck (latent 32 + rope 8), a dense layer, then
# MoE layers of 8 routed experts in 4 groups (2 kept), 2 chosen, and a shared expert
# GLM-4.5's MoE as the tiny models run it: 8 routed experts in 4 groups (2 kept, 3 chosen),
# 2 shared experts
_GLM_EXPERTS = {
    "n_routed_experts": 8,
    "n_shared_experts": 2,
    "moe_intermediate_size": 16,
    "num_experts_per_tok": 3,
    "n_group": 4,
    "topk_group": 2,
    "routed_scaling_factor": 2.5,
}
_MLA_LIKE = {  # multi-head latent attention's shape (DeepSeek-V2's attention)
    "num_hidden_layers": 3,
    "num_key_value_heads": 4,
    "max_position_embeddings": 256,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
}
# YaRN x4 over a 64-token original context with DeepSeek's softmax mscale (mscale_all_dim)
_MLA_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10_000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.707,
}
_DEEPSEEK_LIKE = {
    **_MLA_LIKE,
    "first_k_dense_replace": 1,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "moe_intermediate_size": 32,
    "num_experts_per_tok": 2,
    "n_group": 4,
    "topk_group": 2,
}
_GPTJ_LIKE = {  # GPT-J's sizes, CodeGen's too (its decoder is GPT-J's)
    "n_embd": 64,
    "n_layer": 2,
    "n_head": 4,
    "rotary_dim": 8,
    "n_inner": 128,
    "n_positions": 1024,
    "tie_word_embeddings": False,
}
_ARCH_DEFAULTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {**_LLAMA_LIKE, "tie_word_embeddings": False}),
    "mistral": (
        "MistralConfig",
        {**_LLAMA_LIKE, "sliding_window": 32, "tie_word_embeddings": False},
    ),
    "qwen2": ("Qwen2Config", {**_LLAMA_LIKE, "tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {**_LLAMA_LIKE, "head_dim": 32, "tie_word_embeddings": True}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {
            **_LLAMA_LIKE,
            "head_dim": 32,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "tie_word_embeddings": False,
        },
    ),
    "mixtral": (
        "MixtralConfig",
        {
            **_LLAMA_LIKE,
            "intermediate_size": 32,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "tie_word_embeddings": False,
        },
    ),
    # Gemma / Phi-3: both layer kinds (sliding window 8 < the test prompts), caps that bite
    "gemma2": (
        "Gemma2Config",
        {
            **_LLAMA_LIKE,
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": 8,
            "attn_logit_softcapping": 10.0,
            "final_logit_softcapping": 30.0,
            "tie_word_embeddings": True,
        },
    ),
    "gemma3": (
        "Gemma3TextConfig",
        {
            **_LLAMA_LIKE,
            "num_hidden_layers": 3,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
            "head_dim": 32,
            "query_pre_attn_scalar": 32,
            "sliding_window": 8,
            "rope_theta": 1_000_000.0,
            "rope_local_base_freq": 10_000.0,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
            "tie_word_embeddings": True,
        },
    ),
    "phi3": (
        "Phi3Config",
        {
            **_LLAMA_LIKE,
            "original_max_position_embeddings": 1024,
            "partial_rotary_factor": 0.75,
            "sliding_window": 16,
            "tie_word_embeddings": False,
        },
    ),
    "gemma": (
        "GemmaConfig",
        {**_LLAMA_LIKE, "head_dim": 32, "tie_word_embeddings": True},
    ),
    # Granite: every multiplier away from 1 (attention_multiplier is the whole attention scale)
    "granite": (
        "GraniteConfig",
        {
            **_LLAMA_LIKE,
            "embedding_multiplier": 6.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.5,  # not head_dim^-0.5 (0.25 here): a dropped one shows
            "logits_scaling": 2.5,
            "tie_word_embeddings": True,
        },
    ),
    # GraniteSWA: Granite's scalars, per-head sinks, a window of 8 (shorter than the test
    # prompts) on 3 of 4 layers, per-layer rope bases with a NoPE layer
    "granite_swa": (
        "GraniteSWAConfig",
        {
            **_LLAMA_LIKE,
            "num_hidden_layers": 4,
            "embedding_multiplier": 6.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.5,
            "logits_scaling": 2.5,
            "sliding_window": 8,
            "layer_types": [
                "full_attention",
                "sliding_attention",
                "sliding_attention",
                "sliding_attention",
            ],
            "layer_rope_theta": [0, 10000.0, 500.0, 10000.0],
            "tie_word_embeddings": True,
        },
    ),
    # HyperCLOVA X: Granite's scalars with the logits multiplied (0.4: divided they would be
    # 2.5x), an attention scale that is neither 1 nor head_dim^-0.5, head_dim 32 (not 64 / 4),
    # Peri-LN post norms, q / k / v / o and MLP biases
    "hyperclovax": (
        "HyperCLOVAXConfig",
        {
            **_LLAMA_LIKE,
            "head_dim": 32,
            "embedding_multiplier": 6.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.3,
            "logits_scaling": 0.4,
            "attention_bias": True,
            "mlp_bias": True,
            "use_post_norm": True,
            "tie_word_embeddings": False,
        },
    ),
    # Arcee AFMoE: sandwich norms, gated attention with q / k norms, windows (8) on rotating
    # layers and NoPE global ones (every 2nd), a dense layer, then sigmoid top-3 of 8 experts
    # with a shared one, route_scale 2.5, muP's embedding scale
    "afmoe": (
        "AfmoeConfig",
        {
            **_LLAMA_LIKE,
            "num_hidden_layers": 4,
            "head_dim": 16,
            "num_dense_layers": 1,
            "num_experts": 8,
            "num_experts_per_tok": 3,
            "num_shared_experts": 1,
            "moe_intermediate_size": 16,
            "route_scale": 2.5,
            "global_attn_every_n_layers": 2,
            "sliding_window": 8,
            "mup_enabled": True,
            "tie_word_embeddings": False,
        },
    ),
    # Reflection Beam: AFMoE's sandwich layers with depth-scaled residual adds; sliding layers
    # (window 8) rotating with their own base beside NoPE full ones with the scalable-softmax
    # query scale; output gates with a bias per head; a dense layer, then sigmoid top-3 of 8
    # experts in 4 groups (2 kept) scaled by 2.5, no shared expert; logits soft-capped at 3
    "beam": (
        "BeamConfig",
        {
            **_LLAMA_LIKE,
            "num_hidden_layers": 4,
            "head_dim": 16,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
            "sliding_window": 8,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0},
                "full_attention": None,
            },
            "num_experts": 8,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 16,
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 2.5,
            "final_logit_softcapping": 3.0,
            "tie_word_embeddings": False,
        },
    ),
    # Amazon Ergo: sandwich layers with learned residual gates; fused qkv, interleaved rope on
    # the sliding layers (window 8), NoPE full ones (every 2nd) with logits times 1.5; a relu^2
    # dense layer, then sigmoid top-3 of 8 relu^2 experts scaled by 2.5, each expert's output
    # and the shared expert's RMS-normalized
    "ergo": (
        "ErgoConfig",
        {
            **_LLAMA_LIKE,
            "num_hidden_layers": 4,
            "first_dense_intermediate_size": 128,
            "num_dense_blocks": 1,
            "num_experts": 8,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 16,
            "shared_intermediate_size": 32,
            "moe_routed_scaling_factor": 2.5,
            "sliding_window": 8,
            "global_attention_every_n_layers": 2,
            "global_attention_scale": 1.5,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
    # NVIDIA Dory: a looped nGPT; 1 input layer, 2 recurrent layers run 3 times (one cache a
    # loop), 2 output layers; sliding (window 8) and full layers in each section, their own
    # rope bases; initializer_range 1 keeps the nGPT scales (s / initializer_range) near 1
    "dory": (
        "DoryConfig",
        {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 5,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "max_position_embeddings": 1024,
            "layer_types": [
                "sliding_attention",
                "full_attention",
                "sliding_attention",
                "sliding_attention",
                "full_attention",
            ],
            "sliding_window": 8,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            },
            "n_input_layers": 1,
            "n_recurrent_layers": 2,
            "n_output_layers": 2,
            "n_recurrent_loops": 3,
            "initializer_range": 1.0,
            "ngpt_alpha_init": 0.3,
            "tie_word_embeddings": False,
        },
    ),
    # Microsoft BitNet b1.58: Llama with RMSNorms before o_proj and down_proj, squared ReLU
    # (the released checkpoints' ternary quantization: a quantization_config the tests add)
    "bitnet": (
        "BitNetConfig",
        {**_LLAMA_LIKE, "hidden_act": "relu2", "tie_word_embeddings": False},
    ),
    # Poolside Laguna: query heads per layer (4, 8, 6, 4 over 2 KV heads), full layers rotating
    # half of each head, sliding ones (window 8) all of it with another base, softplus gates
    # per head; dense / sparse layers interleaved, sigmoid top-3 of 8 experts with soft-capped
    # logits and a shared expert of its own width, scaled by 2.5
    "laguna": (
        "LagunaConfig",
        {
            **_LLAMA_LIKE,
            "num_hidden_layers": 4,
            "head_dim": 16,
            "max_position_embeddings": 256,
            "num_attention_heads_per_layer": [4, 8, 6, 4],
            "layer_types": [
                "full_attention",
                "sliding_attention",
                "sliding_attention",
                "full_attention",
            ],
            "sliding_window": 8,
            "rope_parameters": {
                "full_attention": {
                    "rope_type": "default",
                    "rope_theta": 10000.0,
                    "partial_rotary_factor": 0.5,
                },
                "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
            },
            "mlp_layer_types": ["dense", "sparse", "dense", "sparse"],
            "num_experts": 8,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 24,
            "moe_routed_scaling_factor": 2.5,
            "moe_router_logit_softcapping": 1.0,
            "tie_word_embeddings": False,
        },
    ),
    # JetBrains Mellum 2: Qwen3-MoE's layers in Laguna's stack: sliding (window 8) and full
    # layers with their own rope bases, a dense layer, then softmax top-3 of 8 experts
    "mellum": (
        "MellumConfig",
        {
            **_LLAMA_LIKE,
            "num_hidden_layers": 4,
            "head_dim": 16,
            "max_position_embeddings": 256,
            "layer_types": [
                "sliding_attention",
                "full_attention",
                "sliding_attention",
                "full_attention",
            ],
            "sliding_window": 8,
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
            },
            "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
            "num_experts": 8,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 16,
            "tie_word_embeddings": False,
        },
    ),
    # EXAONE 3.x: transformers' Llama under the model_type "exaone" (its checkpoints' names)
    "exaone": ("ExaoneConfig", {**_LLAMA_LIKE, "tie_word_embeddings": False}),
    # Meta CWM: Llama with a window of 8 on 3 of 4 layers
    "cwm": (
        "CwmConfig",
        {
            **_LLAMA_LIKE,
            "num_hidden_layers": 4,
            "sliding_window": 8,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "tie_word_embeddings": False,
        },
    ),
    "olmo2": ("Olmo2Config", {**_LLAMA_LIKE, "tie_word_embeddings": False}),
    # Qwen2-MoE: a dense layer (mlp_only_layers) before a sparse one with a shared expert
    # Hybrids (models/qwen3_next.py): linear, linear, full, linear layers; GVA (4 value heads on
    # 2 key heads), conv width 4, partial rope (1/4 of head_dim 16)
    "qwen3_next": (
        "Qwen3NextConfig",
        {
            **_HYBRID_LIKE,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [1],
        },
    ),
    "qwen3_5": ("Qwen3_5TextConfig", _HYBRID_LIKE),
    # Kimi Linear: KDA, KDA, MLA (NoPE: the rope part of the keys is shared but never rotated),
    # KDA, given as Moonshot's config gives them (linear_attn_config, 1-based layer numbers); a
    # dense first layer, then DeepSeek-V3 MoE layers (8 experts in 4 groups, 2 kept, 2 chosen,
    # a shared expert), under Moonshot's names (num_experts, num_expert_group, ...)
    # Mamba: 3 mixer layers of 128 channels (expand 2), state 16, conv 4 with bias, dt rank 8
    # ("auto" is hidden / 16 = 4: set apart from N), float32 residuals, tied embeddings
    "mamba": (
        "MambaConfig",
        {
            "hidden_size": 64,
            "num_hidden_layers": 3,
            "state_size": 16,
            "expand": 2,
            "conv_kernel": 4,
            "time_step_rank": 8,
            "layer_norm_epsilon": 1e-5,
        },
    ),
    # Falcon Mamba: Mamba's mixer with dt, B and C normalized (no weights), state 12, untied
    "falcon_mamba": (
        "FalconMambaConfig",
        {
            "hidden_size": 64,
            "num_hidden_layers": 3,
            "state_size": 12,
            "expand": 2,
            "conv_kernel": 3,
            "mixer_rms_eps": 1e-6,
            "tie_word_embeddings": False,
        },
    ),
    # Mamba2 (pure): 8 heads of 16 on 2 groups, state 16, a dt clamp that bites in prefill scans
    "mamba2": (
        "Mamba2Config",
        {
            "hidden_size": 64,
            "num_hidden_layers": 3,
            "num_heads": 8,
            "head_dim": 16,
            "n_groups": 2,
            "state_size": 16,
            "expand": 2,
            "conv_kernel": 4,
            "chunk_size": 16,
            "time_step_limit": (0.0, 0.9),
        },
    ),
    "kimi_linear": (
        "KimiLinearConfig",
        {
            **_LLAMA_LIKE,
            "num_hidden_layers": 4,
            "num_key_value_heads": 4,
            "max_position_embeddings": 256,
            "linear_attn_config": {
                "kda_layers": [1, 2, 4],
                "full_attn_layers": [3],
                "num_heads": 4,
                "head_dim": 16,
                "short_conv_kernel_size": 4,
            },
            "q_lora_rank": None,
            "kv_lora_rank": 32,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 16,
            "first_k_dense_replace": 1,
            "num_experts": 8,
            "num_shared_experts": 1,
            "moe_intermediate_size": 32,
            "num_experts_per_token": 2,
            "num_expert_group": 4,
            "topk_group": 2,
            "moe_renormalize": True,
            "routed_scaling_factor": 2.5,
            "tie_word_embeddings": False,
        },
    ),
    # Ling / Ring 2.5: KDA (one-matrix forget gate bounded below at -3, one-matrix output gate),
    # MLA with rope (q without LoRA) and a sigmoid gate per head, KDA / MLA alternating; a dense
    # layer, then MoE (2 groups, 1 kept) whose experts clip silu(gate) and up after the
    # activation, per layer (0: off) and apart for the shared expert
    "bailing_hybrid": (
        "BailingHybridConfig",
        {
            **_LLAMA_LIKE,
            "num_hidden_layers": 4,
            "num_key_value_heads": 4,
            "max_position_embeddings": 256,
            "head_dim": 16,
            "short_conv_kernel_size": 4,
            "layer_group_size": 2,
            "kda_lower_bound": -3.0,
            "q_lora_rank": None,
            "kv_lora_rank": 32,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 16,
            "rope_theta": 10000.0,
            "first_k_dense_replace": 1,
            "num_experts": 8,
            "num_shared_experts": 1,
            "moe_intermediate_size": 32,
            "num_experts_per_token": 2,
            "num_expert_group": 2,
            "topk_group": 1,
            "moe_renormalize": True,
            "routed_scaling_factor": 2.5,
            "expert_swiglu_limit_list": [0, 0.5, 0, 1.0],
            "share_expert_swiglu_limit_list": [0, 0, 0.5, 1.0],
            "tie_word_embeddings": False,
        },
    ),
    # OLMo Hybrid: Gated DeltaNet, GDN, OLMo 3 attention (GQA, rope), GDN; GVA (4 value heads of
    # 32 on 2 key heads of 16), beta doubled; rms_norm_eps apart from the gated norm's fixed 1e-5
    "olmo_hybrid": (
        "OlmoHybridConfig",
        {
            **_LLAMA_LIKE,
            "num_hidden_layers": 4,
            "layer_types": [
                "linear_attention",
                "linear_attention",
                "full_attention",
                "linear_attention",
            ],
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 32,
            "linear_conv_kernel_dim": 4,
            "linear_allow_neg_eigval": True,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0},
            "tie_word_embeddings": False,
        },
    ),
    # Granite 4.0-H: Mamba2 layers (4 heads of 16 on 2 groups, state 16, conv 4 with bias) among
    # attention layers without rope; Granite's multipliers; MoE plus a shared MLP
    "granitemoehybrid": (
        "GraniteMoeHybridConfig",
        {
            **_LLAMA_LIKE,
            "num_hidden_layers": 4,
            "layer_types": ["mamba", "attention", "mamba", "mamba"],
            "mamba_n_heads": 8,
            "mamba_n_groups": 2,
            "mamba_d_state": 16,
            "mamba_d_head": 16,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
            "mamba_chunk_size": 16,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "intermediate_size": 32,
            "shared_intermediate_size": 48,
            "embedding_multiplier": 2.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.5,
            "logits_scaling": 2.0,
            "position_embedding_type": None,
            "tie_word_embeddings": False,
        },
    ),
    # Nemotron-H (dense): Mamba2, MLP and attention blocks (no rope), 8 heads of 16 on 2 groups
    "nemotron_h": (
        "NemotronHConfig",
        {
            **_LLAMA_LIKE,
            "num_hidden_layers": 5,
            "layers_block_type": ["mamba", "mlp", "attention", "mamba", "mlp"],
            "head_dim": 16,
            "mamba_num_heads": 8,
            "mamba_head_dim": 16,
            "n_groups": 2,
            "ssm_state_size": 16,
            "conv_kernel": 4,
            "chunk_size": 16,
            "layer_norm_epsilon": 1e-5,
            # a clamp that bites in prefill scans (softplus(dt) ~ 0.3-1.3); transformers < 5.25
            # clamps at time_step_min whatever time_step_limit says, so the two agree
            "time_step_min": 0.5,
            "time_step_limit": (0.5, float("inf")),
            "tie_word_embeddings": False,
        },
    ),
    # LFM2: short-conv layers (width 3) among attention layers with q / k norms; the MLP's
    # width auto-adjusted (2/3 of 128 rounded up to a multiple of 16: 96); tied embeddings
    "lfm2": (
        "Lfm2Config",
        {
            "hidden_size": 64,
            "intermediate_size": 128,
            "block_multiple_of": 16,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 1024,
            "layer_types": ["conv", "conv", "full_attention", "conv"],
            "conv_L_cache": 3,
            "norm_eps": 1e-5,
        },
    ),
    # LFM3: conv, sliding (window 8, shorter than the test prompts), full (proportional rope
    # over half of each head), conv; gated attention, sandwich norms
    "lfm3": (
        "Lfm3Config",
        {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "max_position_embeddings": 1024,
            "layer_types": ["conv", "sliding_attention", "full_attention", "conv"],
            "sliding_window": 8,
            "conv_L_cache": 3,
            "norm_eps": 1e-5,
        },
    ),
    # LFM2-MoE: a dense first layer, then MoE layers of 8 experts (2 chosen by sigmoid scores
    # plus an expert bias, renormalized and scaled)
    "lfm2_moe": (
        "Lfm2MoeConfig",
        {
            "hidden_size": 64,
            "intermediate_size": 96,
            "moe_intermediate_size": 32,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 1024,
            "layer_types": ["conv", "full_attention", "conv", "conv"],
            "conv_L_cache": 3,
            "norm_eps": 1e-5,
            "num_dense_layers": 1,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "routed_scaling_factor": 1.5,
        },
    ),
    # Inkling: sliding (window 8, their own head geometry) and full layers (relative bias over
    # 12 keys, log-scaled logits past position 4), a dense first layer, then MoE layers of 8
    # routed experts (2 chosen) and 2 shared ones; mup logit divisor 3, head padded past 500
    "inkling": (
        "InklingTextConfig",
        {
            **_LLAMA_LIKE,
            "num_hidden_layers": 3,
            "head_dim": 16,
            "layer_types": ["hybrid_sliding", "hybrid", "hybrid_sliding"],
            "swa_num_attention_heads": 8,
            "swa_num_key_value_heads": 2,
            "swa_head_dim": 8,
            "sliding_window_size": 8,
            "d_rel": 4,
            "rel_extent": 12,
            "log_scaling_n_floor": 4,
            "log_scaling_alpha": 0.3,
            "conv_kernel_size": 3,
            "mlp_layer_types": ["dense", "sparse", "sparse"],
            "intermediate_size": 96,
            "moe_intermediate_size": 32,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "n_shared_experts": 2,
            "route_scale": 2.5,
            "logits_mup_width_multiplier": 3.0,
            "unpadded_vocab_size": 500,
        },
    ),
    # Falcon-H1: attention (rope, heads of 24: not hidden / heads) and a Mamba2 mixer in every
    # layer, side by side; the mixer 6 heads of 16 (mamba_d_ssm 96, not expand * hidden) on 2
    # groups, no norm (y * silu(z)); every multiplier != 1
    "falcon_h1": (
        "FalconH1Config",
        {
            **_LLAMA_LIKE,
            "head_dim": 24,
            "mamba_d_ssm": 96,
            "mamba_n_heads": 6,
            "mamba_d_head": 16,
            "mamba_n_groups": 2,
            "mamba_d_state": 16,
            "mamba_d_conv": 4,
            "mamba_chunk_size": 16,
            "mamba_rms_norm": False,
            "embedding_multiplier": 1.5,
            "lm_head_multiplier": 0.75,
            "key_multiplier": 0.8,
            "attention_in_multiplier": 1.25,
            "attention_out_multiplier": 0.75,
            "ssm_in_multiplier": 1.5,
            "ssm_out_multiplier": 0.6,
            "ssm_multipliers": [0.5, 1.25, 0.8, 1.5, 0.7],
            "mlp_multipliers": [1.5, 0.5],
            "tie_word_embeddings": False,
        },
    ),
    # ZAYA1: CCA attention in every layer (convs of widths 3 then 2 over q | k, a delayed half
    # of the values: state carried per sequence), full layers (partial rope, theta 10000) and
    # sliding ones (window 8, whole-head rope, theta 500), attention biases, a router MLP over
    # 4 experts + a skip class with the previous layer's router state, an untied LM head with a
    # bias
    "zaya": (
        "ZayaConfig",
        {
            **_LLAMA_LIKE,
            "num_hidden_layers": 4,
            "head_dim": 16,
            "layer_types": ["hybrid", "hybrid_sliding", "hybrid", "hybrid_sliding"],
            "sliding_window": 8,
            "rope_parameters": {
                "hybrid": {
                    "rope_type": "default",
                    "rope_theta": 10000.0,
                    "partial_rotary_factor": 0.5,
                },
                "hybrid_sliding": {
                    "rope_type": "default",
                    "rope_theta": 500.0,
                    "partial_rotary_factor": 1.0,
                },
            },
            "cca_time0": 3,
            "cca_time1": 2,
            "attention_bias": True,
            "num_experts": 4,
            "num_experts_per_tok": 1,
            "moe_intermediate_size": 32,
            "router_hidden_size": 16,
            "lm_head_bias": True,
            "tie_word_embeddings": False,
        },
    ),
    # Bamba: Mamba2 layers (8 heads of 16 on 2 groups, state 16, conv 4 with bias) around one
    # attention layer (attn_layer_indices) with partial rope (0.5: BambaConfig fixes it); a
    # gated SiLU MLP, no multipliers
    "bamba": (
        "BambaConfig",
        {
            **_LLAMA_LIKE,
            "num_hidden_layers": 4,
            "attn_layer_indices": [1],
            "mamba_n_heads": 8,
            "mamba_n_groups": 2,
            "mamba_d_state": 16,
            "mamba_d_head": 16,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
            "mamba_chunk_size": 16,
            "tie_word_embeddings": False,
        },
    ),
    # Zamba2: six Mamba2 layers (8 heads of 16 on 2 groups, state 16, conv 4); layers 1, 3 and 5
    # are hybrid, each first running one of 2 shared transformer blocks (alternating: block 0 at
    # 1 and 5) with rank-8 adapters of its own on q / k / v and gate_up; the blocks' attention
    # reads [hidden | embeddings] (4 heads of 32, rope), a GELU MLP; tied embeddings
    "zamba2": (
        "Zamba2Config",
        {
            **_LLAMA_LIKE,
            "num_hidden_layers": 6,
            "layers_block_type": ["linear_attention", "hybrid"] * 3,
            "num_key_value_heads": 4,
            "num_mem_blocks": 2,
            "use_shared_attention_adapter": True,
            "adapter_rank": 8,
            "use_mem_rope": True,
            "n_mamba_heads": 8,
            "mamba_ngroups": 2,
            "mamba_d_state": 16,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
            "chunk_size": 16,
        },
    ),
    # RecurrentGemma (Griffin): recurrent, recurrent, local attention (window 8, shorter than the
    # test prompts; 4 heads of 12 on 2 KV heads, rope over half of each head), recurrent; an
    # RG-LRU of 96 channels (4 gate blocks of 24) after a temporal conv of width 4; soft cap 10
    "recurrent_gemma": (
        "RecurrentGemmaConfig",
        {
            **_LLAMA_LIKE,
            "hidden_size": 48,  # sqrt(48) is not a bfloat16: HF's rounded normalizer shows
            "num_hidden_layers": 4,
            "lru_width": 96,
            "attention_window_size": 8,
            "conv1d_width": 4,
            "logits_soft_cap": 10.0,
        },
    ),
    # Zamba (v1): five Mamba layers (2 heads of 64 channels, state 16, conv 4, dt rank "auto" =
    # 4); layers 2 and 4 hybrid (attn_layer_period 2 / offset 1 past HF's fixed first three),
    # each first running the one shared transformer block over [hidden | embeddings] (4 heads
    # of 32, no rope) with a GELU MLP; tied embeddings
    "zamba": (
        "ZambaConfig",
        {
            **_LLAMA_LIKE,
            "num_hidden_layers": 5,
            "attn_layer_period": 2,
            "attn_layer_offset": 1,
            "num_key_value_heads": 4,
            "n_mamba_heads": 2,
            "mamba_d_state": 16,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
            "hidden_act": "gelu",
        },
    ),
    # Jamba: Mamba (v1) layers (128 channels, state 16, conv 4 with bias, dt rank 8 apart from
    # "auto" = 4, weighted dt / B / C norms) around one attention layer (no rope) at index 1;
    # 4 experts (top 2, not renormalized) on layers 1 and 3, a gated SiLU MLP on the others
    "jamba": (
        "JambaConfig",
        {
            **_LLAMA_LIKE,
            "num_hidden_layers": 4,
            "attn_layer_period": 4,
            "attn_layer_offset": 1,
            "expert_layer_period": 2,
            "expert_layer_offset": 1,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "mamba_d_state": 16,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
            "mamba_dt_rank": 8,
            "tie_word_embeddings": False,
        },
    ),
    "qwen3_5_moe": (
        "Qwen3_5MoeTextConfig",
        {
            **_HYBRID_LIKE,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
        },
    ),
    # Qwen4-Exp (models/qwen4_exp.py): 3 residual streams; linear, linear + PLE, indexed,
    # linear + PLE layers; QSA keeps the top 2 blocks of 4 keys (the prompts have up to 10);
    # n-grams up to 3 tokens, 2 heads per order over prime tables from 61, a conv of width 3
    # dilated by 3; sigmoid-gated DeltaNet output; half of each head rotated (M-RoPE); the
    # top-2 expert weights not renormalized
    "qwen4_exp": (
        "Qwen4ExpTextConfig",
        {
            **{k: v for k, v in _HYBRID_LIKE.items() if k != "partial_rotary_factor"},
            "layer_types": [
                "linear_attention",
                "linear_attention",
                "indexed_attention",
                "linear_attention",
            ],
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
                "mrope_section": [1, 1, 2],
                "mrope_interleaved": True,
            },
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "norm_topk_prob": False,
            "hc_count": 3,
            "hc_lowrank": 16,
            "indexer_n_heads": 2,
            "indexer_kv_heads": 1,
            "indexer_head_dim": 16,
            "indexer_budget": 8,
            "indexer_compress_ratio": 4,
            "ple_layer_ids": [2, 4],
            "ple_embed_dim": 32,
            "ngram_size": 3,
            "heads_per_ngram": 2,
            "ngram_vocab_size_base": 61,
            "make_ngram_vocab_size_divisible_by": 8,
            "ple_conv_kernel_size": 3,
            "seed": 7,
            "output_gate_type": "sigmoid",
        },
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        {
            **_LLAMA_LIKE,
            "num_hidden_layers": 3,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64,
            "norm_topk_prob": False,
            "mlp_only_layers": [1],
            "tie_word_embeddings": False,
        },
    ),
    # gpt-oss: sliding (window 8 < the test prompts) and full layers, YaRN x4 over a 64-token
    # original context, a SwiGLU limit the activations reach, attention sinks
    "gpt_oss": (
        "GptOssConfig",
        {
            **_LLAMA_LIKE,
            "max_position_embeddings": 256,
            "intermediate_size": 32,
            "head_dim": 16,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_theta": 10_000.0,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 64,
            },
            "swiglu_limit": 1.0,
            "tie_word_embeddings": False,
        },
    ),
    # SmolLM3: layer 1 of 2 without rope (NoPE)
    "smollm3": (
        "SmolLM3Config",
        {**_LLAMA_LIKE, "no_rope_layer_interval": 2, "tie_word_embeddings": True},
    ),
    # DeepSeek-V4: 3 hyper-connection streams; a sliding layer (window 8), compressed-sparse
    # layers (windows of 4, the indexer keeping 2) and a heavily compressed one (windows of 8),
    # their rope YaRN x4; a hash-routed MoE layer, then top-k ones, clamped SwiGLU at 1
    "deepseek_v4": (
        "DeepseekV4Config",
        {
            **_LLAMA_LIKE,
            "num_hidden_layers": 4,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "q_lora_rank": 32,
            "partial_rotary_factor": 0.25,
            "layer_types": [
                "sliding_attention",
                "compressed_sparse_attention",
                "heavily_compressed_attention",
                "compressed_sparse_attention",
            ],
            "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
            "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "routed_scaling_factor": 1.5,
            "sliding_window": 8,
            "o_groups": 2,
            "o_lora_rank": 16,
            "index_n_heads": 8,
            "index_head_dim": 16,
            "index_topk": 2,
            "hc_mult": 3,
            "swiglu_limit": 1.0,
            "max_position_embeddings": 256,
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
            },
            "tie_word_embeddings": False,
        },
    ),
    # DeepSeek-V3: MLA with a q bottleneck, YaRN x4 with mscale_all_dim (the softmax scale), a
    # dense layer before MoE layers of 8 routed experts in 4 groups (2 chosen) and a shared one
    "deepseek_v3": (
        "DeepseekV3Config",
        {
            **_LLAMA_LIKE,
            **_DEEPSEEK_LIKE,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 0.707,
                "original_max_position_embeddings": 64,
            },
            "tie_word_embeddings": False,
        },
    ),
    # GLM-4.5: a dense layer before MoE layers of 8 routed experts in 4 groups (2 kept, 3
    # chosen: across groups), 2 shared experts, partial rotary, explicit head_dim, q / k norms
    # and q / k / v biases (tests randomize e_score_correction_bias, a buffer)
    # Solar Open: GLM-4.5's MoE in every layer (8 experts in 4 groups, 2 shared), whole-head
    # rope, no q / k norms
    "solar_open": (
        "SolarOpenConfig",
        {
            **_LLAMA_LIKE,
            "head_dim": 16,
            **_GLM_EXPERTS,
            "tie_word_embeddings": False,
        },
    ),
    # MiniCPM5-MoE: gated attention without q / k norms (head_dim 16), a dense layer then
    # GLM-style MoE layers
    "minicpm5_moe": (
        "MiniCPM5MoeConfig",
        {
            **_LLAMA_LIKE,
            "num_hidden_layers": 3,
            "head_dim": 16,
            "mlp_layer_types": ["dense", "sparse", "sparse"],
            **_GLM_EXPERTS,
            "tie_word_embeddings": False,
        },
    ),
    "glm4_moe": (
        "Glm4MoeConfig",
        {
            **_LLAMA_LIKE,
            "num_hidden_layers": 3,
            "head_dim": 32,
            "partial_rotary_factor": 0.5,
            "attention_bias": True,
            "use_qk_norm": True,
            "first_k_dense_replace": 1,
            **_GLM_EXPERTS,
            "norm_topk_prob": True,
            "tie_word_embeddings": False,
        },
    ),
    # OLMo 3: a sliding layer (window 8 < the test prompts) and a full one, each with its own
    # rope (YaRN x4 over a 64-token original context on the full layer only)
    "olmo3": (
        "Olmo3Config",
        {
            **_LLAMA_LIKE,
            "max_position_embeddings": 256,
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": 8,
            "rope_theta": 10_000.0,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "attention_factor": 1.2,
                "original_max_position_embeddings": 64,
            },
            "tie_word_embeddings": False,
        },
    ),
    # Ministral 3: head_dim != hidden / heads, YaRN, and the position-dependent q scaling away
    # from 1 within the test prompts (original context 16, beta 0.5)
    "ministral3": (
        "Ministral3Config",
        {
            **_LLAMA_LIKE,
            "head_dim": 32,
            "max_position_embeddings": 256,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 1_000_000.0,
                "factor": 16.0,
                "original_max_position_embeddings": 16,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "llama_4_scaling_beta": 0.5,
            },
            "tie_word_embeddings": True,
        },
    ),
    # DeepSeek-V2: MLA without the q bottleneck, softmax routing limited to 2 of 4 groups
    # MiniCPM3: DeepSeek-V2's MLA with dense MLPs and MiniCPM's scalars (embedding x12,
    # residual x1.4/sqrt(3), hidden / (64 / 16) before the tied head)
    "minicpm3": (
        "MiniCPM3Config",
        {
            **_LLAMA_LIKE,
            **_MLA_LIKE,
            "scale_emb": 12,
            "scale_depth": 1.4,
            "dim_model_base": 16,
        },
    ),
    "deepseek_v2": (
        "DeepseekV2Config",
        {
            **_LLAMA_LIKE,
            **_DEEPSEEK_LIKE,
            "q_lora_rank": None,
            "n_shared_experts": 2,
            "topk_method": "group_limited_greedy",
            "routed_scaling_factor": 1.5,
            "tie_word_embeddings": False,
        },
    ),
    # LongCat-Flash: 2 layers of two MLA sublayers each (4 latent caches), LoRA scalings
    # sqrt(64/32) and sqrt(64/16), YaRN x4 with mscale_all_dim, a shortcut MoE of 4 experts
    # and 2 zero (identity) experts (3 chosen) scaled by 1.7
    "longcat_flash": (
        "LongcatFlashConfig",
        {
            **{k: v for k, v in _LLAMA_LIKE.items() if k != "num_hidden_layers"},
            **{k: v for k, v in _MLA_LIKE.items() if k != "num_hidden_layers"},
            "num_layers": 2,
            "kv_lora_rank": 16,
            "head_dim": 8,
            "ffn_hidden_size": 96,
            "n_routed_experts": 4,
            "zero_expert_num": 2,
            "moe_topk": 3,
            "expert_ffn_hidden_size": 32,
            "routed_scaling_factor": 1.7,
            "rope_parameters": _MLA_YARN,
            "tie_word_embeddings": False,
        },
    ),
    # GLM-4.7-Flash: DeepSeek-V3's MLA and MoE, its MLPs named by mlp_layer_types
    "glm4_moe_lite": (
        "Glm4MoeLiteConfig",
        {
            **_LLAMA_LIKE,
            **_DEEPSEEK_LIKE,
            "mlp_layer_types": ["dense", "sparse", "dense"],
            "routed_scaling_factor": 1.8,
            "norm_topk_prob": True,
            "tie_word_embeddings": False,
        },
    ),
    # Mistral 4: V3's MLA and layout with the q scaling away from 1 within the test prompts
    # (original context 16, beta 0.5) under YaRN x16; a softmax router over 8 experts in 4
    # groups (2 kept), renormalized and scaled by 2.0; a dense first layer, a shared expert
    "mistral4": (
        "Mistral4Config",
        {
            **_LLAMA_LIKE,
            **_DEEPSEEK_LIKE,
            "routed_scaling_factor": 2.0,
            "norm_topk_prob": True,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10_000.0,
                "factor": 16.0,
                "original_max_position_embeddings": 16,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 0.707,
                "llama_4_scaling_beta": 0.5,
            },
            "tie_word_embeddings": False,
        },
    ),
    # Youtu-LLM: V3's MLA (q bottleneck, YaRN x4 over a 64-token original context with
    # mscale_all_dim) with a dense MLP in every layer; the head tied to the embedding. No
    # pad_token_id: transformers 5.25's Youtu zeroes that embedding row of a loaded checkpoint
    # (its _init_weights writes through `.data`, past the guard that spares loaded weights)
    "youtu": (
        "YoutuConfig",
        {
            **_LLAMA_LIKE,
            **_MLA_LIKE,
            "pad_token_id": None,
            "rope_parameters": _MLA_YARN,
            "tie_word_embeddings": True,
        },
    ),
    # A.X K1: V3's MLA (YaRN as Youtu's) and MoE (8 experts in 4 groups, 2 kept, biased sigmoid
    # top-2, renormalized, x2.5, a shared expert) on layers 0 and 2 by mlp_layer_types (layer 1
    # dense), each MoE output through its own RMSNorm (post_mlp_layernorm)
    "axk1": (
        "AXK1Config",
        {
            **_LLAMA_LIKE,
            **_MLA_LIKE,
            "mlp_layer_types": ["sparse", "dense", "sparse"],
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "moe_intermediate_size": 32,
            "num_experts_per_tok": 2,
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
            "rope_parameters": _MLA_YARN,
            "tie_word_embeddings": False,
        },
    ),
    # DeepSeek-V3.2: A.X K1's MLA (YaRN) and V3's MoE (layer 0 dense) with DSA on 4 layers: an
    # indexer of 8 heads of 16 (rope on the first 8 dims, NeoX halves) keeps each query's best
    # 6 keys, well below the test prompts' lengths
    "deepseek_v32": (
        "DeepseekV32Config",
        {
            **_LLAMA_LIKE,
            **_DEEPSEEK_LIKE,
            "num_hidden_layers": 4,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
            "rope_parameters": _MLA_YARN,
            "index_topk": 6,
            "index_head_dim": 16,
            "index_n_heads": 8,
            "tie_word_embeddings": False,
        },
    ),
    # GLM-5: V3.2 with the indexer's rope on (even, odd) pairs and shared layers 1 and 3 reusing
    # the choice of layers 0 and 2; one group of experts, weights not renormalized
    "glm_moe_dsa": (
        "GlmMoeDsaConfig",
        {
            **_LLAMA_LIKE,
            **_DEEPSEEK_LIKE,
            "num_hidden_layers": 4,
            "n_group": 1,
            "topk_group": 1,
            "routed_scaling_factor": 1.8,
            "norm_topk_prob": False,
            "rope_parameters": _MLA_YARN,
            "index_topk": 6,
            "index_head_dim": 16,
            "index_n_heads": 8,
            "indexer_types": ["full", "shared", "full", "shared"],
            "tie_word_embeddings": False,
        },
    ),
    # Hy-V4: GLM-5's DSA (the indexer's rope on its last 8 of 16 dims, keeping 6 keys; layers
    # 2-3 shared) with 3 hyper-connection streams (post magnitude 1.5), gated attention with
    # sinks, a dense layer 0, one group of 8 experts with SwiGLU clamped at 1 (x2.5, renormalized)
    "hy_v4": (
        "HYV4Config",
        {
            **_LLAMA_LIKE,
            **_DEEPSEEK_LIKE,
            "num_hidden_layers": 4,
            "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
            "n_group": 1,
            "topk_group": 1,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
            "rope_parameters": _MLA_YARN,
            "index_topk": 6,
            "index_head_dim": 16,
            "index_n_heads": 8,
            "indexer_types": ["full", "full", "shared", "shared"],
            "hc_mult": 3,
            "hc_magnitude": 1.5,
            "hc_eps": 1e-3,
            "swiglu_limit": 1.0,
            "tie_word_embeddings": False,
        },
    ),
    # A.X K2: V3.2's DSA (keeping 6 keys) with a fused query / output-gate projection, gated
    # input norms (and post norms on the sparse layers 1 and 3), YaRN, 8 experts in 4 groups
    "axk2": (
        "AXK2Config",
        {
            **_LLAMA_LIKE,
            **_DEEPSEEK_LIKE,
            "num_hidden_layers": 4,
            "mlp_layer_types": ["dense", "sparse", "dense", "sparse"],
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
            "rope_parameters": _MLA_YARN,
            "index_topk": 6,
            "index_head_dim": 16,
            "index_n_heads": 8,
            "gated_norm_rank": 8,
            "tie_word_embeddings": False,
        },
    ),
    # GLM-4: head_dim 32 (q wider than hidden), interleaved rope over half of each head, q / k / v
    # biases, the four norms a layer
    "glm4": (
        "Glm4Config",
        {
            **_LLAMA_LIKE,
            "head_dim": 32,
            "partial_rotary_factor": 0.5,
            "attention_bias": True,
            "tie_word_embeddings": False,
        },
    ),
    # GLM (glm-4-9b-chat-hf): GLM-4's attention and rope on Llama's two norms a layer
    "glm": (
        "GlmConfig",
        {**_LLAMA_LIKE, "head_dim": 32, "partial_rotary_factor": 0.5, "attention_bias": True},
    ),
    # Helium: Llama with interleaved rope over the whole head, o_proj without a bias
    "helium": ("HeliumConfig", {**_LLAMA_LIKE, "head_dim": 16, "attention_bias": True}),
    # Ministral (8B): Mistral with sliding and full layers by layer_types (window 8 < prompts)
    "ministral": (
        "MinistralConfig",
        {
            **_LLAMA_LIKE,
            "head_dim": 16,  # HF's attention cannot read a None head_dim
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "tie_word_embeddings": False,
        },
    ),
    # VaultGemma: Gemma 2's attention (soft-caps, sliding layers) on two norms a layer
    "vaultgemma": (
        "VaultGemmaConfig",
        {
            **_LLAMA_LIKE,
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": 8,
            "attn_logit_softcapping": 10.0,
            "final_logit_softcapping": 30.0,
        },
    ),
    # Phi-3.5-MoE: Mixtral with LayerNorms, biases (attention, LM head) and SparseMixer top-2
    # routing; a router jitter of 0.1 so the near-top masks bite on random logits
    "phimoe": (
        "PhimoeConfig",
        {
            **_LLAMA_LIKE,
            "intermediate_size": 32,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "router_jitter_noise": 0.1,
            "attention_bias": True,
            "lm_head_bias": True,
            "tie_word_embeddings": False,
        },
    ),
    # Gemma 4 (E2B / E4B layout): sliding layers of head size 16, full layers of 32 (proportional
    # rope on a quarter of it), per-layer inputs of 8, the last two layers reading earlier
    # layers' KV with double-wide MLPs (global KV heads apply with attention_k_eq_v only)
    "gemma4": (
        "Gemma4TextConfig",
        {
            **_LLAMA_LIKE,
            "num_hidden_layers": 6,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
            "head_dim": 16,
            "global_head_dim": 32,
            "num_global_key_value_heads": 1,
            "attention_k_eq_v": False,
            "sliding_window": 8,
            "hidden_size_per_layer_input": 8,
            "vocab_size_per_layer_input": 512,
            "num_kv_shared_layers": 2,
            "use_double_wide_mlp": True,
            "final_logit_softcapping": 30.0,
        },
    ),
    # Gemma 4 Unified: Gemma 4's dense decoder without per-layer inputs; sliding layers of head
    # size 16 (window 8), full layers of 32 with one KV head whose values are the key projection
    # (attention_k_eq_v), proportional rope on a quarter of it; the last two layers read earlier
    # layers' KV with double-wide MLPs
    "gemma4_unified": (
        "Gemma4UnifiedTextConfig",
        {
            **_LLAMA_LIKE,
            "num_hidden_layers": 6,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
            "head_dim": 16,
            "global_head_dim": 32,
            "num_global_key_value_heads": 1,
            "attention_k_eq_v": True,
            "sliding_window": 8,
            "num_kv_shared_layers": 2,
            "use_double_wide_mlp": True,
            "final_logit_softcapping": 30.0,
        },
    ),
    # Gemma 3n (E2B / E4B layout at 6 layers): AltUp over 4 streams, Laurel of rank 8,
    # per-layer inputs of 8 over a smaller table than the vocabulary (ids past it read row 0),
    # MLP widths per layer with the first two sparse (p 0.95 and 0.6), sliding window 8 beside
    # full layers with their own rope base, the last two layers reading layers 3's and 4's KV
    "gemma3n": (
        "Gemma3nTextConfig",
        {
            **_LLAMA_LIKE,
            "num_hidden_layers": 6,
            "head_dim": 16,
            "intermediate_size": [128, 96, 128, 64, 128, 96],
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
            "sliding_window": 8,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            },
            "hidden_size_per_layer_input": 8,
            "vocab_size_per_layer_input": 480,
            "altup_num_inputs": 4,
            "laurel_rank": 8,
            "activation_sparsity_pattern": [0.95, 0.6, 0.0, 0.0, 0.0, 0.0],
            "num_kv_shared_layers": 2,
            "final_logit_softcapping": 30.0,
        },
    ),
    # Gemma 4 MoE (26B-A4B layout): experts beside the dense MLP, full layers' values from their
    # key projection (attention_k_eq_v), one global KV head, no per-layer inputs or KV sharing
    "gemma4_moe": (
        "Gemma4TextConfig",
        {
            **_LLAMA_LIKE,
            "num_hidden_layers": 3,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
            "head_dim": 16,
            "global_head_dim": 32,
            "num_global_key_value_heads": 1,
            "attention_k_eq_v": True,
            "sliding_window": 8,
            "hidden_size_per_layer_input": 0,
            "enable_moe_block": True,
            "num_experts": 4,
            "top_k_experts": 2,
            "moe_intermediate_size": 32,
            "final_logit_softcapping": 30.0,
        },
    ),
    # Llama 4 (Maverick's layout at 4 layers): rope layers 0-2 attend within chunks of 12 keys
    # (not a multiple of the block size) with unit-RMS q / k, NoPE layer 3 scales its queries
    # from position 3 on (floor_scale 4); MoE layers 1 and 3 (router-scaled expert inputs plus
    # a shared expert), dense MLPs of another size elsewhere; experts not square (H != 2I, I)
    "llama4": (
        "Llama4TextConfig",
        {
            **_LLAMA_LIKE,
            "num_hidden_layers": 4,
            "head_dim": 16,
            "intermediate_size": 48,
            "intermediate_size_mlp": 80,
            "num_local_experts": 4,
            "num_experts_per_tok": 1,
            "interleave_moe_layer_step": 2,
            "no_rope_layer_interval": 4,
            "attention_chunk_size": 12,
            "floor_scale": 4,
            "attn_scale": 0.5,
            "tie_word_embeddings": False,
        },
    ),
    # nanochat: weightless norms (q / k after a reversed rope), relu^2 MLP, soft-capped logits
    "nanochat": ("NanoChatConfig", {**_LLAMA_LIKE, "final_logit_softcapping": 5.0}),
    # OLMo (v1): parameter-free LayerNorms; q / k / v clamped (tests also leave clip_qkv unset)
    "olmo": ("OlmoConfig", {**_LLAMA_LIKE, "clip_qkv": 0.5, "tie_word_embeddings": False}),
    # Cohere: per-head q / k LayerNorms, q / k / v / o biases, logits scaled by 0.5
    "cohere": (
        "CohereConfig",
        {
            **{k: v for k, v in _LLAMA_LIKE.items() if k != "rms_norm_eps"},
            "layer_norm_eps": 1e-5,
            "use_qk_norm": True,
            "attention_bias": True,
            "logit_scale": 0.5,
            "tie_word_embeddings": True,
        },
    ),
    # Cohere 2: a sliding layer (window 8 < the test prompts, with rope) and a full NoPE one
    "cohere2": (
        "Cohere2Config",
        {
            **{k: v for k, v in _LLAMA_LIKE.items() if k != "rms_norm_eps"},
            "layer_norm_eps": 1e-5,
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": 8,
            "logit_scale": 0.5,
            "tie_word_embeddings": True,
        },
    ),
    # Cohere 2 MoE: a dense prefix layer (forced rope) then MoE layers (softmax over the top 3
    # of 8 logits, a shared expert averaged in), windows (8) on 2 of the 3 MoE layers, RMSNorms
    "cohere2_moe": (
        "Cohere2MoeConfig",
        {
            **{k: v for k, v in _LLAMA_LIKE.items() if k != "rms_norm_eps"},
            "num_hidden_layers": 4,
            "head_dim": 16,
            "intermediate_size": 32,
            "prefix_dense_intermediate_size": 96,
            "first_k_dense_replace": 1,
            "sliding_window_pattern": 3,
            "sliding_window": 8,
            "num_experts": 8,
            "num_experts_per_tok": 3,
            "num_shared_experts": 1,
            "rms_norm_eps": 1e-5,
            "logit_scale": 0.5,
            "tie_word_embeddings": True,
        },
    ),
    # StarCoder2: LayerNorms, biases everywhere, a non-gated GELU MLP, every layer windowed (8 <
    # the test prompts), GQA, tied head
    "starcoder2": (
        "Starcoder2Config",
        {
            **{k: v for k, v in _LLAMA_LIKE.items() if k != "rms_norm_eps"},
            "norm_epsilon": 1e-5,
            "sliding_window": 8,
            "use_bias": True,
            "tie_word_embeddings": True,
        },
    ),
    # StableLM-2 1.6B's layout: LayerNorms, rope over a quarter of each head, q / k / v biases
    # (tests also turn on qk_layernorm and use_parallel_residual, 2-12B's)
    "stablelm": (
        "StableLmConfig",
        {
            **{k: v for k, v in _LLAMA_LIKE.items() if k != "rms_norm_eps"},
            "layer_norm_eps": 1e-5,
            "partial_rotary_factor": 0.25,
            "use_qkv_bias": True,
            "tie_word_embeddings": False,
        },
    ),
    # Phi-2's layout with GQA and q / k LayerNorms: parallel attention and MLP, rope over half of
    # each head, biases everywhere including the LM head
    "phi": (
        "PhiConfig",
        {
            **{k: v for k, v in _LLAMA_LIKE.items() if k != "rms_norm_eps"},
            "layer_norm_eps": 1e-5,
            "partial_rotary_factor": 0.5,
            "qk_layernorm": True,
            "hidden_act": "gelu_new",
            "tie_word_embeddings": False,
        },
    ),
    # Persimmon-8B's layout: fused per-head qkv, one q and one k LayerNorm shared by all heads,
    # rope over half of each head, relu^2 MLP, biases everywhere but the untied LM head
    "persimmon": (
        "PersimmonConfig",
        {
            **{
                k: v
                for k, v in _LLAMA_LIKE.items()
                if k not in ("rms_norm_eps", "num_key_value_heads")
            },
            "layer_norm_eps": 1e-5,
            "partial_rotary_factor": 0.5,
            "qk_layernorm": True,
            "hidden_act": "relu2",
            "tie_word_embeddings": False,
        },
    ),
    # JetMoE-8B's layout: 4 attention experts (2 chosen: 4 query heads of 16 over 2 kv heads)
    # and 4 MLP experts (2 chosen), biases on both blocks, a tied LM head; rms_norm_eps large
    # (only the final norm reads it: the layers' norms keep 1e-6)
    "jetmoe": (
        "JetMoeConfig",
        {
            **{k: v for k, v in _LLAMA_LIKE.items() if k != "num_attention_heads"},
            "rms_norm_eps": 0.05,
            "kv_channels": 16,
            "intermediate_size": 32,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
        },
    ),
    # Granite MoE: Granite's four multipliers away from 1 (the attention scale 0.5, not
    # head_dim^-0.5 = 0.25), q / k / v / o biases, 4 experts (2 chosen); GraniteMoeShared adds an
    # ungated shared MLP
    "granitemoe": (
        "GraniteMoeConfig",
        {
            **_LLAMA_LIKE,
            "intermediate_size": 32,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "attention_bias": True,
            "embedding_multiplier": 6.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.5,
            "logits_scaling": 2.5,
            "tie_word_embeddings": True,
        },
    ),
    "granitemoeshared": (
        "GraniteMoeSharedConfig",
        {
            **_LLAMA_LIKE,
            "intermediate_size": 32,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "shared_intermediate_size": 48,
            "embedding_multiplier": 6.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.5,
            "logits_scaling": 2.5,
            "tie_word_embeddings": False,
        },
    ),
    # GraniteMoeSWA: GraniteMoeShared's MoE and shared MLP under GraniteSWA's sinks, a window
    # of 8 (shorter than the test prompts) on 3 of 4 layers (not the default i % 4 pattern) and
    # per-layer rope bases (500, NoPE on the full layer, the global 10000); q / k / v / o biases
    "granitemoe_swa": (
        "GraniteMoeSWAConfig",
        {
            **_LLAMA_LIKE,
            "num_hidden_layers": 4,
            "intermediate_size": 32,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "shared_intermediate_size": 48,
            "attention_bias": True,
            "embedding_multiplier": 6.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.5,
            "logits_scaling": 2.5,
            "sliding_window": 8,
            "layer_types": [
                "sliding_attention",
                "full_attention",
                "sliding_attention",
                "sliding_attention",
            ],
            "layer_rope_theta": [500.0, 0, 10000.0, 500.0],
            "tie_word_embeddings": False,
        },
    ),
    # ERNIE 4.5: interleaved rope, explicit head_dim, use_bias (every projection, and the MoE
    # model's lm_head); the MoE model: a dense layer 0, then layers of 8 experts (2 chosen by
    # softmax + a random e_score_correction_bias) and a shared expert
    "ernie4_5": (
        "Ernie4_5Config",
        {**_LLAMA_LIKE, "head_dim": 32, "use_bias": True, "tie_word_embeddings": True},
    ),
    "ernie4_5_moe": (
        "Ernie4_5_MoeConfig",
        {
            **_LLAMA_LIKE,
            "num_hidden_layers": 3,
            "head_dim": 32,
            "use_bias": True,
            "moe_num_experts": 8,
            "moe_k": 2,
            "moe_intermediate_size": 32,
            "moe_num_shared_experts": 1,
            "moe_layer_start_index": 1,
            "tie_word_embeddings": True,
        },
    ),
    # Seed-OSS: head_dim 32 (q wider than hidden), q / k / v biases without an o_proj one (the
    # 36B model's), MLP biases
    "seed_oss": (
        "SeedOssConfig",
        {
            **_LLAMA_LIKE,
            "head_dim": 32,
            "attention_bias": True,
            "attention_out_bias": False,
            "mlp_bias": True,
            "tie_word_embeddings": False,
        },
    ),
    # EXAONE 4.0: post-norms, per-head q / k norms, sliding layers (window 8 < the test prompts)
    # with rope beside global NoPE ones ("LG" twice), Llama 3 rope scaling over a 64-token
    # original context
    "exaone4": (
        "Exaone4Config",
        {
            **_LLAMA_LIKE,
            "num_hidden_layers": 4,
            "max_position_embeddings": 256,
            "sliding_window": 8,
            "sliding_window_pattern": 2,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10_000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
            },
            "tie_word_embeddings": False,
        },
    ),
    # Apertus: ungated xIELU MLP (its alpha_p / alpha_n randomized like norm weights), per-head
    # q / k norms, the released models' Llama 3 rope (theta 12M, factor 8) over a 64-token
    # original context
    "apertus": (
        "ApertusConfig",
        {
            **_LLAMA_LIKE,
            "max_position_embeddings": 256,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 12_000_000.0,
                "factor": 8.0,
                "original_max_position_embeddings": 64,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
            },
            "tie_word_embeddings": False,
        },
    ),
    # Apertus 1.5: Apertus' decoder, the LM head pruned to the first 383 of the 512 ids (an odd
    # count: TP's last head shard is padded); the ids past it still embed
    "apertus1p5": (
        "Apertus1p5TextConfig",
        {
            **_LLAMA_LIKE,
            "max_position_embeddings": 256,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 12_000_000.0,
                "factor": 8.0,
                "original_max_position_embeddings": 64,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
            },
            "output_vocab_size": 383,
            "tie_word_embeddings": False,
        },
    ),
    # Arcee AFM: ungated relu^2 MLP, head_dim 32 (q wider than hidden), YaRN x4 over a 64-token
    # original context (the released model's rope type)
    "arcee": (
        "ArceeConfig",
        {
            **_LLAMA_LIKE,
            "head_dim": 32,
            "max_position_embeddings": 256,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10_000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            "tie_word_embeddings": False,
        },
    ),
    # OLMoE: whole-projection q / k norms, 8 experts of 32 in every layer, 2 chosen (softmax, not
    # renormalized: the released checkpoints' norm_topk_prob=False)
    # FlexOlmo: OLMoE's experts (8, top 2) in OLMo 2's post-norm layers
    "flex_olmo": (
        "FlexOlmoConfig",
        {
            **_LLAMA_LIKE,
            "intermediate_size": 32,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "tie_word_embeddings": False,
        },
    ),
    "olmoe": (
        "OlmoeConfig",
        {
            **_LLAMA_LIKE,
            "intermediate_size": 32,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "tie_word_embeddings": False,
        },
    ),
    # MiniMax-M2: whole-projection q / k norms, partial rotary (rotary_dim 16 of head_dim 32, q
    # wider than hidden), 8 experts of 32 in every layer, 2 chosen by sigmoid + a random
    # e_score_correction_bias, renormalized
    # MiniMax-01: lightning layers around one attention layer, block_size 4 (transformers'
    # blocked prefill crosses blocks), residual factors away from 1.
    "minimax": (
        "MiniMaxConfig",
        {
            **_LLAMA_LIKE,
            "num_hidden_layers": 4,
            "head_dim": 16,
            "intermediate_size": 32,
            "layer_types": [
                "linear_attention",
                "full_attention",
                "linear_attention",
                "linear_attention",
            ],
            "block_size": 4,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "linear_attn_alpha_factor": 1.5,
            "linear_attn_beta_factor": 0.75,
            "full_attn_alpha_factor": 1.25,
            "full_attn_beta_factor": 0.5,
            "mlp_alpha_factor": 0.8,
            "mlp_beta_factor": 1.3,
            "max_position_embeddings": 256,
            "tie_word_embeddings": False,
        },
    ),
    "minimax_m2": (
        "MiniMaxM2Config",
        {
            **_LLAMA_LIKE,
            "intermediate_size": 32,
            "head_dim": 32,
            "rotary_dim": 16,
            "max_position_embeddings": 256,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "tie_word_embeddings": False,
        },
    ),
    # Hunyuan: per-head q / k norms after RoPE, NTK-alpha rope (alpha 1000: a fixed, larger base),
    # head_dim 32; dense: q / k / v / o biases (tests tie the embeddings, as the small models
    # do); MoE: 8 experts of 32 with a shared MLP, softmax top-k renormalized, k per layer (2,
    # then 3)
    "hunyuan_v1_dense": (
        "HunYuanDenseV1Config",
        {
            **_LLAMA_LIKE,
            "head_dim": 32,
            "max_position_embeddings": 256,
            "attention_bias": True,
            "rope_parameters": {
                "rope_type": "dynamic",
                "rope_theta": 10_000.0,
                "alpha": 1000.0,
                "factor": 1.0,
            },
            "tie_word_embeddings": False,
        },
    ),
    "hunyuan_v1_moe": (
        "HunYuanMoEV1Config",
        {
            **_LLAMA_LIKE,
            "intermediate_size": 32,
            "head_dim": 32,
            "max_position_embeddings": 256,
            "num_experts": 8,
            "moe_topk": [2, 3],
            "rope_parameters": {
                "rope_type": "dynamic",
                "rope_theta": 10_000.0,
                "alpha": 1000.0,
                "factor": 1.0,
            },
            "tie_word_embeddings": False,
        },
    ),
    # dots.llm1: Qwen3's attention (per-head q / k norms) with the last layer sliding (window 8
    # < the test prompts); a dense layer, then DeepSeek-V3 MoE layers: 8 experts in 4 groups (2
    # kept), 3 chosen by sigmoid + a random correction bias, renormalized, scaled by 2.5, a
    # shared expert
    "dots1": (
        "Dots1Config",
        {
            **_LLAMA_LIKE,
            "num_hidden_layers": 3,
            "max_position_embeddings": 256,
            "sliding_window": 8,
            "max_window_layers": 2,
            "first_k_dense_replace": 1,
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "moe_intermediate_size": 16,
            "num_experts_per_tok": 3,
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
            "tie_word_embeddings": False,
        },
    ),
    "opt": (
        "OPTConfig",
        {
            "hidden_size": 64,
            "ffn_dim": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "max_position_embeddings": 1024,
            "word_embed_proj_dim": 64,
            "do_layer_norm_before": True,
        },
    ),
    "gpt2": (
        "GPT2Config",
        {
            "n_embd": 64,
            "n_layer": 2,
            "n_head": 4,
            "n_positions": 1024,
            "activation_function": "gelu_new",
        },
    ),
    "gpt_neox": (
        "GPTNeoXConfig",
        {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "max_position_embeddings": 1024,
            "rotary_pct": 0.5,
            "use_parallel_residual": True,
            "hidden_act": "gelu",
            "tie_word_embeddings": False,
        },
    ),
    # GPT-BigCode (StarCoder, SantaCoder): GPT-2 with multi-query attention, one KV head
    # (tests also turn multi_query off: per-head q / k / v rows in c_attn)
    "gpt_bigcode": (
        "GPTBigCodeConfig",
        {
            "n_embd": 64,
            "n_layer": 2,
            "n_head": 4,
            "n_inner": 128,
            "n_positions": 1024,
            "multi_query": True,
        },
    ),
    # Falcon-40B's layout: the new decoder architecture, 2 KV heads, ln_attn / ln_mlp beside
    # each other (tests also use 7B's: multi-query, one LayerNorm; and RW's: ALiBi, biases,
    # sequential)
    "falcon": (
        "FalconConfig",
        {
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_kv_heads": 2,
            "ffn_hidden_size": 128,
            "max_position_embeddings": 1024,
            "new_decoder_architecture": True,
            "bias": False,
        },
    ),
    # BLOOM: ALiBi, fused per-head query_key_value rows, embedding LayerNorm, biases everywhere;
    # 6 heads: two past the largest power of two take the second slope sequence
    "bloom": (
        "BloomConfig",
        {"hidden_size": 96, "n_layer": 2, "n_head": 6, "layer_norm_epsilon": 1e-5},
    ),
    # MPT: ALiBi with MPT's slope order (6 heads: not a power of two), fused Wqkv [q | k | v],
    # bias-free LayerNorms and linears (tests also clamp q / k / v and scale the softmax)
    "mpt": ("MptConfig", {"d_model": 96, "n_layers": 2, "n_heads": 6, "max_seq_len": 1024}),
    # GPT-Neo: unscaled attention, global and local layers (window 8 < prompts), learned
    # positions, an MLP width of its own
    "gpt_neo": (
        "GPTNeoConfig",
        {
            "hidden_size": 64,
            "num_layers": 2,
            "num_heads": 4,
            "attention_types": [[["global", "local"], 1]],
            "window_size": 8,
            "intermediate_size": 96,
            "max_position_embeddings": 1024,
        },
    ),
    # GPT-J-6B's layout: parallel attention and MLP on one LayerNorm, interleaved rotary on the
    # first half of each head, LM head with a bias
    "gptj": ("GPTJConfig", {**_GPTJ_LIKE}),
    # CodeGen: GPT-J's decoder, q | v | k rows in 4 model-parallel groups of the fused qkv_proj
    "codegen": ("CodeGenConfig", {**_GPTJ_LIKE}),
    # BioGPT / XGLM: fairseq decoders, sqrt(d)-scaled embeddings, positions 2 rows in (learned /
    # sinusoidal), OPT's pre-LN layers, tied head
    "biogpt": (
        "BioGptConfig",
        {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "max_position_embeddings": 1024,
        },
    ),
    "xglm": (
        "XGLMConfig",
        {
            "d_model": 64,
            "ffn_dim": 128,
            "num_layers": 2,
            "attention_heads": 4,
            "max_position_embeddings": 1024,
        },
    ),
    # Nemotron: LayerNorm1P norms (weight stored minus 1, with biases), ungated relu^2 MLP,
    # partial rotary (half of head_dim 32: q wider than hidden)
    # Jais 2: Nemotron's decoder with plain LayerNorms, whole-head rope, every bias on
    "jais2": (
        "Jais2Config",
        {
            **_LLAMA_LIKE,
            "hidden_act": "relu2",
            "layer_norm_eps": 1e-5,
            "attention_bias": True,
            "mlp_bias": True,
            "tie_word_embeddings": False,
        },
    ),
    "nemotron": (
        "NemotronConfig",
        {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "max_position_embeddings": 256,
            "norm_eps": 1e-5,
            "tie_word_embeddings": False,
        },
    ),
    # DBRX: fused Wqkv clamped at 1.5 (bites: the released 8 rarely would here), the released
    # rope base in attn_config (and in rope_parameters, which HF reads), bias-free LayerNorms,
    # 8 stacked experts of 32, 2 chosen, weights divided by their 1-norm
    "dbrx": (
        "DbrxConfig",
        {
            "d_model": 64,
            "n_heads": 4,
            "n_layers": 2,
            "max_seq_len": 256,
            "attn_config": {"kv_n_heads": 2, "clip_qkv": 1.5, "rope_theta": 500_000.0},
            "rope_parameters": {"rope_type": "default", "rope_theta": 500_000.0},
            "ffn_config": {
                "ffn_hidden_size": 32,
                "moe_num_experts": 8,
                "moe_top_k": 2,
                "moe_normalize_expert_weights": 1.0,
            },
            "tie_word_embeddings": False,
        },
    ),
    # InternLM3: Llama's layout with head_dim 32 (q wider than hidden); tests also turn on its
    # qkv_bias / bias switches
    "internlm3": (
        "InternLM3Config",
        {**_LLAMA_LIKE, "head_dim": 32, "max_position_embeddings": 256},
    ),
    # K-EXAONE: EXAONE 4.0's attention (per-head q / k norms, sliding layers with window 8 < the
    # test prompts beside global NoPE ones, "LG" twice) in pre-norm layers; a dense layer, then
    # DeepSeek-V3 MoE layers: 8 experts of 16 in 4 groups (2 kept), 3 chosen by sigmoid + a
    # random correction bias, renormalized, scaled by 2.5, a shared expert
    "exaone_moe": (
        "ExaoneMoeConfig",
        {
            **_LLAMA_LIKE,
            "num_hidden_layers": 4,
            "max_position_embeddings": 256,
            "sliding_window": 8,
            "sliding_window_pattern": 2,
            "first_k_dense_replace": 1,
            "moe_intermediate_size": 16,
            "num_experts": 8,
            "num_experts_per_tok": 3,
            "num_shared_experts": 1,
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
            "tie_word_embeddings": False,
        },
    ),
    # MiMo-V2-Flash: full and sliding layers (window 8, twice the KV heads and sinks), q / k heads
    # of 32 and value heads of 16 scaled by 0.5, a YaRN rope over half of each head on the full
    # layers and a default one over HF's default 0.334 on the sliding ones, dense and MoE layers
    # (sigmoid top-2 of 8 in 4 groups, 2 kept, scaled by 2.5, no shared experts)
    "mimo_v2_flash": (
        "MiMoV2FlashConfig",
        {
            **_LLAMA_LIKE,
            "num_hidden_layers": 4,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "v_head_dim": 16,
            "max_position_embeddings": 256,
            "layer_types": [
                "full_attention",
                "sliding_attention",
                "sliding_attention",
                "full_attention",
            ],
            "mlp_layer_types": ["dense", "sparse", "dense", "sparse"],
            "sliding_window": 8,
            "attention_value_scale": 0.5,
            "rope_parameters": {
                "full_attention": {
                    "rope_type": "yarn",
                    "rope_theta": 1000.0,
                    "partial_rotary_factor": 0.5,
                    "factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "n_group": 4,
            "topk_group": 2,
            "moe_intermediate_size": 16,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
            "tie_word_embeddings": False,
        },
    ),
    # Hy3: Qwen3's attention in K-EXAONE's MoE decoder, a dense layer then sigmoid top-3 of 8
    # (one group) with a shared expert, scaled by router_scaling_factor
    "hy_v3": (
        "HYV3Config",
        {
            **_LLAMA_LIKE,
            "num_hidden_layers": 3,
            "head_dim": 16,
            "moe_intermediate_size": 16,
            "num_experts": 8,
            "num_experts_per_tok": 3,
            "num_shared_experts": 1,
            "router_scaling_factor": 2.5,
            "tie_word_embeddings": False,
        },
    ),
    # Kolibri 1: EXAONE 4.0's attention (sliding layers, window 8 < the test prompts, with rope;
    # global NoPE layers) in GLM-4's four-norm layers; MoE in every layer: top-3 of 8 experts by
    # logits + a random balance bias, sigmoid weights renormalized, an ungated shared expert
    "kolibri1": (
        "Kolibri1Config",
        {
            "hidden_size": 64,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "max_position_embeddings": 256,
            "rms_norm_eps": 1e-5,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "sliding_window": 8,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 32,
            "num_experts": 8,
            "num_experts_per_tok": 3,
            "norm_topk_prob": True,
            "tie_word_embeddings": False,
        },
    ),
    # Kolibri 1.1: sliding layers beside indexed NoPE ones on NVFP4 keys / values that keep 2
    # sink, 3 local and the top 4 keys (a budget of 9 < the test prompts) of a pool of 3 blocks
    # of 4 (past 12 keys): indexers 1 and 4, reindexer 3 reading layer 1's KV, reindexer 5 with
    # its own; a dense layer, then Kolibri 1's MoE (not renormalized)
    "kolibri1_1": (
        "Kolibri1_1Config",
        {
            "hidden_size": 64,
            "num_hidden_layers": 6,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "max_position_embeddings": 256,
            "rms_norm_eps": 1e-5,
            "layer_types": ["sliding_attention", "indexed_attention"] * 2
            + ["indexed_attention"] * 2,
            "sliding_window": 8,
            "index_layers": [1, 4],
            "kv_source_layers": [0, 1, 2, 1, 4, 5],
            "index_topk": 4,
            "index_num_sink_tokens": 2,
            "index_num_local_tokens": 3,
            "index_pool_size": 12,
            "index_compression": 4,
            "index_num_heads": 2,
            "mlp_only_layers": [0],
            "mlp_only_intermediate_size": 48,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 32,
            "num_experts": 8,
            "num_experts_per_tok": 3,
            "tie_word_embeddings": False,
        },
    ),
    # Flint: Qwen3-MoE's layers with sinks, sliding layers (window 8) with rope beside global
    # NoPE ones, a dense layer, then sigmoid top-3 of 8 experts renormalized plus an ungated
    # shared expert
    "flint": (
        "FlintConfig",
        {
            **_LLAMA_LIKE,
            "num_hidden_layers": 4,
            "head_dim": 16,
            "max_position_embeddings": 256,
            "layer_types": ["full_attention", "sliding_attention"] * 2,
            "sliding_window": 8,
            "mlp_only_layers": [0],
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 32,
            "num_experts": 8,
            "num_experts_per_tok": 3,
            "tie_word_embeddings": False,
        },
    ),
    # LaraMini: the released period-5 layout (linear, sliding window 8 with RoPE of base 1000,
    # linear, full NoPE, sliding); GVA (4 value heads on 2 key heads); every layer a softmax
    # top-2 of 8 experts renormalized plus an ungated shared expert; tied embeddings
    "lara_mini": (
        "LaraMiniConfig",
        {
            **_LLAMA_LIKE,
            "num_hidden_layers": 5,
            "head_dim": 16,
            "layer_types": [
                "linear_attention",
                "sliding_attention",
                "linear_attention",
                "full_attention",
                "sliding_attention",
            ],
            "sliding_window": 8,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0},
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "linear_conv_kernel_dim": 4,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "norm_topk_prob": True,
            "tie_word_embeddings": True,
        },
    ),
}

_CORPUS_TEXT = (
    "the a an of to in and is was for on with as by at from that this it be are or not "
    "paged attention block cache key value token sequence model layer head batch prefill "
    "decode sample greedy beam memory table slot copy write read hello world my name is "
    "capital city France Paris Berlin Rome river mountain ocean number one two three four "
    "five six seven eight nine ten quick brown fox jumps over lazy dog once upon time there "
    "lived king queen castle story end begin user assistant system question answer yes no"
)
_CORPUS_WORDS = _CORPUS_TEXT.split()


def _corpus(seed: int, lines: int = 400) -> list[str]:
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = [rng.choice(_CORPUS_WORDS) for _ in range(rng.randint(4, 14))]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 999)))
        out.append(" ".join(words) + rng.choice([".", "!", "?", ",", "\n"]))
    return out


def build_tiny_tokenizer(vocab_size: int = TINY_VOCAB_SIZE, seed: int = 0):
    """A byte-level BPE `PreTrainedTokenizerFast` with exactly `vocab_size` tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    missing = vocab_size - tok.get_vocab_size()
    if missing < 0:
        raise ValueError(f"vocab_size={vocab_size} is too small for a byte-level tokenizer")
    if missing:  # a small corpus ran out of merges: fill up with inert tokens
        tok.add_tokens([f"<|extra_{i}|>" for i in range(missing)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SPECIAL_TOKENS[BOS_ID],
        eos_token=SPECIAL_TOKENS[EOS_ID],
        pad_token=SPECIAL_TOKENS[PAD_ID],
        chat_template=CHAT_TEMPLATE,
        model_max_length=1024,
    )


def tiny_config(arch: str, **config_overrides: Any):
    """The HF config of a tiny `arch` model (see SUPPORTED_TINY_ARCHS)."""
    import transformers

    if arch not in _ARCH_DEFAULTS:
        known = SUPPORTED_TINY_ARCHS + MORE_TINY_ARCHS
        raise ValueError(f"unknown tiny arch {arch!r}; supported: {known}")
    cls_name, defaults = _ARCH_DEFAULTS[arch]
    kwargs = {"vocab_size": TINY_VOCAB_SIZE, **_COMMON, **defaults, **config_overrides}
    # a copy: configs may edit nested dicts (rope_parameters) in place, and the defaults serve
    # every later call
    return getattr(transformers, cls_name)(**copy.deepcopy(kwargs))


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that logits differ clearly between tokens (HF init is tiny)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        if p.dim() >= 2:
            std = p.shape[-1] ** -0.5 if "emb" not in name and "wte" not in name else 0.5
            p.copy_(torch.randn(p.shape, generator=gen) * std)
        elif name.endswith("bias"):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        elif name.endswith("rg_lru.recurrent_param"):  # RG-LRU decays a^(8 r) near 0.8-0.99
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5 - 4.0)
        else:  # norm weights
            p.copy_(1.0 + torch.randn(p.shape, generator=gen) * 0.1)
    for name, b in sorted(model.named_buffers()):
        # routing balance biases: DeepSeek-V3's, LFM2-MoE's (buffers)
        if name.endswith(("e_score_correction_bias", "expert_bias", "balancing_biases")):
            b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
        elif name.endswith("layer_scalar"):  # Gemma 4's per-layer output scale (saved)
            b.copy_(1.0 + torch.randn(b.shape, generator=gen) * 0.3)
        elif name.endswith("tid2eid"):  # DeepSeek-V4's hash routing: k distinct experts a token
            experts = model.get_submodule(name.rsplit(".", 1)[0]).num_experts
            b.copy_(torch.rand(b.shape[0], experts, generator=gen).argsort(-1)[:, : b.shape[1]])


def _save_random(model_cls: Any, config: Any, seed: int, path: Path) -> None:
    """A `model_cls(config)` in float32 with `_randomize`'s weights, saved to `path`."""
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    _randomize(model, seed)
    with _quiet_progress():
        model.save_pretrained(path)


class _quiet_progress:
    """Silence transformers' "Writing model shards" progress bar for one save."""

    def __enter__(self) -> None:
        from transformers.utils import logging

        self.was_enabled = logging.is_progress_bar_enabled()
        logging.disable_progress_bar()

    def __exit__(self, *exc: object) -> None:
        from transformers.utils import logging

        if self.was_enabled:
            logging.enable_progress_bar()


def _register_causal_lm(config) -> None:
    """Map `config`'s class to its `*ForCausalLM` in transformers' AutoModelForCausalLM where
    transformers maps none (Mistral 4: only its pretraining and image-text-to-text classes), so
    tiny models build and load through the Auto class (exist_ok: a no-op once mapped)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return
    name = type(config).__name__.removesuffix("Config") + "ForCausalLM"
    transformers.AutoModelForCausalLM.register(
        type(config), getattr(transformers, name), exist_ok=True
    )


def write_tiny_model(
    path: str | Path, arch: str, *, seed: int = 0, **config_overrides: Any
) -> Path:
    """Write a complete tiny HF-format model directory for `arch` and return its path."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = tiny_config(arch, **config_overrides)
    _register_causal_lm(config)
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except TypeError:  # transformers < 4.56 only knows torch_dtype
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    _randomize(model, seed)
    with _quiet_progress():
        model.save_pretrained(path)
    tokenizer = build_tiny_tokenizer(config.vocab_size, seed)
    tokenizer.save_pretrained(path)
    GenerationConfig(**_COMMON).save_pretrained(path)
    if not (path / "model.safetensors").exists():  # pragma: no cover - sharded by accident
        raise RuntimeError(f"expected {path / 'model.safetensors'} to be written")
    return path


def write_tiny_eagle3_head(
    path: str | Path,
    target: str | Path,
    *,
    draft_vocab_size: int | None = None,
    seed: int = 0,
    embed: bool = False,
    weights: dict[str, torch.Tensor] | None = None,
    speculators: bool = False,
    **config_overrides: Any,
) -> Path:
    """Write an EAGLE-3 head for the tiny model at `target` in the EAGLE authors' layout
    (models/llama_eagle3.py): config.json (LlamaForCausalLMEagle3) and model.safetensors with
    `midlayer.*`, `fc`, `norm`, `lm_head`, `d2t` / `t2d`, and `embed_tokens` if `embed`.
    Random weights; `draft_vocab_size` < the target's keeps a random sorted subset of its ids.
    `weights` replace the random ones by name (the authors' names). `speculators`: the same
    head in the speculators layout (the layer's config under `transformer_layer_config`, the
    head's fields beside it, `layers.0.*` for `midlayer.*`)."""
    import json

    from safetensors.torch import save_file

    path, target = Path(path), Path(target)
    path.mkdir(parents=True, exist_ok=True)
    tc = json.loads((target / "config.json").read_text())
    d, vocab = int(tc["hidden_size"]), int(tc["vocab_size"])
    heads = int(tc["num_attention_heads"])
    kv_heads = int(tc.get("num_key_value_heads") or heads)
    head_dim = int(tc.get("head_dim") or d // heads)
    inter = int(tc.get("intermediate_size") or 2 * d)
    dv = draft_vocab_size or vocab
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": d,
        "intermediate_size": inter,
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(tc.get("max_position_embeddings") or 1024),
        "rms_norm_eps": float(tc.get("rms_norm_eps") or 1e-6),
        "rope_theta": float(tc.get("rope_theta") or 10000.0),
        "vocab_size": vocab,
        "draft_vocab_size": dv,
        "tie_word_embeddings": False,
        **config_overrides,
    }
    if speculators:
        head_keys = ("draft_vocab_size", "target_hidden_size", "norm_before_residual")
        head_keys += ("eagle_aux_hidden_state_layer_ids",)
        layer = {k: v for k, v in config.items() if k not in head_keys and k != "architectures"}
        config = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "transformer_layer_config": layer,
            "norm_before_residual": False,
            **{k: config[k] for k in head_keys if k in config},
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                "verifier": {"name_or_path": str(target), "architectures": tc["architectures"]},
            },
        }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    gen = torch.Generator().manual_seed(seed)

    def mat(rows: int, cols: int) -> torch.Tensor:
        return torch.randn((rows, cols), generator=gen) * cols**-0.5

    def norm() -> torch.Tensor:
        return 1.0 + torch.randn(d, generator=gen) * 0.1

    out = {
        "midlayer.self_attn.q_proj.weight": mat(heads * head_dim, 2 * d),
        "midlayer.self_attn.k_proj.weight": mat(kv_heads * head_dim, 2 * d),
        "midlayer.self_attn.v_proj.weight": mat(kv_heads * head_dim, 2 * d),
        "midlayer.self_attn.o_proj.weight": mat(d, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": mat(inter, d),
        "midlayer.mlp.up_proj.weight": mat(inter, d),
        "midlayer.mlp.down_proj.weight": mat(d, inter),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.post_attention_layernorm.weight": norm(),
        "fc.weight": mat(d, 3 * d),
        "norm.weight": norm(),
        "lm_head.weight": mat(dv, d) * 4.0,
    }
    ids = (
        torch.arange(vocab) if dv == vocab else torch.randperm(vocab, generator=gen)[:dv].sort()[0]
    )
    out["d2t"] = ids - torch.arange(dv)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    out["t2d"] = t2d
    if embed:
        out["embed_tokens.weight"] = torch.randn((vocab, d), generator=gen) * 0.5
    out.update(weights or {})
    if speculators:
        out = {k.replace("midlayer.", "layers.0."): v for k, v in out.items()}
    save_file({k: v.contiguous() for k, v in out.items()}, path / "model.safetensors")
    return path


def write_tiny_eagle_head(
    path: str | Path,
    target: str | Path,
    *,
    seed: int = 0,
    bias: bool = True,
    para_norm: bool = False,
    num_layers: int = 1,
) -> Path:
    """Write an EAGLE-1 head for the tiny model at `target` in the EAGLE authors' layout
    (models/llama_eagle.py): a Llama config of the target's width and vocabulary, and
    model.safetensors with `fc.weight` (+ `fc.bias`), `layers.{i}.*` without
    `layers.0.input_layernorm`, and (HASS, `para_norm`) `embedding_layernorm` /
    `hidden_states_layernorm`. Random weights."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    path, target = Path(path), Path(target)
    path.mkdir(parents=True, exist_ok=True)
    tc = json.loads((target / "config.json").read_text())
    d = int(tc.get("hidden_size") or tc.get("n_embd"))
    config = LlamaConfig(
        vocab_size=int(tc["vocab_size"]),
        hidden_size=d,
        intermediate_size=2 * d,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        add_para_norm=para_norm,
    )
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(path)
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {
        "fc.weight": torch.randn((d, 2 * d), generator=gen) * (2 * d) ** -0.5,
    }
    if bias:
        out["fc.bias"] = torch.randn(d, generator=gen) * 0.1
    if para_norm:
        for name in ("embedding_layernorm", "hidden_states_layernorm"):
            out[f"{name}.weight"] = 1.0 + torch.randn(d, generator=gen) * 0.1
    for i in range(num_layers):
        layer = LlamaDecoderLayer(config, i)
        for name, t in sorted(layer.state_dict().items()):
            if i == 0 and name.startswith("input_layernorm."):
                continue  # EAGLE's first layer has no input norm
            if t.dim() >= 2:
                w = torch.randn(t.shape, generator=gen) * t.shape[-1] ** -0.5
            else:
                w = 1.0 + torch.randn(t.shape, generator=gen) * 0.1
            out[f"layers.{i}.{name}"] = w
    save_file({k: v.contiguous() for k, v in out.items()}, path / "model.safetensors")
    return path


def write_tiny_mtp_target(
    path: str | Path,
    arch: str = "deepseek_v3",
    *,
    seed: int = 0,
    own_embed: bool = True,
    own_head: bool = True,
) -> Path:
    """A tiny target with one multi-token-prediction layer in its checkpoint, laid out as its
    family ships it (models/mtp.py). `deepseek_v3` (3 layers): `num_nextn_predict_layers: 1`
    and `model.layers.3.*`: a MoE decoder block (layer 1's tensors plus noise), `enorm`,
    `hnorm`, `eh_proj`, `shared_head.norm` and, if asked, copies of the embedding and head of
    its own (`embed_tokens`, `shared_head.head`). `qwen3_next` (4 hybrid layers):
    `mtp_num_hidden_layers: 1` and `mtp.*`: `layers.0` (full-attention layer 2's tensors plus
    noise), `fc`, `pre_fc_norm_embedding`, `pre_fc_norm_hidden`, `norm`. Random weights."""
    from safetensors.torch import load_file, save_file

    deepseek = arch in ("deepseek_v3", "glm4_moe")  # model.layers.{L}.* (both: layer 1 MoE)
    if not deepseek and arch != "qwen3_next":
        raise ValueError(f"no tiny MTP layout for {arch!r}: deepseek_v3, glm4_moe or qwen3_next")
    extra_config = {"num_nextn_predict_layers" if deepseek else "mtp_num_hidden_layers": 1}
    path = write_tiny_model(path, arch, seed=seed, **extra_config)
    weights = load_file(path / "model.safetensors")
    layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    gen = torch.Generator().manual_seed(seed + 1)
    src = "model.layers.1." if deepseek else "model.layers.2."
    dst = f"model.layers.{layers}." if deepseek else "mtp."
    block = dst if deepseek else "mtp.layers.0."
    extra = {}
    for name, w in weights.items():
        if name.startswith(src):
            noise = torch.randn(w.shape, generator=gen) * (0.3 * float(w.float().std() or 0.1))
            extra[block + name[len(src) :]] = (w + noise.to(w.dtype)).contiguous()
    d = weights["model.embed_tokens.weight"].shape[1]
    vocab = weights["model.embed_tokens.weight"].shape[0]
    if deepseek:
        norms, fc = ("enorm", "hnorm", "shared_head.norm"), "eh_proj"
    else:  # (1 + w) norms
        norms, fc = ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"), "fc"
    for norm in norms:
        extra[f"{dst}{norm}.weight"] = torch.randn(d, generator=gen) * 0.1 + (
            1.0 if deepseek else 0.0
        )
    extra[f"{dst}{fc}.weight"] = torch.randn((d, 2 * d), generator=gen) * (2 * d) ** -0.5
    if deepseek and own_embed:
        extra[f"{dst}embed_tokens.weight"] = torch.randn((vocab, d), generator=gen) * 0.5
    if deepseek and own_head:
        extra[f"{dst}shared_head.head.weight"] = torch.randn((vocab, d), generator=gen) * d**-0.5
    save_file({**weights, **extra}, path / "model.safetensors", metadata={"format": "pt"})
    return path


def write_tiny_classifier(
    path: str | Path,
    arch: str,
    *,
    num_labels: int = 3,
    seed: int = 0,
    kind: str = "Sequence",
    **config_overrides: Any,
) -> Path:
    """Write a tiny HF `*ForSequenceClassification` model directory (transformers' class for
    `arch`'s config, random weights including the `score` head) and return its path;
    `kind="Token"`: its `*ForTokenClassification` (the same head, on every token)."""
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = tiny_config(arch, num_labels=num_labels, **config_overrides)
    stem = type(config).__name__.removesuffix("Config")
    cls = getattr(transformers, f"{stem}For{kind}Classification", None)
    if cls is None:
        raise ValueError(f"transformers has no {stem}For{kind}Classification")
    config.architectures = [cls.__name__]
    _save_random(cls, config, seed, path)
    build_tiny_tokenizer(config.vocab_size, seed).save_pretrained(path)
    return path


# Encoder-only architectures (models/bert.py) -> their transformers config class.
ENCODER_CONFIGS = {
    "BertModel": "BertConfig",
    "BertForSequenceClassification": "BertConfig",
    "XLMRobertaModel": "XLMRobertaConfig",
    "XLMRobertaForSequenceClassification": "XLMRobertaConfig",
    "ModernBertModel": "ModernBertConfig",
    "ModernBertForSequenceClassification": "ModernBertConfig",
    "RobertaForMaskedLM": "RobertaConfig",
    "BertForMaskedLM": "BertConfig",
    "BertForTokenClassification": "BertConfig",
    "RobertaForTokenClassification": "RobertaConfig",
    "XLMRobertaForTokenClassification": "XLMRobertaConfig",
    "ModernBertForTokenClassification": "ModernBertConfig",
    # no paged class: served by the Transformers backend (models/transformers_backend/encoder.py)
    "ElectraModel": "ElectraConfig",
    "ElectraForSequenceClassification": "ElectraConfig",
}


def write_tiny_encoder(
    path: str | Path, arch: str, *, seed: int = 0, **config_overrides: Any
) -> Path:
    """Write a tiny BERT / XLM-RoBERTa model directory (`arch`: an ENCODER_CONFIGS key; random
    weights, the tiny tokenizer, [CLS] = BOS and [SEP] = EOS ids) and return its path."""
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    kwargs = {
        "vocab_size": TINY_VOCAB_SIZE,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 64,
        "max_position_embeddings": 130,
        **_COMMON,
        "sep_token_id": EOS_ID,
        "cls_token_id": BOS_ID,
        **config_overrides,
    }
    config = getattr(transformers, ENCODER_CONFIGS[arch])(**kwargs)
    config.architectures = [arch]
    _save_random(getattr(transformers, arch), config, seed, path)
    build_tiny_tokenizer(config.vocab_size, seed).save_pretrained(path)
    return path


# LLaVA's chat form: "USER: <image>\nWhat is this?\nASSISTANT:"; content may be a string or
# OpenAI-style parts ({"type": "image"} / {"type": "text", "text": ...}), as HF's templates take.
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'].upper() }}: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def write_tiny_llava(
    path: str | Path,
    *,
    text: str = "llama",
    vision: str = "clip",
    seed: int = 0,
    image_size: int = 30,
    patch_size: int = 6,
    grid_pinpoints: list[list[int]] | None = None,
    onevision: str | None = None,
    **config_overrides: Any,
) -> Path:
    """A tiny random `LlavaForConditionalGeneration` checkpoint with its processor (image
    processor, tokenizer with an `<image>` token, chat template) and return its path. `text`:
    a tiny arch with a Llama-style decoder ("llama", "mistral", "qwen2"); `vision`: "clip" or
    "siglip"; `grid_pinpoints` ([height, width] pairs, multiples of image_size) makes it a
    `LlavaNextForConditionalGeneration` (anyres tiles, image_newline) instead, and with
    `onevision` (a vision_aspect_ratio such as "anyres_max_1") a
    `LlavaOnevisionForConditionalGeneration` (its processor saved as image processor and
    tokenizer: LlavaOnevisionProcessor needs torchvision);
    `config_overrides` go to the wrapper's config (vision_feature_layer, ...)."""
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(TINY_VOCAB_SIZE, seed)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    text_config = tiny_config(text, vocab_size=len(tokenizer)).to_dict()
    vision_fields = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "image_size": image_size,
        "patch_size": patch_size,
    }
    square = {"height": image_size, "width": image_size}
    if vision == "clip":
        vision_config = transformers.CLIPVisionConfig(**vision_fields, projection_dim=32)
        sizes = {"size": {"shortest_edge": image_size}, "crop_size": square}
        image_processor = transformers.CLIPImageProcessor(**sizes)
    elif vision == "siglip":
        vision_config = transformers.SiglipVisionConfig(**vision_fields)
        sizes = {"size": square}
        image_processor = transformers.SiglipImageProcessor(**sizes)
    else:
        raise ValueError(f"vision must be 'clip' or 'siglip', got {vision!r}")
    fields = {
        "text_config": text_config,
        "vision_config": vision_config.to_dict(),
        "image_token_id": image_id,
        **_COMMON,
        **config_overrides,
    }
    if onevision is not None:
        assert grid_pinpoints is not None, "OneVision tiles by grid_pinpoints"
        image_processor = transformers.LlavaOnevisionImageProcessor(
            size=square,
            image_grid_pinpoints=grid_pinpoints,
            image_mean=image_processor.image_mean,
            image_std=image_processor.image_std,
        )
        config = transformers.LlavaOnevisionConfig(
            **fields, image_grid_pinpoints=grid_pinpoints, vision_aspect_ratio=onevision
        )
        _save_random(transformers.LlavaOnevisionForConditionalGeneration, config, seed, path)
        image_processor.save_pretrained(path)
        tokenizer.chat_template = LLAVA_CHAT_TEMPLATE
        tokenizer.save_pretrained(path)
        transformers.GenerationConfig(**_COMMON).save_pretrained(path)
        return path
    if grid_pinpoints is None:
        config = transformers.LlavaConfig(**fields)
        model_cls, processor_cls = (
            transformers.LlavaForConditionalGeneration,
            transformers.LlavaProcessor,
        )
    else:
        if vision == "siglip":  # SigLIP's processor has no crop: square views by resizing
            sizes["crop_size"] = square
        image_processor = transformers.LlavaNextImageProcessor(
            **sizes,
            image_grid_pinpoints=grid_pinpoints,
            image_mean=image_processor.image_mean,
            image_std=image_processor.image_std,
        )
        config = transformers.LlavaNextConfig(**fields, image_grid_pinpoints=grid_pinpoints)
        model_cls, processor_cls = (
            transformers.LlavaNextForConditionalGeneration,
            transformers.LlavaNextProcessor,
        )
    _save_random(model_cls, config, seed, path)
    strategy = config.vision_feature_select_strategy
    processor = processor_cls(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=patch_size,
        vision_feature_select_strategy=strategy,
        num_additional_image_tokens=1 if vision == "clip" else 0,
        chat_template=LLAVA_CHAT_TEMPLATE,
    )
    tokenizer.chat_template = LLAVA_CHAT_TEMPLATE
    processor.save_pretrained(path)
    transformers.GenerationConfig(**_COMMON).save_pretrained(path)
    return path


QWEN2_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tiny_qwen2_vl(
    path: str | Path,
    *,
    version: str = "2",
    seed: int = 0,
    patch_size: int = 4,
    **vision_overrides: Any,
) -> Path:
    """A tiny random `Qwen2VLForConditionalGeneration` (version "2"),
    `Qwen2_5_VLForConditionalGeneration` ("2.5"), `Qwen3VLForConditionalGeneration` ("3":
    interleaved M-RoPE, deepstack after the first 2 layers) or
    `Qwen3VLMoeForConditionalGeneration` ("3-moe"), `Qwen3_5ForConditionalGeneration` ("3.5")
    or `Qwen3_5MoeForConditionalGeneration` ("3.5-moe") checkpoint with its image processor
    (`patch_size`-pixel patches merged 2 x 2) and tokenizer (Qwen's vision tokens, a chat
    template) and return its path; `vision_overrides` go to the vision config."""
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(TINY_VOCAB_SIZE, seed)
    vision_tokens = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": vision_tokens})
    ids = dict(zip(vision_tokens, tokenizer.convert_tokens_to_ids(vision_tokens), strict=True))
    # head_dim 16: M-RoPE sections of 2, 3, 3 frequencies (temporal, height, width)
    rope = {"rope_type": "default", "rope_theta": 10_000.0, "mrope_section": [2, 3, 3]}
    text = {**_LLAMA_LIKE, "vocab_size": len(tokenizer), "rope_parameters": rope, **_COMMON}
    vision: dict[str, Any] = {"patch_size": patch_size, "spatial_merge_size": 2}
    vision |= {"temporal_patch_size": 2, "depth": 3, "num_heads": 4}
    if version == "2":
        vision |= {"embed_dim": 32, "hidden_size": text["hidden_size"], "mlp_ratio": 2}
        config_cls, model_cls = (
            transformers.Qwen2VLConfig,
            transformers.Qwen2VLForConditionalGeneration,
        )
    elif version == "2.5":
        vision |= {"hidden_size": 32, "intermediate_size": 48}
        vision |= {"out_hidden_size": text["hidden_size"], "fullatt_block_indexes": [1]}
        vision |= {"window_size": 4 * patch_size}  # windows of 2 x 2 merged patches
        config_cls = transformers.Qwen2_5_VLConfig
        model_cls = transformers.Qwen2_5_VLForConditionalGeneration
    elif version in ("3.5", "3.5-moe"):  # a hybrid decoder, Qwen3-VL's tower, no deepstack
        moe = version == "3.5-moe"
        text = tiny_config("qwen3_5_moe" if moe else "qwen3_5", vocab_size=len(tokenizer))
        text = {**text.to_dict(), **_COMMON}
        text["rope_parameters"] = {  # 4 rotary frequencies, interleaved sections
            "rope_type": "default",
            "rope_theta": 10_000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        }
        vision |= {"hidden_size": 32, "intermediate_size": 48, "num_position_embeddings": 16}
        vision |= {"out_hidden_size": text["hidden_size"]}
        name = "Qwen3_5Moe" if moe else "Qwen3_5"
        config_cls = getattr(transformers, f"{name}Config")
        model_cls = getattr(transformers, f"{name}ForConditionalGeneration")
    elif version in ("3", "3-moe"):
        rope["mrope_interleaved"] = True
        vision |= {"hidden_size": 32, "intermediate_size": 48, "num_position_embeddings": 16}
        vision |= {"out_hidden_size": text["hidden_size"], "deepstack_visual_indexes": [0, 2]}
        text["head_dim"] = 16
        if version == "3":
            config_cls = transformers.Qwen3VLConfig
            model_cls = transformers.Qwen3VLForConditionalGeneration
        else:
            text |= {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
            text["decoder_sparse_step"] = 1
            config_cls = transformers.Qwen3VLMoeConfig
            model_cls = transformers.Qwen3VLMoeForConditionalGeneration
    else:
        raise ValueError(
            f"version must be '2', '2.5', '3', '3-moe', '3.5' or '3.5-moe', got {version!r}"
        )
    config = config_cls(
        text_config=text,
        vision_config={**vision, **vision_overrides},
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
        **_COMMON,
    )
    _save_random(model_cls, config, seed, path)
    factor = patch_size * 2
    image_processor = transformers.Qwen2VLImageProcessor(
        patch_size=patch_size,
        merge_size=2,
        temporal_patch_size=2,
        size={"shortest_edge": 4 * factor * factor, "longest_edge": 64 * factor * factor},
    )
    # the image processor and tokenizer apart: Qwen2VLProcessor needs its video processor,
    # which needs torchvision (its settings are written as it saves them)
    image_processor.save_pretrained(path)
    video = {
        "video_processor_type": "Qwen2VLVideoProcessor",
        "patch_size": patch_size,
        "merge_size": 2,
        "temporal_patch_size": 2,
        "size": {"shortest_edge": 4 * factor * factor, "longest_edge": 64 * factor * factor},
        "image_mean": list(image_processor.image_mean),
        "image_std": list(image_processor.image_std),
    }
    if version.startswith("3"):  # Qwen3-VL's: the size bounds a whole video, frames sampled
        video |= {
            "video_processor_type": "Qwen3VLVideoProcessor",
            "size": {"shortest_edge": 4 * factor * factor, "longest_edge": 16 * 64 * factor**2},
            "fps": 2,
            "min_frames": 4,
            "max_frames": 32,
            "do_sample_frames": True,
        }
    (path / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))
    tokenizer.chat_template = QWEN2_VL_CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    transformers.GenerationConfig(**_COMMON).save_pretrained(path)
    return path


IDEFICS3_CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}:"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


def write_tiny_idefics3(
    path: str | Path,
    *,
    arch: str = "idefics3",
    seed: int = 0,
    image_size: int = 32,
    patch_size: int = 8,
    scale_factor: int = 2,
    longest_edge: int = 96,
) -> Path:
    """A tiny random `Idefics3ForConditionalGeneration` (arch "idefics3") or
    `SmolVLMForConditionalGeneration` ("smolvlm") checkpoint with its image processor (tiles of
    `image_size` pixels, images resized to at most `longest_edge`) and tokenizer (the image,
    tile and row / column tokens, a chat template) and return its path. Idefics3 also gets
    its processor (SmolVLM's needs torchvision for its video processor)."""
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(TINY_VOCAB_SIZE, seed)
    grid = [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
    specials = ["<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>", *grid]
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    text = tiny_config("llama", vocab_size=len(tokenizer)).to_dict()
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
    vision |= {"num_attention_heads": 4, "image_size": image_size, "patch_size": patch_size}
    fields = {
        "text_config": text,
        "vision_config": vision,
        "scale_factor": scale_factor,
        "image_token_id": tokenizer.convert_tokens_to_ids("<image>"),
        **_COMMON,
    }
    processor_kwargs = {
        "do_image_splitting": True,
        "max_image_size": {"longest_edge": image_size},
        "size": {"longest_edge": longest_edge},
    }
    if arch == "idefics3":
        config = transformers.Idefics3Config(**fields)
        model_cls = transformers.Idefics3ForConditionalGeneration
        image_processor = transformers.Idefics3ImageProcessor(**processor_kwargs)
    elif arch == "smolvlm":
        config = transformers.SmolVLMConfig(**fields)
        model_cls = transformers.SmolVLMForConditionalGeneration
        image_processor = transformers.SmolVLMImageProcessor(**processor_kwargs)
    else:
        raise ValueError(f"arch must be 'idefics3' or 'smolvlm', got {arch!r}")
    _save_random(model_cls, config, seed, path)
    tokenizer.chat_template = IDEFICS3_CHAT_TEMPLATE
    if arch == "idefics3":
        seq_len = (image_size // patch_size) ** 2 // scale_factor**2
        transformers.Idefics3Processor(
            image_processor=image_processor,
            tokenizer=tokenizer,
            image_seq_len=seq_len,
            chat_template=IDEFICS3_CHAT_TEMPLATE,
        ).save_pretrained(path)
    else:
        image_processor.save_pretrained(path)
        tokenizer.save_pretrained(path)
    transformers.GenerationConfig(**_COMMON).save_pretrained(path)
    return path


GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<start_of_image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
GEMMA3_IMAGE_TOKENS = {
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
    "image_token": "<image_soft_token>",
}


def write_tiny_gemma3(
    path: str | Path,
    *,
    seed: int = 0,
    image_size: int = 32,
    patch_size: int = 4,
    mm_tokens_per_image: int = 16,
    **text_overrides: Any,
) -> Path:
    """A tiny random `Gemma3ForConditionalGeneration` checkpoint (the tiny Gemma 3 text model,
    sliding window 8, so an image's run is longer than the window; a SigLIP tower of
    `image_size` pixels in `patch_size` patches pooled to `mm_tokens_per_image` rows) with its
    processor (image processor, tokenizer with Gemma 3's image tokens, chat template) and
    return its path."""
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    base = build_tiny_tokenizer(TINY_VOCAB_SIZE, seed)
    specials = [*GEMMA3_IMAGE_TOKENS.values(), "<start_of_turn>", "<end_of_turn>"]
    base.add_special_tokens({"additional_special_tokens": specials})
    base.save_pretrained(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        path, extra_special_tokens=GEMMA3_IMAGE_TOKENS
    )
    ids = {k: tokenizer.convert_tokens_to_ids(v) for k, v in GEMMA3_IMAGE_TOKENS.items()}
    text = tiny_config("gemma3", vocab_size=len(tokenizer), **text_overrides).to_dict()
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
    vision |= {"num_attention_heads": 4, "image_size": image_size, "patch_size": patch_size}
    vision |= {"model_type": "siglip_vision_model", "vision_use_head": False}
    config = transformers.Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=mm_tokens_per_image,
        boi_token_index=ids["boi_token"],
        eoi_token_index=ids["eoi_token"],
        image_token_index=ids["image_token"],
        **_COMMON,
    )
    _save_random(transformers.Gemma3ForConditionalGeneration, config, seed, path)
    pil = getattr(transformers, "Gemma3ImageProcessorPil", transformers.Gemma3ImageProcessor)
    image_processor = pil(  # pan-and-scan off, its settings scaled down as a real config has them
        size={"height": image_size, "width": image_size},
        do_pan_and_scan=False,
        pan_and_scan_min_crop_size=image_size // 4,
        pan_and_scan_max_num_crops=3,
        pan_and_scan_min_ratio_to_activate=1.2,
    )
    transformers.Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_length=mm_tokens_per_image,
        chat_template=GEMMA3_CHAT_TEMPLATE,
    ).save_pretrained(path)
    tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    transformers.GenerationConfig(**_COMMON).save_pretrained(path)
    return path


MISTRAL3_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}[INST]"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}[IMG]"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}[/INST]"
    "{% else %}{{ message['content'] }}</s>{% endif %}{% endfor %}"
)


def write_tiny_mistral3(
    path: str | Path,
    *,
    arch: str = "mistral3",
    seed: int = 0,
    patch_size: int = 4,
    longest_edge: int = 64,
) -> Path:
    """A tiny random `Mistral3ForConditionalGeneration` (arch "mistral3": a Pixtral tower,
    patches merged 2 x 2) or Pixtral-12B-style `LlavaForConditionalGeneration` ("llava": a
    Pixtral tower, no merge) checkpoint with its processor (Pixtral's image processor: images
    resized to at most `longest_edge` pixels; a tokenizer with [IMG], [IMG_BREAK], [IMG_END]
    and a chat template; PixtralProcessor itself needs torchvision) and return its path."""
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(TINY_VOCAB_SIZE, seed)
    tokenizer.add_special_tokens(
        {"additional_special_tokens": ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]}
    )
    text = tiny_config("mistral", vocab_size=len(tokenizer)).to_dict()
    vision = {"model_type": "pixtral", "hidden_size": 32, "intermediate_size": 48}
    vision |= {"num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 8}
    vision |= {"patch_size": patch_size, "image_size": longest_edge}
    image_id = tokenizer.convert_tokens_to_ids("[IMG]")
    if arch == "mistral3":
        merge = 2
        config = transformers.Mistral3Config(
            text_config=text,
            vision_config=vision,
            image_token_index=image_id,
            spatial_merge_size=merge,
            **_COMMON,
        )
        model_cls = transformers.Mistral3ForConditionalGeneration
    elif arch == "llava":
        merge = 1
        config = transformers.LlavaConfig(
            text_config=text,
            vision_config=vision,
            image_token_id=image_id,
            vision_feature_select_strategy="full",
            vision_feature_layer=-1,
            **_COMMON,
        )
        model_cls = transformers.LlavaForConditionalGeneration
    else:
        raise ValueError(f"arch must be 'mistral3' or 'llava', got {arch!r}")
    _save_random(model_cls, config, seed, path)
    image_processor = transformers.PixtralImageProcessor(
        patch_size={"height": patch_size, "width": patch_size},
        size={"longest_edge": longest_edge},
    )
    # the image processor and tokenizer apart: PixtralProcessor needs torchvision
    image_processor.save_pretrained(path)
    tokenizer.chat_template = MISTRAL3_CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    transformers.GenerationConfig(**_COMMON).save_pretrained(path)
    return path


INTERNVL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<IMG_CONTEXT>\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tiny_internvl(
    path: str | Path, *, seed: int = 0, image_size: int = 32, patch_size: int = 4
) -> Path:
    """A tiny random `InternVLForConditionalGeneration` checkpoint (a Qwen2 decoder, tiles of
    `image_size` pixels, pixel shuffle by 0.5: (image_size / patch_size)^2 / 4 rows a tile)
    with its image processor (up to 4 tiles and a thumbnail) and tokenizer (<img>, </img>,
    <IMG_CONTEXT>, a chat template; InternVLProcessor itself needs torchvision) and return
    its path."""
    import transformers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(TINY_VOCAB_SIZE, seed)
    specials = ["<img>", "</img>", "<IMG_CONTEXT>"]
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    text = tiny_config("qwen2", vocab_size=len(tokenizer)).to_dict()
    vision = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2}
    vision |= {"num_attention_heads": 4, "image_size": [image_size] * 2}
    vision |= {"patch_size": [patch_size] * 2}
    config = transformers.InternVLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>"),
        downsample_ratio=0.5,
        **_COMMON,
    )
    _save_random(transformers.InternVLForConditionalGeneration, config, seed, path)
    transformers.GotOcr2ImageProcessor(
        size={"height": image_size, "width": image_size}, min_patches=1, max_patches=4
    ).save_pretrained(path)
    tokenizer.chat_template = INTERNVL_CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    transformers.GenerationConfig(**_COMMON).save_pretrained(path)
    return path


def tiny_model_info(path: str | Path) -> dict[str, Any]:
    """config.json of a tiny model dir (handy in benchmarks)."""
    return json.loads((Path(path) / "config.json").read_text())


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _lora_target_layers(model: torch.nn.Module, targets: tuple[str, ...]):
    """(name, in, out, conv1d) of the HF model's linear layers whose last name part is a target
    (GPT-2's Conv1D layers store their weight as [in, out])."""
    found = []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] not in targets:
            continue
        if isinstance(module, torch.nn.Linear):
            found.append((name, module.in_features, module.out_features, False))
        elif type(module).__name__ == "Conv1D":
            found.append((name, module.weight.shape[0], module.weight.shape[1], True))
    return found


def _lora_shape_model(model_dir: Path) -> torch.nn.Module:
    """The HF model of `model_dir`, for its layer names and shapes: loaded when the dir has
    weights, else built from config.json on the meta device (no memory, any size)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not (model_dir / "config.json").is_file():
        raise ValueError(f"model_dir {model_dir} has no config.json")
    weights = [*model_dir.glob("*.safetensors"), *model_dir.glob("pytorch_model*.bin")]
    if weights:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def write_lora_adapter(
    path: str | Path,
    model_dir: str | Path,
    *,
    rank: int = 8,
    alpha: float = 16,
    target_modules: tuple[str, ...] = LORA_TARGETS,
    seed: int = 0,
    use_rslora: bool = False,
) -> Path:
    """A PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) with
    random A and B for the HF model in `model_dir` (B is not zero, unlike a fresh PEFT adapter,
    so the adapter changes the outputs). `model_dir` may hold only config.json (a
    `load_format="dummy"` model): layer names and shapes then come from the model built on the
    meta device, which allocates no weights."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = _lora_shape_model(Path(model_dir))
    layers = _lora_target_layers(model, tuple(target_modules))
    if not layers:
        raise ValueError(f"no layer of {type(model).__name__} matches {target_modules}")
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, n_in, n_out, _ in layers:
        key = f"base_model.model.{name}"
        tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) * n_in**-0.5
        tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) * rank**-0.5
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted({n.rsplit(".", 1)[-1] for n, *_ in layers}),
        "use_rslora": use_rslora,
        "bias": "none",
        "fan_in_fan_out": any(conv for *_, conv in layers),
    }
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return path


@torch.no_grad()
def merge_lora_adapter(model: torch.nn.Module, adapter_dir: str | Path) -> torch.nn.Module:
    """Add an adapter's scale * B @ A to the weights of an HF model (the reference a LoRA
    engine must match: W' = W + scale * B A, or its transpose for GPT-2's Conv1D)."""
    from paged_engine.lora.adapter import read_peft_adapter

    adapter = read_peft_adapter(str(adapter_dir), max_rank=1 << 16)
    modules = dict(model.named_modules())
    for name, lm in adapter.modules.items():
        layer = modules[name]
        delta = lm.scale * (lm.b.double() @ lm.a.double())
        if type(layer).__name__ == "Conv1D":
            delta = delta.t()
        layer.weight += delta.to(layer.weight.dtype)
    return model


def encode_video(frames: Any, fps: int = 6, container: str = "mp4", codec: str = "mpeg4") -> bytes:
    """uint8 frames [T, H, W, 3] (even H and W) encoded with PyAV as `container` bytes, the
    frame rate `fps` (matroska states no frame count: readers count its packets)."""
    import io

    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.height, stream.width = int(frames.shape[1]), int(frames.shape[2])
        stream.pix_fmt = "yuv420p"
        for frame in frames:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        out.mux(stream.encode())
    return buf.getvalue()
