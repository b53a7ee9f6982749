"""Images through LLaVA-NeXT checkpoints (multimodal/llava_next.py) against HF transformers.

Tiny random `LlavaNextForConditionalGeneration` checkpoints (30-pixel views, 2x1 / 1x2 / 2x2
tile grids): `LLM.generate` with `multi_modal_data` must give HF's placeholder runs (their
length depends on each image's size) and HF `generate`'s greedy tokens and top-5 logprobs
(1e-3, float32) for wide, tall, square and extreme images, in a batch with a text prompt.
Then the engine's own paths against the plain run (chunks through an image, prefix-cache
hits, images processed ahead) and configurations HF could not run either (a clear error).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hf_reference import assert_matches, assert_same_greedy, hf_greedy
from image_checks import check_engine_paths

from paged_engine import LLM, SamplingParams
from paged_engine.multimodal.llava_next import AnyRes
from paged_engine.testing import write_tiny_llava

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

MAX_TOKENS = 8
PROMPT = "USER: <image>\nWhat is in it? Tell me about the colors.\nASSISTANT:"
TWO = "USER: <image>\nand <image>\nWhich one is brighter?\nASSISTANT:"
PINPOINTS = {
    "clip": [[30, 60], [60, 30], [60, 60]],
    "siglip": [[30, 90], [90, 30], [60, 60]],
}


def _image(seed: int, size: tuple[int, int]):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def next_dirs(tmp_path_factory):
    cache = {}

    def make(vision: str = "clip", **overrides):
        key = (vision, repr(sorted(overrides.items())))
        if key not in cache:
            cache[key] = write_tiny_llava(
                tmp_path_factory.mktemp(f"llava-next-{vision}"),
                vision=vision,
                seed=5,
                grid_pinpoints=PINPOINTS[vision],
                **overrides,
            )
        return cache[key]

    return make


def _greedy(top: int = 5) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=top)


def _llm(path, **kw) -> LLM:
    kw = {"max_model_len": 512, **kw}
    return LLM(model=str(path), dtype="float32", block_size=16, **kw)


@pytest.mark.parametrize(
    ("vision", "overrides"),
    [("clip", {}), ("siglip", {"vision_feature_select_strategy": "full"})],
    ids=["clip", "siglip-full"],
)
def test_images_match_hf(next_dirs, vision, overrides):
    path = next_dirs(vision, **overrides)
    cases = [
        (PROMPT, [_image(1, (40, 52))]),  # wider than tall: 1x2 tiles, rows cut
        ("USER: Say something about the sea.\nASSISTANT:", []),
        (TWO, [_image(2, (64, 30)), _image(3, (12, 95))]),  # tall; a thin strip
        (PROMPT, [_image(4, (50, 50))]),  # square: 2x2 tiles, nothing cut
    ]
    processor = transformers.AutoProcessor.from_pretrained(path)
    model = transformers.LlavaNextForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32
    )
    model.eval().generation_config.eos_token_id = None
    refs = []
    for text, images in cases:
        if images:
            inputs = processor(text=text, images=images, return_tensors="pt")
            ids = inputs["input_ids"][0].tolist()
            extra = {"pixel_values": inputs["pixel_values"], "image_sizes": inputs["image_sizes"]}
            refs.append((ids, hf_greedy(model, ids, MAX_TOKENS, 5, **extra)))
        else:
            ids = processor.tokenizer(text)["input_ids"]
            refs.append((ids, hf_greedy(model, ids, MAX_TOKENS, 5)))
    llm = _llm(path)
    prompts = [
        {"prompt": text, "multi_modal_data": {"image": imgs}} if imgs else text
        for text, imgs in cases
    ]
    outs = llm.generate(prompts, _greedy(), use_tqdm=False)
    for (ids, ref), out in zip(refs, outs, strict=True):
        assert out.prompt_token_ids == ids  # each image's run as long as HF's processor makes it
        assert_matches(f"llava-next-{vision}", out, ref)
    lengths = {len(ids) for ids, _ in refs}
    assert len(lengths) == len(refs)  # the images' sizes gave runs of different lengths


def test_placeholder_counts_match_hf_processor(next_dirs):
    """AnyRes.tokens against the count HF's processor writes, over aspect ratios from a
    1-pixel-high strip to a tall one, sizes below, at and above the pinpoints."""
    path = next_dirs()
    processor = transformers.AutoProcessor.from_pretrained(path)
    anyres = AnyRes.from_config(transformers.AutoConfig.from_pretrained(path))
    image_id = processor.tokenizer.convert_tokens_to_ids("<image>")
    sizes = [(1, 80), (80, 1), (7, 7), (29, 31), (30, 30), (31, 61), (45, 44), (59, 61)]
    sizes += [(60, 60), (100, 33), (33, 100), (123, 456), (456, 123), (17, 52)]
    for size in sizes:
        ids = processor(text="<image>", images=[_image(0, size)])["input_ids"][0]
        assert anyres.tokens(size) == list(ids).count(image_id), size


def test_chunks_prefix_cache_and_images_processed_ahead_match_the_plain_run(next_dirs):
    """The engine's paths through images of different lengths against its plain run
    (image_checks); the same picture at another size shares no block past the text; an
    ImageInput whose image_size does not fit its run is refused, nothing lost."""
    path = next_dirs()
    prompts = [
        {"prompt": PROMPT, "multi_modal_data": {"image": _image(i, (30 + 9 * i, 70 - 9 * i))}}
        for i in range(4)
    ] + [{"prompt": TWO, "multi_modal_data": {"image": [_image(5, (20, 80)), _image(6, (60, 60))]}}]
    cached = check_engine_paths(path, prompts, TWO)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    resized = {"prompt": PROMPT, "multi_modal_data": {"image": _image(0, (31, 70))}}
    other = cached.generate([resized], params, use_tqdm=False)[0]
    image_start = other.prompt_token_ids.index(_image_token(path))
    assert other.num_cached_tokens <= image_start // 16 * 16

    images = cached.llm_engine.input_processor.images
    expanded, done = images.process(
        cached.get_tokenizer().encode(TWO), prompts[-1]["multi_modal_data"]["image"]
    )
    swapped = [dataclasses.replace(done[0], image_size=(60, 60)), done[1]]
    bad = {"prompt_token_ids": expanded, "multi_modal_data": {"image": swapped}}
    with pytest.raises(ValueError, match="placeholder"):
        cached.generate([bad], params, use_tqdm=False)
    out = cached.generate(prompts[:1], params, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 24  # nothing lost


def _image_token(path) -> int:
    return transformers.AutoConfig.from_pretrained(path).image_token_id


@pytest.mark.parametrize(
    ("vision", "overrides", "match"),
    [
        # SigLIP has no CLS: "default" drops a real patch, the tiles' grid no longer fits
        ("siglip", {"vision_feature_select_strategy": "default"}, "vision_feature_select"),
        ("clip", {"vision_feature_select_strategy": "full"}, "vision_feature_select"),
        ("clip", {"image_grid_pinpoints": [[30, 45]]}, "image_grid_pinpoints"),
    ],
    ids=["siglip-default", "clip-full", "pinpoints"],
)
def test_configs_hf_cannot_run_are_a_clear_error(tmp_path, vision, overrides, match):
    pinpoints = overrides.pop("image_grid_pinpoints", PINPOINTS[vision])
    path = write_tiny_llava(tmp_path, vision=vision, grid_pinpoints=[[30, 60]])
    config = transformers.AutoConfig.from_pretrained(path)
    config.image_grid_pinpoints = pinpoints
    for key, value in overrides.items():
        setattr(config, key, value)
    config.save_pretrained(path)
    with pytest.raises(ValueError, match=match):
        _llm(path)
    assert _llm(path, limit_mm_per_prompt={"image": 0}).generate(["hello"], _greedy(0))


def test_an_unsupported_tower_with_its_processor_serves_the_text_model(tmp_path, caplog):
    """LLaVA around a tower paged does not run (here DINOv2; saved with its processor): the
    engine starts, says why in a warning, serves text, and refuses images clearly."""
    path = write_tiny_llava(tmp_path, vision="clip")
    config = transformers.AutoConfig.from_pretrained(path)
    config.vision_config = transformers.Dinov2Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
    )
    config.save_pretrained(path)
    llm = _llm(path)
    assert "vision tower (dinov2) is not one paged runs" in caplog.text
    assert llm.llm_engine.model_runner.images is None  # no tower loaded
    assert len(llm.generate(["hello"], _greedy(0))[0].outputs[0].token_ids) == MAX_TOKENS
    image = {"prompt": PROMPT, "multi_modal_data": {"image": _image(1, (30, 30))}}
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.generate([image], _greedy(0))


def test_image_embeds_give_the_image_answer(next_dirs):
    """vLLM's embedding input for LLaVA-NeXT: a list of [rows, hidden] features (HF's own, so
    runs of each image's length) gives the images' prompt and tokens; a tensor of another
    hidden size is a ValueError naming multi_modal_data."""
    path = next_dirs()
    images = [_image(7, (40, 52)), _image(8, (64, 30))]
    processor = transformers.AutoProcessor.from_pretrained(path)
    model = transformers.LlavaNextForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32
    )
    inputs = processor(text=TWO, images=images, return_tensors="pt")
    with torch.no_grad():
        feats = model.get_image_features(inputs["pixel_values"], inputs["image_sizes"])
    llm = _llm(path)
    raw = {"prompt": TWO, "multi_modal_data": {"image": images}}
    embedded = {"prompt": TWO, "multi_modal_data": {"image": list(feats.pooler_output)}}
    want, got = llm.generate([raw, embedded], _greedy(0), use_tqdm=False)
    assert got.prompt_token_ids == want.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert_same_greedy([want.outputs[0]], [got.outputs[0]])
    wrong = {"prompt": PROMPT, "multi_modal_data": {"image": torch.zeros(1, 5, 7)}}
    with pytest.raises(ValueError, match=r"multi_modal_data\['image'\].*hidden size"):
        llm.generate([wrong], _greedy(0))


def test_onevision_matches_hf(tmp_path):
    """LLaVA-OneVision ("anyres_max_1" here, so a 2 x 2 or 3 x 3 tile map is scaled down, as
    HF's bilinear interpolate does): HF's placeholder counts (its processor's own rule) and
    greedy tokens for one image of several sizes; a prompt with two images gives each a single
    padded view (its rows and a newline), as HF's processor does for several."""
    from types import SimpleNamespace

    from transformers.models.llava_onevision.processing_llava_onevision import (
        LlavaOnevisionProcessor,
    )

    path = write_tiny_llava(
        tmp_path,
        vision="siglip",
        seed=3,
        grid_pinpoints=[[30, 60], [60, 30], [60, 60], [90, 90]],
        onevision="anyres_max_1",
        vision_feature_select_strategy="full",
    )
    image_processor = transformers.AutoImageProcessor.from_pretrained(path)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.LlavaOnevisionForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32
    )
    model.eval().generation_config.eos_token_id = None
    rule = SimpleNamespace(  # HF's processor counting, without its torchvision video half
        image_processor=image_processor, num_image_tokens=25, vision_aspect_ratio="anyres_max_1"
    )
    rule._get_unpadded_features = lambda *a: LlavaOnevisionProcessor._get_unpadded_features(
        rule, *a
    )
    llm = _llm(path)
    for size in [(40, 52), (90, 90), (20, 90)]:
        image = _image(1, size)
        out = image_processor(images=[image], return_tensors="pt")
        n = LlavaOnevisionProcessor._get_number_of_features(rule, *size, 30, 30)
        ids = tok.encode(PROMPT.replace("<image>", "<image>" * n))
        extra = {"pixel_values": out["pixel_values"], "image_sizes": out["image_sizes"]}
        ref = hf_greedy(model, ids, MAX_TOKENS, 5, **extra)
        got = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": image}}], _greedy())
        assert got[0].prompt_token_ids == ids
        assert_matches(f"onevision {size}", got[0], ref)
    images = [_image(2, (40, 52)), _image(3, (64, 30))]
    out = image_processor(images=[images], return_tensors="pt")
    ids = tok.encode(TWO.replace("<image>", "<image>" * 26))  # 25 rows and a newline each
    extra = {k: out[k] for k in ("pixel_values", "image_sizes", "batch_num_images")}
    ref = hf_greedy(model, ids, MAX_TOKENS, 5, **extra)
    got = llm.generate([{"prompt": TWO, "multi_modal_data": {"image": images}}], _greedy())
    assert got[0].prompt_token_ids == ids
    assert_matches("onevision two images", got[0], ref)
