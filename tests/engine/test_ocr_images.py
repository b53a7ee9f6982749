"""Images through the OCR checkpoints vLLM users serve, against HF on tiny random weights.

GLM-OCR (multimodal/glm_ocr.py): GLM-4.1V's host side (test_glm4v_images.py's prompts, chat
template and processor) with its own tower: no position grid, q / k RMSNorms per head, qkv /
proj / MLP biases, the MLP of width intermediate_size, the merger's of out_hidden_size * 3,
axial rope of theta 100; RMSNorm eps 0.05 (the merger's LayerNorm keeps 1e-5). Its decoder is
GLM-4's without q / k / v biases and a head_dim (32) other than hidden / heads (16), M-RoPE
sections 2, 1, 1 of 8 rotary frequencies; the checkpoint carries an extra (MTP) layer, passed
over as transformers does.

Each wrapper: `LLM.generate` with `multi_modal_data` gives HF's processor's prompt ids and HF
`generate`'s greedy tokens and top-5 logprobs (1e-3, float32); the tower's rows equal HF's image
features (1e-5); the engine's paths (chunks through images, prefix-cache hits, images processed
ahead), TP=2, the server's chat path with a data: URL, bad input and refused configs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from image_checks import (
    check_chat_data_url,
    check_engine_paths,
    check_matches_hf,
    check_refused,
    check_tensor_parallel,
    check_vision_fields_refused,
    engine,
    greedy,
    grid_path_prompts,
    hf_cases,
    hf_refs,
    noise_image,
    processor_inputs,
    usual_refusals,
)
from vlm_checkpoints import (
    finish_checkpoint,
    load_hf_vlm,
    save_grid_image_processor,
    tokenizer_with,
)

from paged_engine.testing import _COMMON, _save_random

transformers = pytest.importorskip("transformers")


def _glm():
    """test_glm4v_images' prompts and processor (GLM-OCR's host side is GLM-4.1V's)."""
    pytest.importorskip("transformers.models.glm_ocr")
    import test_glm4v_images as glm4v

    return glm4v


_GLM_TEXT = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,  # not hidden / heads: read as given
    "attention_bias": True,  # a config may say so: the attention has no biases whatever it says
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    # 16 of 32 dims rotate: 8 frequencies in sections 2, 1, 1 (x2: HF repeats each)
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 100.0,
        "partial_rotary_factor": 0.5,
        "mrope_section": [4, 2, 2],
    },
    **_COMMON,
}
_GLM_VISION = {
    "depth": 2,
    "hidden_size": 32,
    "num_heads": 2,
    "intermediate_size": 48,  # the blocks' MLP width
    "out_hidden_size": 64,  # the text hidden size; the merger's width is 3x it
    "image_size": 16,
    "patch_size": 4,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "rms_norm_eps": 0.05,
    "hidden_act": "silu",
    "attention_bias": True,
    "rope_parameters": {"rope_type": "axial", "rope_theta": 100.0},
}


def write_tiny_glm_ocr(path: Path, seed: int = 0) -> Path:
    """A tiny random GlmOcrForConditionalGeneration checkpoint with GLM-4.1V's image processor
    (4-pixel patches merged 2 x 2, 8 to 48 merged patches an image) and tokenizer, and a
    layer past num_hidden_layers (the Hub's MTP layer, which transformers ignores)."""
    from safetensors.torch import load_file, save_file

    glm4v = _glm()
    path.mkdir(parents=True, exist_ok=True)
    tokenizer, ids = tokenizer_with(glm4v._SPECIAL, seed)
    config = transformers.GlmOcrConfig(
        text_config={**_GLM_TEXT, "vocab_size": len(tokenizer)},
        vision_config=_GLM_VISION,
        image_token_id=ids["<|image|>"],
        video_token_id=ids["<|video|>"],
        image_start_token_id=ids["<|begin_of_image|>"],
        image_end_token_id=ids["<|end_of_image|>"],
        video_start_token_id=ids["<|begin_of_video|>"],
        video_end_token_id=ids["<|end_of_video|>"],
        **_COMMON,
    )
    _save_random(transformers.GlmOcrForConditionalGeneration, config, seed, path)
    weights = load_file(path / "model.safetensors")
    mtp = "model.language_model.layers.2."
    weights |= {mtp + "eh_proj.weight": torch.randn(64, 128), mtp + "enorm.weight": torch.ones(64)}
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    image_cls = getattr(transformers, "Glm4vImageProcessorPil", transformers.Glm4vImageProcessor)
    save_grid_image_processor(image_cls, path, 2, 2 * 4 * 4)
    return finish_checkpoint(path, tokenizer, glm4v.CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def glm_ocr_dir(tmp_path_factory) -> Path:
    return write_tiny_glm_ocr(tmp_path_factory.mktemp("glm_ocr"), seed=3)


def _glm_model(path: Path):
    return load_hf_vlm(transformers.GlmOcrForConditionalGeneration, path)


def test_glm_ocr_matches_hf(glm_ocr_dir):
    glm4v = _glm()
    model = _glm_model(glm_ocr_dir)
    processor = glm4v._processor(glm_ocr_dir)
    cases = hf_cases(glm4v.PROMPT, glm4v.TEXT, glm4v.TWO)
    refs = hf_refs(model, cases, lambda *case: glm4v._hf_inputs(processor, *case))
    check_matches_hf(glm_ocr_dir, cases, refs, "glm_ocr")


def test_glm_ocr_tower_matches_hf_features(glm_ocr_dir):
    from safetensors.torch import load_file

    from paged_engine.multimodal.archs import build_encoder

    glm4v = _glm()
    model = _glm_model(glm_ocr_dir)
    images = [noise_image(20, (40, 56)), noise_image(21, (72, 24))]
    pixels = glm4v._processor(glm_ocr_dir).image_processor(images=images, return_tensors="pt")
    encoder = build_encoder(model.config).float()
    encoder.load_weights(load_file(glm_ocr_dir / "model.safetensors").items())
    grids = [tuple(g) for g in pixels["image_grid_thw"].tolist()]
    with torch.no_grad():
        want = model.model.get_image_features(pixels["pixel_values"], pixels["image_grid_thw"])
        got = encoder.visual(pixels["pixel_values"], grids)
    torch.testing.assert_close(got, torch.cat(want.pooler_output), atol=1e-5, rtol=0)


def test_glm_ocr_engine_paths(glm_ocr_dir):
    """image_checks' paths (8-token chunks through the images, prefix-cache hits, images
    processed ahead); bad input is a ValueError naming what is wrong."""
    glm4v = _glm()
    prompts = grid_path_prompts(glm4v.PROMPT, glm4v.TWO, narrow=8)
    cached = check_engine_paths(glm_ocr_dir, prompts, glm4v.TWO)
    one = noise_image(10, (32, 32))
    for bad, match in [
        ({"prompt": glm4v.TWO, "multi_modal_data": {"image": one}}, "2 image placeholder"),
        ({"prompt": glm4v.PROMPT, "multi_modal_data": {"image": "a cat"}}, "PIL.Image.Image"),
        ({"prompt": glm4v.PROMPT, "multi_modal_data": {"video": [one]}}, "takes no videos"),
    ]:
        with pytest.raises(ValueError, match=match):
            cached.generate([bad], greedy(0), use_tqdm=False)
    assert len(cached.generate([prompts[0]], greedy(0), use_tqdm=False)[0].outputs[0].token_ids)


def test_glm_ocr_refused_configs(glm_ocr_dir):
    from paged_engine.multimodal.archs import build_encoder

    config = transformers.AutoConfig.from_pretrained(glm_ocr_dir)
    config.vision_config.rope_parameters = {"rope_type": "yarn", "rope_theta": 100.0}
    with pytest.raises(ValueError, match=r"vision_config\.rope_parameters\.rope_type='yarn'"):
        build_encoder(config)
    config = transformers.AutoConfig.from_pretrained(glm_ocr_dir)
    config.vision_config.model_type = "glm4v_vision"
    with pytest.raises(ValueError, match=r"vision_config\.model_type='glm4v_vision'"):
        build_encoder(config)


def test_glm_ocr_chat_data_url(glm_ocr_dir):
    """The server's chat path with an image_url data: URL gives the offline prompt and tokens."""
    question = [{"type": "image"}, {"type": "text", "text": "Read it."}]
    want = check_chat_data_url(engine(glm_ocr_dir), question, noise_image(12, (40, 72)))
    assert want.text == _glm().PROMPT.replace("What is in it? Tell me.", "Read it.")


# HunyuanOCR (multimodal/hunyuan_vl.py, models/hunyuan_vl.py): head_dim 32 split into four rope
# axes of 2, 6, 4, 4 frequencies (unequal, so each axis's dims are told apart) turned by the
# NTK-alpha base (theta 100, alpha 4); an 8 x 8 learned position grid bilinearly resized to
# each image's patch grid; LayerNorm / RMSNorm eps 0.05; exact GELU; q / k / v / o biases in the
# decoder.
_HY_IMAGE, _HY_START, _HY_END = "<hy_image>", "<hy_start>", "<hy_end>"
HY_SPECIAL = ["<|user|>", "<|assistant|>", _HY_START, _HY_IMAGE, _HY_END, "<hy_newline>"]
HY_IMAGE = f"{_HY_START}{_HY_IMAGE}{_HY_END}"
HY_PROMPT = f"<|user|>{HY_IMAGE}Read the text.<|assistant|>"
HY_TWO = f"<|user|>{HY_IMAGE} and {HY_IMAGE}Compare them.<|assistant|>"
HY_TEXT = "<|user|>Say something about the sea.<|assistant|>"
HY_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}" + HY_IMAGE + "{% elif part['type'] == 'text' %}"
    "{{ part['text'] }}{% endif %}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_HY_TEXT_CONFIG = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 512,
    "attention_bias": True,
    "tie_word_embeddings": False,
    "rope_parameters": {
        "rope_type": "xdrope",
        "rope_theta": 100.0,  # base 100 * 4 ** (32 / 30): the image ordinal's dims turn
        "alpha": 4.0,
        "factor": 1.0,
        "mrope_section": [2, 6, 4, 4],
    },
    **_COMMON,
}
_HY_VISION = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "patch_size": 4,
    "spatial_merge_size": 2,
    "max_image_size": 32,  # an 8 x 8 position grid
    "rms_norm_eps": 0.05,
    "hidden_act": "gelu",
}


def _hunyuan():
    pytest.importorskip("transformers.models.hunyuan_vl")


def write_tiny_hunyuan_vl(path: Path, seed: int = 0) -> Path:
    """A tiny random HunYuanVLForConditionalGeneration checkpoint with its PIL image processor
    (4-pixel patches merged 2 x 2; 256 to 4096 pixels an image) and tokenizer."""
    _hunyuan()
    path.mkdir(parents=True, exist_ok=True)
    tokenizer, ids = tokenizer_with(HY_SPECIAL, seed)
    config = transformers.HunYuanVLConfig(
        text_config={**_HY_TEXT_CONFIG, "vocab_size": len(tokenizer)},
        vision_config=_HY_VISION,
        image_token_id=ids[_HY_IMAGE],
        im_start_id=ids[_HY_START],
        im_end_id=ids[_HY_END],
        im_newline_id=ids["<hy_newline>"],
        tie_word_embeddings=False,
        **_COMMON,
    )
    _save_random(transformers.HunYuanVLForConditionalGeneration, config, seed, path)
    transformers.HunYuanVLImageProcessorPil(
        patch_size=4, merge_size=2, temporal_patch_size=1, min_pixels=256, max_pixels=4096
    ).save_pretrained(path)
    return finish_checkpoint(path, tokenizer, HY_TEMPLATE)


@pytest.fixture(scope="module")
def hunyuan_dir(tmp_path_factory) -> Path:
    return write_tiny_hunyuan_vl(tmp_path_factory.mktemp("hunyuan_vl"), seed=5)


def _hy_processor(path: Path):
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    for attr, token in (
        ("image_token", _HY_IMAGE),
        ("image_start_token", _HY_START),
        ("image_end_token", _HY_END),
    ):
        setattr(tokenizer, attr, token)
        setattr(tokenizer, f"{attr}_id", tokenizer.convert_tokens_to_ids(token))
    images = transformers.HunYuanVLImageProcessorPil.from_pretrained(path)
    return transformers.HunYuanVLProcessor(image_processor=images, tokenizer=tokenizer)


def _hy_inputs(processor, text: str, images: list) -> tuple[list[int], dict]:
    keys = ("pixel_values", "image_grid_thw", "mm_token_type_ids")
    return processor_inputs(processor, text, images, keys)


def _hy_model(path: Path):
    return load_hf_vlm(transformers.HunYuanVLForConditionalGeneration, path)


def test_hunyuan_vl_matches_hf(hunyuan_dir):
    model = _hy_model(hunyuan_dir)
    processor = _hy_processor(hunyuan_dir)
    cases = hf_cases(HY_PROMPT, HY_TEXT, HY_TWO)
    refs = hf_refs(model, cases, lambda *case: _hy_inputs(processor, *case))
    check_matches_hf(hunyuan_dir, cases, refs, "hunyuan_vl")


def test_hunyuan_vl_tower_and_positions_match_hf(hunyuan_dir):
    """The encoder's rows equal HF's image features (1e-5); the packed table unpacks to HF's
    get_rope_index."""
    from safetensors.torch import load_file

    from paged_engine.layers.rotary import RotaryEmbedding
    from paged_engine.models.hunyuan_vl import XdRotaryEmbedding
    from paged_engine.multimodal.archs import build_encoder

    model = _hy_model(hunyuan_dir)
    processor = _hy_processor(hunyuan_dir)
    images = [noise_image(20, (40, 56)), noise_image(21, (72, 24))]
    pixels = processor.image_processor(images=images, return_tensors="pt")
    encoder = build_encoder(model.config).float()
    encoder.load_weights(load_file(hunyuan_dir / "model.safetensors").items())
    grids = pixels["image_grid_thw"].tolist()
    rows = pixels["pixel_values"].split([t * h * w for t, h, w in grids])
    with torch.no_grad():
        want = model.model.get_image_features(pixels["pixel_values"], pixels["image_grid_thw"])
        got = [encoder.vision_tower(r, tuple(g)) for r, g in zip(rows, grids, strict=True)]
    torch.testing.assert_close(torch.cat(got), torch.cat(want.pooler_output), atol=1e-5, rtol=0)

    ids, extra = _hy_inputs(processor, HY_TWO, images)
    want, delta = model.model.get_rope_index(
        torch.tensor([ids]), extra["mm_token_type_ids"], extra["image_grid_thw"]
    )
    llm = engine(hunyuan_dir)
    images_proc = llm.llm_engine.input_processor.images
    expanded, done = images_proc.process(llm.get_tokenizer().encode(HY_TWO), images)
    assert expanded == ids
    table = images_proc.positions(len(ids), done)
    sections = _HY_TEXT_CONFIG["rope_parameters"]["mrope_section"]
    rope = XdRotaryEmbedding(RotaryEmbedding(32, 32, 512, 100.0), sections)
    assert rope.axes(torch.from_numpy(table.table)).tolist() == want[:, 0].tolist()
    assert table.delta == int(delta)


def test_hunyuan_vl_engine_paths(hunyuan_dir):
    """image_checks' paths (8-token chunks through the images and their packed positions,
    prefix-cache hits, images processed ahead); bad input is a ValueError naming what is
    wrong (more images than placeholders, over limit_mm_per_prompt, not an image, a video),
    and the engine serves on."""
    prompts = grid_path_prompts(HY_PROMPT, HY_TWO)
    cached = check_engine_paths(hunyuan_dir, prompts, HY_TWO)
    one = noise_image(10, (32, 32))
    refused = usual_refusals(HY_PROMPT, HY_TWO, one, bare=True)
    check_refused(hunyuan_dir, cached, refused, prompts)


def test_hunyuan_vl_refused_configs(hunyuan_dir):
    from paged_engine.layers.rotary import RotaryEmbedding
    from paged_engine.models.hunyuan_vl import XdRotaryEmbedding
    from paged_engine.multimodal.archs import build_encoder

    cases = [
        ("temporal_patch_size", 2, r"vision_config\.temporal_patch_size=2"),
        ("max_image_size", 30, r"vision_config\.max_image_size=30"),
        ("interpolate_mode", "area", r"vision_config\.interpolate_mode='area'"),
    ]
    check_vision_fields_refused(hunyuan_dir, cases, build_encoder)
    with pytest.raises(ValueError, match=r"mrope_section=\[8, 8\]"):
        XdRotaryEmbedding(RotaryEmbedding(32, 32, 64, 100.0), [8, 8])
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        XdRotaryEmbedding(RotaryEmbedding(32, 16, 64, 100.0), [2, 2, 2, 2])


def test_hunyuan_vl_chat_data_url(hunyuan_dir):
    question = [{"type": "image"}, {"type": "text", "text": "What does it say?"}]
    want = check_chat_data_url(engine(hunyuan_dir), question, noise_image(12, (40, 72)))
    assert want.text == HY_PROMPT.replace("Read the text.", "What does it say?")


@pytest.mark.parametrize("arch", ["glm_ocr", "hunyuan_vl"])
def test_tensor_parallel_matches_one_process(request, arch):
    """TP=2 (the tower on every rank, the decoder's heads split, each rank rotating by the
    prompt's multi-axis positions) gives the one-process tokens and top-5 logprobs."""
    if arch == "glm_ocr":
        path, two = request.getfixturevalue("glm_ocr_dir"), _glm().TWO
    else:
        path, two = request.getfixturevalue("hunyuan_dir"), HY_TWO
    prompts = [{"prompt": two, "multi_modal_data": {"image": [noise_image(11, (32, 48))] * 2}}]
    check_tensor_parallel(path, prompts, None, 8)
