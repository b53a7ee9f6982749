"""OLMo 3 and Ministral 3 against HF transformers.

`LLM.generate` on tiny random models whose special features bite must give HF `generate`'s
greedy tokens and the same top-5 logprobs (1e-3, float32): OLMo 3's sliding layers (window 8,
shorter than every prompt) beside full ones, each layer type with its own rope (YaRN on the
full layers only); Ministral 3's per-position q scaling (original context 16, so the factor
steps up several times within a prompt), its YaRN rope and explicit head_dim, also with a
sliding window on every layer. Long prompts prefilled in chunks cross the window and the
scaling's steps inside a chunk; TP=2 gives the one-process results. Checked directly: the ropes
OLMo 3 configs of older transformers give (one rope_theta and rope_scaling, which transformers 5
no longer writes), and the q factor against HF's function bit for bit.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from hf_reference import (
    assert_matches,
    assert_tp_matches_one_process,
    hf_greedy,
    load_hf_model,
)

from paged_engine import LLM, SamplingParams
from paged_engine.layers.rotary import scaled_inv_freq
from paged_engine.models.ministral3 import llama4_attn_scale, llama4_scaling
from paged_engine.models.olmo3 import olmo3_ropes
from paged_engine.testing import write_tiny_model

transformers = pytest.importorskip("transformers")

MAX_TOKENS = 10
TOP = 5
# name -> (arch, config overrides)
CASES: dict[str, tuple[str, dict]] = {
    "olmo3": ("olmo3", {}),
    "ministral3": ("ministral3", {}),
    "ministral3-sliding": ("ministral3", {"sliding_window": 8}),
}


def _generate(llm, prompts, top: int = TOP):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=top)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


# The torch reference backend once (OLMo 3's windows): the backends' attention itself is checked
# against the reference in tests/engine/test_cpu_attention.py and tests/kernels.
@pytest.mark.parametrize(
    ("name", "backend"),
    [("olmo3", "cpu"), ("ministral3", "cpu"), ("ministral3-sliding", "cpu"), ("olmo3", "torch")],
)
def test_greedy_tokens_and_logprobs_match_hf(name, backend, tmp_path):
    arch, overrides = CASES[name]
    path = write_tiny_model(tmp_path, arch, seed=1, **overrides)
    hf = load_hf_model(path)
    rng = random.Random(name)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(12, 40))] for _ in range(3)]
    refs = [hf_greedy(hf, p, MAX_TOKENS, TOP) for p in prompts]
    llm = LLM(
        model=str(path),
        dtype="float32",
        max_model_len=128,
        block_size=16,
        attention_backend=backend,
    )
    for out, ref in zip(_generate(llm, prompts), refs, strict=True):
        assert_matches(f"{name} {backend}", out, ref)
    assert llm.get_stats().num_used_blocks == 0


@pytest.mark.parametrize("name", ["olmo3", "ministral3-sliding"])
def test_long_prompts_prefilled_in_chunks_match_hf(name, tmp_path):
    """Prompts of 10-15 windows, prefilled 32 tokens a step: a chunk's queries see keys of the
    previous chunks only through the window, and (Ministral 3) q's factor changes mid-chunk."""
    arch, overrides = CASES[name]
    path = write_tiny_model(tmp_path, arch, seed=2, **overrides)
    hf = load_hf_model(path)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (83, 120)]
    refs = [hf_greedy(hf, p, MAX_TOKENS, TOP) for p in prompts]
    llm = LLM(
        model=str(path),
        dtype="float32",
        max_model_len=192,
        block_size=16,
        max_num_batched_tokens=32,
        max_num_seqs=2,
    )
    for out, ref in zip(_generate(llm, prompts), refs, strict=True):
        assert_matches(f"{name} long", out, ref)


def test_tensor_parallel_matches_one_process(tmp_path):
    """TP=2 (gloo): OLMo 3's whole-projection q / k norms over sharded heads in both layer
    kinds (Ministral 3's per-token q factor is the same on every rank's heads)."""
    path = write_tiny_model(tmp_path, "olmo3", seed=3)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (30, 50)]
    assert_tp_matches_one_process(path, prompts, max_tokens=8, max_model_len=128)


def test_olmo3_ropes_per_layer_type():
    """transformers 5 configs: each layer type's own rope dict (what HF reads). Older ones: one
    rope_theta and rope_scaling, the scaling on the full layers only."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    nested = SimpleNamespace(
        max_position_embeddings=256,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 500_000.0},
            "full_attention": {**yarn, "rope_theta": 10_000.0},
        },
    )
    legacy = SimpleNamespace(max_position_embeddings=256, rope_theta=10_000.0, rope_scaling=yarn)
    types = ["sliding_attention", "full_attention"]
    for config, sliding_theta in ((nested, 500_000.0), (legacy, 10_000.0)):
        ropes = olmo3_ropes(config, 16, types)
        assert ropes["sliding_attention"] is not ropes["full_attention"]
        plain, _ = scaled_inv_freq(16, sliding_theta, None, 256)
        scaled, factor = scaled_inv_freq(16, 10_000.0, yarn, 256)
        pos = torch.arange(256, dtype=torch.float32)
        assert torch.equal(ropes["sliding_attention"].cos, torch.outer(pos, plain).cos())
        assert torch.equal(ropes["full_attention"].cos, torch.outer(pos, scaled).cos() * factor)
    only_full = olmo3_ropes(legacy, 16, ["full_attention"] * 2)
    assert set(only_full) == {"full_attention"}


def test_ministral3_q_scale_matches_hf_formula():
    """1 within the original context, then 1 + beta * log(1 + floor(pos / original)), float32
    bits as HF's `get_llama_4_attn_scale`."""
    mod = pytest.importorskip("transformers.models.ministral3.modeling_ministral3")
    positions = torch.tensor([0, 1, 15, 16, 17, 31, 32, 100, 16383, 16384, 300_000])
    ours = llama4_attn_scale(positions, 0.1, 16384)
    assert ours.dtype == torch.float32
    assert torch.equal(ours[:5], torch.ones(5))
    hf = mod.get_llama_4_attn_scale(positions[None], 0.1, 16384).flatten()
    assert torch.equal(ours, hf)


def test_ministral3_scaling_config():
    assert llama4_scaling(SimpleNamespace(rope_parameters={"rope_type": "default"})) is None
    params = {"llama_4_scaling_beta": 0.1, "original_max_position_embeddings": 16384}
    assert llama4_scaling(SimpleNamespace(rope_parameters=params)) == (0.1, 16384)
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        llama4_scaling(SimpleNamespace(rope_parameters={"llama_4_scaling_beta": 0.1}))
