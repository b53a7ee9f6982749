"""Vision-language config fields away from the tiny checkpoints' defaults, a few a case, on the
most-served VLM families (LLaVA, LLaVA-NeXT, Qwen2-VL / 2.5-VL, Gemma 3, Idefics3 / SmolVLM,
Mistral 3 / Pixtral, InternVL): each variant, served by `LLM` (float32) with one and two images
of several sizes and aspect ratios, gives HF's expanded prompt ids and HF's greedy tokens and
top-5 logprobs (1e-3, hf_reference.assert_matches) on the same weights; processor settings
changed in the checkpoint's processor files or per request (`mm_processor_kwargs`) as HF's
processor call takes them. A config transformers cannot run (its image features do not fit
the placeholders it writes) is refused at load by a ValueError naming the field.

Regression: a Qwen2-VL image processor whose merge_size is not the tower's spatial_merge_size
(HF counts placeholders by the one, features by the other) was served by the tower's count,
or failed per request with an unnamed grid error; now refused at load (layouts_qwen.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_reference import assert_matches
from image_checks import (
    WIDE_TALL_SMALL,
    check_config_refused,
    engine,
    greedy,
    hf_refs,
    noise_image,
)
from vlm_checkpoints import load_hf_vlm

from paged_engine.testing import (
    write_tiny_gemma3,
    write_tiny_idefics3,
    write_tiny_internvl,
    write_tiny_llava,
    write_tiny_mistral3,
    write_tiny_qwen2_vl,
)
from paged_engine.testing.models import _save_random

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL.Image")

LLAVA = (
    "USER: <image>\nWhat is in it?\nASSISTANT:",
    "USER: <image>\nand <image>\nWhich?\nASSISTANT:",
)
_V = "<|vision_start|><|image_pad|><|vision_end|>"
_CHATML = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
QWEN = (_CHATML.format(f"{_V}What is in it?"), _CHATML.format(f"{_V} and {_V}Which?"))
_BOI = "<start_of_image>"
_GEMMA = "<|bos|><start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n"
GEMMA = (_GEMMA.format(f"{_BOI}What is in it?"), _GEMMA.format(f"{_BOI}and{_BOI}Which?"))
_IDEFICS = "<|im_start|>User:{}<end_of_utterance>\nAssistant:"
IDEFICS = (_IDEFICS.format("<image>What is in it?"), _IDEFICS.format("<image>and<image>Which?"))
MISTRAL = ("[INST][IMG]What is in it?[/INST]", "[INST][IMG] and [IMG]Which?[/INST]")
_CTX = "<IMG_CONTEXT>"
INTERNVL = (
    _CHATML.format(f"{_CTX}\nWhat is in it?"),
    _CHATML.format(f"{_CTX}\nand {_CTX}\nWhich?"),
)


def _cases(prompts: tuple[str, str], sizes=WIDE_TALL_SMALL) -> list[tuple[str, list]]:
    one, two = prompts
    first, second, third = sizes
    return [
        (one, [noise_image(1, first)]),
        (two, [noise_image(2, second), noise_image(3, third)]),
    ]


def _check(path: Path, cls: str, cases, inputs: Callable, name: str, **kwargs: Any) -> None:
    """HF's `cls` on `cases` (its inputs by `inputs(text, images)`) against the engine;
    `kwargs`: each request's mm_processor_kwargs."""
    refs = hf_refs(load_hf_vlm(getattr(transformers, cls), path), cases, inputs)
    extra = {"mm_processor_kwargs": kwargs} if kwargs else {}
    prompts = [{"prompt": t, "multi_modal_data": {"image": imgs}, **extra} for t, imgs in cases]
    outs = engine(path).generate(prompts, greedy(), use_tqdm=False)
    for (ids, ref), out in zip(refs, outs, strict=True):
        assert out.prompt_token_ids == ids, name
        assert_matches(name, out, ref)


def _resave(path: Path, cls: str, seed: int, vision: dict | None = None, **fields: Any) -> Path:
    """`path`'s checkpoint with `fields` (and `vision` on its vision_config) changed, its
    random weights made again for the new shapes."""
    config = transformers.AutoConfig.from_pretrained(path)
    for key, value in fields.items():
        setattr(config, key, value)
    for key, value in (vision or {}).items():
        setattr(config.vision_config, key, value)
    _save_random(getattr(transformers, cls), config, seed, path)
    return path


def _edit_json(path: Path, name: str, **fields: Any) -> None:
    file = path / name
    file.write_text(json.dumps(json.loads(file.read_text()) | fields))


def _processor(path: Path, keys: tuple[str, ...], **kwargs: Any) -> Callable:
    processor = transformers.AutoProcessor.from_pretrained(path)

    def inputs(text: str, images: list) -> tuple[list[int], dict]:
        out = processor(text=[text], images=[images], return_tensors="pt", **kwargs)
        return out["input_ids"][0].tolist(), {k: out[k] for k in keys}

    return inputs


@pytest.mark.parametrize(
    ("vision", "fields"),
    [
        # hidden_states[0] (the embeddings) beside the last layer; a 7-pixel patch leaving a
        # remainder of the 30-pixel image; image_seq_length only HF's processor default
        (
            "clip",
            {
                "patch_size": 7,
                "vision_feature_layer": [0, -1],
                "projector_hidden_act": "silu",
                "multimodal_projector_bias": False,
                "image_seq_length": 7,
            },
        ),
        # a positive layer; "default" drops SigLIP's first patch (no CLS) as HF does
        ("siglip", {"vision_feature_layer": 1, "projector_hidden_act": "quick_gelu"}),
    ],
    ids=["clip", "siglip"],
)
def test_llava(tmp_path, vision, fields):
    path = write_tiny_llava(tmp_path, vision=vision, seed=3, **fields)
    cases = _cases(LLAVA, ((40, 52), (64, 30), (30, 30)))
    _check(
        path, "LlavaForConditionalGeneration", cases, _processor(path, ("pixel_values",)), vision
    )


@pytest.mark.parametrize(
    ("vision", "fields"),
    [
        (
            "clip",
            {
                "grid_pinpoints": [[30, 30], [30, 120], [120, 30], [60, 90]],
                "vision_feature_layer": -2,
            },
        ),
        (
            "siglip",
            {
                "grid_pinpoints": [[30, 60], [60, 60]],
                "vision_feature_select_strategy": "full",
                "projector_hidden_act": "silu",
                "multimodal_projector_bias": False,
            },
        ),
    ],
    ids=["clip", "siglip"],
)
def test_llava_next(tmp_path, vision, fields):
    """Other pinpoints than the tiny default: tiles by aspect ratio, unpadding per image."""
    path = write_tiny_llava(tmp_path, vision=vision, seed=3, **fields)
    inputs = _processor(path, ("pixel_values", "image_sizes"))
    cases = _cases(LLAVA, ((40, 90), (90, 25), (20, 24)))
    _check(path, "LlavaNextForConditionalGeneration", cases, inputs, vision)


@pytest.mark.parametrize(
    ("version", "vision", "merge", "kwargs"),
    [
        ("2", {"spatial_merge_size": 1, "temporal_patch_size": 1}, 1, {}),
        ("2", {}, 2, {"min_pixels": 16 * 16, "max_pixels": 24 * 24}),
        (
            "2.5",
            {"spatial_merge_size": 4, "window_size": 32, "fullatt_block_indexes": [0, 2]},
            4,
            {},
        ),
    ],
    ids=["qwen2-merge1-temporal1", "qwen2-min-max-pixels", "qwen2.5-merge4-windows"],
)
def test_qwen2_vl(tmp_path, version, vision, merge, kwargs):
    """spatial_merge_size / temporal_patch_size (in the image processor too, as a checkpoint
    saves them), window attention fields, min / max_pixels per request."""
    path = write_tiny_qwen2_vl(tmp_path, version=version, seed=2, **vision)
    temporal = vision.get("temporal_patch_size", 2)
    _edit_json(path, "preprocessor_config.json", merge_size=merge, temporal_patch_size=temporal)
    images = transformers.AutoImageProcessor.from_pretrained(path)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    pad = transformers.AutoConfig.from_pretrained(path).image_token_id

    def inputs(text: str, imgs: list) -> tuple[list[int], dict]:
        # HF's size dict for vLLM's min_pixels / max_pixels (deprecated in HF's call)
        size = {"shortest_edge": kwargs.get("min_pixels"), "longest_edge": kwargs.get("max_pixels")}
        out = images(images=imgs, return_tensors="pt", **({"size": size} if kwargs else {}))
        ids = []
        runs = iter(int(g.prod()) // merge**2 for g in out["image_grid_thw"])
        for t in tok.encode(text, add_special_tokens=False):
            ids += [t] * next(runs) if t == pad else [t]
        kinds = torch.tensor([[int(t == pad) for t in ids]])
        keys = ("pixel_values", "image_grid_thw")
        return ids, {k: out[k] for k in keys} | {"mm_token_type_ids": kinds}

    cls = (
        "Qwen2VLForConditionalGeneration"
        if version == "2"
        else ("Qwen2_5_VLForConditionalGeneration")
    )
    cases = _cases(QWEN, ((40, 56), (72, 24), (33, 47)))
    _check(path, cls, cases, inputs, f"qwen{version}", **kwargs)


def test_gemma3(tmp_path):
    """48-pixel images of 6-pixel patches (8 a side) pooled to mm_tokens_per_image=4 rows."""
    path = write_tiny_gemma3(tmp_path, seed=3, image_size=48, patch_size=6, mm_tokens_per_image=4)
    inputs = _processor(path, ("pixel_values", "token_type_ids"))
    _check(path, "Gemma3ForConditionalGeneration", _cases(GEMMA), inputs, "gemma3")


def test_idefics3_scale_factor_and_splitting(tmp_path):
    """scale_factor 4 on 64-pixel tiles; image splitting off in the processor's file, and per
    request; SmolVLM's splitting off."""
    path = write_tiny_idefics3(tmp_path / "a", seed=3, scale_factor=4, image_size=64)
    keys = ("pixel_values", "pixel_attention_mask")
    cls = "Idefics3ForConditionalGeneration"
    _check(path, cls, _cases(IDEFICS), _processor(path, keys), "scale4")
    off = _processor(path, keys, do_image_splitting=False)
    _check(path, cls, _cases(IDEFICS), off, "scale4-no-split", do_image_splitting=False)
    path = write_tiny_idefics3(tmp_path / "b", seed=3)
    saved = json.loads((path / "processor_config.json").read_text())
    saved["image_processor"]["do_image_splitting"] = False
    (path / "processor_config.json").write_text(json.dumps(saved))
    _check(path, cls, _cases(IDEFICS), _processor(path, keys), "no-split")


def _pixtral_inputs(path: Path, unit: int) -> Callable:
    """PixtralProcessor's rule (it needs torchvision): lines of [IMG] a `unit`-pixel block,
    [IMG_BREAK] after each but the last, [IMG_END]."""
    tok = transformers.AutoTokenizer.from_pretrained(path)
    images = transformers.AutoImageProcessor.from_pretrained(path)

    def inputs(text: str, imgs: list) -> tuple[list[int], dict]:
        size = {"height": unit, "width": unit}
        out = images(images=imgs, return_tensors="pt", patch_size=size)
        pieces = text.split("[IMG]")
        for i, (h, w) in enumerate(out["image_sizes"].tolist()):
            lines = ["[IMG]" * (w // unit) + "[IMG_BREAK]" for _ in range(h // unit)]
            lines[-1] = lines[-1].removesuffix("[IMG_BREAK]") + "[IMG_END]"
            pieces[i] += "".join(lines)
        ids = tok.encode("".join(pieces), add_special_tokens=False)
        return ids, {"pixel_values": out["pixel_values"], "image_sizes": out["image_sizes"]}

    return inputs


def test_mistral3_and_pixtral(tmp_path):
    """Mistral 3: spatial_merge_size 4, the second-to-last layer, SiLU and biased projector;
    Pixtral-style LLaVA: two feature layers, no projector bias."""
    cls = "Mistral3ForConditionalGeneration"
    path = write_tiny_mistral3(tmp_path / "m", seed=2)
    fields = {"vision_feature_layer": -2, "projector_hidden_act": "silu"}
    _resave(path, cls, 2, spatial_merge_size=4, multimodal_projector_bias=True, **fields)
    _check(path, cls, _cases(MISTRAL), _pixtral_inputs(path, 16), "mistral3")
    cls = "LlavaForConditionalGeneration"
    path = write_tiny_mistral3(tmp_path / "p", arch="llava", seed=2)
    fields = {"vision_feature_layer": [-2, -1], "multimodal_projector_bias": False}
    _resave(path, cls, 2, projector_hidden_act="silu", **fields)
    _check(path, cls, _cases(MISTRAL), _pixtral_inputs(path, 4), "pixtral")


def test_internvl(tmp_path):
    """downsample_ratio 0.25 (4 rows a tile), the second-to-last layer, a SiLU projector, QK
    norm and RMS norms in the tower; up to 3 tiles per request."""
    path = write_tiny_internvl(tmp_path, seed=2)
    vision = {"use_qk_norm": True, "norm_type": "rms_norm"}
    fields = {"downsample_ratio": 0.25, "vision_feature_layer": -2, "projector_hidden_act": "silu"}
    _resave(path, "InternVLForConditionalGeneration", 2, vision=vision, **fields)
    images = transformers.AutoImageProcessor.from_pretrained(path)

    def inputs(text: str, imgs: list) -> tuple[list[int], dict]:
        out = images(images=imgs, return_tensors="pt", crop_to_patches=True, max_patches=3)
        pieces = text.split(_CTX)
        for i, tiles in enumerate(out["num_patches"].tolist()):
            pieces[i] += "<img>" + _CTX * (4 * tiles) + "</img>"
        tok = transformers.AutoTokenizer.from_pretrained(path)
        return tok.encode("".join(pieces), add_special_tokens=False), {
            "pixel_values": out["pixel_values"]
        }

    cls = "InternVLForConditionalGeneration"
    _check(path, cls, _cases(INTERNVL), inputs, "internvl", max_patches=3)


def test_configs_transformers_cannot_run_are_refused(tmp_path):
    """Each config gives HF image features that do not fit the placeholders its processor
    writes (HF raises at the first image): paged refuses it at load, naming the field."""
    llava = write_tiny_llava(tmp_path / "llava", seed=3)
    next_ = write_tiny_llava(tmp_path / "next", seed=3, grid_pinpoints=[[30, 60], [60, 30]])
    gemma = write_tiny_gemma3(tmp_path / "gemma", seed=3)
    mistral = write_tiny_mistral3(tmp_path / "mistral", seed=2)
    pixtral = write_tiny_mistral3(tmp_path / "pixtral", arch="llava", seed=2)
    internvl = write_tiny_internvl(tmp_path / "internvl", seed=2)
    idefics = write_tiny_idefics3(tmp_path / "idefics", seed=3)

    def config(path: Path, vision: dict | None = None, **fields: Any) -> dict:
        saved = json.loads((path / "config.json").read_text()) | fields
        saved["vision_config"] |= vision or {}
        return saved

    cases = [
        (next_, config(next_, vision_feature_select_strategy="full"), "select_strategy='full'"),
        (next_, config(next_, image_grid_pinpoints=[[45, 60]]), "image_grid_pinpoints"),
        (gemma, config(gemma, mm_tokens_per_image=8), "mm_tokens_per_image=8"),
        (gemma, config(gemma, mm_tokens_per_image=9), "mm_tokens_per_image=9"),
        (mistral, config(mistral, vision_feature_layer=[-2, -1]), "vision_feature_layer"),
        (pixtral, config(pixtral, vision_feature_select_strategy="default"), "select_strategy"),
        (internvl, config(internvl, vision_feature_select_strategy="full"), "select_strategy"),
        (internvl, config(internvl, vision={"image_size": [20, 20]}), "downsample_ratio"),
        (idefics, config(idefics, vision={"image_size": 24}), "scale_factor"),
        (llava, config(llava, vision_feature_layer=4), "vision_feature_layer"),
    ]
    for i, (path, saved, match) in enumerate(cases):
        check_config_refused(path, tmp_path / f"refused{i}", saved, match)


def test_qwen2_vl_processor_merge_size_not_the_towers_is_refused(tmp_path):
    path = write_tiny_qwen2_vl(tmp_path, seed=2)
    _edit_json(path, "preprocessor_config.json", merge_size=1)
    with pytest.raises(
        ValueError, match=r"merge_size 1 is not vision_config\.spatial_merge_size 2"
    ):
        engine(path)
