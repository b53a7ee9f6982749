"""Images through EXAONE 4.5 checkpoints (multimodal/exaone4_5.py) against HF.

A tiny random `Exaone4_5_ForConditionalGeneration`: EXAONE 4.0's decoder as testing.py's tiny
exaone4 (post-norms, q / k norms, sliding layers with window 8 < the prompts beside global NoPE
ones, Llama 3 rope scaling) under plain 1-D positions; Qwen2.5-VL's tower with grouped-query
attention (4 query heads over 2 key / value heads), 4-pixel patches merged 2 x 2, windows of
2 x 2 merged tokens in blocks 0 and 2 beside a full-attention block 1 (the images are wider
than a window, so windows split them, edges partial), rope theta 100. The tower's rows equal
HF's image features (1e-5); `LLM.generate` with `multi_modal_data` must give Exaone4_5_Processor's
prompt ids (one <|image_pad|> per merged patch) and HF `generate`'s greedy tokens and top-5
logprobs (1e-3, float32). Then the engine's paths (chunks through images, prefix-cache hits,
images processed ahead), bad input, TP=2, the server's chat path with a data: URL, refused
configs and the Hub's `mtp.*` tensors passed over.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from image_checks import (
    check_chat_data_url,
    check_paths_and_refusals,
    check_processor_matches_hf,
    check_tensor_parallel,
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

from paged_engine.testing import _ARCH_DEFAULTS, _COMMON, _save_random

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.exaone4_5")

IMAGE = "<vision><|image_pad|></vision>"
PROMPT = f"[|user|]{IMAGE}What is in it? Tell me.[|endofturn|]\n[|assistant|]"
TWO = f"[|user|]{IMAGE} and {IMAGE}Which is brighter?[|endofturn|]\n[|assistant|]"
TEXT = "[|user|]Say something about the sea, then more.[|endofturn|]\n[|assistant|]"
_SPECIAL = [
    "[|user|]",
    "[|assistant|]",
    "[|endofturn|]",
    "<vision>",
    "</vision>",
    "<|image_pad|>",
    "<|video_pad|>",
]
CHAT_TEMPLATE = (
    "{% for message in messages %}[|{{ message['role'] }}|]"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<vision><|image_pad|></vision>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}[|endofturn|]\n{% endfor %}"
    "{% if add_generation_prompt %}[|assistant|]{% endif %}"
)
_VISION = {
    "depth": 3,
    "hidden_size": 32,
    "num_heads": 4,
    "num_key_value_heads": 2,  # grouped-query: two query heads per key / value head
    "intermediate_size": 48,
    "out_hidden_size": 64,  # the text hidden size
    "patch_size": 4,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 16,  # 2 x 2 merged tokens
    "fullatt_block_indexes": [1],
    "hidden_act": "silu",
    "rope_parameters": {"rope_type": "axial", "rope_theta": 100.0},
}


def write_tiny_exaone4_5(path: Path, seed: int = 3) -> Path:
    """A tiny random `Exaone4_5_ForConditionalGeneration` checkpoint with its image processor
    (Qwen2VLImageProcessorPil: 4-pixel patches merged 2 x 2, 8 to 48 merged patches an image)
    and tokenizer (the image tokens, a chat template)."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer, ids = tokenizer_with(_SPECIAL, seed)
    text = {**_ARCH_DEFAULTS["exaone4"][1], "model_type": "exaone4", "vocab_size": len(tokenizer)}
    text["max_position_embeddings"] = 1024  # the image tests' max_model_len 512
    config = transformers.Exaone4_5_Config(
        text_config=text,
        vision_config=_VISION,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        **_COMMON,
    )
    _save_random(transformers.Exaone4_5_ForConditionalGeneration, config, seed, path)
    save_grid_image_processor(transformers.Qwen2VLImageProcessorPil, path, 2, 2 * 4 * 4)
    return finish_checkpoint(path, tokenizer, CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> Path:
    return write_tiny_exaone4_5(tmp_path_factory.mktemp("exaone4_5"))


def _processor(path: Path):
    return processor_without_video(transformers.Exaone4_5_Processor, path)


def _model(path: Path):
    return load_hf_vlm(transformers.Exaone4_5_ForConditionalGeneration, path)


def test_images_match_hf(path):
    cases = hf_cases(PROMPT, TEXT, TWO)  # the two images resized to the grid
    keys = ("pixel_values", "image_grid_thw")
    check_processor_matches_hf(path, _model(path), _processor(path), cases, keys, "exaone4_5")


def test_tower_matches_hf_features(path):
    """The encoder's rows equal HF's get_image_features (grouped-query heads, windows)."""
    model = _model(path)
    images = [noise_image(20, (40, 56)), noise_image(21, (72, 24))]
    pixels = _processor(path).image_processor(images=images, return_tensors="pt")
    encoder = encoder_from_checkpoint(path, model.config)
    grids = [tuple(g) for g in pixels["image_grid_thw"].tolist()]
    with torch.no_grad():
        want = model.model.get_image_features(pixels["pixel_values"], pixels["image_grid_thw"])
        got = encoder.visual(pixels["pixel_values"], grids)
    torch.testing.assert_close(got, torch.cat(want.pooler_output), atol=1e-5, rtol=0)


def test_engine_paths_match_the_plain_run(path):
    """image_checks' paths (8-token chunks through the images, prefix-cache hits, images
    processed ahead); bad input is a ValueError naming what is wrong, and the engine serves
    on."""
    check_paths_and_refusals(path, PROMPT, TWO)


def test_tensor_parallel_matches_one_process(path):
    """TP=2: the tower on every rank, the decoder's heads split."""
    prompts = [{"prompt": TWO, "multi_modal_data": {"image": [noise_image(11, (60, 30))] * 2}}]
    check_tensor_parallel(path, prompts, None, 8)


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
        ("num_key_value_heads", 3, "num_key_value_heads=3"),
        ("model_type", "qwen2_5_vl_vision", "model_type"),
        ("window_size", 4, "window_size=4"),
    ]
    check_vision_fields_refused(path, cases, build_encoder)


def test_mtp_head_is_passed_over(path, tmp_path):
    """The Hub's multi-token-prediction tensors (`mtp.*`, which transformers ignores at load)
    are not loaded: the checkpoint with them serves the same tokens."""
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "with_mtp"
    shutil.copytree(path, copy)
    weights = load_file(copy / "model.safetensors")
    weights["mtp.fc.weight"] = torch.ones(64, 128)
    weights["mtp.layers.0.input_layernorm.weight"] = torch.ones(64)
    save_file(weights, copy / "model.safetensors", metadata={"format": "pt"})
    prompt = {"prompt": PROMPT, "multi_modal_data": {"image": noise_image(13, (40, 56))}}
    want, got = (engine(p).generate([prompt], greedy(0), use_tqdm=False)[0] for p in (path, copy))
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
