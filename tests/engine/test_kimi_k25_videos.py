"""Videos through Kimi K2.5 checkpoints (multimodal/kimi_k25_video.py, moonvit.py) against HF.

The tiny random Kimi_K25ForConditionalGeneration of test_kimi_k25_images.py (4-pixel patches,
2 x 2 merge blocks, a 4-frame temporal table) with a video processor config (2 fps, chunks of
4 frames, a 24-patch budget a frame, 12 patches a side) and a chat template with video parts.

What is transformers' own code here: Kimi_K25VideoProcessor's module source runs (its
`import torchvision` line dropped): its frame chunking, NaViT sizes, shape grouping and
patchify (`_preprocess`), with the three torchvision calls of its base class swapped for
torch: resize as F.interpolate (bicubic, antialias, on the uint8 frames, what torchvision
runs on the CPU), pad as F.pad with zeros, normalize as (x - mean) / std on its fused
mean / std; frame sampling is BaseVideoProcessor.sample_frames (default_sample_indices_fn);
the prompt text is Kimi_K25Processor.replace_video_token (its timestamps and chunk structure)
on that output; the model (tower with temporal sinusoid, chunk-wide attention and temporal
pooling, projector, decoder) is HF's forward through `generate`. Our reading: timestamps
tokenized apart from the text, and the sampling switches (frames a loader sampled kept, no
sampling without the video's fps) that gemma4_video.py also follows.

Checked: the engine's prompt ids, its chunks' patch rows (equal to HF's), HF `generate`'s
greedy tokens and top-5 logprobs (1e-3, float32) on a video HF samples (chunks of 4 and 1
frames), a loader-sampled video after an image (timestamps past an hour, with milliseconds),
all frames of a video without metadata, and text alone. Then chunked prefill, prefix-cache
hits, chunks processed ahead, and bad videos refused by name.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import types

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
from image_checks import check_chunks_and_prefix_hits, engine, greedy, noise_image

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.kimi_k25")
if not importlib.util.find_spec("transformers.models.kimi_k25.video_processing_kimi_k25"):
    pytest.skip("transformers lacks Kimi K2.5's video processor", allow_module_level=True)
from test_kimi_k25_images import (  # noqa: E402
    CHAT_TEMPLATE,
    IMAGE,
    TEXT,
    VIDEO,
    _hf_inputs,
    _hf_model,
    write_tiny_kimi_k25,
)

from paged_engine import SamplingParams  # noqa: E402

VIDEO_CONFIG = {
    "video_processor_type": "Kimi_K25VideoProcessor",
    "size": {"max_height": 12, "max_width": 12},
    "max_patches": 24,
    "patch_size": 4,
    "merge_size": 2,
    "temporal_patch_size": 4,
    "fps": 2,
    "image_mean": [0.5, 0.45, 0.4],
    "image_std": [0.25, 0.3, 0.28],
}


TEMPLATE = CHAT_TEMPLATE.replace(
    "{% elif part['type'] == 'text' %}",
    "{% elif part['type'] == 'video' %}" + VIDEO + "{% elif part['type'] == 'text' %}",
)


def _chat(body: str) -> str:
    return f"<|im_start|>user\n{body}<|im_end|>\n<|im_start|>assistant\n"


def _frames(seed: int, count: int, size: tuple[int, int] = (16, 24)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, *size, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    path = write_tiny_kimi_k25(tmp_path_factory.mktemp("kimi-k25-video"), seed=5)
    (path / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_CONFIG))
    (path / "chat_template.jinja").write_text(TEMPLATE)
    return path


def _hf_video_processor():
    """transformers' Kimi_K25VideoProcessor, its torchvision calls swapped (see the module)."""
    namespace = exec_transformers_module(
        "kimi_k25",
        "video_processing_kimi_k25.py",
        types.SimpleNamespace(InterpolationMode=int),
        drop="import torchvision.transforms.v2.functional as tvF\n",
    )

    class Swapped(namespace["Kimi_K25VideoProcessor"]):
        def resize(self, video, size, resample=None, **kw):
            if tuple(video.shape[-2:]) == (size.height, size.width):
                return video  # (torchvision returns the input as it is)
            flat = video.reshape(-1, *video.shape[-3:])
            out = F.interpolate(flat, (size.height, size.width), mode="bicubic", antialias=True)
            return out.reshape(*video.shape[:-2], size.height, size.width)

        def pad(self, videos, pad_size=None, **kw):
            h, w = pad_size.height, pad_size.width
            return [F.pad(v, (0, w - v.shape[-1], 0, h - v.shape[-2])) for v in videos]

        def normalize(self, image, mean, std, **kw):
            return (image - mean.view(-1, 1, 1)) / std.view(-1, 1, 1)

    config = {k: v for k, v in VIDEO_CONFIG.items() if k != "video_processor_type"}
    return Swapped(**config)


def _hf_video(processor, frames: np.ndarray, meta, sample: bool) -> tuple[str, dict]:
    """HF's chunk text (replace_video_token) and pixels for one video."""
    from transformers.video_utils import VideoMetadata

    video = torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous()
    meta = VideoMetadata(**(meta or {"fps": None, "total_num_frames": len(frames)}))
    if meta.frames_indices is None:
        meta.frames_indices = list(range(len(frames)))
    if sample:
        keep = processor.sample_frames(meta).tolist()
        video, meta.frames_indices = video[keep], [meta.frames_indices[k] for k in keep]
    s = processor._merge_and_standardize_kwargs()
    keys = ("do_resize", "size", "resample", "do_rescale", "rescale_factor", "do_normalize")
    keys += ("image_mean", "image_std", "patch_size", "temporal_patch_size", "merge_size")
    out = processor._preprocess([video], **{k: s[k] for k in (*keys, "max_patches")},
                                return_tensors="pt")  # fmt: skip
    out["video_metadata"] = [meta]
    hf = types.SimpleNamespace(video_processor=processor, video_token=VIDEO)
    text = transformers.Kimi_K25Processor.replace_video_token(hf, out, 0)
    return text, {"pixel_values_videos": out["pixel_values_videos"],
                  "video_grid_thw": out["video_grid_thw"]}  # fmt: skip


def _kind(tok, ids: list[int], m) -> str:
    """The word ("image" or "video") between <|media_begin|> and <|media_content|> before m."""
    text = tok.decode(ids[: m.offset])
    return text[text.rindex("<|media_begin|>") :].split("<|media_begin|>")[1].split("<")[0]


def _request(llm, prompt):
    return llm.llm_engine.input_processor.make_request("probe", prompt, SamplingParams(), None)


def test_videos_match_hf(path):
    """A video HF samples (10 frames at 4 fps -> frames 0, 2, 4, 6, 8: chunks of 4 and 1), a
    loader's 6 frames at 3 fps after an image (chunks of 4 and 2, the second at 01:06:40.333),
    3 frames without metadata taken whole (fps 24) and text: HF's prompt ids, chunk rows,
    tokens, logprobs."""
    model = _hf_model(path)
    processor = _hf_video_processor()
    sampled, loaded, raw = _frames(1, 10), _frames(2, 6, (30, 44)), _frames(3, 3, (20, 20))
    still = noise_image(9, (24, 16))
    whole = {"fps": 4.0, "total_num_frames": 10}
    kept = {"fps": 3.0, "frames_indices": [0, 7, 14, 100, 12001, 12002], "total_num_frames": 12003}
    no_sample = {"do_sample_frames": False}
    cases = [  # (text, multi_modal_data, mm_processor_kwargs, HF's (images, video, meta, sample))
        (_chat(f"{VIDEO}What happens?"), {"video": (sampled, whole)}, None,
         ([], sampled, whole, True)),
        (_chat(f"{IMAGE} then {VIDEO} and now?"), {"image": still, "video": (loaded, kept)},
         None, ([still], loaded, kept, False)),
        (_chat(f"{VIDEO}And?"), {"video": raw}, no_sample, ([], raw, None, False)),
        (TEXT, None, None, ([], None, None, False)),
    ]  # fmt: skip
    llm = engine(path)
    prompts = []
    for text, mm, kw, _ in cases:
        prompt = {"prompt": text, "multi_modal_data": mm} if mm else text
        prompts.append({**prompt, "mm_processor_kwargs": kw} if kw else prompt)
    outs = llm.generate(prompts, greedy(5, 6), use_tqdm=False)
    tok = llm.get_tokenizer()
    for (text, _, _, (images, video, meta, sample)), prompt, out in zip(
        cases, prompts, outs, strict=True
    ):
        extra: dict = {}
        if video is not None:
            chunks, extra = _hf_video(processor, video, meta, sample)
            text = text.replace(VIDEO, chunks)
        ids, pixels = _hf_inputs(path, text, images)
        extra |= pixels
        assert out.prompt_token_ids == ids
        assert_matches("kimi_k25 video", out, hf_greedy(model, ids, 6, 5, **extra))
        if video is None:
            continue
        grids = [tuple(g) for g in extra["video_grid_thw"].tolist()]
        rows = extra["pixel_values_videos"].split([t * h * w for t, h, w in grids])
        items = _request(llm, prompt).request.mm_inputs
        chunks = [m for m in items if _kind(tok, out.prompt_token_ids, m) == "video"]
        assert [m.image_size for m in chunks] == grids
        for m, want in zip(chunks, rows, strict=True):
            assert torch.equal(m.pixel_values, want)
    decoded = [tok.decode(o.prompt_token_ids) for o in outs]
    assert "00:00:00.000<|media_begin|>video<|media_content|>" in decoded[0]
    assert "<|media_end|>00:00:02.000<|media_begin|>video" in decoded[0]
    assert "<|media_end|>01:06:40.333<|media_begin|>video" in decoded[1]
    assert decoded[2].count("<|media_begin|>video") == 1
    llm.llm_engine.shutdown()


def test_stamps_follow_transformers():
    """A chunk's text is Kimi_K25Processor.replace_video_token's (hours, truncated
    milliseconds, the chunk's first frame)."""
    from transformers.video_utils import VideoMetadata

    from paged_engine.multimodal.kimi_k25_video import stamp

    processor = types.SimpleNamespace(merge_size=2, temporal_patch_size=1)
    hf = types.SimpleNamespace(video_processor=processor, video_token="*")
    indices = [0, 1, 59, 61, 1439, 3599, 3600, 3661, 7000, 90000]
    for fps in (1.0, 3.0, 24.0, 29.97):
        meta = VideoMetadata(fps=fps, frames_indices=indices, total_num_frames=90001)
        grids = torch.tensor([[1, 2, 2]] * len(indices))
        out = {"num_chunks_per_video": [len(indices)], "video_grid_thw": grids}
        want = transformers.Kimi_K25Processor.replace_video_token(
            hf, {**out, "video_metadata": [meta]}, 0
        )
        got = "".join(
            f"{stamp(i / fps)}<|media_begin|>video<|media_content|>*<|media_end|>" for i in indices
        )
        assert got == want, fps


def test_engine_paths_and_bad_input(path):
    """Chunks of 4 tokens through the videos and a prefix-cache hit give the plain run's
    tokens; chunks processed ahead are taken, moved ones refused; bad videos are ValueErrors
    naming the parameter, and the engine serves on."""
    prompts = [
        {
            "prompt": _chat(f"{VIDEO}Describe the video in detail, please."),
            "multi_modal_data": {"video": (_frames(s, 9, (20, 28)), {"fps": 4.0})},
        }
        for s in (3, 4)
    ] + [
        {
            "prompt": _chat(f"{IMAGE} then {VIDEO} and now?"),
            "multi_modal_data": {"image": noise_image(5, (24, 16)), "video": _frames(6, 5)},
            "mm_processor_kwargs": {"do_sample_frames": False},
        }
    ]
    params = greedy(0, 10)
    plain, cached, run = check_chunks_and_prefix_hits(
        path, prompts, params, 4, lambda proc: proc.videos.start_id
    )
    proc = cached.llm_engine.input_processor
    tokenizer = cached.get_tokenizer()
    for want, prompt in ((plain[0], prompts[0]), (plain[2], prompts[2])):
        ids = tokenizer.encode(prompt["prompt"])
        expanded, items = proc.multimodal(
            ids, prompt["multi_modal_data"], prompt.get("mm_processor_kwargs")
        )
        still = [m for m in items if _kind(tokenizer, expanded, m) == "image"]
        data = {"video": [m for m in items if m not in still]}
        data |= {"image": still} if still else {}
        ahead = {"prompt_token_ids": expanded, "multi_modal_data": data}
        assert_same_greedy([want], run(cached, [ahead]))
        moved = {"prompt_token_ids": [5, *expanded], "multi_modal_data": data}
        with pytest.raises(ValueError, match="do not fit"):
            cached.generate([moved], params, use_tqdm=False)
    one = _frames(7, 4)
    bad = [
        ({"video": one}, None, "needs the video's fps"),
        ({"video": [one, one]}, None, "2 video"),
        ({"video": (one, {"fps": -1.0})}, None, "fps must be a number"),
        ({"video": (one, {"fps": 2.0, "frames_indices": [0, 1]})}, None, "frames_indices"),
        ({"video": (one, {"fps": 2.0})}, {"num_frames": 2}, "num_frames"),
        ({"video": (one, {"fps": 2.0})}, {"fps": 0}, "fps"),
        ({"video": (one, {"fps": 1.0})}, {"do_sample_frames": True}, "fewer than 2"),
    ]
    for mm, kw, match in bad:
        prompt = {"prompt": _chat(f"{VIDEO}?"), "multi_modal_data": mm}
        with pytest.raises(ValueError, match=match):
            cached.generate([{**prompt, "mm_processor_kwargs": kw or {}}], params, use_tqdm=False)
    assert run(cached, prompts[:1])[0].token_ids == plain[0].token_ids
    short = {"prompt": _chat(f"{VIDEO}?"), "multi_modal_data": {"video": (one, {"fps": 1.0})}}
    out = cached.generate([short], params, use_tqdm=False)[0]  # 2 fps of 4 frames at 1: all
    assert tokenizer.decode(out.prompt_token_ids).count("<|media_begin|>video") == 1
    cached.llm_engine.shutdown()


def test_video_url_chat(path):
    """LLM.chat's video_url part (a data: URL, decoded as vLLM's loader does: its frames and
    their indices kept) gives the offline tokens of decode_video's frames and metadata."""
    pytest.importorskip("av")
    from paged_engine.multimodal.video_io import decode_video
    from paged_engine.testing import encode_video

    data = encode_video(_frames(4, 5, (16, 24)), fps=2)
    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    llm = engine(path)
    part = {"type": "video_url", "video_url": {"url": url}}
    ask = [{"role": "user", "content": [part, {"type": "text", "text": "Go"}]}]
    (got,) = llm.chat(ask, greedy(0, 6), use_tqdm=False)
    frames, meta = decode_video(data)
    prompt = {"prompt": _chat(f"{VIDEO}Go"), "multi_modal_data": {"video": (frames, meta)}}
    (want,) = llm.generate(prompt, greedy(0, 6), use_tqdm=False)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.prompt_token_ids == want.prompt_token_ids
    text = llm.get_tokenizer().decode(want.prompt_token_ids)
    assert "<|media_end|>00:00:02.000<|media_begin|>video" in text, text
    llm.llm_engine.shutdown()


def test_settings_refused(tmp_path):
    """A saved patch size unlike the tower's, or chunks past the tower's frame table: videos
    are not taken (the model serves images, a video a ValueError naming it)."""
    from paged_engine.multimodal.kimi_k25_video import KimiVideoProcessor

    path = write_tiny_kimi_k25(tmp_path / "m", seed=6)
    config = transformers.AutoConfig.from_pretrained(path)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    for change, match in [({"patch_size": 2}, "patch_size=2"), ({"temporal_patch_size": 5},
                          "pos_emb_time")]:  # fmt: skip
        (path / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_CONFIG | change))
        with pytest.raises(ValueError, match=match):
            KimiVideoProcessor(path, config, tok)
