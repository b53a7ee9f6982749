"""Granite MoE (with and without the shared MLP), ERNIE 4.5 (dense and MoE) and Seed-OSS against
HF transformers.

`LLM.generate` on tiny random models whose special features bite (Granite's four multipliers
away from 1 around a top-k-then-softmax router; GraniteMoeShared's ungated shared MLP; ERNIE's
interleaved rope, `use_bias` everywhere including the MoE model's lm_head, a dense layer before
MoE layers whose softmax router ranks with a random correction bias, a biased shared expert;
Seed-OSS's q / k / v biases without an o_proj one) must give HF `generate`'s greedy tokens and
the same top-5 logprobs (1e-3, float32); ERNIE 4.5 MoE also at TP=2. The MoE models also load
the names and layouts transformers 5 holds in memory (fused experts, renamed routers).
"""

from __future__ import annotations

import random

import pytest
from hf_reference import (
    assert_hf_names_load_like_checkpoint,
    assert_matches,
    assert_tp_matches_one_process,
    hf_greedy,
    load_hf_model,
)

from paged_engine import LLM, SamplingParams
from paged_engine.testing import write_tiny_model

transformers = pytest.importorskip("transformers")

MAX_TOKENS = 8
TOP = 5
ARCHS = ["granitemoe", "granitemoeshared", "ernie4_5", "ernie4_5_moe", "seed_oss"]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_and_logprobs_match_hf(arch, tmp_path):
    path = write_tiny_model(tmp_path, arch, seed=1)
    hf = load_hf_model(path)
    rng = random.Random(len(arch))
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(12, 40))] for _ in range(2)]
    refs = [hf_greedy(hf, p, MAX_TOKENS, TOP) for p in prompts]
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, ref in zip(outs, refs, strict=True):
        assert_matches(arch, out, ref)


def test_ernie4_5_older_architecture_name(tmp_path):
    """`Ernie4_5_ForCausalLM` (the older dense releases' config.json spelling, as vLLM maps it)
    serves ERNIE 4.5's dense model: HF's greedy tokens and logprobs."""
    import json

    path = write_tiny_model(tmp_path, "ernie4_5", seed=1)
    hf = load_hf_model(path)
    data = json.loads((path / "config.json").read_text())
    data["architectures"] = ["Ernie4_5_ForCausalLM"]
    (path / "config.json").write_text(json.dumps(data))
    prompt = list(range(3, 30))
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert_matches("ernie4_5", out, hf_greedy(hf, prompt, MAX_TOKENS, TOP))


def test_ernie4_5_moe_tensor_parallel_matches_one_process(tmp_path):
    """TP=2 (gloo): routed experts, the biased shared expert (its down bias added once) and the
    biased lm_head split over two ranks."""
    path = write_tiny_model(tmp_path, "ernie4_5_moe", seed=3)
    prompt = [random.Random(5).randrange(3, 512) for _ in range(24)]
    assert_tp_matches_one_process(path, [prompt], MAX_TOKENS, 64)


@pytest.mark.parametrize("arch", ["granitemoeshared", "ernie4_5_moe"])
def test_transformers5_names_load_like_the_checkpoint(arch, tmp_path):
    """HF's in-memory state dict (experts fused as `experts.gate_up_proj` / `down_proj`, Granite's
    `router.weight`, ERNIE's `gate.moe_statics.e_score_correction_bias`) loads the values
    save_pretrained's checkpoint names gave."""
    path = write_tiny_model(tmp_path, arch, seed=2)
    assert_hf_names_load_like_checkpoint(path, ".experts.gate_up_proj")
