"""GLM-4, Cohere (Command R) and Cohere 2 (Command R7B / A) against HF transformers.

`LLM.generate` on tiny random models whose special features bite must give HF `generate`'s
greedy tokens and the same top-5 logprobs (1e-3, float32): GLM-4's four norms a layer, its
interleaved rope over half of each head (head_dim 32, wider q than hidden), q / k / v biases and
fused gate_up checkpoint; Cohere's parallel block under one bias-free LayerNorm, per-head q / k
LayerNorms, interleaved rope, q / k / v / o biases and logits scaled by 0.5; Cohere 2's sliding
layer (window 8, shorter than every prompt, with rope) beside a full layer without rope. Cohere
also at TP=2 (each rank's rows of the per-head norm weights, o_proj's bias added once).
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from hf_reference import assert_matches, assert_tp_matches_one_process, hf_greedy, load_hf_model

from paged_engine import LLM, SamplingParams
from paged_engine.models.cohere import Cohere2ForCausalLM
from paged_engine.models.glm4 import Glm4ForCausalLM
from paged_engine.testing import tiny_config, write_tiny_model

transformers = pytest.importorskip("transformers")

MAX_TOKENS = 10
TOP = 5


COHERE2_MOE_SIGMOID = {
    "expert_selection_fn": "sigmoid",
    "shared_expert_combination_strategy": "sum",
}


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("glm4", {}),
        ("cohere", {}),
        ("cohere2", {}),
        ("cohere2_moe", {}),
        # sigmoid routing renormalized, the shared expert summed, LayerNorms
        ("cohere2_moe", {**COHERE2_MOE_SIGMOID, "rms_norm_eps": None, "layer_norm_eps": 1e-5}),
    ],
)
def test_greedy_tokens_and_logprobs_match_hf(arch, overrides, tmp_path):
    if arch == "cohere2_moe" and not hasattr(transformers, "Cohere2MoeConfig"):
        pytest.skip("this transformers has no Cohere 2 MoE")
    path = write_tiny_model(tmp_path, arch, seed=1, **overrides)
    hf = load_hf_model(path)
    rng = random.Random(arch)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(12, 40))] for _ in range(3)]
    refs = [hf_greedy(hf, p, MAX_TOKENS, TOP) for p in prompts]
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, ref in zip(outs, refs, strict=True):
        assert_matches(arch, out, ref)
    assert llm.get_stats().num_used_blocks == 0


def test_cohere_tensor_parallel_matches_one_process(tmp_path):
    """TP=2 (gloo): per-head q / k norm weights split by head (k's one head per rank)."""
    path = write_tiny_model(tmp_path, "cohere", seed=3)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (30, 50)]
    assert_tp_matches_one_process(path, prompts, max_tokens=8, max_model_len=128)


def test_cohere2_layer_kinds_from_sliding_window_pattern():
    """Configs without layer_types (transformers < 4.53): every 4th layer full and NoPE; with no
    window at all, no layer rotates (HF applies rope only where a window is set)."""
    old = SimpleNamespace(num_hidden_layers=5, sliding_window=16, sliding_window_pattern=4)
    assert Cohere2ForCausalLM.layer_specs(old) == [
        (16, True),
        (16, True),
        (16, True),
        (None, False),
        (16, True),
    ]
    no_window = SimpleNamespace(num_hidden_layers=2, sliding_window=None, layer_types=None)
    assert Cohere2ForCausalLM.layer_specs(no_window) == [(None, False), (None, False)]


def test_glm4_fused_gate_up_splits_for_the_stacked_rules():
    """The checkpoint's gate_up_proj [2I, D] loads as gate_proj and up_proj halves, so a TP
    rank takes its rows of each (the whole fused tensor would give rank 0 the gate, rank 1 up)."""
    model = Glm4ForCausalLM(tiny_config("glm4"))
    w = torch.randn(2 * 128, 64)
    name = "model.layers.1.mlp.gate_up_proj.weight"
    (gate_name, gate), (up_name, up) = model.convert_weight(name, w)
    assert (gate_name, up_name) == (
        "model.layers.1.mlp.gate_proj.weight",
        "model.layers.1.mlp.up_proj.weight",
    )
    assert torch.equal(gate, w[:128]) and torch.equal(up, w[128:])
