"""Videos through Qwen2-VL / Qwen2.5-VL checkpoints against HF transformers on the same weights.

`multi_modal_data={"video": frames}` (uint8 [T, H, W, 3], a list of frames, or (frames,
{"fps": ...})): HF `generate` with the same patch rows, grid and (Qwen2.5-VL) seconds per frame
group gives the same greedy tokens and top-5 logprobs, also beside an image in one prompt; the
M-RoPE table equals HF's get_rope_index; the preprocessing matches HF's image processor on a
still video (transformers' own video processor needs torchvision); the encoder and prefix
caches key a video by its pixels; bad input is a ValueError naming the parameter."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hf_reference import assert_matches, hf_greedy

from paged_engine import LLM, SamplingParams
from paged_engine.testing import write_tiny_qwen2_vl

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def _chat(body: str) -> str:
    return f"<|im_start|>user\n{body}<|im_end|>\n<|im_start|>assistant\n"


def _frames(seed: int, count: int = 5, size: tuple[int, int] = (40, 56)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, *size, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    cache = {}

    def make(version: str):
        if version not in cache:
            path = tmp_path_factory.mktemp(f"qwen{version}")
            cache[version] = write_tiny_qwen2_vl(path, version=version, seed=2)
        return cache[version]

    return make


def _llm(path, **kw) -> LLM:
    return LLM(model=str(path), dtype="float32", max_model_len=512, block_size=16, **kw)


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)


class _HF:
    def __init__(self, path, version: str) -> None:
        name = {"2": "Qwen2VL", "2.5": "Qwen2_5_VL"}[version]
        cls = getattr(transformers, f"{name}ForConditionalGeneration")
        self.model = cls.from_pretrained(path, dtype=torch.float32).eval()
        self.model.generation_config.eos_token_id = None
        self.images = transformers.AutoImageProcessor.from_pretrained(path)
        self.version = version

    def inputs(self, out, items, fps: list[float] | None = None) -> dict:
        """HF's arguments for a prompt the engine expanded (`out`), its images and videos
        (`fps`: each video's frame rate, as transformers' processor takes it; 24 unknown)."""
        cfg = self.model.config
        ids = out.prompt_token_ids
        kinds = [1 if t == cfg.image_token_id else 2 if t == cfg.video_token_id else 0 for t in ids]
        extra = {"mm_token_type_ids": torch.tensor([kinds])}
        videos = [m for m in items if m.t_step != 1.0 or m.image_size[0] > 1]
        images = [m for m in items if m not in videos]
        if images:
            extra["pixel_values"] = torch.cat([m.pixel_values for m in images])
            extra["image_grid_thw"] = torch.tensor([m.image_size for m in images])
        if videos:
            extra["pixel_values_videos"] = torch.cat([m.pixel_values for m in videos])
            extra["video_grid_thw"] = torch.tensor([m.image_size for m in videos])
            if self.version == "2.5":
                rates = fps or [24.0] * len(videos)
                extra["second_per_grid_ts"] = torch.tensor([2 / r for r in rates])
        return extra


def _items(llm: LLM, prompt: dict) -> tuple:
    """The engine's own processing of a prompt's images and videos."""
    req = llm.llm_engine.input_processor.make_request("probe", prompt, SamplingParams(), None)
    return req.request.mm_inputs


@pytest.mark.parametrize("version", ["2", "2.5"])
def test_videos_match_hf(qwen, version):
    path = qwen(version)
    hf = _HF(path, version)
    llm = _llm(path)
    still = Image.fromarray(_frames(9, 1, (48, 40))[0])
    prompts = [
        {"prompt": _chat(VIDEO + "What happens?"), "multi_modal_data": {"video": _frames(1)}},
        {  # 3 fps: Qwen2.5-VL's temporal positions step by 2 * 2 / 3
            "prompt": _chat(f"{IMAGE} then {VIDEO} and what now?"),
            "multi_modal_data": {"image": still, "video": (_frames(2, 4, (33, 61)), {"fps": 3.0})},
        },
        _chat("No video here."),
    ]
    outs = llm.generate(prompts, _greedy(), use_tqdm=False)
    for prompt, out, fps in zip(prompts, outs, [None, [3.0], None]):
        items = _items(llm, prompt) if isinstance(prompt, dict) else ()
        extra = hf.inputs(out, items, fps) if items else {}
        ref = hf_greedy(hf.model, out.prompt_token_ids, 6, 5, **extra)
        assert_matches(f"qwen{version}-vl video", out, ref)
    assert outs[0].prompt_token_ids.count(hf.model.config.video_token_id) == 3 * 5 * 7
    llm.llm_engine.shutdown()


def test_mrope_table_equals_hf_rope_index(qwen):
    path = qwen("2.5")
    hf = _HF(path, "2.5")
    llm = _llm(path)
    prompt = {
        "prompt": _chat(f"{VIDEO} and {IMAGE} and {VIDEO} then {VIDEO} end"),
        "multi_modal_data": {
            "video": [
                (_frames(3, 6), {"fps": 3.0}),
                _frames(4, 3, (24, 80)),
                # many small frames, slow: temporal positions run past the grid's h and w
                (_frames(6, 24, (16, 16)), {"fps": 1.0}),
            ],
            "image": Image.fromarray(_frames(5, 1)[0]),
        },
    }
    req = llm.llm_engine.input_processor.make_request("r", prompt, SamplingParams(), None).request
    ids = list(req.prompt_token_ids)

    class _Out:
        prompt_token_ids = ids

    extra = hf.inputs(_Out, req.mm_inputs, [3.0, 24.0, 1.0])
    want, delta = hf.model.model.get_rope_index(
        torch.tensor([ids]),
        extra["mm_token_type_ids"],
        extra["image_grid_thw"],
        extra["video_grid_thw"],
        extra["second_per_grid_ts"],
    )
    assert np.array_equal(req.mrope.table, want[:, 0].numpy())
    assert req.mrope.delta == int(delta)
    tps = hf.model.config.vision_config.tokens_per_second
    steps = [m.t_step for m in req.mm_inputs if m.image_size[0] > 1]
    want_steps = [tps * 2 / 3.0, tps * 2 / 24, tps * 2 / 1.0]  # 24: no fps
    assert steps == [pytest.approx(x) for x in want_steps]
    llm.llm_engine.shutdown()


def test_preprocessing_matches_hf_on_a_still_video(qwen):
    """Two copies of one frame are what HF's image processor makes of that image (it repeats
    an image to the temporal patch): the same grid, and pixels within the two resizers'
    difference (PIL against torch's antialiased bicubic)."""
    path = qwen("2")
    llm = _llm(path)
    frame = _frames(6, 1, (44, 60))[0]
    videos = llm.llm_engine.input_processor.videos
    _, (video,), _ = videos.process([videos.video_token_id], [np.stack([frame, frame])])
    hf = transformers.AutoImageProcessor.from_pretrained(path)(
        images=[Image.fromarray(frame)], return_tensors="pt"
    )
    assert tuple(video.image_size) == tuple(hf["image_grid_thw"][0].tolist())
    diff = (video.pixel_values - hf["pixel_values"]).abs()
    assert video.pixel_values.shape == hf["pixel_values"].shape
    assert float(diff.mean()) < 0.05 and float(diff.max()) < 0.6  # (a layout error: ~1)
    # the forms a video comes in give the same rows; an odd frame count pads with the last
    as_list = videos.process([videos.video_token_id], [[Image.fromarray(f) for f in _frames(7)]])
    as_tensor = videos.process([videos.video_token_id], [torch.from_numpy(_frames(7))])
    assert torch.equal(as_list[1][0].pixel_values, as_tensor[1][0].pixel_values)
    assert as_tensor[1][0].image_size[0] == 3  # 5 frames -> 3 groups of 2
    llm.llm_engine.shutdown()


def test_caches_key_a_video_by_its_pixels(qwen):
    path = qwen("2")
    llm = _llm(path, enable_prefix_caching=True)
    text = _chat(VIDEO + "Describe the video in detail, please.")
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def run(frames):
        return llm.generate({"prompt": text, "multi_modal_data": {"video": frames}}, sp)[0]

    first = run(_frames(1))
    again = run(_frames(1))
    other = run(_frames(2))
    n = len(first.prompt_token_ids)
    assert again.num_cached_tokens == n // 16 * 16 - (16 if n % 16 == 0 else 0)
    assert other.num_cached_tokens < 16  # only the text before the video
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    llm.llm_engine.shutdown()


def test_bad_videos_name_the_parameter(qwen):
    path = qwen("2")
    llm = _llm(path, limit_mm_per_prompt={"image": 1, "video": 1})
    text = _chat(VIDEO + "Go.")
    cases = [
        (_frames(1).astype(np.float32), "uint8 frames"),
        (_frames(1)[0], "uint8 frames"),
        ([], "empty"),
        ([_frames(1), _frames(2)], "limit_mm_per_prompt"),
        ((_frames(1), "fast"), "metadata must be a dict"),
        ([np.zeros((8, 8, 3), np.uint8), np.zeros((9, 8, 3), np.uint8)], "frames differ"),
    ]
    for video, says in cases:
        with pytest.raises(ValueError, match=says):
            llm.generate({"prompt": text, "multi_modal_data": {"video": video}}, use_tqdm=False)
    with pytest.raises(ValueError, match="placeholder"):
        llm.generate({"prompt": "no video token", "multi_modal_data": {"video": _frames(1)}})
    with pytest.raises(ValueError, match=r"mm_processor_kwargs\['speed'\]"):
        llm.generate(
            {
                "prompt": text,
                "multi_modal_data": {"video": _frames(1)},
                "mm_processor_kwargs": {"speed": 2},
            }
        )
    ok = llm.generate({"prompt": text, "multi_modal_data": {"video": _frames(1)}}, use_tqdm=False)
    assert ok[0].outputs[0].token_ids
    llm.llm_engine.shutdown()
    none = _llm(qwen("2"), limit_mm_per_prompt={"video": 0})
    with pytest.raises(ValueError, match="takes no videos"):
        none.generate({"prompt": text, "multi_modal_data": {"video": _frames(1)}})
    none.llm_engine.shutdown()


def test_videos_processed_ahead_are_checked_and_taken(qwen):
    """A server processes a prompt's media on its request thread (InputProcessor.multimodal)
    and hands the engine the items, split by kind: the same outputs as the raw media; items
    that do not fit the prompt or the tower are refused."""
    import dataclasses

    llm = _llm(qwen("2.5"))
    proc = llm.llm_engine.input_processor
    still = Image.fromarray(_frames(9, 1, (48, 40))[0])
    ids = llm.get_tokenizer().encode(_chat(f"{VIDEO} and {IMAGE} then {VIDEO}"))
    raw = {"video": [(_frames(1), {"fps": 3.0}), _frames(2, 3)], "image": still}
    expanded, items = proc.multimodal(ids, raw)
    vid = proc.videos.video_token_id
    videos = [m for m in items if expanded[m.offset] == vid]
    images = [m for m in items if expanded[m.offset] != vid]
    sp = _greedy()
    (want,) = llm.generate({"prompt_token_ids": ids, "multi_modal_data": raw}, sp, use_tqdm=False)
    ahead = {"prompt_token_ids": expanded, "multi_modal_data": {"video": videos, "image": images}}
    (got,) = llm.generate(ahead, sp, use_tqdm=False)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.prompt_token_ids == want.prompt_token_ids
    assert [m.t_step for m in _items(llm, ahead)] == [m.t_step for m in items]
    bad = [
        [videos[1], videos[0]],  # in the wrong runs
        [dataclasses.replace(videos[0], image_size=(1, 2, 2)), videos[1]],
        [dataclasses.replace(videos[0], t_step=0.0), videos[1]],
        [videos[0]],
    ]
    for vids in bad:
        with pytest.raises(ValueError, match=r"multi_modal_data\['video'\]"):
            mm = {"video": vids, "image": images}
            llm.generate({"prompt_token_ids": expanded, "multi_modal_data": mm}, use_tqdm=False)
    llm.llm_engine.shutdown()


def test_llm_chat_reads_video_url_parts(qwen):
    """LLM.chat's video_url parts (data: URLs) are decoded and sampled as the server does."""
    pytest.importorskip("av")
    import base64

    from paged_engine.multimodal.video_io import decode_video
    from paged_engine.testing import encode_video

    data = encode_video(_frames(4, 40, (16, 24)), fps=10)
    llm = _llm(qwen("2"))
    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    content = [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "Go"}]
    (got,) = llm.chat([{"role": "user", "content": content}], _greedy(), use_tqdm=False)
    frames, meta = decode_video(data)  # 32 of its 40 frames
    assert len(meta["frames_indices"]) == 32
    prompt = {"prompt": _chat(VIDEO + "Go"), "multi_modal_data": {"video": (frames, meta)}}
    (want,) = llm.generate(prompt, _greedy(), use_tqdm=False)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.prompt_token_ids == want.prompt_token_ids
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\]\.video_url"):
        bad = [{"type": "video_url", "video_url": {"url": "file:///a.mp4"}}]
        llm.chat([{"role": "user", "content": bad}], _greedy())
    llm.llm_engine.shutdown()


@pytest.mark.parametrize("version", ["3", "3.5"])
def test_qwen3_vl_videos_match_hf(qwen, version):
    """Qwen3-VL and Qwen3.5: frames sampled at 2 fps, each pair of frames a group after its
    timestamp text; HF generate on the same patch rows and prompt gives the same greedy tokens
    and top-5 logprobs (a video beside an image), and its M-RoPE table."""
    path = qwen(version)
    name = {"3": "Qwen3VLForConditionalGeneration", "3.5": "Qwen3_5ForConditionalGeneration"}
    model = getattr(transformers, name[version]).from_pretrained(path, dtype=torch.float32)
    model = model.eval()
    model.generation_config.eos_token_id = None
    llm = _llm(path)
    still = Image.fromarray(_frames(9, 1, (48, 40))[0])
    # 20 frames at 10 fps (2 s): 4 sampled (indices 0, 6, 13, 19), 2 groups
    video = (_frames(1, 20, (40, 56)), {"fps": 10.0})
    prompt = {
        "prompt": _chat(f"{IMAGE} then {VIDEO} what now?"),
        "multi_modal_data": {"image": still, "video": video},
    }
    (out,) = llm.generate(prompt, _greedy(), use_tqdm=False)
    items = _items(llm, prompt)
    cfg = model.config
    ids = out.prompt_token_ids
    text = llm.get_tokenizer().decode(ids)
    assert "<0.3 seconds><|vision_start|><|video_pad|>" in text, text  # (0 + 6) / 2 / 10
    assert "<1.6 seconds><|vision_start|><|video_pad|>" in text, text  # (13 + 19) / 2 / 10
    videos = [m for m in items if ids[m.offset] == cfg.video_token_id]
    images = [m for m in items if ids[m.offset] == cfg.image_token_id]
    assert len(videos) == 2 and len(images) == 1
    kinds = [1 if t == cfg.image_token_id else 2 if t == cfg.video_token_id else 0 for t in ids]
    (_, h, w) = videos[0].image_size
    extra = {
        "mm_token_type_ids": torch.tensor([kinds]),
        "pixel_values": images[0].pixel_values,
        "image_grid_thw": torch.tensor([images[0].image_size]),
        "pixel_values_videos": torch.cat([m.pixel_values for m in videos]),
        "video_grid_thw": torch.tensor([[len(videos), h, w]]),
    }
    ref = hf_greedy(model, ids, 6, 5, **extra)
    assert_matches("qwen3-vl video", out, ref)
    want, delta = model.model.get_rope_index(
        torch.tensor([ids]),
        extra["mm_token_type_ids"],
        extra["image_grid_thw"],
        extra["video_grid_thw"],
    )
    req = llm.llm_engine.input_processor.make_request("r", prompt, SamplingParams(), None).request
    assert np.array_equal(req.mrope.table, want[:, 0].numpy())
    assert req.mrope.delta == int(delta)
    llm.llm_engine.shutdown()


def _hf_function(module: str, name: str, cls: str | None = None):
    """A function (or `cls`'s method) of a transformers module, compiled from its source:
    transformers' Qwen3-VL video module needs torchvision to import, its resize and sampling
    rules do not."""
    import ast
    import importlib.util
    import math
    import types
    from pathlib import Path

    path = importlib.util.find_spec("transformers").submodule_search_locations[0]
    source = Path(path, "models", *module.split(".")).with_suffix(".py").read_text()
    tree = ast.parse(source)
    scope = tree.body
    if cls is not None:
        scope = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    node = next(n for n in scope if isinstance(n, ast.FunctionDef) and n.name == name)
    node.decorator_list = []
    code = compile(ast.Module(body=[node], type_ignores=[]), f"<{name}>", "exec")
    namespace = {"math": math, "np": np, "logger": types.SimpleNamespace(warning_once=print)}
    exec(code, namespace)
    return namespace[name]


def test_qwen3_vl_sampling_resize_and_timestamps_follow_transformers():
    """The frame sampling, the resize rule and the timestamps are transformers' Qwen3-VL ones."""
    from types import SimpleNamespace

    from paged_engine.multimodal.qwen3_video import sample_indices, smart_resize, timestamps

    hf_resize = _hf_function("qwen3_vl.video_processing_qwen3_vl", "smart_resize")
    hf_sample = _hf_function(
        "qwen3_vl.video_processing_qwen3_vl", "sample_frames", "Qwen3VLVideoProcessor"
    )
    hf_times = _hf_function(
        "qwen3_vl.processing_qwen3_vl", "_calculate_timestamps", "Qwen3VLProcessor"
    )
    for t, h, w in [(4, 40, 56), (32, 480, 640), (6, 20, 900), (2, 1080, 1920), (64, 96, 96)]:
        for lo, hi in [(4096, 16 * 64 * 64), (128 * 32 * 32, 32 * 32 * 768 * 32)]:
            want = hf_resize(t, h, w, 2, 32, lo, hi)
            assert smart_resize(t, h, w, 32, 2, lo, hi) == want, (t, h, w, lo, hi)
    fake = SimpleNamespace(fps=2, min_frames=4, max_frames=768)
    for total, fps in [(20, 10.0), (300, 30.0), (7, 24.0), (3, 1.0)]:
        meta = SimpleNamespace(total_num_frames=total, fps=fps)
        want = hf_sample(fake, meta).tolist()
        assert sample_indices(total, fps, 2.0, 4, 768) == want
        assert timestamps(want, fps, 2) == pytest.approx(hf_times(None, list(want), fps, 2))


def test_the_video_settings_come_from_the_checkpoint(tmp_path):
    """video_preprocessor_config.json, else transformers 5's processor_config.json, else the
    image processor's patches with HF's video bounds."""
    import json

    from paged_engine.multimodal.qwen_video import _settings

    image = {"patch_size": 14, "merge_size": 2, "temporal_patch_size": 2, "image_mean": [0.5] * 3}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(image))
    got = _settings(tmp_path)
    assert got["size"] == {"shortest_edge": 128 * 28 * 28, "longest_edge": 768 * 28 * 28}
    assert got["image_mean"] == [0.5] * 3
    video = {**image, "size": {"shortest_edge": 3136, "longest_edge": 9408}}
    (tmp_path / "processor_config.json").write_text(json.dumps({"video_processor": video}))
    assert _settings(tmp_path)["size"] == video["size"]
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps({**image, "max_pixels": 5}))
    assert _settings(tmp_path)["size"]["longest_edge"] == 5


def test_a_saved_video_setting_other_than_the_towers_is_refused(tmp_path):
    """The video processor's own patch settings must be the tower's (ValueError naming the
    setting); the image processor's are not read for them (the tower's value is used)."""
    import json

    from paged_engine.multimodal.qwen_video import tower_checked_settings

    defaults = {"patch_size": 14, "fps": 2.0}
    tower = {"patch_size": 14}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"patch_size": 16, "fps": 9}))
    assert tower_checked_settings(tmp_path, defaults, tower) == {"patch_size": 14, "fps": 2.0}
    own = tmp_path / "video_preprocessor_config.json"
    own.write_text(json.dumps({"patch_size": 14, "fps": 1.0}))
    assert tower_checked_settings(tmp_path, defaults, tower) == {"patch_size": 14, "fps": 1.0}
    own.write_text(json.dumps({"patch_size": 16}))
    with pytest.raises(ValueError, match="patch_size=16 is not the tower's 14"):
        tower_checked_settings(tmp_path, defaults, tower)
