"""Awkward images on every image layout: a 1-pixel image, 1 x 300 and 300 x 1 strips, palette,
transparent and grey images and a huge one give an answer or a ValueError naming
multi_modal_data (HF's processor refuses some, e.g. Qwen's aspect-ratio bound), never a crash,
and the engine serves on. The families whose tiny checkpoints live in their own test modules
(tests/engine/test_*_images.py) are built from there. Hostile mm_processor_kwargs (a family's
own bounds, or the shared pixel / tile budget of multimodal/kwargs_budget.py) are refused by
name before any pixel is made, offline and over the chat route, while fair ones (a raise within
the budget, a lowering) are served; processed-ahead images whose image_size a client changed are
refused; the crop searches that 10**9 crops made hang stay cheap."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from paged_engine import LLM, SamplingParams
from paged_engine import testing as tiny

Image = pytest.importorskip("PIL.Image")
pytest.importorskip("transformers")

MODELS = {
    "llava": (tiny.write_tiny_llava, {}, "USER: <image>\nhi ASSISTANT:"),
    "llava-next": (
        tiny.write_tiny_llava,
        {"grid_pinpoints": [[30, 60], [60, 30], [60, 60]]},
        "USER: <image>\nhi ASSISTANT:",
    ),
    "qwen2-vl": (tiny.write_tiny_qwen2_vl, {}, "<|vision_start|><|image_pad|><|vision_end|>hi"),
    "idefics3": (tiny.write_tiny_idefics3, {}, "User:<image>hi"),
    "mistral3": (tiny.write_tiny_mistral3, {}, "[INST][IMG]hi[/INST]"),
    "internvl": (tiny.write_tiny_internvl, {}, "<IMG_CONTEXT>\nhi"),
    "gemma3": (tiny.write_tiny_gemma3, {}, "<start_of_turn>user\n<start_of_image>hi"),
}


def _images():
    rng = np.random.default_rng(0)

    def noise(h: int, w: int):
        return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))

    return {
        "1x1": noise(1, 1),
        "1x300": noise(1, 300),
        "palette": noise(40, 50).convert("P"),
        "rgba": noise(40, 50).convert("RGBA"),
        "grey": noise(40, 50).convert("L"),
        "300x1": noise(300, 1),
        "huge": noise(1500, 1100),
    }


def _module(name: str) -> Any:
    return importlib.import_module(name)  # skips where that module skips (older transformers)


# kind -> (its test module, writer(module, path), prompt(module))
Write = Callable[[Any, Any], Any]
FAMILIES: dict[str, tuple[str, Write, Callable[[Any], str]]] = {
    "gemma4": ("test_gemma4_images", lambda m, p: m.write_tiny_gemma4_vlm(p), lambda m: m.PROMPT),
    "gemma4_unified": (
        "test_gemma4_unified_images",
        lambda m, p: m.write_tiny_gemma4_unified_vlm(p),
        lambda m: m.PROMPT,
    ),
    "glm4v": ("test_glm4v_images", lambda m, p: m.write_tiny_glm4v(p, "glm4v"), lambda m: m.PROMPT),
    "glm_ocr": (
        "test_ocr_images",
        lambda m, p: m.write_tiny_glm_ocr(p),
        lambda m: _module("test_glm4v_images").PROMPT,
    ),
    "hunyuan_vl": (
        "test_ocr_images",
        lambda m, p: m.write_tiny_hunyuan_vl(p),
        lambda m: m.HY_PROMPT,
    ),
    "llama4": ("test_llama4_images", lambda m, p: m.write_tiny_llama4_vlm(p), lambda m: m.PROMPT),
    "aya": (
        "test_aya_vision_images",
        lambda m, p: m.write_tiny(p, "aya", 0),
        lambda m: m._prompt("aya", m.PROMPT),
    ),
    "cohere2_vision": (
        "test_aya_vision_images",
        lambda m, p: m.write_tiny(p, "cohere2", 0),
        lambda m: m._prompt("cohere2", m.PROMPT),
    ),
    "idefics2": ("test_idefics2_images", lambda m, p: m.write_tiny(p, 0), lambda m: m.PROMPT),
    "kimi_k25": ("test_kimi_k25_images", lambda m, p: m.write_tiny_kimi_k25(p), lambda m: m.PROMPT),
    "exaone4_5": (
        "test_exaone4_5_images",
        lambda m, p: m.write_tiny_exaone4_5(p),
        lambda m: m.PROMPT,
    ),
    "llava_onevision1_5": (
        "test_llava_onevision1_5_images",
        lambda m, p: m.write_tiny_llava_onevision1_5(p),
        lambda m: m.PROMPT,
    ),
    "lfm2_vl": ("test_lfm2_vl_images", lambda m, p: m.write_tiny_lfm2_vl(p), lambda m: m.PROMPT),
    "ovis2_5": ("test_ovis2_5_images", lambda m, p: m.write_tiny_ovis2_5(p), lambda m: m.PROMPT),
    "ovis2": ("test_ovis2_images", lambda m, p: m.write_tiny_ovis2(p), lambda m: m.PROMPT),
    "phi4mm": ("test_phi4mm_images", lambda m, p: m.write_tiny_phi4mm(p), lambda m: m.PROMPT),
    "minicpmv4_7": (
        "test_minicpmv_images",
        lambda m, p: m.write_tiny(p, 0, version="4_7"),
        lambda m: m.PROMPT,
    ),
    "mllama": (
        "test_mllama_images",
        lambda m, p: m.write_tiny_mllama(p),
        lambda m: f"{m.IMAGE}<|bos|>what is it?",
    ),
    "paddleocr_vl": (
        "test_paddleocr_vl_images",
        lambda m, p: m.write_tiny_paddleocr_vl(p),
        lambda m: m.PROMPT,
    ),
    "lighton_ocr": (
        "test_lighton_ocr_images",
        lambda m, p: m.write_tiny_lighton_ocr(p),
        lambda m: m.PROMPT,
    ),
    "deepseek_vl": (
        "test_deepseek_vl_images",
        lambda m, p: m.write_tiny_deepseek_vl(p),
        lambda m: m.PROMPT,
    ),
    "deepseek_vl_hybrid": (
        "test_deepseek_vl_images",
        lambda m, p: m.write_tiny_hybrid(p),
        lambda m: m.PROMPT,
    ),
    "aria": ("test_aria_images", lambda m, p: m.write_tiny_aria(p), lambda m: m.PROMPT),
    "molmo2": ("test_molmo2_images", lambda m, p: m.write_tiny_molmo2(p), lambda m: m.PROMPT),
    "qwen3_omni": (
        "test_qwen_omni_images",
        lambda m, p: m.write_tiny_omni(p, "3"),
        lambda m: m._prompts("3")[0],
    ),
    "fuyu": ("test_fuyu_images", lambda m, p: m.write_tiny_fuyu(p), lambda m: m.PROMPT),
    "qianfan_ocr": (
        "test_qianfan_ocr_images",
        lambda m, p: m.write_tiny_qianfan_ocr(p),
        lambda m: m.PROMPT,
    ),
}


# kind -> (mm_processor_kwargs, the field its ValueError names): refused before any pixel is
# made (10**9 tiles or crops allocated or listed, a floor past the image side, a tile under a
# patch that failed the tower's convolution), the engine serving on
HOSTILE_KWARGS: dict[str, list[tuple[dict[str, Any], str]]] = {
    "mllama": [
        ({"max_image_tiles": 10**9}, "max_image_tiles"),
        ({"max_image_tiles": "2"}, "max_image_tiles"),
        ({"size": {"height": 1, "width": 1}}, "size"),
    ],
    "molmo2": [
        ({"max_crops": 10**9}, "max_crops"),
        ({"max_crops": 0}, "max_crops"),
        ({"max_crops": "4"}, "max_crops"),
        ({"overlap_margins": [100, 100]}, "overlap_margins"),
        ({"pooling_size": [0, 0]}, "pooling_size"),
    ],
    "aria": [
        ({"min_image_size": 10**5}, "min_image_size"),
        ({"split_image": True, "split_resolutions": [[10**5, 10**5]]}, "split_resolutions"),
    ],
    "deepseek_vl": [({"min_size": 10**6}, "min_size"), ({"size": {"height": 1}}, "size")],
    "deepseek_vl_hybrid": [({"high_res_size": {"height": 10**4, "width": 10**4}}, "high_res_size")],
    "paddleocr_vl": [({"min_pixels": 10**9}, "min_pixels")],
    "llava_onevision1_5": [({"min_pixels": 10**9}, "min_pixels")],
    "phi4mm": [({"dynamic_hd": 0}, "dynamic_hd"), ({"dynamic_hd": "4"}, "dynamic_hd")],
    "fuyu": [({"size": {"height": 30000, "width": 30000}}, "size")],  # the canvas it pads to
    "ovis2": [({"max_patches": 10**9}, "max_patches"), ({"max_patches": 1000}, "max_patches")],
    # the older families, through the shared budget (multimodal/kwargs_budget.py): a resize
    # to 30000 x 30000 (10 GB) or a 10**9-tile search, refused from the kwargs and image size
    "llava": [
        ({"size": {"height": 30000, "width": 30000}}, "size"),
        ({"size": {"shortest_edge": 10**6}}, "size"),
    ],
    "llava-next": [({"image_grid_pinpoints": [[30000, 30000]]}, "image_grid_pinpoints")],
    "qwen2-vl": [
        ({"min_pixels": 10**12, "max_pixels": 10**12}, "min_pixels"),
        ({"min_pixels": 2**18, "max_pixels": 2**18}, "min_pixels"),  # 4096 tokens: > max_model_len
    ],
    "idefics3": [
        ({"max_image_size": {"longest_edge": 1}}, "max_image_size"),
        ({"size": {"longest_edge": 10**5}}, "size"),
    ],
    "internvl": [
        ({"size": {"height": 30000, "width": 30000}}, "size"),
        ({"crop_to_patches": True, "max_patches": 10**9}, "max_patches"),
    ],
    "gemma3": [
        ({"size": {"height": 30000, "width": 30000}}, "size"),
        (
            {"do_pan_and_scan": True, "pan_and_scan_max_num_crops": 10**9},
            "pan_and_scan_max_num_crops",
        ),
    ],
    "glm4v": [({"size": {"shortest_edge": 10**12, "longest_edge": 10**12}}, "size")],
    "llama4": [
        ({"max_patches": 10**9}, "max_patches"),
        ({"size": {"height": 30000, "width": 30000}}, "size"),
    ],
    # LFM2-VL: its own bounds (lfm2_vl_processor.check_kwargs): a 10**9-tile ratio search
    # (cubic in transformers), views past the pixel budget, a patch size unlike the tower's
    "lfm2_vl": [
        ({"max_tiles": 10**9, "min_tiles": 10**8}, "max_tiles"),
        ({"min_image_tokens": 10**9}, "min_image_tokens"),
        ({"max_image_tokens": 10**9, "min_image_tokens": 10**7}, "max_image_tokens"),
        ({"tile_size": 10**5}, "tile_size"),
        ({"encoder_patch_size": 1}, "encoder_patch_size"),
        ({"max_pixels_tolerance": float("nan")}, "max_pixels_tolerance"),
        ({"do_image_splitting": "yes"}, "do_image_splitting"),
    ],
    # Qianfan-OCR: InternVL's GotOcr2 tiles, through the shared budget
    "qianfan_ocr": [
        ({"size": {"height": 30000, "width": 30000}}, "size"),
        ({"crop_to_patches": True, "max_patches": 10**9}, "max_patches"),
    ],
}
# kind -> mm_processor_kwargs within the budget (a raise or a lowering), still answered
FAIR_KWARGS: dict[str, dict[str, Any]] = {
    "llava": {"size": {"shortest_edge": 40}},
    "qwen2-vl": {"min_pixels": 1024, "max_pixels": 8192},
    "idefics3": {"size": {"longest_edge": 64}},
    "mistral3": {"size": {"longest_edge": 10**6}},  # Pixtral only shrinks to it: no cost
    "lfm2_vl": {"max_image_tokens": 6, "min_image_tokens": 2, "max_tiles": 3},
}
# the families whose processed-ahead images are checked against a changed image_size
TAMPERED = {"mllama", "molmo2", "aria", "deepseek_vl", "deepseek_vl_hybrid", "paddleocr_vl"}
TAMPERED |= {"llava_onevision1_5", "phi4mm", "ovis2", "fuyu"}
TAMPERED |= {"mistral3"}  # Pixtral's lines: a 10**6-pixel side once listed 10**12 tokens


def _refuses_kwargs(
    llm: LLM, prompt: str, cases: list[tuple[dict[str, Any], str]], early: bool = True
) -> None:
    """Each case refused naming mm_processor_kwargs and its field (`early`: before the image
    processor ran, as the budget refuses; this session's torch processors refuse inside), the
    engine serving on."""
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    image = _images()["palette"]
    for kwargs, field in cases:
        req = {"prompt": prompt, "multi_modal_data": {"image": image}}
        with pytest.raises(ValueError, match="mm_processor_kwargs") as e:
            llm.generate([{**req, "mm_processor_kwargs": kwargs}], params, use_tqdm=False)
        assert field in str(e.value), (kwargs, e.value)
        made = ("could not be processed", "gave pixel values")  # the processor ran: too late
        assert not (early and any(m in str(e.value) for m in made)), (kwargs, e.value)
        assert len(llm.generate([req], params, use_tqdm=False)[0].outputs[0].token_ids) == 2


def _refuses_tampered(llm: LLM, prompt: str) -> None:
    """Images processed ahead (a server's ImageInputs) whose image_size a client changed (an
    aspect-ratio id past Mllama's table, a 10**6-crop Phi-4-multimodal grid) are refused by
    the same ValueError as any misfit, before the worker reads them."""
    import dataclasses

    images = llm.llm_engine.input_processor.images
    ids, done = images.process(llm.get_tokenizer().encode(prompt), _images()["palette"])
    if done[0].image_size is None:  # a fixed layout (DeepSeek-VL): no size to change
        return
    for change in (lambda s: (s[0], 999, *s[2:]), lambda s: tuple(10**6 for _ in s)):
        bad = [dataclasses.replace(m, image_size=change(m.image_size)) for m in done]
        with pytest.raises(ValueError, match="multi_modal_data"):
            llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": bad}}])


def _answers_or_refuses(llm: LLM, prompt: str, **request: Any) -> None:
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    answered = 0
    for name, image in _images().items():
        try:
            req = {"prompt": prompt, "multi_modal_data": {"image": image}, **request}
            out = llm.generate([req], params, use_tqdm=False)[0]
        except ValueError as e:
            assert "multi_modal_data" in str(e), (name, e)
            continue
        assert len(out.outputs[0].token_ids) == 2, name
        answered += 1
    assert answered >= 3  # the palette, transparent and grey ones at least
    assert len(llm.generate(["hello"], params, use_tqdm=False)[0].outputs[0].token_ids) == 2


@pytest.mark.parametrize("kind", list(MODELS))
def test_awkward_images_answer_or_refuse_cleanly(tmp_path, kind):
    write, kw, prompt = MODELS[kind]
    path = write(tmp_path, **kw)
    llm = LLM(model=str(path), dtype="float32", max_model_len=1024, max_num_batched_tokens=1024)
    # Gemma 3: its crops too (pan-and-scan of the strips and the huge one)
    extra = {"mm_processor_kwargs": {"do_pan_and_scan": True}} if kind == "gemma3" else {}
    _answers_or_refuses(llm, prompt, **extra)
    _refuses_kwargs(llm, prompt, HOSTILE_KWARGS.get(kind, []))
    if kind in FAIR_KWARGS:
        req = {"prompt": prompt, "multi_modal_data": {"image": _images()["palette"]}}
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        out = llm.generate([{**req, "mm_processor_kwargs": FAIR_KWARGS[kind]}], params)
        assert len(out[0].outputs[0].token_ids) == 2
    if kind in TAMPERED:
        _refuses_tampered(llm, prompt)


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_awkward_images_on_the_newer_families(tmp_path, kind):
    name, write, prompt = FAMILIES[kind]
    module = _module(name)
    path = write(module, tmp_path / kind)
    llm = LLM(model=str(path), dtype="float32", max_num_batched_tokens=4096)
    _answers_or_refuses(llm, prompt(module))
    _refuses_kwargs(llm, prompt(module), HOSTILE_KWARGS.get(kind, []), kind not in TAMPERED)
    if kind in FAIR_KWARGS:  # served
        req = {"prompt": prompt(module), "multi_modal_data": {"image": _images()["palette"]}}
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        out = llm.generate([{**req, "mm_processor_kwargs": FAIR_KWARGS[kind]}], params)
        assert len(out[0].outputs[0].token_ids) == 2
    if kind in TAMPERED:
        _refuses_tampered(llm, prompt(module))


def test_crop_searches_stay_cheap_for_huge_crop_counts():
    """Phi-4-multimodal's aspect-ratio search and Molmo2's tiling list their candidates in
    O(n log n) (transformers': n**3 and n**2 steps): the same choices, in transformers' order."""
    import itertools

    from paged_engine.multimodal.molmo2_processor import select_tiling
    from paged_engine.multimodal.phi4mm_processor import _ratios, crop_grid

    for most in (1, 2, 7, 36, 50):
        steps = itertools.product(range(1, most + 1), repeat=3)
        hf = {(i, j) for n, i, j in steps if i <= n and j <= n and i * j <= most}
        assert list(_ratios(most)) == list(hf), most
    assert crop_grid(15000, 15000, 448, 3000) == (34, 34)  # n**3: minutes
    assert crop_grid(15000, 15000, 448, 800) == (28, 28)
    hf_tiling = _module("transformers.models.molmo2.image_processing_molmo2").select_tiling
    rng = np.random.default_rng(0)
    for h, w in rng.integers(-300, 3000, (30, 2)).tolist():  # grids of at most 12 x 12
        for most in (1, 8, 30):
            assert select_tiling(h, w, 266, most) == hf_tiling(h, w, 266, most), (h, w, most)
        assert select_tiling(h, w, 266, 10**9) == hf_tiling(h, w, 266, 150), (h, w)


@pytest.mark.parametrize(
    "kind, kwargs, field",
    [
        ("mllama", {"max_image_tiles": 10**9}, "max_image_tiles"),
        ("deepseek_vl", {"min_size": 10**6}, "min_size"),
    ],
)
def test_chat_refuses_hostile_processor_kwargs(tmp_path, kind, kwargs, field):
    """Over the server's chat path, with the image as a data: URL: a 400 naming
    mm_processor_kwargs and the field, then the next request answered."""
    pytest.importorskip("paged_server")
    from image_checks import data_url
    from server.server_proc import COMMON_ARGS, serve_in_process

    name, write, _ = FAMILIES[kind]
    llm = LLM(model=str(write(_module(name), tmp_path / kind)), dtype="float32")
    image = {"type": "image_url", "image_url": {"url": data_url(_images()["rgba"])}}
    content = [image, {"type": "text", "text": "what is it?"}]
    body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": content}]}
    try:
        with serve_in_process(COMMON_ARGS, llm.llm_engine) as (http, _):
            bad = {**body, "mm_processor_kwargs": kwargs}
            status, _, out = http.request("POST", "/v1/chat/completions", bad)
            assert status == 400 and out["error"]["param"] == "mm_processor_kwargs", out
            assert field in out["error"]["message"], out
            status, _, out = http.request("POST", "/v1/chat/completions", body)
            assert status == 200, out
    finally:
        llm.llm_engine.shutdown()


# the older layouts and the families whose processors failed on empty or thin images without a
# word of the image (division by zero, NaN, a SizeDict of height 0, an answer to a 0x0 image)
EMPTY_AND_THIN = [*MODELS, "mllama", "idefics2", "fuyu"]


@pytest.mark.parametrize("kind", EMPTY_AND_THIN)
def test_empty_and_thin_images_are_refused_by_name(tmp_path, kind):
    """A 0x0 image is refused before any processor, naming it; 1x1, 1x10000 and 10000x1 are
    answered or refused naming the image's size (processor.py's checks), and the engine serves
    on. LLaVA's checkpoint resizes by a shortest edge of 64 (LLaVA 1.5's is 336; the crop stays
    30): a 1 x 10000 strip would be 64 x 640000 pixels (LLaVA 1.5's: 11 GB), refused before the
    processor runs."""
    import json
    import time

    if kind in MODELS:
        write, kw, prompt = MODELS[kind]
        path = write(tmp_path, **kw)
    else:
        name, family, make_prompt = FAMILIES[kind]
        module = _module(name)
        path, prompt = family(module, tmp_path / kind), make_prompt(module)
    if kind == "llava":
        file = path / "processor_config.json"
        saved = json.loads(file.read_text())
        saved["image_processor"]["size"] = {"shortest_edge": 64}
        file.write_text(json.dumps(saved))
    llm = LLM(model=str(path), dtype="float32", max_num_batched_tokens=4096)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    rng = np.random.default_rng(1)
    for h, w in ((0, 0), (1, 1), (1, 10000), (10000, 1)):
        pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        image = Image.fromarray(pixels) if h else Image.new("RGB", (0, 0))  # (numpy's refused)
        req = {"prompt": prompt, "multi_modal_data": {"image": image}}
        start = time.monotonic()
        try:
            out = llm.generate([req], params, use_tqdm=False)[0]
        except ValueError as e:
            assert f"{w}x{h} pixels" in str(e) and "multi_modal_data" in str(e), (w, h, e)
            if h == 0:
                assert "multi_modal_data['image'][0] is 0x0 pixels" in str(e), e
            if kind == "llava" and max(h, w) == 10000:
                assert "too thin" in str(e) and time.monotonic() - start < 5, e
            continue
        assert h > 0 and not (kind == "llava" and max(h, w) == 10000), (w, h)
        assert len(out.outputs[0].token_ids) == 2, (w, h)
    assert len(llm.generate(["hello"], params, use_tqdm=False)[0].outputs[0].token_ids) == 2
