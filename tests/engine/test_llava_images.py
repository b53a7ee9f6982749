"""Images through LLaVA checkpoints (multimodal/) against HF transformers on the same weights.

Tiny random `LlavaForConditionalGeneration` checkpoints (CLIP and SigLIP towers, processor
saved with them): `LLM.generate` with `multi_modal_data` must give HF `generate`'s greedy tokens
and top-5 logprobs (1e-3, float32) with HF's own processor's pixel values, in a batch that mixes
image and text prompts. Then the engine's own paths against the plain run: prompts chunked
through an image, prefix-cache hits (same image: hit and same output; another image: no hit
past the text before it), n > 1 forks, preemption by recompute, tensor and pipeline
parallelism, and bad input (a ValueError naming the parameter, nothing lost).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hf_reference import assert_matches, assert_same_greedy, hf_greedy

from paged_engine import LLM, SamplingParams
from paged_engine.testing import write_tiny_llava

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

MAX_TOKENS = 8
PROMPT = "USER: <image>\nWhat is in it? Tell me about the colors.\nASSISTANT:"
TWO = "USER: <image>\nand <image>\nWhich one is brighter?\nASSISTANT:"


def _image(seed: int, size: tuple[int, int] = (40, 52)):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def llava_dirs(tmp_path_factory):
    cache = {}

    def make(vision: str = "clip", **overrides):
        key = (vision, repr(sorted(overrides.items())))
        if key not in cache:
            cache[key] = write_tiny_llava(
                tmp_path_factory.mktemp(f"llava-{vision}"), vision=vision, seed=3, **overrides
            )
        return cache[key]

    return make


def _greedy(top: int = 5) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=top)


def _llm(path, **kw) -> LLM:
    # Tests keep up to four engines alive at once: on a GPU each takes a share that leaves
    # room for the others (the KV pool of a model this small fits many times over).
    kw = {"max_model_len": 256, "gpu_memory_utilization": 0.15, **kw}
    return LLM(model=str(path), dtype="float32", block_size=16, **kw)


def _hf_refs(path, cases):
    """HF's greedy continuation of each (prompt text, images) through its own processor."""
    processor = transformers.AutoProcessor.from_pretrained(path)
    model = transformers.LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    model.eval().generation_config.eos_token_id = None
    refs = []
    for text, images in cases:
        if images:
            inputs = processor(text=text, images=images, return_tensors="pt")
            ids = inputs["input_ids"][0].tolist()
            refs.append(
                (ids, hf_greedy(model, ids, MAX_TOKENS, 5, pixel_values=inputs["pixel_values"]))
            )
        else:
            ids = processor.tokenizer(text)["input_ids"]
            refs.append((ids, hf_greedy(model, ids, MAX_TOKENS, 5)))
    return refs


@pytest.mark.parametrize(
    ("vision", "overrides"),
    [
        ("clip", {}),
        ("siglip", {"vision_feature_select_strategy": "full"}),
        # two feature layers concatenated, CLS kept
        ("clip", {"vision_feature_layer": [-3, -1], "vision_feature_select_strategy": "full"}),
    ],
    ids=["clip", "siglip-full", "clip-two-layers"],
)
def test_images_match_hf(llava_dirs, vision, overrides):
    path = llava_dirs(vision, **overrides)
    cases = [
        (PROMPT, [_image(1)]),
        ("USER: Say something about the sea.\nASSISTANT:", []),  # text beside images
        (TWO, [_image(2, (64, 30)), _image(3)]),
    ]
    refs = _hf_refs(path, cases)
    llm = _llm(path)
    prompts = [
        {"prompt": text, "multi_modal_data": {"image": imgs}} if imgs else text
        for text, imgs in cases
    ]
    outs = llm.generate(prompts, _greedy(), use_tqdm=False)
    for (text, _), (ids, ref), out in zip(cases, refs, outs, strict=True):
        assert out.prompt_token_ids == ids  # placeholders expanded as HF's processor does
        assert out.prompt == text
        assert_matches(f"llava-{vision}", out, ref)
    assert llm.llm_engine.scheduler.block_manager.num_free_blocks == (
        llm.llm_engine.scheduler.block_manager.num_total_blocks
    )


def test_the_image_changes_the_answer_and_the_prefix_cache_keys_it(llava_dirs):
    """Same text, other pixels: other logprobs, and no cache hit past the text before the
    image; the same image again: a hit over its blocks and the same output."""
    path = llava_dirs()
    llm = _llm(path, enable_prefix_caching=True)
    params = _greedy(0)

    def run(img):
        out = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": img}}], params)[0]
        lps = [e[t].logprob for e, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]
        return out, lps

    first, lps1 = run(_image(1))
    other, lps2 = run(_image(9))
    assert lps1 != pytest.approx(lps2, abs=1e-4)
    image_start = next(i for i, t in enumerate(first.prompt_token_ids) if t == _image_token(path))
    assert other.num_cached_tokens <= image_start // 16 * 16  # text blocks before it only
    again, lps3 = run(_image(1))
    assert again.num_cached_tokens >= (len(again.prompt_token_ids) - 1) // 16 * 16
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert lps3 == pytest.approx(lps1, abs=1e-4)


def _image_token(path) -> int:
    return transformers.AutoConfig.from_pretrained(path).image_token_id


def test_chunked_prefill_preemption_and_forks_match_the_plain_run(llava_dirs):
    """Prompts cut into 8-token chunks (through each image's 25 placeholders), a pool too
    small for every request at once (preempted and recomputed: the images come back), and
    n = 2 samples forked after the prompt: the same greedy tokens as one plain run."""
    path = llava_dirs()
    prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": _image(i)}} for i in range(4)] + [
        {"prompt": TWO, "multi_modal_data": {"image": [_image(5), _image(6)]}}
    ]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=0)

    def run(llm):
        return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]

    plain = run(_llm(path))
    chunked = _llm(path, max_num_batched_tokens=8, enable_chunked_prefill=True, max_num_seqs=3)
    assert_same_greedy(plain, run(chunked))
    tight = _llm(
        path,
        max_model_len=128,
        num_gpu_blocks_override=9,
        max_num_batched_tokens=16,
        enable_chunked_prefill=True,
    )
    assert_same_greedy(plain, run(tight))
    assert tight.llm_engine.get_stats().num_preemptions > 0
    fork = SamplingParams(temperature=0, n=2, max_tokens=40, ignore_eos=True)
    out = _llm(path).generate(prompts[:1], fork, use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [plain[0].token_ids] * 2


@pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="needs two GPUs"
)
@pytest.mark.parametrize("parallel", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_parallel_matches_one_process(llava_dirs, parallel):
    """TP: the tower runs on both ranks; PP: on the first stage, whose embeddings go on."""
    path = llava_dirs()
    prompts = [{"prompt": TWO, "multi_modal_data": {"image": [_image(7), _image(8)]}}]
    one = [o.outputs[0] for o in _llm(path).generate(prompts, _greedy(0), use_tqdm=False)]
    llm = _llm(path, **{parallel: 2})
    try:
        two = [o.outputs[0] for o in llm.generate(prompts, _greedy(0), use_tqdm=False)]
    finally:
        llm.llm_engine.shutdown()
    assert_same_greedy(one, two)


def test_bad_image_input_is_a_clear_error_and_nothing_is_lost(llava_dirs):
    path = llava_dirs()
    llm = _llm(path, limit_mm_per_prompt={"image": 1})
    bad = [
        ({"prompt": TWO, "multi_modal_data": {"image": _image(1)}}, "2 image placeholder"),
        ({"prompt": TWO, "multi_modal_data": {"image": [_image(1), _image(2)]}}, "limit_mm_per"),
        (
            {"prompt": "USER: no image here", "multi_modal_data": {"image": _image(1)}},
            "0 image placeholder",
        ),
        ({"prompt": PROMPT, "multi_modal_data": {"image": "cat.png"}}, r"\['image'\]\[0\]"),
        ({"prompt": PROMPT, "multi_modal_data": {"image": []}}, "empty"),
        ({"prompt": PROMPT, "multi_modal_data": {"audio": b"x"}}, r"\['audio'\]"),
        ({"prompt": PROMPT, "multi_modal_data": [_image(1)]}, "must be a dict"),
    ]
    for prompt, match in bad:
        with pytest.raises(ValueError, match=match):
            llm.generate([prompt], _greedy(0), use_tqdm=False)
    good = {"prompt": PROMPT, "multi_modal_data": {"image": _image(1)}}
    out = llm.generate([good], _greedy(0), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == MAX_TOKENS
    text_only = _llm(path, limit_mm_per_prompt={"image": 0})
    assert text_only.llm_engine.model_runner.images is None  # the tower is not loaded
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        text_only.generate([good], _greedy(0), use_tqdm=False)
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        _llm(path, limit_mm_per_prompt={"audio": -1})


def test_images_processed_ahead_are_taken_as_they_are(llava_dirs):
    """A server processes images on its request thread (`ImageProcessor.process`) and hands
    the engine the expanded ids with the `ImageInput`s: the same output as raw images; inputs
    that do not fit the prompt are refused."""
    path = llava_dirs()
    llm = _llm(path)
    images = llm.llm_engine.input_processor.images
    ids = llm.get_tokenizer().encode(TWO)
    expanded, done = images.process(ids, [_image(1), _image(2)])
    raw = {"prompt": TWO, "multi_modal_data": {"image": [_image(1), _image(2)]}}
    ahead = {"prompt_token_ids": expanded, "multi_modal_data": {"image": list(done)}}
    want, got = llm.generate([raw, ahead], _greedy(0), use_tqdm=False)
    assert got.prompt_token_ids == want.prompt_token_ids == expanded
    assert_same_greedy([want.outputs[0]], [got.outputs[0]])
    moved = {"prompt_token_ids": [5, *expanded], "multi_modal_data": {"image": list(done)}}
    with pytest.raises(ValueError, match="do not fit"):
        llm.generate([moved], _greedy(0), use_tqdm=False)


def test_llm_chat_reads_image_parts(llava_dirs):
    """LLM.chat: an image_url part (data: URL) and vLLM's image_pil part give the same answer
    as generate on the rendered prompt with the image; an unreadable part names itself."""
    import base64
    import io

    path = llava_dirs()
    llm = _llm(path)
    image = _image(4)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    text = {"type": "text", "text": "What is in it?"}
    by_url = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, text]}]
    by_pil = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image}, text]}]
    params = _greedy(0)
    a, b = (llm.chat(m, params, use_tqdm=False)[0] for m in (by_url, by_pil))
    rendered = "USER: <image>\nWhat is in it?\nASSISTANT:"
    assert a.prompt == b.prompt == rendered
    want = llm.generate([{"prompt": rendered, "multi_modal_data": {"image": image}}], params)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == want.outputs[0].token_ids
    bad = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": "data:image/png;base64,@@"}],
        }
    ]
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\]\.image_url"):
        llm.chat(bad, params, use_tqdm=False)


def test_image_embeds_give_the_image_answer(llava_dirs):
    """vLLM's embedding input for LLaVA: a tensor [images, rows, hidden] of HF's own features
    gives the images' prompt and tokens (processed ahead, they are taken as they are)."""
    path = llava_dirs()
    images = [_image(5), _image(6, (64, 30))]
    processor = transformers.AutoProcessor.from_pretrained(path)
    model = transformers.LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    pixels = processor(text=TWO, images=images, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        feats = model.get_image_features(pixels).pooler_output
    feats = torch.stack(list(feats)) if isinstance(feats, (list, tuple)) else feats
    llm = _llm(path)
    raw = {"prompt": TWO, "multi_modal_data": {"image": images}}
    embedded = {"prompt": TWO, "multi_modal_data": {"image": feats}}
    images_in = llm.llm_engine.input_processor.images
    ids, done = images_in.process(llm.get_tokenizer().encode(TWO), feats)
    ahead = {"prompt_token_ids": ids, "multi_modal_data": {"image": list(done)}}
    want, got, again = llm.generate([raw, embedded, ahead], _greedy(0), use_tqdm=False)
    assert got.prompt_token_ids == again.prompt_token_ids == want.prompt_token_ids
    assert_same_greedy([want.outputs[0]] * 2, [got.outputs[0], again.outputs[0]])


def test_encoder_cache_reuses_features_by_image_hash(llava_dirs):
    """vLLM's encoder cache: the same image in several prompts of a batch, twice in one prompt,
    or again in a later request is encoded once; the answers equal an engine whose cache holds
    nothing; a full pool lets its oldest features go; sleep empties it."""
    path = llava_dirs("clip")
    a, b, c = _image(1), _image(2), _image(3)
    two = "USER: <image>\nand <image>\nWhich? ASSISTANT:"
    prompts = [
        {"prompt": "USER: <image>\nWhat is it? ASSISTANT:", "multi_modal_data": {"image": a}},
        {"prompt": "USER: <image>\nWhat else? ASSISTANT:", "multi_modal_data": {"image": a}},
        {"prompt": two, "multi_modal_data": {"image": [b, b]}},
    ]

    def answers(llm, batch):
        return [o.outputs[0].token_ids for o in llm.generate(batch, _greedy(0), use_tqdm=False)]

    # (no prefix caching: a prompt seen before would skip its placeholders altogether)
    nothing_kept = _llm(path, enable_prefix_caching=False)
    nothing_kept.llm_engine.model_runner.images.cache_elems = 0
    want = answers(nothing_kept, prompts)
    assert nothing_kept.llm_engine.model_runner.images.encoded == 2  # a and b: once each

    llm = _llm(path, enable_sleep_mode=True, enable_prefix_caching=False)
    images = llm.llm_engine.model_runner.images
    assert images.cache_elems >= 2 * 576 * 64  # a step's rows of the text hidden size
    assert answers(llm, prompts) == want and images.encoded == 2
    assert answers(llm, prompts[::-1]) == want[::-1] and images.encoded == 2  # all kept
    assert not images.features and not images.users and len(images.idle) == 2
    # room for what it holds: c pushes out b, let go of first in the last batch (oldest)
    images.cache_elems = images.idle_elems
    answers(llm, [{**prompts[0], "multi_modal_data": {"image": c}}])
    assert images.encoded == 3 and len(images.idle) == 2
    assert answers(llm, prompts[:1]) == want[:1] and images.encoded == 3  # a stayed
    assert answers(llm, prompts[2:]) == want[2:] and images.encoded == 4  # b went
    llm.sleep(level=1)
    llm.wake_up()
    assert not images.idle and images.idle_elems == 0


def test_transparent_images_go_over_white_as_hf_puts_them(llava_dirs):
    """An RGBA image (and a palette image with a transparent index) is composited over white
    before the processor, as transformers' convert_to_rgb does: the engine's pixels equal HF's
    processor's on the transparent image, and differ from dropping the alpha band."""
    path = llava_dirs()
    images = _llm(path).llm_engine.input_processor.images
    processor = transformers.AutoProcessor.from_pretrained(path).image_processor
    rng = np.random.default_rng(7)
    rgba = Image.fromarray(rng.integers(0, 256, (40, 52, 4), dtype=np.uint8), "RGBA")
    index = rng.integers(1, 256, (40, 52), dtype=np.uint8)
    index[10:30, 12:40] = 0  # colour index 0, see-through, in the middle
    palette = Image.fromarray(index, "P")
    palette.putpalette(rng.integers(0, 256, 768, dtype=np.uint8).tolist())
    palette.info["transparency"] = 0
    for image in (rgba, palette):
        _, (m,) = images.process([_image_token(path)], image)
        want = processor(images=image, return_tensors="pt")["pixel_values"][0]
        torch.testing.assert_close(m.pixel_values, want, rtol=0, atol=1e-6)
        no_alpha = Image.fromarray(np.asarray(image.convert("RGB")))  # (no transparency info)
        _, (dropped,) = images.process([_image_token(path)], no_alpha)
        assert not torch.equal(dropped.pixel_values, m.pixel_values)


def test_numpy_images_are_the_images_pil_makes_of_them(llava_dirs):
    """A uint8 numpy array (H, W, 3), (H, W, 4) or (H, W) is taken as vLLM takes it: the same
    answer as the PIL image of the same array; other dtypes and shapes are refused by name."""
    path = llava_dirs()
    llm = _llm(path)
    prompt = "USER: <image>\nWhat is it? ASSISTANT:"
    rng = np.random.default_rng(11)
    for shape in ((40, 52, 3), (40, 52, 4), (40, 52)):
        array = rng.integers(0, 256, shape, dtype=np.uint8)
        outs = [
            llm.generate(
                [{"prompt": prompt, "multi_modal_data": {"image": image}}],
                _greedy(),
                use_tqdm=False,
            )[0].outputs[0]
            for image in (array, Image.fromarray(array))
        ]
        assert outs[0].token_ids == outs[1].token_ids
        assert outs[0].cumulative_logprob == pytest.approx(outs[1].cumulative_logprob, abs=1e-4)
    for bad in (np.zeros((40, 52, 3), np.float32), np.zeros((3, 40, 52), np.uint8)):
        with pytest.raises(ValueError, match=r"multi_modal_data\['image'\]\[0\]: a numpy image"):
            llm.generate([{"prompt": prompt, "multi_modal_data": {"image": bad}}], _greedy())
    llm.llm_engine.shutdown()
