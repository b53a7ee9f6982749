"""Gemma 1, Granite (and GraniteSWA), OLMo 2, Qwen2-MoE and SmolLM3 against HF transformers
(Qwen2-MoE also with a LoRA adapter on its shared expert).

`LLM.generate` on tiny random models whose special features bite (Granite's four multipliers
away from 1; Qwen2-MoE's shared expert, a dense layer among sparse ones, unnormalized top-k;
GraniteSWA's sinks, windows and per-layer rope bases with a NoPE layer; OLMo 2's post-norms and
whole-projection q/k norms; Gemma 1's explicit head_dim; SmolLM3's
layers without rope) must give HF
`generate`'s greedy tokens and the same top-5 logprobs (1e-3, float32); Qwen2-MoE also at TP=2.
"""

from __future__ import annotations

import random

import pytest
from hf_reference import assert_lora_matches_hf_merged, assert_matches, hf_greedy, load_hf_model

from paged_engine import LLM, SamplingParams
from paged_engine.testing import write_tiny_model

transformers = pytest.importorskip("transformers")

MAX_TOKENS = 10
TOP = 5
ARCHS = ["gemma", "granite", "granite_swa", "olmo2", "qwen2_moe", "smollm3"]


def _generate(llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_and_logprobs_match_hf(arch, tmp_path):
    if arch == "granite_swa" and not hasattr(transformers, "GraniteSWAConfig"):
        pytest.skip("this transformers has no GraniteSWA")
    path = write_tiny_model(tmp_path, arch, seed=1)
    hf = load_hf_model(path)
    rng = random.Random(len(arch))
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(12, 40))] for _ in range(3)]
    refs = [hf_greedy(hf, p, MAX_TOKENS, TOP) for p in prompts]
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, block_size=16)
    for out, ref in zip(_generate(llm, prompts), refs, strict=True):
        assert_matches(arch, out, ref)
    assert llm.get_stats().num_used_blocks == 0


def test_qwen2_moe_tensor_parallel_matches_hf(tmp_path):
    """TP=2 (gloo): experts' and shared expert's halves summed by one all-reduce."""
    path = write_tiny_model(tmp_path, "qwen2_moe", seed=3)
    prompt = [random.Random(5).randrange(3, 512) for _ in range(30)]
    ref = hf_greedy(load_hf_model(path), prompt, MAX_TOKENS, TOP)
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, tensor_parallel_size=2)
    try:
        outs = _generate(llm, [prompt])
    finally:
        llm.llm_engine.shutdown()
    assert_matches("qwen2_moe tp=2", outs[0], ref)


def test_qwen2_moe_lora_on_the_shared_expert_matches_hf_merged(tmp_path):
    """An adapter on down_proj reaches the shared expert, whose partial sum leaves the reduce to
    the block: its delta must count once (it used to be dropped)."""
    path = write_tiny_model(tmp_path / "m", "qwen2_moe", seed=4)
    prompt = [random.Random(8).randrange(3, 512) for _ in range(20)]
    assert_lora_matches_hf_merged(path, tmp_path, prompt, MAX_TOKENS, TOP)
