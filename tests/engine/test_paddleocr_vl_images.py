"""PaddleOCR-VL (multimodal/paddleocr_vl.py, models/paddleocr_vl.py) against HF on tiny random
weights.

The tiny checkpoint: a SigLIP tower of 2 layers (width 32, 2 heads of 16: 4 rope frequencies per
axis, theta 100), 4-pixel patches, an 8 x 8 learned position grid resized to each image's patch
grid, LayerNorm eps 0.05, tanh GELU; the projector merging 2 x 2 patches. The decoder is ERNIE
4.5's with every projection biased (use_bias), head_dim 16 and NeoX-halves M-RoPE in unequal
sections 2, 3, 3 (so each axis's frequencies are told apart), theta 100. The image processor
(PaddleOCRVLImageProcessorPil) resizes to 256 - 4096 pixels in multiples of 8.

`LLM.generate` with `multi_modal_data` (one image, two, none) gives HF's processor's prompt ids
and HF `generate`'s greedy tokens and top-5 logprobs (1e-3, float32); our host side gives HF's
processor's ids, pixel values and get_rope_index table; the tower and projector give HF's image
features (1e-5) from transformers' names and from the Hub's, and those rows as vLLM's
image_embeds input give the images' tokens; the engine's paths (chunks through images,
prefix-cache hits, images processed ahead), bad input, refused configs, TP=2 and the server's
chat path with a data: URL.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from image_checks import (
    check_chat_data_url,
    check_engine_paths,
    check_grid_host_side_and_encoder,
    check_matches_hf,
    check_refused,
    check_tensor_parallel,
    check_vision_fields_refused,
    engine,
    grid_path_prompts,
    hf_cases,
    hf_refs,
    noise_image,
    processor_inputs,
    usual_refusals,
)
from vlm_checkpoints import finish_checkpoint, load_hf_vlm, tokenizer_with

from paged_engine.testing import _COMMON, _save_random

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.paddleocr_vl")

_START, _IMAGE, _END = "<|IMAGE_START|>", "<|IMAGE_PLACEHOLDER|>", "<|IMAGE_END|>"
SPECIAL = ["<|begin_of_sentence|>", _START, _IMAGE, _END, "<|video_pad|>"]
IMAGE = f"{_START}{_IMAGE}{_END}"
PROMPT = f"<|begin_of_sentence|>User: {IMAGE}OCR:\nAssistant: "
TWO = f"<|begin_of_sentence|>User: {IMAGE}{IMAGE}Compare them.\nAssistant: "
TEXT = "<|begin_of_sentence|>User: Say something about the sea.\nAssistant: "
# the Hub template's shape: the images first, then the texts, of each user turn
CHAT_TEMPLATE = (
    "<|begin_of_sentence|>{% for message in messages %}{% if message['role'] == 'user' %}"
    "User: {% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}" + IMAGE + ""
    "{% endif %}{% endfor %}{% for part in message['content'] %}{% if part['type'] == 'text' %}"
    "{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{{ '\\n' }}{% else %}Assistant: "
    "{{ message['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}Assistant: {% endif %}"
)
_TEXT_CONFIG = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "use_bias": True,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 100.0, "mrope_section": [2, 3, 3]},
    **_COMMON,
}
_VISION_CONFIG = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "image_size": 32,
    "patch_size": 4,
    "spatial_merge_size": 2,
    "layer_norm_eps": 0.05,
    "hidden_act": "gelu_pytorch_tanh",
    "rope_parameters": {"rope_type": "axial", "rope_theta": 100.0},
}


def write_tiny_paddleocr_vl(path: Path, seed: int = 0) -> Path:
    """A tiny random PaddleOCRVLForConditionalGeneration checkpoint with its PIL image
    processor (4-pixel patches merged 2 x 2; 256 to 4096 pixels an image) and tokenizer."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer, ids = tokenizer_with(SPECIAL, seed)
    config = transformers.PaddleOCRVLConfig(
        text_config={**_TEXT_CONFIG, "vocab_size": len(tokenizer)},
        vision_config=_VISION_CONFIG,
        image_token_id=ids[_IMAGE],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids[_START],
        vision_end_token_id=ids[_END],
        tie_word_embeddings=False,
        **_COMMON,
    )
    _save_random(transformers.PaddleOCRVLForConditionalGeneration, config, seed, path)
    transformers.PaddleOCRVLImageProcessorPil(
        patch_size=4, merge_size=2, temporal_patch_size=1, min_pixels=256, max_pixels=4096
    ).save_pretrained(path)
    return finish_checkpoint(path, tokenizer, CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def paddle_dir(tmp_path_factory) -> Path:
    return write_tiny_paddleocr_vl(tmp_path_factory.mktemp("paddleocr_vl"), seed=4)


@pytest.fixture(scope="module")
def hf_model(paddle_dir):
    return load_hf_vlm(transformers.PaddleOCRVLForConditionalGeneration, paddle_dir)


def _processor(path: Path):
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    tokenizer.image_token = _IMAGE
    tokenizer.image_token_id = tokenizer.convert_tokens_to_ids(_IMAGE)
    images = transformers.PaddleOCRVLImageProcessorPil.from_pretrained(path)
    return transformers.PaddleOCRVLProcessor(image_processor=images, tokenizer=tokenizer)


def _hf_inputs(processor, text: str, images: list) -> tuple[list[int], dict]:
    keys = ("pixel_values", "image_grid_thw", "mm_token_type_ids")
    return processor_inputs(processor, text, images, keys)


def test_paddleocr_vl_matches_hf(paddle_dir, hf_model):
    processor = _processor(paddle_dir)
    cases = hf_cases(PROMPT, TEXT, TWO)
    refs = hf_refs(hf_model, cases, lambda *case: _hf_inputs(processor, *case))
    check_matches_hf(paddle_dir, cases, refs, "paddleocr_vl")


def test_paddleocr_vl_host_side_and_encoder_match_hf(paddle_dir, hf_model):
    """Our processing gives HF's processor's ids and pixel values (flattened per patch) and
    get_rope_index's table and delta; the encoder's rows equal HF's image features (1e-5),
    loaded from transformers' names and from the Hub's (`visual.vision_model.`, `mlp_AR.`,
    with the SigLIP head and packing table transformers ignores); those rows as image_embeds
    (with image_grid_thw) give the images' tokens."""
    from safetensors.torch import load_file

    from paged_engine.multimodal.archs import build_encoder

    images = [noise_image(20, (40, 56)), noise_image(21, (72, 24))]
    ids, extra = _hf_inputs(_processor(paddle_dir), TWO, images)
    weights = load_file(paddle_dir / "model.safetensors")
    hub = {
        k.replace("model.visual.", "visual.")
        .replace("model.projector.", "mlp_AR.")
        .replace("model.language_model.", "model."): v
        for k, v in weights.items()
    }
    hub["visual.vision_model.head.probe"] = torch.zeros(1, 1, 32)
    hub["visual.vision_model.embeddings.packing_position_embedding.weight"] = torch.zeros(4, 32)
    pixels = extra["pixel_values"].flatten(1)  # our rows: HF's [h*w, C, p, p] flattened
    check_grid_host_side_and_encoder(
        engine(paddle_dir), hf_model, TWO, images, ids, extra, pixels, [weights, hub], build_encoder
    )


def test_paddleocr_vl_engine_paths(paddle_dir):
    """image_checks' paths (8-token chunks through the images and their M-RoPE rows,
    prefix-cache hits, images processed ahead); bad input is a ValueError naming what is
    wrong, and the engine serves on."""
    prompts = grid_path_prompts(PROMPT, TWO)
    cached = check_engine_paths(paddle_dir, prompts, TWO)
    one = noise_image(10, (32, 32))
    refused = usual_refusals(PROMPT, TWO, one, bare=True)
    check_refused(paddle_dir, cached, refused, prompts)


def test_paddleocr_vl_refused_configs(paddle_dir):
    from paged_engine.multimodal.archs import build_encoder
    from paged_engine.multimodal.paddleocr_vl import PaddleOCRLayout

    def config():
        return transformers.AutoConfig.from_pretrained(paddle_dir)

    cases = [
        ("model_type", "siglip_vision_model", r"vision_config\.model_type='siglip_vision_model'"),
        ("image_size", 30, r"vision_config\.image_size=30"),
        ("rope_parameters", {"rope_type": "yarn"}, r"rope_parameters\.rope_type='yarn'"),
    ]
    check_vision_fields_refused(paddle_dir, cases, build_encoder)
    bad = config()
    bad.text_config.rope_parameters = {"rope_type": "default", "rope_theta": 100.0}
    with pytest.raises(ValueError, match="mrope_section=None"):
        PaddleOCRLayout(bad, 0, None)
    layout = PaddleOCRLayout(config(), 0, None)
    with pytest.raises(ValueError, match=r"image_size \(2, 4, 4\) is not \(1, h, w\)"):
        layout.length((2, 4, 4))
    with pytest.raises(ValueError, match=r"multiples of vision_config\.spatial_merge_size 2"):
        layout.length((1, 4, 5))


def test_paddleocr_vl_chat_data_url(paddle_dir):
    """The server's chat path with an image_url data: URL gives the offline prompt and tokens."""
    question = [{"type": "image"}, {"type": "text", "text": "OCR:"}]
    want = check_chat_data_url(engine(paddle_dir), question, noise_image(12, (40, 72)))
    assert want.text == PROMPT


def test_paddleocr_vl_tensor_parallel(paddle_dir):
    """TP=2 (the encoder on every rank, the decoder's heads split, each rank rotating by the
    prompt's M-RoPE table; 8-token chunks through the images) gives the one-process tokens and
    top-5 logprobs."""
    prompts = [{"prompt": TWO, "multi_modal_data": {"image": [noise_image(11, (32, 48))] * 2}}]
    check_tensor_parallel(paddle_dir, prompts, 8)
