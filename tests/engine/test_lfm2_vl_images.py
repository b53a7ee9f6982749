"""Images through LFM2-VL checkpoints (multimodal/lfm2_vl.py) against HF.

A tiny random `Lfm2VlForConditionalGeneration` (its LFM2 decoder: short-conv and attention
layers; a SigLIP2 NaFlex tower of 4-pixel patches whose 4 x 4 position table every view
resizes, up and down; pixel unshuffle by 2, a LayerNorm'd projector MLP with biases; images
smart-resized between 4 and 12 tokens, Python's round on the way, split past 1.5x into 2..4
tiles of 24 pixels plus a thumbnail, normalized by non-default means): `LLM.generate` with
`multi_modal_data` must give HF's prompt ids (Lfm2VlProcessor's <|image_start|>, tile and
thumbnail tokens and runs) and HF `generate`'s greedy tokens and top-5 logprobs (1e-3,
float32). transformers' Lfm2VlImageProcessor needs torchvision: where it is missing the
engine's own copy (multimodal/lfm2_vl_processor.py, torch alone) feeds both, its resize /
split rules and tile-ratio order checked against transformers' own methods and the prompt
against Lfm2VlProcessor's builder; where it imports, the copy's output equals the class's.
Fair mm_processor_kwargs (fewer tokens, no splitting, other tile counts and sizes) give HF's
prompt and tokens under the same kwargs; hostile ones are refused by name before any pixel.
Then the tower against get_image_features (padded batch), the engine's paths, TP=2, the
server's chat path and bad input.
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
from hf_reference import assert_matches
from image_checks import (
    check_chat_data_url,
    check_engine_paths,
    check_matches_hf,
    check_refused,
    check_tensor_parallel,
    check_vision_fields_refused,
    engine,
    greedy,
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
# mm_processor_kwargs a request may give (within the budget): fewer tokens, no splitting,
# other tile counts and sizes (3..6 tiles: 1 x 3 and 2 x 3 nearly tie for a 2:1 image), no
# thumbnail
FAIR = [
    {"max_image_tokens": 6, "min_image_tokens": 2},
    {"do_image_splitting": False},
    {"min_tiles": 3, "max_tiles": 6, "tile_size": 16},
    {"max_tiles": 2, "use_thumbnail": False, "max_pixels_tolerance": 1.0},
    {"max_tiles": 8, "tile_size": 16},  # 1 x 2 and 2 x 4 tie for a 2:1 image: the larger
]
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
    from paged_engine.multimodal.lfm2_vl_processor import Lfm2VlTorchProcessor
    from paged_engine.multimodal.torch_processors import saved_settings

    config = transformers.AutoConfig.from_pretrained(path)
    return Lfm2VlTorchProcessor(saved_settings(Path(path)), config)


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


def _hf_prompt(text: str, layouts: list[tuple[int, int, list[int]]], **kw) -> str:
    """Lfm2VlProcessor's text: each <image> replaced by `_build_image_tokens` of its image's
    (rows, cols, resized size), the token counts by its own functions (`kw`: the request's
    mm_processor_kwargs)."""
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
        per_tile = P._compute_tokens_per_tile(me, kw.get("tile_size", PROCESSOR["tile_size"]), 4, 2)
        whole = P._compute_tokens_for_image(me, list(size), 4, 2)
        thumbnail = kw.get("use_thumbnail", True)
        out += P._build_image_tokens(me, rows, cols, per_tile, whole, thumbnail, True) + piece
    return out


def _hf_inputs(path, text: str, images: list, **kw) -> tuple[list[int], dict]:
    """HF's prompt ids and pixel inputs (views padded as HF pads them) under the
    mm_processor_kwargs `kw`: from transformers' processor where it imports, else from our
    copy and Lfm2VlProcessor's builder."""
    tok = transformers.AutoTokenizer.from_pretrained(path)
    if not images:
        return tok.encode(text, add_special_tokens=False), {}
    keys = ("pixel_values", "pixel_attention_mask", "spatial_shapes")
    if HF_PROCESSOR:
        out = transformers.AutoProcessor.from_pretrained(path)(
            text=text, images=[images], return_tensors="pt", **kw
        )
        return out["input_ids"][0].tolist(), {k: out[k] for k in keys}
    out = _processor(path)(images, return_row_col_info=True, **kw)
    sizes = out["image_sizes"].tolist()
    layouts = list(zip(out["image_rows"].tolist(), out["image_cols"].tolist(), sizes, strict=True))
    ids = tok.encode(_hf_prompt(text, layouts, **kw), add_special_tokens=False)
    return ids, {k: out[k] for k in keys}


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


def test_resize_and_split_rules_follow_transformers():
    """Our smart resize and tile grid equal transformers' methods over awkward sizes (ties of
    Python's round, the min / max token bounds, the split threshold, grid ties), under the
    checkpoint's settings and the fair mm_processor_kwargs."""
    from paged_engine.multimodal.lfm2_vl_processor import smart_size, tile_grid

    hf = _hf_rules()
    names = ("downsample_factor", "min_image_tokens", "max_image_tokens", "encoder_patch_size")
    names += ("tile_size", "max_pixels_tolerance", "min_tiles", "max_tiles")
    sizes = [(20, 28), (60, 30), (10, 6), (50, 50), (12, 100), (100, 12), (36, 44), (1, 1)]
    sizes += [(44, 36), (28, 20), (33, 47), (400, 300), (8, 8), (70, 140), (30, 30), (24, 40)]
    for kw in [{}, *FAIR]:
        s = {**PROCESSOR, **kw}
        rule = {k: s[k] for k in names}
        if not s["do_image_splitting"]:  # as transformers' _preprocess
            rule["min_tiles"] = rule["max_tiles"] = 1
        for h, w in sizes:
            split, rows, cols, nh, nw = hf._get_split_layout(h, w, **rule)
            assert smart_size(h, w, s) == (nh, nw), (h, w, kw)
            assert tile_grid(h, w, s) == ((rows, cols) if split else None), (h, w, kw)


def test_tile_ratios_follow_transformers_cheaply():
    """The tile ratios in transformers' order (its set's, sorted stably by tile count) for
    every min_tiles / max_tiles pair up to 40, listed in O(n log n): max_tiles=5000 (10**10
    steps of transformers' comprehension) at once."""
    import time

    from paged_engine.multimodal.lfm2_vl_processor import target_ratios

    hf = _hf_rules()
    for low in range(-1, 12):
        for high in range(0, 41):
            assert list(target_ratios(low, high)) == hf._target_ratios(low, high), (low, high)
    start = time.thread_time()  # this thread's CPU time: a loaded machine does not stretch it
    assert len(target_ratios(2, 5000)) > 40000
    assert time.thread_time() - start < 2


@pytest.mark.skipif(not HF_PROCESSOR, reason="transformers' Lfm2VlImageProcessor: torchvision")
def test_copy_equals_transformers(path):
    """Our copy's output (every key, dtype and value) equals transformers' class, with the
    checkpoint's settings and each fair mm_processor_kwargs."""
    images = [noise_image(7, (60, 30)), noise_image(8, (10, 6)), noise_image(9, (20, 28))]
    hf = transformers.AutoImageProcessor.from_pretrained(path)
    for kw in [{}, *FAIR, *({"return_row_col_info": True, **k} for k in [{}, *FAIR])]:
        want = hf(images, return_tensors="pt", **kw)
        got = _processor(path)(images, return_tensors="pt", **kw)
        assert sorted(got) == sorted(want), kw
        for key, value in want.items():
            value = torch.as_tensor(value)
            assert got[key].dtype == value.dtype, (key, kw)
            torch.testing.assert_close(got[key], value, atol=0, rtol=0, msg=f"{key} {kw}")


def test_fair_kwargs_match_hf(path):
    """Each fair mm_processor_kwargs is served: the engine's prompt ids are HF's under the
    same kwargs (other views than without them) and its greedy tokens and top-5 logprobs
    HF's on those inputs."""
    model = _hf_model(path)
    image = noise_image(13, (60, 30))
    base = _hf_inputs(path, PROMPT, [image])[0]
    llm = engine(path)
    for kw in FAIR:
        inputs = functools.partial(_hf_inputs, path, **kw)
        ((ids, ref),) = hf_refs(model, [(PROMPT, [image])], inputs)
        assert ids != base, kw
        req = {"prompt": PROMPT, "multi_modal_data": {"image": image}, "mm_processor_kwargs": kw}
        out = llm.generate([req], greedy(), use_tqdm=False)[0]
        assert out.prompt_token_ids == ids, kw
        assert_matches("lfm2_vl", out, ref)


HOSTILE = [  # (mm_processor_kwargs, the key its ValueError names)
    ({"min_image_tokens": 10**9}, "min_image_tokens"),
    ({"min_image_tokens": 0}, "min_image_tokens"),
    ({"max_image_tokens": 10**9, "min_image_tokens": 10**7}, "max_image_tokens"),
    ({"max_image_tokens": 2.5}, "max_image_tokens"),
    ({"max_image_tokens": 1}, "max_image_tokens"),  # under the checkpoint's min (4)
    ({"tile_size": 10**5}, "tile_size"),
    ({"tile_size": 20}, "tile_size"),  # not whole 8-pixel blocks
    ({"max_tiles": 10**9, "min_tiles": 10**8}, "max_tiles"),
    ({"max_tiles": 1024}, "max_tiles"),  # under the shared budget, over the search's
    ({"min_tiles": 1}, "min_tiles"),
    ({"min_tiles": 5}, "min_tiles"),  # over the checkpoint's max_tiles (4)
    ({"min_tiles": True}, "min_tiles"),
    ({"max_pixels_tolerance": float("inf")}, "max_pixels_tolerance"),
    ({"max_pixels_tolerance": 0}, "max_pixels_tolerance"),
    ({"max_pixels_tolerance": 2}, "max_pixels_tolerance"),  # an int: transformers refuses it
    ({"encoder_patch_size": 1}, "encoder_patch_size"),
    ({"downsample_factor": 10**6}, "downsample_factor"),
    ({"do_image_splitting": "yes"}, "do_image_splitting"),
    ({"use_thumbnail": 1}, "use_thumbnail"),
    ({"do_pad": False}, "do_pad"),
    ({"return_row_col_info": False}, "return_row_col_info"),
]


def test_hostile_kwargs_refused_by_name(path):
    """Each hostile mm_processor_kwargs is refused by check_kwargs naming the key; the fair
    ones and a do_image_splitting=False beside an otherwise unread max_tiles pass. Through
    the engine: refused before any pixel, the engine serving on."""
    from paged_engine.multimodal.lfm2_vl_processor import Lfm2VlTorchProcessor, check_kwargs

    config = transformers.AutoConfig.from_pretrained(path)
    settings = {**Lfm2VlTorchProcessor.defaults, **PROCESSOR}
    for kw, key in HOSTILE:
        with pytest.raises(ValueError, match=rf"mm_processor_kwargs\['{key}'\]"):
            check_kwargs(kw, settings, config)
    for kw in [*FAIR, {"do_image_splitting": False, "max_tiles": 500}]:
        check_kwargs(kw, settings, config)
    llm = engine(path)
    image = noise_image(14, (60, 30))
    for kw, key in HOSTILE[::4]:
        req = {"prompt": PROMPT, "multi_modal_data": {"image": image}, "mm_processor_kwargs": kw}
        with pytest.raises(ValueError, match=rf"mm_processor_kwargs\['{key}'\]") as e:
            llm.generate([req], greedy(0), use_tqdm=False)
        assert "could not be processed" not in str(e.value)
    ok = {"prompt": PROMPT, "multi_modal_data": {"image": image}}
    assert len(llm.generate([ok], greedy(0), use_tqdm=False)[0].outputs[0].token_ids) == 8


def test_torch_copy_serves_without_torchvision(path, monkeypatch, tmp_path):
    """With torchvision hidden the engine's image processor is our copy, which takes
    transformers' kwargs (return_row_col_info among them) and refuses others by name."""
    from paged_engine.multimodal import torch_processors
    from paged_engine.multimodal.lfm2_vl_processor import Lfm2VlTorchProcessor
    from paged_engine.multimodal.processor import ImageProcessor, wrapper_config

    monkeypatch.setattr(torch_processors, "torchvision_available", lambda: False)
    bare = tmp_path / "bare"  # no image_processor_type saved: the config's model_type picks it
    bare.mkdir()
    (bare / "preprocessor_config.json").write_text(
        json.dumps(PROCESSOR | {"image_processor_type": None})
    )
    config = transformers.AutoConfig.from_pretrained(path)
    assert type(torch_processors.image_processor(bare, config)) is Lfm2VlTorchProcessor
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ours = ImageProcessor(path, wrapper_config(path), tokenizer=tok)
    assert type(ours.hf) is Lfm2VlTorchProcessor
    assert ours.processor_kwargs(FAIR[2]) == FAIR[2]
    with pytest.raises(ValueError, match="mm_processor_kwargs\\['max_num_tiles'\\]"):
        ours.processor_kwargs({"max_num_tiles": 3})
    out = ours.hf(images=[noise_image(15, (60, 30))], return_row_col_info=True)
    assert (out["image_rows"].tolist(), out["image_cols"].tolist()) == ([2], [1])
    assert out["spatial_shapes"].tolist() == [[6, 6], [6, 6], [8, 4]]


def test_normalization_and_patch_order(path):
    """Without a resize (the smart size is the image's) the views are (x - 255 mean) /
    (255 std) cut into row-major patches, each (row, col, channel)."""
    import numpy as np

    proc = _processor(path)
    image = noise_image(10, (16, 24))
    out = proc([image], return_row_col_info=True)
    pixels = out["pixel_values"][0][:24]
    assert out["spatial_shapes"].tolist() == [[4, 6]]
    assert (out["image_rows"].tolist(), out["image_cols"].tolist()) == ([1], [1])
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
    from paged_engine.multimodal.lfm2_vl import Lfm2VlImageEncoder
    from paged_engine.multimodal.lfm2_vl_processor import Lfm2VlTorchProcessor

    config = transformers.AutoConfig.from_pretrained(path)
    cases = [
        ("num_patches", 15, "num_patches"),
        ("model_type", "siglip_vision_model", "model_type"),
    ]
    check_vision_fields_refused(path, cases, Lfm2VlImageEncoder)
    for field, value in [
        ("resample", 1),  # LANCZOS
        ("encoder_patch_size", 8),
        ("downsample_factor", 1),
        ("tile_size", 20),
        ("min_tiles", 1),
    ]:
        with pytest.raises(ValueError, match=field):
            Lfm2VlTorchProcessor({**PROCESSOR, field: value}, config)
