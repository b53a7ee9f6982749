"""Awkward images on every image layout: a 1-pixel image, 1 x 300 and 300 x 1 strips, palette,
transparent and grey images and a huge one give an answer or a ValueError naming
multi_modal_data (HF's processor refuses some, e.g. Qwen's aspect-ratio bound), never a crash,
and the engine serves on. The families whose tiny checkpoints live in their own test modules
(tests/engine/test_*_images.py) are built from there."""

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
    "phi4mm": ("test_phi4mm_images", lambda m, p: m.write_tiny_phi4mm(p), lambda m: m.PROMPT),
    "minicpmv4_7": (
        "test_minicpmv_images",
        lambda m, p: m.write_tiny(p, 0, version="4_7"),
        lambda m: m.PROMPT,
    ),
    "qwen3_omni": (
        "test_qwen_omni_images",
        lambda m, p: m.write_tiny_omni(p, "3"),
        lambda m: m._prompts("3")[0],
    ),
}


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


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_awkward_images_on_the_newer_families(tmp_path, kind):
    name, write, prompt = FAMILIES[kind]
    module = _module(name)
    path = write(module, tmp_path / kind)
    llm = LLM(model=str(path), dtype="float32", max_num_batched_tokens=4096)
    _answers_or_refuses(llm, prompt(module))
