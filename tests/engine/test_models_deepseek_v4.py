"""DeepSeek-V4 against HF transformers.

`LLM.generate` on tiny random DeepSeek-V4s (tiny_config "deepseek_v4": 3 hyper-connection
streams, a sliding layer with a window of 8 shorter than the prompts, compressed-sparse layers
(windows of 4, the indexer keeping 2 of up to 12 entries) and a heavily compressed one (windows
of 8), their rope YaRN x4, a hash-routed MoE layer before top-k ones, SwiGLU clamped at 1) gives
HF `generate`'s greedy tokens and top-5 logprobs (1e-3, float32); a second layout (2 streams,
sigmoid router, plain ropes, windows of 2 and 4, a CSA layer first, 4 output groups) too. Also:
prefill in chunks that split the compressor windows, and prefix caching, give the one-pass
results; TP=2 gives the one-process results; pipeline parallelism and an fp8 KV cache are
refused by name.
"""

from __future__ import annotations

import pytest
from hf_reference import (
    assert_same_greedy,
    assert_tiny_case_matches_hf,
    assert_tp_matches_one_process,
    engine_greedy,
    random_token_prompts,
)

from paged_engine import LLM
from paged_engine.testing import write_tiny_model

pytest.importorskip("transformers.models.deepseek_v4")

VARIANT = {
    "num_hidden_layers": 3,
    "layer_types": [
        "compressed_sparse_attention",
        "sliding_attention",
        "heavily_compressed_attention",
    ],
    "mlp_layer_types": ["moe", "hash_moe", "moe"],
    "compress_rates": {"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
    "scoring_func": "sigmoid",
    "hc_mult": 2,
    "o_groups": 4,
    "o_lora_rank": 8,
    "index_topk": 3,
    "sliding_window": 6,
    "rope_parameters": None,
    "routed_scaling_factor": 2.0,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("deepseek_v4"), "deepseek_v4", seed=1)


def test_matches_hf(tmp_path):
    assert_tiny_case_matches_hf("deepseek_v4", "deepseek_v4", {}, tmp_path)


def test_variant_matches_hf(tmp_path):
    assert_tiny_case_matches_hf("deepseek_v4 variant", "deepseek_v4", VARIANT, tmp_path)


def test_chunked_prefill_and_prefix_caching(model_dir):
    """Chunks of 5 tokens split the windows of 4 and 8; prompts sharing a 20-token prefix hit
    the prefix cache (blocks of 16)."""
    base = random_token_prompts(4, 3)
    prompts = [base[0][:20] + p for p in base]
    kw = {"model": str(model_dir), "max_model_len": 96}
    want = engine_greedy(prompts, 6, **kw)
    chunked = engine_greedy(prompts, 6, max_num_batched_tokens=5, **kw)
    cached = engine_greedy(prompts, 6, enable_prefix_caching=True, block_size=16, **kw)
    assert_same_greedy(want, chunked)
    assert_same_greedy(want, cached)


def test_tp2_matches_one_process(model_dir):
    assert_tp_matches_one_process(model_dir, random_token_prompts(7, 2), 6, 96)


def test_pipeline_parallelism_refused(model_dir):
    with pytest.raises(ValueError, match="DeepSeek-V4 does not support pipeline parallelism"):
        LLM(model=str(model_dir), dtype="float32", max_model_len=64, pipeline_parallel_size=2)


def test_fp8_kv_cache_refused(model_dir):
    # the records hold compressor inputs, not keys: refused as the engine starts
    with pytest.raises(ValueError, match="fp8 KV cache is not supported for DeepseekV4"):
        LLM(model=str(model_dir), dtype="float32", max_model_len=64, kv_cache_dtype="fp8")


def test_prompt_embeds_refused(model_dir):
    # hash-routed layers pick experts by token id, which rows given as embeddings lack
    with pytest.raises(ValueError, match=r"enable_prompt_embeds: .*hash-routed"):
        LLM(model=str(model_dir), dtype="float32", max_model_len=128, enable_prompt_embeds=True)
