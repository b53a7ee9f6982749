"""Images through MiniCPM-OCR checkpoints (multimodal/minicpm_ocr.py over minicpmv.py) against HF.

A tiny random `MiniCPMOcrForConditionalGeneration` (its defaults: downsample_mode "4x", tied
embeddings) over the tiny Qwen3.5 hybrid decoder: a SigLIP-style tower of 4-pixel patches, 3
layers (the window merger after layer 1 in the "16x" case), a 6 x 6 position table the views'
grids are bucketed into; its image processor's slices (scale_resolution 32, up to 4 slices: 1 x
3 and 2 x 2 grids, so rows are joined by "\n"). transformers' MiniCPMOcrImageProcessor runs on
torchvision only, so without it the engine's torch copy (MiniCPMOcrTorchProcessor) gives the
pixels, checked bit for bit against the class's own `_preprocess` (compiled from transformers'
source onto a bare class whose resize / normalize are torch_processors.py's torchvision rule),
both small_image_upsize "always" and "never". HF's prompt comes from MiniCPMOcrProcessor's own
code over that copy. `LLM.generate` with `multi_modal_data` must give its prompt ids and HF
`generate`'s greedy tokens and top-5 logprobs (1e-3, float32), text alone too; bad requests
(small_image_upsize "adaptive", use_image_id as mm_processor_kwargs, an image short) are refused
by name and the engine serves on; the server's chat path gives the offline tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from image_checks import (
    check_chat_data_url,
    check_matches_hf,
    compiled_processor_steps,
    engine,
    greedy,
    hf_cases,
    hf_refs,
    noise_image,
    processor_inputs,
)
from vlm_checkpoints import finish_checkpoint, load_hf_vlm

from paged_engine.testing import (
    _COMMON,
    QWEN2_VL_CHAT_TEMPLATE,
    TINY_VOCAB_SIZE,
    _save_random,
    build_tiny_tokenizer,
    tiny_config,
)

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.minicpm_ocr")
pytest.importorskip("PIL.Image")

PAD = "<|image_pad|>"
NAMES = {
    "image_token": PAD,
    "video_token": "<|video_pad|>",
    "image_start_token": "<image>",
    "image_end_token": "</image>",
    "slice_start_token": "<slice>",
    "slice_end_token": "</slice>",
    "image_id_start_token": "<image_id>",
    "image_id_end_token": "</image_id>",
}
CHAT_TEMPLATE = QWEN2_VL_CHAT_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", PAD)
PROMPT = f"<|im_start|>user\n{PAD}\nRead it.<|im_end|>\n<|im_start|>assistant\n"
TWO = f"<|im_start|>user\n{PAD} and {PAD}\nWhich is longer?<|im_end|>\n<|im_start|>assistant\n"
TEXT = "<|im_start|>user\nSay something about the sea.<|im_end|>\n<|im_start|>assistant\n"
SIZES = ((40, 90), (90, 70), (20, 24))  # 1 x 3 slices; 2 x 2; unsliced (upscaled)
PROCESSOR = {
    "image_processor_type": "MiniCPMOcrImageProcessor",
    "scale_resolution": 32,
    "patch_size": 4,
    "max_slice_nums": 4,
}


def write_tiny(path: Path, seed: int, mode: str = "4x") -> Path:
    """A tiny random MiniCPMOcrForConditionalGeneration (downsample_mode `mode`) with its
    tokenizer and image processor settings saved; returns `path`."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(TINY_VOCAB_SIZE, seed)
    tokenizer.add_special_tokens({"additional_special_tokens": list(NAMES.values())})
    tokenizer._set_model_specific_special_tokens(NAMES)  # tokenizer.image_token, ...
    vision = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3}
    vision |= {"num_attention_heads": 4, "image_size": 24, "patch_size": 4}
    config = transformers.MiniCPMOcrConfig(
        text_config=tiny_config("qwen3_5", vocab_size=len(tokenizer)).to_dict(),
        vision_config=vision,
        insert_layer_id=1,
        downsample_mode=mode,
        image_token_id=tokenizer.convert_tokens_to_ids(PAD),
        video_token_id=tokenizer.convert_tokens_to_ids(NAMES["video_token"]),
        **_COMMON,
    )
    _save_random(transformers.MiniCPMOcrForConditionalGeneration, config, seed, path)
    settings = {**PROCESSOR, "downsample_mode": mode}
    (path / "preprocessor_config.json").write_text(json.dumps(settings))
    return finish_checkpoint(path, tokenizer, CHAT_TEMPLATE)


def _copy(path: Path):
    from paged_engine.multimodal.minicpm_ocr import MiniCPMOcrTorchProcessor
    from paged_engine.multimodal.torch_processors import saved_settings

    config = transformers.AutoConfig.from_pretrained(path)
    return MiniCPMOcrTorchProcessor(saved_settings(path), config)


def _hf_image_processor():
    """MiniCPMOcrImageProcessor's resize / slice / pack methods compiled from transformers'
    source (the module imports torchvision) onto a bare class, its resize and normalize
    torch_processors.py's (torchvision's rule on the CPU); no OpenCV path is reached."""
    from transformers.image_transforms import divide_to_patches
    from transformers.image_utils import PILImageResampling

    from paged_engine.multimodal import torch_processors as tp

    methods = {"find_best_resize", "get_refine_size", "get_sliced_grid", "reshape_by_patch"}
    steps = compiled_processor_steps(
        "minicpm_ocr",
        "image_processing_minicpm_ocr.py",
        "MiniCPMOcrImageProcessor",
        methods | {"_preprocess"},
        {"ensure_divide"},
        PILImageResampling=PILImageResampling,
        divide_to_patches=divide_to_patches,
    )
    steps.resize = lambda image, size, resample: tp.resize(image, (size.height, size.width), 3)
    return steps


def _hf_pixels(steps, images, s: dict) -> dict:
    from paged_engine.multimodal.torch_processors import to_uint8

    out = steps._preprocess(
        [to_uint8(i) for i in images],
        do_resize=True,
        resample=3,
        do_rescale=True,
        rescale_factor=1 / 255,
        do_normalize=True,
        image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
        max_slice_nums=s["max_slice_nums"],
        scale_resolution=s["scale_resolution"],
        patch_size=s["patch_size"],
        slice_mode=s.get("slice_mode", True),
        small_image_upsize=s.get("small_image_upsize", "always"),
        return_tensors="pt",
        disable_grouping=None,
        downsample_mode=s["downsample_mode"],
    )
    return dict(out)


def _hf_processor(path: Path):
    """MiniCPMOcrProcessor over the saved tokenizer and our torch copy of its image
    processor, its attributes set as its __init__ sets them (that needs torchvision)."""
    processor = object.__new__(transformers.MiniCPMOcrProcessor)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    image_processor = _copy(path)
    image_processor.slice_mode = True
    image_processor.use_image_id = True
    image_processor.downsample_mode = image_processor.settings["downsample_mode"]
    image_processor.model_input_names = ["pixel_values", "target_sizes"]
    image_processor.fetch_images = lambda images: images  # PIL images already
    processor.image_processor, processor.tokenizer = image_processor, tokenizer
    processor.video_processor = SimpleNamespace(slice_mode=True, downsample_mode="4x")
    processor.chat_template = None
    processor.slice_mode = processor.video_slice_mode = True
    processor.default_use_image_id = True
    processor.image_token_divisor = processor.video_token_divisor = 4
    for name in NAMES:
        setattr(processor, name, getattr(tokenizer, name))
    processor.image_token_id = tokenizer.image_token_id
    processor.video_token_id = tokenizer.video_token_id
    return processor


def _hf_inputs(path: Path, text: str, images: list):
    return processor_inputs(_hf_processor(path), text, images, ("pixel_values", "target_sizes"))


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("minicpm-ocr"), seed=3)


@pytest.mark.parametrize(
    "extra",
    [{}, {"small_image_upsize": "never"}, {"slice_mode": False}, {"downsample_mode": "16x"}],
)
def test_torch_copy_is_the_processors_steps(extra):
    """The copy's pixels, patch grids and slice grids equal MiniCPMOcrImageProcessor's
    `_preprocess` (bit for bit) on a wide, a tall and a small image, a square one whose 1 x 2
    and 2 x 1 grids tie (the rows win) and one whose slice size depends on rounding the image
    to the grid first."""
    from paged_engine.multimodal.minicpm_ocr import MiniCPMOcrTorchProcessor

    s = {**PROCESSOR, "downsample_mode": "4x", **extra}
    ours = MiniCPMOcrTorchProcessor(s)
    sizes = ((40, 90), (90, 70), (20, 26), (40, 40), (20, 79))
    images = [noise_image(i, size) for i, size in enumerate(sizes)]
    got, want = ours(images), _hf_pixels(_hf_image_processor(), images, s)
    for key in ("grids", "num_patches_per_image"):
        assert got[key] == want[key]
    assert torch.equal(got["target_sizes"], want["target_sizes"])
    assert torch.equal(got["pixel_values"], want["pixel_values"])


def test_images_match_hf(path):
    """Prompt ids (<image_id>k</image_id>, thumbnail and slice runs), greedy tokens and top-5
    logprobs of HF's MiniCPMOcrForConditionalGeneration, text alone too."""
    model = load_hf_vlm(transformers.MiniCPMOcrForConditionalGeneration, path)
    assert model.config.tie_word_embeddings
    cases = hf_cases(PROMPT, TEXT, TWO, SIZES)
    refs = hf_refs(model, cases, lambda *case: _hf_inputs(path, *case))
    tok = transformers.AutoTokenizer.from_pretrained(path)
    slices = [ids.count(tok.convert_tokens_to_ids("<slice>")) for ids, _ in refs]
    assert slices == [3, 0, 4]  # 1 x 3; none; 2 x 2 and none
    assert tok.decode(refs[2][0]).count("<image_id>1</image_id><image>") == 1
    check_matches_hf(path, cases, refs, "minicpm_ocr")


def test_16x_mode_matches_hf(tmp_path):
    """downsample_mode "16x": the window merger after layer 1, grids in 4s."""
    path = write_tiny(tmp_path / "16x", seed=4, mode="16x")
    hf = load_hf_vlm(transformers.MiniCPMOcrForConditionalGeneration, path)
    cases = [(PROMPT, [noise_image(4, (50, 30))])]
    check_matches_hf(path, cases, hf_refs(hf, cases, lambda *c: _hf_inputs(path, *c)), "16x")


def test_bad_requests_refused_by_name(path):
    llm = engine(path, max_model_len=256)
    image = noise_image(5, (30, 40))
    one = {"prompt": PROMPT, "multi_modal_data": {"image": image}}
    cases = [
        ({**one, "mm_processor_kwargs": {"small_image_upsize": "adaptive"}}, "small_image_upsize"),
        ({**one, "mm_processor_kwargs": {"use_image_id": False}}, "use_image_id"),
        ({**one, "mm_processor_kwargs": {"downsample_mode": "16x"}}, "downsample_mode"),
        ({"prompt": TWO, "multi_modal_data": {"image": [image]}}, "2 image placeholder"),
    ]
    for bad, match in cases:
        with pytest.raises(ValueError, match=match):
            llm.generate([bad], greedy(0), use_tqdm=False)
    out = llm.generate([one], greedy(0), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 8


def test_adaptive_checkpoint_refused_by_name():
    from paged_engine.multimodal.minicpm_ocr import MiniCPMOcrTorchProcessor

    with pytest.raises(ValueError, match="small_image_upsize='adaptive'"):
        MiniCPMOcrTorchProcessor({**PROCESSOR, "small_image_upsize": "adaptive"})


def test_server_chat_gives_the_offline_tokens(path):
    """A chat request with a data: URL image part: the offline tokens and prompt ids of the
    chat template's prompt; two images over --limit-mm-per-prompt a 400 naming messages."""
    llm = engine(path, num_gpu_blocks_override=64, limit_mm_per_prompt={"image": 1})
    question = [{"type": "image"}, {"type": "text", "text": "Read it."}]
    check_chat_data_url(llm, question, noise_image(5, (40, 72)), over_limit=True)
