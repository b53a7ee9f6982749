"""LFM2 and LFM2-MoE (models/lfm2.py: gated short-conv layers, layers/short_conv.py, among
attention layers) against HF transformers.

Tiny random models (conv, conv, attention, conv layers; conv width 3, with and without biases;
LFM2's auto-adjusted MLP width; LFM2-MoE with a dense first layer, then 8 experts routed by
sigmoid scores plus a random expert bias, renormalized and scaled, also without bias and
renormalization): `LLM.generate` must give HF `generate`'s greedy tokens and top-5 logprobs
(1e-3, float32) on prompts of 1 to 70 tokens, whole and in prefill chunks of 16 (the conv window
carries across chunks), on the CPU backend and the Triton one. Forks (n = 3) continue their
parent's conv state, prefix caching resumes from state snapshots with the outputs of an engine
without it, TP=2 gives the one-process results, and fused expert checkpoints (transformers 5's
layout) load as the per-expert ones (the released checkpoints') do.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from hf_reference import assert_tp_matches_one_process
from hybrid_checks import (
    assert_greedy_forks_equal_one,
    assert_greedy_matches_hf,
    assert_snapshots_keep_outputs,
    random_prompts,
    tiny_dirs,
    token_requests,
)

from paged_engine import LLM, SamplingParams
from paged_engine.models.lfm2 import lfm2_intermediate_size

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

TOP = 5

# name -> (tiny arch, config overrides)
CASES: dict[str, tuple[str, dict]] = {
    "lfm2": ("lfm2", {}),
    "lfm2-bias": ("lfm2", {"conv_bias": True}),  # biases on in_proj, the conv and out_proj
    "lfm2_moe": ("lfm2_moe", {}),
    "lfm2_moe-plain": ("lfm2_moe", {"use_expert_bias": False, "norm_topk_prob": False}),
    "lfm3": ("lfm3", {}),
    # without the gate and the sandwich norms
    "lfm3-plain": ("lfm3", {"use_attention_gate": False, "use_sandwich_norm": False}),
}


@pytest.fixture(scope="module")
def lfm2_dirs(tmp_path_factory):
    return tiny_dirs(tmp_path_factory, CASES)


@pytest.mark.parametrize(
    ("name", "backend", "budget"),
    [
        ("lfm2", "cpu", None),
        ("lfm2", "cpu", 16),  # prefill chunks of 16: the conv window carries across them
        ("lfm2-bias", "cpu", 16),
        ("lfm2", "triton", 16),  # paged_kernels' Triton conv (interpreted on the CPU)
        ("lfm2_moe", "cpu", None),
        ("lfm2_moe", "cpu", 16),
        ("lfm2_moe-plain", "cpu", None),
    ],
)
def test_greedy_tokens_and_logprobs_match_hf(name, backend, budget, lfm2_dirs):
    llm = assert_greedy_matches_hf(name, lfm2_dirs(name), backend, budget)
    # one pool a conv layer (its window alone), none for the attention layer
    states = llm.llm_engine.model_runner.states
    assert len(states.layers) == 3 and all(layer.kernel == 3 for layer in states.layers)


def test_checkpoint_names_and_mlp_width(lfm2_dirs):
    """The names the released checkpoints use (HF's modules: write_tiny_model saves them), and
    LFM2's MLP width rule (LFM2-1.2B: block_ff_dim 12288 -> 8192) as HF builds it."""
    names = {
        "lfm2": [
            "model.embedding_norm.weight",
            "model.layers.0.operator_norm.weight",
            "model.layers.0.conv.in_proj.weight",
            "model.layers.0.conv.conv.weight",
            "model.layers.0.conv.out_proj.weight",
            "model.layers.2.self_attn.q_layernorm.weight",
            "model.layers.2.self_attn.out_proj.weight",
            "model.layers.2.ffn_norm.weight",
            "model.layers.2.feed_forward.w1.weight",
        ],
        "lfm2_moe": [
            "model.layers.0.feed_forward.w3.weight",
            "model.layers.2.feed_forward.gate.weight",
            "model.layers.2.feed_forward.expert_bias",
            "model.layers.2.feed_forward.experts.7.w2.weight",
        ],
    }
    for name, want in names.items():
        keys = set(safetensors_torch.load_file(lfm2_dirs(name) / "model.safetensors"))
        assert set(want) <= keys, (name, sorted(set(want) - keys))
        assert "lm_head.weight" not in keys  # tied to the embedding
    from transformers.models.lfm2.modeling_lfm2 import Lfm2MLP

    for kw in (
        {"intermediate_size": 12288, "hidden_size": 2048},
        {"intermediate_size": 128, "block_multiple_of": 16, "hidden_size": 64},
        {"intermediate_size": 100, "block_ffn_dim_multiplier": 1.5, "block_multiple_of": 32},
        {"intermediate_size": 100, "block_auto_adjust_ff_dim": False, "hidden_size": 64},
    ):
        config = transformers.Lfm2Config(**kw)
        with torch.device("meta"):
            width = Lfm2MLP(config).w1.out_features
        assert lfm2_intermediate_size(config) == width, kw
    assert lfm2_intermediate_size(transformers.Lfm2Config(intermediate_size=12288)) == 8192


def test_fused_expert_checkpoints_load(lfm2_dirs, tmp_path):
    """transformers 5's fused experts (gate_up_proj [E, 2I, H]: w1 rows then w3's; down_proj
    [E, H, I]) give the per-expert checkpoint's outputs."""
    src = lfm2_dirs("lfm2_moe")
    fused = tmp_path / "fused"
    shutil.copytree(src, fused)
    tensors = safetensors_torch.load_file(src / "model.safetensors")
    out = {}
    for layer in range(1, 4):
        p = f"model.layers.{layer}.feed_forward.experts"
        w = {m: [tensors.pop(f"{p}.{e}.{m}.weight") for e in range(8)] for m in ("w1", "w2", "w3")}
        out[f"{p}.gate_up_proj"] = torch.stack(
            [torch.cat([a, b]) for a, b in zip(w["w1"], w["w3"], strict=True)]
        )
        out[f"{p}.down_proj"] = torch.stack(w["w2"])
    safetensors_torch.save_file({**tensors, **out}, fused / "model.safetensors")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=TOP)
    reqs = token_requests(random_prompts(2, (9, 30)))
    want, got = (
        LLM(model=str(p), dtype="float32", max_model_len=128).generate(reqs, params)
        for p in (src, fused)
    )
    for a, b in zip(want, got, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].cumulative_logprob == pytest.approx(b.outputs[0].cumulative_logprob)


def test_forks_continue_their_parents_state(lfm2_dirs):
    llm = LLM(model=str(lfm2_dirs("lfm2")), dtype="float32", max_model_len=128)
    assert_greedy_forks_equal_one(llm)


@pytest.mark.parametrize("name", ["lfm2", "lfm2_moe"])
def test_prefix_cache_resumes_from_state_snapshots(name, lfm2_dirs):
    assert_snapshots_keep_outputs(lfm2_dirs(name))


@pytest.mark.parametrize("name", ["lfm2", "lfm2_moe"])
def test_tensor_parallel_matches_one_process(name, lfm2_dirs):
    # the conv's 64 channels and the MLP / experts split over 2 ranks
    assert_tp_matches_one_process(lfm2_dirs(name), random_prompts(5, (5, 23, 40)), 8, 128)


@pytest.mark.parametrize(("name", "budget"), [("lfm3", None), ("lfm3", 16), ("lfm3-plain", None)])
def test_lfm3_matches_hf(name, budget, lfm2_dirs):
    """LFM3: sliding (window 8) and full attention layers with their own ropes, per-head output
    gates and sandwich norms among conv layers; whole and in prefill chunks of 16."""
    if not hasattr(transformers, "Lfm3Config"):
        pytest.skip("this transformers has no LFM3")
    assert_greedy_matches_hf(name, lfm2_dirs(name), "cpu", budget)
