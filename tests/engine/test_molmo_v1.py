"""Images through Molmo v1 (`MolmoForCausalLM`, remote code: multimodal/molmo_v1.py,
molmo_v1_processor.py, molmo_v1_encoder.py, models/molmo_v1.py, molmo_v1_config.py) against a
reference composed here from transformers' modules.

transformers has no Molmo v1 class. Its parts are: OpenAI's CLIP ViT (transformers'
CLIPVisionModel: the release's Linear patch embedding over (row, col, channel) pixels is its
bias-free conv), attention pooling over 2 x 2 windows with the windows' mean as the query and
the SwiGLU projector (transformers' Molmo2Adapter over full windows), and Qwen2's decoder
(Qwen2ForCausalLM, run on input embeddings). The glue written here from the release's
preprocessing / modeling files and vLLM's molmo.py: the processor (select_tiling, the
aspect-keeping resize onto a zero canvas, overlapping crops, the global view first, the masks
paired with the views one off as the release pairs them), the two tower layers side by side,
pad_embed on padded patches, the crops' margins dropped through the release's patch ordering,
the features added to the <im_patch> rows, the images after the bos (the release's
`bos or eos`). The same random weights are saved in the release's layout
(`model.vision_backbone.image_vit.transformer.resblocks`, `model.transformer.blocks.N.att_proj`
fused q | k | v, `ff_proj` up | gate, `wte.embedding` + `new_embedding`, `ff_out` heads) with
a config.json of the release's fields (plus the tower's geometry, which the remote code
hard-codes). paged must give the reference's prompt ids, greedy tokens and top-5 logprobs
(1e-3, float32).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hf_reference import assert_matches, hf_greedy_from_embeds
from image_checks import (
    check_chunks_and_prefix_hits,
    check_config_refused,
    engine,
    greedy,
    noise_image,
)
from vlm_checkpoints import finish_checkpoint, tokenizer_with

from paged_engine.testing import _randomize

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

TEXT = " User: what is in the picture? Assistant:"
TOKENS = ["<im_start>", "<im_end>", "<im_patch>", "<im_col>", "<|image|>"]
SIDE, PATCH, MARGINS, MAX_CROPS = 112, 14, (2, 2), 4  # 8 patches a side, windows of 4
VIT = {"image_emb_dim": 32, "image_num_heads": 2, "image_num_layers": 3, "image_mlp_dim": 64}
VIT_LAYERS = [-2, -3]  # the third layer is never read (its weights are skipped)
MEAN, STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
ROWS = 512  # embedding_size: the head's rows; the image tokens lie past them


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """(the release-layout dir, the reference: Qwen2, CLIP, Molmo2Adapter, extras, tokenizer)."""
    root = tmp_path_factory.mktemp("molmo_v1")
    tokenizer, ids = tokenizer_with(TOKENS, 9)
    assert min(ids[t] for t in TOKENS[:4]) >= ROWS  # in new_embedding, as the release's
    text = transformers.Qwen2Config(
        vocab_size=ROWS, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=512, tie_word_embeddings=False,
    )  # fmt: skip
    lm = transformers.Qwen2ForCausalLM(text).float().eval()
    clip_config = transformers.CLIPVisionConfig(
        hidden_size=VIT["image_emb_dim"], intermediate_size=VIT["image_mlp_dim"],
        num_attention_heads=VIT["image_num_heads"], num_hidden_layers=VIT["image_num_layers"],
        image_size=SIDE, patch_size=PATCH, hidden_act="quick_gelu", layer_norm_eps=1e-5,
    )  # fmt: skip
    clip = transformers.CLIPVisionModel(clip_config).float().eval()
    d = VIT["image_emb_dim"]
    adapter_config = transformers.Molmo2AdapterConfig(
        vision_feature_layer=VIT_LAYERS, hidden_size=d, num_attention_heads=2,
        num_key_value_heads=2, head_dim=d // 2, attention_bias=True, hidden_act="silu",
        intermediate_size=96, text_hidden_size=64, mlp_bias=False,
    )  # fmt: skip
    adapter = transformers.models.molmo2.modeling_molmo2.Molmo2Adapter(adapter_config).eval()
    gen = torch.Generator().manual_seed(3)
    extra = {"new_embedding": torch.randn(128, 64, generator=gen)}
    extra["pad_embed"] = torch.randn(2, 2 * d, generator=gen) * 0.5
    with torch.no_grad():
        for i, module in enumerate((lm, clip, adapter)):
            _randomize(module, 4 + i)
    path = root / "remote"
    path.mkdir()
    state = release_state(lm, clip, adapter, extra)
    safetensors.save_file(state, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(release_config(text, ids)))
    pre = {"max_crops": MAX_CROPS, "overlap_margins": list(MARGINS)}
    pre |= {"base_image_input_size": [SIDE, SIDE], "image_patch_size": PATCH}
    pre |= {"image_token_length_w": SIDE // PATCH // 2, "image_token_length_h": SIDE // PATCH // 2}
    (path / "preprocessor_config.json").write_text(json.dumps(pre))
    finish_checkpoint(path, tokenizer)
    return path, (lm, clip, adapter, extra, tokenizer, ids)


@pytest.fixture(scope="module")
def olmo_ckpt(ckpt, tmp_path_factory):
    """Molmo-7B-O's layer kind (attention_layer_norm, norm_after: OLMo 2's decoder) with the
    same tower, adapter and tokenizer; the reference decoder Olmo2ForCausalLM."""
    path, (_, clip, adapter, extra, tokenizer, ids) = ckpt
    text = transformers.Olmo2Config(
        vocab_size=ROWS, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=512, tie_word_embeddings=False,
    )  # fmt: skip
    lm = transformers.Olmo2ForCausalLM(text).float().eval()
    with torch.no_grad():
        _randomize(lm, 8)
    out = tmp_path_factory.mktemp("molmo_v1_olmo")
    state = release_state(lm, clip, adapter, extra)
    safetensors.save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(release_config(text, ids, olmo=True)))
    (out / "preprocessor_config.json").write_text((path / "preprocessor_config.json").read_text())
    finish_checkpoint(out, tokenizer)
    return out, (lm, clip, adapter, extra, tokenizer, ids)


def release_state(lm, clip, adapter, extra) -> dict[str, torch.Tensor]:
    """The same weights in the release's names (the remote code's modules)."""
    out: dict[str, torch.Tensor] = {}
    sd = lm.state_dict()
    out["model.transformer.wte.embedding"] = sd["model.embed_tokens.weight"]
    out["model.transformer.wte.new_embedding"] = extra["new_embedding"]
    out["model.transformer.ln_f.weight"] = sd["model.norm.weight"]
    out["model.transformer.ff_out.weight"] = sd["lm_head.weight"]
    for i in range(lm.config.num_hidden_layers):
        a, b = f"model.layers.{i}.", f"model.transformer.blocks.{i}."
        olmo = f"{a}self_attn.q_norm.weight" in sd  # OLMo 2: no biases, norms after
        for kind in ("weight",) if olmo else ("weight", "bias"):
            qkv = [sd[f"{a}self_attn.{p}_proj.{kind}"] for p in "qkv"]
            out[f"{b}att_proj.{kind}"] = torch.cat(qkv)
        out[f"{b}attn_out.weight"] = sd[f"{a}self_attn.o_proj.weight"]
        up, gate = sd[f"{a}mlp.up_proj.weight"], sd[f"{a}mlp.gate_proj.weight"]
        out[f"{b}ff_proj.weight"] = torch.cat([up, gate])  # x, gate = chunk(2): silu(gate) x
        out[f"{b}ff_out.weight"] = sd[f"{a}mlp.down_proj.weight"]
        norms = ("post_attention", "post_feedforward") if olmo else ("input", "post_attention")
        out[f"{b}attn_norm.weight"] = sd[f"{a}{norms[0]}_layernorm.weight"]
        out[f"{b}ff_norm.weight"] = sd[f"{a}{norms[1]}_layernorm.weight"]
        if olmo:
            out[f"{b}q_norm.weight"] = sd[f"{a}self_attn.q_norm.weight"]
            out[f"{b}k_norm.weight"] = sd[f"{a}self_attn.k_norm.weight"]
    vit = {k.removeprefix("vision_model."): t for k, t in clip.state_dict().items()}
    v = "model.vision_backbone."
    conv = vit["embeddings.patch_embedding.weight"]  # [D, 3, p, p] -> Linear over (dh, dw, c)
    out[f"{v}image_vit.patch_embedding.weight"] = conv.permute(0, 2, 3, 1).reshape(
        conv.shape[0], -1
    )
    out[f"{v}image_vit.class_embedding"] = vit["embeddings.class_embedding"]
    out[f"{v}image_vit.positional_embedding"] = vit["embeddings.position_embedding.weight"]
    for kind in ("weight", "bias"):
        out[f"{v}image_vit.pre_ln.{kind}"] = vit[f"pre_layrnorm.{kind}"]
    names = {"self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk"}
    names |= {"self_attn.v_proj": "attention.wv", "self_attn.out_proj": "attention.wo"}
    names |= {"layer_norm1": "attention_norm", "layer_norm2": "ffn_norm"}
    names |= {"mlp.fc1": "feed_forward.w1", "mlp.fc2": "feed_forward.w2"}
    for i in range(VIT["image_num_layers"]):
        for ours, theirs in names.items():
            for kind in ("weight", "bias"):
                t = vit[f"encoder.layers.{i}.{ours}.{kind}"]
                out[f"{v}image_vit.transformer.resblocks.{i}.{theirs}.{kind}"] = t
    ad = adapter.state_dict()
    for p in "qkvo":
        for kind in ("weight", "bias"):
            out[f"{v}image_pooling_2d.w{p}.{kind}"] = ad[f"image_pooling_2d.{p}_proj.{kind}"]
    for w, p in (("w1", "gate"), ("w2", "down"), ("w3", "up")):
        out[f"{v}image_projector.{w}.weight"] = ad[f"image_projector.{p}_proj.weight"]
    out[f"{v}pad_embed"] = extra["pad_embed"]
    return {k: t.detach().clone().contiguous() for k, t in out.items()}


def release_config(text, ids: dict[str, int], olmo: bool = False) -> dict:
    """config.json as the release writes it (tiny values), plus the tower's geometry and this
    tokenizer's image token ids (the release's are its Qwen2 tokenizer's)."""
    out = {"architectures": ["MolmoForCausalLM"], "model_type": "molmo", "vocab_size": ROWS}
    out |= {"embedding_size": ROWS, "hidden_size": 64, "intermediate_size": 192}
    out |= {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    out |= {"max_position_embeddings": 512, "layer_norm_eps": 1e-6, "rope_theta": 10000.0}
    out |= {"layer_norm_type": "rms", "qkv_bias": not olmo, "norm_after": olmo}
    out |= {"attention_layer_norm": olmo, "weight_tying": False, "use_position_ids": True}
    out["clip_qkv"] = None
    out |= {"torch_dtype": "float32", "tie_word_embeddings": False}
    out["vision_backbone"] = {
        **VIT,
        "image_default_input_size": [SIDE, SIDE],
        "image_patch_size": PATCH,
    }
    out["vit_layers"] = VIT_LAYERS
    for name, token in zip(("start", "end", "patch", "col"), TOKENS, strict=False):
        out[f"image_{name}_token_id"] = ids[token]
    return out


def resize_and_pad(x: torch.Tensor, out_h: int, out_w: int) -> tuple[np.ndarray, np.ndarray]:
    """The release's resize_and_pad of x [3, H, W] in [0, 1] (torch's antialiased bilinear for
    its TensorFlow one): (normalized [h, w, 3], mask [h, w])."""
    h, w = x.shape[1:]
    scale = min(np.float32(out_h) / np.float32(h), np.float32(out_w) / np.float32(w))
    sh, sw = int(np.float32(h) * scale), int(np.float32(w) * scale)
    img = F.interpolate(x[None], (sh, sw), mode="bilinear", antialias=True)[0].clamp(0, 1)
    top, left = (out_h - sh) // 2, (out_w - sw) // 2
    pad = [[top, out_h - sh - top], [left, out_w - sw - left]]
    mask = np.pad(np.ones((sh, sw), bool), pad)
    img = np.pad(img.permute(1, 2, 0).numpy(), [*pad, [0, 0]])
    return (img - np.float32(MEAN)) / np.float32(STD), mask


def tiling(h: int, w: int, window: int) -> tuple[int, int]:
    """select_tiling: every (i, j) with i j <= max_crops by (i j, i); the smallest scale-up that
    fits, else the largest scale-down."""
    pairs = sorted(
        [
            (i, j)
            for i in range(1, MAX_CROPS + 1)
            for j in range(1, MAX_CROPS + 1)
            if i * j <= MAX_CROPS
        ],
        key=lambda t: (t[0] * t[1], t[0]),
    )
    scales = [
        min(np.float32(i * window) / np.float32(h), np.float32(j * window) / np.float32(w))
        for i, j in pairs
    ]
    if all(s < 1 for s in scales):
        return pairs[int(np.argmax(scales))]
    return pairs[int(np.argmin([s if s >= 1 else 1e10 for s in scales]))]


def image_parts(image, ids: dict[str, int]):
    """The release's processor: (tokens, views [V, 3, S, S], masks [V, cp * cp], each pooled
    feature's token index (or -1) in the view-major order of the pooling)."""
    x = torch.from_numpy(np.asarray(image.convert("RGB")).copy()).permute(2, 0, 1).float() / 255
    cp, (lm, rm) = SIDE // PATCH, MARGINS
    window = (cp - lm - rm) * PATCH
    th, tw = tiling(x.shape[1] - (lm + rm) * PATCH, x.shape[2] - (lm + rm) * PATCH, window)
    canvas, cmask = resize_and_pad(
        x, th * window + (lm + rm) * PATCH, tw * window + (lm + rm) * PATCH
    )
    crops, masks, keep = [], [], []
    half = cp // 2
    for i in range(th):
        for j in range(tw):
            y0, x0 = i * window, j * window
            crops.append(canvas[y0 : y0 + SIDE, x0 : x0 + SIDE])
            m = cmask[y0 : y0 + SIDE, x0 : x0 + SIDE].reshape(cp, PATCH, cp, PATCH)
            masks.append(m.astype(np.float32).mean((1, 3)).reshape(-1))
            # the pooled cells this crop keeps: [lo, hi) rows and columns of its half x half
            rows = (0 if i == 0 else lm // 2, half if i == th - 1 else half - rm // 2)
            cols = (0 if j == 0 else lm // 2, half if j == tw - 1 else half - rm // 2)
            keep.append((i, j, rows, cols))
    glob, _ = resize_and_pad(x, SIDE, SIDE)
    views = torch.from_numpy(np.stack([glob, *crops])).permute(0, 3, 1, 2).float()
    masks = torch.from_numpy(np.stack([*masks, np.full(cp * cp, -1.0, np.float32)]))
    # canvas coordinates of each kept cell, then the crops' tokens row-major over them
    coords = {}
    row_at = np.cumsum([0] + [k[2][1] - k[2][0] for k in keep if k[1] == 0])
    col_at = np.cumsum([0] + [k[3][1] - k[3][0] for k in keep if k[0] == 0])
    for n, (i, j, (r0, r1), (c0, c1)) in enumerate(keep):
        for y in range(r0, r1):
            for xx in range(c0, c1):
                coords[(n + 1, y, xx)] = (row_at[i] + y - r0, col_at[j] + xx - c0)
    n_rows, n_cols = int(row_at[-1]), int(col_at[-1])
    p, col = ids["<im_patch>"], ids["<im_col>"]
    tokens = [ids["<im_start>"], *([p] * half + [col]) * half, ids["<im_end>"], ids["<im_start>"]]
    first_crop_token = len(tokens)
    tokens += [*([p] * n_cols + [col]) * n_rows, ids["<im_end>"]]
    where = []
    for v in range(len(views)):
        for y in range(half):
            for xx in range(half):
                if v == 0:
                    where.append(1 + y * (half + 1) + xx)
                elif (v, y, xx) in coords:
                    r, c = coords[(v, y, xx)]
                    where.append(first_crop_token + r * (n_cols + 1) + c)
                else:
                    where.append(-1)
    return tokens, views, masks, torch.tensor(where)


def reference(ref, images: list, text: str = TEXT):
    """(the release processor's prompt ids: bos, every image's tokens, the text; greedy with
    top-5 from the composed model)."""
    lm, clip, adapter, extra, tokenizer, ids = ref
    bos = tokenizer.bos_token_id or tokenizer.eos_token_id
    prompt, added = [bos], []
    for image in images:
        tokens, views, masks, where = image_parts(image, ids)
        with torch.no_grad():
            hs = clip(pixel_values=views, output_hidden_states=True).hidden_states
            feats = torch.cat([hs[k] for k in VIT_LAYERS], -1)[:, 1:]  # [V, cp * cp, 2D]
            m = masks[..., None]
            feats = (
                feats
                + extra["pad_embed"][0] * (m == 0)
                + extra["pad_embed"][1] * ((m < 1) & (m != 0))
            )
            cp, half = SIDE // PATCH, SIDE // PATCH // 2
            grid = torch.arange(cp * cp).view(half, 2, half, 2).permute(0, 2, 1, 3).reshape(-1, 4)
            windows = torch.cat([grid + v * cp * cp for v in range(len(views))])
            pooled = adapter(feats, windows).last_hidden_state  # every window full
        valid = where >= 0
        added.append((len(prompt) + where[valid], pooled[valid]))
        prompt += tokens
    prompt += tokenizer.encode(text, add_special_tokens=False)
    table = torch.cat([lm.model.embed_tokens.weight, extra["new_embedding"]]).detach()
    embeds = table[torch.tensor(prompt)].clone()
    for at, rows in added:
        assert len(set(at.tolist())) == len(at) and all(
            prompt[i] == ids["<im_patch>"] for i in at.tolist()
        )
        embeds[at] += rows
    return prompt, hf_greedy_from_embeds(lm, embeds[None])


def test_images_match_reference(ckpt):
    """A small image (one crop), a wide one (1 x 3 crops, padded rows), a square one in 2 x 2
    crops (crops overlapping both ways), two images together (the second wider than 4 crops:
    whole patch rows of padding, pad_embed[0]), and text alone."""
    path, ref = ckpt
    small, wide, tall = (
        noise_image(1, (60, 50)),
        noise_image(2, (90, 200)),
        noise_image(3, (150, 170)),
    )
    cases = [[small], [wide], [tall], [wide, noise_image(5, (60, 400))], []]
    llm = engine(path, max_model_len=512, limit_mm_per_prompt={"image": 2})
    prompts = [{"prompt": TEXT, "multi_modal_data": {"image": c}} if c else TEXT for c in cases]
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    lengths = []
    for images, out in zip(cases, outs, strict=True):
        if not images:
            continue  # the text alone: below
        ids, want = reference(ref, images)
        assert out.prompt_token_ids == ids
        assert_matches(f"molmo_v1 {len(images)} image(s)", out, want)
        lengths.append(len(ids))
    assert lengths[0] < lengths[1] < lengths[2]  # 1, 3 and 4 crops
    tokenizer = ref[4]
    plain = tokenizer.encode(TEXT, add_special_tokens=False)
    assert outs[-1].prompt_token_ids == plain  # no image: no bos added, the text as given


def test_olmo2_decoder_matches_reference(olmo_ckpt):
    """Molmo-7B-O's layer kind: a tiled image and text alone."""
    path, ref = olmo_ckpt
    llm = engine(path, max_model_len=512)
    image = noise_image(3, (150, 170))
    outs = llm.generate(
        [{"prompt": TEXT, "multi_modal_data": {"image": image}}], greedy(), use_tqdm=False
    )
    ids, want = reference(ref, [image])
    assert outs[0].prompt_token_ids == ids
    assert_matches("molmo_v1 olmo2", outs[0], want)


def test_chunks_and_prefix_hits_give_the_plain_tokens(ckpt):
    """8-token chunks through the images' segments, a prefix-cache hit on one image's prompt
    and none past another image's first token."""
    path, ref = ckpt
    images = [noise_image(6, (90, 200)), noise_image(7, (150, 170))]
    prompts = [{"prompt": TEXT, "multi_modal_data": {"image": im}} for im in images]
    start = ref[5]["<im_start>"]
    check_chunks_and_prefix_hits(path, prompts, greedy(0), 8, lambda _: start)


def test_variants_and_bad_requests_refused_by_name(ckpt, tmp_path):
    """Unserved layer kinds (moe_* fields without MolmoE's block_type "moe", q / k norms
    without norm_after and the reverse) and other config.json fields refused at load naming
    the field; a prompt holding <im_patch>, mm_processor_kwargs, an image processed ahead whose
    tiling a client changed: ValueErrors naming them, the engine serving on."""
    path, ref = ckpt
    llm = engine(path, max_model_len=512)
    image = noise_image(4, (40, 40))
    patch = ref[5]["<im_patch>"]
    bad = [
        ({"prompt_token_ids": [5, patch, 6], "multi_modal_data": {"image": image}}, "im_patch"),
        (
            {
                "prompt": TEXT,
                "multi_modal_data": {"image": image},
                "mm_processor_kwargs": {"max_crops": 2},
            },
            "max_crops",
        ),
    ]
    for prompt, match in bad:
        with pytest.raises(ValueError, match=match):
            llm.generate([prompt], greedy(0), use_tqdm=False)
    images = llm.llm_engine.input_processor.images
    ids, done = images.process(llm.get_tokenizer().encode(TEXT), [image])
    for size in [(40, 40, 10**6, 10**6, 2, 2, 8, 14), (40, 40, 1, 1, 1, 3, 8, 14), (1, 2, 3)]:
        tampered = [dataclasses.replace(done[0], image_size=size)]  # a client's edit
        with pytest.raises(ValueError, match="multi_modal_data"):
            llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": tampered}}])
    out = llm.generate(
        [{"prompt": TEXT, "multi_modal_data": {"image": image}}], greedy(0), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 8
    config = json.loads((path / "config.json").read_text())
    changes = [
        ("attention_layer_norm", {"attention_layer_norm": True}),  # q / k norms, pre-norm
        ("moe_num_experts", {"moe_num_experts": 64}),  # without block_type "moe"
        ("attention_layer_norm", {"norm_after": True}),  # norms after, no q / k norms
        ("qkv_bias", {"qkv_bias": False}),
        ("clip_qkv", {"clip_qkv": 8.0}),
        (
            "image_default_input_size",
            {
                "vision_backbone": {
                    **config["vision_backbone"],
                    "image_default_input_size": [98, 98],
                }
            },
        ),
    ]
    for i, (field, change) in enumerate(changes):
        check_config_refused(path, tmp_path / f"{i}_{field}", config | change, field)
