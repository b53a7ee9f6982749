"""Checks of config_draws_more.py's family draws (the config fuzz's older GPT-style, Llama-like
and MoE families): every draw builds an HF config of its family that holds what was drawn (no
field left at the tiny model's default: a null rope_scaling once left HunYuan's NTK alpha and
Arcee's YaRN in force, GPT-NeoX ignores rope_theta / partial_rotary_factor under any name but
its own, and an omitted head_dim kept the tiny default's 32), and the draws of the families
whose transformers code has a quirk keep clear of it. Configs only: no model is built."""

from __future__ import annotations

import random
from typing import Any

import pytest
from config_draws import FAMILIES
from config_draws_more import MORE_FAMILIES

pytest.importorskip("transformers")

SEEDS = range(12)
MLA = ("glm4_moe_lite", "deepseek_v32")  # (their head_dim: the rope's width)


def _hf_config(family: str, seed: int) -> tuple[dict[str, Any], Any]:
    from paged_engine.testing import tiny_config

    arch, draw = MORE_FAMILIES[family]
    drawn = draw(random.Random(seed))
    return drawn, tiny_config(arch, **drawn)


def test_the_more_families_are_merged_into_the_fuzz():
    assert all(FAMILIES[name] == entry for name, entry in MORE_FAMILIES.items())


@pytest.mark.parametrize("family", list(MORE_FAMILIES))
def test_the_hf_config_holds_the_draw(family):
    for seed in SEEDS:
        drawn, hf = _hf_config(family, seed)
        rope = getattr(hf, "rope_parameters", None) or {}
        theta = drawn.get("rope_theta", drawn.get("rotary_emb_base"))
        if theta is not None and "full_attention" not in rope:
            assert rope.get("rope_theta") == theta, (seed, rope)
        partial = drawn.get("partial_rotary_factor", drawn.get("rotary_pct"))
        if partial is not None:
            assert rope.get("partial_rotary_factor", 1.0) == partial, (seed, rope)
        if family not in MLA:
            hidden = drawn.get("hidden_size", drawn.get("d_model"))
            want = drawn.get("head_dim") or hidden // drawn["num_attention_heads"]
            assert getattr(hf, "head_dim", None) in (want, None), seed
        assert hf.hidden_size == drawn.get("hidden_size", drawn.get("d_model")), seed
        assert hf.num_hidden_layers == drawn["num_hidden_layers"], seed
        if family == "dbrx":  # its experts' width: the model's
            assert hf.ffn_config.hidden_size == hf.d_model, seed


def test_the_draws_keep_clear_of_transformers_quirks():
    """MPT: transformers 5.25 ignores alibi_bias_max (always 8); DBRX clamps q / k / v by
    clip_qkv even when null and sizes its experts by a d_model given by that name only; Gemma
    3n's KV sharing wants the same layer types on both sides; partial ropes narrower than 4
    dims divide by zero in HF's dynamic NTK; DeepSeek-V3.2's indexer heads are 8 or more."""
    for seed in range(40):
        rng = random.Random(seed)
        mpt = MORE_FAMILIES["mpt"][1](rng)
        assert mpt["attn_config"].get("alibi_bias_max", 8) == 8
        dbrx = MORE_FAMILIES["dbrx"][1](rng)
        assert dbrx["attn_config"]["clip_qkv"] is not None
        assert "d_model" in dbrx
        assert MORE_FAMILIES["deepseek_v32"][1](rng)["index_n_heads"] >= 8
        g = MORE_FAMILIES["gemma3n_text"][1](rng)
        n, shared = g["num_hidden_layers"], g["num_kv_shared_layers"]
        if shared:
            assert set(g["layer_types"][n - shared :]) == set(g["layer_types"][: n - shared])
        for family in ("gpt_neox", "phi", "stablelm", "persimmon"):
            c = MORE_FAMILIES[family][1](rng)
            partial = c.get("partial_rotary_factor", c.get("rotary_pct"))
            assert c["hidden_size"] // c["num_attention_heads"] * partial >= 4
