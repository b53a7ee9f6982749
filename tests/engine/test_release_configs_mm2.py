"""More vision-language releases' config.json (release_configs_mm2.py) made tiny by
`shrink_vlm` on a tiny checkpoint of their family (only sizes and token ids changed,
`assert_only_sizes_changed`), on random weights, served by `LLM` (float32) and compared with
transformers: greedy tokens and top-5 logprobs with one image and with two; dtype="auto" and
the default max_model_len as vLLM resolves them from the release file.

LLaVA-NeXT: Vicuna-7B and Yi-34B decoders, Granite-Vision's four concatenated SigLIP layers
(vision_feature_layer [-24, -20, -12, -1], the tower kept at its 27 layers so they exist)
beside a Granite decoder's multipliers (logits_scaling applied, as vLLM's Granite head does,
where transformers' LlavaNext head skips it); Idefics3-8B's 2x pixel shuffle; InternVL3.5's Qwen3
decoder; Mistral-Small-3.2 / Magistral-Small; Qwen2-VL-72B's untied flat layout; GLM-4.1V's
half-rotated M-RoPE; LLaVA-OneVision's anyres_max_9; Llama 4 Scout (its attention chunks,
NoPE layer temperature and layer count made tiny enough for a prompt to cross them; its 10M
default context refused on the CPU pool, as vLLM refuses it). Some also re-saved by
transformers 5."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hf_reference import assert_matches
from image_checks import engine, greedy, hf_refs, noise_image, processor_inputs
from release_configs_mm import assert_only_sizes_changed, shrink_vlm
from release_configs_mm2 import VLMS2, vlm2_release
from test_release_configs_mm import PROMPTS, _inputs, _save_release
from vlm_checkpoints import load_hf_vlm, processor_without_video

from paged_engine.testing import (
    write_tiny_idefics3,
    write_tiny_internvl,
    write_tiny_llava,
    write_tiny_mistral3,
    write_tiny_qwen2_vl,
)

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL.Image")
from test_glm4v_images import PROMPT as GLM_ONE  # noqa: E402
from test_glm4v_images import TWO as GLM_TWO  # noqa: E402
from test_glm4v_images import write_tiny_glm4v  # noqa: E402
from test_llama4_images import PROMPT as LLAMA4_ONE  # noqa: E402
from test_llama4_images import TWO as LLAMA4_TWO  # noqa: E402
from test_llama4_images import _hf_inputs as llama4_inputs  # noqa: E402
from test_llama4_images import write_tiny_llama4_vlm  # noqa: E402

PROMPTS2 = {
    **PROMPTS,
    "glm": (GLM_ONE, GLM_TWO),
    "onevision": PROMPTS["llava"],
    "llama4": (LLAMA4_ONE, LLAMA4_TWO),
}

_NEXT_336 = [[30, 60], [60, 30], [60, 60], [90, 30], [30, 90]]
# Granite-Vision's pinpoints' shape: 1 x n and n x 1 strips beside a few squares
_NEXT_GRANITE = [[30, 30], [30, 60], [30, 90], [60, 30], [60, 60], [90, 30]]
_NEXT_ONEVISION = [[30 * i, 30 * j] for i in range(1, 4) for j in range(1, 4)]
# name -> (family, tiny checkpoint writer: the tokenizer, processor and sizes)
TINY2: dict[str, tuple[str, Callable[[Path], Path]]] = {
    "llava-v1.6-vicuna-7b-hf": (
        "llava",
        lambda p: write_tiny_llava(p, seed=3, grid_pinpoints=_NEXT_336),
    ),
    "llava-v1.6-34b-hf": ("llava", lambda p: write_tiny_llava(p, seed=4, grid_pinpoints=_NEXT_336)),
    "granite-vision-3.2-2b": (
        "llava",
        lambda p: write_tiny_llava(p, vision="siglip", seed=3, grid_pinpoints=_NEXT_GRANITE),
    ),
    "mistral-small-3.2-24b-instruct-2506": ("mistral", lambda p: write_tiny_mistral3(p, seed=2)),
    "magistral-small-2509": ("mistral", lambda p: write_tiny_mistral3(p, seed=5)),
    "idefics3-8b-llama3": ("idefics", lambda p: write_tiny_idefics3(p, seed=3)),
    "internvl3_5-1b-hf": ("internvl", lambda p: write_tiny_internvl(p, seed=2)),
    "qwen2-vl-72b-instruct": ("qwen", lambda p: write_tiny_qwen2_vl(p, version="2", seed=2)),
    "glm-4.1v-9b-thinking": ("glm", lambda p: write_tiny_glm4v(p, "glm4v", seed=3)),
    "llama-4-scout-17b-16e-instruct": ("llama4", lambda p: write_tiny_llama4_vlm(p, seed=3)),
    "llava-onevision-qwen2-0.5b-ov-hf": (
        "onevision",
        lambda p: write_tiny_llava(
            p, vision="siglip", seed=3, grid_pinpoints=_NEXT_ONEVISION, onevision="anyres_max_9"
        ),
    ),
}
# Llama 4's spans made tiny so that a prompt crosses them: 16-token attention chunks, the
# temperature of NoPE layers' queries rising every 8 positions, 4 layers (the 4th NoPE)
_LLAMA4_SPANS = {"attention_chunk_size": 16, "floor_scale": 8, "num_hidden_layers": 4}
# size fields release_configs_mm's check does not know: the projector's widths (the tiny
# tower's), the MoE's expert count and dense width (`shrink`'s)
_SIZES2 = {
    "vision_config": ("projector_input_dim", "projector_output_dim"),
    "text_config": ("num_local_experts", "intermediate_size_mlp", *_LLAMA4_SPANS),
}
# the tower depth a release's vision_feature_layer list reaches into
_KEEP_DEPTH = {"granite-vision-3.2-2b"}


def write_release_vlm2(path: Path, name: str) -> Path:
    """The tiny checkpoint of `name`'s family at `path` with the shrunk release as its
    config.json verbatim, and transformers' model of that file with random weights."""
    TINY2[name][1](path)
    tiny = json.loads((path / "config.json").read_text())
    config = shrink_vlm(vlm2_release(name), tiny)
    if name in _KEEP_DEPTH:
        config["vision_config"]["num_hidden_layers"] = VLMS2[name]["vision_config"][
            "num_hidden_layers"
        ]
    if config["model_type"] == "llama4":
        config["text_config"] |= _LLAMA4_SPANS
    release = vlm2_release(name)
    for part, keys in _SIZES2.items():
        for key in (k for k in keys if k in release.get(part, {})):
            source = tiny if part == "vision_config" else config
            release[part][key] = config[part][key] = source[part][key]
    assert_only_sizes_changed(release, config)
    _save_release(path, config)
    processor = path / "processor_config.json"  # LLaVA's: counts the tower's rows it keeps
    if "vision_feature_select_strategy" in config and processor.exists():
        saved = json.loads(processor.read_text())
        saved["vision_feature_select_strategy"] = config["vision_feature_select_strategy"]
        processor.write_text(json.dumps(saved))
    return path


def _inputs2(path: Path, family: str) -> Callable:
    if family == "glm":
        processor = processor_without_video(transformers.Glm4vProcessor, path)
        keys = ("pixel_values", "image_grid_thw", "mm_token_type_ids")
        return lambda text, imgs: processor_inputs(processor, text, imgs, keys)
    if family == "onevision":
        return _onevision_inputs(path)
    if family == "llama4":
        return lambda text, imgs: llama4_inputs(path, text, imgs)
    return _inputs(path, family)


def _onevision_inputs(path: Path) -> Callable:
    """LlavaOnevisionProcessor's ids without it (it needs torchvision): one image its tiles'
    rows by the processor's own count, each of several one view's rows and a newline."""
    from types import SimpleNamespace

    from transformers.models.llava_onevision.processing_llava_onevision import (
        LlavaOnevisionProcessor as Rule,
    )

    config = json.loads((path / "config.json").read_text())
    images = transformers.AutoImageProcessor.from_pretrained(path)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    side = config["vision_config"]["image_size"]
    rows = (side // config["vision_config"]["patch_size"]) ** 2
    rule = SimpleNamespace(
        image_processor=images,
        num_image_tokens=rows,
        vision_aspect_ratio=config["vision_aspect_ratio"],
    )
    rule._get_unpadded_features = lambda *a: Rule._get_unpadded_features(rule, *a)

    def inputs(text: str, imgs: list) -> tuple[list[int], dict]:
        if len(imgs) == 1:
            n = Rule._get_number_of_features(rule, imgs[0].height, imgs[0].width, side, side)
        else:
            n = rows + 1
        out = images(images=[imgs], return_tensors="pt")
        keys = ("pixel_values", "image_sizes") + (("batch_num_images",) if len(imgs) > 1 else ())
        ids = tok.encode(text.replace("<image>", "<image>" * n))
        return ids, {k: out[k] for k in keys}

    return inputs


@pytest.mark.parametrize("name", list(VLMS2))
def test_vlm_release_config_serves_like_hf(name, tmp_path):
    """One image and two give HF's prompt ids, greedy tokens and top-5 logprobs; no
    max_model_len given: the release's context length."""
    check_vlm2(name, write_release_vlm2(tmp_path / name, name))


def check_vlm2(name: str, path: Path) -> None:
    """`name`'s tiny release at `path` served as transformers serves it."""
    family = TINY2[name][0]
    one, two = PROMPTS2[family]
    cases = [
        (one, [noise_image(1, (40, 52))]),
        (two, [noise_image(2, (64, 30)), noise_image(3, (30, 30))]),
    ]
    hf = load_hf_vlm(getattr(transformers, VLMS2[name]["architectures"][0]), path)
    scale = VLMS2[name].get("text_config", {}).get("logits_scaling")
    if scale:  # vLLM runs the text config's own head (Granite's); HF's wrapper skips the scale
        hf.lm_head.register_forward_hook(lambda _m, _a, logits: logits / scale)
    refs = hf_refs(hf, cases, _inputs2(path, family))
    prompts = [{"prompt": t, "multi_modal_data": {"image": imgs}} for t, imgs in cases]
    default = AUTO[name][1]
    if default > _KV_TOKENS:  # vLLM's default too: more than the CPU pool's KV, refused
        with pytest.raises(ValueError, match=f"fewer than max_model_len={default}"):
            engine(path, max_model_len=None)
    length = None if default <= _KV_TOKENS else 512  # None: vLLM's default, the release's
    llm = engine(path, max_model_len=length)
    try:
        assert llm.llm_engine.config.max_model_len == (length or default), name
        outs = llm.generate(prompts, greedy(), use_tqdm=False)
        for (ids, ref), out in zip(refs, outs, strict=True):
            assert out.prompt_token_ids == ids, name
            assert_matches(name, out, ref)
    finally:
        llm.llm_engine.shutdown()


_KV_TOKENS = 1 << 20  # about what the test's CPU KV pool holds
# dtype="auto" and the default max_model_len as vLLM resolves them from the release's file
AUTO = {
    "llava-v1.6-vicuna-7b-hf": (torch.float16, 4096),
    "llava-v1.6-34b-hf": (torch.bfloat16, 4096),
    "granite-vision-3.2-2b": (torch.bfloat16, 131072),
    "mistral-small-3.2-24b-instruct-2506": (torch.bfloat16, 131072),
    "magistral-small-2509": (torch.bfloat16, 131072),
    "idefics3-8b-llama3": (torch.bfloat16, 131072),
    "internvl3_5-1b-hf": (torch.bfloat16, 40960),
    "qwen2-vl-72b-instruct": (torch.bfloat16, 32768),
    "glm-4.1v-9b-thinking": (torch.bfloat16, 65536),
    "llava-onevision-qwen2-0.5b-ov-hf": (torch.float16, 32768),
    "llama-4-scout-17b-16e-instruct": (torch.bfloat16, 10485760),
}


@pytest.mark.parametrize("name", AUTO)
def test_auto_dtype(name, tmp_path):
    from paged_engine.loader import resolve_dtype

    (tmp_path / "config.json").write_text(json.dumps(VLMS2[name]))
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    assert resolve_dtype("auto", config) == AUTO[name][0]


# re-saved by transformers 5 (a fine-tune's checkpoint): ropes renamed rope_parameters, dtype
RESAVED2 = [
    "granite-vision-3.2-2b",
    "idefics3-8b-llama3",
    "glm-4.1v-9b-thinking",
    "llama-4-scout-17b-16e-instruct",
    "qwen2-vl-72b-instruct",
]


@pytest.mark.parametrize("name", RESAVED2)
def test_vlm_release_config_as_transformers5_saves_it(name, tmp_path):
    """The release re-saved by transformers 5: the same prompt ids, tokens and logprobs."""
    path = write_release_vlm2(tmp_path / name, name)
    transformers.AutoConfig.from_pretrained(path).save_pretrained(path)
    check_vlm2(name, path)
