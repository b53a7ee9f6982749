"""Images through GLM-4V 9B as the Hub ships it (THUDM/glm-4v-9b: config.json's ChatGLMModel with
a vision_config, remote code; vLLM's GLM4VForCausalLM: multimodal/glm4v_remote.py,
models/glm4v_remote_config.py) against a reference composed here.

transformers has no GLM-4V 9B class (its Glm4v is GLM-4.1V, another model). The reference: the
decoder is transformers' GlmForCausalLM written into ChatGLM's names and config.json as
test_models_chatglm.py does (the same model), fed inputs_embeds; the vision side is EVA2-CLIP,
its 2 x 2 conv and GLU projector written below in plain torch functions from the release's
modeling code as vLLM's glm4v.py runs it (explicit softmax attention, post-norm residuals, cls
row dropped, [boi, rows, eoi] / scaling_factor), over random tensors saved under the
release's `transformer.vision.` names. The pixels are transformers' CLIPImageProcessorPil
(bicubic to image_size, no crop, CLIP's mean / std). The prompt: the boi, <|endoftext|>, eoi
triple -> boi, (grid / 2)^2 pads, eoi, the whole span taking the encoder's rows at 1-D
positions, as vLLM's processor and model do. paged must give the reference's prompt ids,
greedy tokens and top-5 logprobs (1e-3, float32), with an image and text alone.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from hf_parity import fuse_qkv
from hf_reference import hf_greedy, load_hf_model
from image_checks import check_config_refused, check_engine_matches_hf, engine, greedy, noise_image
from test_models_chatglm import _RELEASE_CONFIG, _RENAMES, _release_config
from test_qwen_vl_v1 import clip_pixels
from vlm_checkpoints import finish_checkpoint, tokenizer_with

from paged_engine.testing import write_tiny_model

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

MARKS = ["<|begin_of_image|>", "<|endoftext|>", "<|end_of_image|>"]
PLACEHOLDER = "".join(MARKS)
HIDDEN, FFN, VOCAB = 64, 128, 520  # the decoder's (test_models_chatglm.py's sizes)
WIDTH, HEADS, LAYERS, MLP, IMAGE, PATCH, SCALE = 32, 2, 2, 64, 56, 14, 4.0
GRID = IMAGE // PATCH  # 4: a 2 x 2 grid of rows after the conv
ROWS = (GRID // 2) ** 2


def vision_config(**changes) -> dict:
    """glm-4v-9b's vision_config fields, at tiny sizes."""
    config = {"dropout_prob": 0.0, "hidden_act": "gelu", "in_channels": 3}
    config |= {"num_hidden_layers": LAYERS, "hidden_size": WIDTH, "patch_size": PATCH}
    config |= {"num_heads": HEADS, "intermediate_size": MLP, "layer_norm_eps": 1e-6}
    config |= {"num_positions": GRID * GRID + 1, "image_size": IMAGE, "scaling_factor": SCALE}
    return config | changes


def _vision_state(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random tensors under the release's `transformer.vision.` names and shapes."""
    shapes = {
        "patch_embedding.proj.weight": (WIDTH, 3, PATCH, PATCH),
        "patch_embedding.proj.bias": (WIDTH,),
        "patch_embedding.cls_embedding": (1, WIDTH),
        "patch_embedding.position_embedding.weight": (GRID * GRID + 1, WIDTH),
        "conv.weight": (HIDDEN, WIDTH, 2, 2),
        "conv.bias": (HIDDEN,),
        "linear_proj.linear_proj.weight": (HIDDEN, HIDDEN),
        "linear_proj.norm1.weight": (HIDDEN,),
        "linear_proj.norm1.bias": (HIDDEN,),
        "linear_proj.gate_proj.weight": (FFN, HIDDEN),
        "linear_proj.dense_h_to_4h.weight": (FFN, HIDDEN),
        "linear_proj.dense_4h_to_h.weight": (HIDDEN, FFN),
        "boi": (1, 1, HIDDEN),
        "eoi": (1, 1, HIDDEN),
    }
    for i in range(LAYERS):
        p = f"transformer.layers.{i}."
        shapes |= {f"{p}attention.query_key_value.weight": (3 * WIDTH, WIDTH)}
        shapes |= {f"{p}attention.query_key_value.bias": (3 * WIDTH,)}
        shapes |= {
            f"{p}attention.dense.weight": (WIDTH, WIDTH),
            f"{p}attention.dense.bias": (WIDTH,),
        }
        shapes |= {f"{p}mlp.fc1.weight": (MLP, WIDTH), f"{p}mlp.fc1.bias": (MLP,)}
        shapes |= {f"{p}mlp.fc2.weight": (WIDTH, MLP), f"{p}mlp.fc2.bias": (WIDTH,)}
        for norm in ("input_layernorm", "post_attention_layernorm"):
            shapes |= {f"{p}{norm}.weight": (WIDTH,), f"{p}{norm}.bias": (WIDTH,)}
    out = {}
    for name, shape in shapes.items():
        w = torch.randn(shape, generator=gen)
        if "norm" in name and name.endswith("weight"):
            w = 1.0 + 0.1 * w
        elif name.endswith("bias"):
            w = 0.1 * w
        elif len(shape) >= 2 and name.endswith("weight"):
            w = w * shape[1] ** -0.5 if len(shape) == 2 else w * (w[0].numel() ** -0.5)
        out[name] = w
    return out


def _layer_norm(x: torch.Tensor, s: dict, name: str, eps: float) -> torch.Tensor:
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * s[f"{name}.weight"] + s[f"{name}.bias"]


def image_rows(s: dict[str, torch.Tensor], image) -> torch.Tensor:
    """[ROWS + 2, HIDDEN]: EVA2-CLIP, the conv, the GLU, boi / eoi, over CLIP's pixels."""
    x = clip_pixels(image, IMAGE)
    with torch.no_grad():
        p = F.conv2d(x, s["patch_embedding.proj.weight"], s["patch_embedding.proj.bias"], PATCH)
        h = torch.cat([s["patch_embedding.cls_embedding"], p[0].flatten(1).T])  # [1 + g^2, W]
        h = h + s["patch_embedding.position_embedding.weight"]
        d = WIDTH // HEADS
        for i in range(LAYERS):
            pre = f"transformer.layers.{i}."
            qkv = h @ s[f"{pre}attention.query_key_value.weight"].T
            qkv = qkv + s[f"{pre}attention.query_key_value.bias"]
            q, k, v = (t.reshape(-1, HEADS, d).transpose(0, 1) for t in qkv.split(WIDTH, -1))
            att = torch.softmax(q @ k.transpose(1, 2) / d**0.5, -1) @ v  # [H, L, d]
            att = att.transpose(0, 1).reshape(-1, WIDTH) @ s[f"{pre}attention.dense.weight"].T
            att = att + s[f"{pre}attention.dense.bias"]
            h = h + _layer_norm(att, s, f"{pre}input_layernorm", 1e-6)
            m = F.gelu(h @ s[f"{pre}mlp.fc1.weight"].T + s[f"{pre}mlp.fc1.bias"])
            m = m @ s[f"{pre}mlp.fc2.weight"].T + s[f"{pre}mlp.fc2.bias"]
            h = h + _layer_norm(m, s, f"{pre}post_attention_layernorm", 1e-6)
        grid = h[1:].T.reshape(1, WIDTH, GRID, GRID)
        r = F.conv2d(grid, s["conv.weight"], s["conv.bias"], stride=2)[0].flatten(1).T
        r = r @ s["linear_proj.linear_proj.weight"].T
        r = F.gelu(_layer_norm(r, s, "linear_proj.norm1", 1e-5))
        gate = F.silu(r @ s["linear_proj.gate_proj.weight"].T)
        r = (gate * (r @ s["linear_proj.dense_h_to_4h.weight"].T)) @ s[
            "linear_proj.dense_4h_to_h.weight"
        ].T
        return torch.cat([s["boi"][0], r, s["eoi"][0]]) / SCALE


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """(the release-layout dir, the reference: HF's Glm, the vision tensors, tokenizer)."""
    path = tmp_path_factory.mktemp("glm4v_remote")
    tokenizer, ids = tokenizer_with(MARKS, 3)
    write_tiny_model(
        path,
        "glm",
        seed=3,
        vocab_size=VOCAB,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 30000.0},
    )
    hf = load_hf_model(path)
    state = {}
    for name, w in fuse_qkv(hf.state_dict(), ".self_attention.query_key_value.").items():
        for ours, theirs in _RENAMES:
            name = name.replace(ours, theirs)
        state[name] = w
    vision = _vision_state(torch.Generator().manual_seed(5))
    state |= {f"transformer.vision.{k}": v for k, v in vision.items()}
    safetensors.save_file(
        {k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors")
    )
    config = _release_config(
        padded_vocab_size=VOCAB,
        rope_ratio=3.0,
        pad_token_id=ids["<|endoftext|>"],
        boi_token_id=ids["<|begin_of_image|>"],
        eoi_token_id=ids["<|end_of_image|>"],
        vision_config=vision_config(),
    )
    (path / "config.json").write_text(json.dumps(config))
    (path / "configuration_chatglm.py").write_text(_RELEASE_CONFIG)  # its auto_map's
    finish_checkpoint(path, tokenizer)
    return path, (hf, vision, tokenizer)


def reference(ref, text: str, images: list):
    """(vLLM's prompt ids: the triple -> boi, ROWS pads, eoi; HF Glm's greedy with top-5, the
    span's input rows the encoder's)."""
    hf, vision, tokenizer = ref
    boi, pad, eoi = tokenizer.convert_tokens_to_ids(MARKS)
    ids = tokenizer(text).input_ids
    if not images:
        return ids, hf_greedy(hf, ids, 8, 5)
    at = next(i for i in range(len(ids)) if ids[i : i + 3] == [boi, pad, eoi])
    ids = ids[:at] + [boi] + [pad] * ROWS + [eoi] + ids[at + 3 :]
    with torch.no_grad():
        embeds = hf.get_input_embeddings()(torch.tensor([ids]))
        embeds[0, at : at + ROWS + 2] = image_rows(vision, images[0])
    return ids, hf_greedy(hf, ids, 8, 5, inputs_embeds=embeds)


def test_images_match_reference(ckpt):
    """An image, text alone; the expanded ids as prompt_token_ids; the chat form (vLLM's
    placeholder); two images, a missing triple, embeddings and mm_processor_kwargs refused by
    name."""
    path, ref = ckpt
    a, b = noise_image(1, (40, 52)), noise_image(2, (70, 30))
    one = f"look {PLACEHOLDER} what is it"
    cases = [(one, [a]), ("the sea is wide", [])]
    # (trust_remote_code as the release needs it: the config is read without running it)
    llm = engine(path, max_model_len=128, limit_mm_per_prompt={"image": 2}, trust_remote_code=True)
    refs = [reference(ref, t, im) for t, im in cases]
    check_engine_matches_hf(llm, cases, refs, "glm4v_remote")
    first = f"{PLACEHOLDER}\ndescribe"  # the image first, as the chat form puts it
    other = reference(ref, first, [b])
    (out,) = llm.generate([{"prompt": first, "multi_modal_data": {"image": b}}], greedy())
    assert out.prompt_token_ids == other[0] and out.outputs[0].token_ids == other[1].tokens
    parts = [{"type": "image_pil", "image_pil": b}, {"type": "text", "text": "describe"}]
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (out,) = llm.chat([{"role": "user", "content": parts}], greedy(), chat_template=template)
    assert out.prompt_token_ids == other[0]  # vLLM's placeholder, a line of its own
    assert out.outputs[0].token_ids == other[1].tokens
    with pytest.raises(ValueError, match="takes one"):
        two = {"prompt": one + PLACEHOLDER, "multi_modal_data": {"image": [a, b]}}
        llm.generate([two], greedy())
    with pytest.raises(ValueError, match="takes one"):  # two expanded spans, found as they are
        both = {"prompt_token_ids": refs[0][0] * 2, "multi_modal_data": {"image": [a, b]}}
        llm.generate([both], greedy())
    with pytest.raises(ValueError, match="placeholder"):
        llm.generate([{"prompt": "no image here", "multi_modal_data": {"image": a}}], greedy())
    with pytest.raises(ValueError, match="embeddings are not supported"):
        embeds = {"prompt": one, "multi_modal_data": {"image": [torch.zeros(ROWS + 2, HIDDEN)]}}
        llm.generate([embeds], greedy())
    with pytest.raises(ValueError, match="mm_processor_kwargs"):
        bad = {"prompt": one, "multi_modal_data": {"image": a}, "mm_processor_kwargs": {"size": 2}}
        llm.generate([bad], greedy())
    with pytest.raises(ValueError, match="0x0 pixels"):  # not a resized black square
        empty = noise_image(0, (1, 1)).crop((0, 0, 0, 0))
        llm.generate([{"prompt": one, "multi_modal_data": {"image": empty}}], greedy())
    # the pad is <|endoftext|>: a text prompt may hold it (no image asked for), as in vLLM
    text = "a<|endoftext|>b"
    (out,) = llm.generate([text], greedy())
    assert out.outputs[0].token_ids == reference(ref, text, [])[1].tokens


@pytest.mark.parametrize(
    ("field", "change"),
    [
        ("vision_config.num_positions", {"num_positions": GRID * GRID}),
        ("vision_config.image_size", {"image_size": 42}),  # a 3 x 3 grid: odd
        ("vision_config.hidden_act", {"hidden_act": "quick_gelu"}),
        ("vision_config.scaling_factor", {"scaling_factor": None}),
    ],
)
def test_configs_refused_by_name(ckpt, tmp_path, field, change):
    path, _ = ckpt
    config = json.loads((path / "config.json").read_text())
    config["vision_config"] = {**config["vision_config"], **change}
    check_config_refused(path, tmp_path, config, field)
