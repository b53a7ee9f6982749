"""Nemotron-H Omni (`NemotronH_Omni_Reasoning_V3`) against HF: text and images
(multimodal/nemotron_h_omni.py, nemotron_h_omni_processor.py), its decoder through
models/text_wrappers.py's row.

A tiny random wrapper as transformers saves it (the Hub's names): the tiny Nemotron-H hybrid
decoder (Mamba2, relu^2 MLP and attention blocks) under `language_model.` with its stack as
`backbone.`; a one-layer C-RADIO tower of 4-pixel patches whose 8 x 8 position table each
image's grid resizes (up for a 6 x 10 grid, down for 4 x 4), one cls and one register token;
pixel shuffle and the relu^2 projector `mlp1`; with num_nextn_predict_layers 1 the vision final
LayerNorm too; (second checkpoint) a Parakeet audio encoder and its projector. transformers'
image processor runs on torchvision only, so the engine's torch copy gives the pixels, its grid
and patching checked bit for bit against the class's own `_preprocess` (compiled from
transformers' source onto a bare class, its resize the float32 bicubic one), and HF's prompt
comes from NemotronH_Omni_Reasoning_V3Processor's own code over that copy. `LLM.generate` must
give its prompt ids (<img>, the run, </img>) and HF `generate`'s greedy tokens and top-5
logprobs (1e-3, float32), text alone too. Videos are not run (paged has no video tubelets):
refused by name, the engine serving on; audio on a checkpoint without an audio_config too (its
audio: test_nemotron_h_omni_audio.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_parity import assert_serves_like_hf, load_hf_as_saved, write_hf_checkpoint
from image_checks import (
    check_matches_hf,
    compiled_processor_steps,
    engine,
    greedy,
    hf_cases,
    hf_refs,
    noise_image,
    processor_inputs,
)
from vlm_checkpoints import finish_checkpoint, load_hf_vlm, tokenizer_with

from paged_engine import SamplingParams
from paged_engine.loader import load_hf_config, resolve_model
from paged_engine.testing import _COMMON, _save_random, tiny_config

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "NemotronH_Omni_Reasoning_V3"):
    pytest.skip("this transformers has no Nemotron-H Omni", allow_module_level=True)
pytest.importorskip("PIL.Image")

IMAGE, VIDEO, AUDIO = 500, 501, 502
PROMPTS = [[5, 17, 33, 8, 91, 12, 40, 7], [3, 9, 27, 81, 43, 129, 387, 11, 6, 2, 64, 19, 70]]
SPECIAL = ["<image>", "<img>", "</img>", "<video>", "<so_embedding>"]
PROMPT = "User: <image>\nWhat is in it? Assistant:"
TWO = "User: <image> and <image>\nWhich is brighter? Assistant:"
TEXT = "User: Say something about the sea. Assistant:"
SIZES = ((40, 56), (16, 16), (60, 30))  # grids 6 x 10 (table up), 4 x 4 (down), 12 x 4
PROCESSOR = {
    "image_processor_type": "NemotronH_Omni_Reasoning_V3ImageProcessor",
    "patch_size": 4,
    "min_num_patches": 16,
    "max_num_patches": 64,
    "max_model_len": 512,
}
_VISION = {
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "mlp_ratio": 2.0,
    "patch_size": 4,
    "image_size": 16,
    "max_img_size": 32,
    "num_cls_tokens": 1,
    "num_registers": 1,
    "video_temporal_patch_size": 2,
}
_AUDIO = {
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "intermediate_size": 48,
    "num_mel_bins": 16,
    "subsampling_conv_channels": 8,
    "projection_hidden_size": 40,
    "projection_bias": False,
}


def _config(text: dict, audio: bool = False, **ids):
    return transformers.NemotronH_Omni_Reasoning_V3_Config(
        text_config=text,
        vision_config=_VISION,
        audio_config=_AUDIO if audio else None,
        vision_hidden_size=32,
        projector_hidden_size=48,
        **({"image_token_id": IMAGE, "video_token_id": VIDEO, "audio_token_id": AUDIO} | ids),
    )


def write_tiny(path, seed: int, audio: bool = False):
    """Text-only checks' checkpoint: the tiny tokenizer of hf_parity, placeholder ids unused."""
    text = tiny_config("nemotron_h").to_dict()
    model = transformers.NemotronH_Omni_Reasoning_V3
    return write_hf_checkpoint(path, model, _config(text, audio), seed)


def write_tiny_images(path: Path, seed: int, mtp: bool = False) -> Path:
    """A checkpoint whose tokenizer has <image>, <img>, </img> and whose image processor
    settings are saved; `mtp`: num_nextn_predict_layers 1 (the vision final LayerNorm)."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer, ids = tokenizer_with(SPECIAL, seed)
    tokenizer._set_model_specific_special_tokens(
        {"image_token": "<image>", "image_start_token": "<img>", "image_end_token": "</img>"}
    )
    text = tiny_config("nemotron_h", vocab_size=len(tokenizer)).to_dict()
    if mtp:
        text["num_nextn_predict_layers"] = 1
    config = _config(
        text,
        image_token_id=ids["<image>"],
        video_token_id=ids["<video>"],
        audio_token_id=ids["<so_embedding>"],
        **_COMMON,
    )
    _save_random(transformers.NemotronH_Omni_Reasoning_V3, config, seed, path)
    (path / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    return finish_checkpoint(path, tokenizer)


def _copy(path: Path):
    from paged_engine.multimodal.nemotron_h_omni_processor import NemotronOmniTorchProcessor
    from paged_engine.multimodal.torch_processors import saved_settings

    config = transformers.AutoConfig.from_pretrained(path)
    return NemotronOmniTorchProcessor(saved_settings(path), config)


def _hf_steps():
    """The image processor's `_preprocess` and its module functions compiled from
    transformers' source (the module imports torchvision) onto a bare class; its resize is
    the float32 bicubic one with antialias (torchvision's on float images), its normalize
    torch_processors.py's."""
    functions = {"get_patch_grid_size", "get_num_patches_budget", "convert_image_to_patches"}
    steps = compiled_processor_steps(
        "nemotron_h_omni",
        "image_processing_nemotron_h_omni.py",
        "NemotronH_Omni_Reasoning_V3ImageProcessor",
        {"_preprocess"},
        functions,
    )

    def resize(x, size, resample):
        size = (size.height, size.width)
        kw = {"mode": "bicubic", "align_corners": False, "antialias": True}
        return torch.nn.functional.interpolate(x, size, **kw)

    steps.resize = resize
    return steps


def _hf_processor(path: Path):
    """NemotronH_Omni_Reasoning_V3Processor over the saved tokenizer and our torch copy, its
    attributes set as its __init__ sets them (that needs torchvision)."""
    processor = object.__new__(transformers.NemotronH_Omni_Reasoning_V3Processor)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    image_processor = _copy(path)
    image_processor.downsample_ratio = 0.5
    image_processor.model_input_names = ["pixel_values", "image_grid_hw"]
    image_processor.fetch_images = lambda images: images  # PIL images already
    processor.image_processor, processor.tokenizer = image_processor, tokenizer
    processor.chat_template = None
    processor.image_token, processor.image_start_token, processor.image_end_token = SPECIAL[:3]
    processor.image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    return processor


def _hf_inputs(path: Path, text: str, images: list):
    return processor_inputs(_hf_processor(path), text, images, ("pixel_values", "image_grid_hw"))


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("nemotron-h-omni"), seed=2)


@pytest.fixture(scope="module")
def image_path(tmp_path_factory):
    return write_tiny_images(tmp_path_factory.mktemp("nemotron-h-omni-images"), seed=5)


def test_config_is_the_text_model():
    config = _config(tiny_config("nemotron_h").to_dict())
    config.architectures = ["NemotronH_Omni_Reasoning_V3"]
    from paged_engine.models.multimodal_text import text_only_config

    text = text_only_config(config)
    assert text.architectures == ["NemotronHForCausalLM"]
    assert text.tie_word_embeddings is False


def test_text_generation_matches_hf(path):
    """Greedy tokens and top-5 logprobs of HF's wrapper on text; the towers' weights never
    reach the decoder."""
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert any(n.startswith("language_model.backbone.") for n in names)
    assert any(n.startswith("vision_model.radio_model.") for n in names)
    assert load_hf_config(resolve_model(path)).architectures == ["NemotronHForCausalLM"]
    llm = assert_serves_like_hf("nemotron_h_omni", path, PROMPTS, 6)
    model = llm.llm_engine.model_runner.model
    assert not any(n.startswith(("vision", "mlp1")) for n, _ in model.named_parameters())


def test_audio_checkpoint_matches_hf(tmp_path):
    """With a Parakeet audio encoder and its projector saved beside the towers: dropped too."""
    from safetensors import safe_open

    path = write_tiny(tmp_path / "audio", seed=3, audio=True)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    prefixes = {n.split(".")[0] for n in names}
    assert {"sound_encoder", "sound_projection", "mlp1"} <= prefixes  # the Hub's names
    hf = load_hf_as_saved(path)
    assert hf.audio_tower is not None
    assert_serves_like_hf("nemotron_h_omni audio", path, PROMPTS[:1], 4, hf=hf)


@pytest.mark.parametrize("extra", [{}, {"min_num_patches": 4, "max_num_patches": 0}])
def test_torch_copy_is_the_processors_steps(extra):
    """The copy's patches and grids equal the class's `_preprocess` (bit for bit): grids
    scaled down into the budget, up to min_num_patches, rounded to the merge; an image
    already at its grid's size is not resized."""
    from paged_engine.multimodal.nemotron_h_omni_processor import NemotronOmniTorchProcessor

    s = {**PROCESSOR, **extra}
    sizes = (*SIZES, (7, 90), (32, 24))
    images = [noise_image(i, size) for i, size in enumerate(sizes)]
    from paged_engine.multimodal.torch_processors import to_uint8

    got = NemotronOmniTorchProcessor(s)(images)
    defaults = NemotronOmniTorchProcessor(s).settings
    want = _hf_steps()._preprocess(
        [to_uint8(i) for i in images],
        resample=3,
        do_rescale=True,
        rescale_factor=1 / 255,
        do_normalize=True,
        image_mean=defaults["image_mean"],
        image_std=defaults["image_std"],
        patch_size=4,
        downsample_ratio=0.5,
        min_num_patches=defaults["min_num_patches"],
        max_num_patches=defaults["max_num_patches"],
        max_model_len=defaults["max_model_len"],
        disable_grouping=None,
        return_tensors="pt",
    )
    assert torch.equal(got["image_grid_hw"], want["image_grid_hw"])
    assert torch.equal(got["pixel_values"], want["pixel_values"])


def test_images_match_hf(image_path):
    """Prompt ids (<img>, the run, </img>), greedy tokens and top-5 logprobs of HF's model."""
    model = load_hf_vlm(transformers.NemotronH_Omni_Reasoning_V3, image_path)
    cases = hf_cases(PROMPT, TEXT, TWO, SIZES)
    refs = hf_refs(model, cases, lambda *case: _hf_inputs(image_path, *case))
    image = model.config.image_token_id
    assert [ids.count(image) for ids, _ in refs] == [15, 0, 4 + 12]
    check_matches_hf(image_path, cases, refs, "nemotron_h_omni")


def test_vision_final_norm_matches_hf(tmp_path):
    """num_nextn_predict_layers 1: the tower's features LayerNormed before the shuffle (the
    Hub's `vision_projector.vision_final_layernorm`), the decoder's MTP layers skipped."""
    path = write_tiny_images(tmp_path / "mtp", seed=6, mtp=True)
    hf = load_hf_vlm(transformers.NemotronH_Omni_Reasoning_V3, path)
    assert hf.vision_final_layernorm is not None
    cases = [(PROMPT, [noise_image(4, (40, 56))])]
    check_matches_hf(path, cases, hf_refs(hf, cases, lambda *c: _hf_inputs(path, *c)), "mtp")


def test_media_refused_by_name(image_path):
    """Video and audio, image features, hostile kwargs and an image short: ValueErrors naming
    what is wrong; the engine serves on."""
    llm = engine(image_path, max_model_len=256)
    image = noise_image(5, (30, 40))
    one = {"prompt": PROMPT, "multi_modal_data": {"image": image}}
    cases = [
        ({"prompt": PROMPT, "multi_modal_data": {"video": [image, image]}}, "video"),
        ({"prompt": PROMPT, "multi_modal_data": {"audio": (torch.zeros(800), 16000)}}, "audio"),
        ({**one, "mm_processor_kwargs": {"downsample_ratio": 0.25}}, "downsample_ratio"),
        ({**one, "mm_processor_kwargs": {"patch_size": 8}}, "patch_size"),
        ({"prompt": TWO, "multi_modal_data": {"image": [image]}}, "2 image placeholder"),
        ({"prompt": PROMPT, "multi_modal_data": {"image": torch.zeros(15, 64)}}, "embed"),
    ]
    for bad, match in cases:
        with pytest.raises(ValueError, match=match):
            llm.generate([bad], greedy(0), use_tqdm=False)
    out = llm.generate([one], greedy(0), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 8
    text = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert text


def test_config_refusals_name_the_field():
    from paged_engine.multimodal.nemotron_h_omni import check_config

    for field, value, match in (
        ("downsample_ratio", 0.25, "downsample_ratio"),
        ("vision_hidden_size", 64, "vision_hidden_size"),
    ):
        config = _config(tiny_config("nemotron_h").to_dict())
        setattr(config, field, value)
        with pytest.raises(ValueError, match=match):
            check_config(config)
    config = _config(tiny_config("nemotron_h").to_dict())
    config.vision_config.use_swiglu_ffn = True
    with pytest.raises(ValueError, match="use_swiglu_ffn"):
        check_config(config)


def test_budget_by_image_count_refused(image_path, tmp_path):
    """Where min_num_patches x images passes the processor's max_model_len budget, HF's one
    call would give each image fewer patches than one at a time: refused by name."""
    import shutil

    path = Path(shutil.copytree(image_path, tmp_path / "short"))
    (path / "preprocessor_config.json").write_text(json.dumps({**PROCESSOR, "max_model_len": 8}))
    llm = engine(path, max_model_len=256)
    pics = [noise_image(1, (16, 16)), noise_image(2, (20, 20))]
    with pytest.raises(ValueError, match="patch budget"):
        llm.generate([{"prompt": TWO, "multi_modal_data": {"image": pics}}], greedy(0))
    one = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": pics[0]}}], greedy(0))
    assert len(one[0].outputs[0].token_ids) == 8
