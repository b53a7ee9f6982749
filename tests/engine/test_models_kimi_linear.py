"""Kimi Linear (models/kimi_linear.py) against HF transformers: Kimi Delta Attention layers
(per-key-channel decay, q / k / v short convs, sigmoid-gated output norm) among MLA layers without
rope, a dense first MLP and DeepSeek-V3 MoE layers (8 experts in 4 groups, 2 kept).

The tiny model (KDA, KDA, MLA, KDA): `LLM.generate` gives HF `generate`'s greedy tokens and top-5
logprobs (1e-3, float32) on prompts of 1 to 70 tokens, whole and in prefill chunks of 16, and on
the Triton kernels (interpreted); n = 3 greedy forks equal n = 1; prefix caching from state
snapshots keeps the outputs of an engine without it; TP=2 gives the one-process results; a
checkpoint in transformers' in-memory layout (fused conv1d and experts, `forget_gate.` and `mlp.`
names) loads to the same model."""

from __future__ import annotations

import json

import pytest
from hf_reference import assert_tp_matches_one_process, load_hf_model
from hybrid_checks import (
    assert_greedy_forks_equal_one,
    assert_greedy_matches_hf,
    assert_snapshots_keep_outputs,
    random_prompts,
    token_requests,
)

from paged_engine import LLM, SamplingParams
from paged_engine.testing import write_tiny_model

pytest.importorskip("transformers.models.kimi_linear")


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("kimi_linear"), "kimi_linear", seed=1)


@pytest.mark.parametrize(
    ("backend", "budget"),
    [
        ("cpu", None),
        ("cpu", 16),  # prefill chunks of 16: the state carries across them
        ("triton", 16),  # paged_kernels' Triton kernels (interpreted on the CPU)
    ],
)
def test_greedy_tokens_and_logprobs_match_hf(backend, budget, kimi_dir):
    assert_greedy_matches_hf("kimi_linear", kimi_dir, backend, budget)


def test_forks_equal_one(kimi_dir):
    llm = LLM(model=str(kimi_dir), dtype="float32", max_model_len=128)
    assert_greedy_forks_equal_one(llm)


def test_prefix_cache_resumes_from_state_snapshots(kimi_dir):
    assert_snapshots_keep_outputs(kimi_dir)


def test_tensor_parallel_matches_one_process(kimi_dir):
    assert_tp_matches_one_process(kimi_dir, random_prompts(5, (5, 23)), 6, 128)


def test_in_memory_layout_loads(kimi_dir, tmp_path):
    """HF's state_dict names (what transformers 5 holds in memory, not what it saves) give the
    outputs of the saved checkpoint."""
    from safetensors.torch import save_file

    hf = load_hf_model(kimi_dir)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    for part in (".forget_gate.", ".experts.gate_up_proj", ".self_attn.conv1d.", ".mlp."):
        assert any(part in k for k in state), part
    save_file(state, str(tmp_path / "model.safetensors"))
    for name in ("config", "generation_config", "tokenizer", "tokenizer_config"):
        (tmp_path / f"{name}.json").write_text((kimi_dir / f"{name}.json").read_text())
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "kimi_linear"
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)
    reqs = token_requests(random_prompts(2, (9, 3)))
    outs = []
    for path in (kimi_dir, tmp_path):
        llm = LLM(model=str(path), dtype="float32", max_model_len=64)
        outs.append([o.outputs[0] for o in llm.generate(reqs, params, use_tqdm=False)])
    for a, b in zip(*outs, strict=True):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert {t: lp.logprob for t, lp in x.items()} == {t: lp.logprob for t, lp in y.items()}
