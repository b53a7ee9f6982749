"""Videos of families paged serves under vLLM's names: Tarsier2 (`Tarsier2ForConditionalGeneration`,
models/tarsier2_config.py), whose videos run through Qwen2-VL's video path as vLLM's run, and
Ovis2.5's Hub release (`Ovis2_5`, multimodal/ovis2_5_hub_video.py), one video per prompt.

Reference: transformers' `Qwen2VLForConditionalGeneration` on the tiny checkpoint that
test_vllm_names_rerank_tarsier_mantis.py converts into the release's LLaVA layout, given the
engine's patch rows and grids (`pixel_values_videos`, `video_grid_thw`): greedy tokens identical,
top-5 logprobs within 1e-3 (float32). The preprocessing is vLLM's Tarsier2Processor's: the video
processor takes the image processor's settings (preprocessor_config.json; a
video_preprocessor_config.json is not read), so a still video's grid and pixels are what HF's
image processor makes of its frame, and the frame pixel bounds are the images' (top-level
min_pixels / max_pixels over the size).

Ovis2.5: the reference is built as test_ovis2_5_hub.py builds an image's (HF's modules on the
same tiny checkpoint): each frame's pixels by the remote's image steps, the frames' rows one after
another with grid (T, h, w); HF's projector over the input of its tower's post_layernorm on that
grid, between HF's video-start and video-end indicator rows (get_visual_indicator_features()[2],
[3]); ids: the text split at "<video>", the pieces tokenized apart, <|image_pad|> x (rows) between;
HF's model from those embeds, 8 greedy steps: the same ids, tokens, and top-5 logprobs within 1e-3.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
import transformers
from hf_reference import Greedy, assert_matches, hf_greedy, hf_greedy_from_embeds
from image_checks import engine, greedy, noise_image
from PIL import Image
from test_ovis2_5_hub import PAD_ID, _pixels, _visual_rows, write_tiny_ovis2_5_hub
from test_vllm_names_rerank_tarsier_mantis import TARSIER2, tarsier2_layout

from paged_engine import LLM, SamplingParams
from paged_engine.models.tarsier2_config import Tarsier2VideoProcessor
from paged_engine.multimodal.qwen_video import smart_resize
from paged_engine.testing import write_tiny_qwen2_vl

VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def _chat(body: str) -> str:
    return f"<|im_start|>user\n{body}<|im_end|>\n<|im_start|>assistant\n"


def _frames(seed: int, count: int, size: tuple[int, int]) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, *size, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def tarsier2(tmp_path_factory):
    """(transformers' tiny Qwen2-VL, its Tarsier2 conversion, the engine on it). The conversion
    also gets a video_preprocessor_config.json of other bounds, which vLLM's Tarsier2 never
    reads: a processor reading it (or HF's default video bounds) makes other grids."""
    root = tmp_path_factory.mktemp("tarsier2-videos")
    src = write_tiny_qwen2_vl(root / "qwen2-vl", version="2", seed=6)
    pre = json.loads((src / "preprocessor_config.json").read_text())
    pre |= {"image_mean": [0.5, 0.4, 0.3], "image_std": [0.2, 0.3, 0.25]}  # not the defaults
    (src / "preprocessor_config.json").write_text(json.dumps(pre))
    path = root / "tarsier2"
    tarsier2_layout(src, path)
    video = json.loads((src / "video_preprocessor_config.json").read_text())
    video["size"] = {"shortest_edge": 48 * 48 * 4, "longest_edge": 64 * 64 * 8}
    (path / "video_preprocessor_config.json").write_text(json.dumps(video))
    llm = LLM(model=str(path), hf_overrides=TARSIER2, dtype="float32", max_model_len=512)
    yield src, path, llm
    llm.llm_engine.shutdown()


def _items(llm: LLM, prompt: dict) -> tuple:
    """The engine's own processing of a prompt's images and videos."""
    req = llm.llm_engine.input_processor.make_request("probe", prompt, SamplingParams(), None)
    return req.request.mm_inputs


def _hf_inputs(config, ids: list[int], items) -> dict:
    """HF Qwen2-VL's arguments for the engine's expanded prompt and its processed items."""
    kinds = [
        1 if t == config.image_token_id else 2 if t == config.video_token_id else 0 for t in ids
    ]
    extra: dict = {"mm_token_type_ids": torch.tensor([kinds])}
    for key, grid_key, video in (
        ("pixel_values", "image_grid_thw", False),
        ("pixel_values_videos", "video_grid_thw", True),
    ):
        chosen = [m for m in items if (m.image_size[0] > 1) == video]
        if chosen:
            extra[key] = torch.cat([m.pixel_values for m in chosen])
            extra[grid_key] = torch.tensor([m.image_size for m in chosen])
    return extra


def test_tarsier2_videos_match_hf_qwen2_vl(tarsier2) -> None:
    src, _, llm = tarsier2
    model = transformers.Qwen2VLForConditionalGeneration.from_pretrained(src, dtype=torch.float32)
    model.eval().generation_config.eos_token_id = None
    prompts = [
        {
            "prompt": _chat(VIDEO + "What happens?"),
            "multi_modal_data": {"video": _frames(1, 5, (40, 56))},
        },
        {
            "prompt": _chat(f"{IMAGE} then {VIDEO} and now?"),
            "multi_modal_data": {
                "image": noise_image(2, (32, 40)),
                "video": (_frames(3, 4, (24, 72)), {"fps": 2.0}),
            },
        },
    ]
    outs = llm.generate(prompts, greedy(n=6), use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        items = _items(llm, prompt)
        ids = out.prompt_token_ids
        assert_matches(
            "tarsier2 video",
            out,
            hf_greedy(model, ids, 6, 5, **_hf_inputs(model.config, ids, items)),
        )
    # the images' bounds (256 .. 4096 pixels): 40 x 56 stays, 5 frames pad to 3 groups of 2
    (video,) = _items(llm, prompts[0])
    assert tuple(video.image_size) == (3, 10, 14)
    assert outs[0].prompt_token_ids.count(model.config.video_token_id) == 3 * 10 * 14 // 4


def test_tarsier2_video_preprocessing_is_the_image_processors(tarsier2, tmp_path) -> None:
    """A still video (a frame twice) is what the release's image processor (size as min / max
    pixels, vLLM's remap) makes of the frame: grid, and pixels within the resizers' difference;
    a frame over max_pixels is shrunk as the image would be."""
    src, path, llm = tarsier2
    videos = llm.llm_engine.input_processor.videos
    assert isinstance(videos, Tarsier2VideoProcessor)
    hf_images = transformers.AutoImageProcessor.from_pretrained(src)
    for seed, size in ((4, (44, 60)), (5, (100, 120))):
        frame = _frames(seed, 1, size)[0]
        _, (video,), _ = videos.process([videos.video_token_id], [np.stack([frame, frame])])
        want = hf_images(images=[Image.fromarray(frame)], return_tensors="pt")
        assert tuple(video.image_size) == tuple(want["image_grid_thw"][0].tolist())
        diff = (video.pixel_values - want["pixel_values"]).abs()
        assert float(diff.mean()) < 0.05 and float(diff.max()) < 0.6  # (a layout error: ~1)
    assert tuple(video.image_size) == (1, 14, 16)  # 100 x 120 shrunk to 56 x 64 <= 4096 pixels
    # top-level min_pixels / max_pixels override the size, as the video processor reads them
    other = tmp_path / "bounds"
    shutil.copytree(path, other)
    pre = json.loads((other / "preprocessor_config.json").read_text())
    frame = _frames(6, 2, (44, 60))  # 2640 pixels: within the size's bounds
    for low, high in ((4096, 8192), (256, 1024)):
        bounds = {"min_pixels": low, "max_pixels": high}
        (other / "preprocessor_config.json").write_text(json.dumps(pre | bounds))
        small = Tarsier2VideoProcessor(other, videos.config)
        _, (video,), _ = small.process([small.video_token_id], [frame])
        h, w = smart_resize(44, 60, 8, low, high)
        assert tuple(video.image_size) == (1, h // 4, w // 4) and low <= h * w <= high
    # settings the tower cannot read: ValueError naming them (the engine then serves images only)
    (other / "preprocessor_config.json").write_text(json.dumps(pre | {"patch_size": 7}))
    with pytest.raises(ValueError, match="patch_size"):
        Tarsier2VideoProcessor(other, videos.config)
    (other / "preprocessor_config.json").write_text(json.dumps({"patch_size": 4}))
    with pytest.raises(ValueError, match="min_pixels / max_pixels"):
        Tarsier2VideoProcessor(other, videos.config)


OVIS_VIDEO = "<|im_start|>user\n<video>\nWhat happens?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def ovis(tmp_path_factory):
    """(the Hub checkpoint, HF's Ovis2_5 model of it, the engine on the Hub form)."""
    hub, hf = write_tiny_ovis2_5_hub(tmp_path_factory.mktemp("ovis2_5_video"), seed=7)
    model = transformers.Ovis2_5ForConditionalGeneration.from_pretrained(hf, dtype=torch.float32)
    llm = engine(hub, max_model_len=1024)
    yield hub, model.eval(), llm
    llm.llm_engine.shutdown()


def _ovis_video_reference(model, tok, text: str, frames: np.ndarray) -> tuple[list[int], Greedy]:
    """(vLLM's prompt ids, HF's greedy result from its embeds) for one video (see the module)."""
    per_frame = [_pixels(Image.fromarray(f)) for f in frames]
    pixels = torch.cat([p for p, _ in per_frame])
    _, h, w = per_frame[0][1]
    marks = model.model.multi_modal_projector.get_visual_indicator_features("cpu")
    head, tail = (tok.encode(t, add_special_tokens=False) for t in text.split("<video>"))
    with torch.no_grad():
        visual = _visual_rows(model, pixels, (len(frames), h, w))
        rows = torch.cat([marks[2:3], visual, marks[3:4]])  # video start / end indicators
        ids = head + [PAD_ID] * len(rows) + tail
        embeds = model.get_input_embeddings()(torch.tensor([ids]))
        embeds[0, len(head) : len(head) + len(rows)] = rows
    return ids, hf_greedy_from_embeds(model, embeds)


def test_ovis2_5_hub_video_matches_hf_modules(ovis) -> None:
    """Two 20 x 28 frames (widened and scaled up to 448^2 pixels as the images are) through the
    engine: the reference's ids, tokens and logprobs; again with the video processed ahead."""
    hub, model, llm = ovis
    tok = transformers.AutoTokenizer.from_pretrained(hub)
    frames = _frames(8, 2, (20, 28))
    ids, ref = _ovis_video_reference(model, tok, OVIS_VIDEO, frames)
    prompt = {"prompt": OVIS_VIDEO, "multi_modal_data": {"video": frames}}
    (out,) = llm.generate([prompt], greedy(), use_tqdm=False)
    assert out.prompt_token_ids == ids
    assert_matches("Ovis2_5 video", out, ref)
    (video,) = _items(llm, prompt)
    assert video.modality == "video" and video.image_size[0] == 2
    ahead = {"prompt_token_ids": ids, "multi_modal_data": {"video": [video]}}
    assert llm.generate([ahead], greedy(), use_tqdm=False)[0].outputs[0].token_ids == ref.tokens


def test_ovis2_5_hub_video_refusals(ovis) -> None:
    """What vLLM's Ovis2.5 does not take, or paged does not serve, is a ValueError naming it."""
    _, _, llm = ovis
    frames = _frames(9, 1, (32, 32))
    image = noise_image(9, (32, 32))
    both = OVIS_VIDEO.replace("<video>", "<image><video>")
    bad = [
        ({"video": [frames, frames]}, OVIS_VIDEO, None, "one video per prompt"),
        ({"video": frames, "image": image}, both, None, "no images beside it"),
        ({"video": frames}, OVIS_VIDEO.replace("<video>", ""), None, "0 video placeholder"),
        ({"video": frames}, OVIS_VIDEO, {"fps": 2.0}, "mm_processor_kwargs"),
    ]
    for data, text, kwargs, words in bad:
        prompt = {"prompt": text, "multi_modal_data": data}
        if kwargs:
            prompt["mm_processor_kwargs"] = kwargs
        with pytest.raises(ValueError, match=words):
            llm.generate([prompt], greedy(n=1), use_tqdm=False)
    assert llm.generate([OVIS_VIDEO.replace("<video>", "")], greedy(n=1), use_tqdm=False)
