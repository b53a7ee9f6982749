"""Images through Gemma 3 checkpoints (multimodal/gemma3.py) against HF transformers.

A tiny random `Gemma3ForConditionalGeneration` (32-pixel images of 4-pixel patches pooled to 16
rows; its text model's sliding window is 8 tokens, shorter than an image): `LLM.generate` with
`multi_modal_data` must give Gemma3Processor's prompt ids (each <start_of_image> replaced in
the text, newlines merging with their neighbours) and HF `generate`'s greedy tokens and top-5
logprobs (1e-3, float32), HF's prefill letting an image's tokens see each other both ways.
Then the engine's paths (chunks that may not end inside an image, prefix-cache hits inside
one) against the plain run, the bidirectional attention itself, and bad input.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hf_reference import assert_matches, assert_same_greedy, hf_greedy
from image_checks import (
    WIDE_TALL_SMALL,
    check_engine_paths,
    check_matches_hf,
    engine,
    greedy,
    hf_cases,
    hf_refs,
    noise_image,
    path_prompts,
)
from vlm_checkpoints import load_hf_vlm

from paged_engine.testing import write_tiny_gemma3

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

MAX_TOKENS = 8
BOI = "<start_of_image>"
PROMPT = f"<|bos|><start_of_turn>user\n{BOI}What is in it?<end_of_turn>\n<start_of_turn>model\n"
TWO = (
    f"<|bos|><start_of_turn>user\n\n{BOI}and{BOI}\n\n\nWhich is brighter?<end_of_turn>\n"
    "<start_of_turn>model\n"
)
TEXT = (
    "<|bos|><start_of_turn>user\nSay something about the sea.<end_of_turn>\n<start_of_turn>model\n"
)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_gemma3(tmp_path_factory.mktemp("gemma3"), seed=3)


# Pan-and-scan (vLLM's mm_processor_kwargs): long images cut into crops, each its own run.
# (HF's processor call has crop settings of its own for a real checkpoint's size: given here.)
PAN = {
    "do_pan_and_scan": True,
    "pan_and_scan_min_crop_size": 8,
    "pan_and_scan_max_num_crops": 3,
    "pan_and_scan_min_ratio_to_activate": 1.2,
}


def _hf_inputs(path, text: str, images: list, **kwargs) -> tuple[list[int], dict]:
    processor = transformers.AutoProcessor.from_pretrained(path)
    if not images:
        return processor.tokenizer.encode(text, add_special_tokens=False), {}
    out = processor(text=[text], images=[images], return_tensors="pt", **kwargs)
    extra = {"pixel_values": out["pixel_values"], "token_type_ids": out["token_type_ids"]}
    return out["input_ids"][0].tolist(), extra


def test_images_match_hf(path):
    model = load_hf_vlm(transformers.Gemma3ForConditionalGeneration, path)
    # the tall and the small image: their newline runs merge
    cases = hf_cases(PROMPT, TEXT, TWO, WIDE_TALL_SMALL)
    refs = hf_refs(model, cases, lambda *case: _hf_inputs(path, *case))
    check_matches_hf(path, cases, refs, "gemma3")


def test_pan_and_scan_crops_match_hf(path):
    """do_pan_and_scan: HF's text around the original and its crops, each view a run that
    attends to itself both ways; a square image gets no crops."""
    model = load_hf_vlm(transformers.Gemma3ForConditionalGeneration, path)
    llm = engine(path)
    for text, images in [
        (TWO, [noise_image(12, (30, 100)), noise_image(13, (40, 40))]),
        (PROMPT, [noise_image(14, (110, 35))]),
    ]:
        ids, extra = _hf_inputs(path, text, images, **PAN)
        assert len(extra["pixel_values"]) > len(images)  # crops were cut
        ref = hf_greedy(model, ids, MAX_TOKENS, 5, **extra)
        prompt = {"prompt": text, "multi_modal_data": {"image": images}}
        (out,) = llm.generate([{**prompt, "mm_processor_kwargs": PAN}], greedy(), use_tqdm=False)
        assert out.prompt_token_ids == ids
        assert_matches("gemma3 pan-and-scan", out, ref)
        ahead = {"prompt_token_ids": ids, "multi_modal_data": {"image": images}}
        (again,) = llm.generate([{**ahead, "mm_processor_kwargs": PAN}], greedy(), use_tqdm=False)
        assert again.prompt_token_ids == ids and again.outputs[0].token_ids == ref.tokens


def test_images_attend_both_ways(path):
    """The image's rows see its later rows: the same prompt with its image marked causal gives
    other logprobs (so the HF match above depends on the two-way attention)."""
    prompt = {"prompt": PROMPT, "multi_modal_data": {"image": noise_image(4, (32, 32))}}
    both = engine(path).generate([prompt], greedy(5, 1), use_tqdm=False)[0]
    causal = engine(path)
    layout = causal.llm_engine.input_processor.images.layout
    place = layout.place
    layout.place = lambda *a: [dataclasses.replace(m, bidirectional=False) for m in place(*a)]
    layout.fits = lambda m: True
    one_way = causal.generate([prompt], greedy(5, 1), use_tqdm=False)[0]
    first, second = both.outputs[0].logprobs[0], one_way.outputs[0].logprobs[0]
    assert max(abs(first[t].logprob - second[t].logprob) for t in first if t in second) > 1e-3


def test_engine_paths_match_the_plain_run(path):
    """The engine's paths through the images against its plain run (image_checks: 5-token
    chunks, which must move to an image's edges; prefix-cache hits ending inside an image);
    the TWO prompt's images processed ahead; bad input a ValueError, nothing lost."""
    prompts = path_prompts(PROMPT, TWO, narrow=0)
    cached = check_engine_paths(path, prompts, TWO, chunk=20)
    pics = prompts[-1]["multi_modal_data"]["image"]
    for bad, match in [
        ({"prompt": TWO, "multi_modal_data": {"image": pics[:1]}}, "2 <start_of_image>"),
        ({"prompt": PROMPT, "multi_modal_data": {"image": torch.zeros(16, 64)}}, "embeddings"),
    ]:
        with pytest.raises(ValueError, match=match):
            cached.generate([bad], greedy(0), use_tqdm=False)
    out = cached.generate([prompts[0]], greedy(0), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 8


def test_chunks_never_end_inside_an_image(path):
    """With a token budget of 17 (one image is 16) every step ends outside an image and the
    tokens match the plain run; a budget below an image's length is refused at start."""
    prompt = {"prompt": TWO, "multi_modal_data": {"image": [noise_image(5, (20, 20))] * 2}}
    params = greedy(0, 12)
    plain = engine(path).generate([prompt], params, use_tqdm=False)[0]
    llm = engine(path, max_num_batched_tokens=17, enable_chunked_prefill=True)
    scheduler = llm.llm_engine.engine_core.scheduler
    steps = []
    schedule = scheduler.schedule

    def spy():
        out = schedule()
        for start, n in zip(out.start_positions, out.num_new_tokens, strict=True):
            steps.append((start, start + n))
        return out

    scheduler.schedule = spy
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert_same_greedy([plain.outputs[0]], [out.outputs[0]])
    images = _images(llm, prompt)
    assert len(images) == 2 and all(m.bidirectional for m in images)
    for _, end in steps:
        assert not any(m.offset < end < m.end for m in images), (end, steps)
    # a prefix-cache hit that ends inside an image: the rest of it runs in one step
    cached = engine(
        path, max_num_batched_tokens=17, enable_chunked_prefill=True, enable_prefix_caching=True
    )
    cached.generate([prompt], params, use_tqdm=False)
    other = {**prompt, "prompt": TWO.replace("brighter", "darker")}  # differs after the images
    want = engine(path).generate([other], params, use_tqdm=False)[0]
    steps.clear()
    scheduler = cached.llm_engine.engine_core.scheduler
    schedule = scheduler.schedule
    scheduler.schedule = spy
    again = cached.generate([other], params, use_tqdm=False)[0]
    assert any(m.offset < again.num_cached_tokens < m.end for m in images)  # 48 in (33, 49)
    assert_same_greedy([want.outputs[0]], [again.outputs[0]])
    for _, end in steps:
        assert not any(m.offset < end < m.end for m in images), (end, steps)
    with pytest.raises(ValueError, match="max_num_batched_tokens=8"):
        engine(path, max_num_batched_tokens=8, enable_chunked_prefill=True)


def _images(llm, prompt):
    images = llm.llm_engine.input_processor.images
    ids = llm.get_tokenizer().encode(prompt["prompt"], add_special_tokens=False)
    return images.process(ids, prompt["multi_modal_data"]["image"])[1]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_attention_backends_agree(path, backend):
    """The torch reference and the Triton kernel (in its interpreter) give the CPU backend's
    tokens and logprobs, chunks through the images included (their key ends, per token).
    Short prompts (23 and 52 tokens, mostly images: the interpreter's cost is per token): the
    second's images come in two chunks, each after cached rows, beside the first's decodes."""
    prompts = [
        {"prompt": f"<|bos|>{BOI}", "multi_modal_data": {"image": noise_image(6, (24, 40))}},
        {
            "prompt": f"<|bos|>{BOI}and{BOI}Which?",
            "multi_modal_data": {"image": [noise_image(9, (50, 20))] * 2},
        },
    ]
    params = greedy(5, 3)
    want = engine(path).generate(prompts, params, use_tqdm=False)
    llm = engine(
        path, attention_backend=backend, max_num_batched_tokens=24, enable_chunked_prefill=True
    )
    for out, ref in zip(llm.generate(prompts, params, use_tqdm=False), want, strict=True):
        _same_logprobs(ref.outputs[0], out.outputs[0])


def _same_logprobs(want, got) -> None:
    """Same greedy tokens and top logprobs within 1e-4 (an image seen one way only moves them
    by more: test_images_attend_both_ways)."""
    assert_same_greedy([want], [got])
    for a, b in zip(got.logprobs, want.logprobs, strict=True):
        assert {t: p.logprob for t, p in a.items()} == pytest.approx(
            {t: p.logprob for t, p in b.items()}, abs=1e-4
        )


@pytest.mark.parametrize("parallel", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_parallel_matches_one_process(path, parallel):
    """Every rank and stage knows the images' spans (the last stage too, which never sees the
    images): TP=2 and PP=2 give the one-process tokens, with chunks through the prompt."""
    prompts = [{"prompt": TWO, "multi_modal_data": {"image": [noise_image(11, (30, 30))] * 2}}]
    kw = {"max_num_batched_tokens": 20, "enable_chunked_prefill": True}
    (one,) = engine(path, **kw).generate(prompts, greedy(5, 4), use_tqdm=False)
    llm = engine(path, **kw, **{parallel: 2})
    try:
        (two,) = llm.generate(prompts, greedy(5, 4), use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    _same_logprobs(one.outputs[0], two.outputs[0])


@pytest.mark.parametrize(
    "mode",
    [
        {"async_scheduling": True, "max_num_batched_tokens": 20, "enable_chunked_prefill": True},
        {"num_gpu_blocks_override": 14, "max_num_seqs": 3, "max_model_len": 128},  # preempts
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
    ],
    ids=["async-chunked", "preemption", "ngram"],
)
def test_engine_modes_match_the_plain_run(path, mode):
    prompts = [
        {
            "prompt": TWO,
            "multi_modal_data": {"image": [noise_image(i, (30, 40)), noise_image(i + 9, (50, 20))]},
        }
        for i in range(3)
    ]
    params = greedy(0, 10)
    plain = [o.outputs[0] for o in engine(path).generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0] for o in engine(path, **mode).generate(prompts, params, use_tqdm=False)]
    assert_same_greedy(plain, got)
