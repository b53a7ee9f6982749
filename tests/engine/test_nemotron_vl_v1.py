"""Llama Nemotron Nano VL v1 (`Llama_Nemotron_Nano_VL`, remote code: multimodal/nemotron_vl_v1.py,
models/nemotron_vl_v1_config.py) against a reference composed here from transformers' classes.

transformers has no class of the release. Its parts: transformers' RadioModel (C-RADIO, CPE
table resized to each grid, cls + register prefix dropped; its input conditioner normalizes the
[0, 1] tiles as the release's does), the timm ViT's final LayerNorm (F.layer_norm here), v2
pixel shuffle (InternVL's), the mlp1 Sequential (LayerNorm -> Linear -> GELU -> Linear, built
here as the release's torch modules) and LlamaForCausalLM. The glue written here from vLLM's
nemotron_vl.py: v1's size x closeness tile rule, PIL bicubic resizes, a thumbnail after more
than one tile and "<image>" -> <img>, the tiles' run of "<image>", </img>. Weights are saved in
the release's layout (`vision_model.radio_model.*`, block 0's layer scales as timm's ls1 / ls2
gammas, the others absent, `vision_model.radio_model.model.norm.*`, `mlp1.{0,1,3}`,
`language_model.*`) with a config.json shaped as the release's (llm_config, vision_config.args,
no image token id: the tokenizer's "<image>"). paged must give the reference's prompt ids,
greedy tokens and top-5 logprobs (1e-3, float32) for a one-tile image, a 3 x 1 grid with its
thumbnail, two images, and text alone; mm_processor_kwargs max_num_tiles caps the grid; config
values not served are refused by name.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hf_reference import hf_greedy_with_img_runs
from image_checks import check_engine_matches_hf, engine, greedy, noise_image
from vlm_checkpoints import finish_checkpoint, load_hf_vlm, tokenizer_with

from paged_engine.testing import _randomize, tiny_config

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "RadioModel"):
    pytest.skip("this transformers has no RadioModel", allow_module_level=True)
Image = pytest.importorskip("PIL.Image")
safetensors = pytest.importorskip("safetensors.torch")

SPECIAL = ["<image>", "<img>", "</img>"]
PROMPT = "User: <image>\nWhat is in it? Assistant:"
TWO = "User: <image> and <image>\nWhich is brighter? Assistant:"
TEXT = "User: Say something about the sea. Assistant:"
SIDE, PATCH, TABLE, WIDTH, PROJ = 32, 4, 64, 384, 48  # tile, patch, cpe_max_size, ViT, mlp1
MEAN, STD = [0.5, 0.4, 0.3], [0.2, 0.25, 0.3]
TEACHERS = [{"name": "clip"}, {"name": "dino"}, {"name": "clip"}]  # 2 cls, 2 registers (x 4)


def release_config(text: dict) -> dict:
    """config.json as the release writes it (its fields; tiny values)."""
    args = {"model": "vit_small_patch16_224", "cpe_max_size": TABLE, "register_multiple": 4}
    args |= {"teachers": TEACHERS, "cls_token_per_teacher": True, "qkv_bias": True}
    vision = {"model_type": "radio", "args": args, "patch_size": PATCH, "max_resolution": TABLE}
    vision |= {"preferred_resolution": [SIDE, SIDE]}
    llm = {**text, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    top = {"architectures": ["Llama_Nemotron_Nano_VL"], "model_type": "Llama_Nemotron_Nano_VL"}
    top |= {"llm_config": llm, "vision_config": vision, "force_image_size": SIDE}
    top |= {"downsample_ratio": 0.5, "ps_version": "v2", "image_tag_type": "internvl"}
    top |= {"vit_hidden_size": WIDTH, "projector_hidden_size": PROJ, "template": "llama3-chat"}
    return {**top, "norm_mean": MEAN, "norm_std": STD, "torch_dtype": "float32"}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """(the release-layout dir, (tower, final norm, mlp1, Llama, tokenizer) on its weights)."""
    root = tmp_path_factory.mktemp("nemotron_vl_v1")
    tokenizer, _ = tokenizer_with(SPECIAL, 7)
    text = tiny_config("llama", vocab_size=len(tokenizer)).to_dict()
    llm = transformers.LlamaForCausalLM(transformers.LlamaConfig(**text))
    vision = transformers.RadioConfig(
        hidden_size=WIDTH, num_hidden_layers=12, num_attention_heads=6, mlp_ratio=4.0,
        patch_size=PATCH, image_size=SIDE, max_img_size=TABLE, num_cls_tokens=2,
        num_registers=2, norm_mean=MEAN, norm_std=STD,
    )  # fmt: skip
    torch.manual_seed(5)
    tower = transformers.RadioModel(vision).float().eval()
    norm = torch.nn.LayerNorm(WIDTH, eps=1e-6)
    mlp1 = torch.nn.Sequential(
        torch.nn.LayerNorm(4 * WIDTH),
        torch.nn.Linear(4 * WIDTH, PROJ),
        torch.nn.GELU(),
        torch.nn.Linear(PROJ, int(text["hidden_size"])),
    )
    with torch.no_grad():
        for i, module in enumerate((llm, tower, norm, mlp1)):
            _randomize(module, 5 + i)
        for name, p in tower.named_parameters():
            if ".layer_scale" in name and not name.startswith("encoder.layer.0."):
                p.fill_(1.0)  # absent from the release below: 1, as timm's Identity
    llm.save_pretrained(root / "llm")
    tower.save_pretrained(root / "tower")
    state = {f"language_model.{k}": v for k, v in llm.state_dict().items()}
    for k, v in safetensors.load_file(str(root / "tower" / "model.safetensors")).items():
        if ".layer_scale" in k:
            if ".blocks.0." not in k:
                continue
            k = k.replace("layer_scale1.lambda1", "ls1.gamma")
            k = k.replace("layer_scale2.lambda1", "ls2.gamma")
        state[f"vision_model.{k}"] = v
    state |= {f"vision_model.radio_model.model.norm.{k}": v for k, v in norm.state_dict().items()}
    state |= {f"mlp1.{k}": v for k, v in mlp1.state_dict().items()}
    assert "vision_model.radio_model.model.blocks.0.ls1.gamma" in state, list(state)
    path = root / "remote"
    path.mkdir()
    state = {k: v.contiguous() for k, v in state.items()}
    safetensors.save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    text_fields = {k: v for k, v in text.items() if k not in ("architectures", "model_type")}
    (path / "config.json").write_text(json.dumps(release_config(text_fields)))
    finish_checkpoint(path, tokenizer)
    model = load_hf_vlm(transformers.LlamaForCausalLM, root / "llm")
    return path, (tower, norm, mlp1, model, tokenizer)


def vllm_tiles(image, max_tiles: int = 12) -> torch.Tensor:
    """nemotron_vl.py's tiles of `image` in [0, 1] (the tower normalizes): [tiles, 3, S, S]."""
    w, h = image.size
    pairs = {
        (i, j)
        for n in range(1, max_tiles + 1)
        for i in range(1, n + 1)
        for j in range(1, n + 1)
        if 1 <= i * j <= max_tiles
    }
    best_factor, best = float("-inf"), (1, 1)
    for rw, rh in sorted(pairs, key=lambda p: p[0] * p[1]):
        size = min(rw * rh * SIDE * SIDE / (w * h), 0.6)
        factor = size * min((rw / rh) / (w / h), (w / h) / (rw / rh))
        if factor > best_factor:
            best_factor, best = factor, (rw, rh)
    big = image.convert("RGB").resize((best[0] * SIDE, best[1] * SIDE))
    cols = best[0]
    boxes = [((i % cols) * SIDE, (i // cols) * SIDE) for i in range(best[0] * best[1])]
    tiles = [big.crop((x, y, x + SIDE, y + SIDE)) for x, y in boxes]
    if len(tiles) > 1:
        tiles.append(image.convert("RGB").resize((SIDE, SIDE)))
    arrays = [torch.from_numpy(np.asarray(t, dtype=np.float32) / 255.0) for t in tiles]
    return torch.stack(arrays).permute(0, 3, 1, 2)


def image_rows(ref, image) -> torch.Tensor:
    """The tower, final norm, v2 pixel shuffle and mlp1 on the tiles: [tiles x 16, D]."""
    tower, norm, mlp1 = ref[:3]
    g = SIDE // PATCH
    with torch.no_grad():
        x = norm(tower(vllm_tiles(image)).features)  # [T, g * g, W]
        n = x.shape[0]
        x = x.view(n, g, g // 2, WIDTH * 2).permute(0, 2, 1, 3).reshape(n, g // 2, g // 2, -1)
        x = x.permute(0, 2, 1, 3).reshape(n, -1, 4 * WIDTH)  # InternVL's shuffle, ps v2
        return mlp1(x).flatten(0, 1)


def reference(ref, text: str, images: list):
    """(the prompt ids vLLM makes, greedy with top-5 logprobs over the composed embeddings)."""
    model, tok = ref[3:]
    return hf_greedy_with_img_runs(model, tok, text, [image_rows(ref, im) for im in images])


def test_images_match_reference(ckpt):
    """A one-tile image (square: v1's rule keeps 1 x 1 over the tied 2 x 2), a wide one (3 x 1
    tiles and the thumbnail), two images in one prompt (a tall 1 x 2 grid and a small
    square), and text alone; the prompt's expansion as a literal."""
    path, ref = ckpt
    square, wide = noise_image(1, (40, 40)), noise_image(2, (30, 100))
    tall, small = noise_image(3, (90, 40)), noise_image(4, (20, 24))
    cases = [(PROMPT, [square]), (PROMPT, [wide]), (TWO, [tall, small]), (TEXT, [])]
    llm = engine(path, limit_mm_per_prompt={"image": 2})
    refs = [reference(ref, t, im) for t, im in cases]
    check_engine_matches_hf(llm, cases, refs, "nemotron_vl_v1")  # by text and by expanded ids
    tok = ref[4]
    one = "User: <img>" + "<image>" * 16 + "</img>\nWhat is in it? Assistant:"
    assert refs[0][0] == tok(one).input_ids
    assert len(refs[1][0]) - len(refs[0][0]) == 3 * 16  # 4 tiles


def test_tile_limit_and_refusals(ckpt):
    """mm_processor_kwargs max_num_tiles (1: the wide image in one tile; 0 refused), a video
    request, and config fields not served."""
    from paged_engine.models.nemotron_vl_v1_config import nemotron_vl_v1_config

    path, _ = ckpt
    llm = engine(path)
    wide = {"prompt": PROMPT, "multi_modal_data": {"image": noise_image(2, (30, 100))}}
    capped = {**wide, "mm_processor_kwargs": {"max_num_tiles": 1}}
    few, many = (llm.generate(p, greedy(0, 1))[0].prompt_token_ids for p in (capped, wide))
    assert len(many) - len(few) == 3 * 16  # 3 x 1 tiles and the thumbnail against 1 tile
    with pytest.raises(ValueError, match="max_num_tiles"):
        llm.generate({**wide, "mm_processor_kwargs": {"max_num_tiles": 0}}, greedy(0, 1))
    frames = np.zeros((2, 32, 32, 3), dtype=np.uint8)
    with pytest.raises(ValueError, match="video"):
        llm.generate({"prompt": "<video>", "multi_modal_data": {"video": frames}}, greedy(0))
    raw = json.loads((path / "config.json").read_text())
    raw["image_token_id"] = 3
    no_ps = {k: v for k, v in raw.items() if k != "ps_version"}
    assert nemotron_vl_v1_config(raw).vision_final_norm
    cases = [
        ({"ps_version": "v1"}, "ps_version"),
        ({"llm_config": {**raw["llm_config"], "model_type": "qwen2"}}, "llm_config"),
        ({"force_image_size": 30}, "force_image_size"),
        ({"patch_size": 8}, "patch_size"),
    ]
    with pytest.raises(ValueError, match="ps_version"):
        nemotron_vl_v1_config(no_ps)  # the config class's default: v1
    for change, name in cases:
        with pytest.raises(ValueError, match=name):
            nemotron_vl_v1_config({**raw, **change})
    pooled = {**raw["vision_config"], "args": {**raw["vision_config"]["args"], "gp": "avg"}}
    assert not nemotron_vl_v1_config({**raw, "vision_config": pooled}).vision_final_norm
