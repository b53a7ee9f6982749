"""H2OVL-Mississippi (`H2OVLChatModel`, the Hub's remote code: multimodal/h2ovl.py over
multimodal/internvl_chat.py) against HF's InternVLForConditionalGeneration on the same weights.

The checkpoint: test_internvl_chat_remote's tiny InternVL (32-pixel tiles, up to 4, a
thumbnail), here with a Mistral decoder (H2O-Danube2's), written in the Hub's remote layout and
renamed H2OVLChatModel with `use_msac` on. The one difference from transformers' InternVL,
written out here as vLLM's h2ovl.py states it: an image alone in its prompt is tiled twice
(multi-scale adaptive cropping) and its views joined as [pass 2's tiles, pass 1's views but the
last, pass 2's last view], n2 + n1 - 1 of them, each through HF's own GotOcr2 processor
(rescale, ImageNet mean / std) without cropping. Two images in a prompt take InternVL's tiling.
paged on the remote dir must give HF's prompt ids, greedy tokens and top-5 logprobs (1e-3,
float32): one wide image (pass 1 a 3 x 1 grid, pass 2 2 x 2: 8 views), one small square (pass 1
one tile, dropped; pass 2 2 x 2: 5 views), two images, text alone; config values and request
kwargs it does not serve are refused by name.
"""

from __future__ import annotations

import json

import pytest
from image_checks import check_matches_hf, engine, greedy, hf_cases, hf_refs, noise_image
from test_internvl_chat_remote import CTX, MARKER, PROMPT, TEXT, TWO, to_remote
from test_internvl_chat_remote import write_tiny_internvl_hf as write_hf
from vlm_checkpoints import load_hf_vlm, tiled_context_inputs

transformers = pytest.importorskip("transformers")

SIDE, MOST, PER_TILE = 32, 4, 16  # the tiny checkpoint's tile side, max tiles, tokens a tile


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("h2ovl")
    hf = write_hf(root / "hf", seed=7, decoder="mistral")
    remote = to_remote(hf, root / "remote")
    config = json.loads((remote / "config.json").read_text())
    config |= {"architectures": ["H2OVLChatModel"], "model_type": "h2ovl_chat", "use_msac": True}
    config["llm_config"]["architectures"] = ["MistralForCausalLM"]
    assert config["max_dynamic_patch"] == MOST and config["force_image_size"] == SIDE
    (remote / "config.json").write_text(json.dumps(config))
    return hf, remote


def _ratios(low: int, high: int) -> list[tuple[int, int]]:
    """vLLM's get_internvl_target_ratios."""
    found = {
        (i, j)
        for n in range(low, high + 1)
        for i in range(1, n + 1)
        for j in range(1, n + 1)
        if low <= i * j <= high
    }
    return sorted(found, key=lambda x: x[0] * x[1])


def _pass(image, ratios) -> tuple[list, tuple[int, int]]:
    """vLLM's dynamic_preprocess_h2ovl with the thumbnail: (views, grid)."""
    w, h = image.size
    best, diff = (1, 1), float("inf")
    for r in ratios:  # find_closest_aspect_ratio
        d = abs(w / h - r[0] / r[1])
        if d < diff:
            best, diff = r, d
        elif d == diff and w * h > 0.5 * SIDE * SIDE * r[0] * r[1]:
            best = r
    big = image.resize((SIDE * best[0], SIDE * best[1]))
    cols = best[0]
    views = [
        big.crop(
            ((i % cols) * SIDE, (i // cols) * SIDE, (i % cols + 1) * SIDE, (i // cols + 1) * SIDE)
        )
        for i in range(best[0] * best[1])
    ]
    if len(views) != 1:
        views.append(image.resize((SIDE, SIDE)))
    return views, best


def _msac(image) -> list:
    first, prior = _pass(image, _ratios(1, MOST))
    kept = [r for r in _ratios(3, MOST) if prior[0] % r[0] != 0 and prior[1] % r[1] != 0]
    second, _ = _pass(image, kept)
    return second[:-1] + first[:-1] + second[-1:]


def _inputs(hf, text: str, images: list) -> tuple[list[int], dict]:
    """HF's ids and pixels: MSAC views for an image alone, InternVL's tiles for more."""
    text = text.replace(MARKER, CTX)
    if len(images) != 1:
        return tiled_context_inputs(hf, text, images)
    views = _msac(images[0].convert("RGB"))
    processor = transformers.AutoImageProcessor.from_pretrained(hf)
    pixels = processor(images=views, return_tensors="pt", crop_to_patches=False)["pixel_values"]
    assert pixels.shape[0] == len(views)
    run = "<img>" + CTX * (PER_TILE * len(views)) + "</img>"
    tok = transformers.AutoTokenizer.from_pretrained(hf)
    return tok.encode(text.replace(CTX, run, 1), add_special_tokens=False), {"pixel_values": pixels}


def test_msac_matches_hf_internvl(dirs):
    hf, remote = dirs
    wide, square = noise_image(1, (32, 96)), noise_image(4, (30, 30))
    assert [len(_msac(i)) for i in (wide, square)] == [8, 5]  # vLLM's n1 + n2 - 1
    cases = hf_cases(PROMPT, TEXT, TWO, ((32, 96), (40, 56), (33, 47)))
    cases.append((PROMPT, [square]))
    model = load_hf_vlm(transformers.InternVLForConditionalGeneration, hf)
    refs = hf_refs(model, cases, lambda *case: _inputs(hf, *case))
    check_matches_hf(remote, cases, refs, "h2ovl")


def test_msac_pixels_are_the_remote_views(dirs):
    """The engine's tiles for an image alone equal the written-out MSAC's, bit for bit: wide,
    tall, 48 x 32 whose first pass ties (1 x 1 and 2 x 1 equally far from 1.5: the later grid,
    the image's area being over half of its pixels; 3 views, the first 1 x 1 would give 5),
    a square whose second pass has no grid left (1 x 1)."""
    import torch

    hf, remote = dirs
    llm = engine(remote)
    images = llm.llm_engine.input_processor.images
    run = images._runner({})
    processor = transformers.AutoImageProcessor.from_pretrained(hf)
    for seed, size in enumerate([(32, 96), (90, 20), (32, 48), (64, 64), (30, 30)]):
        image = noise_image(seed, size)
        tiles, size_out = images.layout.load(run, image, 1)
        views = _msac(image)
        want = processor(images=views, return_tensors="pt", crop_to_patches=False)
        assert size_out == (len(views),)
        assert torch.equal(tiles, want["pixel_values"].float())
    assert [len(_msac(noise_image(0, s))) for s in ((32, 48), (64, 64))] == [3, 5]


def test_chat_and_refusals(dirs):
    """LLM.chat writes "<image>" (InternVL-Chat's marker); vLLM's tiling kwargs and a decoder
    the row does not name are refused by name, the engine serving on."""
    from paged_engine.models.multimodal_text import text_only_config
    from paged_engine.multimodal.internvl_chat import internvl_config

    hf, remote = dirs
    good = json.loads((remote / "config.json").read_text())
    qwen = internvl_config({**good, "llm_config": {**good["llm_config"], "model_type": "qwen2"}}, 7)
    with pytest.raises(ValueError, match="'qwen2'"):
        text_only_config(qwen)
    llm = engine(remote)
    image = noise_image(5, (32, 96))  # MSAC: 8 views; beside another: 4 tiles
    message = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image}]}]
    message[0]["content"].append({"type": "text", "text": "What is in it?"})
    (out,) = llm.chat(message, greedy(2), use_tqdm=False)
    ids, _ = _inputs(hf, PROMPT, [image])
    assert out.prompt_token_ids == ids
    bad = {"prompt": PROMPT, "multi_modal_data": {"image": image}}
    with pytest.raises(ValueError, match="max_patches"):
        llm.generate([{**bad, "mm_processor_kwargs": {"max_dynamic_patch": 2}}], greedy(0))
    (out,) = llm.generate([bad], greedy(0), use_tqdm=False)
    assert out.prompt_token_ids == ids
    # the same image beside another: InternVL's tiles, not the cached MSAC views (by_count)
    pair = {"prompt": TWO, "multi_modal_data": {"image": [image, noise_image(6, (40, 40))]}}
    (out,) = llm.generate([pair], greedy(0), use_tqdm=False)
    assert out.prompt_token_ids == _inputs(hf, TWO, pair["multi_modal_data"]["image"])[0]
