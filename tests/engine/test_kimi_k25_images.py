"""Images through Kimi K2.5 checkpoints (multimodal/kimi_k25.py, moonvit.py) against HF.

A tiny random `Kimi_K25ForConditionalGeneration` (its DeepSeek-V3 decoder: MLA with a q
bottleneck, YaRN, a dense layer before a grouped-router MoE layer, lm_head tied to the
embedding; a MoonViT tower of 4-pixel patches with a 4 x 4 learned position grid that every
test image resamples, 2-D rope, 2 x 2 merge blocks; images resized under a 48-patch budget and
12 patches a side, padded to 8 pixels, normalized by non-default means), saved by transformers
in the Hub's original names (fused wqkv in pairwise rope order, `blocks`, `norm0`):
`LLM.generate` with `multi_modal_data` must give HF's prompt ids (each <|media_pad|> repeated
once per merge block, as Kimi_K25Processor does) and HF `generate`'s greedy tokens and top-5
logprobs (1e-3, float32). transformers' Kimi_K25ImageProcessor needs torchvision: where it is
missing the engine's own processor (torch alone, through multimodal/torch_processors.py)
feeds both, its resize rule checked against transformers' navit_resize; where it imports, its
pixels must equal ours bit for bit. Then the engine's paths, TP=2, the server's chat path and
bad input.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import math
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
    hf_cases,
    hf_refs,
    noise_image,
)
from vlm_checkpoints import finish_checkpoint, load_hf_vlm

from paged_engine.multimodal.torch_processors import torchvision_available

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.kimi_k25")

IMAGE = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
PROMPT = f"<|im_start|>user\n{IMAGE}What is in it?<|im_end|>\n<|im_start|>assistant\n"
TWO = f"<|im_start|>user\n{IMAGE} and {IMAGE}Which is brighter?<|im_end|>\n<|im_start|>assistant\n"
TEXT = "<|im_start|>user\nSay something about the sea.<|im_end|>\n<|im_start|>assistant\n"
MEDIA = ["<|media_begin|>", "<|media_content|>", "<|media_pad|>", "<|media_end|>"]
VIDEO = "<|kimi_k25_video_placeholder|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}" + IMAGE + "{% elif part['type'] == 'text' %}"
    "{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PROCESSOR = {  # what Kimi_K25ImageProcessor saves, scaled down
    "image_processor_type": "Kimi_K25ImageProcessor",
    "size": {"max_height": 12, "max_width": 12},  # patches a side
    "max_patches": 48,
    "patch_size": 4,
    "merge_size": 2,
    "image_mean": [0.48, 0.45, 0.4],
    "image_std": [0.27, 0.26, 0.28],
    "resample": 3,
    "do_resize": True,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "do_convert_rgb": True,
}

HF_PROCESSOR = torchvision_available()


def write_tiny_kimi_k25(path: Path, seed: int = 0) -> Path:
    from paged_engine.testing import _COMMON, _save_random, build_tiny_tokenizer, tiny_config

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(seed=seed)
    tokenizer.add_special_tokens({"additional_special_tokens": [*MEDIA, VIDEO]})
    ids = tokenizer.convert_tokens_to_ids([*MEDIA, VIDEO])
    text = tiny_config("deepseek_v3", vocab_size=len(tokenizer), max_position_embeddings=512)
    text.rope_parameters["original_max_position_embeddings"] = 128  # YaRN x4
    text = text.to_dict()
    vision = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2}
    vision |= {"num_attention_heads": 2, "patch_size": 4, "pos_emb_height": 4}
    vision |= {"pos_emb_width": 4, "merge_kernel_size": [2, 2]}
    vision |= {"rope_parameters": {"rope_type": "axial", "rope_theta": 100.0}}
    config = transformers.Kimi_K25Config(
        text_config=text,
        vision_config=vision,
        projection_hidden_size=32,
        projection_layer_norm_eps=1e-4,
        image_token_id=ids[2],
        vision_start_token_id=ids[0],
        vision_end_token_id=ids[3],
        video_token_id=ids[4],  # (videos: test_kimi_k25_videos.py)
        **_COMMON,
    )
    _save_random(transformers.Kimi_K25ForConditionalGeneration, config, seed, path)
    (path / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    return finish_checkpoint(path, tokenizer, CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_kimi_k25(tmp_path_factory.mktemp("kimi-k25"), seed=4)


def _processor(path):
    from paged_engine.multimodal.kimi_k25 import KimiImageProcessor
    from paged_engine.multimodal.torch_processors import saved_settings

    config = transformers.AutoConfig.from_pretrained(path)
    return KimiImageProcessor(saved_settings(Path(path)), config)


def _one(processor, image) -> tuple[torch.Tensor, tuple[int, ...]]:
    """One image's (pixel values, grid) by our processor."""
    out = processor(images=[image], return_tensors="pt")
    return out["pixel_values"], tuple(out["image_grid_thw"][0].tolist())


def _hf_inputs(path, text: str, images: list) -> tuple[list[int], dict]:
    """Kimi_K25Processor's ids (each <|media_pad|> repeated per merge block of its image) and
    the pixels: transformers' image processor where it imports, else ours."""
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ids = tok.encode(text, add_special_tokens=False)
    if not images:
        return ids, {}
    if HF_PROCESSOR:
        out = transformers.AutoImageProcessor.from_pretrained(path)(images, return_tensors="pt")
    else:
        out = _processor(path)(images=images, return_tensors="pt")
    pixels, grids = out["pixel_values"], out["image_grid_thw"]
    pad = tok.convert_tokens_to_ids("<|media_pad|>")
    runs = iter(int(g.prod()) // 4 for g in grids)
    expanded: list[int] = []
    for t in ids:
        expanded += [t] * next(runs) if t == pad else [t]
    return expanded, {"pixel_values": pixels, "image_grid_thw": grids}


def _hf_model(path):
    return load_hf_vlm(transformers.Kimi_K25ForConditionalGeneration, path)


def test_images_match_hf(path):
    # 40 x 56: over the patch budget, scaled down, then padded; 70 x 20: capped at 12
    # patches a side; 13 x 9: padded up from 3 x 2
    cases = hf_cases(PROMPT, TEXT, TWO, ((40, 56), (70, 20), (13, 9)))
    refs = hf_refs(_hf_model(path), cases, lambda *case: _hf_inputs(path, *case))
    assert len(refs[0][0]) - len(refs[1][0]) != 0
    check_matches_hf(path, cases, refs, "kimi_k25")


def test_encoder_matches_hf_features(path):
    """The tower and projector alone: each image's rows equal HF's get_image_features (the
    position grid resampled to 6 x 10 and 12 x 4 patch grids, the merge blocks' order)."""
    from safetensors.torch import load_file

    from paged_engine.multimodal.inputs import ImageInput
    from paged_engine.multimodal.kimi_k25 import KimiImageEncoder

    model = _hf_model(path)
    config = transformers.AutoConfig.from_pretrained(path)
    ours = KimiImageEncoder(config)
    ours.load_weights(load_file(Path(path) / "model.safetensors").items())
    proc = _processor(path)
    done = [_one(proc, noise_image(5, (24, 40))), _one(proc, noise_image(6, (48, 16)))]
    assert [g for _, g in done] == [(1, 6, 10), (1, 12, 4)]
    images = [ImageInput(p, 0, g[1] * g[2] // 4, str(i), g) for i, (p, g) in enumerate(done)]
    with torch.no_grad():
        got = ours.encode(images)
        want = model.model.get_image_features(
            torch.cat([p for p, _ in done]), torch.tensor([g for _, g in done])
        ).pooler_output
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def _hf_function(module: str, name: str):
    """A function of a transformers module compiled from its source (the module imports
    torchvision)."""
    root = importlib.util.find_spec("transformers").submodule_search_locations[0]
    source = Path(root, "models", *module.split(".")).with_suffix(".py").read_text()
    node = next(
        n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == name
    )
    namespace = {"math": math}
    exec(compile(ast.Module(body=[node], type_ignores=[]), f"<{name}>", "exec"), namespace)
    return namespace[name]


def test_resize_rule_and_pixels_follow_transformers(path):
    from paged_engine.multimodal.kimi_k25 import navit_size

    hf = _hf_function("kimi_k25.image_processing_kimi_k25", "navit_resize")
    for h, w in [(40, 56), (70, 20), (13, 9), (3, 200), (1000, 1000), (56, 56), (9, 5)]:
        for patch, merge, budget, side in [(4, 2, 48, 12), (14, 2, 16384, 512), (14, 2, 64, 9)]:
            assert navit_size(h, w, patch, merge, budget, side) == hf(
                h, w, patch, merge, budget, side
            )
    if not HF_PROCESSOR:
        pytest.skip("transformers' Kimi_K25ImageProcessor needs torchvision")
    images = [noise_image(7, (40, 56)), noise_image(8, (13, 9)), noise_image(9, (32, 32))]
    images += [noise_image(10 + i, s) for i, s in enumerate([(1, 90), (90, 1), (200, 60)])]
    out = transformers.AutoImageProcessor.from_pretrained(path)(images, return_tensors="pt")
    ours = _processor(path)(images=images, return_tensors="pt")
    assert out["image_grid_thw"].tolist() == ours["image_grid_thw"].tolist()
    assert torch.equal(out["pixel_values"], ours["pixel_values"])  # bit for bit


def test_padding_and_normalization(path):
    """Without a resize (under the patch budget and the side cap) the pixels are the image's
    (x / 255 - mean) / std, padded right and bottom with zeros before the normalization, cut
    into row-major patches."""
    import numpy as np

    proc = _processor(path)
    mean = torch.tensor(PROCESSOR["image_mean"])[:, None, None]
    std = torch.tensor(PROCESSOR["image_std"])[:, None, None]
    for size, padded in [((16, 24), (16, 24)), ((13, 9), (16, 16))]:
        image = noise_image(10, size)
        pixels, grid = _one(proc, image)
        assert grid == (1, padded[0] // 4, padded[1] // 4)
        x = torch.zeros(3, *padded)
        x[:, : size[0], : size[1]] = torch.from_numpy(np.array(image)).permute(2, 0, 1).float()
        x = (x / 255 - mean) / std
        want = x.view(3, grid[1], 4, grid[2], 4).permute(1, 3, 0, 2, 4).reshape(-1, 3, 4, 4)
        torch.testing.assert_close(pixels, want)


def test_engine_paths_match_the_plain_run(path):
    """image_checks' paths (8-token chunks through the images, prefix-cache hits, images
    processed ahead); bad input a ValueError naming what is wrong, nothing lost."""
    prompts = [
        {"prompt": PROMPT, "multi_modal_data": {"image": noise_image(i, (24 + 8 * i, 40))}}
        for i in range(3)
    ] + [
        {
            "prompt": TWO,
            "multi_modal_data": {"image": [noise_image(7, (16, 48)), noise_image(8, (32, 32))]},
        }
    ]
    cached = check_engine_paths(path, prompts, TWO)
    one = noise_image(9, (20, 20))
    refused = [
        ({"prompt": TWO, "multi_modal_data": {"image": [one]}}, "2 image placeholder"),
        ({"prompt": PROMPT, "multi_modal_data": {"image": [one, one]}}, "1 image placeholder"),
        ({"prompt": PROMPT, "multi_modal_data": {"image": "a cat"}}, "PIL.Image.Image"),
        ({"prompt": PROMPT, "multi_modal_data": {"video": [one, one]}}, "one per video"),
    ]
    check_refused(path, cached, refused, prompts)


def test_tensor_parallel_matches_one_process(path):
    """TP=2: the tower on every rank, the decoder's heads and experts split."""
    prompts = [{"prompt": TWO, "multi_modal_data": {"image": [noise_image(11, (32, 48))] * 2}}]
    check_tensor_parallel(path, prompts, None, 8)


def test_chat_data_url_gives_the_offline_tokens(path):
    """The server's chat path: an image_url part with a data: URL gives the offline tokens and
    prompt (the chat template's <|media_pad|> expanded by the image's grid)."""
    question = [{"type": "image"}, {"type": "text", "text": "What is it?"}]
    want = check_chat_data_url(engine(path), question, noise_image(12, (40, 72)))
    assert want.text == PROMPT.replace("What is in it?", "What is it?")


def test_config_refusals(path):
    """What the path does not run is refused by the config field's name."""
    from paged_engine.multimodal.kimi_k25 import KimiImageEncoder, KimiImageProcessor

    config = transformers.AutoConfig.from_pretrained(path)
    cases = [
        ("merge_kernel_size", [2, 1], "merge_kernel_size"),
        ("pos_emb_width", 5, "pos_emb_width"),
    ]
    check_vision_fields_refused(path, cases, KimiImageEncoder)
    bad = transformers.AutoConfig.from_pretrained(path)
    bad.projection_hidden_size = 64
    with pytest.raises(ValueError, match="projection_hidden_size"):
        KimiImageEncoder(bad)
    with pytest.raises(ValueError, match="resample"):
        KimiImageProcessor({**PROCESSOR, "resample": 1}, config)  # LANCZOS
    with pytest.raises(ValueError, match="patch_size"):
        KimiImageProcessor({**PROCESSOR, "patch_size": 8}, config)
