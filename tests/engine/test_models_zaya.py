"""ZAYA1 (`ZayaForCausalLM`) against HF transformers.

`LLM.generate` on a tiny random ZAYA (tiny_config "zaya": CCA attention with convs of widths 3
and 2 over q | k and a delayed half of the values, full layers with partial rope beside sliding
ones with window 8, shorter than the prompts, and whole-head rope of another base, attention and
LM-head biases, a router MLP over 4 experts and a skip class fed the previous layer's router
state) gives HF `generate`'s greedy tokens and top-5 logprobs (1e-3, float32); so do balancing
biases that make the skip class win, the default layout (every layer "hybrid", convs of width
2, no biases, tied head), and prefills cut into chunks of 5 tokens and prefix-cache hits, which
resume the per-sequence conv and value state from snapshots. Tensor parallelism is refused by
name.
"""

from __future__ import annotations

import random

import pytest
import torch
from hf_reference import (
    assert_matches,
    assert_tiny_case_matches_hf,
    hf_greedy,
    load_hf_model,
)

from paged_engine import LLM, SamplingParams
from paged_engine.testing import write_tiny_model

pytest.importorskip("transformers")
pytest.importorskip("transformers.models.zaya")
safetensors_torch = pytest.importorskip("safetensors.torch")

MAX_TOKENS, TOP = 10, 5


def test_zaya_matches_hf(tmp_path):
    assert_tiny_case_matches_hf("zaya", "zaya", {}, tmp_path)


def test_zaya_default_layout_matches_hf(tmp_path):
    """Every layer full ("hybrid"), cca_time 2 / 2, no attention or head bias, tied head."""
    overrides = {
        "layer_types": None,
        "sliding_window": None,
        "rope_parameters": None,
        "cca_time0": 2,
        "cca_time1": 2,
        "attention_bias": False,
        "lm_head_bias": False,
    }
    assert_tiny_case_matches_hf("zaya-default", "zaya", overrides, tmp_path)


def test_zaya_skip_expert_matches_hf(tmp_path):
    """Balancing biases that let the skip class win (transformers sets its bias to -1.0 at
    load, whatever the checkpoint holds: so does the loader), so that some tokens' MoE outputs
    are zero."""
    path = write_tiny_model(tmp_path, "zaya", seed=1)
    weights = safetensors_torch.load_file(path / "model.safetensors")
    for name in weights:
        if name.endswith("mlp.gate.balancing_biases"):
            weights[name] = torch.tensor([-1.25, -0.95, -1.2, -1.1, 0.5])
    safetensors_torch.save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    hf = load_hf_model(path)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 17, 33)]
    refs = [hf_greedy(hf, p, MAX_TOKENS, TOP) for p in prompts]
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, ref in zip(outs, refs, strict=True):
        assert_matches("zaya skip expert", out, ref)


def test_zaya_chunked_prefill_and_prefix_hits_match_hf(tmp_path):
    """Prefill chunks of 5 tokens continue the conv / delayed-value state; a second wave of
    prompts sharing a 21-token prefix resumes from prefix-cache snapshots."""
    path = write_tiny_model(tmp_path, "zaya", seed=2)
    hf = load_hf_model(path)
    rng = random.Random(11)
    prefix = [rng.randrange(3, 512) for _ in range(21)]
    prompts = [prefix + [rng.randrange(3, 512) for _ in range(n)] for n in (3, 9, 14)]
    refs = [hf_greedy(hf, p, MAX_TOKENS, TOP) for p in prompts]
    llm = LLM(
        model=str(path),
        dtype="float32",
        max_model_len=128,
        block_size=4,
        max_num_batched_tokens=5,
        enable_prefix_caching=True,
    )
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP)
    try:
        for wave in range(2):  # the second wave hits the cache
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            for out, ref in zip(outs, refs, strict=True):
                assert_matches(f"zaya chunked, wave {wave}", out, ref)
        assert llm.get_stats().num_used_blocks == 0
    finally:
        llm.llm_engine.shutdown()


def test_zaya_refuses_tensor_parallelism(tmp_path):
    path = write_tiny_model(tmp_path, "zaya", seed=3)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(model=str(path), dtype="float32", max_model_len=64, tensor_parallel_size=2)
