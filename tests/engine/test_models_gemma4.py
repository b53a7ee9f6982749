"""Gemma 4 (text) against HF transformers.

`LLM.generate` on tiny random models must give HF `generate`'s greedy tokens and the same top-5
logprobs (1e-3, float32), in the two layouts the family ships:

- E2B / E4B: sliding layers (window 8, shorter than every prompt) of head size 16 beside full
  layers of head size 32, proportional rope on a quarter of the full
  layers' head, per-layer inputs (PLE), and the last two layers attending over earlier layers'
  KV (no K / V of their own, double-wide MLPs), every layer scaled by a random `layer_scalar`;
- 26B-A4B: tanh-GELU experts beside the dense MLP, routed from the residual stream with
  per-expert scales, and full layers with one global KV head whose values are their key
  projection (k_eq_v).

Also: the released models' 512-wide full-layer heads run in the Triton kernel as on the CPU
backend; TP=2 gives the one-process results; a LoRA adapter on the attention projections gives
HF's merged model; the KV cache holds one tensor per layer that computes KV, each of its own
shape; what the engine does not do is refused by name.
"""

from __future__ import annotations

import pytest
from hf_reference import (
    assert_lora_matches_hf_merged,
    assert_same_greedy,
    assert_tiny_case_matches_hf,
    assert_tp_matches_one_process,
    engine_greedy,
    random_token_prompts,
)

from paged_engine import LLM
from paged_engine.testing import write_tiny_model

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.gemma4")

CASES = {"gemma4": ("gemma4", {}), "gemma4_moe": ("gemma4_moe", {})}
PROMPTS = [[5, 9, 33, 71, 2, 8, 100, 41, 77, 3, 12, 90, 4], list(range(20, 58))]


@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_and_logprobs_match_hf(case, tmp_path):
    assert_tiny_case_matches_hf(case, *CASES[case], tmp_path)


def test_tensor_parallel_matches_one_process(tmp_path):
    """TP=2 over per-layer inputs, KV-shared layers and two cache shapes (the MoE's experts
    split as every FusedMoE's do: tests/engine/test_models_moe.py)."""
    path = write_tiny_model(tmp_path, "gemma4", seed=3)
    assert_tp_matches_one_process(path, PROMPTS, 8, max_model_len=64)


def test_head_size_512_runs_in_the_triton_kernel(tmp_path):
    """The released models' full layers hold 512-wide heads: the Triton backend (interpreted
    here) takes them and gives the CPU backend's tokens and logprobs, prompts in chunks."""
    path = write_tiny_model(tmp_path, "gemma4", seed=1, global_head_dim=512)
    # 12 + 12 tokens over a 16-token budget: the second prompt in two chunks, both past the
    # sliding window (8) and over two 8-token blocks, the last one partial; the interpreter
    # runs a program per token and head of every launch
    prompts = [p[:12] for p in random_token_prompts(5, 2)]
    kw = {"model": str(path), "max_model_len": 64, "max_num_batched_tokens": 16, "block_size": 8}
    cpu, triton = (engine_greedy(prompts, 3, attention_backend=b, **kw) for b in ("cpu", "triton"))
    assert_same_greedy(cpu, triton)


def test_lora_on_attention_matches_hf_merged(tmp_path):
    """An adapter on q / k / o: on k_eq_v full layers the k_proj delta reaches the values too
    (they are the key projection), as in HF's merged model."""
    path = write_tiny_model(tmp_path / "model", "gemma4_moe", seed=1)
    targets = ("q_proj", "k_proj", "o_proj")
    assert_lora_matches_hf_merged(path, tmp_path, list(range(5, 30)), 6, 3, targets=targets)


@pytest.mark.parametrize(
    ("arch", "want"),
    [
        # layers 0-3 (4 and 5 read 3's and 2's): full layers of head size 32
        ("gemma4", [(2, 16), (2, 16), (2, 32), (2, 16)]),
        # k_eq_v: the full layer's one global KV head
        ("gemma4_moe", [(2, 16), (2, 16), (1, 32)]),
    ],
)
def test_kv_cache_holds_each_kv_layer_in_its_own_shape(arch, want, tmp_path):
    """One cache per layer that computes KV, each (KV heads, head size) its layer's."""
    llm = LLM(model=str(write_tiny_model(tmp_path, arch)), dtype="float32", max_model_len=64)
    cache = llm.llm_engine.model_runner.cache
    assert [tuple(k.shape) for k, _ in cache.kv_caches] == [
        cache.backend.kv_cache_shape(cache.num_blocks, 16, h, d) for h, d in want
    ]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kv_cache_dtype": "fp8"}, "fp8 KV cache is not supported"),
        ({"pipeline_parallel_size": 2}, "does not support pipeline parallelism"),
    ],
)
def test_refusals(kwargs, match, tmp_path):
    path = write_tiny_model(tmp_path, "gemma4")
    with pytest.raises(ValueError, match=match):
        LLM(model=str(path), dtype="float32", max_model_len=64, **kwargs)


def test_bidirectional_encoder_is_refused():
    from paged_engine.models.gemma4 import Gemma4ForCausalLM
    from paged_engine.testing import tiny_config

    with pytest.raises(ValueError, match="use_bidirectional_attention='all'"):
        Gemma4ForCausalLM(tiny_config("gemma4", use_bidirectional_attention="all"))
