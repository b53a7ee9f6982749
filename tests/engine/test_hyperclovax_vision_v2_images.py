"""Images through HyperCLOVA X Vision V2 checkpoints (multimodal/hyperclovax_vision_v2.py)
against HF.

A tiny random `HyperCLOVAXVisionV2ForConditionalGeneration`: testing.py's tiny HyperCLOVA X
decoder (Granite's scalars, logits multiplied, Peri-LN post norms; its own LM head) under plain
1-D positions; Qwen2.5-VL's tower (4-pixel patches merged 2 x 2, windows of 2 x 2 merged tokens
in blocks 0 and 2 beside a full-attention block 1) whose 40-wide merged rows a linear projector
widens to the text's 64. The encoder's rows equal HF's image features (1e-5); `LLM.generate`
with `multi_modal_data` must give HyperCLOVAXVisionV2Processor's prompt ids (one <|image_pad|>
per merged patch) and HF `generate`'s greedy tokens and top-5 logprobs (1e-3, float32). Then
the engine's paths (chunks through images, prefix-cache hits, images processed ahead), bad
input, refused configs and the Hub release's names.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from image_checks import (
    check_paths_and_refusals,
    check_processor_matches_hf,
    check_vision_fields_refused,
    engine,
    greedy,
    hf_cases,
    noise_image,
)
from vlm_checkpoints import (
    encoder_from_checkpoint,
    finish_checkpoint,
    load_hf_vlm,
    processor_without_video,
    save_grid_image_processor,
    tokenizer_with,
)

from paged_engine.testing import _COMMON, _save_random, tiny_config

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.hyperclovax_vision_v2")

IMAGE = "<|image_start|><|image_pad|><|image_end|>"
PROMPT = f"<|user|>{IMAGE}What is in it? Tell me.<|endofturn|>\n<|assistant|>"
TWO = f"<|user|>{IMAGE} and {IMAGE}Which is brighter?<|endofturn|>\n<|assistant|>"
TEXT = "<|user|>Say something about the sea, then more.<|endofturn|>\n<|assistant|>"
_SPECIAL = ["<|user|>", "<|assistant|>", "<|endofturn|>", "<|image_start|>", "<|image_end|>"]
_SPECIAL += ["<|image_pad|>", "<|video_pad|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|image_start|><|image_pad|><|image_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|endofturn|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_VISION = {
    "model_type": "qwen2_5_vl_vision",
    "depth": 3,
    "hidden_size": 32,
    "num_heads": 4,
    "intermediate_size": 48,
    "out_hidden_size": 40,  # the projector widens it to the text's 64
    "patch_size": 4,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 16,  # 2 x 2 merged tokens
    "fullatt_block_indexes": [1],
    "hidden_act": "silu",
}


def write_tiny_hyperclovax_vision_v2(path: Path, seed: int = 3) -> Path:
    """A tiny random checkpoint with its image processor (Qwen2VLImageProcessorPil: 4-pixel
    patches merged 2 x 2, 8 to 48 merged patches an image) and tokenizer."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer, ids = tokenizer_with(_SPECIAL, seed)
    text = tiny_config("hyperclovax", vocab_size=len(tokenizer)).to_dict()
    config = transformers.HyperCLOVAXVisionV2Config(
        text_config=text,
        vision_config=_VISION,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        tie_word_embeddings=False,  # the decoder's own head, saved
        **_COMMON,
    )
    _save_random(transformers.HyperCLOVAXVisionV2ForConditionalGeneration, config, seed, path)
    save_grid_image_processor(transformers.Qwen2VLImageProcessorPil, path, 2, 2 * 4 * 4)
    return finish_checkpoint(path, tokenizer, CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> Path:
    return write_tiny_hyperclovax_vision_v2(tmp_path_factory.mktemp("hyperclovax_vision_v2"))


def _processor(path: Path):
    return processor_without_video(transformers.HyperCLOVAXVisionV2Processor, path)


def _model(path: Path):
    return load_hf_vlm(transformers.HyperCLOVAXVisionV2ForConditionalGeneration, path)


def test_images_match_hf(path):
    cases = hf_cases(PROMPT, TEXT, TWO)  # the two images resized to the grid
    keys = ("pixel_values", "image_grid_thw")
    check_processor_matches_hf(
        path, _model(path), _processor(path), cases, keys, "hyperclovax_vision_v2"
    )


def test_encoder_matches_hf_features(path):
    """The encoder's rows (tower, merger, projector) equal HF's get_image_features."""
    model = _model(path)
    images = [noise_image(20, (40, 56)), noise_image(21, (72, 24))]
    llm = engine(path)
    _, done = llm.llm_engine.input_processor.images.process(llm.get_tokenizer().encode(TWO), images)
    pixels = _processor(path).image_processor(images=images, return_tensors="pt")
    encoder = encoder_from_checkpoint(path, model.config)
    with torch.no_grad():
        want = model.model.get_image_features(pixels["pixel_values"], pixels["image_grid_thw"])
        got = torch.cat(encoder.encode(done))
    torch.testing.assert_close(got, torch.cat(want.pooler_output), atol=1e-5, rtol=0)


def test_engine_paths_match_the_plain_run(path):
    """image_checks' paths (8-token chunks through the images, prefix-cache hits, images
    processed ahead); bad input is a ValueError naming what is wrong, and the engine serves
    on."""
    check_paths_and_refusals(path, PROMPT, TWO)


def test_config_refusals(path):
    from paged_engine.multimodal.archs import build_encoder

    cases = [("model_type", "qwen2_vl", "model_type"), ("window_size", 4, "window_size=4")]
    check_vision_fields_refused(path, cases, build_encoder)


def test_hub_names_load(path, tmp_path):
    """The Hub release's names (`model.language_model.model.*` beside
    `model.language_model.lm_head`, `model.vision_model.*`, `model.vision_projector.*`) serve
    the same tokens, its own head untied whatever tie_word_embeddings says."""
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "hub"
    shutil.copytree(path, copy)
    weights = load_file(copy / "model.safetensors")
    text = "model.language_model."

    def hub(name: str) -> str:
        if name.startswith(text) and not name.startswith(text + "lm_head."):
            return text + "model." + name.removeprefix(text)
        return name

    assert text + "lm_head.weight" in weights  # transformers 5 saves the head there too
    save_file({hub(k): v for k, v in weights.items()}, copy / "model.safetensors")
    config = json.loads((copy / "config.json").read_text())
    config["tie_word_embeddings"] = True  # the checkpoint's own head still wins, as in HF
    (copy / "config.json").write_text(json.dumps(config))
    prompt = {"prompt": PROMPT, "multi_modal_data": {"image": noise_image(13, (40, 56))}}
    want, got = (
        engine(p).generate([prompt], greedy(), use_tqdm=False)[0].outputs[0] for p in (path, copy)
    )
    assert got.token_ids == want.token_ids
    assert got.logprobs == want.logprobs
