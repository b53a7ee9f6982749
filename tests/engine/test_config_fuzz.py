"""A few seeds of the model-configuration fuzz (config_fuzz.py) in the suite: each draws a tiny
config of one family from the values Hub configs use and must give HF's greedy tokens and
logprobs (1e-3, float32), or be refused by a ValueError naming a drawn field. The seeds cover
the families whose config fields interact most (latent attention with MoE routing, per-layer
windows with rope per layer type, longrope, gpt-oss's YaRN and sinks, the Hub's older config
layout). `python tests/engine/config_fuzz.py FIRST COUNT [FAMILIES|all]` runs many."""

from __future__ import annotations

import pytest
from config_fuzz import FAMILIES, MAX_MODEL_LEN, draw, run_seed

pytest.importorskip("transformers")

# The families the seeds below draw from: the first 26 (config_draws.py's own; the families
# config_draws_more.py and config_draws_hybrid.py append would change every seed's draw).
SUITE_FAMILIES = list(FAMILIES)[:26]

# seed -> what it covers (checked against the draw below, so a changed draw shows here)
SEEDS: dict[int, str] = {
    395: "deepseek_v3: YaRN with mscale != mscale_all_dim (the softmax scale), 3 prompts",
    96: "deepseek_v3: routed_scaling_factor on a MoE layer, no q bottleneck",
    71: "deepseek_v2: group-limited greedy routing layout, a dense first layer",
    59: "gemma2: attention softcap 5 that bites, a window shorter than a prompt",
    119: "phi3: longrope's long factors (prompts past original_max_position_embeddings 32)",
    10: "olmo3: sliding and full layers, each with its rope",
    11: "gpt_oss: sliding and full layers, sinks, YaRN",
    464: "gemma3_text: the Hub layout (sliding_window_pattern, rope_local_base_freq)",
}


@pytest.mark.parametrize("seed", list(SEEDS))
def test_a_fuzzed_config_matches_hf(seed, tmp_path):
    family = draw(seed, SUITE_FAMILIES)[0]
    assert family == SEEDS[seed].split(":")[0], "the draw changed: pick the seeds anew"
    _, outcome, detail = run_seed(seed, SUITE_FAMILIES, tmp_path)
    assert outcome in ("ok", "refused"), detail


def test_the_draws_cover_every_family_and_fit_the_context():
    """1000 seeds draw every family; every prompt and its tokens fit the engine's context."""
    seen = set()
    for seed in range(1000):
        family, config, lengths, max_tokens, max_len = draw(seed, list(FAMILIES))
        seen.add(family)
        limit = config.get("max_position_embeddings", MAX_MODEL_LEN)  # (Mamba's: none)
        assert max(lengths) + max_tokens <= max_len <= limit * 8
    assert seen == set(FAMILIES)
