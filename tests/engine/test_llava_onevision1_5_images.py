"""Images through LLaVA-OneVision-1.5 checkpoints (multimodal/llava_onevision1_5.py) against HF.

A tiny random `LlavaOnevision15ForConditionalGeneration`: testing.py's tiny Qwen3 decoder under
plain 1-D positions; the RICE-ViT tower (2 blocks, 4 heads of 8, LayerNorms of eps 1e-5, a class
row per image with its own rotary angles, 4-pixel patches merged 2 x 2, rope theta 100). The
tower's rows equal HF's image features (1e-5), loaded from the saved names and from
transformers' in-memory ones; `LLM.generate` with `multi_modal_data` must give
Exaone4_5_Processor's prompt ids (one <|image_pad|> per merged patch) and HF `generate`'s greedy
tokens and top-5 logprobs (1e-3, float32) for one image, two and none. Then the engine's paths
(chunks through images, prefix-cache hits, images processed ahead), bad input, the server's
chat path with a data: URL and refused configs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from image_checks import (
    check_chat_data_url,
    check_paths_and_refusals,
    check_processor_matches_hf,
    check_vision_fields_refused,
    engine,
    greedy,
    hf_cases,
    noise_image,
)
from vlm_checkpoints import (
    chatml_template,
    encoder_from_checkpoint,
    finish_checkpoint,
    load_hf_vlm,
    processor_without_video,
    save_grid_image_processor,
    tokenizer_with,
)

from paged_engine.testing import _ARCH_DEFAULTS, _COMMON, _save_random

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.llava_onevision1_5")

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPT = f"<|im_start|>user\n{IMAGE}What is in it? Tell me.<|im_end|>\n<|im_start|>assistant\n"
TWO = f"<|im_start|>user\n{IMAGE} and {IMAGE}Which is brighter?<|im_end|>\n<|im_start|>assistant\n"
TEXT = (
    "<|im_start|>user\nSay something about the sea, then more.<|im_end|>\n<|im_start|>assistant\n"
)
_SPECIAL = [
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
CHAT_TEMPLATE = chatml_template("<|vision_start|><|image_pad|><|vision_end|>")
_VISION = {
    "depth": 2,
    "hidden_size": 32,
    "num_heads": 4,
    "intermediate_size": 48,
    "out_hidden_size": 64,  # the text hidden size
    "patch_size": 4,
    "spatial_merge_size": 2,
    "hidden_act": "gelu",
    "layer_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "axial", "rope_theta": 100.0},
}


def write_tiny_llava_onevision1_5(path: Path, seed: int = 3) -> Path:
    """A tiny random `LlavaOnevision15ForConditionalGeneration` checkpoint with its image
    processor (Qwen2VLImageProcessorPil, one frame a patch: 4-pixel patches merged 2 x 2, 8 to
    48 merged patches an image) and tokenizer (the image tokens, a chat template)."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer, ids = tokenizer_with(_SPECIAL, seed)
    text = {**_ARCH_DEFAULTS["qwen3"][1], "model_type": "qwen3", "vocab_size": len(tokenizer)}
    text["max_position_embeddings"] = 1024  # the image tests' max_model_len 512
    config = transformers.LlavaOnevision15Config(
        text_config=text,
        vision_config=_VISION,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        **_COMMON,
    )
    _save_random(transformers.LlavaOnevision15ForConditionalGeneration, config, seed, path)
    # (patch x merge) ** 2 pixels a merged patch
    save_grid_image_processor(transformers.Qwen2VLImageProcessorPil, path, 1, (4 * 2) ** 2)
    return finish_checkpoint(path, tokenizer, CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> Path:
    return write_tiny_llava_onevision1_5(tmp_path_factory.mktemp("llava_onevision1_5"))


def _processor(path: Path):
    """HF's processor for llava_onevision1_5: Exaone4_5_Processor."""
    return processor_without_video(transformers.Exaone4_5_Processor, path)


def _model(path: Path):
    return load_hf_vlm(transformers.LlavaOnevision15ForConditionalGeneration, path)


def test_images_match_hf(path):
    cases = hf_cases(PROMPT, TEXT, TWO)  # the two images resized to the grid
    keys = ("pixel_values", "image_grid_thw")
    check_processor_matches_hf(
        path, _model(path), _processor(path), cases, keys, "llava_onevision1_5"
    )


def test_tower_matches_hf_features(path):
    """The encoder's rows equal HF's get_image_features (a class row per image), its weights
    read from the saved names and from transformers' in-memory ones (`cls_embeddings.*`,
    `merger.norm`, `merger.linear_fc{1,2}`) alike."""
    from safetensors.torch import load_file

    from paged_engine.multimodal.archs import build_encoder

    model = _model(path)
    images = [noise_image(20, (40, 56)), noise_image(21, (72, 24))]
    pixels = _processor(path).image_processor(images=images, return_tensors="pt")
    grids = [tuple(g) for g in pixels["image_grid_thw"].tolist()]
    with torch.no_grad():
        want = torch.cat(
            model.model.get_image_features(
                pixels["pixel_values"], pixels["image_grid_thw"]
            ).pooler_output
        )
    saved, in_memory = load_file(path / "model.safetensors"), model.state_dict()
    assert "visual.class_embedding" in saved and "visual.merger.mlp.0.weight" in saved
    assert "model.visual.cls_embeddings.class_embedding" in in_memory
    assert "model.visual.merger.linear_fc1.weight" in in_memory
    for weights in (saved, in_memory):
        encoder = build_encoder(model.config).float()
        encoder.load_weights(weights.items())
        with torch.no_grad():
            got = encoder.visual(pixels["pixel_values"], grids)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # two frames of one grid (a class row each, attention within each frame), as HF's tower
    t, h, w = grids[0]
    frames = pixels["pixel_values"][: t * h * w].repeat(2, 1)
    with torch.no_grad():
        want = model.model.visual(frames, torch.tensor([[2, h, w]])).pooler_output
        got = encoder.visual(frames, [(2, h, w)])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_engine_paths_match_the_plain_run(path):
    """image_checks' paths (8-token chunks through the images, prefix-cache hits, images
    processed ahead); bad input is a ValueError naming what is wrong, and the engine serves
    on; the image's features (vLLM's image_embeds with its grid) give the image's tokens."""
    cached = check_paths_and_refusals(path, PROMPT, TWO)
    one = noise_image(9, (20, 20))

    # vLLM's image features input: the tower's rows with their grid give the image's tokens
    processor = cached.llm_engine.input_processor.images
    _, (image,) = processor.process(cached.get_tokenizer().encode(PROMPT), [one])
    encoder = encoder_from_checkpoint(path, processor.config)
    with torch.no_grad():
        (rows,) = encoder.encode([image])
    features = {"image_embeds": rows, "image_grid_thw": torch.tensor([image.image_size])}
    want, got = (
        cached.generate(
            [{"prompt": PROMPT, "multi_modal_data": {"image": x}}], greedy(0), use_tqdm=False
        )[0]
        for x in (one, features)
    )
    assert got.prompt_token_ids == want.prompt_token_ids
    assert got.outputs[0].token_ids == want.outputs[0].token_ids


def test_chat_data_url_gives_the_offline_tokens(path):
    """The server's chat path: an image_url part with a data: URL gives the offline tokens and
    prompt (the chat template's <|image_pad|> expanded by the image's grid)."""
    question = [{"type": "image"}, {"type": "text", "text": "What is it?"}]
    want = check_chat_data_url(engine(path), question, noise_image(12, (40, 72)))
    assert want.text == PROMPT.replace("What is in it? Tell me.", "What is it?")


def test_config_refusals(path):
    """What the tower does not run as HF runs it is refused by the config field's name."""
    from paged_engine.multimodal.archs import build_encoder

    cases = [
        ("model_type", "qwen2_5_vl_vision", "model_type"),
        ("num_heads", 16, "divisible by 4"),  # head_dim 2: no row / column quarters
        ("rope_parameters", {"rope_type": "default", "rope_theta": 1.0}, "rope_type"),
        ("layer_norm_eps", 0.0, "layer_norm_eps"),
    ]
    check_vision_fields_refused(path, cases, build_encoder)


def test_two_frame_patches_are_refused(path, tmp_path):
    """An image processor cutting two frames a patch (Qwen2-VL's default temporal_patch_size)
    gives rows the tower cannot read: refused by that field's name, the engine serving on."""
    copy = tmp_path / "two_frames"
    shutil.copytree(path, copy)
    saved = copy / "preprocessor_config.json"
    settings = json.loads(saved.read_text())
    saved.write_text(json.dumps({**settings, "temporal_patch_size": 2}))
    llm = engine(copy)
    bad = {"prompt": PROMPT, "multi_modal_data": {"image": noise_image(14, (40, 56))}}
    with pytest.raises(ValueError, match="temporal_patch_size=2"):
        llm.generate([bad], greedy(0), use_tqdm=False)
    out = llm.generate([TEXT], greedy(0), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 8
