"""AI21 Jamba (models/jamba.py: Mamba v1 layers, layers/mamba.py, among rope-less attention
layers, with MoE feed-forwards on some layers) against HF transformers.

Tiny random models (mamba, attention, mamba, mamba by attn_layer_period / offset; the mixer 128
channels, state 16, conv 4, dt rank 8, Jamba's weighted dt / B / C norms; 4 experts, top 2 not
renormalized, on layers 1 and 3, a gated MLP on the others; also dense, num_experts 1, with
in_proj / out_proj biases): `LLM.generate` must give HF `generate`'s greedy tokens and top-5
logprobs (1e-3, float32) on prompts of 1 to 70 tokens, whole and in prefill chunks of 16, on the
CPU backend and the Triton one. Forks (n = 3) continue their parent's state, prefix caching
resumes from state snapshots with the outputs of an engine without it, TP=2 gives the
one-process results, and fused expert checkpoints (transformers 5's in-memory layout) load as
the per-expert ones (the released checkpoints' and what save_pretrained writes) do.
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
from paged_engine.layers.fused_moe import SparseMoeBlock
from paged_engine.models.hybrid import is_hybrid, layer_types, num_kv_layers
from paged_engine.testing import tiny_config

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

TOP = 5
# name -> (tiny arch, config overrides)
CASES: dict[str, tuple[str, dict]] = {
    "jamba": ("jamba", {}),
    "jamba-dense": ("jamba", {"num_experts": 1, "mamba_proj_bias": True}),
}


@pytest.fixture(scope="module")
def jamba_dirs(tmp_path_factory):
    return tiny_dirs(tmp_path_factory, CASES)


@pytest.mark.parametrize(
    ("name", "backend", "budget"),
    [
        ("jamba", "cpu", None),
        ("jamba", "cpu", 16),  # prefill chunks of 16: KV, conv window and state carry across
        ("jamba-dense", "cpu", None),
        ("jamba-dense", "cpu", 16),
        ("jamba", "triton", 16),  # paged_kernels' Triton conv and selective scan (interpreted)
    ],
)
def test_greedy_tokens_and_logprobs_match_hf(name, backend, budget, jamba_dirs):
    llm = assert_greedy_matches_hf(name, jamba_dirs(name), backend, budget)
    model = llm.llm_engine.model_runner.model.model
    # a state pool per Mamba layer, KV for the attention layer alone
    assert len(llm.llm_engine.model_runner.states.layers) == 3
    assert model.kv_index == [-1, 0, -1, -1]
    sparse = [isinstance(layer.feed_forward, SparseMoeBlock) for layer in model.layers]
    assert sparse == ([False, True, False, True] if name == "jamba" else [False] * 4)


def test_layer_layout_from_periods():
    """attn_layer_period / offset (Jamba-v0.1's 8 / 4) give the KV layers."""
    config = tiny_config("jamba", num_hidden_layers=16, attn_layer_period=8, attn_layer_offset=4)
    types = layer_types(config)
    assert [i for i, t in enumerate(types) if t in ("full_attention", "attention")] == [4, 12]
    assert is_hybrid(config) and num_kv_layers(config) == 2


def test_fused_expert_checkpoints_load(jamba_dirs, tmp_path):
    """HF's per-expert names (what save_pretrained writes, with `router` and `final_layernorm`),
    and transformers 5's fused experts (gate_up_proj [E, 2I, H]: gate rows then up's; down_proj
    [E, H, I]) giving the per-expert checkpoint's outputs."""
    src = jamba_dirs("jamba")
    tensors = safetensors_torch.load_file(src / "model.safetensors")
    want_names = {
        "model.final_layernorm.weight",
        "model.layers.0.mamba.dt_layernorm.weight",
        "model.layers.0.mamba.b_layernorm.weight",
        "model.layers.0.mamba.c_layernorm.weight",
        "model.layers.0.feed_forward.gate_proj.weight",
        "model.layers.1.self_attn.q_proj.weight",
        "model.layers.1.feed_forward.router.weight",
        "model.layers.3.feed_forward.experts.3.down_proj.weight",
        "lm_head.weight",  # untied
    }
    assert want_names <= set(tensors), sorted(want_names - set(tensors))
    fused = tmp_path / "fused"
    shutil.copytree(src, fused)
    out = {}
    for layer in (1, 3):
        p = f"model.layers.{layer}.feed_forward.experts"
        w = {
            m: [tensors.pop(f"{p}.{e}.{m}.weight") for e in range(4)]
            for m in ("gate_proj", "up_proj", "down_proj")
        }
        out[f"{p}.gate_up_proj"] = torch.stack(
            [torch.cat([a, b]) for a, b in zip(w["gate_proj"], w["up_proj"], strict=True)]
        )
        out[f"{p}.down_proj"] = torch.stack(w["down_proj"])
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


def test_forks_and_prefix_cache_keep_outputs(jamba_dirs):
    path = jamba_dirs("jamba")
    llm = LLM(model=str(path), dtype="float32", max_model_len=128)
    assert_greedy_forks_equal_one(llm)
    del llm
    assert_snapshots_keep_outputs(path)


@pytest.mark.parametrize("name", ["jamba", "jamba-dense"])
def test_tensor_parallel_matches_one_process(name, jamba_dirs):
    # the mixer's 128 channels (x_proj and out_proj all-reduced), the heads, MLP and experts
    # split over 2 ranks
    assert_tp_matches_one_process(jamba_dirs(name), random_prompts(5, (5, 23, 40)), 8, 128)
