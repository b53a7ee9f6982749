"""IBM Bamba (models/bamba.py: Mamba2 layers among attention layers with partial rope) against HF
transformers.

Tiny random models (mamba, attention, mamba, mamba by `attn_layer_indices`; the mixer 8 heads of
16 on 2 groups, state 16, conv 4; attention 4 heads of 16 on 2 KV heads rotating half of each
head, BambaConfig's fixed partial_rotary_factor), also with one group (replicated under TP),
in_proj / out_proj, attention and MLP biases on and the conv's off, a time-step clamp that bites
in prefill scans, and tied embeddings: `LLM.generate` must give HF `generate`'s greedy tokens
and top-5 logprobs (1e-3, float32) on prompts of 1 to 70 tokens, whole and in prefill chunks of
16, on the CPU backend and the Triton one. Forks (n = 3) continue their parent's state, prefix
caching resumes from state snapshots with the outputs of an engine without it, TP=2 gives the
one-process results, and a LoRA adapter on every projection (the mixer's in_proj / out_proj
included) gives HF's tokens on the merged model.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hf_reference import assert_lora_matches_hf_merged, assert_tp_matches_one_process
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

_BIAS = {
    "mamba_n_groups": 1,  # replicated on every TP rank, its norm's squares summed across them
    "mamba_proj_bias": True,
    "mamba_conv_bias": False,
    "attention_bias": True,
    "mlp_bias": True,
    "time_step_limit": [0.5, 2.0],  # softplus(dt) reaches ~0.3 to ~3 in these models
    "tie_word_embeddings": True,
}
# name -> (tiny arch, config overrides)
CASES: dict[str, tuple[str, dict]] = {
    "bamba": ("bamba", {}),
    "bamba-bias": ("bamba", _BIAS),
}


@pytest.fixture(scope="module")
def bamba_dirs(tmp_path_factory):
    return tiny_dirs(tmp_path_factory, CASES)


@pytest.mark.parametrize(
    ("name", "backend", "budget"),
    [
        ("bamba", "cpu", None),
        ("bamba", "cpu", 16),  # prefill chunks of 16: KV and state carry across them
        ("bamba-bias", "cpu", 16),
        ("bamba-bias", "triton", 16),  # paged_kernels' Triton kernels (interpreted)
    ],
)
def test_greedy_tokens_and_logprobs_match_hf(name, backend, budget, bamba_dirs):
    llm = assert_greedy_matches_hf(name, bamba_dirs(name), backend, budget)
    model = llm.llm_engine.model_runner.model.model
    # a state pool per Mamba layer, KV for the attention layer alone; half of each head rotated
    assert len(llm.llm_engine.model_runner.states.layers) == 3
    assert model.kv_index == [-1, 0, -1, -1]
    assert model.rotary_emb.rotary_dim == 8


def test_layer_types_from_attn_layer_indices():
    config = tiny_config("bamba", num_hidden_layers=5, attn_layer_indices=[1, 4])
    lin, full = "linear_attention", "full_attention"
    assert layer_types(config) == [lin, full, lin, lin, full]
    assert is_hybrid(config) and num_kv_layers(config) == 2
    # transformers 4's BambaConfig: its layers_block_type property says "mamba" / "attention"
    older = SimpleNamespace(layers_block_type=["mamba", "attention", "mamba"])
    assert is_hybrid(older) and num_kv_layers(older) == 1


def test_forks_and_prefix_cache_keep_outputs(bamba_dirs):
    path = bamba_dirs("bamba")
    llm = LLM(model=str(path), dtype="float32", max_model_len=128)
    assert_greedy_forks_equal_one(llm)
    del llm
    assert_snapshots_keep_outputs(path)


@pytest.mark.parametrize("name", ["bamba", "bamba-bias"])
def test_tensor_parallel_matches_one_process(name, bamba_dirs):
    assert_tp_matches_one_process(bamba_dirs(name), random_prompts(5, (5, 23, 40)), 8, 128)


def test_lora_on_every_projection_matches_hf_merged(bamba_dirs, tmp_path):
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    prompt = random_prompts(11, (23,))[0]
    path = bamba_dirs("bamba")
    assert_lora_matches_hf_merged(
        path, tmp_path, prompt, 8, 5, targets=(*targets, "in_proj", "out_proj")
    )
