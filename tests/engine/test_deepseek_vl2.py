"""Images through DeepSeek-VL2 (`DeepseekVLV2ForCausalLM`, remote code: multimodal/
deepseek_vl2.py, deepseek_vl2_encoder.py, models/deepseek_vl2_config.py) against a reference
composed here from transformers' modules.

transformers has no DeepSeek-VL2 class. Its parts are: the release's timm SigLIP ViT (no class
token, its head ignored, the final norm's output: transformers' SiglipVisionModel's
last_hidden_state, the same maths), the downsample MLP projector (written here from vLLM's
MlpProjector: the grid zero-padded to even sides, 2 x 2 neighbours side by side channel-major,
Linear, GELU, Linear) and DeepSeek-V2's MoE decoder: under multi-head attention (tiny:
transformers' DeepSeek-OCR-2 decoder, as test_deepseek_ocr_v1.py) or MLA (small: transformers'
DeepseekV2ForCausalLM). The processor and rows are written here from vLLM's
processors/deepseek_vl2.py and deepseek_vl2.py: the candidate resolution keeping most pixels,
the padded global view and padded tiles, image_newline after each row, view_seperator between
the global view and the tiles (global_view_pos "head"; "tail" the other way round). The same
random weights are saved in the release's layout (`vision.` in timm's names with a fused qkv
and an unread attn_pool, `projector.layers.{0,2}`, `language.model.` / `language.lm_head.`)
with a config.json shaped as the release's. 44-pixel tiles of 14-pixel patches leave 2 pixels
unread and a 3 x 3 grid that the projector pads to 4 x 4. paged must give the reference's
prompt ids, greedy tokens and top-5 logprobs (1e-3, float32).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hf_reference import assert_matches, hf_greedy_with_rows
from image_checks import check_config_refused, engine, greedy, noise_image
from vlm_checkpoints import finish_checkpoint, image_run_ids, load_hf_vlm, tokenizer_with

from paged_engine.testing import _randomize, _save_random

transformers = pytest.importorskip("transformers")
ImageOps = pytest.importorskip("PIL.ImageOps")
safetensors = pytest.importorskip("safetensors.torch")

S, P = 44, 14
CANDIDATES = [[S, S], [S, 2 * S], [2 * S, S], [2 * S, 2 * S]]
VISION = {"hidden_size": 32, "intermediate_size": 119, "num_hidden_layers": 2}
VISION |= {"num_attention_heads": 2, "image_size": S, "patch_size": P}
MOE = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2}
MOE |= {"num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 4}
MOE |= {"num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1}
MOE |= {"routed_scaling_factor": 1.5, "topk_method": "greedy", "rms_norm_eps": 1e-6}
MLA = {"q_lora_rank": None, "kv_lora_rank": 16, "qk_nope_head_dim": 16}
MLA |= {"qk_rope_head_dim": 8, "v_head_dim": 16}
ONE, TWO = "<image>\nDescribe.", "<image> and <image>\ncompare."
THREE = "<image> a <image> b <image> three"


def _hf_text(kind: str, root, tokenizer):
    """(transformers' decoder of `kind` saved at root / kind, its release language_config)."""
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    text = {"vocab_size": len(tokenizer), **MOE, **ids}
    lang = {**text, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}
    lang |= {"lm_head": True, "rm_head": False, "max_position_embeddings": 4096}
    if kind == "mla":
        cfg = transformers.DeepseekV2Config(**text, **MLA, first_k_dense_replace=1)
        _save_random(transformers.DeepseekV2ForCausalLM, cfg, 5, root / kind)
        return transformers.DeepseekV2ForCausalLM, {**lang, **MLA, "use_mla": True}
    sam = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    sam |= {"image_size": 64, "global_attn_indexes": [0], "downsample_channels": [32, 64]}
    encoder = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1}
    encoder |= {"num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 8}
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    cfg = transformers.DeepseekOcr2Config(
        text_config={**text, "mlp_layer_types": ["dense", "sparse"], "rope_parameters": rope},
        vision_config={"sam_config": sam, "encoder_config": encoder},
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
    )
    _save_random(transformers.DeepseekOcr2ForConditionalGeneration, cfg, 5, root / kind)
    none = {"kv_lora_rank": None, "q_lora_rank": None, "qk_nope_head_dim": 0}
    none |= {"qk_rope_head_dim": 0, "v_head_dim": 0, "use_mla": False}
    return transformers.DeepseekOcr2ForConditionalGeneration, {**lang, **none}


def _release_config(lang: dict, image_id: int, view_pos: str) -> dict:
    """config.json as the release writes it (its fields, tiny values) plus image_token_id."""
    vision = {"width": 32, "layers": 2, "heads": 2, "mlp_ratio": 3.7362, "patch_size": P}
    vision |= {"image_size": S, "model_name": "siglip_so400m_patch14_384", "select_layer": -1}
    vision |= {"global_pool": "map", "ignore_head": True, "class_token": False}
    vision |= {"model_type": "vision", "num_classes": 0, "weight_init": "skip"}
    proj = {"model_type": "mlp_projector", "projector_type": "downsample_mlp_gelu", "depth": 2}
    proj |= {"input_dim": 32, "n_embed": MOE["hidden_size"], "mlp_ratio": 1}
    proj |= {"downsample_ratio": 2, "token_pooling": False}
    top = {"architectures": ["DeepseekVLV2ForCausalLM"], "model_type": "deepseek_vl_v2"}
    top |= {"language_config": {"architectures": ["DeepseekV2ForCausalLM"], **lang}}
    top |= {"vision_config": vision, "projector_config": proj, "tile_tag": "2D"}
    top |= {"global_view_pos": view_pos, "candidate_resolutions": CANDIDATES}
    return {**top, "image_token_id": image_id, "torch_dtype": "float32"}


def _release_state(text_file, tower, head) -> dict[str, torch.Tensor]:
    """The release's tensors: the decoder under `language.`, the tower in timm's names."""
    out = {}
    for name, t in safetensors.load_file(str(text_file)).items():
        if name.startswith(("model.layers.", "model.embed_tokens.", "model.norm.", "lm_head.")):
            out[f"language.{name}"] = t
    sd = {k.removeprefix("vision_model."): v for k, v in tower.state_dict().items()}
    emb = "embeddings."
    out["vision.patch_embed.proj.weight"] = sd[f"{emb}patch_embedding.weight"]
    out["vision.patch_embed.proj.bias"] = sd[f"{emb}patch_embedding.bias"]
    out["vision.pos_embed"] = sd[f"{emb}position_embedding.weight"][None]
    for i in range(VISION["num_hidden_layers"]):
        hf, tm = f"encoder.layers.{i}.", f"vision.blocks.{i}."
        for part in ("weight", "bias"):
            qkv = [sd[f"{hf}self_attn.{p}_proj.{part}"] for p in "qkv"]
            out[f"{tm}attn.qkv.{part}"] = torch.cat(qkv)
            pairs = [("layer_norm1", "norm1"), ("layer_norm2", "norm2")]
            pairs += [("self_attn.out_proj", "attn.proj"), ("mlp.fc1", "mlp.fc1")]
            for a, b in [*pairs, ("mlp.fc2", "mlp.fc2")]:
                out[f"{tm}{b}.{part}"] = sd[f"{hf}{a}.{part}"]
    out["vision.norm.weight"] = sd["post_layernorm.weight"]
    out["vision.norm.bias"] = sd["post_layernorm.bias"]
    out["vision.attn_pool.latent"] = torch.randn(1, 1, 32)  # the ignored head: never read
    out |= head
    return {k: v.contiguous() for k, v in out.items()}


def _checkpoint(root, kind: str, view_pos: str):
    tokenizer, ids = tokenizer_with(["<image>"], 3)
    cls, lang = _hf_text(kind, root, tokenizer)
    tower = transformers.SiglipVisionModel(transformers.SiglipVisionConfig(**VISION))
    tower = tower.float().eval()
    with torch.no_grad():
        _randomize(tower, 4)
    gen = torch.Generator().manual_seed(6)
    hidden, wide = MOE["hidden_size"], 4 * VISION["hidden_size"]
    head = {
        "projector.layers.0.weight": torch.randn(hidden, wide, generator=gen) * wide**-0.5,
        "projector.layers.0.bias": torch.randn(hidden, generator=gen) * 0.1,
        "projector.layers.2.weight": torch.randn(hidden, hidden, generator=gen) * hidden**-0.5,
        "projector.layers.2.bias": torch.randn(hidden, generator=gen) * 0.1,
        "image_newline": torch.randn(hidden, generator=gen),
        "view_seperator": torch.randn(hidden, generator=gen),
    }
    path = root / f"{kind}_release"
    path.mkdir()
    state = _release_state(root / kind / "model.safetensors", tower, head)
    safetensors.save_file(state, str(path / "model.safetensors"))
    config = _release_config(lang, ids["<image>"], view_pos)
    (path / "config.json").write_text(json.dumps(config))
    finish_checkpoint(path, tokenizer)
    return path, (load_hf_vlm(cls, root / kind), tower, head, tokenizer, view_pos)


@pytest.fixture(scope="module")
def mha(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("deepseek_vl2"), "mha", "head")


def _fit(w: int, h: int) -> tuple[int, int]:
    """The release's choice: most pixels kept once scaled to fit, then least waste."""
    scored = []
    for cw, ch in CANDIDATES:
        scale = min(cw / w, ch / h)
        kept = min(int(w * scale) * int(h * scale), w * h)
        scored.append((-kept, cw * ch - kept, (cw, ch)))
    return min(scored, key=lambda s: s[:2])[2]


def _views(image, cropping: bool):
    """(views [1 + wt ht, 3, S, S]: global, then tiles row-major; (wt, ht))."""
    w, h = _fit(*image.size) if cropping else (S, S)
    whole = ImageOps.pad(image, (S, S), color=(127, 127, 127))
    local = ImageOps.pad(image, (w, h), color=(127, 127, 127))
    tiles = [local.crop((x, y, x + S, y + S)) for y in range(0, h, S) for x in range(0, w, S)]
    arrays = [np.asarray(v, dtype=np.float32) / 255 for v in [whole, *tiles]]
    pixels = (torch.from_numpy(np.stack(arrays)) - 0.5) / 0.5
    return pixels.permute(0, 3, 1, 2), (w // S, h // S)


def _image_rows(ref, image, cropping: bool) -> torch.Tensor:
    _, tower, head, _, view_pos = ref
    pixels, (wt, ht) = _views(image, cropping)
    with torch.no_grad():
        x = tower(pixel_values=pixels).last_hidden_state  # [n, 9, D]
        n, d = x.shape[0], x.shape[-1]
        x = F.pad(x.view(n, 3, 3, d), (0, 0, 0, 1, 0, 1))  # [n, 4, 4, D]
        x = x.view(n, 2, 2, 2, 2, d).permute(0, 1, 3, 5, 2, 4).reshape(n, 2, 2, 4 * d)
        x = F.linear(x, head["projector.layers.0.weight"], head["projector.layers.0.bias"])
        x = F.linear(F.gelu(x), head["projector.layers.2.weight"], head["projector.layers.2.bias"])
    nl = head["image_newline"]

    def rows(grid):  # [H, W, D] -> each row, then image_newline
        return torch.cat([grid, nl.expand(grid.shape[0], 1, -1)], 1).flatten(0, 1)

    whole = rows(x[0])
    local = rows(x[1:].view(ht, wt, 2, 2, -1).permute(0, 2, 1, 3, 4).reshape(ht * 2, wt * 2, -1))
    sep = head["view_seperator"][None]
    out = torch.cat([whole, sep, local] if view_pos == "head" else [local, sep, whole])
    assert out.shape[0] == 2 * 3 + 1 + (2 * ht) * (2 * wt + 1)
    return out


def reference(ref, text: str, images: list):
    """(vLLM's prompt ids: each "<image>" a run of its rows; greedy with top-5)."""
    model, _, _, tokenizer, _ = ref
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    rows = [_image_rows(ref, im, len(images) <= 2) for im in images]
    ids = image_run_ids(tokenizer, text, "<image>", rows)
    return ids, hf_greedy_with_rows(model, ids, image_id, rows)


def _check(path, ref, cases) -> list:
    llm = engine(path, limit_mm_per_prompt={"image": 3})
    prompts = [{"prompt": t, "multi_modal_data": {"image": ims}} for t, ims in cases]
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    for (text, images), out in zip(cases, outs, strict=True):
        ids, want = reference(ref, text, images)
        assert out.prompt_token_ids == ids
        assert_matches(f"deepseek_vl2 {len(images)} image(s)", out, want)
    return outs


def test_mha_images_match_reference(mha):
    """tiny's layout: a square image (one 44 x 44 tile), a wide one (2 x 1 tiles), a tall
    (1 x 2) and a big one (2 x 2) in one prompt (both tiled), three in one prompt (one tile
    each: vLLM's rule)."""
    path, ref = mha
    square, wide = noise_image(1, (30, 30)), noise_image(2, (90, 200))
    tall, big = noise_image(3, (150, 60)), noise_image(7, (100, 120))
    cases = [(ONE, [square]), (ONE, [wide]), (TWO, [tall, big]), (THREE, [wide, tall, square])]
    outs = _check(path, ref, cases)
    lengths = [len(o.prompt_token_ids) for o in outs]
    assert lengths[1] > lengths[0]  # the wide image's two tiles


def test_encoder_rows_equal_reference(mha):
    """The encoder's rows of an image processed by the engine (2 x 2 tiles) equal the
    reference's to float32 rounding: closer than the logprobs can tell (the tower's GELU).
    The same image with its tiling changed by a client: a ValueError, the engine serving on."""
    from vlm_checkpoints import encoder_from_checkpoint

    from paged_engine.models.deepseek_vl2_config import deepseek_vl2_config

    path, ref = mha
    image = noise_image(7, (100, 120))
    llm = engine(path)
    _, done = llm.llm_engine.input_processor.images.process(
        llm.get_tokenizer().encode(ONE), [image]
    )
    config = deepseek_vl2_config(json.loads((path / "config.json").read_text()))
    with torch.no_grad():
        rows = encoder_from_checkpoint(path, config).encode(done)[0]
    assert tuple(done[0].image_size) == (2, 2)
    torch.testing.assert_close(rows, _image_rows(ref, image, True), atol=1e-5, rtol=1e-5)
    ids = llm.get_tokenizer().encode(ONE)
    for size in [(3, 2), (1, 2), (0, 1)]:  # a client's tampered tiling: refused, serving on
        bad = [dataclasses.replace(done[0], image_size=size)]
        with pytest.raises(ValueError, match="multi_modal_data"):
            llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": bad}}])
    out = llm.generate([{"prompt": ONE, "multi_modal_data": {"image": image}}], greedy(0))
    assert len(out[0].outputs[0].token_ids) == 8


def test_mla_tail_images_match_reference(tmp_path):
    """small's decoder (MLA) and global_view_pos "tail": a wide image and a square one."""
    path, ref = _checkpoint(tmp_path, "mla", "tail")
    _check(path, ref, [(ONE, [noise_image(4, (90, 200))]), (TWO, [noise_image(5, (40, 40))] * 2)])


def test_configs_refused_by_name(mha, tmp_path):
    """config.json fields the path does not serve: a ValueError naming the field at load."""
    from paged_engine.models.deepseek_vl2_config import deepseek_vl2_config

    path, _ = mha
    config = json.loads((path / "config.json").read_text())
    lang, proj, vision = (
        config[k] for k in ("language_config", "projector_config", "vision_config")
    )
    bad_fields = [
        ("topk_method", {"language_config": {**lang, "topk_method": "noaux_tc"}}),
        ("norm_topk_prob", {"language_config": {**lang, "norm_topk_prob": True}}),
        ("projector_type", {"projector_config": {**proj, "projector_type": "mlp_gelu"}}),
        ("token_pooling", {"projector_config": {**proj, "token_pooling": True}}),
        ("tile_tag", {"tile_tag": "1D"}),
        ("select_layer", {"vision_config": {**vision, "select_layer": -2}}),
        ("global_pool", {"vision_config": {**vision, "global_pool": "avg"}}),
        ("candidate_resolutions", {"candidate_resolutions": [[S, S], [S, 50]]}),
    ]
    for field, change in bad_fields:
        with pytest.raises(ValueError, match=field):
            deepseek_vl2_config(config | change)
    check_config_refused(path, tmp_path / "bad", config | {"tile_tag": "1D"}, "tile_tag")
