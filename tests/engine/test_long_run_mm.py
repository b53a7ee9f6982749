"""Long runs of image requests through one offline engine (a Qwen2-VL checkpoint: M-RoPE):
waves on a KV pool too small for them all (recompute preemption), prefix caching on, prompts
cut into 8-token chunks through their image runs, a processor cache that must evict. The
greedy tokens equal a roomy engine's without prefix caching; a cached prefix never reaches past
the text into another image's run; once idle after each wave the engine holds nothing of the
requests (tests/engine_state.py), every KV block is free, and the processor cache and the
encoder's idle features stay within their bounds."""

from __future__ import annotations

import numpy as np
import pytest
from engine_state import leftovers

from paged_engine import LLM, SamplingParams
from paged_engine.testing import write_tiny_qwen2_vl

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

VISION = "<|vision_start|><|image_pad|><|vision_end|>"
OPTS = {"dtype": "float32", "max_model_len": 160, "block_size": 16, "seed": 0}


def _image(seed: int, size: tuple[int, int]):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


def _prompt(text: str, images: list) -> dict | str:
    body = f"<|im_start|>user\n{VISION * len(images)}{text}<|im_end|>\n<|im_start|>assistant\n"
    return {"prompt": body, "multi_modal_data": {"image": images}} if images else body


def _wave(seed: int) -> list:
    """Prompts sharing images (prefix hits), one text over two different images (no hit past
    the text), two images in one prompt and text alone."""
    a, b, c = _image(seed, (40, 56)), _image(seed + 10, (40, 56)), _image(seed + 20, (24, 32))
    same = "What is in it? Tell me about the colors and shapes."
    return [
        _prompt(same, [a]),
        _prompt(same, [b]),  # the same text and run length, other pixels
        _prompt("Describe it.", [a]),
        _prompt("Which is brighter?", [a, c]),
        _prompt("Say something about the sea and the sky.", []),
        _prompt(same, [a]),
    ]


def test_image_waves_under_preemption_match_a_roomy_engine_and_leave_it_idle(tmp_path) -> None:
    path = str(write_tiny_qwen2_vl(tmp_path / "qwen2vl", version="2", seed=2))
    pad = transformers.AutoConfig.from_pretrained(path).image_token_id
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, n=2),
    ]
    ref = LLM(model=path, enable_prefix_caching=False, num_gpu_blocks_override=200, **OPTS)
    llm = LLM(
        model=path,
        enable_prefix_caching=True,
        num_gpu_blocks_override=12,  # 192 token slots for up to 6 sequences of ~100
        max_num_batched_tokens=8,  # image runs (35 placeholders) span several chunks
        max_num_seqs=6,
        mm_processor_cache_gb=120_000 / 2**30,  # about two images' pixels: it evicts
        **OPTS,
    )
    engine = llm.llm_engine
    pool = engine.block_manager.pool
    free = pool.num_free_blocks
    cache = engine.input_processor.images.cache
    images = engine.model_runner.images
    try:
        for seed in (1, 2):
            prompts = _wave(seed)
            per = [params[i % 2] for i in range(len(prompts))]
            got = llm.generate(prompts, per, use_tqdm=False)
            want = ref.generate(prompts, per, use_tqdm=False)
            for g, w in zip(got, want, strict=True):
                assert g.prompt_token_ids == w.prompt_token_ids
                assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
            first_pad = got[1].prompt_token_ids.index(pad)
            assert got[1].num_cached_tokens <= first_pad // 16 * 16  # other image: text only
            assert got[5].num_cached_tokens >= 32  # the first prompt again: blocks of its image
            while engine.engine_core.can_step():  # the last finished sequences leave the worker
                engine.step()
            assert leftovers(engine) == {}
            assert pool.num_free_blocks == free
            held = sum(v[0].numel() * v[0].element_size() for v in cache._entries.values())
            assert cache.bytes == held <= cache.max_bytes
            assert images.idle_elems == sum(f.numel() for f in images.idle.values())
            assert images.idle_elems <= images.cache_elems
        assert engine.scheduler.num_preemptions > 0, "the KV pool is too large to preempt"
        assert cache.hits > 0
    finally:
        llm.llm_engine.shutdown()
        ref.llm_engine.shutdown()
