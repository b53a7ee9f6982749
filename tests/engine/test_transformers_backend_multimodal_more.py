"""The Transformers modeling backend on LLaVA-NeXT, LLaVA-OneVision, Idefics3 and SmolVLM
(models/transformers_backend/multimodal.py): HF's tower, projector and packing through
`get_image_features` (anyres tiles unpadded with `image_newline` rows, OneVision's scaled-down
maps and one-view images, Idefics3's pixel-shuffled tiles), HF's decoder with paged attention,
give HF `generate`'s greedy tokens and top-5 logprobs (float32, 1e-3) with HF's processor's
pixels, and paged's native class's, in batches of images of different sizes and text; chunked
prefill through the images keeps the plain run's tokens; what is left is refused by name."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import test_idefics3_images as idefics3  # tests/engine is on sys.path
import test_llava_next_images as next_images
from hf_reference import assert_same_greedy
from image_checks import check_engine_matches_hf, engine, greedy, hf_cases, hf_refs, noise_image
from test_transformers_backend_multimodal import BACKEND, _prompts, _wrapped
from vlm_checkpoints import load_hf_vlm

from paged_engine.models.transformers_backend import (
    TransformersImageEncoder,
    check_transformers_config,
)
from paged_engine.testing import write_tiny_llava

transformers = pytest.importorskip("transformers")

NEXT = next_images.PROMPT, next_images.TWO, "USER: Say something about the sea.\nASSISTANT:"
IDEFICS3 = idefics3.PROMPT, idefics3.TWO, idefics3.TEXT
next_dirs = next_images.next_dirs  # (fixtures of the native tests' tiny checkpoints)
idefics3_dirs = idefics3.dirs


def _backend(path, **kw):
    llm = engine(path, model_impl="transformers", **kw)
    assert type(llm.llm_engine.model_runner.model).__name__ == BACKEND
    assert isinstance(llm.llm_engine.model_runner.images.encoder, TransformersImageEncoder)
    return llm


def _check(path, cases, refs, name: str, base: str) -> None:
    """The backend gives HF's ids and references and the native class's greedy tokens and
    top-5 logprobs (1e-3); every image went through HF's `base` model."""
    llm = _backend(path)
    assert type(llm.llm_engine.model_runner.images.encoder.base).__name__ == base
    check_engine_matches_hf(llm, cases, refs, f"{name}-transformers")
    want = engine(path).generate(_prompts(cases), greedy(), use_tqdm=False)
    got = llm.generate(_prompts(cases), greedy(), use_tqdm=False)
    assert_same_greedy([o.outputs[0] for o in want], [o.outputs[0] for o in got], abs_tol=1e-3)


def _chunked_matches_plain(path, prompts: list[dict]) -> None:
    """8-token chunks through the images (each image encoded on its own) keep the tokens."""
    params = greedy(0, 12)
    plain = _backend(path).generate(prompts, params, use_tqdm=False)
    chunked = _backend(path, max_num_batched_tokens=8, enable_chunked_prefill=True)
    got = chunked.generate(prompts, params, use_tqdm=False)
    assert_same_greedy([o.outputs[0] for o in plain], [o.outputs[0] for o in got])
    assert plain[0].outputs[0].token_ids != plain[1].outputs[0].token_ids  # images matter


def test_llava_next_tiles_match_hf_and_the_native_class(next_dirs) -> None:
    """1x2, 2x1 and 2x2 tile grids (padding rows or columns cut), a thin strip."""
    path = next_dirs()
    prompt, two, text = NEXT
    cases = hf_cases(prompt, text, two, ((40, 52), (64, 30), (12, 95)))
    cases.append((prompt, [noise_image(4, (50, 50))]))
    processor = transformers.AutoProcessor.from_pretrained(path)
    hf = load_hf_vlm(transformers.LlavaNextForConditionalGeneration, path)

    def inputs(text: str, images: list):
        if not images:
            return processor.tokenizer.encode(text), {}
        out = processor(text=text, images=images, return_tensors="pt")
        return out["input_ids"][0].tolist(), {k: out[k] for k in ("pixel_values", "image_sizes")}

    refs = hf_refs(hf, cases, inputs)
    assert len({len(ids) for ids, _ in refs}) == len(refs)  # runs of each image's length
    _check(path, cases, refs, "llava-next", "LlavaNextModel")
    more = {"prompt": prompt, "multi_modal_data": {"image": noise_image(6, (48, 61))}}
    _chunked_matches_plain(path, [*_prompts(cases[2:3]), more, *_prompts(cases[:1])])


@pytest.fixture(scope="module")
def onevision(tmp_path_factory):
    """A tiny OneVision ("anyres_max_1": 2 x 2 and 3 x 3 maps scaled down bilinearly)."""
    return write_tiny_llava(
        tmp_path_factory.mktemp("onevision-tf"),
        vision="siglip",
        seed=3,
        grid_pinpoints=[[30, 60], [60, 30], [60, 60], [90, 90]],
        onevision="anyres_max_1",
        vision_feature_select_strategy="full",
    )


def _onevision_inputs(path):
    """HF's OneVision ids (its processor's own count; that processor needs torchvision) and
    its image processor's pixels, sizes and images a prompt."""
    from transformers.models.llava_onevision.processing_llava_onevision import (
        LlavaOnevisionProcessor as Rule,
    )

    image_processor = transformers.AutoImageProcessor.from_pretrained(path)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    rule = SimpleNamespace(
        image_processor=image_processor, num_image_tokens=25, vision_aspect_ratio="anyres_max_1"
    )
    rule._get_unpadded_features = lambda *a: Rule._get_unpadded_features(rule, *a)

    def inputs(text: str, images: list):
        if not images:
            return tok.encode(text), {}
        out = image_processor(images=[images], return_tensors="pt")
        counts = [Rule._get_number_of_features(rule, *im.size[::-1], 30, 30) for im in images]
        if len(images) > 1:
            counts = [26] * len(images)  # a view (25 rows) and a newline each
        parts = text.split("<image>")
        expanded = "".join(p + "<image>" * n for p, n in zip(parts, counts + [0], strict=True))
        keys = ("pixel_values", "image_sizes", "batch_num_images")
        return tok.encode(expanded), {k: out[k] for k in keys}

    return inputs


def test_onevision_images_match_hf_and_the_native_class(onevision) -> None:
    """One image (maps scaled down or not), two in a prompt (a view each), and text."""
    prompt, two, text = NEXT
    cases = hf_cases(prompt, text, two, ((40, 52), (64, 30), (20, 90)))
    cases.append((prompt, [noise_image(5, (90, 90))]))
    hf = load_hf_vlm(transformers.LlavaOnevisionForConditionalGeneration, onevision)
    refs = hf_refs(hf, cases, _onevision_inputs(onevision))
    _check(onevision, cases, refs, "onevision", "LlavaOnevisionModel")
    # the two images of one prompt reach the encoder one at a time (a lone one-view image)
    _chunked_matches_plain(onevision, _prompts([cases[2], cases[0], cases[3]]))


def test_onevision_videos_are_refused_by_name(onevision) -> None:
    llm = _backend(onevision)
    video = {"prompt": NEXT[0], "multi_modal_data": {"video": [noise_image(1, (30, 30))]}}
    with pytest.raises(ValueError, match=r"multi_modal_data\['video'\]: this model takes no"):
        llm.generate([video], greedy(0), use_tqdm=False)
    out = llm.generate([NEXT[2]], greedy(0), use_tqdm=False)[0]  # still serving
    assert len(out.outputs[0].token_ids) == 8


@pytest.mark.parametrize("arch", ["idefics3", "smolvlm"])
def test_idefics3_and_smolvlm_tiles_match_hf_and_the_native_class(idefics3_dirs, arch) -> None:
    """2 x 3 tiles and the global view, a tall image, a small untiled one."""
    path = idefics3_dirs(arch)
    name = "Idefics3" if arch == "idefics3" else "SmolVLM"
    hf = load_hf_vlm(getattr(transformers, f"{name}ForConditionalGeneration"), path)
    prompt, two, text = IDEFICS3
    cases = hf_cases(prompt, text, two, ((50, 90), (96, 40), (20, 24)))
    refs = hf_refs(hf, cases, lambda *case: idefics3._hf_inputs(path, arch, *case))
    _check(path, cases, refs, arch, f"{name}Model")
    if arch == "idefics3":
        more = {"prompt": prompt, "multi_modal_data": {"image": noise_image(6, (70, 40))}}
        _chunked_matches_plain(path, [*_prompts(cases[:1]), more, *_prompts(cases[2:])])


@pytest.mark.parametrize(
    ("wrapper", "match"),
    [
        ("LlavaNextVideoForConditionalGeneration", "only .*LlavaNext"),
        ("Idefics2ForConditionalGeneration", "only .*Idefics3"),
        ("Qwen2_5_VLForConditionalGeneration", "M-RoPE"),
    ],
)
def test_wrappers_left_are_refused_by_name(wrapper: str, match: str) -> None:
    with pytest.raises(ValueError, match=f"model_impl='transformers': .*{wrapper}: {match}"):
        check_transformers_config(_wrapped(wrapper))
