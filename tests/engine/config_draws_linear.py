"""The linear-attention, short-conv and recurrent hybrid draws of the model-configuration fuzz
(config_fuzz.py; config_draws_hybrid.py merges them into its families): LFM2 / LFM2-MoE's conv
layers, Qwen3-Next / Qwen3.5's and OLMo Hybrid's Gated DeltaNet, MiniMax-01's lightning
attention, Kimi Linear's KDA, RecurrentGemma's RG-LRU, each among softmax attention layers, with
the heads, conv widths, MoE and rope fields the Hub's configs of each family vary.

Imported through config_draws.py (its and config_draws_hybrid.py's helpers are read from there:
import config_draws first)."""

from __future__ import annotations

import random
from typing import Any

from config_draws import _attention, _flag, _rope
from config_draws_hybrid import ATTN, MAMBA, _core, _layer_pattern, _moe_top_k


def lfm2(rng: random.Random) -> dict[str, Any]:
    """LFM2: short-conv and attention layers (layer_types, or the first Hub configs'
    full_attn_idxs), q / k norms, the MLP width auto-adjusted or not."""
    c = _core(rng, (2, 5))
    c.update(_attention(rng, c["hidden_size"], head_dim=False))
    types = _layer_pattern(rng, c["num_hidden_layers"], ("conv", "conv", ATTN), ATTN)
    if rng.random() < 0.4:
        c["full_attn_idxs"] = [i for i, t in enumerate(types) if t == ATTN]
        c["layer_types"] = None
    else:
        c["layer_types"] = types
    c["intermediate_size"] = rng.choice((64, 96, 128, 192))
    c["block_auto_adjust_ff_dim"] = rng.random() < 0.7
    c["block_multiple_of"] = rng.choice((8, 16, 256))
    c["block_ffn_dim_multiplier"] = rng.choice((1.0, 1.0, 1.5))
    c["conv_L_cache"] = rng.choice((2, 3, 4))
    c["conv_bias"] = rng.random() < 0.2
    c["norm_eps"] = 1e-5
    c["rope_theta"] = rng.choice((10_000.0, 1_000_000.0))
    return c


def lfm2_moe(rng: random.Random) -> dict[str, Any]:
    """LFM2-MoE: LFM2's layers, dense for num_dense_layers, then sigmoid-routed experts (with or
    without the expert bias, renormalized or not, scaled)."""
    c = lfm2(rng)
    for name in ("full_attn_idxs", "block_auto_adjust_ff_dim", "block_multiple_of"):
        c.pop(name, None)
    c.pop("block_ffn_dim_multiplier")
    if c["layer_types"] is None:
        c["layer_types"] = _layer_pattern(rng, c["num_hidden_layers"], ("conv", "conv", ATTN), ATTN)
    c["moe_intermediate_size"] = rng.choice((16, 32))
    c["num_dense_layers"] = rng.randint(0, min(2, c["num_hidden_layers"]))
    n = c["num_experts"] = rng.choice((4, 8))
    c["num_experts_per_tok"] = _moe_top_k(rng, n)
    c["use_expert_bias"] = rng.random() < 0.8
    c["routed_scaling_factor"] = rng.choice((1.0, 1.5))
    c["norm_topk_prob"] = rng.random() < 0.8
    return c


def qwen3_next(rng: random.Random) -> dict[str, Any]:
    """Qwen3-Next: Gated DeltaNet and gated attention layers (layer_types, or the default every
    4th), value heads a multiple of the key heads, partial rope, MoE with a shared expert."""
    c = _core(rng, (2, 4))
    c.update(_attention(rng, c["hidden_size"]))
    c["head_dim"] = rng.choice((8, 16, 32))
    c["intermediate_size"] = rng.choice((32, 64))
    if c["num_hidden_layers"] < 4 or rng.random() < 0.7:  # else the default: every 4th full
        # (transformers 5.25 cannot run a stack without attention: its mask asks an attention
        # cache layer for its size; every Hub config holds one)
        c["layer_types"] = _layer_pattern(rng, c["num_hidden_layers"], (MAMBA, MAMBA, ATTN), ATTN)
    kh = c["linear_num_key_heads"] = rng.choice((1, 2, 4))
    c["linear_num_value_heads"] = kh * rng.choice((1, 2, 4))
    c["linear_key_head_dim"] = rng.choice((8, 16, 32))
    c["linear_value_head_dim"] = rng.choice((8, 16, 32))
    c["linear_conv_kernel_dim"] = rng.choice((2, 3, 4))
    c["partial_rotary_factor"] = rng.choice((0.25, 0.25, 0.5, 1.0))
    n = c["num_experts"] = rng.choice((4, 8))
    c["num_experts_per_tok"] = _moe_top_k(rng, n)
    c["moe_intermediate_size"] = rng.choice((16, 32))
    c["shared_expert_intermediate_size"] = rng.choice((16, 48))
    c["norm_topk_prob"] = rng.random() < 0.8
    c["decoder_sparse_step"] = rng.choice((1, 1, 2))
    c["mlp_only_layers"] = rng.choice(([], [], [0]))
    _flag(rng, c, "attention_bias", p=0.1)
    c["rms_norm_eps"] = 1e-6
    rotary = int(c["head_dim"] * c["partial_rotary_factor"])
    _rope(rng, c, ("yarn", "linear"), rotary)
    return c


def minimax(rng: random.Random) -> dict[str, Any]:
    """MiniMax-01: lightning (linear) attention and softmax attention layers, a blocked
    prefill (block_size), residual alpha / beta per kind, MoE in every layer."""
    c = _core(rng, (2, 4))
    c.update(_attention(rng, c["hidden_size"]))
    c["head_dim"] = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    c["intermediate_size"] = rng.choice((16, 32, 64))
    # (paged refuses a stack without softmax attention, as vLLM; MiniMax's hold 1 in 8)
    c["layer_types"] = _layer_pattern(rng, c["num_hidden_layers"], (MAMBA, MAMBA, ATTN), ATTN)
    c["block_size"] = rng.choice((4, 8, 16, 256))
    n = c["num_local_experts"] = rng.choice((2, 4, 8))
    c["num_experts_per_tok"] = _moe_top_k(rng, n, 2)
    for name in ("linear_attn", "full_attn", "mlp"):
        c[f"{name}_alpha_factor"] = rng.choice((1.0, 1.5, 3.5))
        c[f"{name}_beta_factor"] = rng.choice((1.0, 0.75))
    c["rope_theta"] = rng.choice((10_000.0, 10_000_000.0))
    return c


def kimi_linear(rng: random.Random) -> dict[str, Any]:
    """Kimi Linear: KDA and MLA (NoPE) layers as Moonshot's config gives them
    (linear_attn_config, 1-based layer numbers), a dense first layer, DeepSeek-V3 routing under
    Moonshot's names."""
    c = _core(rng, (2, 4))
    n = c["num_hidden_layers"]
    heads = c["num_attention_heads"] = rng.choice((2, 4))
    c["num_key_value_heads"] = heads
    full = sorted(rng.sample(range(1, n + 1), rng.randint(1, n)))
    c["linear_attn_config"] = {
        "kda_layers": [i for i in range(1, n + 1) if i not in full],
        "full_attn_layers": full,
        "num_heads": rng.choice((2, 4)),
        "head_dim": rng.choice((8, 16, 32)),
        "short_conv_kernel_size": rng.choice((2, 3, 4)),
    }
    c["intermediate_size"] = rng.choice((32, 64))
    c["q_lora_rank"] = rng.choice((None, 16))
    c["kv_lora_rank"] = rng.choice((16, 32))
    c["qk_nope_head_dim"] = rng.choice((8, 16))
    c["qk_rope_head_dim"] = rng.choice((4, 8))
    c["v_head_dim"] = rng.choice((8, 16))
    c["first_k_dense_replace"] = rng.randint(0, min(1, n - 1))
    e = c["num_experts"] = rng.choice((4, 8))
    c["num_shared_experts"] = rng.choice((1, 2))
    c["moe_intermediate_size"] = rng.choice((16, 32))
    c["num_experts_per_token"] = rng.randint(1, 3)
    c["num_expert_group"] = rng.choice([g for g in (1, 2, 4) if e // g >= 2])
    c["topk_group"] = c["num_expert_group"]
    c["moe_renormalize"] = rng.random() < 0.7
    c["routed_scaling_factor"] = rng.choice((1.0, 2.446))
    c["rms_norm_eps"] = 1e-5
    return c


def qwen3_5(rng: random.Random) -> dict[str, Any]:
    """Qwen3.5 (text): Qwen3-Next's layers with a dense MLP."""
    c = qwen3_next(rng)
    for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
        del c[name]
    for name in ("shared_expert_intermediate_size", "norm_topk_prob", "decoder_sparse_step"):
        del c[name]
    del c["mlp_only_layers"]
    return c


def qwen3_5_moe(rng: random.Random) -> dict[str, Any]:
    """Qwen3.5-MoE (text): Qwen3-Next's layers, every MLP sparse with a shared expert."""
    c = qwen3_next(rng)
    for name in ("norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "intermediate_size"):
        del c[name]
    return c


def olmo_hybrid(rng: random.Random) -> dict[str, Any]:
    """OLMo Hybrid: Gated DeltaNet and OLMo 3 attention layers, GVA, negative eigenvalues or
    not."""
    c = _core(rng, (2, 4))
    c.update(_attention(rng, c["hidden_size"], head_dim=False))
    c["intermediate_size"] = rng.choice((32, 64, 128))
    types = _layer_pattern(rng, c["num_hidden_layers"], (MAMBA, MAMBA, ATTN), ATTN)
    if MAMBA not in types:  # (HF's config wants one of each)
        types[(types.index(ATTN) + 1) % len(types)] = MAMBA
    c["layer_types"] = types
    kh = c["linear_num_key_heads"] = rng.choice((1, 2, 4))
    c["linear_num_value_heads"] = kh * rng.choice((1, 2))
    c["linear_key_head_dim"] = rng.choice((8, 16, 32))
    c["linear_value_head_dim"] = rng.choice((8, 16, 32))
    c["linear_conv_kernel_dim"] = rng.choice((2, 3, 4))
    c["linear_allow_neg_eigval"] = rng.random() < 0.7
    c["rms_norm_eps"] = 1e-6
    c["rope_theta"] = rng.choice((10_000.0, 500_000.0))
    return c


def recurrent_gemma(rng: random.Random) -> dict[str, Any]:
    """RecurrentGemma (Griffin): recurrent (RG-LRU) and local attention blocks (block_types
    cycled), the LRU width, window, conv width, logit soft cap, MQA or MHA."""
    c = _core(rng, (3, 5))  # (each cycle of block_types below reaches attention)
    heads = c["num_attention_heads"] = rng.choice(
        [h for h in (2, 4) if (c["hidden_size"] // h) % 4 == 0]
    )
    c["num_key_value_heads"] = rng.choice((1, heads))
    c["intermediate_size"] = rng.choice((64, 96, 128))
    c["block_types"] = rng.choice(
        (["recurrent", "recurrent", "attention"], ["recurrent", "attention"], ["attention"])
    )
    c["lru_width"] = rng.choice((None, 2 * c["hidden_size"]))
    c["attention_window_size"] = rng.choice((6, 16, 33))
    c["conv1d_width"] = rng.choice((2, 4))
    c["logits_soft_cap"] = rng.choice((30.0, 10.0))
    c["rms_norm_eps"] = 1e-6
    return c
