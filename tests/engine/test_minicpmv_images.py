"""Images through MiniCPM-V 4.6 and 4.7 checkpoints (multimodal/minicpmv.py) against HF.

A tiny random `MiniCPMV4_6ForConditionalGeneration` over the tiny Qwen3.5 hybrid decoder: a
SigLIP-style tower of 4-pixel patches, 3 layers with the window-attention merger after layer 1
(so layers run both before and after it), a 6 x 6 position table that the views' grids (8 x 8,
4 x 12, ...) are bucketed into; the image processor's slices (scale_resolution 32, up to 4
slices: 1 x 3 and 2 x 2 grids, so rows are joined by "\n") and non-square thumbnails; also
downsample_mode "4x" (no window merger). `LLM.generate` with `multi_modal_data` must give
MiniCPMV4_6Processor's prompt ids (its <image_id>k</image_id> per image) and HF `generate`'s
greedy tokens and top-5 logprobs (1e-3, float32). Then the engine's paths against the plain run,
the server's chat path, and bad input. MiniCPM-V 4.7 (the same tower, canvas M-RoPE over 4
rotary frequencies, interleaved t, h, w, t): its position table equals get_rope_index's (a "\n"
right after an image runs its frame on), HF's tokens, the engine's paths, TP=2.
transformers' processor needs torchvision for its video processor, so the reference prompt comes
from MiniCPMV4_6Processor's / 4_7's own code on the PIL image processor (`_hf_processor`).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from image_checks import (
    check_chat_data_url,
    check_engine_paths,
    check_matches_hf,
    check_refused,
    check_tensor_parallel,
    engine,
    hf_cases,
    hf_refs,
    noise_image,
    path_prompts,
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
pytest.importorskip("transformers.models.minicpmv4_6")
Image = pytest.importorskip("PIL.Image")

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
PROMPT = f"<|im_start|>user\n{PAD}\nWhat is in it?<|im_end|>\n<|im_start|>assistant\n"
TWO = f"<|im_start|>user\n{PAD} and {PAD}\nWhich is brighter?<|im_end|>\n<|im_start|>assistant\n"
TEXT = "<|im_start|>user\nSay something about the sea.<|im_end|>\n<|im_start|>assistant\n"
SIZES = ((40, 90), (90, 70), (20, 24))  # hf_cases' images


def _tokenizer(seed: int):
    tokenizer = build_tiny_tokenizer(TINY_VOCAB_SIZE, seed)
    tokenizer.add_special_tokens({"additional_special_tokens": list(NAMES.values())})
    tokenizer._set_model_specific_special_tokens(NAMES)  # tokenizer.image_token, ...
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def write_tiny(path: Path, seed: int, mode: str = "16x", version: str = "4_6") -> Path:
    """A tiny random MiniCPMV{version}ForConditionalGeneration (downsample_mode `mode`, in its
    config and its PIL image processor) with its tokenizer saved, and return its path. 4.7:
    its marker ids in the config, and M-RoPE sections (1, 1, 1 of 4 rotary frequencies,
    interleaved t, h, w, t) so that the canvas positions bite."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer(seed)
    text = tiny_config("qwen3_5", vocab_size=len(tokenizer)).to_dict()
    extra = {}
    if version == "4_7":
        text["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": 10_000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        }
        names = ("slice_start", "slice_end", "image_start", "image_end")
        extra = {f"{k}_id": tokenizer.convert_tokens_to_ids(NAMES[f"{k}_token"]) for k in names}
        (extra["newline_id"],) = tokenizer.encode("\n", add_special_tokens=False)
    vision = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3}
    vision |= {"num_attention_heads": 4, "image_size": 24, "patch_size": 4}
    config = getattr(transformers, f"MiniCPMV{version}Config")(
        text_config=text,
        vision_config=vision,
        insert_layer_id=1,
        downsample_mode=mode,
        image_token_id=tokenizer.convert_tokens_to_ids(PAD),
        video_token_id=tokenizer.convert_tokens_to_ids(NAMES["video_token"]),
        **extra,
        **_COMMON,
    )
    model_cls = getattr(transformers, f"MiniCPMV{version}ForConditionalGeneration")
    _save_random(model_cls, config, seed, path)
    _image_processor(mode).save_pretrained(path)
    return finish_checkpoint(path, tokenizer)


def _image_processor(mode: str):
    return transformers.MiniCPMV4_6ImageProcessorPil(
        scale_resolution=32, patch_size=4, max_slice_nums=4, downsample_mode=mode
    )


def _hf_processor(path: Path, version: str = "4_6"):
    """MiniCPMV{version}Processor over the saved tokenizer and PIL image processor, its
    attributes set as its __init__ sets them (that needs a torchvision video processor)."""
    cls = getattr(transformers, f"MiniCPMV{version}Processor")
    processor = object.__new__(cls)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    image_processor = transformers.AutoImageProcessor.from_pretrained(path)
    processor.image_processor, processor.tokenizer = image_processor, tokenizer
    mode = image_processor.downsample_mode
    processor.video_processor = SimpleNamespace(slice_mode=True, downsample_mode=mode)
    processor.chat_template = None
    processor.slice_mode = processor.video_slice_mode = image_processor.slice_mode
    processor.default_use_image_id = image_processor.use_image_id
    processor.image_token_divisor = processor.video_token_divisor = 4 if mode == "4x" else 16
    for name in NAMES:
        setattr(processor, name, getattr(tokenizer, name))
    processor.image_token_id = tokenizer.image_token_id
    processor.video_token_id = tokenizer.video_token_id
    return processor


def _hf_inputs(path: Path, text: str, images: list, version: str = "4_6"):
    processor = _hf_processor(path, version)
    if not images:
        return processor.tokenizer.encode(text, add_special_tokens=False), {}
    out = processor(
        text=[text],
        images=images,
        return_tensors="pt",
        add_special_tokens=False,
        return_mm_token_type_ids=True,
    )
    keys = ("pixel_values", "target_sizes") + (("mm_token_type_ids",) if version == "4_7" else ())
    return out["input_ids"][0].tolist(), {k: out[k] for k in keys}


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("minicpmv"), seed=3)


@pytest.fixture(scope="module")
def model(path):
    return load_hf_vlm(transformers.MiniCPMV4_6ForConditionalGeneration, path)


def test_tower_and_merger_match_hf(path, model):
    """The encoder's rows of each view equal HF's get_image_features (1e-5)."""
    from paged_engine.multimodal.archs import build_encoder
    from paged_engine.multimodal.processor import ImageProcessor

    config = transformers.AutoConfig.from_pretrained(path)
    encoder = build_encoder(config).float()
    encoder.load_weights((f"model.{n}", t) for n, t in model.model.state_dict().items())
    images = ImageProcessor(path, config, None, _hf_processor(path).tokenizer)
    _, views = images.process(images.layout.tokenizer.encode(PROMPT), [noise_image(1, (40, 90))])
    _, extra = _hf_inputs(path, PROMPT, [noise_image(1, (40, 90))])
    with torch.no_grad():
        want = model.model.get_image_features(**extra).pooler_output
        got = encoder.encode(views)
    grids = [tuple(s) for s in extra["target_sizes"].tolist()]
    assert [tuple(v.image_size) for v in views] == grids
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_images_match_hf(path, model):
    # wide: a 1 x 3 slice grid, a 4 x 12 thumbnail; 2 x 2 slices; unsliced
    cases = hf_cases(PROMPT, TEXT, TWO, SIZES)
    refs = hf_refs(model, cases, lambda *case: _hf_inputs(path, *case))
    tok = _hf_processor(path).tokenizer
    slices = [ids.count(tok.convert_tokens_to_ids("<slice>")) for ids, _ in refs]
    assert slices == [3, 0, 4]  # 1 x 3; none; 2 x 2 and none
    assert tok.decode(refs[2][0]).count("<image_id>1</image_id><image>") == 1
    check_matches_hf(path, cases, refs, "minicpmv")


def test_4x_mode_matches_hf(tmp_path):
    """downsample_mode "4x": no vit_merger, a row per 2 x 2 patches (grids in 2s)."""
    path = write_tiny(tmp_path / "4x", seed=4, mode="4x")
    hf = load_hf_vlm(transformers.MiniCPMV4_6ForConditionalGeneration, path)
    cases = [(TWO, [noise_image(4, (50, 30)), noise_image(5, (18, 22))])]
    _, extra = _hf_inputs(path, *cases[0])
    assert extra["target_sizes"].tolist()[0] == [10, 6]  # 4x: not a grid the 16x merges take
    check_matches_hf(path, cases, hf_refs(hf, cases, lambda *c: _hf_inputs(path, *c)), "4x")


def test_engine_paths_match_the_plain_run(path):
    """The engine's paths through the views against its plain run (image_checks); one image
    short, features, a wrong kind and too many images: ValueErrors, the engine serving."""
    prompts = path_prompts(PROMPT, TWO)
    cached = check_engine_paths(path, prompts, TWO)
    pics = prompts[-1]["multi_modal_data"]["image"]
    refused = [
        ({"prompt": TWO, "multi_modal_data": {"image": pics[:1]}}, "2 image placeholder"),
        ({"prompt": PROMPT, "multi_modal_data": {"image": torch.zeros(8, 64)}}, "embeddings"),
        ({"prompt": PROMPT, "multi_modal_data": {"image": "a.png"}}, "PIL.Image"),
    ]
    check_refused(path, cached, refused, prompts)


def test_server_chat_gives_the_offline_tokens(path):
    """A chat request with a data: URL image part: the offline tokens and prompt ids of the
    chat template's prompt; two images over --limit-mm-per-prompt a 400 naming messages."""
    llm = engine(path, num_gpu_blocks_override=64, limit_mm_per_prompt={"image": 1})
    question = [{"type": "image"}, {"type": "text", "text": "What is it?"}]
    check_chat_data_url(llm, question, noise_image(5, (40, 72)), over_limit=True)


@pytest.fixture(scope="module")
def path47(tmp_path_factory):
    if not hasattr(transformers, "MiniCPMV4_7ForConditionalGeneration"):
        pytest.skip("this transformers has no MiniCPM-V 4.7")
    return write_tiny(tmp_path_factory.mktemp("minicpmv4_7"), seed=5, version="4_7")


def test_canvas_positions_match_hf(path47):
    """MiniCPM-V 4.7: the engine's canvas M-RoPE table is get_rope_index's, for HF's ids (a
    2 x 2 and a 1 x 3 slice grid, an unsliced image; "\n" after an image: a frame's tail)."""
    from paged_engine.multimodal.processor import ImageProcessor

    hf = transformers.MiniCPMV4_7ForConditionalGeneration.from_pretrained(path47)
    config = transformers.AutoConfig.from_pretrained(path47)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path47)
    images = ImageProcessor(path47, config, None, tokenizer)
    three = f"{PAD}\n{TWO}"
    pics = [noise_image(2, (90, 70)), noise_image(1, (40, 90)), noise_image(3, (20, 24))]
    ids, extra = _hf_inputs(path47, three, pics, "4_7")
    want, delta = hf.model.get_rope_index(
        torch.tensor([ids]),
        mm_token_type_ids=extra["mm_token_type_ids"],
        target_sizes=extra["target_sizes"],
    )
    for prompt in (tokenizer.encode(three), ids):  # spliced here; HF's ids taken as they are
        out, views = images.process(prompt, pics)
        assert out == ids
        table = images.positions(len(ids), views)
        assert (table.table == want[:, 0].numpy()).all()
        assert (
            table.delta == int(delta)
            and (table.table[:, : table.first] == range(table.first)).all()
        )


def test_canvas_images_match_hf(path47):
    """MiniCPM-V 4.7's greedy tokens and top-5 logprobs against HF's, and the engine's paths
    (chunks through the views, prefix hits, images processed ahead) against its plain run."""
    hf = load_hf_vlm(transformers.MiniCPMV4_7ForConditionalGeneration, path47)
    cases = hf_cases(PROMPT, TEXT, TWO, SIZES)
    refs = hf_refs(hf, cases, lambda *case: _hf_inputs(path47, *case, "4_7"))
    check_matches_hf(path47, cases, refs, "minicpmv4_7")
    prompts = [
        {"prompt": PROMPT, "multi_modal_data": {"image": noise_image(i, (30 + 20 * i, 70))}}
        for i in range(2)
    ] + [{"prompt": TWO, "multi_modal_data": {"image": cases[2][1]}}]
    check_engine_paths(path47, prompts, TWO)


def test_tensor_parallel_matches_one_process(path47):
    """TP=2 gives the one-process tokens and logprobs, with chunks through the views (4.7: its
    M-RoPE tables travel to the other rank)."""
    prompts = [
        {
            "prompt": TWO,
            "multi_modal_data": {"image": [noise_image(11, (30, 70)), noise_image(12, (30, 30))]},
        }
    ]
    check_tensor_parallel(path47, prompts, 16)
