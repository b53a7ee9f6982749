"""Videos through Gemma 4 checkpoints (multimodal/gemma4_video.py) against HF transformers.

The tiny random Gemma4ForConditionalGeneration of test_gemma4_images.py (sliding window 8,
shorter than a frame's run; use_bidirectional_attention="vision") with a video processor config
(2-pixel patches pooled 3 x 3, 70 soft tokens a frame, num_frames 4) and a chat template with
video parts. transformers' Gemma4VideoProcessor imports torchvision only for its resize: here
its module source runs with that call (tvF.resize, bicubic with antialias) as
F.interpolate on the uint8 frames (what torchvision runs on the CPU) and its normalize as a
plain (x - mean) / std, so its frame sampling, aspect-kept sizes, patch order and padding, and
Gemma4Processor's prompt (per frame "mm:ss " and a run between <|image> and <image|>), its
mm_token_type_ids (each frame's run a two-way group) and the model's get_video_features are
transformers' own. Against them: the engine's prompt ids, its frames' patch rows (equal to
HF's unpadded rows), HF `generate`'s greedy tokens and top-5 logprobs (1e-3, float32) on a
video HF samples, a loader-sampled video beside an image (timestamps past a minute), a short
video without metadata and text alone. Then chunked prefill through the frames, prefix-cache
hits, frames processed ahead, TP=2, LLM.chat with a video_url data: URL, and bad videos.
"""

from __future__ import annotations

import base64
import dataclasses
import importlib.util
import json
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hf_reference import (
    assert_matches,
    assert_same_greedy,
    exec_transformers_module,
    hf_greedy,
)
from image_checks import (
    check_chunks_and_prefix_hits,
    check_tensor_parallel,
    engine,
    greedy,
    noise_image,
)

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.gemma4")
pytest.importorskip("PIL.Image")
if not hasattr(transformers, "Gemma4ImageProcessorPil") or not importlib.util.find_spec(
    "transformers.models.gemma4.video_processing_gemma4"
):  # (its module is read, not imported: it needs torchvision)
    pytest.skip("transformers lacks Gemma 4's image or video processor", allow_module_level=True)
from test_gemma4_images import (  # noqa: E402
    CHAT_TEMPLATE,
    SOFT_TOKENS,
    _pixels,
    write_tiny_gemma4_vlm,
)

from paged_engine import SamplingParams  # noqa: E402
from paged_engine.layers.rotary import RotaryEmbedding  # noqa: E402

VIDEO_CONFIG = {
    "video_processor_type": "Gemma4VideoProcessor",
    "patch_size": 2,
    "pooling_kernel_size": 3,
    "max_soft_tokens": SOFT_TOKENS,
    "num_frames": 4,
}
TEMPLATE = CHAT_TEMPLATE.replace(
    "{% if part['type'] == 'image' %}<|image|>",
    "{% if part['type'] == 'image' %}<|image|>{% elif part['type'] == 'video' %}<|video|>",
)
TEXT = "<|bos|><|turn>user\nSay something about the sea.<turn|>\n<|turn>model\n"


def _chat(body: str) -> str:
    return f"<|bos|><|turn>user\n{body}<turn|>\n<|turn>model\n"


def _frames(seed: int, count: int, size: tuple[int, int] = (16, 24)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, *size, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    path = write_tiny_gemma4_vlm(tmp_path_factory.mktemp("gemma4v"), seed=3)
    (path / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_CONFIG))
    (path / "chat_template.jinja").write_text(TEMPLATE)
    return path


def _hf_video_processor():
    """transformers' Gemma4VideoProcessor, its torchvision calls swapped (see the module)."""

    def resize(video, size, interpolation=None, antialias=True):
        return F.interpolate(
            video, size=list(size), mode="bicubic", align_corners=False, antialias=antialias
        )

    namespace = exec_transformers_module(
        "gemma4",
        "video_processing_gemma4.py",
        types.SimpleNamespace(InterpolationMode=int, resize=resize),
    )
    config = {k: v for k, v in VIDEO_CONFIG.items() if k != "video_processor_type"}
    video = namespace["Gemma4VideoProcessor"](**config)
    video.normalize = _normalize
    return video


def _normalize(image, mean, std, **kw):
    return (image - torch.as_tensor(mean).view(-1, 1, 1)) / torch.as_tensor(std).view(-1, 1, 1)


def _processor(path: Path):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(transformers.ProcessorMixin, "check_argument_for_proper_class", _any)
        return transformers.Gemma4Processor(
            feature_extractor=transformers.Gemma4AudioFeatureExtractor(),
            image_processor=transformers.AutoImageProcessor.from_pretrained(path),
            tokenizer=transformers.AutoTokenizer.from_pretrained(path),
            video_processor=_hf_video_processor(),
            image_seq_length=SOFT_TOKENS,
        )


def _any(self, name: str, value: object) -> None:
    return None


def _hf_inputs(path, processor, text: str, images: list, video, meta, sample: bool):
    """HF's prompt ids and model arguments (the image's pixels the engine's, as
    test_gemma4_images.py feeds them; the video's HF's own)."""
    if video is None:
        return processor.tokenizer.encode(text, add_special_tokens=False), {}
    kw = {"do_convert_rgb": False, "do_sample_frames": sample}
    if meta is not None:
        kw["video_metadata"] = [meta]
    out = processor(
        text=[text], images=[images] if images else None, videos=[video], videos_kwargs=kw,
        return_tensors="pt",
    )  # fmt: skip
    keys = ("pixel_values_videos", "video_position_ids", "num_frames_per_video")
    extra = {k: out[k] for k in ("mm_token_type_ids", *keys)}
    if images:
        extra |= {"image_position_ids": out["image_position_ids"]}
        extra |= _pixels(path, images, out)
    return out["input_ids"][0].tolist(), extra


def _request(llm, prompt):
    return llm.llm_engine.input_processor.make_request("probe", prompt, SamplingParams(), None)


def test_videos_match_hf(path):
    """A video HF samples (10 frames at 2 fps -> frames 0, 2, 5, 7), a loader's 5 frames (more
    than num_frames, kept: 00:00, 00:30, 01:15, 01:40, 02:30 at 1 fps) after an image, 3 frames
    without metadata (fewer than num_frames: kept, fps 24) and text: HF's prompt ids, frame
    rows, tokens, logprobs."""
    model = transformers.Gemma4ForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    model.eval().generation_config.eos_token_id = None
    processor = _processor(path)
    sampled, loaded, raw = _frames(1, 10), _frames(2, 5, (30, 14)), _frames(3, 3, (20, 20))
    still = noise_image(9, (40, 26))
    whole = {"fps": 2.0, "total_num_frames": 10}
    kept = {"fps": 1.0, "frames_indices": [0, 30, 75, 100, 150], "total_num_frames": 151}
    cases = [  # (text, multi_modal_data, HF's (images, video, metadata, sample))
        (_chat("<|video|>What happens?"), {"video": (sampled, whole)}, ([], sampled, whole, True)),
        (
            _chat("<|image|> then <|video|> and now?"),
            {"image": still, "video": (loaded, kept)},
            ([still], loaded, kept, False),
        ),
        (_chat("<|video|>And?"), {"video": raw}, ([], raw, None, False)),
        (TEXT, None, ([], None, None, False)),
    ]
    llm = engine(path)
    prompts = [{"prompt": t, "multi_modal_data": mm} if mm else t for t, mm, _ in cases]
    outs = llm.generate(prompts, greedy(5, 6), use_tqdm=False)
    for (text, mm, hf_media), prompt, out in zip(cases, prompts, outs, strict=True):
        ids, extra = _hf_inputs(path, processor, text, *hf_media)
        assert out.prompt_token_ids == ids
        assert_matches("gemma4 video", out, hf_greedy(model, ids, 6, 5, **extra))
        if mm is None:
            continue
        items = _request(llm, prompt).request.mm_inputs
        frames = [m for m in items if extra["mm_token_type_ids"][0, m.offset] == 2]
        assert len(frames) == int(extra["num_frames_per_video"][0])
        for m, rows, where in zip(
            frames, extra["pixel_values_videos"], extra["video_position_ids"], strict=True
        ):
            real = int((where >= 0).all(-1).sum())
            assert m.image_size == tuple(int(v) + 1 for v in where[:real].amax(0).flip(0))
            assert torch.equal(m.pixel_values, rows[:real])
            assert m.bidirectional
    # plain positions (no M-RoPE table): every rope's table holds max_model_len rows
    rows = llm.apply_model(
        lambda m: sorted({r.cos.shape[0] for r in m.modules() if isinstance(r, RotaryEmbedding)})
    )[0]
    assert rows == [llm.llm_engine.config.max_model_len]
    tokenizer = llm.get_tokenizer()
    assert "What happens?" in tokenizer.decode(outs[0].prompt_token_ids)
    assert "<image|> 01:15 <|image>" in tokenizer.decode(outs[1].prompt_token_ids)
    assert tokenizer.decode(outs[2].prompt_token_ids).count("00:00 <|image>") == 3
    llm.llm_engine.shutdown()


def test_sampling_and_stamps_follow_transformers(path):
    """Frame sampling (num_frames, fps with num_frames null, too few frames) is
    transformers' default_sample_indices_fn, and a video's prompt text its
    Gemma4Processor.replace_video_token (minutes, truncated seconds)."""
    from transformers.video_utils import VideoMetadata, default_sample_indices_fn

    from paged_engine.multimodal.gemma4_video import sample_indices, stamp

    for total, n, fps, rate in [(10, 4, None, 2.0), (33, 32, None, 30.0), (7, 7, None, 1.0)]:
        meta = VideoMetadata(total_num_frames=total, fps=rate)
        want = default_sample_indices_fn(meta, num_frames=n, fps=fps).tolist()
        assert sample_indices(total, n, fps, rate) == want
    for total, fps, rate in [(100, 2.0, 30.0), (9, 1.0, 24.0), (300, 0.5, 25.0)]:
        meta = VideoMetadata(total_num_frames=total, fps=rate)
        want = default_sample_indices_fn(meta, num_frames=None, fps=fps).tolist()
        assert sample_indices(total, None, fps, rate) == want
    assert sample_indices(3, 4, None, 2.0) is None  # transformers refuses: too few frames
    processor = _processor(path)
    indices = [0, 59, 60, 61, 1439, 3599, 3600, 3661, 7000]
    for fps in (1.0, 24.0, 29.97):
        meta = VideoMetadata(fps=fps, frames_indices=indices, total_num_frames=8000)
        want = processor.replace_video_token(
            {"num_soft_tokens_per_video": [1], "video_metadata": [meta]}, 0
        )
        got = " ".join(f"{stamp(i / fps)} <|image><|video|><image|>" for i in indices)
        assert got == want, fps


def test_engine_paths_and_bad_input(path):
    """Chunks of 80 tokens (a frame's run is up to 70, two-way: chunks move to its edges) and
    a prefix-cache hit give the plain run's tokens (another video hits only the text before
    it); frames processed ahead are taken, moved or cut ones refused; bad videos are
    ValueErrors naming the parameter, and the engine serves on."""
    prompts = [
        {
            "prompt": _chat("<|video|>Describe the video in detail, please."),
            "multi_modal_data": {"video": (_frames(s, 8), {"fps": 4.0})},
        }
        for s in (3, 4)
    ] + [
        {
            "prompt": _chat("<|image|> then <|video|> and now?"),
            "multi_modal_data": {"image": noise_image(5, (40, 24)), "video": _frames(6, 2)},
        }
    ]
    params = greedy(0, 10)
    plain, cached, run = check_chunks_and_prefix_hits(
        path, prompts, params, 80, lambda proc: proc.videos.start_id
    )

    proc = cached.llm_engine.input_processor
    tokenizer = cached.get_tokenizer()
    for want, prompt in ((plain[0], prompts[0]), (plain[2], prompts[2])):
        ids = tokenizer.encode(prompt["prompt"])
        expanded, items = proc.multimodal(ids, prompt["multi_modal_data"])
        images = [m for m in items if expanded[m.offset] == proc.images.image_token_id]
        frames = [m for m in items if m not in images]
        mm = {"video": frames} | ({"image": images} if images else {})
        ahead = {"prompt_token_ids": expanded, "multi_modal_data": mm}
        assert_same_greedy([want], run(cached, [ahead]))
    ids = tokenizer.encode(prompts[0]["prompt"])
    expanded, items = proc.multimodal(ids, prompts[0]["multi_modal_data"])
    moved = dataclasses.replace(items[0], offset=items[0].offset + 1)
    small = dataclasses.replace(items[0], image_size=(3, 3))
    one_way = dataclasses.replace(items[0], bidirectional=False)
    for bad in (items[1:], [moved, *items[1:]], [small, *items[1:]], [one_way, *items[1:]]):
        with pytest.raises(ValueError, match=r"multi_modal_data\['video'\]"):
            cached.generate({"prompt_token_ids": expanded, "multi_modal_data": {"video": bad}})

    text = _chat("<|video|>Go.")
    cases = [
        (_frames(1, 4).astype(np.float32), "uint8 frames"),
        ((_frames(1, 4), {"fps": 0}), "fps must be a number > 0"),
        ((_frames(1, 4), {"fps": 5.0, "frames_indices": [0, 1]}), "frames_indices has 2"),
        ((_frames(1, 3), {"do_sample_frames": True}), r"\[0\]: 3 frame\(s\), fewer than"),
        (_frames(1, 2, (1, 300)), r"\[0\]: frames of 1 x 300 give a 3 x \d+ patch grid"),
        ([_frames(1, 4), _frames(2, 4)], r"2 video\(s\) but the prompt has 1"),
    ]
    for video, says in cases:
        with pytest.raises(ValueError, match=says):
            cached.generate({"prompt": text, "multi_modal_data": {"video": video}})
    kw_cases = [
        ({"fps": 1.0}, r"mm_processor_kwargs\['fps'\] is not taken by Gemma 4"),
        ({"speed": 2}, r"mm_processor_kwargs\['speed'\]"),
    ]
    for kw, says in kw_cases:
        with pytest.raises(ValueError, match=says):
            mm = {"video": _frames(1, 4)}
            cached.generate({"prompt": text, "multi_modal_data": mm, "mm_processor_kwargs": kw})
    assert len(run(cached, prompts[:1])[0].token_ids) == 10
    # a frame's run attends both ways: a step budget below it is refused by the request
    small_budget = engine(path, max_num_batched_tokens=40, enable_chunked_prefill=True)
    with pytest.raises(ValueError, match=r"video'\]\[0\]: a frame of \d+ tokens.*=40"):
        small_budget.generate(prompts[:1], params, use_tqdm=False)
    assert len(small_budget.generate([TEXT], params, use_tqdm=False)[0].outputs[0].token_ids) == 10


def test_tensor_parallel(path):
    """TP=2 (gloo) gives the one-process tokens and logprobs, chunks through the frames."""
    prompts = [
        {
            "prompt": _chat("<|image|> then <|video|> and now?"),
            "multi_modal_data": {"image": noise_image(7, (24, 40)), "video": _frames(8, 2)},
        }
    ]
    check_tensor_parallel(path, prompts, chunk=80)


def test_video_url_chat(path):
    """LLM.chat's video_url part (a data: URL, decoded as vLLM's loader does: its frames and
    their indices kept) gives the offline tokens of decode_video's frames and metadata."""
    pytest.importorskip("av")
    from paged_engine.multimodal.video_io import decode_video
    from paged_engine.testing import encode_video

    data = encode_video(_frames(4, 3, (16, 24)), fps=2)
    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    llm = engine(path)
    part = {"type": "video_url", "video_url": {"url": url}}
    ask = [{"role": "user", "content": [part, {"type": "text", "text": "Go"}]}]
    (got,) = llm.chat(ask, greedy(0, 6), use_tqdm=False)
    frames, meta = decode_video(data)
    prompt = {"prompt": _chat("<|video|>Go"), "multi_modal_data": {"video": (frames, meta)}}
    (want,) = llm.generate(prompt, greedy(0, 6), use_tqdm=False)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.prompt_token_ids == want.prompt_token_ids
    text = llm.get_tokenizer().decode(want.prompt_token_ids)
    assert "00:00 <|image>" in text and "<image|> 00:01 <|image>" in text, text
    llm.llm_engine.shutdown()
