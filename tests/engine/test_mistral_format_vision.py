"""Pixtral / Mistral Small 3.x in Mistral's native format (mistral_vision.py, vLLM's
PixtralForConditionalGeneration with config / load / tokenizer format "mistral").

A tiny random HF checkpoint (LLaVA with a Pixtral tower, Pixtral-12B's HF form; Mistral 3 with
its norm and 2 x 2 patch merger) is rewritten here as Mistral ships it: params.json with a
`vision_encoder` section, consolidated.safetensors under Mistral's names (transformers'
conversion tables read backwards; text and vision wq / wk rows back in the interleaved rotary
layout) and a byte-level tekken.json whose specials put [IMG], [IMG_BREAK], [IMG_END] at 10,
12, 13 (mistral_common's ids). The engine on that directory must give the prompt vLLM's mistral
tokenizer writes (BOS, [INST], rows of [IMG] ended by [IMG_BREAK], the last by [IMG_END], the
text's bytes, [/INST]) and HF's greedy tokens and top-5 logprobs on the original with HF's
Pixtral image processor's pixels. Also: the weights equal the HF checkpoint's, and the
vision fields paged cannot map are refused by name.
"""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import pytest
import torch
from hf_parity import write_hf_checkpoint
from image_checks import check_matches_hf, hf_refs, noise_image
from safetensors.torch import load_file, save_file
from test_mistral_format import (
    _to_interleaved,
    assert_native_weights_are_hf,
    native_text_params,
    native_text_weight,
)

from paged_engine.loader import load_hf_config, resolve_model
from paged_engine.testing import tiny_config

transformers = pytest.importorskip("transformers")

SPECIALS = [
    "<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]",
    "[IMG_END]",
]  # fmt: skip
NUM_SPECIAL = 16  # the last two unnamed
IMG, BREAK, END, BOS, INST, END_INST = 10, 12, 13, 1, 3, 4
PATCH, EDGE = 4, 64
PROMPT = "[INST][IMG]What is in it?[/INST]"
TWO = "[INST][IMG] and [IMG]Which is brighter?[/INST]"
TEXT = "[INST]Say hi.[/INST]"
# HF name (after the tower / projector prefix) -> Mistral's, as the conversion scripts map
_VISION = (
    ("vision_tower.", "vision_encoder."),
    ("attention.q_proj", "attention.wq"),
    ("attention.k_proj", "attention.wk"),
    ("attention.v_proj", "attention.wv"),
    ("attention.o_proj", "attention.wo"),
    ("feed_forward.gate_proj", "feed_forward.w1"),
    ("feed_forward.down_proj", "feed_forward.w2"),
    ("feed_forward.up_proj", "feed_forward.w3"),
    ("multi_modal_projector.linear_1", "vision_language_adapter.w_in"),
    ("multi_modal_projector.linear_2", "vision_language_adapter.w_out"),
    ("multi_modal_projector.patch_merger", "patch_merger"),
    ("multi_modal_projector.norm", "pre_mm_projector_norm"),
)


def write_byte_tekken(path: Path, image: dict) -> None:
    """A tekken.json of the 256 bytes (ids NUM_SPECIAL + byte), SPECIALS, an `image` section."""
    vocab = [{"rank": b, "token_bytes": base64.b64encode(bytes([b])).decode()} for b in range(256)]
    data = {
        "config": {
            "pattern": r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+",
            "default_vocab_size": NUM_SPECIAL + 256,
            "default_num_special_tokens": NUM_SPECIAL,
            "version": "v7",
        },
        "vocab": vocab,
        "special_tokens": [{"rank": i, "token_str": s} for i, s in enumerate(SPECIALS)],
        "image": image,
    }
    (path / "tekken.json").write_text(json.dumps(data))


def write_hf(path: Path, arch: str) -> Path:
    text = tiny_config("mistral", vocab_size=NUM_SPECIAL + 256, rms_norm_eps=1e-5)
    vision = transformers.PixtralVisionConfig(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        head_dim=8,
        patch_size=PATCH,
        image_size=EDGE,
        hidden_act="silu",
        rope_parameters={"rope_type": "axial", "rope_theta": 300.0},  # not the default
    )
    common = {"text_config": text, "vision_config": vision, "vision_feature_layer": -1}
    if arch == "mistral3":
        config = transformers.Mistral3Config(image_token_index=IMG, spatial_merge_size=2, **common)
        cls = transformers.Mistral3ForConditionalGeneration
    else:
        config = transformers.LlavaConfig(
            image_token_id=IMG, vision_feature_select_strategy="full", **common
        )
        cls = transformers.LlavaForConditionalGeneration
    return write_hf_checkpoint(path, cls, config, seed=3)


def write_native(hf_dir: Path, out: Path) -> Path:
    """`hf_dir` as Mistral ships it: params.json, consolidated.safetensors, tekken.json."""
    out.mkdir(parents=True)
    cfg = json.loads((hf_dir / "config.json").read_text())
    text, vision = cfg["text_config"], cfg["vision_config"]
    heads, kv_heads = text["num_attention_heads"], text["num_key_value_heads"]
    merge = cfg.get("spatial_merge_size", 1)
    encoder = {
        k: vision[k]
        for k in (
            "hidden_size",
            "num_channels",
            "image_size",
            "patch_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        )
    }
    encoder |= {"rope_theta": vision["rope_parameters"]["rope_theta"], "image_token_id": IMG}
    encoder |= {"image_break_token_id": BREAK, "image_end_token_id": END}
    encoder["adapter_bias"] = cfg["multimodal_projector_bias"]
    if merge > 1:
        encoder |= {"mm_projector_id": "patch_merge", "spatial_merge_size": merge}
        encoder |= {"add_pre_mm_projector_layer_norm": True, "max_image_size": EDGE}
    params = {**native_text_params(text), "vision_encoder": encoder}
    weights = load_file(hf_dir / "model.safetensors")
    if "language_model.lm_head.weight" not in weights:  # tied: the checkpoint has no head
        params["tied_embeddings"] = True
    (out / "params.json").write_text(json.dumps(params))
    native = {}
    for name, w in weights.items():
        if name.startswith(("vision_tower.", "multi_modal_projector.")):
            for hf, ours in _VISION:
                name = name.replace(hf, ours)
            if name.endswith(("attention.wq.weight", "attention.wk.weight")):
                w = _to_interleaved(w, vision["num_attention_heads"])
        else:
            name, w = native_text_weight(name.removeprefix("language_model."), w, heads, kv_heads)
        native[name] = w.contiguous()
    save_file(native, out / "consolidated.safetensors")
    image = {"image_patch_size": PATCH, "max_image_size": EDGE, "spatial_merge_size": merge}
    write_byte_tekken(out, image)
    return out


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    cache: dict[str, tuple[Path, Path]] = {}

    def make(arch: str) -> tuple[Path, Path]:
        if arch not in cache:
            hf_dir = write_hf(tmp_path_factory.mktemp(arch), arch)
            cache[arch] = (hf_dir, write_native(hf_dir, tmp_path_factory.mktemp("n") / arch))
        return cache[arch]

    return make


def _ids(text: str) -> list[int]:
    return [NUM_SPECIAL + b for b in text.encode()]


def _reference_inputs(merge: int, text: str, images: list) -> tuple[list[int], dict]:
    """mistral_common's prompt ids (BOS, [INST], text bytes with each image's rows in place of
    its [IMG], [/INST]) and HF's Pixtral image processor's pixels at the unit patch x merge."""
    pieces = text.removeprefix("[INST]").removesuffix("[/INST]").split("[IMG]")
    ids = [BOS, INST, *_ids(pieces[0])]
    if not images:
        return [*ids, END_INST], {}
    unit = PATCH * merge
    processor = transformers.PixtralImageProcessorPil(
        size={"longest_edge": EDGE}, patch_size={"height": unit, "width": unit}
    )
    out = processor(images=images, return_tensors="pt")
    for (h, w), piece in zip(out["image_sizes"].tolist(), pieces[1:], strict=True):
        span = ([IMG] * (w // unit) + [BREAK]) * (h // unit)
        span[-1] = END
        ids += [*span, *_ids(piece)]
    return [*ids, END_INST], {k: out[k] for k in ("pixel_values", "image_sizes")}


@pytest.mark.parametrize("arch", ["llava", "mistral3"])
def test_native_checkpoint_serves_images_like_hf(dirs, arch):
    hf_dir, native = dirs(arch)
    name = "Mistral3" if arch == "mistral3" else "Llava"
    model = getattr(transformers, f"{name}ForConditionalGeneration").from_pretrained(
        hf_dir, dtype=torch.float32
    )
    model.eval().generation_config.eos_token_id = None
    merge = 2 if arch == "mistral3" else 1
    cases = [(PROMPT, [noise_image(1, (40, 56))]), (PROMPT, [noise_image(2, (90, 30))])]
    cases += [(TWO, [noise_image(3, (16, 64)), noise_image(4, (48, 40))]), (TEXT, [])]
    refs = hf_refs(model, cases, lambda text, imgs: _reference_inputs(merge, text, imgs))
    check_matches_hf(native, cases, refs, f"native {arch}")


@pytest.mark.parametrize("arch", ["llava", "mistral3"])
def test_weights_and_config_are_the_hf_checkpoints(dirs, arch):
    hf_dir, native = dirs(arch)
    assert_native_weights_are_hf(hf_dir, native)
    ours, theirs = load_hf_config(resolve_model(native)), load_hf_config(resolve_model(hf_dir))
    for field in ("architectures", "hidden_size", "vocab_size", "tie_word_embeddings"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.text_only_of == theirs.text_only_of


def _with_vision(native: Path, out: Path, **fields) -> Path:
    shutil.copytree(native, out)
    params = json.loads((native / "params.json").read_text())
    params["vision_encoder"] = {**params["vision_encoder"], **fields}
    (out / "params.json").write_text(json.dumps(params))
    return out


def test_unmapped_vision_fields_are_refused_by_name(dirs, tmp_path):
    from paged_engine.mistral_vision import native_image_processor, vision_hf_name

    _, native = dirs("mistral3")
    for i, (fields, match) in enumerate(
        [
            ({"mm_projector_id": "mlp"}, "mm_projector_id"),
            ({"add_pre_mm_projector_layer_norm": False}, "add_pre_mm_projector_layer_norm"),
            ({"video_stride": 2}, "video_stride"),
            ({"spatial_merge_size": 0}, "spatial_merge_size"),
        ]
    ):
        path = _with_vision(native, tmp_path / str(i), **fields)
        with pytest.raises(ValueError, match=match):
            load_hf_config(resolve_model(path))
    with pytest.raises(ValueError, match="unknown tensor"):
        vision_hf_name("vision_encoder.transformer.norm.weight")
    wrong = _with_vision(native, tmp_path / "ids", image_break_token_id=11)
    with pytest.raises(ValueError, match="image_break_token_id"):
        native_image_processor(wrong)


def test_vllm_flags_and_text_only_serving(dirs):
    """vLLM's three "mistral" flags give the auto run's tokens with an image; with
    limit_mm_per_prompt={"image": 0} the text model alone answers a text prompt."""
    from image_checks import engine, greedy

    _, native = dirs("llava")
    prompt = {"prompt": PROMPT, "multi_modal_data": {"image": noise_image(4, (24, 36))}}
    outs = []
    for formats in (
        {},
        dict.fromkeys(("tokenizer_mode", "config_format", "load_format"), "mistral"),
    ):
        llm = engine(native, **formats)
        outs.append(llm.generate([prompt, TEXT], greedy(0), use_tqdm=False))
        llm.llm_engine.shutdown()
    assert [o.outputs[0].token_ids for o in outs[0]] == [o.outputs[0].token_ids for o in outs[1]]
    assert outs[0][0].prompt_token_ids.count(IMG) == (24 // PATCH) * (36 // PATCH)
    llm = engine(native, limit_mm_per_prompt={"image": 0})
    text_only = llm.generate([TEXT], greedy(0), use_tqdm=False)[0]
    assert text_only.outputs[0].token_ids == outs[0][1].outputs[0].token_ids
    llm.llm_engine.shutdown()
