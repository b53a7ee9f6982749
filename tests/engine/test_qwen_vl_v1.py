"""Images through Qwen-VL v1 as the Hub ships it (config.json's QWenLMHeadModel with a `visual`
section, remote code; vLLM's QwenVLForConditionalGeneration: multimodal/qwen_vl_v1.py,
models/qwen_vl_v1_config.py) against a reference composed here from transformers' and torch's
modules.

transformers has no Qwen-VL class. Its parts are: the OpenCLIP ViT-bigG without a class token,
whose residual blocks are transformers' CLIPEncoder layers (exact GELU, eps 1e-6) once the
release's per-head packed in_proj ([q_h | k_h | v_h] per head) is unpacked into q / k / v, with
the patch conv, the bicubic-resized 16 x 16 positional table and ln_pre from torch; the
resampler (torch's nn.MultiheadAttention and LayerNorms, ViT-MAE's 2-D sin-cos table as its
saved pos_embed, on the queries and, resized to the grid, the keys); Qwen v1 as transformers'
Qwen2ForCausalLM (one KV head per head) fed inputs_embeds, converted to the release's names as
test_models_remote_aliases.py's test_qwen_v1 does. The pixels are transformers'
CLIPImageProcessorPil (bicubic to image_size, no crop, CLIP's mean / std). The prompt: each
<img> ... </img> span's text dropped and n_queries pads put between, as vLLM's processor does.
paged must give the reference's prompt ids, greedy tokens and top-5 logprobs (1e-3, float32).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from hf_reference import hf_greedy_with_rows
from image_checks import (
    check_config_refused,
    check_engine_matches_hf,
    engine,
    greedy,
    noise_image,
)
from test_models_remote_aliases import QWEN_V1_NAMES
from vlm_checkpoints import finish_checkpoint, tiny_qwen2_text, tokenizer_with

from paged_engine.testing import _randomize

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

MARKS = ["<img>", "</img>", "<imgpad>"]
WIDTH, HEADS, IMAGE, PATCH, QUERIES, DIM = 32, 2, 64, 2, 256, 128  # grid 32: 16^2 queries
MEAN = [0.48145466, 0.4578275, 0.40821073]
STD = [0.26862954, 0.26130258, 0.27577711]


def _lm_state(llm) -> dict[str, torch.Tensor]:
    """Qwen2's weights under Qwen v1's names (q / k / v fused into c_attn)."""
    out = {}
    for name, w in llm.state_dict().items():
        if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            continue
        if ".self_attn.q_proj." in name:
            parts = [
                llm.state_dict()[name.replace("q_proj", p)] for p in ("q_proj", "k_proj", "v_proj")
            ]
            name, w = name.replace(".self_attn.q_proj.", ".attn.c_attn."), torch.cat(parts)
        for ours, theirs in QWEN_V1_NAMES:
            name = name.replace(ours, theirs)
        out[name] = w
    return out


def _packed(layer, kind: str) -> torch.Tensor:
    """CLIP's q / k / v `kind` (weight / bias) packed per head as the release's in_proj."""
    a = layer.self_attn
    parts = [
        getattr(getattr(a, p), kind).unflatten(0, (HEADS, -1))
        for p in ("q_proj", "k_proj", "v_proj")
    ]
    return torch.cat(parts, dim=1).flatten(0, 1)


def _visual_state(vit) -> dict[str, torch.Tensor]:
    out = {
        f"transformer.visual.{k}": v
        for k, v in vit.state_dict().items()
        if not k.startswith("encoder.")
    }
    for i, layer in enumerate(vit["encoder"].layers):
        p = f"transformer.visual.transformer.resblocks.{i}."
        for ours, theirs in (("ln_1", layer.layer_norm1), ("ln_2", layer.layer_norm2)):
            out |= {f"{p}{ours}.{k}": v for k, v in theirs.state_dict().items()}
        out |= {f"{p}attn.in_proj.{k}": _packed(layer, k) for k in ("weight", "bias")}
        out |= {
            f"{p}attn.out_proj.{k}": v for k, v in layer.self_attn.out_proj.state_dict().items()
        }
        out |= {f"{p}mlp.c_fc.{k}": v for k, v in layer.mlp.fc1.state_dict().items()}
        out |= {f"{p}mlp.c_proj.{k}": v for k, v in layer.mlp.fc2.state_dict().items()}
    return out


def release_config(src: dict, start: int) -> dict:
    """config.json as Qwen-VL-Chat writes it (its fields, tiny values)."""
    top = {"architectures": ["QWenLMHeadModel"], "model_type": "qwen"}
    top |= {"auto_map": {"AutoConfig": "configuration_qwen.QWenConfig"}}
    top |= {"hidden_size": DIM, "num_attention_heads": 4, "num_hidden_layers": 2}
    top |= {"intermediate_size": 2 * src["intermediate_size"], "kv_channels": DIM // 4}
    top |= {"layer_norm_epsilon": 1e-6, "rotary_emb_base": 10000, "rotary_pct": 1.0}
    top |= {"max_position_embeddings": 1024, "seq_length": 1024, "no_bias": True}
    top |= {"vocab_size": src["vocab_size"], "tie_word_embeddings": False}
    top |= {"use_dynamic_ntk": True, "use_logn_attn": True, "fp16": False, "bf16": False}
    top["visual"] = {"heads": HEADS, "image_size": IMAGE, "image_start_id": start, "layers": 2}
    top["visual"] |= {"mlp_ratio": 2.0, "output_dim": DIM, "patch_size": PATCH, "width": WIDTH}
    return top


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """(the release-layout dir, the reference: the LM, the ViT's parts, tokenizer)."""
    path = tmp_path_factory.mktemp("qwen_vl_v1")
    tokenizer, ids = tokenizer_with(MARKS, 3)
    start = ids["<img>"]
    assert [ids[m] for m in MARKS] == [start, start + 1, start + 2]
    text = tiny_qwen2_text(len(tokenizer), DIM, kv_heads=4)
    torch.manual_seed(0)
    llm = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**text)).float().eval()
    clip = transformers.CLIPVisionConfig(
        hidden_size=WIDTH,
        intermediate_size=2 * WIDTH,
        num_attention_heads=HEADS,
        num_hidden_layers=2,
        hidden_act="gelu",
        layer_norm_eps=1e-6,
    )
    clip._attn_implementation = "eager"
    vit = torch.nn.ModuleDict(
        {
            "conv1": torch.nn.Conv2d(3, WIDTH, PATCH, PATCH, bias=False),
            "ln_pre": torch.nn.LayerNorm(WIDTH, eps=1e-6),
            "encoder": transformers.models.clip.modeling_clip.CLIPEncoder(clip),
            "attn_pool": torch.nn.ModuleDict(
                {
                    "kv_proj": torch.nn.Linear(WIDTH, DIM, bias=False),
                    "attn": torch.nn.MultiheadAttention(DIM, DIM // 128),
                    "ln_q": torch.nn.LayerNorm(DIM, eps=1e-6),
                    "ln_kv": torch.nn.LayerNorm(DIM, eps=1e-6),
                }
            ),
            "ln_post": torch.nn.LayerNorm(DIM, eps=1e-6),
        }
    )
    vit.positional_embedding = torch.nn.Parameter(torch.empty(256, WIDTH))
    vit["attn_pool"].query = torch.nn.Parameter(torch.empty(QUERIES, DIM))
    vit.proj = torch.nn.Parameter(torch.empty(DIM, DIM))
    with torch.no_grad():
        for seed, module in enumerate((llm, vit), start=4):
            _randomize(module, seed)
    mae = transformers.models.vit_mae.modeling_vit_mae.build_2d_sinusoidal_position_embedding
    table = mae(16, 16, DIM).view(16, 16, DIM).transpose(0, 1).reshape(QUERIES, DIM)
    vit["attn_pool"].pos_embed = torch.nn.Parameter(table.float())  # the release's sin-cos
    vit.float().eval()
    state = _lm_state(llm) | _visual_state(vit)
    safetensors.save_file(
        {k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors")
    )
    (path / "config.json").write_text(json.dumps(release_config(text, start)))
    finish_checkpoint(path, tokenizer)
    llm.generation_config.eos_token_id = None
    return path, (llm, vit, tokenizer)


def _resized(table: torch.Tensor, side: int) -> torch.Tensor:
    grid = table.reshape(1, 16, 16, -1).permute(0, 3, 1, 2)
    out = F.interpolate(grid, size=(side, side), mode="bicubic", align_corners=False)
    return out.permute(0, 2, 3, 1).flatten(0, 2)


def clip_pixels(image, side: int) -> torch.Tensor:
    """transformers' CLIP processor on `image` (resized to side x side, no center crop, OpenAI
    CLIP's mean / std): [1, 3, side, side] in float32."""
    proc = transformers.models.clip.image_processing_pil_clip.CLIPImageProcessorPil(
        size={"height": side, "width": side},
        do_center_crop=False,
        image_mean=MEAN,
        image_std=STD,
    )
    return torch.as_tensor(proc(image, return_tensors="pt")["pixel_values"]).float()


def image_rows(vit, image) -> torch.Tensor:
    """[QUERIES, DIM]: CLIP's pixels -> conv, positions, ln_pre, CLIP layers, the resampler."""
    x = clip_pixels(image, IMAGE)
    side, pool = IMAGE // PATCH, vit["attn_pool"]
    with torch.no_grad():
        h = vit["conv1"](x).flatten(2).transpose(1, 2) + _resized(vit.positional_embedding, side)
        h = vit["encoder"](vit["ln_pre"](h)).last_hidden_state[0]  # [grid^2, W]
        kv = pool["ln_kv"](pool["kv_proj"](h))[:, None]  # sequence first
        q = (pool["ln_q"](pool.query) + pool.pos_embed)[:, None]
        out = pool["attn"](q, kv + _resized(pool.pos_embed, side)[:, None], kv)[0][:, 0]
        return vit["ln_post"](out) @ vit.proj


def reference(ref, text: str, images: list):
    """(vLLM's prompt ids: span text dropped, QUERIES pads after each <img>; Qwen2's greedy
    with top-5 on the scattered rows)."""
    llm, vit, tokenizer = ref
    import re

    text = re.sub(r"<img>.*?</img>", "<img></img>", text)
    ids = tokenizer(text).input_ids
    pad, start = tokenizer.convert_tokens_to_ids(["<imgpad>", "<img>"])
    ids = [t for i in ids for t in ([i] + [pad] * QUERIES if i == start else [i])]
    with torch.no_grad():
        rows = [image_rows(vit, im) for im in images]
    return ids, hf_greedy_with_rows(llm, ids, pad, rows)


def test_images_match_reference(ckpt):
    """One image (a path written in its span, dropped), two images (vLLM's empty spans), text
    alone; the expanded ids as prompt_token_ids; the chat form ("Picture 1: <img></img>");
    spans short, a stray </img>, image embeddings and mm_processor_kwargs refused by name."""
    path, ref = ckpt
    a, b = noise_image(1, (40, 52)), noise_image(2, (70, 30))
    one = "Picture 1: <img>/tmp/cat.png</img>\nwhat is it"
    two = "Picture 1: <img></img>\nPicture 2: <img></img>\nthe same?"
    cases = [(one, [a]), (two, [b, a]), ("the sea is wide", [])]
    llm = engine(path, max_model_len=640, limit_mm_per_prompt={"image": 2})
    refs = [reference(ref, t, im) for t, im in cases]
    check_engine_matches_hf(llm, cases, refs, "qwen_vl_v1")
    parts = [{"type": "image_pil", "image_pil": a}, {"type": "text", "text": "what is it"}]
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (out,) = llm.chat([{"role": "user", "content": parts}], greedy(0), chat_template=template)
    assert out.prompt_token_ids == refs[0][0]  # "Picture 1: <img></img>"
    assert out.outputs[0].token_ids == refs[0][1].tokens
    with pytest.raises(ValueError, match="span"):  # two images, one span
        llm.generate([{"prompt": one, "multi_modal_data": {"image": [a, b]}}], greedy(0))
    with pytest.raises(ValueError, match="0x0 pixels"):  # not a resized black square
        empty = noise_image(0, (1, 1)).crop((0, 0, 0, 0))
        llm.generate([{"prompt": one, "multi_modal_data": {"image": empty}}], greedy(0))
    with pytest.raises(ValueError, match="outside an <img>"):
        llm.generate(
            [{"prompt": "x </img> y <img></img>", "multi_modal_data": {"image": a}}], greedy(0)
        )
    with pytest.raises(ValueError, match="embeddings are not supported"):
        embeds = {"prompt": one, "multi_modal_data": {"image": [torch.zeros(QUERIES, DIM)]}}
        llm.generate([embeds], greedy(0))
    with pytest.raises(ValueError, match="mm_processor_kwargs"):
        bad = {"prompt": one, "multi_modal_data": {"image": a}, "mm_processor_kwargs": {"size": 2}}
        llm.generate([bad], greedy(0))
    first = {"prompt": one, "multi_modal_data": {"image": [a]}}
    assert len(llm.generate([first], greedy(0))[0].outputs[0].token_ids) == 8


@pytest.mark.parametrize(
    ("field", "change"),
    [
        ("visual.output_dim", {"output_dim": 256}),
        ("visual.image_size", {"image_size": 32}),
        ("visual.n_queries", {"n_queries": 200}),
        ("visual.mlp_ratio", {"mlp_ratio": "4"}),
    ],
)
def test_configs_refused_by_name(ckpt, tmp_path, field, change):
    path, _ = ckpt
    config = json.loads((path / "config.json").read_text())
    config["visual"] = {**config["visual"], **change}
    check_config_refused(path, tmp_path, config, field)
