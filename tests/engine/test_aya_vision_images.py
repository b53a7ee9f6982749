"""Images through Aya Vision and Command A Vision checkpoints (multimodal/aya_vision.py) against
HF transformers.

Tiny random wrappers over the tiny Cohere 2 decoder (a sliding layer of window 8, shorter
than a tile's run, and a NoPE full layer; logit_scale 0.5, which Aya Vision's wrapper applies
and Command A Vision's drops): 32-pixel tiles of 4-pixel SigLIP patches, pixel shuffle by 2
(16 rows a tile), up to 4 tiles and the whole image, a SwiGLU projector of width 48 (not the
text width). Aya Vision reads hidden_states[-2] of a 3-layer tower (no post_layernorm) through
a LayerNorm; Command A Vision the last layer after post_layernorm, with no LayerNorm.
`LLM.generate` with `multi_modal_data` must give HF's prompt ids (AyaVisionProcessor's on the
text; Command A Vision's rule written out) and HF `generate`'s greedy tokens and top-5 logprobs
(1e-3, float32). Then the engine's paths against the plain run, TP=2, the server's chat path,
and bad input.

Aya Vision saves GotOcr2's PIL image processor; Command A Vision its own
Cohere2VisionImageProcessor, which transformers runs on torchvision only: without it the
engine's torch copy (multimodal/torch_processors.py) feeds the engine and HF's model; where
torchvision imports, the copy's tiles and pixels must equal transformers' bit for bit over a
range of sizes and aspect ratios.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from image_checks import (
    WIDE_TALL_SMALL,
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
from vlm_checkpoints import load_hf_vlm

from paged_engine.multimodal.aya_vision import END, LINE_BREAK, PATCH, START
from paged_engine.testing import (
    _COMMON,
    TINY_VOCAB_SIZE,
    _save_random,
    build_tiny_tokenizer,
    tiny_config,
)

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.aya_vision")
pytest.importorskip("transformers.models.cohere2_vision")
Image = pytest.importorskip("PIL.Image")

TILE_ROWS = 16  # (32 / 4 / 2)^2
TURN = "<|START_OF_TURN_TOKEN|>"
USER, BOT, END_TURN = "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>", "<|END_OF_TURN_TOKEN|>"
MARK = {"aya": "<image>", "cohere2": PATCH}  # what each prompt writes for an image


def _prompt(arch: str, body: str) -> str:
    return f"<|bos|>{TURN}{USER}{body.format(img=MARK[arch])}{END_TURN}{TURN}{BOT}"


def _template(arch: str) -> str:
    return (
        "{{ bos_token }}{% for message in messages %}" + TURN + "{% if message['role'] == "
        f"'user' %}}{USER}{{% else %}}{BOT}{{% endif %}}"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        f"{{% if part['type'] == 'image' %}}{MARK[arch]}"
        "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
        "{% endfor %}{% endif %}" + END_TURN + "{% endfor %}"
        "{% if add_generation_prompt %}" + TURN + BOT + "{% endif %}"
    )


COHERE2_PROCESSOR = {  # Cohere2VisionImageProcessor's settings, scaled down
    "image_processor_type": "Cohere2VisionImageProcessor",
    "size": {"height": 32, "width": 32},
    "crop_to_patches": True,
    "min_patches": 1,
    "max_patches": 4,
    "resample": 3,
    "image_mean": [0.48, 0.45, 0.4],
    "image_std": [0.27, 0.26, 0.28],
}
PROMPT = "{img}What is in it?"
TWO = "{img} and {img}Which is brighter?"
TEXT = "Say something about the sea."


def write_tiny(path: Path, arch: str, seed: int) -> Path:
    """A tiny random AyaVisionForConditionalGeneration ("aya": its AyaVisionProcessor saved)
    or Cohere2VisionForConditionalGeneration ("cohere2": tokenizer and image processor), each
    with its image processor's settings (crop_to_patches: up to 4 tiles and the whole image;
    GotOcr2's PIL class for Aya Vision, Cohere2VisionImageProcessor for Command A Vision)."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(TINY_VOCAB_SIZE, seed)
    specials = [START, END, PATCH, LINE_BREAK, TURN, USER, BOT, END_TURN]
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    text = tiny_config("cohere2", vocab_size=len(tokenizer)).to_dict()
    vision = {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 64}
    vision |= {"num_hidden_layers": 3, "num_attention_heads": 4, "image_size": 32}
    vision |= {"patch_size": 4, "vision_use_head": False}
    fields = {"text_config": text, "vision_config": vision, "downsample_factor": 2, **_COMMON}
    fields |= {"alignment_intermediate_size": 48}
    image_id = tokenizer.convert_tokens_to_ids(PATCH)
    if arch == "aya":
        config = transformers.AyaVisionConfig(
            **fields, image_token_index=image_id, vision_feature_layer=-2
        )
        model_cls = transformers.AyaVisionForConditionalGeneration
    else:
        config = transformers.Cohere2VisionConfig(**fields, image_token_id=image_id)
        model_cls = transformers.Cohere2VisionForConditionalGeneration
    _save_random(model_cls, config, seed, path)
    tokenizer.chat_template = _template(arch)
    if arch == "aya":
        image_processor = transformers.GotOcr2ImageProcessorPil(
            size={"height": 32, "width": 32}, crop_to_patches=True, min_patches=1, max_patches=4
        )
        _aya_processor(image_processor, tokenizer).save_pretrained(path)
    else:
        (path / "preprocessor_config.json").write_text(json.dumps(COHERE2_PROCESSOR))
    tokenizer.save_pretrained(path)
    transformers.GenerationConfig(**_COMMON).save_pretrained(path)
    return path


def _aya_processor(image_processor, tokenizer):
    # 32-pixel tiles of 8-pixel (4 x pixel shuffle 2) units: 16 placeholders a tile
    return transformers.AyaVisionProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=8,
        img_size=32,
        chat_template=tokenizer.chat_template,
    )


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    cache: dict[str, Path] = {}

    def make(arch: str) -> Path:
        if arch not in cache:
            seed = 3 if arch == "aya" else 4
            cache[arch] = write_tiny(tmp_path_factory.mktemp(arch), arch, seed)
        return cache[arch]

    return make


def _hf_inputs(path: Path, arch: str, text: str, images: list) -> tuple[list[int], dict]:
    """HF's prompt ids and pixels: AyaVisionProcessor itself; for Command A Vision,
    Cohere2VisionProcessor's rule (each image token -> <|START_OF_IMG|>, a run and
    <|IMG_LINE_BREAK|> per tile, <|END_OF_IMG|>) on the image processor's tiles."""
    tok = transformers.AutoTokenizer.from_pretrained(path)
    if not images:
        return tok.encode(text, add_special_tokens=False), {}
    if arch == "aya":
        processor = transformers.AutoProcessor.from_pretrained(path)
        out = processor(text=[text], images=images, return_tensors="pt", add_special_tokens=False)
        return out["input_ids"][0].tolist(), {"pixel_values": out["pixel_values"]}
    out = _cohere2_image_processor(path)(images=images, return_tensors="pt", crop_to_patches=True)
    pieces = text.split(PATCH)
    for i, tiles in enumerate(out["num_patches"].tolist()):
        pieces[i] += START + (PATCH * TILE_ROWS + LINE_BREAK) * tiles + END
    ids = tok.encode("".join(pieces), add_special_tokens=False)
    return ids, {"pixel_values": out["pixel_values"]}


def _cohere2_image_processor(path: Path):
    """transformers' Cohere2VisionImageProcessor where torchvision imports, else ours."""
    from paged_engine.multimodal.torch_processors import image_processor

    return image_processor(path, transformers.AutoConfig.from_pretrained(path))


def _model(path: Path, arch: str):
    name = "AyaVision" if arch == "aya" else "Cohere2Vision"
    cls = getattr(transformers, f"{name}ForConditionalGeneration")
    model = load_hf_vlm(cls, path)
    return model


@pytest.mark.parametrize("arch", ["aya", "cohere2"])
def test_images_match_hf(dirs, arch):
    path = dirs(arch)
    model = _model(path, arch)
    # wide: tiles and the whole image, 2 x 1 by GotOcr2's rule, 3 x 1 by Cohere2Vision's;
    # the small one: one tile
    cases = hf_cases(
        _prompt(arch, PROMPT), _prompt(arch, TEXT), _prompt(arch, TWO), WIDE_TALL_SMALL
    )
    refs = hf_refs(model, cases, lambda *case: _hf_inputs(path, arch, *case))
    views = 3 if arch == "aya" else 4
    assert refs[0][0].count(model.config.image_token_id) == views * TILE_ROWS
    check_matches_hf(path, cases, refs, arch)


@pytest.mark.parametrize("arch", ["aya", "cohere2"])
def test_engine_paths_match_the_plain_run(dirs, arch):
    """The engine's paths through tiles against its plain run (image_checks); one image short,
    features instead of images, a wrong kind and too many images: ValueErrors naming
    multi_modal_data, the engine still serving."""
    path = dirs(arch)
    prompts = path_prompts(_prompt(arch, PROMPT), _prompt(arch, TWO))
    cached = check_engine_paths(path, prompts, _prompt(arch, TWO))
    pics = prompts[-1]["multi_modal_data"]["image"]
    short = "2 <image> placeholder" if arch == "aya" else "2 image placeholder"
    refused = [
        ({"prompt": _prompt(arch, TWO), "multi_modal_data": {"image": pics[:1]}}, short),
        ({**prompts[0], "multi_modal_data": {"image": torch.zeros(16, 64)}}, "embeddings"),
        ({**prompts[0], "multi_modal_data": {"image": "a.png"}}, "PIL.Image"),
    ]
    check_refused(path, cached, refused, prompts)


# (height, width): wide, tall, one tile, upscaled, one pixel thin, a tile exactly
SIZES = [(40, 90), (100, 30), (20, 24), (32, 32), (33, 31), (1, 200), (200, 1), (7, 5)]
SIZES += [(64, 64), (100, 300), (300, 100), (63, 129), (16, 90), (129, 63)]


def test_cohere2_torch_processor_matches_transformers(dirs, monkeypatch):
    """Where torchvision imports: for each size and aspect ratio above, with and without
    mm_processor_kwargs, the engine's processor with torchvision hidden (its torch copy) gives
    Cohere2VisionImageProcessor's tiles and pixels bit for bit, and the engine's prompt ids
    hold a run and a line break per tile."""
    from paged_engine.multimodal import aya_vision, torch_processors

    if not torch_processors.torchvision_available():
        pytest.skip("transformers' Cohere2VisionImageProcessor needs torchvision")
    from paged_engine.multimodal.processor import ImageProcessor, wrapper_config

    path = dirs("cohere2")
    hf = transformers.AutoImageProcessor.from_pretrained(path)
    assert type(hf).__name__ == "Cohere2VisionImageProcessor"
    tok = transformers.AutoTokenizer.from_pretrained(path)
    monkeypatch.setattr(torch_processors, "torchvision_available", lambda: False)
    ours = ImageProcessor(path, wrapper_config(path), tokenizer=tok)
    assert type(ours.hf) is aya_vision.Cohere2VisionTorchProcessor
    prompt = tok.encode(_prompt("cohere2", PROMPT), add_special_tokens=False)
    brk = tok.convert_tokens_to_ids(LINE_BREAK)
    for i, size in enumerate(SIZES):
        image = noise_image(20 + i, size)
        for kw in ({}, {"max_patches": 2}, {"max_patches": 12, "resample": 2}):
            want = hf(images=[image], return_tensors="pt", crop_to_patches=True, **kw)
            got = ours.hf(images=[image], crop_to_patches=True, **kw)
            assert got["num_patches"].tolist() == want["num_patches"].tolist()
            assert got["pixel_values"].dtype == want["pixel_values"].dtype == torch.float32
            assert torch.equal(got["pixel_values"], want["pixel_values"]), (size, kw)
            ids, placed = ours.process(prompt, [image], kw)
            assert ids.count(brk) == len(placed) == int(want["num_patches"][0])
            tiles = torch.stack([m.pixel_values for m in placed])
            assert torch.equal(tiles, want["pixel_values"])


def test_tensor_parallel_matches_one_process(dirs):
    """TP=2 (the tower replicated, the decoder sharded) gives the one-process tokens and
    logprobs, with chunks through the tiles."""
    path = dirs("aya")
    prompts = [
        {
            "prompt": _prompt("aya", TWO),
            "multi_modal_data": {"image": [noise_image(11, (30, 70)), noise_image(12, (30, 30))]},
        }
    ]
    check_tensor_parallel(path, prompts, 24)


@pytest.mark.parametrize("arch", ["aya", "cohere2"])
def test_server_chat_gives_the_offline_tokens(dirs, arch):
    """A chat request with a data: URL image part: the offline tokens and prompt ids of the
    chat template's prompt; two images over --limit-mm-per-prompt a 400 naming messages."""
    llm = engine(dirs(arch), num_gpu_blocks_override=64, limit_mm_per_prompt={"image": 1})
    question = [{"type": "image"}, {"type": "text", "text": "What is it?"}]
    check_chat_data_url(llm, question, noise_image(5, (40, 72)), over_limit=True)
