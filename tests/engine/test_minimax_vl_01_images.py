"""Images through MiniMax-VL-01 (`MiniMaxVL01ForConditionalGeneration`, remote code:
models/minimax_vl_01_config.py, multimodal/minimax_vl_01.py) against a reference composed here.

transformers has no MiniMax-VL-01 class. vLLM runs it as LLaVA-NeXT's image path over
MiniMax-Text-01, so the reference is transformers' LlavaNextModel's `get_image_features` (CLIP
tower, projector, anyres unpad, image_newline) on pixels made by the release's "anyres"
processor steps written out below (its (width, height) pinpoints, aspect-kept bicubic resize on
black, S x S crops), spliced into transformers' MiniMaxForCausalLM's inputs_embeds. The same
random weights are saved under the release's names with its config.json (text_config in
MiniMax-Text-01's own names) and preprocessor_config.json ("anyres"). paged must give the
reference's prompt ids (each image's run as long as its feature rows), greedy tokens and top-5
logprobs (1e-3, float32); modes and configs it does not serve are refused by name.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hf_reference import assert_matches, hf_greedy
from image_checks import check_config_refused, engine, greedy, noise_image
from test_models_minimax import _RELEASE_NAMES  # MiniMax-Text-01's names for HF's fields
from vlm_checkpoints import finish_checkpoint, load_hf_vlm, tokenizer_with

from paged_engine.testing import _randomize, _save_random, tiny_config

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")
safetensors = pytest.importorskip("safetensors.torch")

SIDE, PATCH = 28, 14
PINPOINTS = [[28, 56], [56, 28], [56, 56]]
MEAN = [0.5, 0.4, 0.3]
STD = [0.25, 0.2, 0.3]
PROMPT = "USER: <image>\nWhat is in it?\nASSISTANT:"
TWO = "USER: <image>\nand <image>\nWhich is brighter?\nASSISTANT:"
TEXT = "USER: Say something about the sea.\nASSISTANT:"
CLIP = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4}
CLIP |= {"num_hidden_layers": 2, "image_size": SIDE, "patch_size": PATCH}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """(the release-layout dir, (HF LlavaNextModel for the images, HF MiniMax, tokenizer))."""
    root = tmp_path_factory.mktemp("minimax_vl")
    tokenizer, ids = tokenizer_with(["<image>"], 6)
    layers = ["linear_attention", "full_attention"]
    text = tiny_config("minimax", vocab_size=520, num_hidden_layers=2, layer_types=layers)
    _save_random(transformers.MiniMaxForCausalLM, text, 6, root / "hf")
    llava = transformers.LlavaNextModel(
        transformers.LlavaNextConfig(
            vision_config=CLIP,
            text_config=tiny_config("llama", hidden_size=text.hidden_size),
            image_grid_pinpoints=PINPOINTS,
            image_token_index=ids["<image>"],
            vision_feature_layer=-1,
        )
    ).eval()
    with torch.no_grad():
        _randomize(llava, 7)
        llava.image_newline.copy_(torch.randn(text.hidden_size) * 0.5)
    state = {  # the release's names: old LLaVA ones around MiniMax-Text-01's
        f"language_model.{k}": v
        for k, v in safetensors.load_file(str(root / "hf" / "model.safetensors")).items()
    }
    for k, v in llava.state_dict().items():
        if k.startswith(("vision_tower.", "multi_modal_projector.", "image_newline")):
            state[k] = v.contiguous()
    path = root / "release"
    path.mkdir()
    safetensors.save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    raw = {k: v for k, v in text.to_dict().items() if k not in ("layer_types", "architectures")}
    for ours, theirs in _RELEASE_NAMES.items():
        raw[theirs] = raw.pop(ours)
    raw |= {"attn_type_list": [int(t == "full_attention") for t in layers], "postnorm": True}
    raw |= {"model_type": "minimax_text_01", "shared_intermediate_size": 0}
    config = {"architectures": ["MiniMaxVL01ForConditionalGeneration"]}
    config |= {"model_type": "minimax_vl_01", "text_config": raw, "vision_config": CLIP}
    config |= {"image_token_index": ids["<image>"], "image_grid_pinpoints": PINPOINTS}
    config |= {"vision_feature_layer": -1, "vision_feature_select_strategy": "default"}
    config |= {"projector_hidden_act": "gelu", "process_image_mode": "anyres"}
    (path / "config.json").write_text(json.dumps(config))
    processor = {"image_processor_type": "ImageProcessor", "process_image_mode": "anyres"}
    processor |= {"size": [SIDE, SIDE], "image_mean": MEAN, "image_std": STD}
    processor |= {"image_grid_pinpoints": PINPOINTS, "patch_size": PATCH}
    (path / "preprocessor_config.json").write_text(json.dumps(processor))
    finish_checkpoint(path, tokenizer)
    model = load_hf_vlm(transformers.MiniMaxForCausalLM, root / "hf")
    return path, (llava, model, tokenizer, ids["<image>"])


def release_views(image) -> torch.Tensor:
    """The release processor's anyres steps on one image: [1 + tiles, 3, S, S]."""
    w, h = image.size
    best, most, waste = None, -1, float("inf")
    for pw, ph in PINPOINTS:  # read as (width, height), the image as (width, height)
        scale = min(pw / w, ph / h)
        kept = min(int(w * scale) * int(h * scale), w * h)
        if kept > most or (kept == most and pw * ph - kept < waste):
            best, most, waste = (pw, ph), kept, pw * ph - kept
    bw, bh = best
    if w / h > bw / bh:
        new_h = int(bw * h / w)
        scaled, at = image.resize((bw, new_h), Image.BICUBIC), (0, (bh - new_h) // 2)
    else:
        new_w = int(bh * w / h)
        scaled, at = image.resize((new_w, bh), Image.BICUBIC), ((bw - new_w) // 2, 0)
    canvas = Image.new("RGB", (bw, bh), (0, 0, 0))
    canvas.paste(scaled, at)
    views = [image.resize((SIDE, SIDE), Image.BICUBIC)]
    views += [
        canvas.crop((j, i, j + SIDE, i + SIDE))
        for i in range(0, bh, SIDE)
        for j in range(0, bw, SIDE)
    ]
    arr = np.stack([np.asarray(v, dtype=np.float32) / 255 for v in views])
    arr = (arr - np.float32(MEAN)) / np.float32(STD)
    return torch.from_numpy(arr).permute(0, 3, 1, 2)


def reference(ref, text: str, images: list):
    """(prompt ids: "<image>" -> one placeholder a feature row; greedy with top-5)."""
    llava, model, tokenizer, image_id = ref
    rows = []
    for image in images:
        views = release_views(image)
        sizes = torch.tensor([[image.size[1], image.size[0]]])
        with torch.no_grad():
            out = llava.get_image_features(
                views, sizes, vision_feature_layer=-1, vision_feature_select_strategy="default"
            )
        rows.append(torch.cat(list(out.pooler_output)))
    ids: list[int] = []
    for i, chunk in enumerate(text.split("<image>")):
        if i:
            ids += [image_id] * rows[i - 1].shape[0]
        ids += tokenizer(chunk).input_ids
    if not images:
        return ids, hf_greedy(model, ids, 8, 5)
    with torch.no_grad():
        embeds = model.get_input_embeddings()(torch.tensor([ids]))
        embeds[0, torch.tensor(ids) == image_id] = torch.cat(rows)
    return ids, hf_greedy(model, ids, 8, 5, inputs_embeds=embeds)


def test_images_match_reference(ckpt):
    """A wide image (1 x 2 tiles, rows cut), text alone, a tall one (2 x 1) with a small
    square one (2 x 2) in one prompt: the reference's runs, tokens and logprobs."""
    path, ref = ckpt
    cases = [
        (PROMPT, [noise_image(1, (30, 70))]),
        (TEXT, []),
        (TWO, [noise_image(2, (80, 33)), noise_image(3, (20, 20))]),
    ]
    llm = engine(path, max_model_len=256, limit_mm_per_prompt={"image": 2})
    prompts = [{"prompt": t, "multi_modal_data": {"image": ims}} if ims else t for t, ims in cases]
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    for (text, images), out in zip(cases, outs, strict=True):
        ids, want = reference(ref, text, images)
        assert out.prompt_token_ids == ids  # each run as long as the image's feature rows
        assert_matches(f"minimax-vl-01 {len(images)} image(s)", out, want)
    assert len({len(o.prompt_token_ids) for o in outs}) == 3
    bad = {**prompts[0], "mm_processor_kwargs": {"do_resize": False}}
    with pytest.raises(ValueError, match=r"mm_processor_kwargs\['do_resize'\]"):
        llm.generate([bad], greedy(0), use_tqdm=False)
    assert llm.generate(prompts[:1], greedy(), use_tqdm=False)[0].outputs[0].token_ids == (
        outs[0].outputs[0].token_ids
    )  # served on after the refusal


def test_pixels_are_the_release_processors(ckpt):
    """The layout's processor gives the release's anyres views over shapes from thin strips
    to squares below and above the pinpoints (a square one: the tie the two rules break
    differently); a 1-pixel strip, whose scaled side the release floors to 0, is served."""
    from paged_engine.multimodal.processor import ImageProcessor

    path, _ = ckpt
    images = engine(path, max_model_len=256).llm_engine.input_processor.images
    assert isinstance(images, ImageProcessor)
    for size in [(5, 90), (90, 5), (28, 28), (29, 57), (57, 29), (100, 100), (31, 45)]:
        image = noise_image(sum(size), size)
        out = images.hf([image])
        assert tuple(out["image_sizes"][0]) == size
        torch.testing.assert_close(out["pixel_values"][0], release_views(image), rtol=0, atol=1e-5)
    strip = images.hf([noise_image(0, (1, 300))])["pixel_values"][0]  # the release fails here
    assert strip.shape == (3, 3, SIDE, SIDE)


@pytest.mark.parametrize(
    ("where", "change", "match"),
    [
        ("config", {"process_image_mode": "dynamic_res"}, "process_image_mode='dynamic_res'"),
        ("processor", {"process_image_mode": "resize"}, "process_image_mode='resize'"),
        ("processor", {"image_grid_pinpoints": [[28, 56], [56, 28]]}, "image_grid_pinpoints"),
        ("processor", {"size": [28, 56]}, "size"),
        ("config", {"image_grid_pinpoints": [[28, 56], [56, 56]]}, "transpose"),
        ("config", {"vision_config": {**CLIP, "model_type": "siglip_vision_model"}}, "clip"),
    ],
)
def test_unserved_settings_refused_by_name(ckpt, tmp_path, where, change, match):
    path, _ = ckpt
    if where == "config":
        config = {**json.loads((path / "config.json").read_text()), **change}
        check_config_refused(path, tmp_path / "bad", config, match)
        return
    out = tmp_path / "bad"
    out.mkdir()
    for f in path.iterdir():
        if f.name != "preprocessor_config.json":
            (out / f.name).symlink_to(f)
    saved = {**json.loads((path / "preprocessor_config.json").read_text()), **change}
    (out / "preprocessor_config.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=match):
        engine(out, max_model_len=256)
