"""use_audio_in_video=True on the Qwen2.5-Omni / Qwen3-Omni thinkers (multimodal/omni_av.py) vs HF.

The tiny thinkers of test_omni_audio.py with the video processor of test_omni_video.py and a
short clock (config position_id_per_seconds 5; Qwen2.5-Omni seconds_per_chunk 2: chunks of 10
positions), so a short video and clip interleave in several runs: Qwen2.5-Omni 4 frame groups at
t = 0, 5, 10, 15 and 25 audio rows -> V(0, 1) A(0..9) V(2, 3) A(10..24); Qwen3-Omni groups at
0, 10, 20, 30 and 20 rows -> V0 A(0..9) V1 A(10..19) V2 V3. The reference prompt is the text
transformers' processors make (their `replace_video_with_audio_token` run on the engine's grid
and HF's audio run length; their video processor needs torchvision), HF given the engine's
pixel rows. Against it: the prompt ids, get_rope_index(use_audio_in_video=True) and HF
`generate`'s greedy tokens and top-5 logprobs (float32), for a video and for an image before
one (Qwen3-Omni: and a wide frame before a short clip); then 8-token chunks and a
prefix-cache hit, and refusals by name.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from audio_checks import noise_clip
from hf_reference import assert_matches, assert_same_greedy, hf_greedy
from image_checks import engine, greedy, noise_image

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.qwen2_5_omni")
pytest.importorskip("transformers.models.qwen3_omni_moe")
from test_omni_audio import _HF, write_tiny_omni_audio  # noqa: E402
from test_omni_video import _VIDEO_CONFIG, _frames  # noqa: E402
from test_qwen_omni_images import MARKS  # noqa: E402

from paged_engine import SamplingParams  # noqa: E402

CLOCK = {"position_id_per_seconds": 5, "seconds_per_chunk": 2}
ON = {"use_audio_in_video": True}
SECONDS = {"2.5": 1.0, "3": 1.5}  # clips of 25 / 20 rows


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    cache: dict[str, Path] = {}

    def make(version: str) -> Path:
        if version not in cache:
            path = write_tiny_omni_audio(tmp_path_factory.mktemp(f"omni_av{version}"), version)
            (path / "video_preprocessor_config.json").write_text(json.dumps(_VIDEO_CONFIG))
            config = json.loads((path / "config.json").read_text())
            (path / "config.json").write_text(json.dumps(config | CLOCK, indent=1))
            cache[version] = path
        return cache[version]

    return make


def _text(version: str, with_image: bool) -> str:
    bos, eos, image, video = MARKS[version][:4]
    body = f"{bos}{video}{eos}What happens?"
    if with_image:
        body = f"{bos}{image}{eos} then {body}"
    return f"<|im_start|>user\n{body}<|im_end|>\n<|im_start|>assistant\n"


def _hf_block(version: str, grid: tuple, step: float, audio_rows: int) -> str:
    """transformers' processor text for a video token with its audio (its own method)."""
    if version == "2.5":
        from transformers import Qwen2_5OmniProcessor as Processor
    else:
        from transformers import Qwen3OmniMoeProcessor as Processor
    video, audio = MARKS[version][3], MARKS[version][4]
    fake = SimpleNamespace(
        audio_bos_token="<|audio_bos|>",
        audio_eos_token="<|audio_eos|>",
        video_token=video,
        audio_token=audio,
        video_processor=SimpleNamespace(merge_size=2),
    )
    fake.get_chunked_index = lambda *a: Processor.get_chunked_index(fake, *a)
    per_grid = step / CLOCK["position_id_per_seconds"]  # temporal_patch_size / fps
    return Processor.replace_video_with_audio_token(
        fake,
        {"video_grid_thw": torch.tensor([grid]), "video_second_per_grid": [per_grid]},
        0,
        {"num_audio_tokens": [audio_rows]},
        0,
        **CLOCK,
    )


def _reference(hf: _HF, llm, version: str, with_image: bool, frames, clip):
    """(HF's prompt ids, its generate arguments) for the prompt with its video and clip."""
    rows, grid, step = llm.llm_engine.input_processor.videos._load(0, frames, {})
    runs, features = hf.audio_runs([clip])
    text = _text(version, with_image)
    video = MARKS[version][3]
    text = text.replace(video, _hf_block(version, grid, step, runs[0]))
    extra = features | {"use_audio_in_video": True}
    if with_image:  # its run as the processor writes it
        out = hf.images(images=[noise_image(3, (40, 24))], return_tensors="pt")
        extra |= {k: out[k] for k in ("pixel_values", "image_grid_thw")}
        image = MARKS[version][2]
        text = text.replace(image, image * (int(out["image_grid_thw"][0].prod()) // 4))
    ids = hf.tok.encode(text, add_special_tokens=False)
    extra |= {"pixel_values_videos": rows, "video_grid_thw": torch.tensor([grid])}
    extra["video_second_per_grid"] = torch.tensor([step / CLOCK["position_id_per_seconds"]])
    return ids, extra


@pytest.mark.parametrize("version", ["2.5", "3"])
def test_audio_in_video_matches_hf(dirs, version):
    path = dirs(version)
    hf = _HF(path, version)
    llm = engine(path)
    frames, clip = _frames(1, 8, (24, 32)), noise_clip(1, SECONDS[version])
    cases = [(False, frames, clip), (True, frames, clip)]
    if version == "3":  # V0 A(0..6): the eos pair past the clip's last row (6), not the
        # block's largest position (the video's width, 11)
        cases.append((False, _frames(2, 2, (8, 96)), noise_clip(2, 0.5)))
    for with_image, frames, clip in cases:
        data = {"video": frames, "audio": clip}
        if with_image:
            data["image"] = noise_image(3, (40, 24))
        prompt = {"prompt": _text(version, with_image), "multi_modal_data": data}
        out = llm.generate(prompt | {"mm_processor_kwargs": ON}, greedy(5, 6), use_tqdm=False)[0]
        ids, extra = _reference(hf, llm, version, with_image, frames, clip)
        assert out.prompt_token_ids == ids
        runs = np.diff(np.flatnonzero(np.diff([t == hf.audio_pad for t in ids]))).tolist()
        assert len(runs) >= (3 if len(frames) == 8 else 1)  # (video, audio, video ... runs)
        assert_matches(
            f"omni{version} audio in video", out, hf_greedy(hf.model, ids, 6, 5, **extra)
        )
        want, delta = hf.model.get_rope_index(
            torch.tensor([ids]),
            extra.get("image_grid_thw"),
            extra["video_grid_thw"],
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            use_audio_in_video=True,
            audio_seqlens=extra["feature_attention_mask"].sum(-1),
            second_per_grids=extra["video_second_per_grid"],
        )
        req = llm.llm_engine.input_processor.make_request(
            "p", prompt | {"mm_processor_kwargs": ON}, SamplingParams(), None
        ).request
        np.testing.assert_array_equal(req.mrope.table, want[:, 0].numpy())
        assert req.mrope.delta == int(delta)
    llm.llm_engine.shutdown()


def test_engine_paths_and_refusals(dirs):
    """Qwen2.5-Omni: 8-token chunks, a prefix-cache hit and the items processed ahead (as the
    server's chat path sends them) give the plain run's tokens; bad input is refused by name
    and the engine serves on."""
    path = dirs("2.5")
    prompts = [
        {
            "prompt": _text("2.5", False),
            "multi_modal_data": {"video": _frames(s, 8, (24, 32)), "audio": noise_clip(s, 0.8)},
            "mm_processor_kwargs": ON,
        }
        for s in (4, 5)
    ]
    params = greedy(0, 8)
    plain = [o.outputs[0] for o in engine(path).generate(prompts, params, use_tqdm=False)]
    llm = engine(path, max_num_batched_tokens=8, enable_chunked_prefill=True, max_num_seqs=2)
    assert_same_greedy(plain, [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)])
    cached = engine(path, enable_prefix_caching=True)
    cached.generate(prompts[:1], params, use_tqdm=False)
    again = cached.generate(prompts[:1], params, use_tqdm=False)[0]
    assert again.num_cached_tokens >= (len(again.prompt_token_ids) - 1) // 16 * 16
    assert_same_greedy(plain[:1], [again.outputs[0]])

    one = prompts[0]
    # processed ahead (the server's chat thread): the items taken as they are, without kwargs
    processor = cached.llm_engine.input_processor
    ids = processor.tokenizer.encode(one["prompt"])
    expanded, items = processor.multimodal(ids, one["multi_modal_data"], ON)
    video_id = processor.videos.video_token_id
    mm = {"video": [m for m in items if expanded[m.offset] == video_id]}
    mm["audio"] = [m for m in items if m.modality == "audio"]
    assert len(mm["video"]) >= 2 and len(mm["audio"]) >= 2  # (the runs of one video, clip)
    ahead = cached.generate(
        {"prompt_token_ids": expanded, "multi_modal_data": mm}, params, use_tqdm=False
    )
    assert_same_greedy(plain[:1], [ahead[0].outputs[0]])

    video = one["multi_modal_data"]["video"]
    kw = r"mm_processor_kwargs\['use_audio_in_video'\]"
    refused = [
        ({"video": video}, ON, kw),  # no soundtrack
        ({"video": [video, video], "audio": noise_clip(1, 0.5)}, ON, kw),
        (one["multi_modal_data"], {"use_audio_in_video": "yes"}, f"{kw} must be a bool"),
        # 2 / 0.5 * 5 = 20 positions a group, over a chunk of 10
        (one["multi_modal_data"], ON | {"fps": 0.5}, r"mm_processor_kwargs\['fps'\]"),
    ]
    for data, kwargs, says in refused:
        bad = one | {"multi_modal_data": data, "mm_processor_kwargs": kwargs}
        with pytest.raises(ValueError, match=says):
            cached.generate(bad, params, use_tqdm=False)
    assert cached.generate(prompts[:1], params, use_tqdm=False)[0].outputs[0].token_ids == (
        plain[0].token_ids
    )


def _mp4_with_sound(frames: np.ndarray, clip: np.ndarray | None, rate: int = 16000) -> bytes:
    """An MPEG-4 video (4 fps) with an AAC soundtrack (none for clip None), encoded with PyAV."""
    import io

    av = pytest.importorskip("av")
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        video = out.add_stream("mpeg4", rate=4)
        video.height, video.width = frames.shape[1:3]
        video.pix_fmt = "yuv420p"
        audio = None if clip is None else out.add_stream("aac", rate=rate, layout="mono")
        for f in frames:
            out.mux(video.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        out.mux(video.encode())
        if audio is not None:
            pcm = clip[None, :].astype(np.float32)
            frame = av.AudioFrame.from_ndarray(pcm, format="fltp", layout="mono")
            frame.sample_rate = rate
            out.mux(audio.encode(frame))
            out.mux(audio.encode())
    return buf.getvalue()


def test_chat_video_urls_bring_their_soundtrack(dirs, tmp_path):
    """LLM.chat and the server's chat route with use_audio_in_video: a video_url part's own
    audio track joins it (decoded from the same bytes), giving the tokens of generate with the
    decoded frames and soundtrack passed explicitly."""
    import base64

    from paged_engine.multimodal.audio_io import load_audio
    from paged_engine.multimodal.video_io import decode_video

    pytest.importorskip("paged_server")
    from server.server_proc import COMMON_ARGS, serve_in_process

    bos, eos, _, video_mark = MARKS["2.5"][:4]
    template = (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
        "{% for part in message['content'] %}"
        f"{{% if part['type'] == 'video' %}}{bos}{video_mark}{eos}"
        "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
        "{% endfor %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    (tmp_path / "t.jinja").write_text(template)
    data = _mp4_with_sound(_frames(7, 8, (24, 32)), noise_clip(7, 2.0))
    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "video_url", "video_url": {"url": url}},
                {"type": "text", "text": "What happens?"},
            ],
        }
    ]
    llm = engine(dirs("2.5"), chat_template=str(tmp_path / "t.jinja"))
    params = greedy(0, 6)
    want = llm.generate(
        {
            "prompt": _text("2.5", False),
            "multi_modal_data": {"video": decode_video(data), "audio": load_audio(data, "clip")},
            "mm_processor_kwargs": ON,
        },
        params,
        use_tqdm=False,
    )[0]
    got = llm.chat(messages, params, use_tqdm=False, mm_processor_kwargs=ON)
    assert got[0].prompt_token_ids == want.prompt_token_ids
    assert got[0].outputs[0].token_ids == want.outputs[0].token_ids
    without = llm.chat(messages, params, use_tqdm=False)[0]
    assert len(without.prompt_token_ids) < len(want.prompt_token_ids)  # no audio runs
    body = {
        "model": "tiny",
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "messages": messages,
        "mm_processor_kwargs": ON,
    }
    with serve_in_process(COMMON_ARGS, llm.llm_engine) as (http, _):
        status, _, out = http.request("POST", "/v1/chat/completions", body)
        assert status == 200, out
        assert out["prompt_token_ids"] == want.prompt_token_ids
        assert out["choices"][0]["token_ids"] == want.outputs[0].token_ids
        mute = _mp4_with_sound(_frames(7, 8, (24, 32)), None)  # a video without sound
        part = {
            "type": "video_url",
            "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(mute).decode()},
        }
        bad = body | {"messages": [{"role": "user", "content": [part]}]}
        status, _, out = http.request("POST", "/v1/chat/completions", bad)
        assert status == 400 and "messages[0].content[0]" in out["error"]["message"], out
