"""Falcon-H1 (models/falcon_h1.py: attention and a Mamba2 mixer side by side in every layer)
against HF transformers.

Tiny random models (2 layers; attention with rope, 4 heads of 24 on 2 KV heads; the mixer 6
heads of 16 with mamba_d_ssm 96 != expand * hidden, on 2 groups; every multiplier != 1:
embedding, lm_head, key, attention in / out, ssm in / out, the five ssm_multipliers, the MLP's
two). The mixer without its norm (y * silu(z), Falcon-H1's default), with it before the gate
(one group, every bias on, a time-step clamp that bites in prefill scans) and after it:
`LLM.generate` must give HF `generate`'s greedy tokens and top-5 logprobs (1e-3, float32) on
prompts of 1 to 70 tokens, whole and in prefill chunks of 16, on the CPU backend and the Triton
one. Every layer holds both a KV cache and a recurrent state. Forks (n = 3) continue their
parent's state, prefix caching resumes from state snapshots with the outputs of an engine
without it, TP=2 gives the one-process results, and a mixer whose heads do not split is refused
naming tensor_parallel_size.
"""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
import torch
from hf_reference import assert_tp_matches_one_process
from hybrid_checks import (
    assert_greedy_forks_equal_one,
    assert_greedy_matches_hf,
    assert_snapshots_keep_outputs,
    random_prompts,
    tiny_dirs,
)

from paged_engine import LLM
from paged_engine.models.hybrid import is_hybrid, layer_types, num_kv_layers
from paged_engine.testing import tiny_config

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

_NORM = {
    "mamba_rms_norm": True,  # mamba_norm_before_gate: True (HF's default)
    "mamba_n_groups": 1,  # replicated on every TP rank, its norm's squares summed across them
    "mamba_proj_bias": True,
    "projectors_bias": True,
    "attention_bias": True,
    "mlp_bias": True,
    "time_step_limit": [0.5, 2.0],  # softplus(dt) reaches ~0.3 to ~3 in these models
}
# name -> (tiny arch, config overrides)
CASES: dict[str, tuple[str, dict]] = {
    "falcon_h1": ("falcon_h1", {}),
    "falcon_h1-norm": ("falcon_h1", _NORM),
    "falcon_h1-norm-after": (
        "falcon_h1",
        {"mamba_rms_norm": True, "mamba_norm_before_gate": False},
    ),
}


@pytest.fixture(scope="module")
def falcon_dirs(tmp_path_factory):
    return tiny_dirs(tmp_path_factory, CASES)


@pytest.mark.parametrize(
    ("name", "backend", "budget"),
    [
        ("falcon_h1", "cpu", None),
        ("falcon_h1", "cpu", 16),  # prefill chunks of 16: KV and state carry across them
        ("falcon_h1-norm", "cpu", 16),
        ("falcon_h1-norm-after", "cpu", None),
        ("falcon_h1-norm", "triton", 16),  # paged_kernels' Triton kernels (interpreted)
    ],
)
def test_greedy_tokens_and_logprobs_match_hf(name, backend, budget, falcon_dirs):
    llm = assert_greedy_matches_hf(name, falcon_dirs(name), backend, budget)
    # both in every layer: a state pool (the mixer's) and a KV cache
    runner = llm.llm_engine.model_runner
    assert len(runner.states.layers) == 2 and len(runner.model.model.kv_index) == 2
    assert runner.model.model.kv_index == [0, 1]


def test_every_layer_holds_kv_and_state():
    config = tiny_config("falcon_h1", num_hidden_layers=3)
    assert layer_types(config) == ["hybrid"] * 3
    assert is_hybrid(config) and num_kv_layers(config) == 3
    # configs of transformers < 5 list no layer types: the model type says
    older = SimpleNamespace(model_type="falcon_h1", num_hidden_layers=3)
    assert is_hybrid(older) and num_kv_layers(older) == 3


def test_forks_and_prefix_cache_keep_outputs(falcon_dirs):
    path = falcon_dirs("falcon_h1")
    llm = LLM(model=str(path), dtype="float32", max_model_len=128)
    assert_greedy_forks_equal_one(llm)
    del llm
    assert_snapshots_keep_outputs(path)


@pytest.mark.parametrize("name", ["falcon_h1", "falcon_h1-norm"])
def test_tensor_parallel_matches_one_process(name, falcon_dirs):
    assert_tp_matches_one_process(falcon_dirs(name), random_prompts(5, (5, 23, 40)), 8, 128)


def test_unsplittable_mixer_heads_are_refused(tmp_path):
    from paged_engine.testing import write_tiny_model

    path = write_tiny_model(
        tmp_path / "odd", "falcon_h1", mamba_d_ssm=80, mamba_n_heads=5, mamba_n_groups=1
    )
    # refused before any worker process starts (check_model_parallelism)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 must divide .* mamba_n_heads=5"):
        LLM(model=str(path), dtype="float32", max_model_len=64, tensor_parallel_size=2)


def test_checkpoint_names_and_mup_vector(falcon_dirs, tmp_path):
    """HF's module names load (write_tiny_model saves them); a `mup_vector` a checkpoint may
    carry is ignored, as HF ignores it (it recomputes the buffer from ssm_multipliers)."""
    src = falcon_dirs("falcon_h1")
    weights = safetensors_torch.load_file(str(src / "model.safetensors"))
    for name in (
        "model.final_layernorm.weight",
        "model.layers.0.feed_forward.gate_proj.weight",
        "model.layers.0.pre_ff_layernorm.weight",
        "model.layers.0.mamba.in_proj.weight",
        "model.layers.0.mamba.A_log",
        "model.layers.1.self_attn.k_proj.weight",
    ):
        assert name in weights
    assert not any(".mamba.norm." in n for n in weights)  # mamba_rms_norm False: no norm
    dst = tmp_path / "mup"
    shutil.copytree(src, dst)
    weights["model.layers.0.mamba.mup_vector"] = torch.full((1, 1, 96 * 2 + 64 + 6), 9.0)
    safetensors_torch.save_file(weights, str(dst / "model.safetensors"))
    LLM(model=str(dst), dtype="float32", max_model_len=64)
