"""Vision-language releases under the architecture names vLLM registers for them
(models/hub_vlm_configs.py) against HF on the transformers form of the same weights.

LightOnOCR-1B-1025 (`LightOnOCRForConditionalGeneration`, model_type "mistral3"): a tiny random
transformers LightOnOcr checkpoint (test_lighton_ocr_images' writer) is written again as the
release ships it: the same tensor names (`model.vision_encoder.*`, `model.vision_projection.*`,
`model.language_model.*`), a Mistral3-style config.json (projector switches at the top, rope
as `rope_theta`, the head tied by text_config alone), the Pixtral image processor in
preprocessor_config.json beside a processor_config.json naming the release's own processor
class. paged on the release dir must give HF's prompt ids, greedy tokens and top-5 logprobs
(1e-3, float32) on the transformers dir: one image, text alone, two images; Mistral 3 switches
LightOnOCR does not run are refused by name, from the reader and from the engine.
"""

from __future__ import annotations

import json
import shutil

import pytest
from image_checks import (
    WIDE_TALL_SMALL,
    check_matches_hf,
    check_processor_matches_hf,
    engine,
    hf_cases,
    hf_refs,
)
from test_internvl_chat_remote import CTX, write_tiny_internvl_hf
from test_internvl_chat_remote import TWO as CTX_TWO
from test_lighton_ocr_images import PROMPT, TEXT, TWO, write_tiny_lighton_ocr
from vlm_checkpoints import load_hf_vlm, tiled_context_inputs

from paged_engine.models.hub_vlm_configs import intern_s1_config, lighton_ocr_config

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.lighton_ocr")

_COPIED = ("model.safetensors", "tokenizer", "generation_config", "chat_template", "special")
CTX_PROMPT = f"<|im_start|>user\n{CTX}\nWhat is in it?<|im_end|>\n<|im_start|>assistant\n"


def _rope_theta(config: dict) -> dict:
    """`config` with its rope as the release writes it (`rope_theta`, no rope_parameters)."""
    rope = config.pop("rope_parameters")
    return {**config, "rope_theta": rope["rope_theta"]}


def to_lighton_hub(hf_dir, path):
    """`hf_dir` (transformers' LightOnOcr) as LightOnOCR-1B-1025 ships it, at `path`."""
    path.mkdir(parents=True, exist_ok=True)
    for f in hf_dir.iterdir():
        if f.name.startswith(_COPIED):
            shutil.copy(f, path / f.name)
    hf = json.loads((hf_dir / "config.json").read_text())
    text = _rope_theta({**hf["text_config"], "architectures": ["Qwen3ForCausalLM"]})
    text["tie_word_embeddings"] = hf["tie_word_embeddings"]  # the release ties by text_config
    config = {
        "architectures": ["LightOnOCRForConditionalGeneration"],
        "model_type": "mistral3",
        "dtype": "float32",
        "image_token_id": hf["image_token_id"],
        "multimodal_projector_bias": False,
        "projector_hidden_act": "gelu",
        "spatial_merge_size": hf["spatial_merge_size"],
        "vision_feature_layer": -1,
        "text_config": text,
        "vision_config": _rope_theta(dict(hf["vision_config"])),
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    saved = json.loads((hf_dir / "processor_config.json").read_text())
    images = saved.pop("image_processor")
    images |= {"image_processor_type": "PixtralImageProcessorFast", "patch_size": 4}
    images["processor_class"] = "LightOnOCRProcessor"
    (path / "preprocessor_config.json").write_text(json.dumps(images, indent=2))
    tokens = {"image_token": "<|image_pad|>", "image_break_token": "<|vision_pad|>"}
    tokens["image_end_token"] = "<|vision_end|>"
    processor = {**tokens, "patch_size": 4, "spatial_merge_size": 2}
    processor["processor_class"] = "LightOnOCRProcessor"  # not a transformers class
    (path / "processor_config.json").write_text(json.dumps(processor, indent=2))
    return path


@pytest.fixture(scope="module")
def lighton_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lighton_hub")
    hf = write_tiny_lighton_ocr(root / "hf", seed=3)
    return hf, to_lighton_hub(hf, root / "hub")


def test_lighton_ocr_release_matches_hf(lighton_dirs):
    """One image (a 10 x 15 patch grid), text alone, two images on the release dir give HF's
    ids, tokens and logprobs on the transformers dir."""
    hf_dir, hub = lighton_dirs
    model = load_hf_vlm(transformers.LightOnOcrForConditionalGeneration, hf_dir)
    processor = transformers.AutoProcessor.from_pretrained(hf_dir)
    cases = hf_cases(PROMPT, TEXT, TWO, ((40, 58), (90, 30), (17, 33)))
    keys = ("pixel_values", "image_sizes")
    refs = check_processor_matches_hf(
        hub, model, processor, cases, keys, "lighton_ocr_hub", whole=True
    )
    assert refs[0][0].count(model.config.image_token_id) == 5 * 7


def test_lighton_ocr_release_refuses_by_name(lighton_dirs):
    """Mistral 3 switches LightOnOCR's model does not run, a missing image token or
    sub-config: ValueError naming the field, from the reader and from the engine."""
    _, hub = lighton_dirs
    good = json.loads((hub / "config.json").read_text())
    assert lighton_ocr_config(good).tie_word_embeddings is True
    assert lighton_ocr_config({**good, "vision_feature_layer": None}).image_token_id > 0
    bad = [
        ({"vision_feature_layer": -2}, "vision_feature_layer"),
        ({"projector_hidden_act": "silu"}, "projector_hidden_act"),
        ({"multimodal_projector_bias": True}, "multimodal_projector_bias"),
        ({"image_token_id": None}, "image_token_id"),
        ({"text_config": None}, "text_config"),
    ]
    for change, match in bad:
        with pytest.raises(ValueError, match=match):
            lighton_ocr_config({**good, **change})
    (hub / "config.json").write_text(json.dumps({**good, "vision_feature_layer": -2}))
    try:
        with pytest.raises(ValueError, match="vision_feature_layer"):
            engine(hub)
    finally:
        (hub / "config.json").write_text(json.dumps(good))


def to_intern_s1(hf_dir, path):
    """`hf_dir` (transformers' InternVL, a Qwen3 decoder) as Intern-S1-mini ships it, at `path`:
    the same tensors, config.json under model_type "interns1" (the head tied by text_config),
    the GotOcr2 processor file naming the release's own processor class."""
    path.mkdir(parents=True, exist_ok=True)
    for f in hf_dir.iterdir():
        if f.name.startswith(_COPIED):
            shutil.copy(f, path / f.name)
    hf = json.loads((hf_dir / "config.json").read_text())
    text = {**hf["text_config"], "architectures": ["Qwen3ForCausalLM"]}
    text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    vision = {**hf["vision_config"], "model_type": "interns1_vision"}
    vision |= {"architectures": ["InternS1VisionModel"], "drop_path_rate": 0.0}
    auto = {"AutoConfig": "configuration_interns1.InternS1Config"}
    config = {k: v for k, v in hf.items() if k not in ("text_config", "vision_config")}
    config |= {"architectures": ["InternS1ForConditionalGeneration"], "model_type": "interns1"}
    config |= {"auto_map": auto, "text_config": text, "vision_config": vision}
    config.pop("tie_word_embeddings")
    (path / "config.json").write_text(json.dumps(config, indent=2))
    images = json.loads((hf_dir / "preprocessor_config.json").read_text())
    images |= {"image_processor_type": "GotOcr2ImageProcessorFast"}
    images["processor_class"] = "InternS1Processor"  # remote code: not read
    (path / "preprocessor_config.json").write_text(json.dumps(images, indent=2))
    return path


@pytest.fixture(scope="module")
def intern_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("intern_s1")
    hf = write_tiny_internvl_hf(root / "hf", seed=7, decoder="qwen3")
    return hf, to_intern_s1(hf, root / "hub")


def test_intern_s1_release_matches_hf(intern_dirs):
    """One image (2 tiles and the thumbnail), text alone, two images on the release dir give
    HF InternVL's ids, tokens and logprobs on the transformers dir (q / k norms and q / k / v
    biases on in the tower)."""
    hf_dir, hub = intern_dirs
    model = load_hf_vlm(transformers.InternVLForConditionalGeneration, hf_dir)
    cases = hf_cases(CTX_PROMPT, TEXT, CTX_TWO, WIDE_TALL_SMALL)
    refs = hf_refs(model, cases, lambda *case: tiled_context_inputs(hf_dir, *case))
    check_matches_hf(hub, cases, refs, "intern_s1_hub")


def test_intern_s1_release_refuses_by_name(intern_dirs):
    """A vision field InternVL's tower does not hold, a q / k norm eps it does not run, a
    missing image token or sub-config: ValueError naming the field, from the reader and from
    the engine."""
    _, hub = intern_dirs
    good = json.loads((hub / "config.json").read_text())
    assert intern_s1_config(good).vision_config.use_qk_norm
    for tie in (True, False):  # the head tied by text_config alone
        text = {**good["text_config"], "tie_word_embeddings": tie}
        config = intern_s1_config({**good, "text_config": text, "tie_word_embeddings": not tie})
        assert config.tie_word_embeddings is tie
    vision = good["vision_config"]
    bad = [
        ({"vision_config": {**vision, "use_swiglu": True}}, "vision_config.use_swiglu"),
        ({"vision_config": {**vision, "layer_norm_eps": 1e-5}}, "vision_config.layer_norm_eps"),
        ({"image_token_id": None}, "image_token_id"),
        ({"vision_config": None}, "vision_config"),
    ]
    for change, match in bad:
        with pytest.raises(ValueError, match=match):
            intern_s1_config({**good, **change})
    plain = {**vision, "use_qk_norm": False, "layer_norm_eps": 1e-5}  # no q / k norm: any eps
    assert intern_s1_config({**good, "vision_config": plain}).vision_config.layer_norm_eps == 1e-5
    (hub / "config.json").write_text(json.dumps({**good, **bad[0][0]}))
    try:
        with pytest.raises(ValueError, match="use_swiglu"):
            engine(hub)
    finally:
        (hub / "config.json").write_text(json.dumps(good))
