"""Nemotron Nano VL v2 (`NemotronH_Nano_VL_V2`, remote code: multimodal/nemotron_nano_vl.py,
models/nemotron_nano_vl_config.py) against a reference composed here from transformers' modules.

transformers has no class of the release. Its parts are transformers' Nemotron-H Omni ones: the
C-RADIO tower (RadioModel: CPE position table resized to each grid, cls + register prefix
dropped), pixel shuffle and the RMSNorm -> relu^2 projector, and the Nemotron-H decoder; the
release runs them per 512-pixel tile with no vision final norm and its layer scales at 1 (vLLM
never reads ls1 / ls2). The glue written here from vLLM's processors/nano_nemotron_vl.py and
nano_nemotron_vl.py: InternVL's closest-ratio tile grid, the uint8 bicubic resize, a thumbnail
after more than one tile, (x - norm_mean) / norm_std, and "<image>" -> <img>, the tiles' run of
"<image>", </img>. The Omni model's random weights (vit_small's 12 layers of 384, 4-pixel
patches, 32-pixel tiles, a 16 x 16 CPE table resized to 8 x 8) are saved in the release's layout
(`vision_model.radio_model.*`, `mlp1.{0,1,3}`, `language_model.*`, no layer scales) with a
config.json shaped as the release's (llm_config, vision_config.args). paged must give the
reference's prompt ids, greedy tokens and top-5 logprobs (1e-3, float32) for a one-tile image, a
3 x 1 grid with its thumbnail, two images, and text alone; config values and requests not served
are refused by name.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hf_reference import hf_greedy_with_img_runs
from image_checks import check_engine_matches_hf, engine, greedy, noise_image
from vlm_checkpoints import finish_checkpoint, load_hf_vlm, tokenizer_with

from paged_engine.testing import _COMMON, _randomize, tiny_config

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "NemotronH_Omni_Reasoning_V3"):
    pytest.skip("this transformers has no Nemotron-H Omni", allow_module_level=True)
pytest.importorskip("PIL.Image")
safetensors = pytest.importorskip("safetensors.torch")

SPECIAL = ["<image>", "<img>", "</img>"]
PROMPT = "User: <image>\nWhat is in it? Assistant:"
TWO = "User: <image> and <image>\nWhich is brighter? Assistant:"
TEXT = "User: Say something about the sea. Assistant:"
SIDE, PATCH, TABLE = 32, 4, 64  # tile pixels, patch pixels, cpe_max_size
MEAN, STD = [0.5, 0.4, 0.3], [0.2, 0.25, 0.3]
TEACHERS = [{"name": "clip"}, {"name": "dino"}, {"name": "clip"}]  # 2 cls, 2 registers (x 4)


def release_config(text: dict, image_id: int) -> dict:
    """config.json as the release writes it (its fields; tiny values)."""
    args = {"model": "vit_small_patch16_224", "cpe_max_size": TABLE, "register_multiple": 4}
    args |= {"teachers": TEACHERS, "cls_token_per_teacher": True, "qkv_bias": True}
    vision = {"model_type": "radio", "args": args, "patch_size": PATCH, "max_resolution": TABLE}
    vision |= {"preferred_resolution": [SIDE, SIDE], "separate_video_embedder": True}
    llm = {**text, "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h"}
    top = {"architectures": ["NemotronH_Nano_VL_V2"], "model_type": "NemotronH_Nano_VL_V2"}
    top |= {"llm_config": llm, "vision_config": vision, "force_image_size": SIDE}
    top |= {"patch_size": PATCH, "downsample_ratio": 0.5, "ps_version": "v2"}
    top |= {"use_thumbnail": True, "img_context_token_id": image_id}
    top |= {"img_context_token": "<image>", "img_start_token": "<img>", "img_end_token": "</img>"}
    top |= {"vit_hidden_size": 384, "projector_hidden_size": 48, "template": "nemotron-h-5p5"}
    return {**top, "norm_mean": MEAN, "norm_std": STD, "torch_dtype": "float32"}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """(the release-layout dir, (transformers' Omni model on the same weights, tokenizer))."""
    root = tmp_path_factory.mktemp("nemotron_nano_vl")
    tokenizer, ids = tokenizer_with(SPECIAL, 7)
    text = tiny_config("nemotron_h", vocab_size=len(tokenizer)).to_dict()
    vision = {"hidden_size": 384, "num_hidden_layers": 12, "num_attention_heads": 6}
    vision |= {"mlp_ratio": 4.0, "patch_size": PATCH, "image_size": SIDE, "max_img_size": TABLE}
    vision |= {"num_cls_tokens": 2, "num_registers": 2, "video_temporal_patch_size": 2}
    config = transformers.NemotronH_Omni_Reasoning_V3_Config(
        text_config=text,
        vision_config=vision,
        vision_hidden_size=384,
        projector_hidden_size=48,
        image_token_id=ids["<image>"],
        **_COMMON,
    )
    torch.manual_seed(3)
    model = transformers.NemotronH_Omni_Reasoning_V3(config).float()
    with torch.no_grad():
        _randomize(model, 3)
        for name, p in model.named_parameters():
            if ".layer_scale" in name:  # the release has none: vLLM's are 1
                p.fill_(1.0)
    model.save_pretrained(root / "hf")
    path = root / "remote"
    path.mkdir()
    saved = safetensors.load_file(str(root / "hf" / "model.safetensors"))
    state = {k: v for k, v in saved.items() if "layer_scale" not in k and ".ls" not in k}
    assert any(k.startswith("vision_model.radio_model.model.blocks.") for k in state), list(state)
    safetensors.save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    text_fields = {k: v for k, v in text.items() if k not in ("architectures", "model_type")}
    (path / "config.json").write_text(json.dumps(release_config(text_fields, ids["<image>"])))
    finish_checkpoint(path, tokenizer)
    return path, (load_hf_vlm(transformers.NemotronH_Omni_Reasoning_V3, root / "hf"), tokenizer)


def vllm_tiles(image, max_tiles: int = 12) -> torch.Tensor:
    """processors/nano_nemotron_vl.py's tiles of `image`, normalized: [tiles, 3, S, S]."""
    w, h = image.size
    pairs = {
        (i, j) for n in range(1, max_tiles + 1) for i in range(1, n + 1) for j in range(1, n + 1)
    }
    ratios = sorted((p for p in pairs if p[0] * p[1] <= max_tiles), key=lambda p: p[0] * p[1])
    best_diff, best = float("inf"), (1, 1)
    for ratio in ratios:
        diff = abs(w / h - ratio[0] / ratio[1])
        if diff < best_diff:
            best_diff, best = diff, ratio
        elif diff == best_diff and w * h > 0.5 * SIDE * SIDE * ratio[0] * ratio[1]:
            best = ratio
    arr = torch.from_numpy(np.asarray(image.convert("RGB"), dtype=np.uint8).copy())
    arr = arr.permute(2, 0, 1)[None]

    def resize(hh, ww):
        kw = {"mode": "bicubic", "align_corners": False, "antialias": True}
        return F.interpolate(arr, size=(hh, ww), **kw) / 255.0

    big = resize(best[1] * SIDE, best[0] * SIDE)[0]
    tiles = [
        big[:, r * SIDE : (r + 1) * SIDE, c * SIDE : (c + 1) * SIDE]
        for r in range(best[1])
        for c in range(best[0])
    ]
    if len(tiles) > 1:
        tiles.append(resize(SIDE, SIDE)[0])
    mean, std = torch.tensor(MEAN).view(3, 1, 1), torch.tensor(STD).view(3, 1, 1)
    return torch.stack([(t - mean) / std for t in tiles])


def image_rows(model, image) -> torch.Tensor:
    """transformers' tower (dense, per tile), pixel shuffle and projector on the tiles."""
    grid = SIDE // PATCH
    with torch.no_grad():
        feats = model.vision_model(vllm_tiles(image)).features  # [tiles, grid^2, 384]
        return model.project_vision_features(feats, grid, grid).flatten(0, 1)


def reference(ref, text: str, images: list):
    """(the prompt ids vLLM makes, greedy with top-5 logprobs over the composed embeddings)."""
    model, tok = ref
    return hf_greedy_with_img_runs(model, tok, text, [image_rows(model, im) for im in images])


def test_images_match_reference(ckpt):
    """A one-tile image (square), a wide one (3 x 1 tiles and the thumbnail), two images in
    one prompt (a tall 1 x 2 grid and a small square), and text alone."""
    path, ref = ckpt
    square, wide = noise_image(1, (40, 40)), noise_image(2, (30, 100))
    tall, small = noise_image(3, (90, 40)), noise_image(4, (20, 24))
    cases = [(PROMPT, [square]), (PROMPT, [wide]), (TWO, [tall, small]), (TEXT, [])]
    llm = engine(path, limit_mm_per_prompt={"image": 2})
    refs = [reference(ref, t, im) for t, im in cases]
    check_engine_matches_hf(llm, cases, refs, "nemotron_nano_vl")  # by text and by expanded ids
    one, multi = (len(ids) for ids, _ in refs[:2])
    assert multi - one == 3 * (SIDE // PATCH // 2) ** 2  # 4 tiles against 1


def test_refusals_name_the_field(ckpt, tmp_path):
    """Requests (a video; mm_processor_kwargs max_num_tiles 0) and config fields not served."""
    from paged_engine.models.nemotron_nano_vl_config import nemotron_nano_vl_config

    path, _ = ckpt
    llm = engine(path)
    frames = np.zeros((2, 32, 32, 3), dtype=np.uint8)
    with pytest.raises(ValueError, match="video"):
        llm.generate({"prompt": "<video>", "multi_modal_data": {"video": frames}}, greedy(0))
    bad = {"prompt": PROMPT, "multi_modal_data": {"image": noise_image(5, (40, 40))}}
    bad["mm_processor_kwargs"] = {"max_num_tiles": 0}
    with pytest.raises(ValueError, match="max_num_tiles"):
        llm.generate(bad, greedy(0), use_tqdm=False)
    raw = json.loads((path / "config.json").read_text())
    cases = [
        ({"vision_config": {**raw["vision_config"], "args": {"min_num_patches": 4}}}, "min_num"),
        ({"ps_version": "v1"}, "ps_version"),
        ({"sound_config": {"model_type": "parakeet"}}, "sound_config"),
        ({"img_context_token": "<IMG_CONTEXT>"}, "img_context_token"),
        ({"force_image_size": 30}, "force_image_size"),
    ]
    args = raw["vision_config"]["args"]
    for key, value in (("model", "vit_tiny"), ("qk_normalization", True)):
        vision = {**raw["vision_config"], "args": {**args, key: value}}
        cases.append(({"vision_config": vision}, key))
    vision = {**raw["vision_config"], "args": {**args, "initializer_factor": 0.1}}
    cases.append(({"vision_config": vision}, "initializer_factor"))
    for change, name in cases:
        with pytest.raises(ValueError, match=name):
            nemotron_nano_vl_config({**raw, **change})
