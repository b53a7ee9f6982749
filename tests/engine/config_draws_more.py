"""More family draws of the model-configuration fuzz (config_fuzz.py), merged into config_draws.py's
FAMILIES: older GPT-style decoders (GPT-2, GPT-BigCode, GPT-J, CodeGen, GPT-Neo, GPT-NeoX,
BLOOM, MPT, Falcon, Phi-2, Persimmon, StableLM, OLMo v1) and newer Llama-like ones (HunYuan
dense, ERNIE 4.5, Seed-OSS, Apertus, Arcee, InternLM3, Nemotron); config_draws_moe.py's MoE and
per-layer families join MORE_FAMILIES at the end. Each draw varies what the family's Hub configs
vary (heads, head_dim, biases, tied heads, partial rotary, parallel residuals, ALiBi, rope
scalings the family's HF code takes, windows); field names are the family's configuration_*.py's
(GPT-2-era configs through their attribute_map). Import it through config_draws (circular)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from config_draws import (
    ROPE_TYPES,
    _base,
    _flag,
    _head_dim,
    _rope,
    _window,
)


def _rope_pinned(rng: random.Random, c: dict[str, Any], types: tuple[str, ...], dims: int) -> None:
    """_rope, with an unscaled draw pinned as rope_parameters: a null rope_scaling would leave
    the tiny model's default rope_parameters (HunYuan's NTK alpha, Arcee's YaRN) in force."""
    _rope(rng, c, types, dims)
    if c["rope_scaling"] is None:
        c["rope_parameters"] = {"rope_type": "default", "rope_theta": c["rope_theta"]}
        if "partial_rotary_factor" in c:
            c["rope_parameters"]["partial_rotary_factor"] = c["partial_rotary_factor"]


def _mha_base(rng: random.Random) -> dict[str, Any]:
    """_base with one KV head a query head and no explicit head_dim (the GPT-era classes)."""
    c = _base(rng)
    c.pop("head_dim", None)
    c["num_key_value_heads"] = c["num_attention_heads"]
    return c


def _gpt_fields(rng: random.Random) -> dict[str, Any]:
    """hidden / heads / layers / positions under their attribute_map names (GPT-2, GPT-J, ...):
    only fields the class has, so config.json holds no stray Llama fields."""
    hidden = rng.choice((32, 48, 64))
    return {
        "hidden_size": hidden,
        "num_attention_heads": rng.choice([h for h in (2, 4, 8) if (hidden // h) % 2 == 0]),
        "num_hidden_layers": rng.randint(1, 3),
        "vocab_size": rng.randint(264, 320),
        "max_position_embeddings": rng.choice((128, 256, 1024)),
        "tie_word_embeddings": rng.random() < 0.5,
    }


def _partial(rng: random.Random, hd: int, factors: tuple[float, ...]) -> float:
    """A partial rotary factor of `factors` giving an even rotary width of head_dim `hd`, 4 or
    more (HF's dynamic NTK divides by width - 2)."""
    ok = [f for f in factors if hd * f == int(hd * f) and int(hd * f) % 2 == 0 and hd * f >= 4]
    return rng.choice(ok or [1.0])


def gpt_neox(rng: random.Random) -> dict[str, Any]:
    c = _mha_base(rng)
    del c["num_key_value_heads"]
    c["partial_rotary_factor"] = _partial(rng, _head_dim(c), (0.25, 0.5, 1.0))
    c["use_parallel_residual"] = rng.random() < 0.8  # Pythia / NeoX: parallel
    c["attention_bias"] = rng.random() < 0.8
    c["hidden_act"] = rng.choice(("gelu", "gelu_fast"))
    c["layer_norm_eps"] = 1e-5
    _rope_pinned(rng, c, ROPE_TYPES, int(_head_dim(c) * c["partial_rotary_factor"]))
    # HF's GPT-NeoX reads these under NeoX's own names only (and ignores rope_theta)
    c["rotary_pct"] = c.pop("partial_rotary_factor")
    c["rotary_emb_base"] = c.pop("rope_theta")
    return c


def phi(rng: random.Random) -> dict[str, Any]:
    c = _mha_base(rng)  # Phi-1 / 1.5 / 2: MHA
    c["partial_rotary_factor"] = _partial(rng, _head_dim(c), (0.4, 0.5, 0.25))
    c["qk_layernorm"] = rng.random() < 0.3
    c["hidden_act"] = "gelu_new"
    c["layer_norm_eps"] = 1e-5
    _rope_pinned(rng, c, ROPE_TYPES, int(_head_dim(c) * c["partial_rotary_factor"]))
    return c


def stablelm(rng: random.Random) -> dict[str, Any]:
    c = _base(rng)
    c.pop("head_dim", None)
    c["partial_rotary_factor"] = _partial(rng, _head_dim(c), (0.25, 0.25, 0.5, 1.0))
    _flag(rng, c, "use_qkv_bias", "qk_layernorm", "use_parallel_residual", p=0.4)
    c["layer_norm_eps"] = 1e-5
    _rope_pinned(rng, c, ROPE_TYPES, int(_head_dim(c) * c["partial_rotary_factor"]))
    return c


def falcon(rng: random.Random) -> dict[str, Any]:
    c = _mha_base(rng)
    c.pop("intermediate_size")
    heads = c.pop("num_key_value_heads")
    kind = rng.choice(("7b", "40b", "rw", "11b"))
    c["new_decoder_architecture"] = kind in ("40b", "11b")
    c["multi_query"] = kind == "7b" or rng.random() < 0.2
    c["parallel_attn"] = kind != "rw" or rng.random() < 0.3
    c["alibi"] = kind == "rw" and rng.random() < 0.7
    c["bias"] = kind == "rw"
    c["num_kv_heads"] = heads  # (the tiny default's 2 would stay; HF's MHA reads it)
    if c["new_decoder_architecture"]:
        c["num_kv_heads"] = rng.choice(sorted({heads, max(heads // 2, 1), 1}))
        if kind == "11b":
            c["num_ln_in_parallel_attn"] = 1
    if rng.random() < 0.5:
        c["ffn_hidden_size"] = rng.choice((64, 96, 128))
    c["layer_norm_epsilon"] = 1e-5
    c["tie_word_embeddings"] = rng.random() < 0.8
    if not c["alibi"]:
        _rope_pinned(rng, c, ROPE_TYPES, _head_dim(c))
    return c


def gpt2(rng: random.Random) -> dict[str, Any]:
    c = _gpt_fields(rng)
    c["n_inner"] = rng.choice((None, 64, 96))
    c["activation_function"] = rng.choice(("gelu_new", "gelu_new", "gelu", "relu"))
    c["scale_attn_by_inverse_layer_idx"] = rng.random() < 0.2  # Mistral's Stanford GPT-2s
    c["reorder_and_upcast_attn"] = rng.random() < 0.2
    c["tie_word_embeddings"] = rng.random() < 0.8
    return c


def gpt_bigcode(rng: random.Random) -> dict[str, Any]:
    c = _gpt_fields(rng)
    c["n_inner"] = rng.choice((None, 64, 128))
    c["multi_query"] = rng.random() < 0.8  # SantaCoder / StarCoder: MQA
    c["activation_function"] = rng.choice(("gelu_pytorch_tanh", "gelu"))
    c["tie_word_embeddings"] = rng.random() < 0.5
    return c


def gptj(rng: random.Random) -> dict[str, Any]:
    c = _gpt_fields(rng)
    hd = c["hidden_size"] // c["num_attention_heads"]
    c["rotary_dim"] = rng.choice([d for d in (4, 8, 16, hd) if d <= hd])  # (HF: not None)
    c["n_inner"] = rng.choice((None, 64, 128))
    c["activation_function"] = "gelu_new"
    return c


def bloom(rng: random.Random) -> dict[str, Any]:
    c = _gpt_fields(rng)
    # (True: refused by name; no released BLOOM sets it)
    c["apply_residual_connection_post_layernorm"] = rng.random() < 0.1
    c["layer_norm_epsilon"] = 1e-5
    c["tie_word_embeddings"] = rng.random() < 0.8
    return c


def mpt(rng: random.Random) -> dict[str, Any]:
    c = _gpt_fields(rng)
    c["max_seq_len"] = c["max_position_embeddings"]  # (MPT's own name; HF keeps both)
    c["expansion_ratio"] = rng.choice((2, 4))
    c["attn_config"] = {  # (alibi_bias_max: every release's 8; transformers 5.25 ignores it)
        "alibi": True,
        "clip_qkv": rng.choice((None, None, 6.0, 0.5)),
    }
    c["tie_word_embeddings"] = True  # every MPT ties (and HF's MPT head is the embedding)
    return c


def hunyuan_v1_dense(rng: random.Random) -> dict[str, Any]:
    c = _base(rng)
    c["head_dim"] = _head_dim(c)  # explicit: else the tiny default's stays
    _flag(rng, c, "attention_bias", p=0.2)
    _rope_pinned(rng, c, ("linear",), _head_dim(c))
    if c["rope_scaling"] is None and rng.random() < 0.6:  # Hunyuan-A13B / 7B: NTK alpha
        c["rope_scaling"] = {"rope_type": "dynamic", "alpha": rng.choice((1000.0, 50.0))}
        c["rope_scaling"]["factor"] = 1.0
    return c


def ernie4_5(rng: random.Random) -> dict[str, Any]:
    c = _base(rng)
    c["head_dim"] = _head_dim(c)  # explicit: else the tiny default's stays
    c["use_bias"] = rng.random() < 0.3
    c["rms_norm_eps"] = 1e-5
    _rope_pinned(rng, c, ROPE_TYPES, _head_dim(c))
    return c


def seed_oss(rng: random.Random) -> dict[str, Any]:
    c = _base(rng)
    c["head_dim"] = _head_dim(c)  # explicit: else the tiny default's stays
    _flag(rng, c, "attention_bias", p=0.8)
    _flag(rng, c, "attention_out_bias", "mlp_bias", p=0.2)
    _rope_pinned(rng, c, ROPE_TYPES, _head_dim(c))
    return c


def apertus(rng: random.Random) -> dict[str, Any]:
    c = _base(rng)  # (an explicit head_dim: HF's attention reads it)
    c["hidden_act"] = "xielu"
    _flag(rng, c, "attention_bias", p=0.2)
    _rope_pinned(rng, c, ("llama3", "llama3", "yarn"), _head_dim(c))
    return c


def arcee(rng: random.Random) -> dict[str, Any]:
    c = _base(rng)
    c["head_dim"] = _head_dim(c)  # explicit: else the tiny default's stays
    c["hidden_act"] = "relu2"
    _flag(rng, c, "attention_bias", "mlp_bias", p=0.2)
    _rope_pinned(rng, c, ("yarn", *ROPE_TYPES), _head_dim(c))
    return c


def internlm3(rng: random.Random) -> dict[str, Any]:
    c = _base(rng)
    c["head_dim"] = _head_dim(c)  # explicit: else the tiny default's stays
    c["attention_bias"] = c["mlp_bias"] = rng.random() < 0.3  # (HF: qkv_bias == bias)
    _rope_pinned(rng, c, ROPE_TYPES, _head_dim(c))
    return c


def gpt_neo(rng: random.Random) -> dict[str, Any]:
    c = _gpt_fields(rng)
    n = c["num_hidden_layers"]
    pattern = rng.choice((["global", "local"], ["local"], ["global"]))
    c["attention_types"] = [[pattern, n // len(pattern) or 1]]
    if len(pattern) * (n // len(pattern) or 1) != n:  # HF wants one type a layer
        c["num_hidden_layers"] = len(pattern) * (n // len(pattern) or 1)
    c["window_size"] = _window(rng, c)
    c["intermediate_size"] = rng.choice((None, 64, 96))
    c["activation_function"] = "gelu_new"
    return c


def codegen(rng: random.Random) -> dict[str, Any]:
    c = gptj(rng)
    c["num_attention_heads"] = rng.choice([h for h in (4, 8) if c["hidden_size"] // h % 2 == 0])
    hd = c["hidden_size"] // c["num_attention_heads"]  # (4 model-parallel groups of heads)
    c["rotary_dim"] = rng.choice([d for d in (4, 8, hd) if d <= hd])
    c["n_ctx"] = c["max_position_embeddings"]
    return c


def persimmon(rng: random.Random) -> dict[str, Any]:
    c = _mha_base(rng)
    del c["num_key_value_heads"]
    c["partial_rotary_factor"] = _partial(rng, _head_dim(c), (0.5, 0.5, 1.0))
    c["qk_layernorm"] = rng.random() < 0.8
    c["hidden_act"] = "relu2"
    c["layer_norm_eps"] = 1e-5
    _rope_pinned(rng, c, ("linear", "dynamic"), int(_head_dim(c) * c["partial_rotary_factor"]))
    return c


def nemotron(rng: random.Random) -> dict[str, Any]:
    c = _base(rng)
    c["head_dim"] = _head_dim(c)
    c["partial_rotary_factor"] = _partial(rng, c["head_dim"], (0.5, 0.5, 1.0))
    _flag(rng, c, "attention_bias", "mlp_bias", p=0.2)
    c["norm_eps"] = 1e-5
    c["hidden_act"] = "relu2"
    _rope_pinned(rng, c, ("linear", "dynamic"), int(c["head_dim"] * c["partial_rotary_factor"]))
    return c


def olmo(rng: random.Random) -> dict[str, Any]:
    c = _mha_base(rng)
    c["clip_qkv"] = rng.choice((None, 8.0, 0.5))
    _flag(rng, c, "attention_bias", p=0.2)
    _rope_pinned(rng, c, ("linear", "dynamic"), _head_dim(c))
    return c


# family -> (write_tiny_model's arch, the draw)
MORE_FAMILIES: dict[str, tuple[str, Callable[[random.Random], dict[str, Any]]]] = {
    "gpt_neox": ("gpt_neox", gpt_neox),
    "phi": ("phi", phi),
    "stablelm": ("stablelm", stablelm),
    "falcon": ("falcon", falcon),
    "gpt2": ("gpt2", gpt2),
    "gpt_bigcode": ("gpt_bigcode", gpt_bigcode),
    "gptj": ("gptj", gptj),
    "bloom": ("bloom", bloom),
    "mpt": ("mpt", mpt),
    "hunyuan_v1_dense": ("hunyuan_v1_dense", hunyuan_v1_dense),
    "ernie4_5": ("ernie4_5", ernie4_5),
    "seed_oss": ("seed_oss", seed_oss),
    "apertus": ("apertus", apertus),
    "arcee": ("arcee", arcee),
    "internlm3": ("internlm3", internlm3),
    "gpt_neo": ("gpt_neo", gpt_neo),
    "codegen": ("codegen", codegen),
    "persimmon": ("persimmon", persimmon),
    "nemotron": ("nemotron", nemotron),
    "olmo": ("olmo", olmo),
}

from config_draws_moe import MOE_FAMILIES  # noqa: E402 (its draws use the helpers above)

MORE_FAMILIES.update(MOE_FAMILIES)
