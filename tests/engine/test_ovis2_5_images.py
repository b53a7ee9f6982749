"""Images through Ovis 2.5 checkpoints (multimodal/ovis2_5.py) against HF.

A tiny random `Ovis2_5ForConditionalGeneration` (a Qwen3 decoder; a tower of 4-pixel patches
whose 4 x 4 position table every image resizes bicubically, up and down; window and full
attention layers both present, windows of 2 x 2 merged tokens cut at the edges; a
non-default rope theta; a 72-entry visual vocabulary whose last 4 rows are the indicators;
images smart-resized between 4 and 24 merged tokens, one under the factor widened first):
`LLM.generate` with `multi_modal_data` must give HF's prompt ids (Ovis2_5Processor's
<img> <image> x n </img>, its own replace_image_token) and HF `generate`'s greedy tokens and
top-5 logprobs (1e-3, float32). Then the encoder against get_image_features and the
indicator rows, the engine's paths, TP=2, the server's chat path and bad input.
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
    check_paths_and_refusals,
    check_tensor_parallel,
    check_vision_fields_refused,
    engine,
    hf_cases,
    hf_refs,
    noise_image,
)
from vlm_checkpoints import chatml_template, finish_checkpoint, load_hf_vlm, saved_tokenizer

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.ovis2_5")

TOKENS = {
    "image_token": "<image>",
    "image_start_token": "<img>",
    "image_end_token": "</img>",
    "video_token": "<video>",
    "video_start_token": "<vid>",
    "video_end_token": "</vid>",
}
PROMPT = "<|im_start|>user\n<image>\nWhat is in it?<|im_end|>\n<|im_start|>assistant\n"
TWO = "<|im_start|>user\n<image> and <image>\nWhich is brighter?<|im_end|>\n<|im_start|>assistant\n"
TEXT = "<|im_start|>user\nSay something about the sea.<|im_end|>\n<|im_start|>assistant\n"
CHAT_TEMPLATE = chatml_template("<image>\n")
PROCESSOR = {  # Ovis2_5ImageProcessor's settings, scaled down (factor 4 * 2 = 8 pixels)
    "image_processor_type": "Ovis2_5ImageProcessor",  # the PIL backend without torchvision
    "size": {"shortest_edge": 4 * 64, "longest_edge": 24 * 64},
    "patch_size": 4,
    "merge_size": 2,
    "temporal_patch_size": 1,
    "image_mean": [0.48, 0.45, 0.4],
    "image_std": [0.27, 0.26, 0.28],
}


def write_tiny_ovis2_5(path: Path, seed: int = 0) -> Path:
    from paged_engine.testing import _COMMON, _save_random, tiny_config

    path.mkdir(parents=True, exist_ok=True)
    tok = saved_tokenizer(path, list(TOKENS.values()), CHAT_TEMPLATE, seed, **TOKENS)
    ids = {f"{k}_id": tok.convert_tokens_to_ids(v) for k, v in TOKENS.items()}
    text = tiny_config("qwen3", vocab_size=len(tok), tie_word_embeddings=False).to_dict()
    vision = {
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 3,
        "num_attention_heads": 2,
        "patch_size": 4,
        "image_size": 16,  # a 4 x 4 position table
        "spatial_merge_size": 2,
        "window_size": 16,  # 2 x 2 merged tokens
        "layer_types": ["window_attention", "full_attention", "window_attention"],
        "vocab_size": 72,  # not the text width: a transposed table shows
        "num_visual_indicator_tokens": 4,
        "hidden_act": "gelu_pytorch_tanh",
        "rope_parameters": {"rope_type": "axial", "rope_theta": 100.0},
    }
    config = transformers.Ovis2_5Config(
        text_config=text, vision_config=vision, tie_word_embeddings=False, **ids, **_COMMON
    )
    config.architectures = ["Ovis2_5ForConditionalGeneration"]
    _save_random(transformers.Ovis2_5ForConditionalGeneration, config, seed, path)
    (path / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    return finish_checkpoint(path, tok)  # (its extra special tokens saved)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_ovis2_5(tmp_path_factory.mktemp("ovis2_5"), seed=3)


def _image_processor(path):
    from transformers.models.ovis2_5.image_processing_pil_ovis2_5 import (
        Ovis2_5ImageProcessorPil,
    )

    return Ovis2_5ImageProcessorPil.from_pretrained(path)


def _hf_inputs(path, text: str, images: list) -> tuple[list[int], dict]:
    """HF's prompt ids (Ovis2_5Processor.replace_image_token on each image) and pixels."""
    from transformers.models.ovis2_5.processing_ovis2_5 import Ovis2_5Processor

    tok = transformers.AutoTokenizer.from_pretrained(path)
    if not images:
        return tok.encode(text, add_special_tokens=False), {}
    proc = _image_processor(path)
    out = proc(images, return_tensors="pt")
    me = SimpleNamespace(image_processor=proc, **TOKENS)
    pieces = text.split(TOKENS["image_token"])
    prompt = pieces[0]
    for i, piece in enumerate(pieces[1:]):
        prompt += Ovis2_5Processor.replace_image_token(me, out, i) + piece
    ids = tok.encode(prompt, add_special_tokens=False)
    return ids, {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


def _hf_model(path):
    return load_hf_vlm(transformers.Ovis2_5ForConditionalGeneration, path)


def test_images_match_hf(path):
    # 20 x 28 -> 24 x 32: 6 x 8 patches, 3 x 4 merged tokens; 90 x 40 scaled down; 5 x 30
    # widened from under the factor
    cases = hf_cases(PROMPT, TEXT, TWO, ((20, 28), (90, 40), (5, 30)))
    refs = hf_refs(_hf_model(path), cases, lambda *case: _hf_inputs(path, *case))
    check_matches_hf(path, cases, refs, "ovis2_5")


def test_encoder_matches_hf_features(path):
    """The tower, visual tokenizer and table alone: each image's rows equal HF's
    get_image_features (grids up and down from the 4 x 4 table, windows cut at the edges),
    between the start and end indicator rows HF puts on <img> and </img>."""
    from safetensors.torch import load_file

    from paged_engine.multimodal.inputs import ImageInput
    from paged_engine.multimodal.ovis2_5 import Ovis2_5ImageEncoder

    model = _hf_model(path)
    config = transformers.AutoConfig.from_pretrained(path)
    ours = Ovis2_5ImageEncoder(config)
    ours.load_weights(load_file(Path(path) / "model.safetensors").items())
    pictures = [noise_image(5, (90, 40)), noise_image(6, (20, 28)), noise_image(7, (5, 30))]
    _, extra = _hf_inputs(path, "<image><image><image>", pictures)
    grids = [tuple(g) for g in extra["image_grid_thw"].tolist()]
    assert len(set(grids)) == 3 and any(h < 4 or w < 4 for _, h, w in grids)
    pixels = extra["pixel_values"].split([t * h * w for t, h, w in grids])
    images = [
        ImageInput(p, 0, t * h * w // 4 + 2, str(i), (t, h, w))
        for i, (p, (t, h, w)) in enumerate(zip(pixels, grids, strict=True))
    ]
    with torch.no_grad():
        got = ours.encode(images)
        want = model.model.get_image_features(**extra).pooler_output
        marks = model.model.multi_modal_projector.get_visual_indicator_features("cpu")
    assert tuple(ours.vte.weight.shape) == (72, 64)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a[1:-1], b, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a[0], marks[0])
        torch.testing.assert_close(a[-1], marks[1])
    # transformers' own names (its table transposed) load to the same encoder
    again = Ovis2_5ImageEncoder(config)
    again.load_weights(model.state_dict().items())
    with torch.no_grad():
        for a, b in zip(again.encode(images), got, strict=True):
            torch.testing.assert_close(a, b)


def test_engine_paths_match_the_plain_run(path):
    """image_checks' paths (8-token chunks through the images and their bounds, prefix-cache
    hits, images processed ahead); bad input a ValueError naming what is wrong."""
    rows = {"prompt": PROMPT, "multi_modal_data": {"image": torch.zeros(12, 64)}}
    check_paths_and_refusals(path, PROMPT, TWO, lambda _: [(rows, "embeddings")])


def test_tensor_parallel_matches_one_process(path):
    """TP=2: the encoder on every rank, the decoder's heads split; chunks through images."""
    prompts = [{"prompt": TWO, "multi_modal_data": {"image": [noise_image(11, (60, 30))] * 2}}]
    check_tensor_parallel(path, prompts, 8, 8)


def test_chat_data_url_gives_the_offline_tokens(path):
    """The server's chat path: an image_url part with a data: URL gives the offline tokens and
    prompt (the chat template's <image> expanded as Ovis2_5Processor does)."""
    question = [{"type": "image"}, {"type": "text", "text": "What is in it?"}]
    want = check_chat_data_url(engine(path), question, noise_image(12, (60, 30)))
    assert want.text == PROMPT


def test_config_refusals(path):
    """What the path does not run is refused by the config field's name."""
    from paged_engine.multimodal.ovis2_5 import Ovis2_5ImageEncoder

    bad = [
        ("temporal_patch_size", 2),
        ("layer_types", ["sliding_attention"] * 3),
        ("num_visual_indicator_tokens", 1),
        ("image_size", 18),
        ("rope_parameters", {"rope_type": "yarn", "rope_theta": 100.0}),
    ]
    cases = [(field, value, field) for field, value in bad]  # each named in its error
    check_vision_fields_refused(path, cases, Ovis2_5ImageEncoder)
