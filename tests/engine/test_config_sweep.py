"""Universal config fields (partial_rotary_factor, attention_bias, mlp_bias,
tie_word_embeddings, head_dim) swept over every tiny architecture that transformers runs: each
variant, served by `LLM` (float32), gives HF transformers' greedy tokens and top-3 logprobs
(1e-3, hf_reference.assert_matches) on a short prompt and one past every window; a variant
transformers cannot run (or one paged does not serve) is refused at load by a ValueError naming
the field. Kept here: the variants the sweep found wrong, and a few that matched.

Regressions:
- partial_rotary_factor on model types whose transformers rope turns whole heads (their own
  default rope over head_dim; layers/rotary.py WHOLE_HEAD_ROPE_MODEL_TYPES) once rotated part
  of each head (MiniCPM3, Jais2, FlexOlmo, ... : `test_rope_turns_what_transformers_turns`);
  with Ministral 3's yarn (transformers cannot run it) it was served, as it was on GLM-4.7-Flash
  (its MLA rope turns all qk_rope_head_dim dims whatever the factor says: cos / sin too narrow).
- Laguna took a top-level partial_rotary_factor for the layer types whose rope_parameters name
  none, and Mellum refused it (transformers reads each layer type's alone, default 1).
- head_dim apart from the MLA dims: Mistral 4 (transformers sizes its rope by head_dim) once
  served another rope; Youtu and A.X K1 (cos / sin head_dim wide: transformers cannot run it)
  were served.
- CWM's, MiniMax's and MiniMax-M2's attention_bias and OLMo's mlp_bias (transformers' have no
  such biases) asked for biases the checkpoint lacks;
  LFM3's (transformers' has them) left the checkpoint's biases unread; HY-V3's mlp_bias (biased
  dense and shared MLPs) failed at load without naming the field.
- mlp_bias on the DeepSeek-style MoE models whose transformers MLPs never read it (GLM-4.5 MoE,
  DeepSeek-V3, Mistral 4, dots.llm1, ...; paged_engine/config_ignored.py IGNORED_FIELDS)
  was refused; so was DeepSeek-V4's (transformers biases its shared expert).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from config_variant_check import assert_refused, hf_refs, serve_and_compare

from paged_engine.testing import tiny_config, write_tiny_model

pytest.importorskip("transformers")

MAX_TOKENS = 4
LENGTHS = (7, 70)  # the second runs past every tiny model's sliding window
_HALF = {"partial_rotary_factor": 0.5}

# id -> (tiny arch, config overrides)
MATCHES: dict[str, tuple[str, dict[str, Any]]] = {
    # regressions
    "minicpm3-partial_rotary_factor": ("minicpm3", _HALF),
    "jais2-partial_rotary_factor": ("jais2", _HALF),
    "laguna-partial_rotary_factor": ("laguna", _HALF),
    "mellum-partial_rotary_factor": ("mellum", _HALF),  # once refused
    "cwm-attention_bias": ("cwm", {"attention_bias": True}),
    "lfm3-attention_bias": ("lfm3", {"attention_bias": True}),
    "glm4_moe-mlp_bias": ("glm4_moe", {"mlp_bias": True}),
    "olmo-mlp_bias": ("olmo", {"mlp_bias": True}),
    "minimax-attention_bias": ("minimax", {"attention_bias": True}),
    "minimax_m2-attention_bias": ("minimax_m2", {"attention_bias": True}),
    "dots1-mlp_bias": ("dots1", {"mlp_bias": True}),
    "deepseek_v4-mlp_bias": ("deepseek_v4", {"mlp_bias": True}),  # biased shared expert
    # matched before
    "llama-biases-head_dim-tied": (
        "llama",
        {"attention_bias": True, "mlp_bias": True, "head_dim": 8, "tie_word_embeddings": True},
    ),
    "kimi_linear-partial_rotary_factor": ("kimi_linear", _HALF),
}

# id -> (tiny arch, config overrides, what the error names)
REFUSED: dict[str, tuple[str, dict[str, Any], str]] = {
    "ministral3-partial-with-yarn": (
        "ministral3",
        _HALF,
        "partial_rotary_factor=0.5 with a 'yarn' rope scaling",
    ),
    "glm4_moe_lite-partial_rotary_factor": (
        "glm4_moe_lite",
        _HALF,
        "partial_rotary_factor=0.5 is not supported for model_type 'glm4_moe_lite'",
    ),
    "mistral4-head_dim": ("mistral4", {"head_dim": 8}, "head_dim=8"),
    "youtu-head_dim": ("youtu", {"head_dim": 24}, "head_dim=24"),
    "axk1-head_dim": ("axk1", {"head_dim": 24}, "head_dim=24"),
    "hy_v3-mlp_bias": ("hy_v3", {"mlp_bias": True}, r"config.mlp_bias=True"),
}

# tiny archs whose transformers rope turns whole heads, once partly turned by paged
WHOLE_HEAD_ARCHS = [
    "minicpm3",
    "granite_swa",
    "granitemoe_swa",
    "hyperclovax",
    "afmoe",
    "beam",
    "ergo",
    "dory",
    "bitnet",
    "exaone",
    "exaone_moe",
    "cwm",
    "bailing_hybrid",
    "olmo",
    "olmo_hybrid",
    "flex_olmo",
    "minicpm5_moe",
    "vaultgemma",
    "llama4",
    "nanochat",
    "cohere2_moe",
    "jetmoe",
    "minimax",
    "dots1",
    "jais2",
    "internlm3",
    "hy_v3",
    "kolibri1",
    "kolibri1_1",
    "flint",
    "lara_mini",
]


@pytest.mark.parametrize("case", list(MATCHES))
def test_swept_config_matches_hf(case: str, tmp_path: Path) -> None:
    arch, overrides = MATCHES[case]
    path = write_tiny_model(tmp_path, arch, seed=1, **overrides)
    prompts, refs = hf_refs(path, LENGTHS, max_tokens=MAX_TOKENS, seed=3)
    serve_and_compare(case, path, prompts, refs, max_tokens=MAX_TOKENS)


@pytest.mark.parametrize("case", list(REFUSED))
def test_swept_config_transformers_cannot_run_is_refused_by_name(case: str, tmp_path) -> None:
    arch, overrides, match = REFUSED[case]
    assert_refused(tmp_path, arch, overrides, {}, match)


@pytest.mark.parametrize("arch", WHOLE_HEAD_ARCHS)
def test_rope_turns_what_transformers_turns(arch: str) -> None:
    """With partial_rotary_factor=0.5, paged's ropes are as wide as transformers' cos / sin
    tables (its rotary modules' inv_freq: two dims each); no weights, no generation."""
    import transformers

    from paged_engine.layers.rotary import RotaryEmbedding
    from paged_engine.loader import building_in
    from paged_engine.models import get_model_class
    from paged_engine.testing.models import _register_causal_lm

    config = tiny_config(arch, **_HALF)
    _register_causal_lm(config)
    hf = transformers.AutoModelForCausalLM.from_config(config)
    want = {2 * b.numel() for n, b in hf.named_buffers() if n.endswith("inv_freq")}
    config = tiny_config(arch, **_HALF)
    config.architectures = [type(hf).__name__]
    with building_in(torch.float32, "cpu"):
        model = get_model_class(config)(config)
    got = {m.rotary_dim for m in model.modules() if isinstance(m, RotaryEmbedding)}
    assert want and got == want, f"{arch}: rope dims {got}, transformers' {want}"


def test_config_class_validation_refused_by_name(tmp_path: Path) -> None:
    """DBRX's config class rejects tie_word_embeddings (transformers cannot load it): a
    ValueError naming the field, not the hub's validation error."""
    assert_refused(tmp_path, "dbrx", {}, {"tie_word_embeddings": True}, "tie_word_embeddings")
