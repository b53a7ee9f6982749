"""The rope kernel's fused KV write (paged_kernels.rope_qk_ with the layer's caches and slots)
inside the engine on the Triton backend (Triton's interpreter on a CPU), against the same engine
with the separate write kernel (TritonBackend.rope_writes_kv off)."""

from __future__ import annotations

import random

import pytest

from paged_engine import LLM, SamplingParams


# e4m3 on Gemma 3 (q / k norms, sliding layers); e5m2 and Qwen3's norms: the kernel's own
# bit-for-bit tests (tests/kernels/test_rotary.py), which run in a fraction of an engine's time
@pytest.mark.parametrize(("arch", "kv_cache_dtype"), [("llama", "auto"), ("gemma3", "fp8")])
def test_rope_kernel_writes_the_kv_cache(tiny_model_factory, monkeypatch, arch, kv_cache_dtype):
    """On the Triton backend each attention layer's rope kernel also stores the step's K/V in
    the paged cache (no write launch of its own); the engine with the separate write kernel
    gives the same greedy tokens and bit-identical logprobs, over prefills, a chunked prefill,
    a prefix hit and decode steps (Gemma 3's q/k norms and sliding layers, an fp8 cache)."""
    from paged_engine.attention.triton_backend import TritonBackend

    writes = []
    plain_write = TritonBackend.write_kv

    def counted(self, *args, **kwargs):
        writes.append(1)
        return plain_write(self, *args, **kwargs)

    monkeypatch.setattr(TritonBackend, "write_kv", counted)
    rng = random.Random(5)
    # Each token is a program of every kernel launch in the interpreter: few, short prompts.
    # 6 + 5 + 3 tokens over an 8-token budget: prompt 1 is chunked (2 tokens, then 3); 6 and
    # 5 tokens pass Gemma 3's sliding window (4 here).
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (6, 5, 3)]
    prompts.append(prompts[0][:4] + [7, 8, 9])  # a prefix hit on prompt 0's first block
    # Gemma 3 with one layer of each kind (the tiny model's default has three): launches per
    # step are the interpreter's cost
    gemma3 = {
        "num_hidden_layers": 2,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 4,
    }
    # One engine serves both runs (the backend reads rope_writes_kv at every forward), so the
    # fp8 scales are calibrated once and both runs use the same.
    llm = LLM(
        model=str(tiny_model_factory(arch, **(gemma3 if arch == "gemma3" else {}))),
        dtype="float32",
        attention_backend="triton",
        kv_cache_dtype=kv_cache_dtype,
        max_model_len=64,
        max_num_batched_tokens=8,
        block_size=4,
        enable_prefix_caching=True,
    )
    params = SamplingParams(temperature=0, max_tokens=3, logprobs=3, ignore_eos=True)
    runs = {}
    for fused in (True, False):
        monkeypatch.setattr(TritonBackend, "rope_writes_kv", fused)
        assert llm.reset_prefix_cache()  # the second run computes every block again
        writes.clear()
        # three prompts in one batch, then the one that hits prompt 0's cached blocks
        first = [{"prompt_token_ids": p} for p in prompts[:3]]
        outs = llm.generate(first, params, use_tqdm=False)
        outs += llm.generate({"prompt_token_ids": prompts[3]}, params, use_tqdm=False)
        runs[fused] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
        assert outs[-1].num_cached_tokens > 0
        assert bool(writes) != fused, f"{len(writes)} write launches (fused={fused})"
    llm.llm_engine.shutdown()
    assert runs[True] == runs[False]
