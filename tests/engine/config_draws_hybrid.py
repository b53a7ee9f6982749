"""The hybrid and state-space family draws of the model-configuration fuzz (config_fuzz.py),
merged into config_draws.FAMILIES: tiny configs (hidden 32-64, 2-5 layers) whose fields take the
values real Hub configs of each family use: the layer pattern (attention / Mamba / conv / linear
attention per layer: Jamba's attn_layer_period / offset, Bamba's attn_layer_indices, Nemotron-H's
block types, layer_types), Mamba2 heads (head size, groups, state, conv width, chunk size, dt
clamp, biases), Mamba (v1) dt rank, MoE routing fields, tied heads, rope bases, head_dim and
GQA. Each draw gives write_tiny_model's config overrides; the families' HF field names are those
of transformers' configuration_<family>.py. The Mamba-mixer families are here; the linear
attention / short-conv / recurrent ones in config_draws_linear.py, merged below.

Imported by config_draws.py (its helpers are read from there: import config_draws first)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from config_draws import _attention, _flag

MAMBA, ATTN = "linear_attention", "full_attention"
# transformers 5.25 cannot run a stack without attention layers (its causal mask asks an
# attention cache layer for its size: ValueError get_mask_sizes), so each hybrid draw holds one
# (as every Hub config of these families does); paged's all-linear stacks go unchecked here.


def _core(rng: random.Random, layers: tuple[int, int] = (2, 4)) -> dict[str, Any]:
    """Hidden size, vocab, layers, context, tied head: the fields every family has."""
    return {
        "hidden_size": rng.choice((32, 48, 64)),
        "num_hidden_layers": rng.randint(*layers),
        "vocab_size": rng.randint(264, 320),  # the tiny byte-level tokenizer needs 261+
        "max_position_embeddings": rng.choice((128, 256, 1024)),
        "tie_word_embeddings": rng.random() < 0.5,
    }


def _ssm_heads(rng: random.Random, inner: int) -> tuple[int, int, int]:
    """(heads, head size, groups) of a Mamba2 mixer `inner` channels wide: heads of 8-32 (the
    Hub's 64: Codestral, Bamba, Granite 4), 1 group up to one a head (Nemotron-H's 8)."""
    head = rng.choice([d for d in (8, 16, 32) if inner % d == 0])
    heads = inner // head
    groups = rng.choice([g for g in (1, 1, 2, 4, 8) if heads % g == 0])
    return heads, head, groups


def _state(rng: random.Random) -> int:
    return rng.choice((8, 16, 32, 64, 128))  # Mamba2 Hub configs: 64 / 128 / 256


def _chunk(rng: random.Random) -> int:
    return rng.choice((8, 16, 32, 256))  # below the prompt lengths, or (the Hub's) above


def _dt_limit(rng: random.Random) -> tuple[float, float]:
    """The Hub's (0, inf), or a clamp that bites (softplus(dt) of the random weights ~0.3-1.3)."""
    return rng.choice(((0.0, float("inf")), (0.0, float("inf")), (0.0, 0.9), (0.5, float("inf"))))


def _layer_pattern(
    rng: random.Random, n: int, kinds: tuple[str, ...], need: str | None = None
) -> list[str]:
    """n layer kinds drawn from `kinds`; `need`: one layer at least of that kind."""
    types = [rng.choice(kinds) for _ in range(n)]
    if need is not None and need not in types:
        types[rng.randrange(n)] = need
    return types


def _moe_top_k(rng: random.Random, n: int, most: int = 4) -> int:
    return rng.randint(1, min(n, most))


def jamba(rng: random.Random) -> dict[str, Any]:
    """Jamba: Mamba (v1) layers, attention (no rope) every attn_layer_period from offset, MoE
    every expert_layer_period (v0.1 / 1.5: 8 / 4 and 2 / 1, 16 experts top 2)."""
    c = _core(rng, (2, 5))
    c.update(_attention(rng, c["hidden_size"], head_dim=False))
    c["intermediate_size"] = rng.choice((32, 64, 96))
    period = c["attn_layer_period"] = rng.choice((1, 2, 3, 4, 8))
    c["attn_layer_offset"] = rng.randrange(min(period, c["num_hidden_layers"]))  # (attention)
    period = c["expert_layer_period"] = rng.choice((1, 2, 2))
    c["expert_layer_offset"] = rng.randrange(period)
    n = c["num_experts"] = rng.choice((1, 2, 4, 8, 16))
    c["num_experts_per_tok"] = _moe_top_k(rng, n, 2)
    c["mamba_d_state"] = rng.choice((8, 16))
    c["mamba_d_conv"] = rng.choice((2, 3, 4))
    c["mamba_expand"] = rng.choice((1, 2))
    c["mamba_dt_rank"] = rng.choice(("auto", "auto", 4, 8))
    c["mamba_conv_bias"] = rng.random() < 0.8
    c["mamba_proj_bias"] = rng.random() < 0.2
    c["rms_norm_eps"] = 1e-6
    return c


def _mamba2_fields(rng: random.Random, c: dict[str, Any], expand: bool = True) -> None:
    """Bamba's / Granite 4's / Falcon-H1's mamba_* fields, d_head maybe left to "auto"."""
    c["mamba_expand"] = rng.choice((1, 2)) if expand else 2
    heads, head, groups = _ssm_heads(rng, c["mamba_expand"] * c["hidden_size"])
    c["mamba_n_heads"], c["mamba_n_groups"] = heads, groups
    c["mamba_d_head"] = rng.choice((head, "auto"))
    c["mamba_d_state"] = _state(rng)
    c["mamba_d_conv"] = rng.choice((2, 3, 4))
    c["mamba_chunk_size"] = _chunk(rng)
    c["mamba_conv_bias"] = rng.random() < 0.8
    c["mamba_proj_bias"] = rng.random() < 0.2
    c["time_step_limit"] = _dt_limit(rng)


def bamba(rng: random.Random) -> dict[str, Any]:
    """Bamba: Mamba2 layers and attention at attn_layer_indices (rope over half of each head:
    BambaConfig fixes partial_rotary_factor 0.5)."""
    c = _core(rng)
    c.update(_attention(rng, c["hidden_size"], head_dim=False))
    while (c["hidden_size"] // c["num_attention_heads"]) % 4:  # rope over an even half
        c.update(_attention(rng, c["hidden_size"], head_dim=False))
    c["intermediate_size"] = rng.choice((32, 64, 96))
    n = c["num_hidden_layers"]
    c["attn_layer_indices"] = sorted(rng.sample(range(n), rng.randint(1, n)))
    _mamba2_fields(rng, c)
    _flag(rng, c, "attention_bias", "mlp_bias", p=0.2)
    c["rope_theta"] = rng.choice((10_000.0, 1_000_000.0))
    return c


def falcon_h1(rng: random.Random) -> dict[str, Any]:
    """Falcon-H1: attention (rope, its own head_dim) and a Mamba2 mixer side by side in each
    layer, mamba_d_ssm maybe apart from expand * hidden, µP multipliers (the Hub's != 1)."""
    c = _core(rng, (1, 3))
    c.update(_attention(rng, c["hidden_size"]))
    c["intermediate_size"] = rng.choice((32, 64, 96))
    _mamba2_fields(rng, c, expand=False)
    if rng.random() < 0.5:  # Falcon-H1's d_ssm: heads x head size, not expand x hidden
        heads, head, groups = _ssm_heads(rng, rng.choice((48, 64, 96)))
        c["mamba_d_ssm"], c["mamba_n_heads"], c["mamba_d_head"] = heads * head, heads, head
        c["mamba_n_groups"] = groups
    else:
        c["mamba_d_ssm"] = None
    c["mamba_rms_norm"] = rng.random() < 0.5
    c["mamba_norm_before_gate"] = rng.random() < 0.5
    _flag(rng, c, "attention_bias", "mlp_bias", "projectors_bias", p=0.2)
    c["rope_theta"] = rng.choice((10_000.0, 1e11))  # the Hub's Falcon-H1: 1e11
    if rng.random() < 0.7:
        c["embedding_multiplier"] = rng.choice((1.0, 5.656))
        c["lm_head_multiplier"] = rng.choice((1.0, 0.0390625))
        c["key_multiplier"] = rng.choice((1.0, 0.390625))
        c["attention_in_multiplier"] = rng.choice((1.0, 0.5))
        c["attention_out_multiplier"] = rng.choice((1.0, 0.9375))
        c["ssm_in_multiplier"] = rng.choice((1.0, 1.25))
        c["ssm_out_multiplier"] = rng.choice((1.0, 0.2357))
        c["ssm_multipliers"] = [round(rng.uniform(0.2, 1.5), 4) for _ in range(5)]
        c["mlp_multipliers"] = [round(rng.uniform(0.5, 1.5), 4) for _ in range(2)]
    c["rms_norm_eps"] = 1e-5
    return c


_NEMOTRON_CODES = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}


def nemotron_h(rng: random.Random) -> dict[str, Any]:
    """Nemotron-H: one block a layer, Mamba2 / attention (no rope) / MLP (relu2) / MoE (Nemotron
    3: sigmoid routing with a correction bias, grouped, scaled, shared experts), given as
    layers_block_type or as the Hub's hybrid_override_pattern ("M-M*-ME")."""
    c = _core(rng)
    c.update(_attention(rng, c["hidden_size"]))
    c["head_dim"] = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    n = rng.randint(2, 5)
    # transformers 5.25 cannot run a stack without attention (its mask asks an attention cache
    # layer for its size) or one whose first layer holds no cache (it reads the length there):
    # every Hub pattern starts with "M" and holds a "*"
    codes = "M" + "".join(_layer_pattern(rng, n - 1, tuple("MM*-E"), need="*"))
    if rng.random() < 0.5:
        c["layers_block_type"] = None
        c["hybrid_override_pattern"] = codes
    else:
        c["layers_block_type"] = [_NEMOTRON_CODES[k] for k in codes]
    c["num_hidden_layers"] = n
    c["intermediate_size"] = rng.choice((32, 64, 96))
    heads, head, groups = _ssm_heads(rng, rng.choice((1, 2)) * c["hidden_size"])
    c["mamba_num_heads"], c["mamba_head_dim"], c["n_groups"] = heads, head, groups
    c["ssm_state_size"] = _state(rng)
    c["conv_kernel"] = rng.choice((2, 3, 4))
    c["chunk_size"] = _chunk(rng)
    c["use_conv_bias"] = rng.random() < 0.8
    c["use_bias"] = rng.random() < 0.2  # the mixer's in / out projections
    _flag(rng, c, "attention_bias", "mlp_bias", p=0.2)  # (HF's NemotronH: no attention bias)
    # (transformers < 5.25 clamped at time_step_min: keep them in step)
    lo, _ = c["time_step_limit"] = _dt_limit(rng)
    c["time_step_min"] = lo if lo > 0 else 0.001
    c["residual_in_fp32"] = rng.random() < 0.5
    if "E" in codes:
        e = c["n_routed_experts"] = rng.choice((4, 8))
        c["num_experts_per_tok"] = _moe_top_k(rng, e, 3)
        g = c["n_group"] = rng.choice([g for g in (1, 2, 4) if e // g >= 2])
        c["topk_group"] = rng.randint(1, g)
        if g * c["num_experts_per_tok"] > e * c["topk_group"]:  # enough experts kept
            c["topk_group"] = g
        c["moe_intermediate_size"] = rng.choice((16, 32))
        c["moe_latent_size"] = rng.choice((None, None, 16, 32))  # Nemotron 3 Super's latent MoE
        c["n_shared_experts"] = rng.choice((0, 1))
        c["moe_shared_expert_intermediate_size"] = rng.choice((16, 48))
        c["routed_scaling_factor"] = rng.choice((1.0, 2.5))
        c["norm_topk_prob"] = rng.random() < 0.7
    c["layer_norm_epsilon"] = 1e-5
    return c


def granitemoehybrid(rng: random.Random) -> dict[str, Any]:
    """Granite 4.0-H: Mamba2 and attention layers (Hub: "mamba" / "attention"), MoE plus a
    shared MLP (or dense: num_local_experts 0, Granite 4.0-H-Micro), attention with rope or
    none (position_embedding_type), Granite's multipliers."""
    c = _core(rng)
    c.update(_attention(rng, c["hidden_size"], head_dim=False))
    kinds = ("mamba", "mamba", "attention")
    c["layer_types"] = _layer_pattern(rng, c["num_hidden_layers"], kinds, "attention")
    _mamba2_fields(rng, c)
    n = c["num_local_experts"] = rng.choice((0, 4, 8))
    c["num_experts_per_tok"] = _moe_top_k(rng, max(n, 1), 3)
    c["intermediate_size"] = rng.choice((16, 32, 64))
    c["shared_intermediate_size"] = rng.choice((32, 48, 64))
    c["embedding_multiplier"] = rng.choice((1.0, 12.0))
    c["residual_multiplier"] = rng.choice((1.0, 0.22))
    c["attention_multiplier"] = rng.choice((1.0, 0.0078125, 0.25))
    c["logits_scaling"] = rng.choice((1.0, 8.0))
    c["position_embedding_type"] = rng.choice((None, "nope", "rope"))
    c["rope_theta"] = rng.choice((10_000.0, 1_000_000.0))
    _flag(rng, c, "attention_bias", p=0.1)
    return c


def mamba2(rng: random.Random) -> dict[str, Any]:
    """Mamba2 (Codestral Mamba, mamba2-*m): heads x head size = expand x hidden, groups, state,
    conv, chunk, biases, dt clamp, residuals in float32 or not."""
    c = _core(rng, (1, 3))
    del c["max_position_embeddings"]  # (no positions: none in the Hub's Mamba2 configs)
    c["expand"] = rng.choice((1, 2))
    c["num_heads"], c["head_dim"], c["n_groups"] = _ssm_heads(rng, c["expand"] * c["hidden_size"])
    c["state_size"] = _state(rng)
    c["conv_kernel"] = rng.choice((2, 3, 4))
    c["chunk_size"] = _chunk(rng)
    c["use_bias"] = rng.random() < 0.2
    c["use_conv_bias"] = rng.random() < 0.8
    c["time_step_limit"] = _dt_limit(rng)
    c["residual_in_fp32"] = rng.random() < 0.7
    c["layer_norm_epsilon"] = 1e-5
    return c


def zamba2(rng: random.Random) -> dict[str, Any]:
    """Zamba2: Mamba2 layers, some "hybrid" (first running one of num_mem_blocks shared
    transformer blocks over [hidden | embeddings], with or without per-layer LoRA adapters and
    rope), GQA on the blocks' heads of 2 x hidden / heads."""
    c = _core(rng, (2, 6))
    heads = c["num_attention_heads"] = rng.choice((2, 4, 8))
    c["num_key_value_heads"] = rng.choice(sorted({heads, max(heads // 2, 1)}))
    n = c["num_hidden_layers"]
    c["layers_block_type"] = _layer_pattern(rng, n, ("mamba", "hybrid"), "hybrid")
    # transformers 5 unties the shared blocks along with the embeddings: a block a hybrid layer
    c["tie_word_embeddings"] = rng.random() < 0.5
    c["num_mem_blocks"] = rng.choice((1, 2))
    c["use_shared_attention_adapter"] = rng.random() < 0.5
    if c["use_shared_attention_adapter"]:  # the Hub's Zamba2 are MHA: transformers 5.25 sizes
        c["num_key_value_heads"] = heads  # its k / v adapters for MHA only (GQA crashes)
    c["adapter_rank"] = rng.choice((4, 8))
    c["use_mem_rope"] = rng.random() < 0.7
    c["rope_theta"] = rng.choice((10_000.0, 100_000.0))
    c["mamba_expand"] = 2
    heads, _, groups = _ssm_heads(rng, 2 * c["hidden_size"])
    c["n_mamba_heads"], c["mamba_ngroups"] = heads, groups
    c["mamba_d_state"] = _state(rng)
    c["mamba_d_conv"] = rng.choice((2, 3, 4))
    c["chunk_size"] = _chunk(rng)
    c["use_conv_bias"] = rng.random() < 0.8
    c["add_bias_linear"] = rng.random() < 0.2
    c["intermediate_size"] = rng.choice((None, 64, 128))
    c["hidden_act"] = rng.choice(("gelu", "gelu"))
    return c


def mamba(rng: random.Random) -> dict[str, Any]:
    """Mamba (v1): expand, state, conv width, dt rank ("auto": ceil(hidden / 16)), biases."""
    c = _core(rng, (1, 3))
    del c["max_position_embeddings"]  # (no positions: none in the Hub's Mamba configs)
    c["state_size"] = rng.choice((4, 8, 16))
    c["expand"] = rng.choice((1, 2))
    c["conv_kernel"] = rng.choice((2, 3, 4))
    c["time_step_rank"] = rng.choice(("auto", "auto", 4, 8))
    c["use_bias"] = rng.random() < 0.2
    c["use_conv_bias"] = rng.random() < 0.8
    c["residual_in_fp32"] = rng.random() < 0.7
    c["layer_norm_epsilon"] = 1e-5
    return c


def falcon_mamba(rng: random.Random) -> dict[str, Any]:
    """Falcon Mamba: Mamba (v1) with dt, B and C rms-normalized (mixer_rms_eps)."""
    c = mamba(rng)
    c["mixer_rms_eps"] = rng.choice((1e-6, 1e-5))
    return c


def zamba(rng: random.Random) -> dict[str, Any]:
    """Zamba (v1): Mamba (v1) layers (n_mamba_heads), the hybrid ones by attn_layer_period /
    offset first running the one shared transformer block over [hidden | embeddings]."""
    c = _core(rng, (4, 7))
    heads = c["num_attention_heads"] = rng.choice((2, 4, 8))
    c["num_key_value_heads"] = heads  # Zamba-7B: MHA
    # HF: layer 2 hybrid, then layer 3 + i where i % period == offset; transformers 5.25 cannot
    # build a model with one hybrid layer (its tie keys for the shared block match nothing)
    c["attn_layer_period"] = rng.choice((2, 3, 6))
    c["attn_layer_offset"] = rng.randrange(min(c["attn_layer_period"], c["num_hidden_layers"] - 3))
    c["n_mamba_heads"] = rng.choice((1, 2, 4))
    c["mamba_d_state"] = rng.choice((8, 16))
    c["mamba_d_conv"] = rng.choice((2, 3, 4))
    c["mamba_expand"] = 2
    c["mamba_dt_rank"] = rng.choice(("auto", 8))
    c["mamba_conv_bias"] = rng.random() < 0.8
    c["mamba_proj_bias"] = rng.random() < 0.2
    c["intermediate_size"] = rng.choice((64, 128))
    c["hidden_act"] = "gelu"
    c["tie_word_embeddings"] = rng.random() < 0.5  # (untied: the block too, as Zamba2's)
    return c


def _every(i: int, n: int) -> str:
    return ATTN if (i + 1) % n == 0 else MAMBA


def to_hub_layer_names(config: dict[str, Any], rng: random.Random) -> list[str]:
    """config.json's layer pattern (as HF saves it) rewritten in place as the Hub's configs of
    the family spell it: Nemotron-H's hybrid_override_pattern, Granite 4's and Zamba2's
    "mamba" / "attention", Kimi Linear's linear_attn_config alone. The edits made."""
    kind = config["model_type"]
    if kind == "nemotron_h" and rng.random() < 0.7:
        codes = {v: k for k, v in _NEMOTRON_CODES.items()} | {MAMBA: "M", ATTN: "*"}
        types = config.pop("layers_block_type")
        config["hybrid_override_pattern"] = "".join(codes[t] for t in types)
        return ["hybrid_override_pattern"]
    key = {"granitemoehybrid": "layer_types", "zamba2": "layers_block_type"}.get(kind)
    if key and rng.random() < 0.7:
        names = {MAMBA: "mamba", ATTN: "attention"}
        config[key] = [names.get(t, t) for t in config[key]]
        return [f"{key} mamba / attention"]
    if kind == "lfm2" and rng.random() < 0.5:  # LFM2's first configs
        types = config.pop("layer_types")
        config["full_attn_idxs"] = [i for i, t in enumerate(types) if t == ATTN]
        return ["full_attn_idxs"]
    types = config.get("layer_types") or []
    every = [n for n in range(2, 5) if types == [_every(i, n) for i in range(len(types))]]
    if kind.startswith("qwen3_") and every and rng.random() < 0.7:  # Qwen3-Next's interval
        del config["layer_types"]
        config["full_attention_interval"] = every[0]
        return [f"full_attention_interval {every[0]}"]
    if kind == "kimi_linear" and rng.random() < 0.7:
        for name in ("layer_types", "mlp_layer_types", "linear_head_dim", "linear_num_heads"):
            config.pop(name, None)
        config.pop("linear_conv_kernel_dim", None)
        return ["linear_attn_config alone"]
    return []


from config_draws_linear import (  # noqa: E402 (its draws build on the helpers above)
    kimi_linear,
    lfm2,
    lfm2_moe,
    minimax,
    olmo_hybrid,
    qwen3_5,
    qwen3_5_moe,
    qwen3_next,
    recurrent_gemma,
)

# family -> (write_tiny_model's arch, the draw)
HYBRID_FAMILIES: dict[str, tuple[str, Callable[[random.Random], dict[str, Any]]]] = {
    "jamba": ("jamba", jamba),
    "bamba": ("bamba", bamba),
    "falcon_h1": ("falcon_h1", falcon_h1),
    "nemotron_h": ("nemotron_h", nemotron_h),
    "granitemoehybrid": ("granitemoehybrid", granitemoehybrid),
    "lfm2": ("lfm2", lfm2),
    "lfm2_moe": ("lfm2_moe", lfm2_moe),
    "qwen3_next": ("qwen3_next", qwen3_next),
    "mamba2": ("mamba2", mamba2),
    "zamba2": ("zamba2", zamba2),
    "mamba": ("mamba", mamba),
    "falcon_mamba": ("falcon_mamba", falcon_mamba),
    "minimax": ("minimax", minimax),
    "kimi_linear": ("kimi_linear", kimi_linear),
    "qwen3_5": ("qwen3_5", qwen3_5),
    "qwen3_5_moe": ("qwen3_5_moe", qwen3_5_moe),
    "zamba": ("zamba", zamba),
    "olmo_hybrid": ("olmo_hybrid", olmo_hybrid),
    "recurrent_gemma": ("recurrent_gemma", recurrent_gemma),
}
