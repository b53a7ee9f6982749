"""Images through Inkling 2 checkpoints (multimodal/inkling2_vl.py) against HF.

A tiny random `Inkling2ForConditionalGeneration`: test_models_inkling2.py's decoder and a
2-layer tower of 4-pixel patches merged 2 x 2 (8-pixel cells), heads of 8 turned pairwise by
(col, row) at theta 100, a 3 x 3 position table resampled to each image's patch grid, class
tokens, the merger; images of 6 to 90 cells, padded. transformers'
Inkling2ImageProcessor needs torchvision: where it is missing the engine's torch copy gives the
pixels of both (checked against the processor's steps written out here, transparency over its
checkerboard included); HF's ids are Inkling2Processor's expansion (one image token per cell).
`LLM.generate` with `multi_modal_data` must give HF's prompt ids and HF `generate`'s greedy
tokens and top-5 logprobs (1e-3, float32); the encoder equals HF's image features (1e-5); then
the engine's paths (chunks through images, prefix-cache hits, images processed ahead), bad
input and refused vision fields.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from image_checks import (
    check_grid_encoder_matches_hf,
    check_matches_hf,
    check_paths_and_refusals,
    check_vision_fields_refused,
    hf_cases,
    hf_refs,
    noise_image,
)
from test_models_inkling2 import TEXT
from vlm_checkpoints import expand_image_tokens, finish_checkpoint, load_hf_vlm, tokenizer_with

from paged_engine.testing import _save_random

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.inkling2")

IMAGE = "<|unused_200054|>"
PROMPT = f"user: {IMAGE}What is in it? Tell me.\nassistant:"
TWO = f"user: {IMAGE} and {IMAGE}Which is brighter?\nassistant:"
TEXT_ONLY = "user: Say something about the sea, then more.\nassistant:"
VISION = {
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "patch_size": 4,
    "spatial_merge_size": 2,
    "posemb_grid_size": 3,
    "projection_hidden_dim": 24,
    "rope_parameters": {"rope_type": "axial", "rope_theta": 100.0},
}
PROCESSOR = {"image_processor_type": "Inkling2ImageProcessor", "size": {"height": 8, "width": 8}}


def write_tiny_inkling2_vl(path: Path, seed: int = 3) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tokenizer, ids = tokenizer_with([IMAGE], seed)
    config = transformers.Inkling2Config(
        text_config={**TEXT, "vocab_size": len(tokenizer)},
        vision_config={**VISION, "text_hidden_size": TEXT["hidden_size"]},
        image_token_id=ids[IMAGE],
    )
    _save_random(transformers.Inkling2ForConditionalGeneration, config, seed, path)
    (path / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    return finish_checkpoint(path, tokenizer, None)


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> Path:
    return write_tiny_inkling2_vl(tmp_path_factory.mktemp("inkling2_vl"))


def _processor():
    from paged_engine.multimodal.inkling2_vl import Inkling2TorchProcessor

    return Inkling2TorchProcessor(PROCESSOR)


def _hf_inputs(path: Path, text: str, images: list) -> tuple[list[int], dict]:
    """Inkling2Processor's ids (each image token -> one per cell) and the pixels (our
    processor's: transformers' needs torchvision)."""
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ids = tok.encode(text, add_special_tokens=False)
    if not images:
        return ids, {}
    out = _processor()(images=images)
    runs = (int(g.prod()) for g in out["image_grid_thw"])
    expanded = expand_image_tokens(ids, tok.convert_tokens_to_ids(IMAGE), runs)
    return expanded, {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


def _model(path: Path):
    return load_hf_vlm(transformers.Inkling2ForConditionalGeneration, path)


def test_images_match_hf(path):
    cases = hf_cases(PROMPT, TEXT_ONLY, TWO)
    refs = hf_refs(_model(path), cases, lambda *case: _hf_inputs(path, *case))
    check_matches_hf(path, cases, refs, "inkling2_vl")


def test_encoder_matches_hf_features(path):
    out = _processor()(images=[noise_image(20, (40, 56)), noise_image(21, (72, 24))])
    check_grid_encoder_matches_hf(path, _model(path), out)  # one token a cell


def test_processor_follows_transformers_steps():
    """Inkling2ImageProcessor's steps written out (pad with -1 on the 0-255 scale to whole
    cells, rescale, normalize, cells in raster order; RGBA over its checkerboard)."""
    from PIL import Image

    rgba = np.random.default_rng(5).integers(0, 256, (13, 19, 4), dtype=np.uint8)
    for image in (noise_image(4, (13, 19)), Image.fromarray(rgba, "RGBA")):
        x = torch.from_numpy(np.array(image)).permute(2, 0, 1).to(torch.int32)
        if x.shape[0] == 4:
            board = (torch.arange(13)[:, None] // 8 + torch.arange(19)[None, :] // 8) % 2
            bg = torch.where(board == 0, 204, 153)
            x = (x[:3] * x[3:] + bg * (255 - x[3:]) + 127) // 255
        padded = torch.full((3, 16, 24), -1.0)
        padded[:, :13, :19] = x.float()
        want = ((padded / 255 - 0.5) / 0.5).reshape(3, 2, 8, 3, 8).permute(1, 3, 2, 4, 0)
        out = _processor()(images=[image])
        assert out["image_grid_thw"].tolist() == [[1, 2, 3]]
        torch.testing.assert_close(out["pixel_values"], want.reshape(6, 8, 8, 3), atol=1e-6, rtol=0)


def test_engine_paths_match_the_plain_run(path):
    check_paths_and_refusals(path, PROMPT, TWO)


def test_config_refusals(path):
    from paged_engine.multimodal.archs import build_encoder

    cases = [
        ("model_type", "qwen2_5_vl_vision", "model_type"),
        ("rope_parameters", {"rope_type": "default", "rope_theta": 1.0}, "rope_type"),
        ("num_attention_heads", 3, "num_attention_heads=3"),
    ]
    check_vision_fields_refused(path, cases, build_encoder)
