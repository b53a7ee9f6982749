"""Videos through GLM-4.1V / GLM-4.5V / GLM-4.6V checkpoints (multimodal/glm4v_video.py) vs HF.

The tiny random checkpoints of test_glm4v_images.py with a video processor config (4-pixel
patches merged 2 x 2, at most 9216 pixels over a video's frames). transformers' own video
processor runs here with its two torchvision calls (resize, normalize) swapped for torch's
antialiased bicubic (what paged's resize is) and a plain normalize: its frame sampling
(GLM-4.6V's copied from its source: that module imports torchvision), smart_resize, temporal
padding and patch order, and Glm4vProcessor / Glm46VProcessor's prompt (frame pairs as image
runs, their timestamps) are HF's own. Against that: the engine's prompt ids and pixel rows,
HF `generate`'s greedy tokens and top-5 logprobs (1e-3, float32) on a sampled video, a video
beside an image and plain text, and HF's get_rope_index table. Then chunked prefill through a
video, prefix-cache hits, pairs processed ahead, TP=2, LLM.chat's video_url parts and the
server's, and bad videos refused by name.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hf_reference import assert_matches, assert_same_greedy, hf_greedy
from image_checks import (
    check_chunks_and_prefix_hits,
    check_tensor_parallel,
    engine,
    greedy,
    noise_image,
)

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.glm4v")
pytest.importorskip("transformers.models.glm46v")
from test_glm4v_images import ARCHS, CHAT_TEMPLATE, write_tiny_glm4v  # noqa: E402

from paged_engine import SamplingParams  # noqa: E402

VIDEO = "<|begin_of_video|><|video|><|end_of_video|>"
IMAGE = "<|begin_of_image|><|image|><|end_of_image|>"
TEXT = "[gMASK]<sop><|user|>\nSay something about the sea.<|assistant|>\n"
_SIZE = {"shortest_edge": 256, "longest_edge": 9216}  # pixels over a video's frames
TEMPLATE = CHAT_TEMPLATE.replace(
    "{% elif part['type'] == 'text' %}",
    "{% elif part['type'] == 'video' %}" + VIDEO + "{% elif part['type'] == 'text' %}",
)


def _chat(body: str) -> str:
    return f"[gMASK]<sop><|user|>\n{body}<|assistant|>\n"


def _frames(seed: int, count: int, size: tuple[int, int] = (40, 56)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, *size, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def glm_dirs(tmp_path_factory):
    cache: dict[str, Path] = {}

    def make(arch: str = "glm4v") -> Path:
        if arch not in cache:
            path = write_tiny_glm4v(tmp_path_factory.mktemp(arch), arch, seed=3)
            kind = "Glm46VVideoProcessor" if arch == "glm46v" else "Glm4vVideoProcessor"
            config = {"patch_size": 4, "merge_size": 2, "temporal_patch_size": 2, "size": _SIZE}
            config |= {"video_processor_type": kind, "fps": 2, "max_duration": 300}
            (path / "video_preprocessor_config.json").write_text(json.dumps(config))
            (path / "chat_template.jinja").write_text(TEMPLATE)
            cache[arch] = path
        return cache[arch]

    return make


def _hf_source(module: str, cls: str, name: str):
    """`cls.name` of a transformers module compiled from its source (the module itself
    imports torchvision, the method does not)."""
    import ast
    import importlib.util
    import math

    root = importlib.util.find_spec("transformers").submodule_search_locations[0]
    tree = ast.parse(Path(root, "models", *module.split(".")).with_suffix(".py").read_text())
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    node = next(n for n in body if isinstance(n, ast.FunctionDef) and n.name == name)
    namespace = {"math": math, "np": np}
    exec(compile(ast.Module(body=[node], type_ignores=[]), f"<{name}>", "exec"), namespace)
    return namespace[name]


def _resize(videos, size, resample, factor: int, temporal_factor: int, **kw):
    """HF's Glm4vVideoProcessor.resize with torch's antialiased bicubic for torchvision's."""
    from transformers.models.glm4v.video_processing_glm4v import smart_resize

    b, t, c, height, width = videos.shape
    h, w = smart_resize(
        t, height, width, temporal_factor, factor, size.shortest_edge, size.longest_edge
    )
    x = videos.flatten(0, 1).float()
    x = F.interpolate(x, size=(h, w), mode="bicubic", align_corners=False, antialias=True)
    return x.round_().clamp_(0, 255).to(torch.uint8).view(b, t, c, h, w)


def _normalize(image, mean, std, **kw):
    return (image - torch.as_tensor(mean).view(-1, 1, 1)) / torch.as_tensor(std).view(-1, 1, 1)


def _processor(path: Path, arch: str):
    """HF's Glm4vProcessor (Glm46VProcessor) with HF's video processor, see the module."""
    from transformers.models.glm4v.video_processing_glm4v import Glm4vVideoProcessor

    config = json.loads((path / "video_preprocessor_config.json").read_text())
    video = Glm4vVideoProcessor(**{k: v for k, v in config.items() if k != "video_processor_type"})
    video.resize, video.normalize = _resize, _normalize
    if arch == "glm46v":  # (the two video processors differ only in this)
        fn = _hf_source("glm46v.video_processing_glm46v", "Glm46VVideoProcessor", "sample_frames")
        video.sample_frames = types.MethodType(fn, video)
    cls = transformers.Glm46VProcessor if arch == "glm46v" else transformers.Glm4vProcessor
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(transformers.ProcessorMixin, "check_argument_for_proper_class", _any)
        return cls(
            image_processor=transformers.AutoImageProcessor.from_pretrained(path),
            tokenizer=transformers.AutoTokenizer.from_pretrained(path),
            video_processor=video,
        )


def _any(self, name: str, value: object) -> None:
    return None


def _hf_inputs(
    processor, text: str, images: list, videos: list, metadata, sample: bool = False
) -> tuple[list, dict]:
    """HF's prompt ids and model arguments (`sample`: HF samples the frames)."""
    if not images and not videos:
        return processor.tokenizer.encode(text, add_special_tokens=False), {}
    kw = {"do_convert_rgb": False, "do_sample_frames": sample}
    if metadata is not None:
        kw["video_metadata"] = metadata
    out = processor(
        text=[text], images=images or None, videos=videos or None, videos_kwargs=kw,
        return_tensors="pt",
    )  # fmt: skip
    keys = ["mm_token_type_ids", "pixel_values", "image_grid_thw"]
    keys += ["pixel_values_videos", "video_grid_thw"]
    return out["input_ids"][0].tolist(), {k: out[k] for k in keys if k in out}


def _forward(extra: dict) -> dict:
    """HF's model arguments for a prompt with an image and a video: the video's frame pairs
    as images (transformers 5.25's Glm4vModel counts every image token as the image's and
    the video's placeholder at once, so it refuses the two together), as its
    get_video_features and get_rope_index read them: grid (1, h, w) each."""
    if "pixel_values" not in extra or "pixel_values_videos" not in extra:
        return extra
    (t, h, w) = extra["video_grid_thw"][0].tolist()
    return {
        "mm_token_type_ids": extra["mm_token_type_ids"].clamp(max=1),
        "pixel_values": torch.cat([extra["pixel_values"], extra["pixel_values_videos"]]),
        "image_grid_thw": torch.cat([extra["image_grid_thw"], torch.tensor([[1, h, w]] * t)]),
    }


def _request(llm, prompt):
    return llm.llm_engine.input_processor.make_request("probe", prompt, SamplingParams(), None)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_videos_match_hf(glm_dirs, arch):
    """A video HF samples (20 frames at 10 fps), a video a loader sampled (frames 0, 3, 6, 9,
    12 at 2 fps: times 0, 3, 6 s) after an image, 5 frames without metadata (fps 24, the last
    repeated) and text: HF's prompt ids, pixel rows, tokens, logprobs and M-RoPE table."""
    path = glm_dirs(arch)
    cls = getattr(transformers, f"{ARCHS[arch]}ForConditionalGeneration")
    model = cls.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    processor = _processor(path, arch)
    sampled, still = _frames(1, 20), noise_image(9, (48, 40))
    loaded, raw = _frames(2, 5, (33, 61)), _frames(3, 5, (24, 32))
    whole = {"fps": 10.0, "total_num_frames": 20}
    kept = {"fps": 2.0, "frames_indices": [0, 3, 6, 9, 12], "total_num_frames": 13}
    cases = [
        (
            _chat(VIDEO + "What happens?"),
            {"video": (sampled, whole)},
            ([], [sampled], [whole], True),
        ),
        (
            _chat(f"{IMAGE} then {VIDEO} and now?"),
            {"image": still, "video": (loaded, kept)},
            ([still], [loaded], [kept]),
        ),
        (_chat(VIDEO + "And?"), {"video": raw}, ([], [raw], None)),
        (TEXT, None, ([], [], None)),
    ]
    llm = engine(path)
    prompts = [{"prompt": t, "multi_modal_data": mm} if mm else t for t, mm, _ in cases]
    outs = llm.generate(prompts, greedy(5, 6), use_tqdm=False)
    for (text, mm, hf_media), prompt, out in zip(cases, prompts, outs, strict=True):
        ids, extra = _hf_inputs(processor, text, *hf_media)
        assert out.prompt_token_ids == ids, arch
        assert_matches(f"{arch} video", out, hf_greedy(model, ids, 6, 5, **_forward(extra)))
        if mm is None:
            continue
        req = _request(llm, prompt).request
        pairs = [m for m in req.mm_inputs if extra["mm_token_type_ids"][0, m.offset] == 2]
        assert len(pairs) == int(extra["video_grid_thw"][0, 0])
        got = torch.cat([m.pixel_values for m in pairs])
        torch.testing.assert_close(got, extra["pixel_values_videos"], atol=1e-5, rtol=0)
        want, delta = model.model.get_rope_index(
            torch.tensor([ids]),
            extra["mm_token_type_ids"],
            extra.get("image_grid_thw"),
            extra["video_grid_thw"],
        )
        assert req.mrope.table.tolist() == want[:, 0].tolist()
        assert req.mrope.delta == int(delta)
    text = llm.get_tokenizer().decode(outs[0].prompt_token_ids)
    # 4.1V / 4.5V: frames 0, 5, 10, 15, 19, 19 -> pairs at 0.0, 1.0, 1.9 s, whole seconds
    # 4.6V: 18 frames (3 a second for 3 s), first-frame times with a tenth
    if arch == "glm46v":
        assert "<|end_of_image|>0.0 seconds<|begin_of_image|>" in text, text
        assert text.count("<|begin_of_image|>") == 9
    else:
        assert "<|end_of_image|>1<|begin_of_image|>" in text, text
        assert text.count("<|begin_of_image|>") == 3
    text = llm.get_tokenizer().decode(outs[1].prompt_token_ids)
    stamp = "{:.1f} seconds" if arch == "glm46v" else "{:.0f}"
    assert "<|end_of_image|>" + stamp.format(3) + "<|begin_of_image|>" in text, text
    llm.llm_engine.shutdown()


def test_sampling_follows_transformers():
    """GLM-4.1V's and GLM-4.6V's frame sampling are transformers' (short, long, given
    duration, fewer frames than wanted)."""
    from transformers.models.glm4v.video_processing_glm4v import Glm4vVideoProcessor
    from transformers.video_utils import VideoMetadata

    from paged_engine.multimodal.glm4v_video import sample_indices, sample_indices_46v

    v41 = Glm4vVideoProcessor()
    fn = _hf_source("glm46v.video_processing_glm46v", "Glm46VVideoProcessor", "sample_frames")
    v46 = types.MethodType(fn, Glm4vVideoProcessor())
    cases = [(20, 10.0, None), (7, 24.0, None), (300, 30.0, None), (1, 5.0, None)]
    cases += [(9000, 25.0, None), (40, 2.0, 15.5), (2000, 0.5, None), (90000, 30.0, None)]
    for total, fps, duration in cases:
        meta = VideoMetadata(total_num_frames=total, fps=fps, duration=duration)
        want = v41.sample_frames(meta, fps=2).tolist()
        assert sample_indices(total, fps, 2.0, 300, duration) == want, (total, fps)
        assert (
            sample_indices(total, fps, 0.5, 300, duration)
            == v41.sample_frames(meta, fps=0.5).tolist()
        )
        assert sample_indices_46v(total, fps, 2, duration) == v46(meta).tolist(), (total, fps)


def test_engine_paths(glm_dirs):
    """Chunks of 8 tokens through the pairs and a prefix-cache hit give the plain run's
    tokens (another video's prompt hits only the text before it); pairs processed ahead are
    taken (as images, as the server hands them, or as the prompt's videos); bad videos are
    ValueErrors naming the parameter and the engine serves on."""
    path = glm_dirs("glm4v")
    prompts = [
        {
            "prompt": _chat(VIDEO + "Describe the video in detail, please."),
            "multi_modal_data": {"video": (_frames(s, 20), {"fps": 10.0})},
        }
        for s in (3, 4)
    ] + [
        {
            "prompt": _chat(f"{IMAGE} then {VIDEO} and now?"),
            "multi_modal_data": {"image": noise_image(5, (40, 24)), "video": _frames(6, 4)},
        }
    ]
    params = greedy(0, 12)
    plain, cached, run = check_chunks_and_prefix_hits(
        path, prompts, params, 8, lambda proc: proc.videos.start_id
    )

    proc = cached.llm_engine.input_processor
    tokenizer = cached.get_tokenizer()
    for want, prompt in ((plain[0], prompts[0]), (plain[2], prompts[2])):
        ids = tokenizer.encode(prompt["prompt"])
        expanded, items = proc.multimodal(ids, prompt["multi_modal_data"])
        ahead = {"prompt_token_ids": expanded, "multi_modal_data": {"image": list(items)}}
        assert_same_greedy([want], run(cached, [ahead]))
    ids = tokenizer.encode(prompts[0]["prompt"])
    expanded, items = proc.multimodal(ids, prompts[0]["multi_modal_data"])
    ahead = {"prompt_token_ids": expanded, "multi_modal_data": {"video": list(items)}}
    assert_same_greedy(plain[:1], run(cached, [ahead]))
    moved = dataclasses.replace(items[0], offset=items[0].offset + 1)
    small = dataclasses.replace(items[0], image_size=(1, 2, 2))
    for bad in (items[1:], [moved, *items[1:]], [small, *items[1:]]):
        with pytest.raises(ValueError, match=r"multi_modal_data\['video'\]"):
            mm = {"video": list(bad)}
            cached.generate({"prompt_token_ids": expanded, "multi_modal_data": mm})

    text = _chat(VIDEO + "Go.")
    cases = [
        (_frames(1, 4).astype(np.float32), "uint8 frames"),
        (_frames(1, 1), r"\[0\]: 1 frame\(s\)"),
        ((_frames(1, 4), {"fps": 0}), "fps must be a number > 0"),
        ((_frames(1, 4), {"fps": 5.0, "frames_indices": [0, 1]}), "frames_indices has 2"),
        ((_frames(1, 4), {"fps": 5.0, "duration": "long"}), r"\[0\]: duration must be"),
        ([_frames(1, 4), _frames(2, 4)], "2 video\\(s\\) but the prompt has 1"),
    ]
    for video, says in cases:
        with pytest.raises(ValueError, match=says):
            cached.generate({"prompt": text, "multi_modal_data": {"video": video}})
    kw_cases = [
        ({"do_sample_frames": True}, "needs the video's fps"),
        ({"speed": 2}, r"mm_processor_kwargs\['speed'\]"),
    ]
    for kw, says in kw_cases:
        with pytest.raises(ValueError, match=says):
            mm = {"video": _frames(1, 4)}
            cached.generate({"prompt": text, "multi_modal_data": mm, "mm_processor_kwargs": kw})
    assert len(run(cached, prompts[:1])[0].token_ids) == 12
    limited = engine(path, limit_mm_per_prompt={"video": 0})
    with pytest.raises(ValueError, match="takes no videos"):
        limited.generate({"prompt": text, "multi_modal_data": {"video": _frames(1, 4)}})


def test_glm46v_refuses_fps(glm_dirs):
    llm = engine(glm_dirs("glm46v"))
    prompt = {
        "prompt": _chat(VIDEO + "Go."),
        "multi_modal_data": {"video": (_frames(1, 8), {"fps": 4.0})},
        "mm_processor_kwargs": {"fps": 1.0},
    }
    with pytest.raises(ValueError, match=r"mm_processor_kwargs\['fps'\] is not taken"):
        llm.generate(prompt, greedy(0, 2))
    llm.llm_engine.shutdown()


def test_tensor_parallel(glm_dirs):
    """TP=2 (gloo) gives the one-process tokens and logprobs, chunks through the pairs."""
    prompts = [
        {
            "prompt": _chat(f"{IMAGE} then {VIDEO} and now?"),
            "multi_modal_data": {"image": noise_image(7, (24, 40)), "video": _frames(8, 4)},
        }
    ]
    check_tensor_parallel(glm_dirs("glm4v_moe"), prompts, chunk=16)


def test_video_url_chat_and_server(glm_dirs):
    """LLM.chat's video_url part (a data: URL, decoded and sampled as vLLM's loader does) and
    the server's give the offline tokens of the frames and metadata decode_video gives."""
    pytest.importorskip("av")
    pytest.importorskip("paged_server")
    from server.server_proc import COMMON_ARGS, offline_chat, serve_in_process

    from paged_engine.multimodal.video_io import decode_video
    from paged_engine.testing import encode_video

    data = encode_video(_frames(4, 40, (16, 24)), fps=10)
    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    llm = engine(glm_dirs("glm4v"))
    part = {"type": "video_url", "video_url": {"url": url}}
    ask = [{"role": "user", "content": [part, {"type": "text", "text": "Go"}]}]
    (got,) = llm.chat(ask, greedy(0, 6), use_tqdm=False)
    frames, meta = decode_video(data)  # 32 of its 40 frames, their indices kept
    prompt = {"prompt": _chat(VIDEO + "Go"), "multi_modal_data": {"video": (frames, meta)}}
    (want,) = llm.generate(prompt, greedy(0, 6), use_tqdm=False)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.prompt_token_ids == want.prompt_token_ids
    assert llm.get_tokenizer().decode(want.prompt_token_ids).count("<|begin_of_image|>") == 16

    hf_parts = [{"type": "video"}, {"type": "text", "text": "Go"}]
    hf_ask = [{"role": "user", "content": hf_parts}]
    offline = offline_chat(llm, hf_ask, {"video": (frames, meta)}, 6)
    body = {"model": "tiny", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    body |= {"messages": ask, "return_token_ids": True}
    try:
        with serve_in_process(COMMON_ARGS, llm.llm_engine) as (http, _):
            status, _, out = http.request("POST", "/v1/chat/completions", body)
            assert status == 200, out
            assert out["choices"][0]["token_ids"] == offline.ids
            assert out["prompt_token_ids"] == offline.prompt_ids
    finally:
        llm.llm_engine.shutdown()
