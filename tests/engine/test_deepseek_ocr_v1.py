"""Images through DeepSeek-OCR v1 (`DeepseekOCRForCausalLM`, remote code: multimodal/
deepseek_ocr_v1.py, deepseek_ocr_v1_encoder.py, models/deepseek_ocr_v1_config.py) against a
reference composed here from transformers' modules.

transformers has no DeepSeek-OCR v1 class. Its parts are: SAM ViT-B with neck and two stride-2
convs (transformers' DeepseekOcr2SamVisionEncoder: the same maths, pos_embed and relative
position tables resized alike), CLIP-L's pre_layrnorm and encoder (transformers' CLIPVisionModel)
fed SAM's grid in place of its patch embedding, and DeepSeek-V2's multi-head-attention MoE
decoder (transformers' DeepseekOcr2 text model). The glue written here from vLLM's
deepseek_ocr.py / deepencoder.py / processors/deepseek_ocr.py: the processor (crops by the
closest tile ratio, the padded global view), CLIP's CLS and resized position embeddings, the
linear projector, image_newline after each row, the crops' grid before the global view and
view_seperator last. The same random weights are saved in the release's layout (`model.sam_model`
/ `model.vision_model` with CLIP's fused qkv_proj / `model.projector.layers`, the decoder's
experts one by one) with a config.json shaped as the release's (language_config, a
vision_config.width of tiny towers). paged must give the reference's prompt ids, greedy tokens
and top-5 logprobs (1e-3, float32).
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hf_reference import assert_matches, hf_greedy_with_rows
from image_checks import check_config_refused, engine, greedy, noise_image
from vlm_checkpoints import finish_checkpoint, image_run_ids, load_hf_vlm, tokenizer_with

from paged_engine.testing import _randomize, _save_random

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")
ImageOps = pytest.importorskip("PIL.ImageOps")
safetensors = pytest.importorskip("safetensors.torch")

PROMPT = "<image>\nFree OCR."
TWO = "<image>\nand\n<image>\nconvert to markdown."
TEXT = "the sea is wide and the sky is grey"
TINY = {"base_size": 256, "image_size": 128}  # gundam's 1024 / 640, by 4 and 5
SAM = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 128}
SAM |= {"global_attn_indexes": [1], "downsample_channels": [32, 64], "mlp_dim": 128}
CLIP = {"hidden_size": 64, "intermediate_size": 256, "num_attention_heads": 4}
CLIP |= {"num_hidden_layers": 2, "image_size": 28, "patch_size": 14, "hidden_act": "quick_gelu"}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """(the release-layout dir, the reference: HF DeepSeek-OCR-2 (SAM, decoder), CLIP, head)."""
    root = tmp_path_factory.mktemp("deepseek_ocr_v1")
    tokenizer, ids = tokenizer_with(["<image>"], 3)
    text = {"vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 96}
    text |= {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4}
    text |= {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    text |= {"n_shared_experts": 1, "routed_scaling_factor": 1.5, "topk_method": "greedy"}
    text |= {"mlp_layer_types": ["dense", "sparse"], "rms_norm_eps": 1e-6}
    text |= {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    text |= {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    encoder = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1}
    encoder |= {"num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 8}
    config = transformers.DeepseekOcr2Config(
        text_config=text,
        vision_config={"sam_config": SAM, "encoder_config": encoder},
        image_token_id=ids["<image>"],
    )
    cls = transformers.DeepseekOcr2ForConditionalGeneration
    _save_random(cls, config, 5, root / "hf")
    clip = transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**CLIP)).float().eval()
    with torch.no_grad():
        _randomize(clip, 4)
    gen = torch.Generator().manual_seed(6)
    width, hidden = 64 + CLIP["hidden_size"], text["hidden_size"]
    head = {
        "projector.layers.weight": torch.randn(hidden, width, generator=gen) * width**-0.5,
        "projector.layers.bias": torch.randn(hidden, generator=gen) * 0.1,
        "image_newline": torch.randn(hidden, generator=gen),
        "view_seperator": torch.randn(hidden, generator=gen),
    }
    path = root / "remote"
    path.mkdir()
    safetensors.save_file(release_state(root / "hf", clip, head), str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(release_config(text, ids["<image>"])))
    finish_checkpoint(path, tokenizer)
    return path, (load_hf_vlm(cls, root / "hf"), clip, head, tokenizer)


def release_state(hf_dir, clip, head) -> dict[str, torch.Tensor]:
    """The release's tensors: transformers saves DeepSeek-OCR-2 in the Hub's names, which are
    v1's for SAM (`model.sam_model.blocks ...`) and the decoder (`model.layers`, experts one
    by one); its Qwen2 query tower and projector dropped for CLIP (qkv fused as the release
    has it) and the v1 head."""
    out = {
        k: v
        for k, v in safetensors.load_file(str(hf_dir / "model.safetensors")).items()
        if not k.startswith(("model.qwen2_model.", "model.projector.", "model.view_sep"))
    }
    assert any(k.startswith("model.sam_model.blocks.") for k in out)
    assert any(".mlp.experts.0.gate_proj." in k for k in out)
    tower = {k.removeprefix("vision_model."): v for k, v in clip.state_dict().items()}
    for name, t in tower.items():
        if "position_ids" in name or name.startswith("post_layernorm"):
            continue
        if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            continue
        if ".self_attn.q_proj." in name:  # the release fuses q / k / v (vLLM's qkv_proj)
            t = torch.cat([tower[name.replace("q_proj", f"{p}_proj")] for p in "qkv"])
            name = name.replace("q_proj", "qkv_proj")
        name = name.replace("encoder.layers.", "transformer.layers.")
        out[f"model.vision_model.{name}"] = t
    out |= {f"model.{k}": v for k, v in head.items()}
    return {k: v.contiguous() for k, v in out.items()}


def release_config(text: dict, image_id: int) -> dict:
    """config.json as the release writes it (its fields, tiny values), plus image_token_id
    (the release's tokenizer has "<image>" at 128815, the default; this tokenizer has not)."""
    lang = {k: text[k] for k in ("vocab_size", "hidden_size", "intermediate_size")}
    lang |= {k: text[k] for k in ("num_hidden_layers", "num_attention_heads", "bos_token_id")}
    lang |= {k: text[k] for k in ("num_key_value_heads", "n_routed_experts", "eos_token_id")}
    lang |= {k: text[k] for k in ("num_experts_per_tok", "moe_intermediate_size")}
    lang |= {k: text[k] for k in ("n_shared_experts", "routed_scaling_factor", "topk_method")}
    lang |= {"first_k_dense_replace": 1, "kv_lora_rank": None, "q_lora_rank": None}
    lang |= {"qk_nope_head_dim": 0, "qk_rope_head_dim": 0, "v_head_dim": 0, "use_mla": False}
    lang |= {"n_group": 1, "topk_group": 1, "lm_head": True, "rm_head": False}
    lang |= {"max_position_embeddings": 8192, "torch_dtype": "float32"}
    sam = {"width": SAM["hidden_size"], "layers": SAM["num_hidden_layers"], "heads": 2}
    sam |= {"global_attn_indexes": SAM["global_attn_indexes"], "downsample_channels": [32, 64]}
    clip = {"width": CLIP["hidden_size"], "layers": CLIP["num_hidden_layers"], "heads": 4}
    clip |= {"image_size": CLIP["image_size"], "patch_size": CLIP["patch_size"]}
    vision = {"image_size": SAM["image_size"], "mlp_ratio": 3.7362, "model_name": "deeplip_b_l"}
    vision |= {"model_type": "vision", "width": {"clip-l-14-224": clip, "sam_vit_b": sam}}
    projector = {"input_dim": 64 + CLIP["hidden_size"], "model_type": "mlp_projector"}
    projector |= {"n_embed": text["hidden_size"], "projector_type": "linear"}
    top = {"architectures": ["DeepseekOCRForCausalLM"], "model_type": "deepseek_vl_v2"}
    top |= {"language_config": {"architectures": ["DeepseekV2ForCausalLM"], **lang}}
    top |= {"projector_config": projector, "vision_config": vision, "tile_tag": "2D"}
    top |= {"global_view_pos": "head", "candidate_resolutions": [[1024, 1024]]}
    return {**lang, **top, "image_token_id": image_id}


def views(image, base: int, crop: int, crop_mode: bool):
    """vLLM's DeepseekOCRProcessor on one image: (global [1, 3, B, B], crops, (wt, ht))."""
    w, h = image.size
    wt = ht = 1
    crops = []
    if crop_mode and (w > 640 or h > 640):
        ratios = sorted(
            {(i, j) for i in range(1, 7) for j in range(1, 7) if 2 <= i * j <= 6},
            key=lambda r: r[0] * r[1],
        )
        best = float("inf")
        for i, j in ratios:
            diff = abs(w / h - i / j)
            if diff < best:
                best, (wt, ht) = diff, (i, j)
            elif diff == best and w * h > 0.5 * crop * crop * i * j:
                wt, ht = i, j
        big = image.resize((crop * wt, crop * ht))
        boxes = [
            (c * crop, r * crop, c * crop + crop, r * crop + crop)
            for r in range(ht)
            for c in range(wt)
        ]
        crops = [big.crop(b) for b in boxes]
    if crop <= 640 and not crop_mode:
        image = image.resize((crop, crop))
    whole = ImageOps.pad(image, (base, base), color=(127, 127, 127))

    def tensor(im):
        return torch.from_numpy((np.asarray(im, dtype=np.float32) / 255 - 0.5) / 0.5).permute(
            2, 0, 1
        )

    stack = torch.stack([tensor(c) for c in crops]) if crops else None
    return tensor(whole)[None], stack, (wt, ht)


def encoded(ref, pixels: torch.Tensor) -> torch.Tensor:
    """[N, 3, S, S] -> [N, g, g, hidden]: HF's SAM encoder, HF CLIP's layers, the projector."""
    hf, clip, head, _ = ref
    with torch.no_grad():
        sam = hf.model.vision_tower.sam_encoder(pixel_values=pixels).last_hidden_state
        patches = sam.flatten(2).transpose(1, 2)  # [N, L, C]
        vm = clip  # transformers 5: the tower at the top level
        pos = vm.embeddings.position_embedding.weight
        d, src, side = pos.shape[1], round((pos.shape[0] - 1) ** 0.5), sam.shape[-1]
        grid = pos[1:]
        if src != side:  # vLLM's DeepCLIPVisionEmbeddings.get_abs_pos
            grid = grid.view(1, src, src, d).permute(0, 3, 1, 2)
            grid = F.interpolate(grid, (side, side), mode="bicubic", antialias=True)
            grid = grid.permute(0, 2, 3, 1).reshape(-1, d)
        cls = vm.embeddings.class_embedding.expand(len(pixels), 1, d)
        x = torch.cat([cls, patches], 1) + torch.cat([pos[:1], grid])[None]
        x = vm.encoder(inputs_embeds=vm.pre_layrnorm(x)).last_hidden_state[:, 1:]
        w, b = head["projector.layers.weight"], head["projector.layers.bias"]
        out = F.linear(torch.cat([x, patches], -1), w, b)
    return out.view(len(pixels), side, side, -1)


def image_rows(ref, image, base: int, crop: int, crop_mode: bool) -> torch.Tensor:
    _, _, head, _ = ref
    whole, crops, (wt, ht) = views(image, base, crop, crop_mode)

    def rows(grid):  # [H, W, D] -> each row, then image_newline
        nl = head["image_newline"].view(1, 1, -1).expand(grid.shape[0], 1, -1)
        return torch.cat([grid, nl], 1).flatten(0, 1)

    parts = []
    if crops is not None:
        t = encoded(ref, crops)
        g = t.shape[1]
        parts.append(
            rows(t.view(ht, wt, g, g, -1).permute(0, 2, 1, 3, 4).reshape(ht * g, wt * g, -1))
        )
    parts += [rows(encoded(ref, whole)[0]), head["view_seperator"][None]]
    out = torch.cat(parts)
    nb, nr = math.ceil(base // 16 / 4), math.ceil(crop // 16 / 4)
    assert out.shape[0] == nb * (nb + 1) + 1 + (ht * nr * (wt * nr + 1) if crops is not None else 0)
    return out


def reference(ref, text: str, images: list, kw: dict):
    """(vLLM's prompt ids: each "<image>" a run of its rows; greedy with top-5)."""
    model, _, _, tokenizer = ref
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    rows = [
        image_rows(ref, im, kw["base_size"], kw["image_size"], kw.get("crop_mode", True))
        for im in images
    ]
    ids = image_run_ids(tokenizer, text, "<image>", rows)
    return ids, hf_greedy_with_rows(model, ids, image_id, rows)


def test_images_match_reference(ckpt):
    """A wide image (4 x 1 crops: a tie of tile ratios going to the later one), two images
    (a tall one in 1 x 6 crops, a small one uncropped), text alone, a 3 x 2 grid of crops, and
    the wide image in a base-like mode (crop_mode False, image_size = base_size). Global views
    at 256 pixels and crops at 128 make SAM grids of 16 and 8 (its 8 x 8 pos_embed and 15-row
    global relative tables resized for the global view) and CLIP grids of 4 and 2 (its 2 x 2
    position grid resized for the global view)."""
    path, ref = ckpt
    wide, tall, small = (
        noise_image(1, (200, 700)),
        noise_image(2, (900, 150)),
        noise_image(3, (80, 100)),
    )
    base_like = {"base_size": 128, "image_size": 128, "crop_mode": False}
    grid = noise_image(4, (700, 1000))  # 3 x 2 crops: rows of tiles side by side
    cases = [(PROMPT, [wide], TINY), (TWO, [tall, small], TINY), (TEXT, [], TINY)]
    cases += [(PROMPT, [grid], TINY)]
    cases.append((PROMPT, [wide], base_like))
    prompts = []
    for text, images, kw in cases:
        prompts.append(
            {"prompt": text, "multi_modal_data": {"image": images}, "mm_processor_kwargs": kw}
            if images
            else text
        )
    llm = engine(path, max_model_len=512, limit_mm_per_prompt={"image": 2})
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    for (text, images, kw), out in zip(cases, outs, strict=True):
        ids, want = reference(ref, text, images, kw)
        assert out.prompt_token_ids == ids
        assert_matches(f"deepseek_ocr_v1 {len(images)} image(s) {kw}", out, want)
    assert len(outs[0].prompt_token_ids) > len(outs[-1].prompt_token_ids)  # 4 crops vs none


def test_chunks_cache_ahead_and_embeds_give_the_plain_tokens(ckpt):
    """Against a plain run of one cropped image (the engine's mm_processor_kwargs): 8-token
    chunks through its run; a prefix-cache hit on it; the image processed ahead
    (`ImageProcessor.process`) with the expanded ids; the encoder's rows given as image
    embeddings at its "<image>"."""
    from vlm_checkpoints import encoder_from_checkpoint

    from paged_engine.models.deepseek_ocr_v1_config import deepseek_ocr_v1_config

    path, _ = ckpt
    image = noise_image(7, (100, 900))
    prompt = {"prompt": PROMPT, "multi_modal_data": {"image": image}}

    def tokens(llm, p=prompt):
        return llm.generate([p], greedy(0), use_tqdm=False)[0]

    llm = engine(path, mm_processor_kwargs=TINY, enable_prefix_caching=True)
    plain = tokens(llm).outputs[0].token_ids
    again = tokens(llm)
    assert again.num_cached_tokens >= 16 and again.outputs[0].token_ids == plain
    chunked = engine(
        path, mm_processor_kwargs=TINY, max_num_batched_tokens=8, enable_chunked_prefill=True
    )
    assert tokens(chunked).outputs[0].token_ids == plain
    images = llm.llm_engine.input_processor.images
    ids, done = images.process(llm.get_tokenizer().encode(PROMPT), [image])
    ahead = {"prompt_token_ids": ids, "multi_modal_data": {"image": list(done)}}
    assert tokens(llm, ahead).outputs[0].token_ids == plain
    config = deepseek_ocr_v1_config(json.loads((path / "config.json").read_text()))
    with torch.no_grad():
        rows = encoder_from_checkpoint(path, config).encode(done)[0]
    out = tokens(llm, {"prompt": PROMPT, "multi_modal_data": {"image": [rows]}})
    assert out.prompt_token_ids == ids and out.outputs[0].token_ids == plain


def test_bad_requests_and_configs_refused_by_name(ckpt, tmp_path):
    """An image count off, mm_processor_kwargs out of bounds, an image processed ahead whose
    tiling a client changed: ValueErrors naming what is wrong, the engine serving on;
    config.json fields the path does not serve: one naming the field at load."""
    path, _ = ckpt
    llm = engine(path, mm_processor_kwargs=TINY, limit_mm_per_prompt={"image": 2})
    one, two = noise_image(4, (30, 30)), [noise_image(5, (30, 30)), noise_image(6, (30, 30))]
    cases = [({"prompt": PROMPT, "multi_modal_data": {"image": two}}, r"2 image\(s\)")]
    empty = Image.new("RGB", (0, 0))  # ImageOps.pad would make it a blank canvas
    cases.append(({"prompt": PROMPT, "multi_modal_data": {"image": empty}}, "0x0 pixels"))
    for name, value in [("base_size", 100), ("image_size", 2048), ("crop_mode", "yes")]:
        bad = {"prompt": PROMPT, "multi_modal_data": {"image": one}}
        cases.append(({**bad, "mm_processor_kwargs": {name: value}}, name))
    for bad, match in cases:
        with pytest.raises(ValueError, match=match):
            llm.generate([bad], greedy(0), use_tqdm=False)
    images = llm.llm_engine.input_processor.images
    ids, done = images.process(llm.get_tokenizer().encode(PROMPT), [noise_image(7, (100, 900))])
    for size in [(1, 999, 256, 128), (10**6,) * 4, (3, 2, 256, 128)]:  # tampered tilings
        bad = [dataclasses.replace(done[0], image_size=size)]
        with pytest.raises(ValueError, match="multi_modal_data"):
            llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": bad}}])
    out = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": one}}], greedy(0))
    assert len(out[0].outputs[0].token_ids) == 8
    config = json.loads((path / "config.json").read_text())
    lang = config["language_config"]
    bad_fields = [
        ("use_mla", {"language_config": {**lang, "use_mla": True}}),
        ("norm_topk_prob", {"language_config": {**lang, "norm_topk_prob": True}}),
        ("tile_tag", {"tile_tag": "1D"}),
        (
            "projector_type",
            {"projector_config": {**config["projector_config"], "projector_type": "mlp_gelu"}},
        ),
    ]
    for field, change in bad_fields:
        check_config_refused(path, tmp_path / field, config | change, field)
