"""The family draws of the model-configuration fuzz (config_fuzz.py): for each family a tiny
config (hidden 32-64, 1-3 layers) whose fields take values real Hub configs of the family use:
MHA / GQA / MQA heads, explicit head_dim, biases, tied heads, rope bases and each scaling the
family's HF code takes, sliding windows and layer_types, softcaps, MoE routing fields, DeepSeek's
latent attention shapes. A draw gives write_tiny_model's config overrides."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

ROPE_TYPES = ("linear", "dynamic", "yarn", "llama3", "longrope")
WINDOW, FULL = "sliding_attention", "full_attention"


def _attention(rng: random.Random, hidden: int, head_dim: bool = True) -> dict[str, Any]:
    """Heads as Hub configs set them: MHA, GQA or MQA; maybe head_dim != hidden / heads."""
    heads = rng.choice([h for h in (2, 4, 8) if (hidden // h) % 2 == 0])
    kv = rng.choice(sorted({heads, max(heads // 2, 1), max(heads // 4, 1), 1}))
    out: dict[str, Any] = {"num_attention_heads": heads, "num_key_value_heads": kv}
    if head_dim and rng.random() < 0.4:
        out["head_dim"] = rng.choice((8, 16, 24, 32))
    return out


def _head_dim(c: dict[str, Any]) -> int:
    return c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]


def _rope(rng: random.Random, c: dict[str, Any], types: tuple[str, ...], rotary_dim: int) -> None:
    """rope_theta and maybe a rope_scaling of one of `types` into config `c`."""
    c["rope_theta"] = rng.choice((10_000.0, 50_000.0, 500_000.0, 1_000_000.0))
    kind = rng.choice(("default", "default", *types))
    c["rope_scaling"] = None  # omitted: the family's default (gpt-oss: its YaRN)
    orig = rng.choice((32, 64, 256))  # original_max_position_embeddings
    if kind == "linear":
        c["rope_scaling"] = {"rope_type": "linear", "factor": rng.choice((2.0, 4.0, 8.0))}
    elif kind == "dynamic":
        c["rope_scaling"] = {"rope_type": "dynamic", "factor": rng.choice((2.0, 4.0))}
    elif kind == "llama3":
        c["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": rng.choice((8.0, 32.0)),
            "low_freq_factor": 1.0,
            "high_freq_factor": rng.choice((2.0, 4.0)),
            "original_max_position_embeddings": orig,
        }
    elif kind == "yarn":
        s: dict[str, Any] = {"rope_type": "yarn", "factor": rng.choice((2.0, 4.0, 8.0, 32.0))}
        if rng.random() < 0.7:
            s["original_max_position_embeddings"] = orig
        if rng.random() < 0.3:
            s["beta_fast"], s["beta_slow"] = rng.choice(((32.0, 1.0), (8.0, 2.0)))
        r = rng.random()
        if r < 0.25:
            s["attention_factor"] = rng.choice((0.8, 1.0, 1.25))
        elif r < 0.5:
            s["mscale"], s["mscale_all_dim"] = rng.choice(((1.0, 0.707), (1.0, 1.0), (0.707, 1.0)))
        if rng.random() < 0.25:
            s["truncate"] = False
        c["rope_scaling"] = s
    elif kind == "longrope":
        # HF switches to the long factors past `orig` per forward; paged fixes one set for
        # max_model_len (documented in layers/rotary.py): orig 256 keeps the short set, 32
        # the long one (the prompts are drawn longer than 32 then).
        orig = rng.choice((32, 256))
        half = rotary_dim // 2
        c["max_position_embeddings"] = max(c["max_position_embeddings"], 4 * orig)
        c["rope_scaling"] = {
            "rope_type": "longrope",
            "short_factor": [round(rng.uniform(1.0, 1.2), 3) for _ in range(half)],
            "long_factor": [round(rng.uniform(1.0, 16.0), 3) for _ in range(half)],
            "original_max_position_embeddings": orig,
        }


def _window(rng: random.Random, c: dict[str, Any]) -> int:
    return rng.choice((6, 8, 16, 33))


def _layer_types(rng: random.Random, n: int) -> list[str]:
    return [rng.choice((WINDOW, FULL)) for _ in range(n)]


def _base(rng: random.Random) -> dict[str, Any]:
    hidden = rng.choice((32, 48, 64))
    c = {
        "hidden_size": hidden,
        "intermediate_size": rng.choice((32, 64, 96, 128)),
        "num_hidden_layers": rng.randint(1, 3),
        "vocab_size": rng.randint(264, 320),  # the tiny byte-level tokenizer needs 261+
        # 64: shorter than the prompts; a static rope scaling stretches it or it is refused
        "max_position_embeddings": rng.choice((64, 128, 128, 256, 1024)),
        "tie_word_embeddings": rng.random() < 0.5,
    }
    c.update(_attention(rng, hidden))
    return c


def _flag(rng: random.Random, c: dict[str, Any], *names: str, p: float = 0.4) -> None:
    for name in names:  # set either way: the tiny defaults may hold the other value
        c[name] = rng.random() < p


def llama(rng: random.Random) -> dict[str, Any]:
    c = _base(rng)
    _flag(rng, c, "attention_bias", "mlp_bias")
    _rope(rng, c, ROPE_TYPES, _head_dim(c))
    return c


def mistral(rng: random.Random) -> dict[str, Any]:
    c = _base(rng)
    c["sliding_window"] = rng.choice((None, _window(rng, c)))
    if c["sliding_window"] and rng.random() < 0.4:  # Ministral's per-layer windows
        c["layer_types"] = _layer_types(rng, c["num_hidden_layers"])
    _rope(rng, c, ("linear", "yarn", "llama3"), _head_dim(c))
    return c


def _qwen_window(rng: random.Random, c: dict[str, Any]) -> None:
    if rng.random() < 0.5:
        c["use_sliding_window"] = True
        c["sliding_window"] = _window(rng, c)
        if rng.random() < 0.3:
            c["layer_types"] = _layer_types(rng, c["num_hidden_layers"])
        if rng.random() < 0.7:
            c["max_window_layers"] = rng.randint(0, c["num_hidden_layers"])
    elif rng.random() < 0.3:  # a window switched off: HF ignores it
        c["use_sliding_window"], c["sliding_window"] = False, 8


def qwen2(rng: random.Random) -> dict[str, Any]:
    c = _base(rng)
    c.pop("head_dim", None)
    _qwen_window(rng, c)
    _rope(rng, c, ("yarn", "dynamic", "linear"), _head_dim(c))
    return c


def qwen3(rng: random.Random) -> dict[str, Any]:
    c = _base(rng)
    _flag(rng, c, "attention_bias", p=0.2)
    _qwen_window(rng, c)
    _rope(rng, c, ("yarn", "dynamic", "linear"), _head_dim(c))
    return c


def qwen3_moe(rng: random.Random) -> dict[str, Any]:
    c = qwen3(rng)
    c.pop("layer_types", None)  # not a Qwen3-MoE field: HF's slides every layer (or crashes)
    n = c["num_experts"] = rng.choice((4, 6, 8))
    c["num_experts_per_tok"] = rng.randint(1, min(n, 4))
    c["moe_intermediate_size"] = rng.choice((16, 32, 48))
    c["norm_topk_prob"] = rng.random() < 0.5
    c["decoder_sparse_step"] = rng.choice((1, 1, 2))
    if rng.random() < 0.3:
        c["mlp_only_layers"] = rng.sample(range(c["num_hidden_layers"]), 1)
    return c


def mixtral(rng: random.Random) -> dict[str, Any]:
    c = _base(rng)
    c["sliding_window"] = rng.choice((None, _window(rng, c)))
    n = c["num_local_experts"] = rng.choice((2, 4, 8))
    c["num_experts_per_tok"] = rng.randint(1, min(n, 3))
    _rope(rng, c, ("linear", "yarn"), _head_dim(c))
    return c


def _gemma_common(rng: random.Random, c: dict[str, Any], gemma1: bool = False) -> None:
    if gemma1:  # HF 5's Gemma reads hidden_act (the legacy "gelu" meaning tanh)
        c["hidden_act"] = rng.choice(("gelu", "gelu_pytorch_tanh"))
        if rng.random() < 0.5:  # the updated Hub configs' second field (HF 5 ignores it)
            c["hidden_activation"] = "gelu_pytorch_tanh"
    else:
        c["hidden_activation"] = rng.choice(("gelu_pytorch_tanh", "gelu_pytorch_tanh", "gelu"))
    _flag(rng, c, "attention_bias", p=0.2)
    c["rms_norm_eps"] = 1e-6


def gemma(rng: random.Random) -> dict[str, Any]:
    c = _base(rng)
    _gemma_common(rng, c, gemma1=True)
    _rope(rng, c, ("linear", "dynamic"), _head_dim(c))
    return c


def gemma2(rng: random.Random) -> dict[str, Any]:
    c = _base(rng)
    _gemma_common(rng, c)
    c["query_pre_attn_scalar"] = rng.choice((_head_dim(c), c["hidden_size"] // 4, 24))
    c["sliding_window"] = _window(rng, c)
    if rng.random() < 0.3:
        c["layer_types"] = _layer_types(rng, c["num_hidden_layers"])
    c["attn_logit_softcapping"] = rng.choice((None, 50.0, 5.0))
    c["final_logit_softcapping"] = rng.choice((None, 30.0, 3.0))
    _rope(rng, c, ("linear",), _head_dim(c))
    return c


def _per_type_rope(c: dict[str, Any]) -> None:
    """transformers 5.25 reads YaRN's `truncate` from the outer rope_parameters, so with a rope
    per layer type (Gemma 3, OLMo 3) it always truncates (paged follows the field, as vLLM):
    no such Hub config sets it, so the draw leaves it out."""
    if c.get("rope_scaling"):
        c["rope_scaling"].pop("truncate", None)


def gemma3_text(rng: random.Random) -> dict[str, Any]:
    c = _base(rng)
    _gemma_common(rng, c)
    c["query_pre_attn_scalar"] = rng.choice((_head_dim(c), c["hidden_size"] // 4))
    c["sliding_window"] = _window(rng, c)
    c["layer_types"] = _layer_types(rng, c["num_hidden_layers"])
    c["attn_logit_softcapping"] = rng.choice((None, None, 20.0))
    c["final_logit_softcapping"] = rng.choice((None, None, 30.0))
    c["rope_local_base_freq"] = rng.choice((10_000.0, 20_000.0))
    _rope(rng, c, ("linear", "yarn"), _head_dim(c))  # Gemma 3 4b+: linear x8 on full layers
    _per_type_rope(c)
    return c


def phi3(rng: random.Random) -> dict[str, Any]:
    c = _base(rng)
    c.pop("head_dim", None)
    hd = _head_dim(c)
    prf = rng.choice([f for f in (1.0, 0.75, 0.5) if (hd * f) % 2 == 0 and hd * f == int(hd * f)])
    c["partial_rotary_factor"] = prf
    c["sliding_window"] = rng.choice((None, _window(rng, c)))
    _rope(rng, c, ("longrope", "longrope"), int(hd * prf))  # HF's Phi-3 takes no other
    if c["rope_scaling"]:  # Phi-3.5's layout
        c["original_max_position_embeddings"] = c["rope_scaling"].pop(
            "original_max_position_embeddings"
        )
    return c


def _mla_moe(rng: random.Random, c: dict[str, Any]) -> None:
    """DeepSeek's latent attention shapes and routed / shared experts."""
    c.pop("head_dim", None)
    c["num_key_value_heads"] = c["num_attention_heads"]
    c["q_lora_rank"] = rng.choice((None, 16, 32))
    c["kv_lora_rank"] = rng.choice((16, 32))
    c["qk_nope_head_dim"] = rng.choice((8, 16))
    c["qk_rope_head_dim"] = rng.choice((4, 8))
    c["v_head_dim"] = rng.choice((8, 16, 24))
    n = c["n_routed_experts"] = rng.choice((4, 8))
    c["num_experts_per_tok"] = rng.randint(1, 3)
    c["n_shared_experts"] = rng.choice((1, 2))
    c["moe_intermediate_size"] = rng.choice((16, 32))
    c["first_k_dense_replace"] = rng.randint(0, min(1, c["num_hidden_layers"] - 1))
    c["routed_scaling_factor"] = rng.choice((1.0, 1.5, 2.5))
    c["norm_topk_prob"] = rng.random() < 0.5
    # HF scores a group by its best two experts (DeepSeek-V3): two or more a group
    c["n_group"] = rng.choice([g for g in (1, 2, 4) if n % g == 0 and n // g >= 2])
    c["topk_group"] = rng.randint(1, c["n_group"])
    if c["n_group"] * c["num_experts_per_tok"] > n * c["topk_group"]:  # enough experts kept
        c["topk_group"] = c["n_group"]
    c["rms_norm_eps"] = 1e-6


def deepseek_v2(rng: random.Random) -> dict[str, Any]:
    c = _base(rng)
    _mla_moe(rng, c)
    c["topk_method"] = rng.choice(("greedy", "group_limited_greedy"))
    _rope(rng, c, ("yarn",), c["qk_rope_head_dim"])
    return c


def deepseek_v3(rng: random.Random) -> dict[str, Any]:
    c = _base(rng)
    _mla_moe(rng, c)
    c["rope_interleave"] = rng.random() < 0.7
    _rope(rng, c, ("yarn", "yarn"), c["qk_rope_head_dim"])
    return c


def olmo2(rng: random.Random) -> dict[str, Any]:
    c = _base(rng)
    c.pop("head_dim", None)
    _flag(rng, c, "attention_bias", p=0.2)
    _rope(rng, c, ("linear", "yarn", "llama3"), _head_dim(c))
    return c


def granite(rng: random.Random) -> dict[str, Any]:
    c = _base(rng)
    c.pop("head_dim", None)
    _flag(rng, c, "attention_bias", "mlp_bias", p=0.3)
    c["embedding_multiplier"] = rng.choice((1.0, 12.0))
    c["residual_multiplier"] = rng.choice((1.0, 0.22))
    c["attention_multiplier"] = rng.choice((1.0, 0.0078125, 0.25))
    c["logits_scaling"] = rng.choice((1.0, 8.0, 16.0))
    _rope(rng, c, ("linear", "dynamic"), _head_dim(c))
    return c


def gpt_oss(rng: random.Random) -> dict[str, Any]:
    c = _base(rng)
    c["head_dim"] = rng.choice((8, 16))
    c["attention_bias"] = rng.random() < 0.7
    n = c["num_local_experts"] = rng.choice((2, 4, 8))
    c["num_experts_per_tok"] = rng.randint(1, min(n, 4))
    c["sliding_window"] = _window(rng, c)
    c["layer_types"] = _layer_types(rng, c["num_hidden_layers"])
    c["swiglu_limit"] = rng.choice((7.0, 1.0))
    _rope(rng, c, ("yarn", "yarn"), c["head_dim"])
    return c


def cohere(rng: random.Random) -> dict[str, Any]:
    c = _base(rng)
    c.pop("head_dim", None)
    c["use_qk_norm"] = rng.random() < 0.5
    _flag(rng, c, "attention_bias", p=0.3)
    c["logit_scale"] = rng.choice((0.0625, 0.125, 1.0))
    c["layer_norm_eps"] = 1e-5
    _rope(rng, c, ("linear",), _head_dim(c))
    return c


def qwen2_moe(rng: random.Random) -> dict[str, Any]:
    c = qwen2(rng)
    c.pop("layer_types", None)  # Qwen1.5-MoE / Qwen2-57B configs hold none
    c["num_experts"] = rng.choice((4, 8))
    c["num_experts_per_tok"] = rng.randint(1, 4)
    c["moe_intermediate_size"] = rng.choice((16, 32))
    c["shared_expert_intermediate_size"] = rng.choice((32, 64))  # (HF cannot build 0)
    c["norm_topk_prob"] = rng.random() < 0.3
    c["decoder_sparse_step"] = rng.choice((1, 1, 2))
    c["mlp_only_layers"] = rng.choice(([], [0]))
    return c


def cohere2(rng: random.Random) -> dict[str, Any]:
    c = cohere(rng)
    del c["use_qk_norm"]
    c["sliding_window"] = _window(rng, c)
    c["layer_types"] = _layer_types(rng, c["num_hidden_layers"])  # full layers: NoPE
    return c


def olmo3(rng: random.Random) -> dict[str, Any]:
    c = olmo2(rng)
    c["sliding_window"] = _window(rng, c)
    c["layer_types"] = _layer_types(rng, c["num_hidden_layers"])
    _per_type_rope(c)
    return c


def glm4_moe(rng: random.Random) -> dict[str, Any]:
    c = _base(rng)
    c["head_dim"] = rng.choice((16, 32))
    c["partial_rotary_factor"] = rng.choice((0.5, 1.0))
    _flag(rng, c, "attention_bias", "use_qk_norm", p=0.6)
    n = c["n_routed_experts"] = rng.choice((4, 8))
    c["num_experts_per_tok"] = rng.randint(1, 3)
    c["n_shared_experts"] = rng.choice((1, 2))
    c["moe_intermediate_size"] = rng.choice((16, 32))
    c["first_k_dense_replace"] = rng.randint(0, 1)
    c["routed_scaling_factor"] = rng.choice((1.0, 2.5))
    c["norm_topk_prob"] = rng.random() < 0.7
    c["n_group"] = rng.choice([g for g in (1, 2) if n // g >= 2])
    c["topk_group"] = c["n_group"]
    _rope(rng, c, ("yarn",), int(c["head_dim"] * c["partial_rotary_factor"]))
    return c


def smollm3(rng: random.Random) -> dict[str, Any]:
    c = llama(rng)
    c["no_rope_layer_interval"] = rng.choice((2, 3, 4))
    if rng.random() < 0.3:
        c["use_sliding_window"], c["sliding_window"] = True, _window(rng, c)
    c["rope_scaling"] = None if c["rope_scaling"] is None else {"rope_type": "yarn", "factor": 2.0}
    return c


def starcoder2(rng: random.Random) -> dict[str, Any]:
    c = _base(rng)
    c.pop("head_dim", None)
    c["use_bias"] = rng.random() < 0.8
    c["hidden_act"] = "gelu_pytorch_tanh"
    c["sliding_window"] = rng.choice((None, _window(rng, c)))
    c["norm_epsilon"] = 1e-5
    _rope(rng, c, ("linear",), _head_dim(c))
    return c


def exaone4(rng: random.Random) -> dict[str, Any]:
    c = _base(rng)
    c.pop("head_dim", None)
    if rng.random() < 0.6:  # 32B: windows on 3 of 4 layers, NoPE full layers; 1.2B: none
        c["sliding_window"] = _window(rng, c)
        c["layer_types"] = _layer_types(rng, c["num_hidden_layers"])
    else:  # (HF needs the layer types then)
        c["sliding_window"], c["layer_types"] = None, [FULL] * c["num_hidden_layers"]
    _rope(rng, c, ("llama3",), _head_dim(c))
    return c


def granitemoe(rng: random.Random) -> dict[str, Any]:
    c = granite(rng)
    del c["mlp_bias"]
    n = c["num_local_experts"] = rng.choice((2, 4, 8))
    c["num_experts_per_tok"] = rng.randint(1, min(n, 3))
    return c


def glm4(rng: random.Random) -> dict[str, Any]:
    c = _base(rng)
    c["head_dim"] = rng.choice((8, 16, 32))
    c["partial_rotary_factor"] = 0.5
    c["attention_bias"] = rng.random() < 0.8
    _rope(rng, c, ("linear",), c["head_dim"] // 2)
    return c


def ministral(rng: random.Random) -> dict[str, Any]:
    c = mistral(rng)
    c["sliding_window"] = _window(rng, c)
    c["layer_types"] = _layer_types(rng, c["num_hidden_layers"])
    return c


# family -> (write_tiny_model's arch, the draw)
FAMILIES: dict[str, tuple[str, Callable[[random.Random], dict[str, Any]]]] = {
    "llama": ("llama", llama),
    "mistral": ("mistral", mistral),
    "qwen2": ("qwen2", qwen2),
    "qwen3": ("qwen3", qwen3),
    "qwen3_moe": ("qwen3_moe", qwen3_moe),
    "mixtral": ("mixtral", mixtral),
    "gemma": ("gemma", gemma),
    "gemma2": ("gemma2", gemma2),
    "gemma3_text": ("gemma3", gemma3_text),
    "phi3": ("phi3", phi3),
    "deepseek_v2": ("deepseek_v2", deepseek_v2),
    "deepseek_v3": ("deepseek_v3", deepseek_v3),
    "olmo2": ("olmo2", olmo2),
    "granite": ("granite", granite),
    "gpt_oss": ("gpt_oss", gpt_oss),
    "cohere": ("cohere", cohere),
    "qwen2_moe": ("qwen2_moe", qwen2_moe),
    "cohere2": ("cohere2", cohere2),
    "olmo3": ("olmo3", olmo3),
    "glm4_moe": ("glm4_moe", glm4_moe),
    "smollm3": ("smollm3", smollm3),
    "starcoder2": ("starcoder2", starcoder2),
    "exaone4": ("exaone4", exaone4),
    "granitemoe": ("granitemoe", granitemoe),
    "glm4": ("glm4", glm4),
    "ministral": ("ministral", ministral),
}

from config_draws_more import MORE_FAMILIES  # noqa: E402 (its draws build on the ones above)

FAMILIES.update(MORE_FAMILIES)

from config_draws_hybrid import HYBRID_FAMILIES  # noqa: E402 (hybrid / state-space families)

FAMILIES.update(HYBRID_FAMILIES)
