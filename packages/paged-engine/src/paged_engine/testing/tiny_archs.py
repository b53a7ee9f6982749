"""Every tiny architecture `write_tiny_model` knows: its transformers config class and the
small sizes and settings it gets (`_ARCH_DEFAULTS`), the token ids and chat template the
tiny tokenizer shares with them."""

from __future__ import annotations

from typing import Any

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
