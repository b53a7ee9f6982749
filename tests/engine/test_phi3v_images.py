"""Images through Phi-3-vision / Phi-3.5-vision (`Phi3VForCausalLM`, remote code:
multimodal/phi3v.py, models/phi3v_config.py) against a reference composed here.

transformers has no Phi-3-vision class, so the reference is written out in this file from the
remote code (as vLLM's phi3v.py restates it): the HD resize / white padding / crops and CLIP
normalization of the image, transformers' CLIPVisionModel on the views (hidden_states[-2],
CLS dropped), the 2 x 2 merge, sub_GN / glb_GN separators and the GELU projection, and the
rows spliced into HF Phi3ForCausalLM's inputs_embeds at the image runs; greedy `generate`.
The same random weights are saved in the release's layout (`model.vision_embed_tokens.*`
beside Phi-3's names) with a Phi-3.5-vision config.json (embd_layer, img_processor; a tiny
CLIP of 336-pixel crops in 14-pixel patches given as `vision_config`) and a
preprocessor_config.json (num_crops 2). paged must give the reference's prompt ids, greedy
tokens and top-5 logprobs (1e-3, float32) for one image, two (<|image_1|>, <|image_2|>), text
alone and a per-request num_crops; bad tags, num_crops out of bounds and config fields the
path does not serve are refused by name.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hf_reference import assert_matches, hf_greedy
from image_checks import engine, greedy, noise_image
from vlm_checkpoints import finish_checkpoint, load_hf_vlm, tokenizer_with

from paged_engine.multimodal.phi3v import MOST_CROPS
from paged_engine.testing import _randomize, _save_random, tiny_config

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")
safetensors = pytest.importorskip("safetensors.torch")

IMAGE_ID, SIDE, CROPS = 32044, 336, 2
PROMPT = "<|user|>\n<|image_1|>\nDescribe it.<|end|>\n<|assistant|>\n"
TWO = "<|user|>\n<|image_1|>\nand <|image_2|>\nWhich is brighter?<|end|>\n<|assistant|>\n"
TEXT = "<|user|>\nSay something about the sea.<|end|>\n<|assistant|>\n"
# Phi-3.5-vision's chat template (string content: the engine writes "<|image_N|>" lines)
TEMPLATE = (
    "{% for message in messages %}{{'<|' + message['role'] + '|>' + '\\n' + message['content']"
    " + '<|end|>\\n' }}{% endfor %}{% if add_generation_prompt and messages[-1]['role'] != "
    "'assistant' %}{{- '<|assistant|>\\n' -}}{% endif %}"
)
MEAN = np.array([0.48145466, 0.4578275, 0.40821073], dtype=np.float32)
STD = np.array([0.26862954, 0.26130258, 0.27577711], dtype=np.float32)
CLIP = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4}
CLIP |= {"num_hidden_layers": 2, "image_size": SIDE, "patch_size": 14, "hidden_act": "quick_gelu"}
EMBD = {"embedding_cls": "image", "hd_transform_order": "sub_glb", "projection_cls": "mlp"}
EMBD |= {"use_hd_transform": True, "with_learnable_separator": True}
IMG = {"image_dim_out": 32, "model_name": "openai/clip-vit-large-patch14-336"}
IMG |= {"name": "clip_vision_model", "num_img_tokens": 144, "layer_idx": -2}
IMG |= {"type_feature": "patch"}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """(the remote-layout dir, the reference: HF Phi-3, CLIP, separators, projection)."""
    root = tmp_path_factory.mktemp("phi3v")
    tokenizer, _ = tokenizer_with(["<|user|>", "<|end|>", "<|assistant|>"], 3)
    text = tiny_config("phi3", vocab_size=32064, max_position_embeddings=4096)
    text.original_max_position_embeddings, text.sliding_window = 4096, None
    _save_random(transformers.Phi3ForCausalLM, text, 3, root / "hf")
    clip = transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**CLIP)).float().eval()
    with torch.no_grad():
        _randomize(clip, 4)
    gen = torch.Generator().manual_seed(5)
    width, hidden = 4 * CLIP["hidden_size"], text.hidden_size
    head = {
        "glb_GN": torch.randn(1, 1, width, generator=gen),
        "sub_GN": torch.randn(1, 1, 1, width, generator=gen),
        "img_projection.0.weight": torch.randn(hidden, width, generator=gen) * width**-0.5,
        "img_projection.0.bias": torch.randn(hidden, generator=gen) * 0.1,
        "img_projection.2.weight": torch.randn(hidden, hidden, generator=gen) * hidden**-0.5,
        "img_projection.2.bias": torch.randn(hidden, generator=gen) * 0.1,
    }
    path = root / "remote"
    path.mkdir()
    state = dict(safetensors.load_file(str(root / "hf" / "model.safetensors")))
    tower = {  # the release's names (transformers 5's state dict drops `vision_model.`)
        "img_processor.vision_model." + k.removeprefix("vision_model."): v
        for k, v in clip.state_dict().items()
        if "position_ids" not in k
    }
    state |= {
        f"model.vision_embed_tokens.{k}": v.contiguous() for k, v in {**tower, **head}.items()
    }
    # the remote model's image embedding holds the token table as `wte` (the same tensor)
    state["model.vision_embed_tokens.wte.weight"] = state["model.embed_tokens.weight"].clone()
    safetensors.save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = {**text.to_dict(), "architectures": ["Phi3VForCausalLM"], "model_type": "phi3_v"}
    config |= {"auto_map": {"AutoConfig": "configuration_phi3_v.Phi3VConfig"}}
    config |= {"embd_layer": EMBD, "img_processor": IMG, "vision_config": CLIP}
    (path / "config.json").write_text(json.dumps(config))
    processor = {"num_crops": CROPS, "image_mean": MEAN.tolist(), "image_std": STD.tolist()}
    processor |= {"image_processor_type": "Phi3VImageProcessor", "num_img_tokens": 144}
    (path / "preprocessor_config.json").write_text(json.dumps(processor))
    finish_checkpoint(path, tokenizer, TEMPLATE)
    model = load_hf_vlm(transformers.Phi3ForCausalLM, root / "hf")
    return path, (model, clip, head, tokenizer)


def hd_views(image, num_crops: int) -> torch.Tensor:
    """The remote image processor on one image: [1 + crops, 3, 336, 336], global first."""
    w, h = image.size
    flip = w < h
    if flip:
        image, (w, h) = image.transpose(Image.Transpose.TRANSPOSE), (h, w)
    ratio, scale = w / h, 1
    while scale * np.ceil(scale / ratio) <= num_crops:
        scale += 1
    new_w = int((scale - 1) * SIDE)
    new_h = int(new_w / ratio)
    arr = np.asarray(image.resize((new_w, new_h), Image.Resampling.BILINEAR))
    tall = int(np.ceil(new_h / SIDE) * SIDE)
    top = int((tall - new_h) / 2)
    arr = np.pad(arr, ((top, tall - new_h - top), (0, 0), (0, 0)), constant_values=255)
    if flip:
        arr = arr.transpose(1, 0, 2)
    x = torch.from_numpy((arr.astype(np.float32) / 255 - MEAN) / STD).permute(2, 0, 1)
    hc, wc = x.shape[1] // SIDE, x.shape[2] // SIDE
    crops = x.reshape(1, 3, hc, SIDE, wc, SIDE).permute(0, 2, 4, 1, 3, 5).reshape(-1, 3, SIDE, SIDE)
    whole = F.interpolate(x[None], size=(SIDE, SIDE), mode="bicubic")
    return torch.cat([whole, crops]), hc, wc


def image_rows(ref, image, num_crops: int) -> torch.Tensor:
    """The remote image embedding (hd_transform_order "sub_glb") of one image."""
    _, clip, head, _ = ref
    views, hc, wc = hd_views(image, num_crops)
    with torch.no_grad():
        feats = clip(views, output_hidden_states=True).hidden_states[-2][:, 1:]
    c = feats.shape[-1]

    def merge(x, h_crop, w_crop):  # [n, 576, C] -> [12 h_crop, 12 w_crop + 1, 4C]
        x = x.reshape(-1, 12, 2, 12, 2, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, 144, 4 * c)
        x = x.reshape(h_crop, w_crop, 12, 12, 4 * c).permute(0, 2, 1, 3, 4)
        x = x.reshape(h_crop * 12, w_crop * 12, 4 * c)
        return torch.cat([x, head["sub_GN"][0].expand(h_crop * 12, 1, 4 * c)], dim=1)

    rows = torch.cat(
        [
            merge(feats[1:], hc, wc).reshape(-1, 4 * c),
            head["glb_GN"][0],
            merge(feats[:1], 1, 1).reshape(-1, 4 * c),
        ]
    )
    up = F.linear(rows, head["img_projection.0.weight"], head["img_projection.0.bias"])
    out = F.linear(F.gelu(up), head["img_projection.2.weight"], head["img_projection.2.bias"])
    assert out.shape[0] == (hc * wc + 1) * 144 + 1 + (hc + 1) * 12
    return out


def reference(ref, text: str, images: list, num_crops: int = CROPS):
    """(the remote processor's prompt ids, placeholders as 32044; greedy with top-5)."""
    model, _, _, tokenizer = ref
    chunks = re.split(r"<\|image_\d+\|>", text)
    rows = [image_rows(ref, im, num_crops) for im in images]
    ids: list[int] = []
    for i, chunk in enumerate(chunks):
        if i:
            ids += [IMAGE_ID] * rows[i - 1].shape[0]
        ids += tokenizer(chunk).input_ids
    if not images:
        return ids, hf_greedy(model, ids, 8, 5)
    with torch.no_grad():
        embeds = model.get_input_embeddings()(torch.tensor([ids]))
        embeds[0, torch.tensor(ids) == IMAGE_ID] = torch.cat(rows)
    return ids, hf_greedy(model, ids, 8, 5, inputs_embeds=embeds)


def _llm(path):
    return engine(path, max_model_len=2048, limit_mm_per_prompt={"image": 2})


def test_images_match_reference(ckpt):
    """One wide image (2 crops), two (a tall one: the transposed path; a small one), text
    alone, and the wide image with mm_processor_kwargs num_crops 1 (one crop)."""
    path, ref = ckpt
    wide, tall, small = (
        noise_image(1, (40, 110)),
        noise_image(2, (90, 30)),
        noise_image(3, (20, 24)),
    )
    cases = [(PROMPT, [wide], CROPS), (TWO, [tall, small], CROPS), (TEXT, [], CROPS)]
    cases.append((PROMPT, [wide], 1))
    prompts = []
    for text, images, crops in cases:
        prompt = {"prompt": text, "multi_modal_data": {"image": images}} if images else text
        if crops != CROPS:
            prompt["mm_processor_kwargs"] = {"num_crops": crops}
        prompts.append(prompt)
    outs = _llm(path).generate(prompts, greedy(), use_tqdm=False)
    for (text, images, crops), out in zip(cases, outs, strict=True):
        ids, want = reference(ref, text, images, crops)
        assert out.prompt_token_ids == ids
        assert_matches(f"phi3v {len(images)} image(s), num_crops {crops}", out, want)
    assert len(outs[0].prompt_token_ids) > len(outs[3].prompt_token_ids)  # 2 crops vs 1


def test_bad_requests_refused_by_name(ckpt):
    """A tag without its image (<|image_3|> with two), a tag count off, num_crops out of
    bounds: ValueErrors naming what is wrong; the engine serves on."""
    path, _ = ckpt
    llm = _llm(path)
    one, two = noise_image(4, (30, 30)), [noise_image(5, (30, 30)), noise_image(6, (30, 30))]
    three = TWO.replace("<|image_2|>", "<|image_3|>")
    cases = [
        ({"prompt": three, "multi_modal_data": {"image": two}}, r"<\|image_3\|>"),
        ({"prompt": TWO, "multi_modal_data": {"image": [one]}}, r"1 image\(s\).*<\|image_2\|>"),
        ({"prompt": PROMPT, "multi_modal_data": {"image": two}}, r"2 image\(s\)"),
    ]
    for crops in (0, "4", MOST_CROPS + 1):  # (the bound keeps the HD image under MOST_PIXELS)
        bad = {"prompt": PROMPT, "multi_modal_data": {"image": one}}
        cases.append(({**bad, "mm_processor_kwargs": {"num_crops": crops}}, "num_crops"))
    for bad, match in cases:
        with pytest.raises(ValueError, match=match):
            llm.generate([bad], greedy(0), use_tqdm=False)
    out = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": one}}], greedy(0))
    assert len(out[0].outputs[0].token_ids) == 8


def test_chunks_ahead_and_embeds_give_the_plain_tokens(ckpt):
    """Against a plain run of one image: 64-token chunks through its run; the image processed
    ahead (`ImageProcessor.process`) with the expanded ids; the encoder's rows given as
    image embeddings at the <|image_1|> tag; `LLM.chat` with an image part (the template's
    string content: "<|image_1|>" written before the text, as vLLM does)."""
    from vlm_checkpoints import encoder_from_checkpoint

    from paged_engine.models.phi3v_config import phi3v_config

    path, _ = ckpt
    image = noise_image(7, (50, 70))
    prompt = {"prompt": PROMPT, "multi_modal_data": {"image": image}}
    llm = _llm(path)
    plain = llm.generate([prompt], greedy(0), use_tqdm=False)[0].outputs[0].token_ids
    chunked = engine(
        path, max_model_len=2048, max_num_batched_tokens=64, enable_chunked_prefill=True
    )
    chunked_prefill = chunked.generate([prompt], greedy(0), use_tqdm=False)[0]
    assert chunked_prefill.outputs[0].token_ids == plain
    images = llm.llm_engine.input_processor.images
    ids, done = images.process(llm.get_tokenizer().encode(PROMPT), [image])
    ahead = {"prompt_token_ids": ids, "multi_modal_data": {"image": list(done)}}
    assert llm.generate([ahead], greedy(0), use_tqdm=False)[0].outputs[0].token_ids == plain
    config = phi3v_config(json.loads((path / "config.json").read_text()))
    with torch.no_grad():
        rows = encoder_from_checkpoint(path, config).encode(done)[0]
    embeds = {"prompt": PROMPT, "multi_modal_data": {"image": [rows]}}
    out = llm.generate([embeds], greedy(0), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids and out.outputs[0].token_ids == plain
    parts = [{"type": "image_pil", "image_pil": image}, {"type": "text", "text": "Describe it."}]
    (out,) = llm.chat([{"role": "user", "content": parts}], greedy(0), use_tqdm=False)
    assert out.prompt_token_ids == ids and out.outputs[0].token_ids == plain


@pytest.mark.parametrize(
    ("section", "field", "value"),
    [
        ("embd_layer", "hd_transform_order", "glb_sub"),
        ("embd_layer", "use_hd_transform", False),
        ("img_processor", "type_feature", "cls_patch"),
        ("img_processor", "layer_idx", 1),
        ("img_processor", "image_dim_out", 64),
        ("vision_config", "image_size", 224),
    ],
)
def test_config_fields_refused_by_name(ckpt, section, field, value):
    from paged_engine.models.phi3v_config import phi3v_config

    raw = json.loads((ckpt[0] / "config.json").read_text())
    raw[section] = {**raw[section], field: value}
    with pytest.raises(ValueError, match=rf"{section}\.{field}"):
        phi3v_config(raw)


def test_token_count_follows_the_release_formula():
    """(h // 336 * w // 336 + 1) * 144 + 1 + (h // 336 + 1) * 12 over HD sizes."""
    from paged_engine.multimodal.phi3v import hd_size, image_tokens

    for w, h, crops in ((1000, 500, 16), (500, 1000, 16), (336, 336, 4), (50, 8000, 16)):
        new_w, new_h, flip = hd_size(w, h, crops)
        padded = math.ceil(new_h / SIDE) * SIDE
        hh, ww = (new_w, padded) if flip else (padded, new_w)
        assert hh // SIDE * (ww // SIDE) <= crops
        want = (hh // SIDE * (ww // SIDE) + 1) * 144 + 1 + (hh // SIDE + 1) * 12
        assert image_tokens(hh // SIDE, ww // SIDE) == want
