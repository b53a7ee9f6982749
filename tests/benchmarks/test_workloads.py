from __future__ import annotations

import json

from benchmarks.models import CONFIGS
from benchmarks.workloads import NANO_VLLM_OUTPUT_TOKENS, fixed_length, nano_vllm, standard


def test_nano_vllm_is_the_published_workload():
    wl = nano_vllm()
    assert wl.num_requests == 256
    assert wl.output_tokens == NANO_VLLM_OUTPUT_TOKENS == 133_966
    assert all(100 <= len(r.prompt_token_ids) <= 1024 for r in wl.requests)
    assert all(0 <= t <= 10000 for r in wl.requests for t in r.prompt_token_ids)
    assert wl.temperature == 0.6 and not wl.scaled


def test_fixed_length_and_scaling_are_stated():
    wl = fixed_length()
    assert wl.num_requests == 1000 and not wl.scaled
    assert {len(r.prompt_token_ids) for r in wl.requests} == {1024}
    assert {r.max_tokens for r in wl.requests} == {128}
    small = fixed_length(4, 16, 8)
    assert small.scaled and "scaled down" in small.describe()
    assert nano_vllm(4, (8, 16), (2, 4)).requests == nano_vllm(4, (8, 16), (2, 4)).requests


def test_standard_sizes():
    assert [w.num_requests for w in standard(False, "cuda")] == [256, 1000]
    assert all(w.scaled for w in standard(True, "cpu"))


def test_committed_configs_are_the_published_architectures():
    from transformers import AutoConfig

    expect = {
        "qwen3-0.6b": (28, 1024, 16, 8, 151936),
        "llama-3.2-1b": (16, 2048, 32, 8, 128256),
        "llama-3.1-8b": (32, 4096, 32, 8, 128256),
        "qwen3-30b-a3b": (48, 2048, 32, 4, 151936),
    }
    assert set(expect) <= set(CONFIGS)
    for name, (layers, hidden, heads, kv_heads, vocab) in expect.items():
        cfg = AutoConfig.for_model(**json.loads(CONFIGS[name].read_text()))
        got = (
            cfg.num_hidden_layers,
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.vocab_size,
        )
        assert got == (layers, hidden, heads, kv_heads, vocab), name
    moe = AutoConfig.for_model(**json.loads(CONFIGS["qwen3-30b-a3b"].read_text()))
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (128, 8, 768)
    oss = AutoConfig.for_model(**json.loads(CONFIGS["gpt-oss-20b"].read_text()))
    got = (oss.num_hidden_layers, oss.hidden_size, oss.num_local_experts, oss.num_experts_per_tok)
    assert got == (24, 2880, 32, 4) and oss.layer_types[:2] == [
        "sliding_attention",
        "full_attention",
    ]
    assert (oss.sliding_window, oss.head_dim, oss.vocab_size) == (128, 64, 201088)
