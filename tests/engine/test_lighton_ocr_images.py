"""Images through LightOnOCR checkpoints (multimodal/lighton_ocr.py) against HF.

A tiny random `LightOnOcrForConditionalGeneration`: a Pixtral tower of 4-pixel patches, patches
merged 2 x 2, a Qwen3 decoder; Pixtral's image processor (longest edge 64). `LLM.generate` with
`multi_modal_data` must give LightOnOcrProcessor's prompt ids (a plain run of one
<|image_pad|> per merged patch, no break / end tokens) and HF `generate`'s greedy tokens and
top-5 logprobs (1e-3, float32); images whose patch grid is odd on a side (HF's merger drops the
last row / column) included. Then the tower's rows against HF's image features, the engine's
paths (chunks through images, prefix-cache hits, images processed ahead), bad input and the
server's chat path with a data: URL.
"""

from __future__ import annotations

import pytest
import torch
from image_checks import (
    check_chat_data_url,
    check_paths_and_refusals,
    check_processor_matches_hf,
    engine,
    hf_cases,
    noise_image,
)
from vlm_checkpoints import (
    chatml_template,
    encoder_from_checkpoint,
    finish_checkpoint,
    load_hf_vlm,
    saved_tokenizer,
)

from paged_engine.testing import _COMMON, _save_random, tiny_config

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.lighton_ocr")

IMAGE = "<|image_pad|>"
PROMPT = f"<|im_start|>user\n{IMAGE}Read it.<|im_end|>\n<|im_start|>assistant\n"
TWO = f"<|im_start|>user\n{IMAGE} and {IMAGE}Which is longer?<|im_end|>\n<|im_start|>assistant\n"
TEXT = "<|im_start|>user\nSay something about the sea.<|im_end|>\n<|im_start|>assistant\n"
_SPECIAL = ["<|im_start|>", "<|im_end|>", IMAGE, "<|vision_pad|>", "<|vision_end|>"]
CHAT_TEMPLATE = chatml_template("<|image_pad|>")


def write_tiny_lighton_ocr(path, seed: int = 0):
    """A tiny random LightOnOCR checkpoint with its processor (LightOnOcrProcessor)."""
    path.mkdir(parents=True, exist_ok=True)
    names = {"image_token": IMAGE, "image_break_token": _SPECIAL[3]}
    tokenizer = saved_tokenizer(
        path, _SPECIAL, CHAT_TEMPLATE, seed, **names, image_end_token=_SPECIAL[4]
    )
    text = tiny_config("qwen3", vocab_size=len(tokenizer)).to_dict()
    vision = {"model_type": "pixtral", "hidden_size": 32, "intermediate_size": 48}
    vision |= {"num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 8}
    vision |= {"patch_size": 4, "image_size": 64, "hidden_act": "silu"}
    config = transformers.LightOnOcrConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE),
        spatial_merge_size=2,
        **_COMMON,
    )
    _save_random(transformers.LightOnOcrForConditionalGeneration, config, seed, path)
    images = transformers.PixtralImageProcessor(
        patch_size={"height": 4, "width": 4}, size={"longest_edge": 64}
    )
    processor = transformers.LightOnOcrProcessor(
        image_processor=images, tokenizer=tokenizer, patch_size=4, spatial_merge_size=2
    )
    return finish_checkpoint(path, processor)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_lighton_ocr(tmp_path_factory.mktemp("lighton_ocr"), seed=3)


def _model(path):
    return load_hf_vlm(transformers.LightOnOcrForConditionalGeneration, path)


def test_images_match_hf(path):
    """One image (a 10 x 15 patch grid: the odd column dropped by the merger), text alone,
    two images of different sizes (resized to fit); then HF's expanded ids as
    prompt_token_ids."""
    model, processor = _model(path), transformers.AutoProcessor.from_pretrained(path)
    cases = hf_cases(PROMPT, TEXT, TWO, ((40, 58), (90, 30), (17, 33)))
    keys = ("pixel_values", "image_sizes")
    refs = check_processor_matches_hf(
        path, model, processor, cases, keys, "lighton_ocr", whole=True
    )
    assert refs[0][0].count(model.config.image_token_id) == 5 * 7


def test_tower_matches_hf_features(path):
    """The encoder's rows equal HF's get_image_features, odd grids included."""
    from paged_engine.multimodal.inputs import ImageInput

    model = _model(path)
    images = [noise_image(20, (40, 58)), noise_image(21, (64, 24))]
    out = transformers.AutoProcessor.from_pretrained(path).image_processor(
        images=images, return_tensors="pt"
    )
    encoder = encoder_from_checkpoint(path, model.config)
    inputs = [
        ImageInput(x[:, :h, :w], 0, 1, "", (h, w))
        for x, (h, w) in zip(out["pixel_values"], out["image_sizes"].tolist(), strict=True)
    ]
    with torch.no_grad():
        want = model.model.get_image_features(out["pixel_values"], out["image_sizes"])
        got = encoder.encode(inputs)
    assert [g.shape[0] for g in got] == [35, 24]
    for g, w in zip(got, want.pooler_output, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)


def test_engine_paths_match_the_plain_run(path):
    """image_checks' paths (8-token chunks through the images, prefix-cache hits, images
    processed ahead); bad input is a ValueError naming what is wrong, and the engine serves
    on."""
    thin = {"prompt": PROMPT, "multi_modal_data": {"image": noise_image(4, (2, 60))}}
    more = [(thin, "at least")]
    check_paths_and_refusals(path, PROMPT, TWO, lambda _: more, not_an_image="a page")


def test_chat_data_url_gives_the_offline_tokens(path):
    """The server's chat path: an image_url part with a data: URL gives the offline tokens and
    prompt (the chat template's <|image_pad|> expanded by the merged grid)."""
    question = [{"type": "image"}, {"type": "text", "text": "Read it."}]
    want = check_chat_data_url(engine(path), question, noise_image(12, (40, 72)))
    assert want.text == PROMPT


def test_config_refusals(path):
    from paged_engine.multimodal.archs import build_encoder

    for owner, field, value, match in [
        ("vision_config", "model_type", "siglip_vision_model", "model_type"),
        (None, "spatial_merge_size", 0, "spatial_merge_size=0"),
    ]:
        config = transformers.AutoConfig.from_pretrained(path)
        setattr(getattr(config, owner) if owner else config, field, value)
        with pytest.raises(ValueError, match=match):
            build_encoder(config)
