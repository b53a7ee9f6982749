"""The Hub's remote-code InternVL (`InternVLChatModel`, multimodal/internvl_chat.py) against HF's
InternVLForConditionalGeneration on the same weights.

A tiny random InternVL checkpoint in transformers' form (a Qwen2 decoder; 32-pixel tiles of
4-pixel patches, 16 rows a tile, up to 4 tiles and a thumbnail; q / k / v biases and q / k
norms on) is written again in the Hub's remote layout (the inverse of transformers'
convert_internvl_weights_to_hf: `vision_model.*` with a fused `attn.qkv`, `mlp1.{0,1,3}`,
`language_model.*`; config.json with vision_config / llm_config / select_layer / ps_version
...; no image processor file). paged on the remote dir must give HF's prompt ids, greedy
tokens and top-5 logprobs (1e-3, float32) on the transformers dir, for an image marked by
"<image>" (vLLM's placeholder, what the chat template writes), two marked by <IMG_CONTEXT>,
and text alone; `LLM.chat` with an image part gives the same answer; config values the path
does not serve are refused by name.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from image_checks import (
    WIDE_TALL_SMALL,
    check_matches_hf,
    engine,
    greedy,
    hf_cases,
    hf_refs,
    noise_image,
)
from vlm_checkpoints import (
    chatml_template,
    finish_checkpoint,
    load_hf_vlm,
    tiled_context_inputs,
    tokenizer_with,
)

from paged_engine.models.multimodal_text import text_only_config
from paged_engine.multimodal.internvl_chat import internvl_config
from paged_engine.testing import _COMMON, _save_random, tiny_config

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL.Image")
safetensors = pytest.importorskip("safetensors.torch")

CTX, MARKER = "<IMG_CONTEXT>", "<image>"
PROMPT = f"<|im_start|>user\n{MARKER}\nWhat is in it?<|im_end|>\n<|im_start|>assistant\n"
TWO = f"<|im_start|>user\n{CTX}\nand {CTX}\nWhich is brighter?<|im_end|>\n<|im_start|>assistant\n"
TEXT = "<|im_start|>user\nSay something about the sea.<|im_end|>\n<|im_start|>assistant\n"
# transformers' name -> the Hub's (applied in order, on `model.`-less names)
_TO_HUB = (
    ("vision_tower.", "vision_model."),
    ("multi_modal_projector.layer_norm.", "mlp1.0."),
    ("multi_modal_projector.linear_1.", "mlp1.1."),
    ("multi_modal_projector.linear_2.", "mlp1.3."),
    (".encoder.layer.", ".encoder.layers."),
    (".lambda_1", ".ls1"),
    (".lambda_2", ".ls2"),
    (".attention.projection_layer.", ".attn.proj."),
    (".attention.", ".attn."),
    (".layernorm_before.", ".norm1."),
    (".layernorm_after.", ".norm2."),
    (".embeddings.cls_token", ".embeddings.class_embedding"),
    (".embeddings.position_embeddings", ".embeddings.position_embedding"),
    (".embeddings.patch_embeddings.projection.", ".embeddings.patch_embedding."),
)


def write_tiny_internvl_hf(path, seed: int, decoder: str = "qwen2"):
    """transformers' InternVL checkpoint with a `decoder` text model (its GotOcr2 tiling
    processor, a tokenizer with <img>, </img>, <IMG_CONTEXT> and "<image>", a chat template
    writing "<image>\\n")."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer, ids = tokenizer_with(["<img>", "</img>", CTX, MARKER], seed)
    text = tiny_config(decoder, vocab_size=len(tokenizer)).to_dict()
    vision = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2}
    vision |= {"num_attention_heads": 4, "image_size": [32, 32], "patch_size": [4, 4]}
    vision |= {"attention_bias": True, "use_qk_norm": True}
    config = transformers.InternVLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids[CTX],
        downsample_ratio=0.5,
        **_COMMON,
    )
    _save_random(transformers.InternVLForConditionalGeneration, config, seed, path)
    save_tiling_processor(path)
    return finish_checkpoint(path, tokenizer, chatml_template(MARKER + "\n"))


def save_tiling_processor(path) -> None:
    """GotOcr2's tiling processor in `path` as the InternVL conversion writes it: 32-pixel
    tiles, 1 to 4 of them, ImageNet mean / std."""
    transformers.GotOcr2ImageProcessorPil(
        size={"height": 32, "width": 32},
        min_patches=1,
        max_patches=4,
        image_mean=[0.485, 0.456, 0.406],
        image_std=[0.229, 0.224, 0.225],
    ).save_pretrained(path)


def assert_chat_matches(llm, image, ref) -> None:
    """LLM.chat of one user turn (`image`, then "What is in it?") gives the prompt ids and
    greedy tokens of `ref` (prompt ids, Greedy): the turn as the checkpoint's chat template
    renders it."""
    message = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image}]}]
    message[0]["content"].append({"type": "text", "text": "What is in it?"})
    (out,) = llm.chat(message, greedy(0), use_tqdm=False)
    assert out.prompt_token_ids == ref[0]
    assert list(out.outputs[0].token_ids) == ref[1].tokens


def to_remote(hf_dir, path, internlm2: bool = False):
    """`hf_dir` in the Hub's remote layout at `path` (weights, config.json; the tokenizer and
    generation config copied, no image processor); with `internlm2`, its Llama decoder as
    InternLM2 (packed wqkv, its names, its own head)."""
    path.mkdir(parents=True, exist_ok=True)
    saved = safetensors.load_file(str(hf_dir / "model.safetensors"))
    state = {name.removeprefix("model."): tensor for name, tensor in saved.items()}
    hf = json.loads((hf_dir / "config.json").read_text())
    if internlm2:
        state = _as_internlm2(state, hf["text_config"])
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.startswith(("language_model.model.", "language_model.lm_head.")):
            out[name] = tensor  # transformers 5.25 saves the LLM under the Hub's names
            continue
        if name == "language_model.output.weight":
            out[name] = tensor
            continue
        if name.startswith(("language_model.", "lm_head.")):
            out["language_model." + name.replace("language_model.", "model.", 1)] = tensor
            continue
        for ours, hub in _TO_HUB:
            name = name.replace(ours, hub)
        if ".attn.k_proj." in name or ".attn.v_proj." in name:
            continue
        if ".attn.q_proj." in name:
            parts = [state[_hf_name(name, p)] for p in "qkv"]
            name, tensor = name.replace(".attn.q_proj.", ".attn.qkv."), torch.cat(parts)
        out[name] = tensor.contiguous()
    safetensors.save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    vision, text = hf["vision_config"], hf["text_config"]
    remote_vision = {
        "architectures": ["InternVisionModel"],
        "model_type": "intern_vit_6b",
        "qkv_bias": vision["attention_bias"],
        "qk_normalization": vision["use_qk_norm"],
        "image_size": vision["image_size"][0],
        "patch_size": vision["patch_size"][0],
        "drop_path_rate": 0.0,
        "use_flash_attn": False,
    }
    keep = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    keep += ("num_channels", "hidden_act", "layer_norm_eps", "norm_type")
    remote_vision |= {k: vision[k] for k in keep}
    llm = {**text, "architectures": ["Qwen2ForCausalLM"]}
    heads = ("lm_head.weight", "language_model.lm_head.weight")
    llm["tie_word_embeddings"] = not any(h in state for h in heads)  # the remote LLM's flag
    if internlm2:
        llm |= {"architectures": ["InternLM2ForCausalLM"], "model_type": "internlm2"}
        llm |= {"bias": False, "tie_word_embeddings": False}
    config = {
        "architectures": ["InternVLChatModel"],
        "model_type": "internvl_chat",
        "auto_map": {"AutoConfig": "configuration_internvl_chat.InternVLChatConfig"},
        "downsample_ratio": 0.5,
        "dynamic_image_size": True,
        "force_image_size": 32,
        "max_dynamic_patch": 4,
        "min_dynamic_patch": 1,
        "ps_version": "v2",
        "select_layer": -1,
        "template": "internvl2_5",
        "use_thumbnail": True,
        "torch_dtype": "float32",
        "vision_config": remote_vision,
        "llm_config": llm,
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    for f in hf_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config", "chat_t")):
            shutil.copy(f, path / f.name)
    return path


def _as_internlm2(state: dict, text: dict) -> dict:
    """A Llama decoder's tensors (`language_model.model.*` / `lm_head`) in InternLM2's names
    and packing: per KV head [q x group, k, v] rows in wqkv; `output` its own head."""
    heads, kv = text["num_attention_heads"], text["num_key_value_heads"]
    d = text["hidden_size"] // heads
    names = (
        ("model.embed_tokens.", "model.tok_embeddings."),
        (".self_attn.o_proj.", ".attention.wo."),
        (".mlp.gate_proj.", ".feed_forward.w1."),
        (".mlp.up_proj.", ".feed_forward.w3."),
        (".mlp.down_proj.", ".feed_forward.w2."),
        (".input_layernorm.", ".attention_norm."),
        (".post_attention_layernorm.", ".ffn_norm."),
    )
    out = {}
    embed = state["language_model.model.embed_tokens.weight"]
    head = state.get("language_model.lm_head.weight", embed)
    out["language_model.output.weight"] = head.clone()  # a tensor of its own on disk
    for name, w in state.items():
        if not name.startswith("language_model.model."):
            out.setdefault(name, w)
        elif ".self_attn.q_proj." in name:
            q = w.reshape(kv, heads // kv, d, -1)
            k, v = (state[name.replace("q_proj", f"{p}_proj")].reshape(kv, 1, d, -1) for p in "kv")
            packed = torch.cat((q, k, v), dim=1).reshape(-1, w.shape[-1])
            out[name.replace(".self_attn.q_proj.", ".attention.wqkv.")] = packed
        elif ".self_attn." not in name or ".self_attn.o_proj." in name:
            for ours, theirs in names:
                name = name.replace(ours, theirs)
            out[name] = w
    out.pop("language_model.lm_head.weight", None)
    return out


def _hf_name(hub: str, part: str) -> str:
    """transformers' name of the `part` ("q", "k", "v") projection of a Hub q_proj name."""
    name = hub.replace(".attn.q_proj.", f".attention.{part}_proj.")
    for ours, theirs in reversed(_TO_HUB):
        name = name.replace(theirs, ours)
    return name


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("internvl_chat")
    hf = write_tiny_internvl_hf(root / "hf", seed=5)
    return hf, to_remote(hf, root / "remote")


def test_remote_checkpoint_matches_hf(dirs):
    """ "<image>" (one image), <IMG_CONTEXT> (two) and text alone on the remote dir give HF's
    ids, tokens and logprobs on the transformers dir; LLM.chat's image part the same."""
    hf_dir, remote = dirs
    model = load_hf_vlm(transformers.InternVLForConditionalGeneration, hf_dir)
    cases = hf_cases(PROMPT, TEXT, TWO, WIDE_TALL_SMALL)

    def inputs(text: str, images: list) -> tuple[list[int], dict]:
        return tiled_context_inputs(hf_dir, text.replace(MARKER, CTX), images)

    refs = hf_refs(model, cases, inputs)
    check_matches_hf(remote, cases, refs, "internvl_chat")
    llm = engine(remote)
    assert_chat_matches(llm, cases[0][1][0], refs[0])


def test_refuses_by_name(dirs):
    """Remote config values this path does not serve: ValueError naming the field, from the
    engine as from the config reader; vLLM's names of the tiling kwargs point to GotOcr2's,
    which steer the tiles."""
    _, remote = dirs
    good = json.loads((remote / "config.json").read_text())
    bad = [
        ({"ps_version": "v1"}, "ps_version"),
        ({"force_image_size": 64}, "force_image_size"),
        ({"use_thumbnail": False}, "use_thumbnail"),
        ({"max_dynamic_patch": 0}, "max_dynamic_patch"),
        ({"llm_config": {**good["llm_config"], "model_type": "internlm"}}, "'internlm'"),
    ]
    for change, match in bad:
        with pytest.raises(ValueError, match=match):
            internvl_config({**good, **change}, 7)
    phi3 = internvl_config({**good, "llm_config": {**good["llm_config"], "model_type": "phi3"}}, 7)
    with pytest.raises(ValueError, match="'phi3'"):  # Mini-InternVL-4B: no text class here
        text_only_config(phi3)
    llm = engine(remote)
    prompt = {"prompt": PROMPT, "multi_modal_data": {"image": noise_image(4, (50, 70))}}
    renamed = {**prompt, "mm_processor_kwargs": {"max_dynamic_patch": 2}}
    with pytest.raises(ValueError, match="max_patches"):  # vLLM's name: GotOcr2's named
        llm.generate([renamed], greedy(0), use_tqdm=False)
    one = {**prompt, "mm_processor_kwargs": {"crop_to_patches": False}}
    (out,) = llm.generate([one], greedy(0), use_tqdm=False)
    context = llm.llm_engine.input_processor.images.image_token_id
    assert out.prompt_token_ids.count(context) == 16  # one tile
    (remote / "config.json").write_text(json.dumps({**good, "ps_version": "v1"}))
    try:
        with pytest.raises(ValueError, match="ps_version"):
            engine(remote)
    finally:
        (remote / "config.json").write_text(json.dumps(good))


def test_internlm2_llm_matches_hf(tmp_path):
    """An InternLM2 llm_config (InternVL2 / 2.5's 8B and 26B): its packed wqkv and names
    over the same Llama decoder give HF's ids, tokens and logprobs, with an image and without."""
    hf_dir = write_tiny_internvl_hf(tmp_path / "hf", seed=6, decoder="llama")
    remote = to_remote(hf_dir, tmp_path / "remote", internlm2=True)
    model = load_hf_vlm(transformers.InternVLForConditionalGeneration, hf_dir)
    cases = hf_cases(PROMPT, TEXT, TWO, WIDE_TALL_SMALL)[:2]

    def inputs(text: str, images: list) -> tuple[list[int], dict]:
        return tiled_context_inputs(hf_dir, text.replace(MARKER, CTX), images)

    check_matches_hf(remote, cases, hf_refs(model, cases, inputs), "internvl_chat_internlm2")


def test_skywork_r1v_is_internvl_chat(dirs, tmp_path):
    """SkyworkR1VChatModel (model_type skywork_chat): the same checkpoint under Skywork's
    names gives InternVL-Chat's prompt ids, tokens and logprobs (those checked against HF)."""
    _, remote = dirs
    skywork = shutil.copytree(remote, tmp_path / "skywork")
    config = json.loads((skywork / "config.json").read_text())
    config |= {"architectures": ["SkyworkR1VChatModel"], "model_type": "skywork_chat"}
    (skywork / "config.json").write_text(json.dumps(config))
    prompt = {"prompt": PROMPT, "multi_modal_data": {"image": noise_image(4, (50, 70))}}
    want, got = (
        engine(p).generate([prompt], greedy(), use_tqdm=False)[0] for p in (remote, skywork)
    )
    assert got.prompt_token_ids == want.prompt_token_ids
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    for a, b in zip(got.outputs[0].logprobs, want.outputs[0].logprobs, strict=True):
        assert {t: p.logprob for t, p in a.items()} == {t: p.logprob for t, p in b.items()}
