"""Videos through the Qwen2.5-Omni and Qwen3-Omni thinkers (multimodal/omni_video.py) vs HF.

The tiny random thinkers of test_qwen_omni_images.py (Qwen2.5-VL's windowed tower; Qwen3-VL's
with deepstack rows) with a video processor config (4-pixel patches merged 2 x 2, 64 to 768
pixels a frame). transformers' Qwen2-VL video processor, which both Omni processors use,
imports torchvision, so HF is given the engine's own pixel rows (the resize and patch rules are
QwenVideoProcessor's, checked in test_qwen_videos.py), the prompt expanded by the Omni
processors' rule (one video token per merged patch) and video_second_per_grid =
temporal_patch_size / fps, with fps as the processors take it (mm_processor_kwargs' or 2 /
1). Against that: HF `generate`'s greedy tokens and top-5 logprobs (1e-3, float32) on a video,
a video beside an image (6 frames at 3 fps: temporal positions 0, 16, 33 past the grid) and
text, and the thinker's get_rope_index table (Omni's: the text after a video continues past
its last temporal index). Then chunks through a video, prefix-cache hits, TP=2 and refusals.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hf_reference import assert_matches, hf_greedy
from image_checks import (
    check_chunks_and_prefix_hits,
    check_tensor_parallel,
    engine,
    greedy,
    noise_image,
)

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.qwen2_5_omni")
pytest.importorskip("transformers.models.qwen3_omni_moe")
from test_qwen_omni_images import CLASSES, MARKS, write_tiny_omni  # noqa: E402

from paged_engine import SamplingParams  # noqa: E402

_VIDEO_CONFIG = {
    "patch_size": 4,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "size": {"shortest_edge": 64, "longest_edge": 768},  # pixels a frame
    "video_processor_type": "Qwen2VLVideoProcessor",
}


def _frames(seed: int, count: int, size: tuple[int, int] = (40, 56)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, *size, 3), dtype=np.uint8)


def _chat(version: str, body: str) -> str:
    return f"<|im_start|>user\n{body}<|im_end|>\n<|im_start|>assistant\n"


def _marks(version: str) -> tuple[str, str]:
    bos, eos, image, video = MARKS[version][:4]
    return f"{bos}{video}{eos}", f"{bos}{image}{eos}"


@pytest.fixture(scope="module")
def omni_dirs(tmp_path_factory):
    cache: dict[str, Path] = {}

    def make(version: str) -> Path:
        if version not in cache:
            path = write_tiny_omni(tmp_path_factory.mktemp(f"omni{version}"), version)
            (path / "video_preprocessor_config.json").write_text(json.dumps(_VIDEO_CONFIG))
            cache[version] = path
        return cache[version]

    return make


def _hf_model(path: Path, version: str):
    model = getattr(transformers, CLASSES[version]).from_pretrained(path, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    return model.eval()


def _hf_inputs(llm, model, prompt: dict, fps: float | None, default: float) -> tuple:
    """(HF's prompt ids, its model arguments, the engine's request): the prompt with the
    Omni processors' runs for the engine's own pixel rows."""
    req = llm.llm_engine.input_processor.make_request("p", prompt, SamplingParams(), None).request
    cfg = model.config
    tok = llm.get_tokenizer()
    ids = tok.encode(prompt["prompt"], add_special_tokens=False)
    items = iter(req.mm_inputs)
    expanded: list[int] = []
    for t in ids:
        n = next(items).length if t in (cfg.image_token_id, cfg.video_token_id) else 1
        expanded += [t] * n
    videos = [m for m in req.mm_inputs if expanded[m.offset] == cfg.video_token_id]
    images = [m for m in req.mm_inputs if expanded[m.offset] == cfg.image_token_id]
    extra: dict = {}
    if images:
        extra["pixel_values"] = torch.cat([m.pixel_values for m in images])
        extra["image_grid_thw"] = torch.tensor([m.image_size for m in images])
    if videos:
        extra["pixel_values_videos"] = torch.cat([m.pixel_values for m in videos])
        extra["video_grid_thw"] = torch.tensor([m.image_size for m in videos])
        extra["video_second_per_grid"] = torch.tensor([2 / (fps or default)] * len(videos))
    return expanded, extra, req


def _hf_grid(frames: np.ndarray) -> list[int]:
    """The grid transformers' Qwen2-VL video processor gives `frames` (this test's settings):
    its smart_resize of each frame, the frame count rounded up to pairs."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    count, height, width = frames.shape[:3]
    size = _VIDEO_CONFIG["size"]
    h, w = smart_resize(height, width, 8, size["shortest_edge"], size["longest_edge"])
    return [-(-count // 2), h // 4, w // 4]


@pytest.mark.parametrize("version", ["2.5", "3"])
def test_videos_match_hf(omni_dirs, version):
    path = omni_dirs(version)
    model = _hf_model(path, version)
    video, image = _marks(version)
    default = 2.0 if version == "2.5" else 1.0
    fps = 3.0 if version == "2.5" else 0.5  # steps of 16.7 (floored) and 100 positions
    cases = [  # (the metadata's rate is not read, as transformers' Omni processors)
        ({"video": (_frames(1, 4), {"fps": 30.0})}, video + "What happens?", None),
        (
            {"image": noise_image(9, (48, 40)), "video": _frames(2, 5, (24, 32))},
            f"{image} then {video} and now?",
            fps,
        ),
        (None, "Say something about the sea.", None),
    ]
    llm = engine(path)
    prompts = [
        {"prompt": _chat(version, t), "multi_modal_data": mm} if mm else _chat(version, t)
        for mm, t, _ in cases
    ]
    prompts[1]["mm_processor_kwargs"] = {"fps": fps}
    outs = llm.generate(prompts, greedy(5, 6), use_tqdm=False)
    for (mm, _, rate), prompt, out in zip(cases, prompts, outs, strict=True):
        if mm is None:
            ids = llm.get_tokenizer().encode(prompt, add_special_tokens=False)
            assert out.prompt_token_ids == ids
            assert_matches(f"omni{version}", out, hf_greedy(model, ids, 6, 5))
            continue
        ids, extra, req = _hf_inputs(llm, model, prompt, rate, default)
        frames = mm["video"][0] if isinstance(mm["video"], tuple) else mm["video"]
        assert extra["video_grid_thw"][0].tolist() == _hf_grid(frames)
        assert out.prompt_token_ids == ids
        assert_matches(f"omni{version} video", out, hf_greedy(model, ids, 6, 5, **extra))
        want, delta = model.get_rope_index(
            torch.tensor([ids]),
            extra.get("image_grid_thw"),
            extra["video_grid_thw"],
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            second_per_grids=extra["video_second_per_grid"],
        )
        np.testing.assert_array_equal(req.mrope.table, want[:, 0].numpy())
        assert req.mrope.delta == int(delta)
    # 5 frames -> 3 groups, the last at floor(2 * 2 / fps * 25) (33 or 200), past h and w:
    # the eos after them one further
    req = _hf_inputs(llm, model, prompts[1], fps, default)[2]
    (run,) = [m for m in req.mm_inputs if m.image_size[0] > 1]
    start, last = req.mrope.table[1, run.offset], int(2 * 2 / fps * 25)
    assert run.image_size[0] == 3 and req.mrope.table[0, run.end - 1] - start == last
    assert req.mrope.table[0, run.end] - start == last + 1 > max(run.image_size[1:]) // 2
    llm.llm_engine.shutdown()


@pytest.mark.parametrize("version", ["2.5", "3"])
def test_engine_paths(omni_dirs, version):
    """Chunks of 8 tokens through a video (Qwen3-Omni: its deepstack rows chunk by chunk) and a
    prefix-cache hit give the plain run's tokens; fps and use_audio_in_video are refused by
    name when bad, and the engine serves on."""
    path = omni_dirs(version)
    video, image = _marks(version)
    prompts = [
        {
            "prompt": _chat(version, f"{video}Describe the video in detail, please."),
            "multi_modal_data": {"video": (_frames(s, 6), {"fps": 4.0})},
        }
        for s in (3, 4)
    ] + [
        {
            "prompt": _chat(version, f"{image} then {video} and now?"),
            "multi_modal_data": {"image": noise_image(5, (40, 24)), "video": _frames(6, 3)},
        }
    ]
    params = greedy(0, 12)
    plain, cached, run = check_chunks_and_prefix_hits(
        path, prompts, params, 8, lambda proc: proc.videos.video_token_id
    )

    refused = [
        ({"use_audio_in_video": True}, r"mm_processor_kwargs\['use_audio_in_video'\]"),
        ({"fps": 0}, r"mm_processor_kwargs\['fps'\] must be a number > 0"),
    ]
    if version == "3":  # 2 / 3 * 25: a fractional step
        refused.append(({"fps": 3.0}, r"mm_processor_kwargs\['fps'\]=3: Qwen3-Omni"))
    for kw, says in refused:
        with pytest.raises(ValueError, match=says):
            cached.generate(prompts[0] | {"mm_processor_kwargs": kw}, params, use_tqdm=False)
    with pytest.raises(ValueError, match="uint8 frames"):
        bad = {"video": _frames(1, 4).astype(np.float32)}
        cached.generate(prompts[0] | {"multi_modal_data": bad}, params, use_tqdm=False)
    # use_audio_in_video=False is HF's default: taken
    (same,) = run(cached, [prompts[0] | {"mm_processor_kwargs": {"use_audio_in_video": False}}])
    assert same.token_ids == plain[0].token_ids


def test_tensor_parallel(omni_dirs):
    """TP=2 (gloo) on Qwen3-Omni: the one-process tokens and logprobs, chunks through a video."""
    video, image = _marks("3")
    prompts = [
        {
            "prompt": _chat("3", f"{image} then {video} and now?"),
            "multi_modal_data": {"image": noise_image(7, (24, 40)), "video": _frames(8, 4)},
        }
    ]
    check_tensor_parallel(omni_dirs("3"), prompts, chunk=16)
