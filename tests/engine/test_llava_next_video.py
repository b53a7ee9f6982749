"""Images and videos through LLaVA-NeXT-Video checkpoints (multimodal/llava_next_video.py) vs HF.

A tiny random `LlavaNextVideoForConditionalGeneration` (a CLIP tower of 30-pixel frames in
5-pixel patches: a 6 x 6 map, pooled 2 x 2 on average to 9 rows a frame; LLaVA-NeXT's anyres
tiles for images) with LLaVA-NeXT's image processor and a saved LlavaNextVideoVideoProcessor
config. transformers' video processor needs torchvision: HF's LlavaNextVideoProcessor runs here
with each frame through its CLIP image processor instead (identical where no resize is needed:
frames with a 30-pixel shortest edge, center-cropped), so its prompt ids (its own <video>
count), pixel values and HF `generate`'s greedy tokens and top-5 logprobs (1e-3, float32) are
the reference for a video, an image with a video, an image and text alone. Then the frames'
resize against HF's rule, chunked prefill and prefix-cache hits through videos and an image,
videos processed ahead, LLM.chat's video_url parts, and bad input refused by name.
"""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch
from hf_reference import assert_matches, assert_same_greedy, hf_greedy
from image_checks import check_chunks_and_prefix_hits, engine, greedy, noise_image
from vlm_checkpoints import finish_checkpoint, load_hf_vlm, tokenizer_with

from paged_engine import SamplingParams
from paged_engine.testing import _COMMON, _save_random, tiny_config

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

PINPOINTS = [[30, 60], [60, 30], [60, 60]]
SQUARE = {"height": 30, "width": 30}
VIDEO = "USER: <video>\nWhat happens in it?\nASSISTANT:"
BOTH = "USER: <image>\nand <video>\nDo they match?\nASSISTANT:"
IMAGE = "USER: <image>\nWhat is in it?\nASSISTANT:"
TEXT = "USER: Say something about the sea.\nASSISTANT:"
TEMPLATE = (
    "{% for message in messages %}{{ message['role'].upper() }}: "
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>\n{% elif part['type'] == 'video' %}<video>\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def _frames(seed: int, count: int, size: tuple[int, int] = (30, 40)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, *size, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    path = tmp_path_factory.mktemp("llava-next-video")
    tokenizer, ids = tokenizer_with(["<image>", "<video>"], 5)
    tower = transformers.CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        image_size=30,
        patch_size=5,
        projection_dim=32,
    )
    config = transformers.LlavaNextVideoConfig(
        text_config=tiny_config("llama", vocab_size=len(tokenizer)).to_dict(),
        vision_config=tower.to_dict(),
        image_token_index=ids["<image>"],
        video_token_index=ids["<video>"],
        image_grid_pinpoints=PINPOINTS,
        spatial_pool_mode="average",
        spatial_pool_stride=2,
        **_COMMON,
    )
    _save_random(transformers.LlavaNextVideoForConditionalGeneration, config, 5, path)
    transformers.LlavaNextImageProcessor(
        size={"shortest_edge": 30}, crop_size=SQUARE, image_grid_pinpoints=PINPOINTS
    ).save_pretrained(path)
    video = {"video_processor_type": "LlavaNextVideoVideoProcessor", "resample": 3}
    video |= {"size": {"shortest_edge": 30}, "crop_size": SQUARE, "do_sample_frames": False}
    (path / "video_preprocessor_config.json").write_text(json.dumps(video))
    return finish_checkpoint(path, tokenizer, TEMPLATE)


def _frame_pixels(path, frames: np.ndarray) -> torch.Tensor:
    """HF's CLIP image processor on each frame (transformers' video steps, without
    torchvision): [T, 3, 30, 30]."""
    clip = transformers.CLIPImageProcessor(size={"shortest_edge": 30}, crop_size=SQUARE)
    return clip([Image.fromarray(f) for f in frames], return_tensors="pt")["pixel_values"]


def _hf_processor(path):
    """HF's LlavaNextVideoProcessor, its video processor `_frame_pixels` per video."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(transformers.ProcessorMixin, "check_argument_for_proper_class", _any)
        processor = transformers.LlavaNextVideoProcessor(
            image_processor=transformers.AutoImageProcessor.from_pretrained(path),
            tokenizer=transformers.AutoTokenizer.from_pretrained(path),
            patch_size=5,
            vision_feature_select_strategy="default",
            num_additional_image_tokens=1,
        )

    def videos(items, **kw):
        stacked = torch.stack([_frame_pixels(path, v) for v in items])
        return transformers.BatchFeature({"pixel_values_videos": stacked})

    processor.video_processor = videos
    return processor


def _any(self, name: str, value: object) -> None:
    return None


def test_images_and_videos_match_hf(path):
    model = load_hf_vlm(transformers.LlavaNextVideoForConditionalGeneration, path)
    processor = _hf_processor(path)
    cases = [
        (VIDEO, [], [_frames(1, 3)]),  # 30 x 40 frames: cropped, not resized
        (TEXT, [], []),
        (BOTH, [noise_image(2, (40, 52))], [_frames(3, 2, (36, 30))]),
        (IMAGE, [noise_image(4, (64, 30))], []),
    ]
    llm = engine(path)
    prompts, refs = [], []
    for text, images, videos in cases:
        mm = {"image": images} if images else {}
        mm |= {"video": videos} if videos else {}
        prompts.append({"prompt": text, "multi_modal_data": mm} if mm else text)
        if not mm:
            ids = processor.tokenizer.encode(text)
            refs.append((ids, hf_greedy(model, ids, 8, 5)))
            continue
        out = processor(text=[text], images=images or None, videos=videos or None)
        ids = torch.as_tensor(out["input_ids"])[0].tolist()
        extra = {k: torch.as_tensor(np.asarray(out[k])) for k in out if k != "input_ids"}
        extra.pop("attention_mask", None)
        refs.append((ids, hf_greedy(model, ids, 8, 5, **extra)))
        if videos:  # the engine's frames are HF's pixel values
            req = llm.llm_engine.input_processor.make_request("p", prompts[-1], greedy(), None)
            (mine,) = [m for m in req.request.mm_inputs if m.modality == "video"]
            torch.testing.assert_close(mine.pixel_values, extra["pixel_values_videos"][0])
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    video_id = model.config.video_token_id
    assert [ids.count(video_id) for ids, _ in refs] == [27, 0, 18, 0]  # 9 rows a frame
    for (ids, ref), out in zip(refs, outs, strict=True):
        assert out.prompt_token_ids == ids
        assert_matches("llava-next-video", out, ref)


def test_resized_frames_follow_hf(path):
    """Frames larger than the tower's: shortest edge to 30 (HF's size rule), bicubic with
    antialias (as torchvision, within a step or two of PIL's values), center crop."""
    llm = engine(path)
    videos = llm.llm_engine.input_processor.videos
    for size in [(45, 75), (90, 60), (20, 33)]:
        frames = _frames(6, 2, size)
        _, (item,), _ = videos.process([7, videos.video_token_id], frames)
        want = _frame_pixels(path, frames)
        assert item.pixel_values.shape == want.shape == (2, 3, 30, 30)
        assert (item.pixel_values - want).abs().mean() < 0.05, size


def test_the_video_settings_come_from_the_checkpoint(path, tmp_path):
    """Without a saved video processor the image processor's resize, crop and normalization
    serve; a saved crop that is not the tower's frame is refused by name."""
    from paged_engine.multimodal.llava_next_video import LlavaNextVideoProcessor

    config = transformers.AutoConfig.from_pretrained(path)
    (tmp_path / "preprocessor_config.json").write_bytes(
        (path / "preprocessor_config.json").read_bytes()
    )
    videos = LlavaNextVideoProcessor(tmp_path, config)
    assert videos.settings["crop_size"] == SQUARE
    frames = _frames(1, 2)
    _, (item,), _ = videos.process([videos.video_token_id], frames)
    torch.testing.assert_close(item.pixel_values, _frame_pixels(path, frames))
    saved = json.loads((path / "video_preprocessor_config.json").read_text())
    saved["crop_size"] = {"height": 224, "width": 224}
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match="crop_size"):
        LlavaNextVideoProcessor(tmp_path, config)


def test_chunks_prefix_cache_and_videos_processed_ahead(path):
    """Chunks through videos and an image against the plain run, prefix-cache hits on the same
    video (none past the text for other frames) and on the same image; videos processed ahead
    taken with the expanded ids, refused one token off."""
    prompts = [
        {"prompt": VIDEO, "multi_modal_data": {"video": _frames(7, 3)}},
        {"prompt": VIDEO, "multi_modal_data": {"video": _frames(8, 2)}},
        {"prompt": IMAGE, "multi_modal_data": {"image": noise_image(9, (50, 50))}},
        {
            "prompt": BOTH,
            "multi_modal_data": {"image": noise_image(1, (20, 80)), "video": _frames(2, 1)},
        },
    ]
    params = greedy(0, 12)
    plain, cached, run = check_chunks_and_prefix_hits(
        path, prompts, params, 8, lambda proc: proc.videos.video_token_id
    )
    run(cached, prompts[2:3])
    again = cached.generate(prompts[2:3], params, use_tqdm=False)[0]
    assert again.num_cached_tokens >= (len(again.prompt_token_ids) - 1) // 16 * 16
    assert_same_greedy(plain[2:3], [again.outputs[0]])
    videos = cached.llm_engine.input_processor.videos
    ids = cached.get_tokenizer().encode(VIDEO)
    expanded, done, _ = videos.process(ids, prompts[0]["multi_modal_data"]["video"])
    ahead = {"prompt_token_ids": expanded, "multi_modal_data": {"video": done}}
    assert_same_greedy(plain[:1], run(cached, [ahead]))
    moved = {"prompt_token_ids": [5, *expanded], "multi_modal_data": {"video": done}}
    with pytest.raises(ValueError, match="do not fit"):
        cached.generate([moved], params, use_tqdm=False)


def test_llm_chat_reads_video_url_parts(path):
    """LLM.chat's video_url part (a data: URL, decoded and sampled as the server does) gives
    the answer of generate with the same decoded frames."""
    pytest.importorskip("av")
    from paged_engine.multimodal.video_io import decode_video
    from paged_engine.testing import encode_video

    data = encode_video(_frames(4, 6, (30, 40)), fps=6)
    llm = engine(path)
    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    content = [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "Go"}]
    (got,) = llm.chat([{"role": "user", "content": content}], greedy(0), use_tqdm=False)
    video = decode_video(data)  # (frames, metadata): 6 frames, fewer than the 32 it samples
    prompt = {"prompt": "USER: <video>\nGo\nASSISTANT:", "multi_modal_data": {"video": video}}
    (want,) = llm.generate(prompt, greedy(0), use_tqdm=False)
    assert got.prompt_token_ids == want.prompt_token_ids
    assert got.prompt_token_ids.count(llm.llm_engine.input_processor.videos.video_token_id) == 54
    assert got.outputs[0].token_ids == want.outputs[0].token_ids


def test_bad_input_is_refused_by_name(path, tmp_path):
    llm = engine(path, limit_mm_per_prompt={"image": 2, "video": 1})
    video, image = _frames(1, 2), noise_image(1, (30, 30))
    cases = [
        ({"prompt": VIDEO + "<video>", "multi_modal_data": {"video": video}}, "2 video placeh"),
        ({"prompt": IMAGE, "multi_modal_data": {"video": video}}, "0 video placeholder"),
        ({"prompt": VIDEO, "multi_modal_data": {"video": [video, video]}}, "limit_mm_per_prompt"),
        ({"prompt": BOTH, "multi_modal_data": {"image": [image, image]}}, "1 image placeholder"),
        (
            {"prompt": VIDEO, "multi_modal_data": {"video": video.astype(np.float32)}},
            r"multi_modal_data\['video'\]\[0\] must be uint8",
        ),
        (
            {"prompt": VIDEO, "multi_modal_data": {"video": _frames(1, 1, (1, 300))}},
            r"multi_modal_data\['video'\]\[0\]: frames of 1 x 300: the aspect",
        ),
    ]
    for bad, match in cases:
        with pytest.raises(ValueError, match=match):
            llm.generate([bad], greedy(0), use_tqdm=False)
    fps = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match=r"mm_processor_kwargs\['fps'\]"):
        prompt = {"prompt": VIDEO, "multi_modal_data": {"video": video}}
        llm.generate([{**prompt, "mm_processor_kwargs": {"fps": 2}}], fps, use_tqdm=False)
    out = llm.generate([{"prompt": VIDEO, "multi_modal_data": {"video": video}}], greedy(0))
    assert len(out[0].outputs[0].token_ids) == 8  # nothing lost
    config = json.loads((path / "config.json").read_text())
    for field, value in [("spatial_pool_mode", "conv"), ("spatial_pool_stride", 0)]:
        (tmp_path / "config.json").write_text(json.dumps({**config, field: value}))
        for name in ("model.safetensors", "preprocessor_config.json", "tokenizer.json"):
            (tmp_path / name).write_bytes((path / name).read_bytes())
        with pytest.raises(ValueError, match=field):
            engine(tmp_path)
