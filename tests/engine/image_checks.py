"""Checks shared by the image tests (test_*_images.py): noise images, the engine on a tiny
checkpoint, and the engine's own paths with images against its plain run."""

from __future__ import annotations

import numpy as np
import pytest
from hf_reference import assert_matches, assert_same_greedy

from paged_engine import LLM, SamplingParams

Image = pytest.importorskip("PIL.Image")


def noise_image(seed: int, size: tuple[int, int]):
    """A random RGB image of `size` (height, width)."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


def greedy(top: int = 5, n: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=top)


def engine(path, **kw) -> LLM:
    kw = {"max_model_len": 512, **kw}
    return LLM(model=str(path), dtype="float32", block_size=16, **kw)


def check_matches_hf(path, cases: list[tuple[str, list]], refs: list, name: str) -> None:
    """Each case (prompt text, its images) through the engine gives HF's prompt ids and its
    reference (`refs[i]`: (HF's ids, hf_greedy's result)); the same images with HF's expanded
    ids as `prompt_token_ids` are taken as they are and give the same tokens."""
    llm = engine(path)
    prompts = [
        {"prompt": text, "multi_modal_data": {"image": imgs}} if imgs else text
        for text, imgs in cases
    ]
    for (ids, ref), out in zip(refs, llm.generate(prompts, greedy(), use_tqdm=False), strict=True):
        assert out.prompt_token_ids == ids
        assert_matches(name, out, ref)
    with_images = [(r, imgs) for r, (_, imgs) in zip(refs, cases, strict=True) if imgs]
    ahead = [
        {"prompt_token_ids": ids, "multi_modal_data": {"image": imgs}}
        for (ids, _), imgs in with_images
    ]
    outs = llm.generate(ahead, greedy(), use_tqdm=False)
    for out, ((ids, ref), _) in zip(outs, with_images, strict=True):
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == ref.tokens


def check_engine_paths(path, prompts: list[dict], two: str, *, chunk: int = 8) -> LLM:
    """Against one plain run of `prompts` (the last holding two images for the text `two`,
    the first two one image each): `chunk`-token chunks through the images; a prefix-cache hit
    on the same image (and none past the text for another image); the last prompt's images
    processed ahead (`ImageProcessor.process`) and handed over with the expanded ids, and
    moved one token (refused). Returns the prefix-caching engine, still serving."""
    params = greedy(0, 24)

    def run(llm, batch=prompts):
        return [o.outputs[0] for o in llm.generate(batch, params, use_tqdm=False)]

    plain = run(engine(path))
    chunked = engine(
        path, max_num_batched_tokens=chunk, enable_chunked_prefill=True, max_num_seqs=3
    )
    assert_same_greedy(plain, run(chunked))

    cached = engine(path, enable_prefix_caching=True)
    run(cached, prompts[:1])
    again = cached.generate(prompts[:1], params, use_tqdm=False)[0]
    assert again.num_cached_tokens >= (len(again.prompt_token_ids) - 1) // 16 * 16
    assert_same_greedy(plain[:1], [again.outputs[0]])
    other = cached.generate(prompts[1:2], params, use_tqdm=False)[0]
    images = cached.llm_engine.input_processor.images
    first = other.prompt_token_ids.index(images.image_token_id)
    assert other.num_cached_tokens <= first // 16 * 16

    pics = prompts[-1]["multi_modal_data"]["image"]
    expanded, done = images.process(cached.get_tokenizer().encode(two), pics)
    ahead = {"prompt_token_ids": expanded, "multi_modal_data": {"image": list(done)}}
    assert_same_greedy(plain[-1:], run(cached, [ahead]))
    moved = {"prompt_token_ids": [5, *expanded], "multi_modal_data": {"image": list(done)}}
    with pytest.raises(ValueError, match="do not fit"):
        cached.generate([moved], params, use_tqdm=False)
    return cached
