"""Images through Llama 4 checkpoints (multimodal/llama4.py) against HF transformers.

A tiny random `Llama4ForConditionalGeneration`: 32-pixel tiles of 8-pixel patches (a 4 x 4 grid
with its CLS token last, 2-D rope of theta 100), pixel shuffle by 2 (4 rows a tile), at most 4
tiles plus the whole image; its text model is the tiny Llama 4 (chunked attention of 12 keys,
shorter than the prompts; a NoPE layer with query temperature from position 3; MoE and dense
layers). `LLM.generate` with `multi_modal_data` must give Llama4Processor's prompt ids
(<|image_start|>, tile runs with their separators, <|image|>, the whole image's run,
<|image_end|>) and HF `generate`'s greedy tokens and top-5 logprobs (1e-3, float32) for tiled,
untiled and several images. Then the engine's paths (chunks through tiles, prefix-cache hits,
images processed ahead, TP=2) against its plain run, the server's chat path, and bad input.

transformers runs Llama 4's image processor on torchvision only: without it these tests skip.
"""

from __future__ import annotations

import json
from pathlib import Path

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
from safetensors.torch import load_file
from vlm_checkpoints import finish_checkpoint, load_hf_vlm

from paged_engine.testing import _COMMON, _save_random, build_tiny_tokenizer, tiny_config

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.llama4")
Image = pytest.importorskip("PIL.Image")

SIDE, PATCH = 32, 8
USER = "<|header_start|>user<|header_end|>\n\n"
ASSISTANT = "<|header_start|>assistant<|header_end|>\n\n"
PROMPT = f"{USER}<|image|>What is in it?<|eot|>{ASSISTANT}"
TWO = f"{USER}<|image|>and<|image|>Which is brighter?<|eot|>{ASSISTANT}"
TEXT = f"{USER}Say something about the sea.<|eot|>{ASSISTANT}"
IMAGE_TOKENS = [
    "<|image_start|>",
    "<|image_end|>",
    "<|image|>",
    "<|patch|>",
    "<|tile_x_separator|>",
    "<|tile_y_separator|>",
]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|header_start|>{{ message['role'] }}"
    "<|header_end|>\n\n{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|image|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|eot|>{% endfor %}"
    "{% if add_generation_prompt %}<|header_start|>assistant<|header_end|>\n\n{% endif %}"
)
PROCESSOR = {  # Llama4ImageProcessor's settings, scaled down (normalization by non-default means)
    "image_processor_type": "Llama4ImageProcessor",
    "size": {"height": SIDE, "width": SIDE},
    "max_patches": 4,
    "resize_to_max_canvas": False,
    "resample": 2,
    "do_resize": True,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.48, 0.45, 0.4],
    "image_std": [0.27, 0.26, 0.28],
    "do_convert_rgb": True,
}


def hf_processor_available() -> bool:
    from paged_engine.multimodal.torch_processors import torchvision_available

    return torchvision_available()


def write_tiny_llama4_vlm(path: Path, seed: int = 0) -> Path:
    """The tiny checkpoint of the module docstring, with its processor and chat template."""
    tokenizer = build_tiny_tokenizer(seed=seed)
    specials = [*IMAGE_TOKENS, "<|header_start|>", "<|header_end|>", "<|eot|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in IMAGE_TOKENS}
    vision = {"hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2}
    vision |= {"intermediate_size": 128, "image_size": SIDE, "patch_size": PATCH}
    vision |= {"pixel_shuffle_ratio": 0.5, "projector_input_dim": 48}
    vision |= {"projector_output_dim": 48, "vision_output_dim": 48}
    vision |= {"rope_parameters": {"rope_type": "default", "rope_theta": 100.0}}
    config = transformers.Llama4Config(
        text_config=tiny_config("llama4", vocab_size=len(tokenizer)).to_dict(),
        vision_config=vision,
        boi_token_index=ids["<|image_start|>"],
        eoi_token_index=ids["<|image_end|>"],
        image_token_index=ids["<|patch|>"],
        **_COMMON,
    )
    _save_random(transformers.Llama4ForConditionalGeneration, config, seed, path)
    (path / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    return finish_checkpoint(path, tokenizer, CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> Path:
    return write_tiny_llama4_vlm(tmp_path_factory.mktemp("llama4_vlm"), seed=3)


@pytest.fixture(scope="module")
def hf_model(path):
    return load_hf_vlm(transformers.Llama4ForConditionalGeneration, path)


def _hf_processor(path):
    """Llama4Processor over transformers' image processor (torchvision only)."""
    return transformers.Llama4Processor(
        image_processor=transformers.AutoImageProcessor.from_pretrained(path),
        tokenizer=transformers.AutoTokenizer.from_pretrained(path),
        patch_size=PATCH,
        pixel_shuffle_ratio=0.5,
        chat_template=CHAT_TEMPLATE,
    )


def _ours(path):
    from paged_engine.multimodal.torch_processors import torch_processor

    return torch_processor(path, transformers.AutoConfig.from_pretrained(path))


def _prompt_split_image(rows: int, cols: int, n: int) -> str:
    """Llama4Processor's text for an image of rows x cols tiles of n <|patch|> each."""
    text = "<|image_start|>"
    if rows * cols > 1:
        for _ in range(rows):
            text += "<|tile_x_separator|>".join(["<|patch|>" * n] * cols) + "<|tile_y_separator|>"
    return text + "<|image|>" + "<|patch|>" * n + "<|image_end|>"


def _hf_inputs(path, text: str, images: list) -> tuple[list[int], dict]:
    """HF's prompt ids and pixels: Llama4Processor where torchvision imports; else the
    engine's torch processor's pixels and Llama4Processor's rule on the text."""
    tok = transformers.AutoTokenizer.from_pretrained(path)
    if not images:
        return tok.encode(text, add_special_tokens=False), {}
    if hf_processor_available():
        out = _hf_processor(path)(
            text=text, images=images, return_tensors="pt", add_special_tokens=False
        )
        # the processor normalizes in bfloat16 (as Meta's code does); the model reads float32
        return out["input_ids"][0].tolist(), {"pixel_values": out["pixel_values"].float()}
    out = _ours(path)(images=images, return_tensors="pt")
    pieces = text.split("<|image|>")
    n = (SIDE // PATCH // 2) ** 2
    for i, (rows, cols) in enumerate(out["aspect_ratios"].tolist()):
        pieces[i] += _prompt_split_image(rows, cols, n)
    ids = tok.encode("".join(pieces), add_special_tokens=False)
    return ids, {"pixel_values": out["pixel_values"].float()}


def test_images_match_hf(path, hf_model):
    # 2 x 2 tiles + the whole image; 3 x 1 tiles and untiled
    cases = hf_cases(PROMPT, TEXT, TWO, ((50, 90), (96, 40), (20, 24)))
    refs = hf_refs(hf_model, cases, lambda *case: _hf_inputs(path, *case))
    names = ("<|tile_x_separator|>", "<|tile_y_separator|>", "<|image_start|>", "<|image|>")
    x_sep, y_sep, start, image = _ids(path, *names)
    assert refs[0][0].count(x_sep) == 2 and refs[0][0].count(y_sep) == 2
    two = refs[2][0]
    assert two.count(y_sep) == 3 and [start, image] in [two[i : i + 2] for i in range(len(two))]
    check_matches_hf(path, cases, refs, "llama4")


def _ids(path, *tokens: str) -> list[int]:
    return transformers.AutoTokenizer.from_pretrained(path).convert_tokens_to_ids(list(tokens))


def test_tile_features_match_hf(path, hf_model):
    """The encoder's rows of each tile equal HF's get_image_features (tower, 2-D rope, pixel
    shuffle, adapter, projector) to float32 rounding."""
    from paged_engine.multimodal.archs import build_encoder
    from paged_engine.multimodal.processor import wrapper_config

    encoder = build_encoder(wrapper_config(path)).float()
    encoder.load_weights(load_file(path / "model.safetensors").items())
    _, extra = _hf_inputs(path, PROMPT, [noise_image(5, (40, 70))])
    pixels = extra["pixel_values"]
    with torch.no_grad():
        want = hf_model.get_image_features(pixel_values=pixels).pooler_output
        got = encoder(pixels)
    assert got.shape == want.shape == (pixels.shape[0], 4, 64)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# (height, width): tiled, untiled, upscaled to a tile, one pixel thin, a tile exactly
SIZES = [(50, 90), (96, 40), (20, 24), (32, 32), (33, 31), (1, 200), (200, 1), (7, 5), (64, 64)]
SIZES += [(100, 300), (300, 100), (63, 129), (16, 90), (129, 63)]


def test_torch_processor_matches_transformers(path, monkeypatch):
    """Where torchvision imports: for each size and aspect ratio above, with and without
    mm_processor_kwargs, the engine's processor with torchvision hidden (its torch copy) gives
    Llama4Processor's prompt ids and tiles and Llama4ImageProcessor's pixels bit for bit."""
    if not hf_processor_available():
        pytest.skip("transformers' Llama4ImageProcessor needs torchvision")
    from paged_engine.multimodal import llama4, torch_processors
    from paged_engine.multimodal.processor import ImageProcessor, wrapper_config

    hf = _hf_processor(path)
    tok = hf.tokenizer
    monkeypatch.setattr(torch_processors, "torchvision_available", lambda: False)
    ours = ImageProcessor(path, wrapper_config(path), tokenizer=tok)
    assert type(ours.hf) is llama4.Llama4TorchProcessor
    prompt = tok.encode(PROMPT, add_special_tokens=False)
    for i, size in enumerate(SIZES):
        image = noise_image(20 + i, size)
        for kw in ({}, {"max_patches": 1}, {"max_patches": 6, "resize_to_max_canvas": True}):
            want = hf(
                text=PROMPT, images=[image], return_tensors="pt", add_special_tokens=False, **kw
            )
            tiles = hf.image_processor(images=[image], return_tensors="pt", **kw)
            got = ours.hf(images=[image], **kw)
            assert got["aspect_ratios"].tolist() == tiles["aspect_ratios"].tolist()
            assert got["pixel_values"].dtype == want["pixel_values"].dtype == torch.bfloat16
            assert torch.equal(tiles["pixel_values"], want["pixel_values"])  # kwargs passed on
            assert torch.equal(got["pixel_values"], want["pixel_values"]), (size, kw)
            ids, placed = ours.process(prompt, [image], kw)
            assert ids == want["input_ids"][0].tolist()
            tiles = torch.stack([m.pixel_values for m in placed])
            assert torch.equal(tiles, want["pixel_values"].float())


def test_engine_paths_match_the_plain_run(path):
    """Chunks of 8 tokens through the tiles, a prefix-cache hit on the same image, images
    processed ahead (image_checks) against the plain run; bad input a ValueError naming it."""
    prompts = path_prompts(PROMPT, TWO, narrow=0)
    cached = check_engine_paths(path, prompts, TWO)
    pics = prompts[-1]["multi_modal_data"]["image"]
    refused = [
        ({"prompt": TWO, "multi_modal_data": {"image": pics[:1]}}, "2 <\\|image\\|> token"),
        ({"prompt": PROMPT, "multi_modal_data": {"image": pics}}, "1 <\\|image\\|> token"),
        ({"prompt": PROMPT, "multi_modal_data": {"image": "a.png"}}, "PIL.Image"),
        ({"prompt": PROMPT, "multi_modal_data": {"image": torch.zeros(4, 64)}}, "embeddings"),
        ({"prompt": PROMPT + "<|patch|>", "multi_modal_data": {"image": pics[0]}}, "<\\|patch"),
    ]
    check_refused(path, cached, refused, prompts)


def test_tensor_parallel_matches_one_process(path):
    prompts = [{"prompt": TWO, "multi_modal_data": {"image": [noise_image(11, (30, 70))] * 2}}]
    check_tensor_parallel(path, prompts, 20)


def test_chat_data_url_gives_the_offline_tokens(path):
    """The server's chat path: an image_url part with a data: URL gives the offline tokens and
    prompt (the chat template's <|image|> becomes the image's tiles); mm_processor_kwargs reach
    the image processor (max_patches 1: untiled, fewer tokens); two images over
    limit_mm_per_prompt, or a data: URL that is no image, a 400 naming the messages."""

    def more(http, body: dict, want) -> None:
        small = {**body, "mm_processor_kwargs": {"max_patches": 1}}
        status, _, out = http.request("POST", "/v1/chat/completions", small)
        assert status == 200 and out["usage"]["prompt_tokens"] < len(want.prompt_ids), out
        part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}
        ask = [{"role": "user", "content": [part, body["messages"][0]["content"][1]]}]
        status, _, error = http.request("POST", "/v1/chat/completions", {**body, "messages": ask})
        assert status == 400 and error["error"]["param"].startswith("messages"), error

    llm = engine(path, limit_mm_per_prompt={"image": 1})
    question = [{"type": "image"}, {"type": "text", "text": "What is it?"}]
    check_chat_data_url(llm, question, noise_image(12, (40, 72)), over_limit=True, more=more)
