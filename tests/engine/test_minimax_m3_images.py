"""Images through MiniMax M3 checkpoints (multimodal/minimax_m3_vl.py) against HF.

A tiny random `MiniMaxM3SparseForConditionalGeneration`: test_models_minimax_m3.py's decoder
(a sparse-attention layer, a MoE layer) and a 2-layer tower of 4-pixel patches merged 2 x 2,
heads of 16 of which 12 dims rotate by (t, h, w) at theta 100, the patch-merge projector;
images resized to 4-48 merged patches. transformers' MiniMaxM3VLImageProcessor needs
torchvision: where it is missing the engine's torch copy gives the pixels of both (its resize
rule checked against transformers' smart_resize, its patch order against the tower's
positions); HF's ids are MiniMaxM3VLProcessor's expansion (start, one image token per merged
patch, end). `LLM.generate` with `multi_modal_data` must give HF's prompt ids and HF
`generate`'s greedy tokens and top-5 logprobs (1e-3, float32); the tower and projector equal
HF's image features (1e-5); then the engine's paths (chunks through images, prefix-cache hits,
images processed ahead), bad input and refused vision fields.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import math
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
from test_models_minimax_m3 import TEXT
from vlm_checkpoints import expand_image_tokens, finish_checkpoint, load_hf_vlm, tokenizer_with

from paged_engine.testing import _save_random

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.minimax_m3_vl")

IMAGE, START, END, VIDEO = (
    "]<]image[>[",
    "]<]start of image[>[",
    "]<]end of image[>[",
    "]<]video[>[",
)
PROMPT = f"user: {IMAGE}What is in it? Tell me.\nassistant:"
TWO = f"user: {IMAGE} and {IMAGE}Which is brighter?\nassistant:"
TEXT_ONLY = "user: Say something about the sea, then more.\nassistant:"
VISION = {
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "patch_size": 4,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "rope_parameters": {"rope_type": "axial", "rope_theta": 100.0},
}
PROCESSOR = {
    "image_processor_type": "MiniMaxM3VLImageProcessor",
    "patch_size": 4,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "size": {"shortest_edge": 4 * 64, "longest_edge": 48 * 64},
}


def write_tiny_minimax_m3(path: Path, seed: int = 3) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tokenizer, ids = tokenizer_with([IMAGE, START, END, VIDEO], seed)
    config = transformers.MiniMaxM3VLConfig(
        text_config={**TEXT, "vocab_size": len(tokenizer)},
        vision_config=VISION,
        projector_hidden_size=48,
        image_token_index=ids[IMAGE],
        video_token_index=ids[VIDEO],
    )
    _save_random(transformers.MiniMaxM3SparseForConditionalGeneration, config, seed, path)
    (path / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    return finish_checkpoint(path, tokenizer, None)


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> Path:
    return write_tiny_minimax_m3(tmp_path_factory.mktemp("minimax_m3_vl"))


def _processor(path: Path):
    from paged_engine.multimodal.minimax_m3_vl import MiniMaxM3ImageProcessor

    return MiniMaxM3ImageProcessor(PROCESSOR, transformers.AutoConfig.from_pretrained(path))


def _hf_inputs(path: Path, text: str, images: list) -> tuple[list[int], dict]:
    """MiniMaxM3VLProcessor's ids (each image token -> start, a run by the merged grid, end)
    and the pixels (our processor's: transformers' needs torchvision)."""
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ids = tok.encode(text, add_special_tokens=False)
    if not images:
        return ids, {}
    out = _processor(path)(images=images, return_tensors="pt")
    image, start, end = tok.convert_tokens_to_ids([IMAGE, START, END])
    runs = (int(g.prod()) // 4 for g in out["image_grid_thw"])
    expanded = expand_image_tokens(ids, image, runs, (start,), (end,))
    return expanded, {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


def _model(path: Path):
    return load_hf_vlm(transformers.MiniMaxM3SparseForConditionalGeneration, path)


def test_images_match_hf(path):
    cases = hf_cases(PROMPT, TEXT_ONLY, TWO)
    refs = hf_refs(_model(path), cases, lambda *case: _hf_inputs(path, *case))
    check_matches_hf(path, cases, refs, "minimax_m3_vl")


def test_encoder_matches_hf_features(path):
    out = _processor(path)(images=[noise_image(20, (40, 56)), noise_image(21, (72, 24))])
    check_grid_encoder_matches_hf(path, _model(path), out, merged=4)  # 2 x 2 merged


def _hf_function(name: str):
    """A function (or a method of the image processor) of transformers' image processing
    module, compiled from its source (the module imports torchvision)."""
    root = importlib.util.find_spec("transformers").submodule_search_locations[0]
    source = Path(root, "models/minimax_m3_vl/image_processing_minimax_m3_vl.py").read_text()
    nodes = ast.parse(source).body
    nodes += [m for n in nodes if isinstance(n, ast.ClassDef) for m in n.body]
    node = next(n for n in nodes if isinstance(n, ast.FunctionDef) and n.name == name)
    node.decorator_list, node.returns = [], None
    for arg in node.args.args:
        arg.annotation = None
    namespace = {"math": math}
    exec(compile(ast.Module(body=[node], type_ignores=[]), f"<{name}>", "exec"), namespace)
    return namespace[name]


def test_patch_rows_follow_transformers(path):
    """Unresized, unnormalized pixels: our rows are transformers' patchify's."""
    patchify = _hf_function("patchify")
    image = noise_image(30, (24, 40))
    ours = _processor(path)(images=[image], do_resize=False, do_normalize=False, do_rescale=False)
    x = torch.from_numpy(np.array(image)).permute(2, 0, 1)[None].float()
    want, h, w = patchify(None, x, patch_size=4, merge_size=2, temporal_patch_size=2)
    assert ours["image_grid_thw"].tolist() == [[1, h, w]]
    assert torch.equal(ours["pixel_values"], want[0])


def test_resize_rule_follows_transformers():
    from paged_engine.multimodal.minimax_m3_vl import smart_size

    smart_resize = _hf_function("smart_resize")

    for h, w in [(40, 56), (72, 24), (33, 47), (3, 200), (1000, 1000), (9, 5), (16, 90)]:
        for factor, low, high in [(8, 256, 3072), (28, 3136, 451584), (28, 56 * 56, 28 * 28 * 4)]:
            assert smart_size(h, w, factor, low, high) == smart_resize(h, w, factor, low, high)


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


def test_processor_settings():
    """The release's stale size [672, 672] means the class default (transformers' rule);
    another size without both pixel bounds is refused by name."""
    from paged_engine.multimodal.minimax_m3_vl import MiniMaxM3ImageProcessor

    stale = MiniMaxM3ImageProcessor({**PROCESSOR, "size": [672, 672]})
    assert stale.size == {"shortest_edge": 3136, "longest_edge": 451584}
    with pytest.raises(ValueError, match=r"size=.*shortest_edge and longest_edge"):
        MiniMaxM3ImageProcessor({**PROCESSOR, "size": {"height": 28, "width": 28}})
