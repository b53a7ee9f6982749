"""Images through MiniCPM-V 2.6, 4.0 and 4.5 as the Hub ships them (`MiniCPMV`, remote code:
multimodal/minicpmv_remote.py, models/minicpmv_remote_config.py) against a reference composed
here from transformers' and torch's modules.

transformers has no MiniCPM-V 2.6 / 4.0 / 4.5 class. Their parts are: the NaViT SigLIP tower,
which vLLM runs as Idefics2VisionTransformer at each view's patch grid (transformers'
Idefics2VisionTransformer on the view's pixels: bucketed position ids, post_layernorm), Qwen2 /
Llama / Qwen3 (transformers' Qwen2ForCausalLM / LlamaForCausalLM / Qwen3ForCausalLM fed
inputs_embeds; 4.0's MiniCPM4-3B as vLLM's MiniCPMV4_0 runs it, plain Llama, here with
MiniCPM4's LongRoPE at an attention factor above 1 and short factors that differ per
frequency), and the perceiver
resampler, composed here from torch's nn.MultiheadAttention and LayerNorms with transformers'
ViT-MAE 2-D sin-cos table (its layout is [sin_h | cos_h | sin_w | cos_w]; MiniCPM's puts the
column first, so the table is transposed) on the keys (2.6, 4.0) or the values (4.5).
The glue written here from vLLM's minicpmv.py and the release's processor rules: the slicing,
the resizes, the prompt's <image_id> / <image> / <slice> markers around query_num <unk>s. The
same random weights are saved in the release's layout (`llm.`, `vpm.`, `resampler.`) with a
config.json and preprocessor_config.json shaped as the release's. paged must give the
reference's prompt ids, greedy tokens and top-5 logprobs (1e-3, float32).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hf_reference import hf_greedy_with_rows
from image_checks import (
    check_config_refused,
    check_engine_matches_hf,
    engine,
    greedy,
    noise_image,
)
from vlm_checkpoints import finish_checkpoint, tiny_qwen2_text, tokenizer_with

from paged_engine.testing import _randomize

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")
safetensors = pytest.importorskip("safetensors.torch")

PATTERN = "(<image>./</image>)"
MARKS = ["<image>", "</image>", "<slice>", "</slice>", "<image_id>", "</image_id>", "<unk>"]
QUERIES, RES, PATCH, MAX_SLICES = 8, 32, 4, 9  # the release: 64, 448, 14, 9
VISION = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2}
VISION |= {"num_hidden_layers": 2, "image_size": 56, "patch_size": PATCH}
WIDTH = 256  # the resampler's heads are 128 wide: 2 heads
U = "<unk>" * QUERIES
# 2.6's and 4.0's expansion (vLLM's MiniCPMV2_6 / MiniCPMV4_0 prompt) of image 0, written out:
# wide (3 x 1 slices: one row) and tall (1 x 4: four rows joined by "\n")
WIDE_TEXT = f"<image_id>0</image_id><image>{U}</image><slice>{U}</slice><slice>{U}</slice>"
WIDE_TEXT += f"<slice>{U}</slice>"
TALL_TEXT = f"<image_id>0</image_id><image>{U}</image><slice>{U}</slice>\n<slice>{U}</slice>"
TALL_TEXT += f"\n<slice>{U}</slice>\n<slice>{U}</slice>"
# MiniCPM4's LongRoPE (4.0's rope_scaling), tiny: 64-wide heads, 1024 of 512 positions
LONGROPE = {"rope_type": "longrope", "original_max_position_embeddings": 512}
LONGROPE |= {"short_factor": [1.0 + 0.15 * i for i in range(32)]}
LONGROPE |= {"long_factor": [4.0 + 0.3 * i for i in range(32)]}


@pytest.fixture(scope="module", params=["2.6", "4.0", "4.5"])
def ckpt(request, tmp_path_factory):
    """(the release-layout dir, the reference: the LM, the tower, the resampler, tokenizer)."""
    version = request.param
    path = tmp_path_factory.mktemp(f"minicpmv_remote_{version}")
    tokenizer, _ = tokenizer_with(MARKS, 3)
    text = tiny_qwen2_text(len(tokenizer), WIDTH)
    torch.manual_seed(0)
    if version == "4.5":
        text["head_dim"] = 48
        llm = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**text)).float().eval()
    elif version == "4.0":
        text |= {"rope_theta": 10000.0, "rope_scaling": LONGROPE, "hidden_act": "silu"}
        llm = transformers.LlamaForCausalLM(transformers.LlamaConfig(**text)).float().eval()
    else:
        llm = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**text)).float().eval()
    vpm, resampler = tower_and_resampler(QUERIES)
    save_random_release(path, 4, llm=llm, vpm=vpm, resampler=resampler)
    (path / "config.json").write_text(json.dumps(release_config(text, version)))
    pre = {"image_processor_type": "MiniCPMVImageProcessor", "image_feature_size": QUERIES}
    pre |= {"max_slice_nums": MAX_SLICES, "scale_resolution": RES, "patch_size": PATCH}
    pre |= {"use_image_id": True, "slice_mode": True, "version": float(version)}
    pre |= {"norm_mean": [0.5, 0.5, 0.5], "norm_std": [0.5, 0.5, 0.5], "unk": "<unk>"}
    (path / "preprocessor_config.json").write_text(json.dumps(pre))
    finish_checkpoint(path, tokenizer)
    llm.generation_config.eos_token_id = None
    resampler.on_values = version == "4.5"
    return path, (llm, vpm, resampler, tokenizer)


def tower_and_resampler(queries: int) -> tuple[torch.nn.Module, torch.nn.ModuleDict]:
    """transformers' Idefics2 tower at VISION and the release's resampler as torch modules
    (kv_proj, nn.MultiheadAttention, ln_q / ln_kv / ln_post, `query` [queries, WIDTH], `proj`
    [WIDTH, WIDTH]), built in that order; their weights still to be randomized."""
    idefics2 = transformers.models.idefics2.modeling_idefics2
    vpm = idefics2.Idefics2VisionTransformer(transformers.Idefics2VisionConfig(**VISION))
    resampler = torch.nn.ModuleDict(
        {
            "kv_proj": torch.nn.Linear(VISION["hidden_size"], WIDTH, bias=False),
            "attn": torch.nn.MultiheadAttention(WIDTH, WIDTH // 128),
            **{n: torch.nn.LayerNorm(WIDTH, eps=1e-6) for n in ("ln_q", "ln_kv", "ln_post")},
        }
    )
    resampler.query = torch.nn.Parameter(torch.empty(queries, WIDTH))
    resampler.proj = torch.nn.Parameter(torch.empty(WIDTH, WIDTH))
    return vpm, resampler


def save_random_release(path, seed: int, **modules: torch.nn.Module) -> None:
    """Each of `modules` randomized in order (seeds `seed`, `seed + 1`, ...), in float32 eval
    mode, and saved to `path`/model.safetensors in the release's layout: `{name}.{tensor}`."""
    with torch.no_grad():
        for i, module in enumerate(modules.values()):
            _randomize(module, seed + i)
    state = {}
    for name, module in modules.items():
        module.float().eval()
        state |= {f"{name}.{k}": v.contiguous() for k, v in module.state_dict().items()}
    safetensors.save_file(state, str(path / "model.safetensors"))


def slicing_images() -> tuple:
    """A small image (one view: the thumbnail alone), a wide one (3 x 1 slices) and a tall one
    (1 x 4), their slice grids checked."""
    small, wide, tall = (
        noise_image(1, (20, 24)),
        noise_image(2, (40, 80)),
        noise_image(3, (110, 30)),
    )
    assert grid_of(24, 20) is None and grid_of(80, 40) == (3, 1) and grid_of(30, 110) == (1, 4)
    return small, wide, tall


def release_config(text: dict, version: str) -> dict:
    """config.json as MiniCPM-V 2.6 / 4.0 / 4.5 write it (their fields, tiny values); no
    image_token_id: its <unk> id comes from the saved tokenizer, as vLLM looks it up."""
    top = {"architectures": ["MiniCPMV"], "model_type": "minicpmv", "version": float(version)}
    top |= {"auto_map": {"AutoConfig": "configuration_minicpm.MiniCPMVConfig"}}
    top |= {"query_num": QUERIES, "slice_mode": True, "use_image_id": True, "patch_size": PATCH}
    top |= {"drop_vision_last_layer": False, "batch_vision_input": True, "image_size": RES}
    top |= {"slice_config": {"max_slice_nums": MAX_SLICES, "model_type": "minicpmv"}}
    top["slice_config"] |= {"patch_size": PATCH, "scale_resolution": RES}
    top |= {"use_sliding_window": False, "sliding_window": 1024, "hidden_act": "silu"}
    top |= {"vision_config": {**VISION, "model_type": "siglip"}, "torch_dtype": "float32"}
    return {**text, **top}


def grid_of(w: int, h: int, res: int = RES) -> tuple[int, int] | None:
    """vLLM's get_sliced_grid (the release processor's): (cols, rows) or None."""
    n = min(math.ceil(w * h / res**2), MAX_SLICES)
    if n <= 1:
        return None
    best, error = None, math.inf
    for count in [c for c in (n - 1, n, n + 1) if c != 1 and c <= MAX_SLICES]:
        for cols in [m for m in range(1, count + 1) if count % m == 0]:
            e = abs(math.log(w / h) - math.log(cols / (count // cols)))
            if e < error:
                best, error = (cols, count // cols), e
    return best


def views(image):
    """The release processor's views of one image: (grid, [PIL views])."""

    def fit(w: float, h: float, up: bool) -> tuple[int, int]:
        if w * h > RES * RES or up:
            h2 = int(RES / math.sqrt(w / h))
            w, h = int(h2 * (w / h)), h2
        return tuple(max(round(v / PATCH) * PATCH, PATCH) for v in (w, h))

    w, h = image.size
    grid = grid_of(w, h)
    out = [image.resize(fit(w, h, grid is None), Image.Resampling.BICUBIC)]
    if grid is not None:
        cols, rows = grid
        cw, ch = fit(
            max(round(w / cols) * cols, cols) / cols, max(round(h / rows) * rows, rows) / rows, True
        )
        big = image.resize((cw * cols, ch * rows), Image.Resampling.BICUBIC)
        out += [
            big.crop((c * cw, r * ch, c * cw + cw, r * ch + ch))
            for r in range(rows)
            for c in range(cols)
        ]
    return grid, out


def view_rows(ref, view) -> torch.Tensor:
    """[QUERIES, WIDTH]: the tower at the view's grid, then the resampler (its positions on
    the keys; 4.5's on the values)."""
    _, vpm, rs, _ = ref
    x = torch.from_numpy(np.asarray(view, dtype=np.float32) / 255).permute(2, 0, 1)
    x = ((x - 0.5) / 0.5)[None]
    h, w = x.shape[-2] // PATCH, x.shape[-1] // PATCH
    table = transformers.models.vit_mae.modeling_vit_mae.build_2d_sinusoidal_position_embedding(
        70, 70, WIDTH
    )
    pos = table.view(70, 70, WIDTH).transpose(0, 1)[:h, :w].reshape(h * w, WIDTH)
    with torch.no_grad():
        feats = vpm(x).last_hidden_state[0]  # [h w, D]
        kv = rs["ln_kv"](rs["kv_proj"](feats))[:, None]  # [L, 1, E] (sequence first)
        q = rs["ln_q"](rs.query)[:, None]
        keys, values = (kv, kv + pos[:, None]) if rs.on_values else (kv + pos[:, None], kv)
        out = rs["attn"](q, keys, values)[0][:, 0]
        return rs["ln_post"](out) @ rs.proj


def image_text(k: int, grid: tuple[int, int] | None) -> str:
    """The release processor's text for image `k`: its id, the overview's <unk> run, then
    `grid`'s (columns, rows) slices, a row a line; None: no slices."""
    unk = "<unk>" * QUERIES
    seg = f"<image_id>{k}</image_id><image>{unk}</image>"
    if grid is not None:
        cols, n = grid
        seg += "\n".join("".join(f"<slice>{unk}</slice>" for _ in range(cols)) for _ in range(n))
    return seg


def reference(ref, text: str, images: list):
    """(the release processor's prompt ids, Qwen2's greedy with top-5 on the scattered rows)."""
    llm, _, _, tokenizer = ref
    rows = []
    for k, image in enumerate(images):
        grid, vs = views(image)
        text = text.replace(PATTERN, image_text(k, grid), 1)
        rows += [view_rows(ref, v) for v in vs]
    ids = tokenizer(text).input_ids
    return ids, hf_greedy_with_rows(llm, ids, tokenizer.convert_tokens_to_ids("<unk>"), rows)


def test_slicing_follows_the_release_rules():
    """2.6's grid at the release's 448 (vLLM's get_sliced_grid): one view, a square tie kept
    at one column, wide, 3 x 3, a tall image taking 4 slices of n + 1."""
    from paged_engine.multimodal.minicpmv_remote import sliced_grid

    sizes = [((448, 448), None), ((500, 500), (1, 2)), ((1000, 500), (2, 1))]
    sizes += [((1344, 1344), (3, 3)), ((300, 2000), (1, 4))]
    for (w, h), want in sizes:
        assert sliced_grid(w, h, 9, 448) == want == grid_of(w, h, 448), (w, h)


def test_images_match_reference(ckpt):
    """A small image (one upscaled view), a wide one (3 x 1 slices), a tall one in 1 x 4,
    two images in one prompt (<image_id>1), and text alone; the images again with the
    expanded ids as prompt_token_ids; a pattern short and mm_processor_kwargs refused."""
    path, ref = ckpt
    small, wide, tall = slicing_images()
    assert image_text(0, (3, 1)) == WIDE_TEXT and image_text(0, (1, 4)) == TALL_TEXT
    one, two = f"look {PATTERN}\nwhat is it", f"{PATTERN} and {PATTERN} differ"
    cases = [(one, [small]), (one, [wide]), (one, [tall]), (two, [wide, small])]
    cases.append(("the sea is wide", []))
    llm = engine(path, max_model_len=512, limit_mm_per_prompt={"image": 2})
    refs = [reference(ref, t, im) for t, im in cases]
    check_engine_matches_hf(llm, cases, refs, "minicpmv_remote")
    with pytest.raises(ValueError, match="image placeholder"):  # two images, one pattern
        llm.generate([{"prompt": one, "multi_modal_data": {"image": [small, wide]}}], greedy(0))
    with pytest.raises(ValueError, match="mm_processor_kwargs"):
        bad = {"prompt": one, "multi_modal_data": {"image": small}}
        llm.generate([{**bad, "mm_processor_kwargs": {"max_slice_nums": 2}}], greedy(0))
    first = {"prompt": one, "multi_modal_data": {"image": [small]}}
    assert len(llm.generate([first], greedy(0))[0].outputs[0].token_ids) == 8


@pytest.mark.parametrize(
    ("field", "change"),
    [
        ("version", {"version": 2.0}),
        ("version", {"version": "4.6"}),
        ("rope_scaling", {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}),
        ("version", {"version": 3.0}),
        ("drop_vision_last_layer", {"drop_vision_last_layer": True}),
        ("slice_mode", {"slice_mode": False}),
        ("use_sliding_window", {"use_sliding_window": True}),
    ],
)
def test_configs_refused_by_name(ckpt, tmp_path, field, change):
    path, _ = ckpt
    config = json.loads((path / "config.json").read_text())
    check_config_refused(path, tmp_path, config | change, field)


def test_auto_dtype_is_the_releases(ckpt, tmp_path):
    """dtype="auto" serves in config.json's torch_dtype (the releases' bfloat16), which the
    translated config keeps (remote_aliases.remote_config)."""
    from paged_engine.loader import resolve_dtype
    from paged_engine.models.remote_aliases import remote_config

    raw = json.loads((ckpt[0] / "config.json").read_text())
    raw |= {"torch_dtype": "bfloat16", "image_token_id": 3}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert resolve_dtype("auto", remote_config(tmp_path)) == torch.bfloat16
