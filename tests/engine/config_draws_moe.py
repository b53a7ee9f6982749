"""The config fuzz's draws of more MoE and per-layer families (merged into config_draws_more.py's
MORE_FAMILIES, so into config_draws.py's FAMILIES): Llama 4's text model (chunked attention,
NoPE layers, MoE interleave), HunYuan-MoE, ERNIE 4.5 MoE, OLMoE, FlexOlmo, MiniMax-M2,
dots.llm1, EXAONE-MoE, GLM-4.7-Flash and DeepSeek-V3.2's latent attention (V3.2's sparse
indexer), Gemma 3n's text model (AltUp, Laurel, KV sharing, activation sparsity),
MiMo-V2-Flash, DBRX and Phi-3.5-MoE. Field names as the families' configuration_*.py spell
them; values as their Hub configs vary them."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from config_draws import FULL, ROPE_TYPES, WINDOW, _base, _flag, _head_dim, _layer_types, _window
from config_draws_more import _gpt_fields, _rope_pinned, ernie4_5, hunyuan_v1_dense


def llama4_text(rng: random.Random) -> dict[str, Any]:
    c = _base(rng)
    c["head_dim"] = c.get("head_dim") or _head_dim(c)
    c["intermediate_size_mlp"] = rng.choice((48, 64, 96))
    c["num_hidden_layers"] = rng.randint(1, 4)
    c["num_local_experts"] = rng.choice((2, 4, 8))
    c["num_experts_per_tok"] = rng.choice((1, 1, 2))
    c["interleave_moe_layer_step"] = rng.choice((1, 2))  # Scout 1, Maverick 2
    if rng.random() < 0.3:
        c["moe_layers"] = sorted(rng.sample(range(c["num_hidden_layers"]), 1))
    c["no_rope_layer_interval"] = rng.choice((2, 4))
    r = rng.random()
    if r < 0.2:  # the Hub's empty list: HF derives it from the interval
        c["no_rope_layers"] = []
    elif r < 0.4:  # 1 = rope, 0 = NoPE
        c["no_rope_layers"] = [rng.choice((0, 1, 1)) for _ in range(c["num_hidden_layers"])]
    c["attention_chunk_size"] = rng.choice((None, 8, 16, 33, 8192))
    c["use_qk_norm"] = rng.random() < 0.6
    c["attn_temperature_tuning"] = rng.random() < 0.7
    c["floor_scale"] = rng.choice((4, 8, 8192))
    c["attn_scale"] = rng.choice((0.1, 0.5))
    _rope_pinned(rng, c, ("llama3", "llama3", *ROPE_TYPES), c["head_dim"])
    return c


def hunyuan_v1_moe(rng: random.Random) -> dict[str, Any]:
    c = hunyuan_v1_dense(rng)
    c["num_experts"] = rng.choice((2, 4, 8))
    k = [rng.randint(1, min(c["num_experts"], 3)) for _ in range(c["num_hidden_layers"])]
    c["moe_topk"] = k if rng.random() < 0.4 else k[0]
    return c


def ernie4_5_moe(rng: random.Random) -> dict[str, Any]:
    c = ernie4_5(rng)
    c["num_hidden_layers"] = rng.randint(1, 3)
    n = c["moe_num_experts"] = rng.choice((4, 8))
    c["moe_k"] = rng.randint(1, min(n, 3))
    c["moe_intermediate_size"] = rng.choice((16, 32))
    c["moe_num_shared_experts"] = rng.choice((0, 1, 2))
    c["moe_layer_start_index"] = rng.randint(0, 1)
    c["moe_layer_end_index"] = rng.choice((-1, c["num_hidden_layers"] - 1))
    c["moe_layer_interval"] = rng.choice((1, 1, 2))
    c["moe_norm_min"] = 1e-12
    return c


def olmoe(rng: random.Random) -> dict[str, Any]:
    c = _base(rng)
    c.pop("head_dim", None)  # (HF sizes its q / k norms by hidden_size: no other head_dim)
    n = c["num_experts"] = rng.choice((4, 8))
    c["num_experts_per_tok"] = rng.randint(1, min(n, 4))
    c["norm_topk_prob"] = rng.random() < 0.4
    c["clip_qkv"] = rng.choice((None, None, 8.0, 0.5))
    _flag(rng, c, "attention_bias", p=0.2)
    _rope_pinned(rng, c, ("linear", "dynamic"), _head_dim(c))
    return c


def flex_olmo(rng: random.Random) -> dict[str, Any]:
    c = olmoe(rng)
    del c["clip_qkv"]
    return c


def minimax_m2(rng: random.Random) -> dict[str, Any]:
    c = _base(rng)
    c["head_dim"] = c.get("head_dim") or _head_dim(c)
    c["rotary_dim"] = rng.choice([d for d in (c["head_dim"] // 2, c["head_dim"]) if d % 2 == 0])
    n = c["num_local_experts"] = rng.choice((4, 8))
    c["num_experts_per_tok"] = rng.randint(1, min(n, 4))
    _rope_pinned(rng, c, ("yarn", "linear"), c["rotary_dim"])
    return c


def dots1(rng: random.Random) -> dict[str, Any]:
    c = _base(rng)
    n = c["n_routed_experts"] = rng.choice((4, 8))
    c["num_experts_per_tok"] = rng.randint(1, 3)
    c["n_shared_experts"] = rng.choice((1, 2))
    c["moe_intermediate_size"] = rng.choice((16, 32))
    c["first_k_dense_replace"] = rng.randint(0, min(1, c["num_hidden_layers"] - 1))
    c["routed_scaling_factor"] = rng.choice((1.0, 2.5))
    c["norm_topk_prob"] = rng.random() < 0.7
    c["n_group"] = rng.choice([g for g in (1, 2) if n // g >= 2])
    c["topk_group"] = c["n_group"]
    _flag(rng, c, "attention_bias", p=0.2)
    if rng.random() < 0.4:
        c["sliding_window"] = _window(rng, c)
        c["max_window_layers"] = rng.randint(0, c["num_hidden_layers"])
    else:
        c["sliding_window"] = None
    _rope_pinned(rng, c, ROPE_TYPES, _head_dim(c))
    return c


def exaone_moe(rng: random.Random) -> dict[str, Any]:
    c = _base(rng)  # (K-EXAONE: head_dim 128 != hidden / heads)
    c["num_hidden_layers"] = rng.randint(1, 4)
    c["sliding_window"] = _window(rng, c)
    if rng.random() < 0.5:
        c["sliding_window_pattern"] = rng.choice((2, 4))
    else:
        c["layer_types"] = _layer_types(rng, c["num_hidden_layers"])
    c["first_k_dense_replace"] = rng.randint(0, 1)
    n = c["num_experts"] = rng.choice((4, 8))
    c["num_experts_per_tok"] = rng.randint(1, 3)
    c["num_shared_experts"] = 1  # (0 builds an empty HF expert; no release drops it)
    c["moe_intermediate_size"] = rng.choice((16, 32))
    c["routed_scaling_factor"] = rng.choice((1.0, 2.5))
    c["norm_topk_prob"] = rng.random() < 0.7
    c["n_group"] = rng.choice([g for g in (1, 2) if n // g >= 2])
    c["topk_group"] = c["n_group"]
    _rope_pinned(rng, c, ROPE_TYPES, _head_dim(c))
    return c


def glm4_moe_lite(rng: random.Random) -> dict[str, Any]:
    from config_draws import _mla_moe

    c = _base(rng)
    _mla_moe(rng, c)
    c["rope_interleave"] = rng.random() < 0.7
    c["n_group"], c["topk_group"] = 1, 1  # GLM-4.7-Flash: no groups
    n = c["num_hidden_layers"]
    c["mlp_layer_types"] = [rng.choice(("dense", "sparse")) for _ in range(n)]
    del c["first_k_dense_replace"]
    _rope_pinned(rng, c, ("yarn",), c["qk_rope_head_dim"])
    return c


def _per_type_ropes(rng: random.Random, partial: float | None = None) -> dict[str, Any]:
    """rope_parameters with a plain rope per layer type (Gemma 3n, MiMo-V2-Flash)."""
    out = {}
    for kind in (FULL, WINDOW):
        out[kind] = {"rope_type": "default", "rope_theta": rng.choice((10_000.0, 1_000_000.0))}
        if partial is not None:
            out[kind]["partial_rotary_factor"] = partial
    return out


def gemma3n_text(rng: random.Random) -> dict[str, Any]:
    c = _base(rng)
    c["head_dim"] = rng.choice((8, 16, 32))
    n = c["num_hidden_layers"] = rng.randint(2, 6)
    c["layer_types"] = types = _layer_types(rng, n)
    # the last `shared` layers read the cache of the last unshared layer of their type: HF
    # wants the types of both groups alike
    shared = rng.choice(
        [k for k in range(n) if set(types[n - k :]) in (set(), set(types[: n - k]))]
    )
    c["num_kv_shared_layers"] = shared
    c["sliding_window"] = _window(rng, c)
    if rng.random() < 0.5:
        c["intermediate_size"] = [rng.choice((32, 64, 96)) for _ in range(n)]
    c["hidden_size_per_layer_input"] = rng.choice((4, 8))
    c["vocab_size_per_layer_input"] = c["vocab_size"]
    c["altup_num_inputs"] = rng.choice((2, 4))
    c["laurel_rank"] = rng.choice((4, 8))
    c["activation_sparsity_pattern"] = [rng.choice((0.95, 0.0, 0.0)) for _ in range(n)]
    c["final_logit_softcapping"] = rng.choice((30.0, 10.0))  # (HF: not None)
    c["hidden_activation"] = "gelu_pytorch_tanh"
    c["rms_norm_eps"] = 1e-6
    c["rope_parameters"] = _per_type_ropes(rng)
    return c


def mimo_v2_flash(rng: random.Random) -> dict[str, Any]:
    c = _base(rng)
    c["num_key_value_heads"] = max(c["num_key_value_heads"] // 2, 1)  # (sliding layers: x2)
    # (24, 32: even rotary dims at HF's default factor 0.334 too, which the Hub layout's
    # top-level rope fields leave in force)
    c["head_dim"] = rng.choice((24, 32))
    c["v_head_dim"] = rng.choice((8, 16, c["head_dim"], c["head_dim"] + 16))  # (HF: any width)
    n = c["num_hidden_layers"] = rng.randint(1, 4)
    c["layer_types"] = _layer_types(rng, n)
    c["mlp_layer_types"] = [rng.choice(("dense", "sparse")) for _ in range(n)]
    c["sliding_window"] = _window(rng, c)
    if rng.random() < 0.3:  # the Hub's spelling: the window past the query (HF adds 1)
        c["sliding_window_size"] = c["sliding_window"] - 1
    c["attention_value_scale"] = rng.choice((None, 0.707, 0.5))
    c["attention_bias"] = rng.random() < 0.2
    c["rope_parameters"] = _per_type_ropes(rng, rng.choice((0.5, 1.0)))
    e = c["n_routed_experts"] = rng.choice((4, 8))
    c["num_experts_per_tok"] = rng.randint(1, 3)
    c["moe_intermediate_size"] = rng.choice((16, 32))
    c["routed_scaling_factor"] = rng.choice((None, 1.0, 2.5))  # the Hub's null: 1
    c["norm_topk_prob"] = rng.random() < 0.7
    c["n_group"] = rng.choice([g for g in (1, 2) if e // g >= 2])
    c["topk_group"] = c["n_group"]
    return c


def deepseek_v32(rng: random.Random) -> dict[str, Any]:
    from config_draws import _mla_moe

    c = _base(rng)
    _mla_moe(rng, c)
    c["q_lora_rank"] = rng.choice((16, 32))  # (HF's V3.2: an int)
    c["rope_interleave"] = rng.random() < 0.7
    c["index_topk"] = rng.choice((4, 8, 16, 64))  # (fewer than a prompt's tokens: sparse)
    c["index_head_dim"] = rng.choice((8, 16))
    # 8+ heads (the release's 64): the indexer's ReLU'd scores of a few heads tie at exactly 0
    # on many keys, and which tied key a top-k keeps is the implementation's choice
    c["index_n_heads"] = rng.choice((8, 16))
    c["head_dim"] = c["qk_rope_head_dim"]  # (HF: the rope width)
    _rope_pinned(rng, c, ("yarn",), c["qk_rope_head_dim"])
    return c


def dbrx(rng: random.Random) -> dict[str, Any]:
    c = _gpt_fields(rng)
    heads = c["num_attention_heads"]
    theta = rng.choice((10_000.0, 500_000.0))
    c["attn_config"] = {
        "kv_n_heads": rng.choice(sorted({heads, max(heads // 2, 1), 1})),
        "clip_qkv": rng.choice((8.0, 0.5)),  # (HF's DBRX clamps by it always: no None)
        "rope_theta": theta,
    }
    c["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    n = rng.choice((4, 8))
    c["ffn_config"] = {
        "ffn_hidden_size": rng.choice((16, 32)),
        "moe_num_experts": n,
        "moe_top_k": rng.randint(1, min(n, 4)),
        "moe_normalize_expert_weights": rng.choice((1.0, None)),
    }
    c["tie_word_embeddings"] = False  # (HF refuses tied DBRX heads)
    # d_model by its own name: HF sizes ffn_config's experts by d_model before it maps a
    # hidden_size onto it (the experts would keep the tiny default's width)
    c["d_model"] = c.pop("hidden_size")
    return c


def phimoe(rng: random.Random) -> dict[str, Any]:
    c = _base(rng)
    c.pop("head_dim", None)
    c["num_local_experts"] = rng.choice((4, 8))
    c["num_experts_per_tok"] = 2  # (SparseMixer: top-2 only)
    c["router_jitter_noise"] = rng.choice((0.01, 0.1))
    c["attention_bias"] = c["lm_head_bias"] = rng.random() < 0.8
    c["sliding_window"] = rng.choice((None, _window(rng, c)))
    _rope_pinned(rng, c, ("longrope",), _head_dim(c))
    if c["rope_scaling"]:  # Phi-3.5-MoE's attention scales of the two factor sets
        c["rope_scaling"]["short_mscale"], c["rope_scaling"]["long_mscale"] = 1.243, 1.243
    return c


# family -> (write_tiny_model's arch, the draw)
MOE_FAMILIES: dict[str, tuple[str, Callable[[random.Random], dict[str, Any]]]] = {
    "llama4_text": ("llama4", llama4_text),
    "hunyuan_v1_moe": ("hunyuan_v1_moe", hunyuan_v1_moe),
    "ernie4_5_moe": ("ernie4_5_moe", ernie4_5_moe),
    "olmoe": ("olmoe", olmoe),
    "flex_olmo": ("flex_olmo", flex_olmo),
    "minimax_m2": ("minimax_m2", minimax_m2),
    "dots1": ("dots1", dots1),
    "exaone_moe": ("exaone_moe", exaone_moe),
    "glm4_moe_lite": ("glm4_moe_lite", glm4_moe_lite),
    "gemma3n_text": ("gemma3n", gemma3n_text),
    "mimo_v2_flash": ("mimo_v2_flash", mimo_v2_flash),
    "deepseek_v32": ("deepseek_v32", deepseek_v32),
    "dbrx": ("dbrx", dbrx),
    "phimoe": ("phimoe", phimoe),
}
