"""DeepSeek Sparse Attention through paged_kernels' batched indexer top-k and sparse MLA kernel
(the CUDA path, forced here on the CPU under TRITON_INTERPRET=1) against the per-sequence torch
reference: the same greedy tokens and logprobs (1e-3, float32) for a batch of prompts of
different lengths, prefilled in chunks of 8 over 4-token blocks, the repeated prompts served
partly from the prefix cache. GLM-5's shared layers reuse the full layers' kernel choice;
Hy-V4's sinks join the kernel's softmax; Mistral Large 4's NoPE layer has no rope part."""

from __future__ import annotations

import pytest
from hf_reference import assert_same_greedy, random_token_prompts

from paged_engine import LLM, SamplingParams
from paged_engine.models import deepseek_v32
from paged_engine.testing import write_tiny_model

transformers = pytest.importorskip("transformers")
pytest.importorskip("triton")

CONFIGS = {"deepseek_v32": "DeepseekV32Config", "glm_moe_dsa": "GlmMoeDsaConfig",
           "hy_v4": "HYV4Config", "mistral_large4": "MistralLarge4Config"}  # fmt: skip


def _write(arch: str, tmp_path) -> str:
    if not hasattr(transformers, CONFIGS[arch]):
        pytest.skip(f"this transformers has no {CONFIGS[arch]}")
    if arch != "mistral_large4":
        return str(write_tiny_model(tmp_path, arch, seed=5))
    from test_models_mistral_large4 import write_text, write_wrapper

    return str(write_text(write_wrapper(tmp_path / "wrapper"), tmp_path / "text"))


def _generate(path: str, prompts: list[list[int]]) -> tuple[list, list[int]]:
    """Greedy CompletionOutputs and each request's prefix-cache hit, in a small chunked pool."""
    llm = LLM(
        model=path, dtype="float32", max_model_len=64, block_size=4, max_num_batched_tokens=8,
        max_num_seqs=3, enable_prefix_caching=True,
    )  # fmt: skip
    # 3 tokens: two decode steps after each prefill (each step slow in the interpreter)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=0)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    return [o.outputs[0] for o in outs], [o.num_cached_tokens for o in outs]


@pytest.mark.parametrize("arch", CONFIGS)
def test_kernel_path_matches_the_torch_reference(arch, tmp_path, monkeypatch):
    path = _write(arch, tmp_path)
    shared = list(range(7, 26))
    # 12 random tokens (of 12-40): every token is a program of each launch in the interpreter
    once = [shared + [30, 31], [5, 9, 33], random_token_prompts(arch, 1)[0][:12], shared + [40]]
    prompts = once + once[:1]  # the last one runs after the first finished: a cache hit
    attention = deepseek_v32.SparseLatentAttention
    monkeypatch.setattr(attention, "kernel_path", False)  # the reference, on a GPU too
    want, _ = _generate(path, prompts)

    monkeypatch.setattr(attention, "kernel_path", True)
    ran: list[int] = []

    def keep(self, *args):
        raise AssertionError("the torch reference ran on the kernel path")

    def run_kernels(self, q, index_q, rows_cache, md):
        ran.append(q.shape[0])
        return kernels(self, q, index_q, rows_cache, md)

    kernels = attention._run_kernels
    monkeypatch.setattr(attention, "_keep", keep)
    monkeypatch.setattr(attention, "_run_kernels", run_kernels)
    got, cached = _generate(path, prompts)
    assert_same_greedy(want, got, abs_tol=1e-3)
    assert cached[-1] >= 16 and max(ran) == 8 and min(ran) < 8  # chunks, decode steps
