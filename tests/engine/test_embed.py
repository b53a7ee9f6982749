"""LLM.embed / PoolingParams: embeddings pooled from the final hidden states in the step.

Reference: HF transformers' base model `last_hidden_state` (the final normed hidden state) on
the same weights, last token or mean over the prompt, L2-normalized.
"""

from __future__ import annotations

import pytest
import torch

from paged_engine import LLM, EmbeddingRequestOutput, PoolingParams, SamplingParams
from paged_engine.testing import SUPPORTED_TINY_ARCHS

PROMPTS = [list(range(3, 40)), [5, 6, 7], list(range(50, 71)), [9]]


def make_llm(path, **kw) -> LLM:
    kw = {
        "device": "cpu",
        "dtype": "float32",
        "num_gpu_blocks_override": 64,
        "max_model_len": 128,
        "max_num_batched_tokens": 16,  # the 37-token prompt is pooled over 3 chunks
        **kw,
    }
    return LLM(model=str(path), **kw)


def hf_embeddings(path, prompts, pooling: str, normalize: bool = True) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            h = model.base_model(torch.tensor([p])).last_hidden_state[0]  # [T, D]
            v = h[-1] if pooling == "LAST" else h.mean(0)
            out.append(torch.nn.functional.normalize(v, dim=-1) if normalize else v)
    return out


def assert_close(outs: list[EmbeddingRequestOutput], refs: list[torch.Tensor]) -> None:
    assert len(outs) == len(refs)
    for o, ref in zip(outs, refs):
        got = torch.tensor(o.outputs.embedding)
        assert got.shape == ref.shape
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", SUPPORTED_TINY_ARCHS)
@pytest.mark.parametrize("pooling", ["LAST", "MEAN"])
def test_embed_matches_hf(tiny_model_factory, arch, pooling):
    path = tiny_model_factory(arch)
    llm = make_llm(path, pooler_config={"pooling_type": pooling})
    outs = llm.embed(PROMPTS, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == PROMPTS and all(o.finished for o in outs)
    assert_close(outs, hf_embeddings(path, PROMPTS, pooling))
    assert abs(sum(v * v for v in outs[0].outputs.embedding) - 1.0) < 1e-5


def test_normalize_off_and_text_prompts(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    raw = llm.embed(PROMPTS, PoolingParams(normalize=False), use_tqdm=False)
    assert_close(raw, hf_embeddings(tiny_llama_dir, PROMPTS, "LAST", normalize=False))
    tok = llm.get_tokenizer()
    (text,) = llm.embed("hello world", use_tqdm=False)
    assert text.prompt_token_ids == tok.encode("hello world")
    assert text.prompt == "hello world"


def test_embed_batches_with_generation_and_keeps_it_unchanged(tiny_llama_dir):
    """Embedding and generation requests in the same steps: each gives what it gives alone."""
    llm = make_llm(tiny_llama_dir)
    params = SamplingParams(temperature=0, max_tokens=8)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    engine = llm.llm_engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"g{i}", p, params, final_only=True)
        engine.add_request(f"e{i}", p, PoolingParams(), final_only=True)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert [list(done[f"g{i}"].outputs[0].token_ids) for i in range(4)] == [list(t) for t in alone]
    embeds = [EmbeddingRequestOutput.from_base(done[f"e{i}"]) for i in range(4)]
    assert_close(embeds, hf_embeddings(tiny_llama_dir, PROMPTS, "LAST"))


def test_prefix_cache_keeps_embeddings(tiny_llama_dir):
    """LAST reuses cached prefixes (the last prompt token always runs); MEAN skips the cache."""
    for pooling in ("LAST", "MEAN"):
        llm = make_llm(tiny_llama_dir, pooler_config={"pooling_type": pooling})
        refs = hf_embeddings(tiny_llama_dir, PROMPTS, pooling)
        assert_close(llm.embed(PROMPTS, use_tqdm=False), refs)
        assert_close(llm.embed(PROMPTS, use_tqdm=False), refs)  # cached now
        hits = llm.get_stats().prefix_cache_hits
        assert hits > 0 if pooling == "LAST" else hits == 0


@pytest.mark.parametrize("pooling", ["LAST", "MEAN"])
def test_preemption_keeps_embeddings(tiny_llama_dir, pooling):
    """Growing generations in a 5-block pool preempt (recompute) while embeddings are pooled
    over 8-token chunks: every output is still the one computed alone."""
    llm = make_llm(
        tiny_llama_dir,
        pooler_config={"pooling_type": pooling},
        num_gpu_blocks_override=6,
        max_model_len=64,
        max_num_batched_tokens=8,
    )
    gen = SamplingParams(temperature=0, max_tokens=55, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate([[3, 4, 5], [6, 7, 8]], gen)]
    engine, embeds = llm.llm_engine, [list(range(3, 40)), list(range(10, 40))]
    for i, p in enumerate([[3, 4, 5], [6, 7, 8]]):
        engine.add_request(f"g{i}", p, gen, final_only=True)
    for i, p in enumerate(embeds):
        engine.add_request(f"e{i}", p, PoolingParams(), final_only=True)
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert llm.get_stats().num_preemptions > 0
    assert [done[f"g{i}"].outputs[0].token_ids for i in range(2)] == alone
    outs = [EmbeddingRequestOutput.from_base(done[f"e{i}"]) for i in range(2)]
    assert_close(outs, hf_embeddings(tiny_llama_dir, embeds, pooling))


@pytest.mark.parametrize("kw", [{"async_scheduling": True}, {"tensor_parallel_size": 2}])
def test_async_scheduling_and_tensor_parallel_embed_alike(tiny_llama_dir, kw):
    refs = hf_embeddings(tiny_llama_dir, PROMPTS, "LAST")
    assert_close(make_llm(tiny_llama_dir, **kw).embed(PROMPTS, use_tqdm=False), refs)


def test_encode_returns_pooling_outputs(tiny_llama_dir):
    from paged_engine import PoolingRequestOutput

    llm = make_llm(tiny_llama_dir)
    (out,) = llm.encode([[5, 6, 7]], use_tqdm=False)
    assert isinstance(out, PoolingRequestOutput) and out.outputs.data.dtype == torch.float32
    (emb,) = llm.embed([[5, 6, 7]], use_tqdm=False)
    assert out.outputs.data.tolist() == emb.outputs.embedding


def test_pooled_chunks_restart_after_a_recompute():
    from paged_engine.pooling import PooledChunks, PoolingSamplingParams

    chunks = PooledChunks()
    chunks.add(0, 2, [1.0, 1.0])
    chunks.add(2, 2, [100.0, 100.0])  # lost to a preemption: the prompt is recomputed
    chunks.add(0, 3, [3.0, 0.0])
    chunks.add(3, 1, [1.0, 4.0])
    mean = PoolingSamplingParams(pooling_type="MEAN", normalize=False)
    assert chunks.finish(mean, 4) == [1.0, 1.0]


def test_bad_pooling_options_name_the_parameter(tiny_llama_dir):
    with pytest.raises(ValueError, match=r"pooler_config\.pooling_type"):
        make_llm(tiny_llama_dir, pooler_config={"pooling_type": "MAX"})
    with pytest.raises(ValueError, match="pooler_config has unknown keys"):
        make_llm(tiny_llama_dir, pooler_config={"pooling": "MEAN"})
    llm = make_llm(tiny_llama_dir)
    hidden = llm.llm_engine.hf_config.hidden_size
    with pytest.raises(ValueError, match="dimensions=8 is not supported"):
        llm.embed([1, 2, 3], PoolingParams(dimensions=8), use_tqdm=False)
    (same,) = llm.embed([1, 2, 3], PoolingParams(dimensions=hidden), use_tqdm=False)
    assert len(same.outputs.embedding) == hidden
    with pytest.raises(ValueError, match="normalize must be a bool"):
        PoolingParams(normalize="yes")
    assert llm.embed([4, 5], use_tqdm=False)[0].finished  # still serving


def test_default_model_embeds_like_hf(hf_default_model):
    """The default model (SmolLM2-135M GGUF), last-token and mean pooling, against HF
    transformers' GGUF loading of the same file; similar texts closer than unrelated ones."""
    hf, _ = hf_default_model
    texts = ["The cat sat on the mat.", "A cat was sitting on a mat.", "Quarterly GDP rose 3%."]
    hidden = {}
    for pooling in ("LAST", "MEAN"):
        llm = LLM(
            device="cpu",
            dtype="float32",
            max_model_len=256,
            pooler_config={"pooling_type": pooling},
        )
        outs = llm.embed(texts, use_tqdm=False)
        llm.llm_engine.shutdown()
        for text, o in zip(texts, outs):
            if text not in hidden:
                with torch.no_grad():
                    ids = torch.tensor([o.prompt_token_ids])
                    hidden[text] = hf.base_model(ids).last_hidden_state[0]
            h = hidden[text]
            ref = torch.nn.functional.normalize(h[-1] if pooling == "LAST" else h.mean(0), dim=-1)
            got = torch.tensor(o.outputs.embedding)
            torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-3, msg=pooling)
        v = [torch.tensor(o.outputs.embedding) for o in outs]
        assert v[0].shape == (576,) and v[0] @ v[1] > v[0] @ v[2], pooling


def test_matryoshka_dimensions_truncate_before_normalizing(tiny_llama_dir):
    """A model trained for truncated embeddings (`is_matryoshka`, or `matryoshka_dimensions`
    listing the sizes: vLLM's config fields) takes `dimensions`: the first k values of the
    pooled vector, then L2-normalized."""
    (ref,) = hf_embeddings(tiny_llama_dir, [PROMPTS[0]], "LAST", normalize=False)
    any_size = make_llm(tiny_llama_dir, hf_overrides={"is_matryoshka": True})
    (out,) = any_size.embed(PROMPTS[0], PoolingParams(dimensions=8), use_tqdm=False)
    want = torch.nn.functional.normalize(ref[:8], dim=-1)
    assert out.outputs.embedding == pytest.approx(want.tolist(), abs=1e-5)
    listed = make_llm(tiny_llama_dir, hf_overrides={"matryoshka_dimensions": [8, 16]})
    (out,) = listed.embed(PROMPTS[0], PoolingParams(dimensions=16, normalize=False), use_tqdm=False)
    assert out.outputs.embedding == pytest.approx(ref[:16].tolist(), abs=1e-5)
    for bad in (12, 10_000):
        with pytest.raises(ValueError, match=f"dimensions={bad} is not supported"):
            listed.embed(PROMPTS[0], PoolingParams(dimensions=bad), use_tqdm=False)
