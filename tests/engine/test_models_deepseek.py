"""DeepSeek-V2 / V3 (multi-head latent attention over a latent KV cache, DeepSeek's MoE) against
HF transformers, and the latent cache against the engine's machinery.

Tiny random models through `LLM.generate` must give HF `generate`'s greedy tokens and top-5
logprobs (1e-3, float32): V3 with a q bottleneck, YaRN with both mscales, group-limited routing
over biased sigmoid scores and a shared expert; a V3 variant without the q bottleneck or YaRN;
V2 (softmax routing); GLM-4.7-Flash (`mlp_layer_types`); Mistral 4 (Llama-4 query scaling past
a 16-token original context, its softmax router; interleaved and NeoX rope); V3 on the Triton
kernels (interpreter) and at TP=2 (gloo).
"""

from __future__ import annotations

import random

import pytest
import torch
from hf_reference import (
    assert_lora_matches_hf_merged,
    assert_matches,
    assert_tp_matches_one_process,
    hf_greedy,
    load_hf_model,
)

import paged_kernels
from paged_engine import LLM, SamplingParams
from paged_engine.testing import write_tiny_model
from paged_engine.worker.cache_engine import CacheEngine, latent_kv

transformers = pytest.importorskip("transformers")

MAX_TOKENS = 8
TOP = 5
VARIANTS = {
    "v3": ("deepseek_v3", {}),
    # V2-Lite's shape: q straight from x, no YaRN; attention biases on
    "v3-no-q-lora": (
        "deepseek_v3",
        {"q_lora_rank": None, "rope_scaling": None, "attention_bias": True},
    ),
    "v2": ("deepseek_v2", {}),
    "glm4_moe_lite": ("glm4_moe_lite", {}),
    # a large rms_norm_eps: the layer norms take it, the latent norms keep 1e-6 (as HF builds them)
    "glm4_moe_lite-eps": ("glm4_moe_lite", {"rms_norm_eps": 0.5}),
    # position-scaled queries, softmax routing over top-2-sum groups, renormalized
    "mistral4": ("mistral4", {}),
    "mistral4-neox-rope": ("mistral4", {"rope_interleave": False}),
    # MiniCPM3: dense MLPs, MiniCPM's scalars, NeoX rope; longrope (short factors in use: the
    # 128-token context is within the original 256) and without the q bottleneck
    "minicpm3": ("minicpm3", {}),
    "minicpm3-longrope": (
        "minicpm3",
        {
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0, 1.3, 2.0, 3.5],
                "long_factor": [1.5, 2.0, 4.0, 8.0],
                "original_max_position_embeddings": 256,
            },
            "max_position_embeddings": 1024,
        },
    ),
    "minicpm3-no-q-lora": ("minicpm3", {"q_lora_rank": None}),
}


def _prompts(seed: int, count: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(12, 40))] for _ in range(count)]


def _generate(llm, prompts, **kw):
    params = SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP, **kw
    )
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_tokens_and_logprobs_match_hf(variant, tmp_path):
    arch, overrides = VARIANTS[variant]
    if arch == "minicpm3" and not hasattr(transformers, "MiniCPM3Config"):
        pytest.skip("this transformers has no MiniCPM3")
    path = write_tiny_model(tmp_path, arch, seed=1, **overrides)
    hf = load_hf_model(path)
    prompts = _prompts(7)
    refs = [hf_greedy(hf, p, MAX_TOKENS, TOP) for p in prompts]
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, block_size=16)
    for out, ref in zip(_generate(llm, prompts), refs, strict=True):
        assert_matches(variant, out, ref)
    assert llm.get_stats().num_used_blocks == 0


@pytest.mark.skipif(not paged_kernels.triton_available(), reason="needs triton")
def test_triton_kernels_give_hf_tokens(tmp_path):
    """One KV head of kv_lora_rank + rope entries (40: not a power of two), values read from
    the key cache, 4 query heads on it."""
    path = write_tiny_model(tmp_path, "deepseek_v3", seed=2)
    hf = load_hf_model(path)
    prompt = _prompts(11, 1)[0]
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, attention_backend="triton")
    out = _generate(llm, [prompt])[0]
    assert_matches("deepseek_v3 triton", out, hf_greedy(hf, prompt, MAX_TOKENS, TOP))


def test_tensor_parallel_matches_one_process(tmp_path):
    """TP=2: each rank holds half the heads (q_b_proj / kv_b_proj rows, o_proj columns) and
    the whole latent cache."""
    path = write_tiny_model(tmp_path, "deepseek_v3", seed=3)
    assert_tp_matches_one_process(path, _prompts(5, 2), MAX_TOKENS, 128)


def test_latent_cache_is_one_tensor_a_layer(tmp_path):
    """The cache holds kv_lora_rank + qk_rope_head_dim entries a token and layer, once: the
    key and value of a layer are one tensor; block copies and swaps move it once."""
    path = write_tiny_model(tmp_path, "deepseek_v3", seed=4)
    config = transformers.AutoConfig.from_pretrained(path)
    assert latent_kv(config)
    per_token = 32 + 8  # kv_lora_rank + qk_rope_head_dim of the tiny config
    layers = config.num_hidden_layers
    assert CacheEngine.bytes_per_block(config, 16, torch.float32) == layers * 16 * per_token * 4
    from paged_engine.attention.cpu_backend import CpuBackend

    cache = CacheEngine(
        config,
        6,
        16,
        dtype=torch.float32,
        device=torch.device("cpu"),
        backend=CpuBackend(),
        num_cpu_blocks=3,
    )
    for key, value in (*cache.kv_caches, *cache.cpu_caches):
        assert key is value
    first = cache.kv_caches[0][0]
    cache.kv_caches[0][0].copy_(torch.randn(first.shape))
    block = first.select(cache._block_dim, 2).clone()
    cache.copy_blocks([(2, 4)])
    assert torch.equal(first.select(cache._block_dim, 4), block)
    cache.swap_out([(4, 1)])
    first.zero_()
    cache.swap_in([(1, 5)])
    assert torch.equal(first.select(cache._block_dim, 5), block)


def test_shared_prefix_and_parallel_samples(tmp_path):
    """n=3 greedy samples share the prompt's blocks (copy-on-write on the latent cache) and
    equal one greedy run; a second request with the same prompt hits the prefix cache."""
    path = write_tiny_model(tmp_path, "deepseek_v3", seed=5)
    prompt = _prompts(13, 1)[0]
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, enable_prefix_caching=True)
    (single,) = _generate(llm, [prompt])
    hits = llm.get_stats().prefix_cache_hits
    (shared,) = _generate(llm, [prompt], n=3)
    want = single.outputs[0].token_ids
    assert [c.token_ids for c in shared.outputs] == [want] * 3
    assert llm.get_stats().prefix_cache_hits >= hits + 16  # the prompt's first full block
    assert llm.get_stats().num_used_blocks == 0


def test_auto_backend_on_cuda_takes_torch_for_wide_heads(caplog):
    """paged_attention holds heads of up to MAX_HEAD_DIM entries: a wider KV head (no supported
    model has one; MLA's 576-wide latent has its own kernel, mla_attention) runs on the torch
    reference under "auto", and an explicit "triton" is refused up front."""
    from paged_engine.attention import get_attention_backend
    from paged_engine.attention.torch_backend import TorchBackend

    if not paged_kernels.triton_available():
        pytest.skip("needs triton")
    cuda = torch.device("cuda")  # only named: no tensor is made
    wide = paged_kernels.MAX_HEAD_DIM + 64
    assert isinstance(get_attention_backend("auto", cuda, head_dim=wide), TorchBackend)
    assert "torch reference" in caplog.text
    with pytest.raises(ValueError, match="attention_backend='triton' takes head sizes"):
        get_attention_backend("triton", cuda, head_dim=wide)
    assert not isinstance(get_attention_backend("auto", cuda, head_dim=128), TorchBackend)


def test_batch_invariant_mode_is_refused(tmp_path):
    """MLA's absorbed products are batched matmuls without a fixed-order kernel: refused, named."""
    path = write_tiny_model(tmp_path, "deepseek_v3", seed=6, first_k_dense_replace=3)
    with pytest.raises(ValueError, match="multi-head latent attention"):
        LLM(model=str(path), dtype="float32", max_model_len=64, batch_invariant=True)


def test_lora_on_latent_attention_matches_hf_merged(tmp_path):
    """An adapter on MLA's projections (the replicated q_a_proj / kv_a_proj_with_mqa, the
    per-head q_b_proj, o_proj) and the MLPs' down_proj; kv_b_proj, absorbed into the attention,
    is refused by name (the loader's error names the module)."""
    path = write_tiny_model(tmp_path / "m", "deepseek_v3", seed=7)
    prompt = _prompts(17, 1)[0]
    targets = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj", "down_proj")
    assert_lora_matches_hf_merged(path, tmp_path, prompt, MAX_TOKENS, TOP, targets=targets)
    from paged_engine import LoRARequest
    from paged_engine.testing import write_lora_adapter

    bad = write_lora_adapter(tmp_path / "kv_b", path, rank=4, target_modules=("kv_b_proj",))
    llm = LLM(model=str(path), dtype="float32", max_model_len=64, enable_lora=True)
    with pytest.raises(ValueError, match="kv_b_proj"):
        request = LoRARequest("kv_b", 1, str(bad))
        llm.generate([{"prompt_token_ids": prompt}], lora_request=request, use_tqdm=False)
