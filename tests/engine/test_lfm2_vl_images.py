"""Images through LFM2-VL checkpoints (multimodal/lfm2_vl.py) against HF.

A tiny random `Lfm2VlForConditionalGeneration` (its LFM2 decoder: short-conv and attention
layers; a SigLIP2 NaFlex tower of 4-pixel patches whose 4 x 4 position table every view
resizes, up and down; pixel unshuffle by 2, a LayerNorm'd projector MLP with biases; images
smart-resized between 4 and 12 tokens, Python's round on the way, split past 1.5x into 2..4
tiles of 24 pixels plus a thumbnail, normalized by non-default means): `LLM.generate` with
`multi_modal_data` must give HF's prompt ids (Lfm2VlProcessor's <|image_start|>, tile and
thumbnail tokens and runs) and HF `generate`'s greedy tokens and top-5 logprobs (1e-3,
float32). transformers' Lfm2VlImageProcessor needs torchvision: where it is missing the
engine's own processor (torch alone) feeds both, its resize / split rules checked against
transformers' own methods and the prompt against Lfm2VlProcessor's builder. Then the tower
against get_image_features (padded batch), the engine's paths, TP=2, the server's chat path
and bad input.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
import math
from pathlib import Path
from types import SimpleNamespace

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
    usual_refusals,
)
from vlm_checkpoints import finish_checkpoint, load_hf_vlm

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.lfm2_vl")

PROMPT = "<|im_start|>user\n<image>What is in it?<|im_end|>\n<|im_start|>assistant\n"
TWO = "<|im_start|>user\n<image> and <image>Which is brighter?<|im_end|>\n<|im_start|>assistant\n"
TEXT = "<|im_start|>user\nSay something about the sea.<|im_end|>\n<|im_start|>assistant\n"
MARKS = ["<image>", "<|image_start|>", "<|image_end|>", "<|img_thumbnail|>"]
TILES = [f"<|img_row_{r}_col_{c}|>" for r in range(1, 5) for c in range(1, 5)]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% elif part['type'] == 'text' %}"
    "{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PROCESSOR = {  # what Lfm2VlImageProcessor saves, scaled down
    "image_processor_type": "Lfm2VlImageProcessor",
    "downsample_factor": 2,
    "do_image_splitting": True,
    "min_tiles": 2,
    "max_tiles": 4,
    "use_thumbnail": True,
    "min_image_tokens": 4,
    "max_image_tokens": 12,
    "encoder_patch_size": 4,
    "tile_size": 24,
    "max_pixels_tolerance": 1.5,
    "resample": 2,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.48, 0.45, 0.4],
    "image_std": [0.27, 0.26, 0.28],
    "do_pad": True,
}
MAX_PATCHES = 48  # max(max_image_tokens * 2^2, (24 / 4)^2): HF's padded length
HF_PROCESSOR = importlib.util.find_spec("torchvision") is not None


def write_tiny_lfm2_vl(path: Path, seed: int = 0) -> Path:
    from paged_engine.testing import _COMMON, _save_random, build_tiny_tokenizer, tiny_config

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(seed=seed)
    tokenizer.add_special_tokens({"additional_special_tokens": [*MARKS, *TILES]})
    text = tiny_config("lfm2", vocab_size=len(tokenizer)).to_dict()
    vision = {"model_type": "siglip2_vision_model", "hidden_size": 32, "intermediate_size": 48}
    vision |= {"num_hidden_layers": 2, "num_attention_heads": 2, "patch_size": 4}
    vision |= {"num_patches": 16, "vision_use_head": False}
    config = transformers.Lfm2VlConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        projector_hidden_size=40,
        projector_hidden_act="gelu",
        downsample_factor=2,
        **_COMMON,
    )
    _save_random(transformers.Lfm2VlForConditionalGeneration, config, seed, path)
    (path / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    return finish_checkpoint(path, tokenizer, CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_lfm2_vl(tmp_path_factory.mktemp("lfm2-vl"), seed=4)


def _processor(path):
    from paged_engine.multimodal.lfm2_vl import Lfm2VlImageProcessor, read_settings

    config = transformers.AutoConfig.from_pretrained(path)
    return Lfm2VlImageProcessor(read_settings(Path(path)), config)


def _hf_source(name: str) -> ast.Module:
    root = importlib.util.find_spec("transformers").submodule_search_locations[0]
    return ast.parse(Path(root, "models", "lfm2_vl", name).read_text())


def _hf_rules():
    """Lfm2VlImageProcessor's resize and split methods and module functions, compiled from
    transformers' source (the module imports torchvision) onto a bare class."""
    tree = _hf_source("image_processing_lfm2_vl.py")
    methods = {"smart_resize", "_is_image_too_large", "_get_grid_layout", "_target_ratios"}
    body: list[ast.stmt] = []
    for node in tree.body:
        functions = ("round_by_factor", "find_closest_aspect_ratio")
        if isinstance(node, ast.FunctionDef) and node.name in functions:
            body.append(node)
        elif isinstance(node, ast.ClassDef) and node.name == "Lfm2VlImageProcessor":
            keep = [n for n in node.body if isinstance(n, ast.FunctionDef) and n.name in methods]
            keep.append(next(n for n in node.body if getattr(n, "name", "") == "_get_split_layout"))
            body.append(ast.ClassDef("Rules", [], [], keep, [], type_params=[]))
    namespace = {"math": math, "lru_cache": functools.lru_cache}
    module = ast.fix_missing_locations(ast.Module(body=body, type_ignores=[]))
    exec(compile(module, "<lfm2_vl rules>", "exec"), namespace)
    return namespace["Rules"]()


def _hf_prompt(text: str, layouts: list[tuple[int, int, tuple[int, int]]]) -> str:
    """Lfm2VlProcessor's text: each <image> replaced by `_build_image_tokens` of its image's
    (rows, cols, resized size), the token counts by its own functions."""
    from transformers.models.lfm2_vl.processing_lfm2_vl import Lfm2VlProcessor as P

    me = SimpleNamespace(
        image_start_token="<|image_start|>",
        image_end_token="<|image_end|>",
        image_thumbnail_token="<|img_thumbnail|>",
        image_token="<image>",
    )
    pieces = text.split("<image>")
    out = pieces[0]
    for (rows, cols, size), piece in zip(layouts, pieces[1:], strict=True):
        per_tile = P._compute_tokens_per_tile(me, PROCESSOR["tile_size"], 4, 2)
        whole = P._compute_tokens_for_image(me, list(size), 4, 2)
        out += P._build_image_tokens(me, rows, cols, per_tile, whole, True, True) + piece
    return out


def _hf_inputs(path, text: str, images: list) -> tuple[list[int], dict]:
    """HF's prompt ids and pixel inputs (views padded to MAX_PATCHES as HF pads them): from
    transformers' processor where it imports, else from ours and Lfm2VlProcessor's builder."""
    tok = transformers.AutoTokenizer.from_pretrained(path)
    if not images:
        return tok.encode(text, add_special_tokens=False), {}
    if HF_PROCESSOR:
        out = transformers.AutoProcessor.from_pretrained(path)(
            text=text, images=[images], return_tensors="pt"
        )
        keys = ("pixel_values", "pixel_attention_mask", "spatial_shapes")
        return out["input_ids"][0].tolist(), {k: out[k] for k in keys}
    proc = _processor(path)
    layouts, views, grids = [], [], []
    for image in images:
        v, g, (rows, cols) = proc(image)
        layouts.append((rows, cols, (g[-1][0] * 4, g[-1][1] * 4)))
        views += v
        grids += g
    pixels = torch.zeros(len(views), MAX_PATCHES, 48)
    mask = torch.zeros(len(views), MAX_PATCHES, dtype=torch.long)
    for i, v in enumerate(views):
        pixels[i, : len(v)], mask[i, : len(v)] = v, 1
    ids = tok.encode(_hf_prompt(text, layouts), add_special_tokens=False)
    extra = {"pixel_values": pixels, "pixel_attention_mask": mask}
    return ids, {**extra, "spatial_shapes": torch.tensor(grids)}


def _hf_model(path):
    return load_hf_vlm(transformers.Lfm2VlForConditionalGeneration, path)


def test_images_match_hf(path):
    # 20 x 28: one view, 16 x 32 (20 / 8 = 2.5 rounds to 2); 60 x 30: 2 x 1 tiles + an
    # 8 x 4 thumbnail; 10 x 6 upscaled to 6 x 4
    cases = hf_cases(PROMPT, TEXT, TWO, ((20, 28), (60, 30), (10, 6)))
    refs = hf_refs(_hf_model(path), cases, lambda *case: _hf_inputs(path, *case))
    assert "<|img_thumbnail|>" in transformers.AutoTokenizer.from_pretrained(path).decode(
        refs[2][0]
    )
    check_matches_hf(path, cases, refs, "lfm2_vl")


def test_encoder_matches_hf_features(path):
    """The tower and projector alone: each view's rows equal HF's get_image_features on the
    padded batch (the 4 x 4 position table resized up and down to 6 x 6, 8 x 4, 4 x 8 and
    2 x 18 grids; unshuffle order; padding masked)."""
    from safetensors.torch import load_file

    from paged_engine.multimodal.inputs import ImageInput
    from paged_engine.multimodal.lfm2_vl import Lfm2VlImageEncoder

    model = _hf_model(path)
    config = transformers.AutoConfig.from_pretrained(path)
    ours = Lfm2VlImageEncoder(config)
    ours.load_weights(load_file(Path(path) / "model.safetensors").items())
    pictures = [noise_image(5, (60, 30)), noise_image(6, (20, 28)), noise_image(7, (10, 70))]
    _, extra = _hf_inputs(path, "<image><image><image>", pictures)
    grids = [tuple(g) for g in extra["spatial_shapes"].tolist()]
    assert grids == [(6, 6), (6, 6), (8, 4), (4, 8), (2, 18)]
    images = [
        ImageInput(p[: h * w], 0, h * w // 4, str(i), (h, w))
        for i, (p, (h, w)) in enumerate(zip(extra["pixel_values"], grids, strict=True))
    ]
    with torch.no_grad():
        got = ours.encode(images)
        want = model.model.get_image_features(**extra).pooler_output
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_resize_and_split_rules_follow_transformers(path):
    """Our smart resize and tile grid equal transformers' methods over awkward sizes (ties of
    Python's round, the min / max token bounds, the split threshold, grid ties)."""
    hf = _hf_rules()
    proc = _processor(path)
    kw = {k: PROCESSOR[k] for k in ("downsample_factor", "min_image_tokens", "max_image_tokens")}
    kw |= {k: PROCESSOR[k] for k in ("encoder_patch_size", "tile_size", "max_pixels_tolerance")}
    sizes = [(20, 28), (60, 30), (10, 6), (50, 50), (12, 100), (100, 12), (36, 44), (1, 1)]
    sizes += [(44, 36), (28, 20), (33, 47), (400, 300), (8, 8), (70, 140), (30, 30), (24, 40)]
    for h, w in sizes:
        split, rows, cols, nh, nw = hf._get_split_layout(h, w, min_tiles=2, max_tiles=4, **kw)
        assert proc.smart_size(h, w) == (nh, nw), (h, w)
        assert proc.grid(h, w) == ((rows, cols) if split else (1, 1)), (h, w)


@pytest.mark.skipif(not HF_PROCESSOR, reason="transformers' Lfm2VlImageProcessor: torchvision")
def test_pixels_equal_transformers(path):
    images = [noise_image(7, (60, 30)), noise_image(8, (10, 6)), noise_image(9, (20, 28))]
    out = transformers.AutoImageProcessor.from_pretrained(path)(images, return_tensors="pt")
    ours = [v for image in images for v in _processor(path)(image)[0]]
    for i, v in enumerate(ours):
        torch.testing.assert_close(out["pixel_values"][i, : len(v)], v)


def test_normalization_and_patch_order(path):
    """Without a resize (the smart size is the image's) the views are (x - 255 mean) /
    (255 std) cut into row-major patches, each (row, col, channel)."""
    import numpy as np

    proc = _processor(path)
    image = noise_image(10, (16, 24))
    (pixels,), grids, tiles = proc(image)
    assert (grids, tiles) == ([(4, 6)], (1, 1))
    mean = torch.tensor(PROCESSOR["image_mean"]) * 255
    std = torch.tensor(PROCESSOR["image_std"]) * 255
    x = (torch.from_numpy(np.array(image)).float() - mean) / std  # [16, 24, 3]
    want = x.view(4, 4, 6, 4, 3).permute(0, 2, 1, 3, 4).reshape(24, 48)
    torch.testing.assert_close(pixels, want)


def test_engine_paths_match_the_plain_run(path):
    """image_checks' paths (8-token chunks through the views, prefix-cache hits, images
    processed ahead); bad input a ValueError naming what is wrong, nothing lost."""
    prompts = [
        {"prompt": PROMPT, "multi_modal_data": {"image": noise_image(i, (20 + 8 * i, 28))}}
        for i in range(3)
    ] + [
        {
            "prompt": TWO,
            "multi_modal_data": {"image": [noise_image(7, (50, 50)), noise_image(8, (16, 16))]},
        }
    ]
    cached = check_engine_paths(path, prompts, TWO)
    one = noise_image(9, (20, 20))
    check_refused(path, cached, usual_refusals(PROMPT, TWO, one), prompts)


def test_tensor_parallel_matches_one_process(path):
    """TP=2: the tower on every rank, the decoder's heads and convolutions split."""
    prompts = [{"prompt": TWO, "multi_modal_data": {"image": [noise_image(11, (60, 30))] * 2}}]
    check_tensor_parallel(path, prompts, None, 8)


def test_chat_data_url_gives_the_offline_tokens(path):
    """The server's chat path: an image_url part with a data: URL gives the offline tokens and
    prompt (the chat template's <image> expanded as Lfm2VlProcessor does)."""
    question = [{"type": "image"}, {"type": "text", "text": "What is it?"}]
    want = check_chat_data_url(engine(path), question, noise_image(12, (60, 30)))
    assert want.text == PROMPT.replace("What is in it?", "What is it?")


def test_config_refusals(path):
    """What the path does not run is refused by the config field's name."""
    from paged_engine.multimodal.lfm2_vl import Lfm2VlImageEncoder, Lfm2VlImageProcessor

    config = transformers.AutoConfig.from_pretrained(path)
    cases = [
        ("num_patches", 15, "num_patches"),
        ("model_type", "siglip_vision_model", "model_type"),
    ]
    check_vision_fields_refused(path, cases, Lfm2VlImageEncoder)
    for field, value in [
        ("resample", 3),
        ("encoder_patch_size", 8),
        ("downsample_factor", 1),
        ("tile_size", 20),
        ("min_tiles", 1),
    ]:
        with pytest.raises(ValueError, match=field):
            Lfm2VlImageProcessor({**PROCESSOR, field: value}, config)
