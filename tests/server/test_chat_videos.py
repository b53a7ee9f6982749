"""Videos in the OpenAI server (a tiny random Qwen2.5-VL): a chat request's `video_url` parts
(data: / http(s): / file: URLs) give exactly the greedy tokens of offline `LLM.generate` over
the same rendered prompt with the frames the loader samples (`num_frames` of them, vLLM's
media_io_kwargs, per request or --media-io-kwargs), also beside an image; /tokenize counts the
video's tokens; every unreadable video, refused part, bad media_io_kwargs and too many videos
is a 400 naming the parameter, and the server keeps serving; a model without videos refuses
video parts; --limit-mm-per-prompt takes video counts."""

from __future__ import annotations

import base64
import io
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest
from server_proc import COMMON_ARGS, ServerProc, fill_host, offline_chat, serve_in_process

np = pytest.importorskip("numpy")
Image = pytest.importorskip("PIL.Image")
pytest.importorskip("av")

from paged_engine.multimodal.video_io import decode_video  # noqa: E402
from paged_engine.testing import encode_video  # noqa: E402

MAX_TOKENS = 6
GREEDY = {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
PLAIN = {**GREEDY, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
VIDEO = "messages[0].content[0].video_url"


def _clip(seed: int, count: int = 10) -> bytes:
    """A 40 x 56 mp4 of `count` frames at 5 fps: 8-pixel blocks of random colors."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (count, 5, 7, 3), dtype=np.uint8)
    return encode_video(np.kron(blocks, np.ones((1, 8, 8, 1), np.uint8)), fps=5)


def _video_url(data: bytes) -> str:
    return "data:video/mp4;base64," + base64.b64encode(data).decode()


def _video_part(url: str) -> dict:
    return {"type": "video_url", "video_url": {"url": url}}


def _image_part(image) -> dict:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def _ask(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "What happens?"}]}]


def _hf(messages: list[dict]) -> list[dict]:
    kinds = {"video_url": "video", "image_url": "image"}
    return [
        {**m, "content": [p if p["type"] == "text" else {"type": kinds[p["type"]]} for p in c]}
        if isinstance(c := m["content"], list)
        else m
        for m in messages
    ]


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    folder = tmp_path_factory.mktemp("videos")
    (folder / "a.mp4").write_bytes(_clip(0))
    return SimpleNamespace(a=_clip(0), b=_clip(1, count=7), folder=folder)


@pytest.fixture(scope="module")
def video_host(clips) -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            found = self.path == "/a.mp4"
            self.send_response(200 if found else 404)
            self.send_header("Content-Type", "video/mp4")
            body = clips.a if found else b""
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    yield "http://127.0.0.1:{}".format(*server.server_address[1:])
    server.shutdown()
    server.server_close()


def _mixed(clips, picture) -> list[dict]:
    """A video, text, an image and another video in one message."""
    return [
        {
            "role": "user",
            "content": [
                _video_part(_video_url(clips.b)),
                {"type": "text", "text": "and"},
                _image_part(picture),
                _video_part(_video_url(clips.a)),
            ],
        }
    ]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory, clips) -> Iterator[SimpleNamespace]:
    """A tiny Qwen2.5-VL (at most 2 videos a prompt, 4 frames sampled from each by default)
    behind a server in this process, with the offline answers to compare with computed first
    on the same engine (whose steps the server's loop then runs alone)."""
    from paged_engine import LLM
    from paged_engine.testing import write_tiny_qwen2_vl

    path = write_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen25"), version="2.5", seed=2)
    llm = LLM(
        str(path),
        dtype="float32",
        max_model_len=1024,
        block_size=16,
        limit_mm_per_prompt={"video": 2},
    )

    def offline(messages: list[dict], mm: dict) -> SimpleNamespace:
        return offline_chat(llm, _hf(messages), mm, MAX_TOKENS)

    picture = Image.fromarray(np.random.default_rng(5).integers(0, 256, (36, 44, 3), np.uint8))
    one = _ask(_video_part("x"))
    four = [decode_video(clips.b, num_frames=4), decode_video(clips.a, num_frames=4)]
    want = {  # the server's --media-io-kwargs: 4 frames; a request's -1: all
        "four": offline(one, {"video": four[1]}),
        "all": offline(one, {"video": decode_video(clips.a, num_frames=-1)}),
        "mixed": offline(_mixed(clips, picture), {"video": four, "image": [picture]}),
    }
    args = [
        *COMMON_ARGS,
        "--allowed-local-media-path",
        str(clips.folder),
        "--media-io-kwargs",
        '{"video": {"num_frames": 4}}',
    ]
    try:
        with serve_in_process(args, llm.llm_engine) as (http, app):
            yield SimpleNamespace(http=http, app=app, want=want, picture=picture)
    finally:
        llm.llm_engine.shutdown()


def _chat(server: ServerProc, messages: list[dict], **extra) -> dict:
    status, _, body = server.request(
        "POST",
        "/v1/chat/completions",
        {**GREEDY, "messages": messages, "return_token_ids": True, **extra},
    )
    assert status == 200, body
    return body


def _refused(server: ServerProc, body: dict) -> dict:
    """The 400's error object; the server then still answers a plain chat request."""
    status, _, payload = server.request("POST", "/v1/chat/completions", body)
    assert status == 400, payload
    ok, _, after = server.request("POST", "/v1/chat/completions", PLAIN)
    assert ok == 200, after
    return payload["error"]


# ---- answers ---------------------------------------------------------------------------------
def test_a_data_url_video_gives_the_offline_tokens(qwen, clips) -> None:
    assert decode_video(clips.a, num_frames=4)[1]["frames_indices"] == [0, 3, 6, 9]
    body = _chat(qwen.http, _ask(_video_part(_video_url(clips.a))))
    want = qwen.want["four"]
    assert body["choices"][0]["token_ids"] == want.ids
    assert body["prompt_token_ids"] == want.prompt_ids
    assert body["usage"]["prompt_tokens"] == len(want.prompt_ids)
    assert qwen.want["all"].prompt_ids != want.prompt_ids  # 10 frames are more tokens than 4


def test_media_io_kwargs_per_request(qwen, clips) -> None:
    messages = _ask(_video_part(_video_url(clips.a)))
    body = _chat(qwen.http, messages, media_io_kwargs={"video": {"num_frames": -1}})
    assert body["choices"][0]["token_ids"] == qwen.want["all"].ids
    assert body["prompt_token_ids"] == qwen.want["all"].prompt_ids


def test_videos_and_an_image_in_order(qwen, clips) -> None:
    body = _chat(qwen.http, _mixed(clips, qwen.picture))
    assert body["choices"][0]["token_ids"] == qwen.want["mixed"].ids
    assert body["prompt_token_ids"] == qwen.want["mixed"].prompt_ids


def test_http_and_file_urls_and_a_stream(qwen, clips, video_host) -> None:
    want = qwen.want["four"]
    for url in (f"{video_host}/a.mp4", (clips.folder / "a.mp4").as_uri()):
        assert _chat(qwen.http, _ask(_video_part(url)))["choices"][0]["token_ids"] == want.ids
    bare = _ask({"type": "video_url", "video_url": f"{video_host}/a.mp4"})  # vLLM's form
    events = qwen.http.stream(
        {**GREEDY, "messages": bare, "stream_options": {"include_usage": True}},
        "/v1/chat/completions",
    )
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert text == _chat(qwen.http, bare)["choices"][0]["message"]["content"]
    assert events[-1]["usage"]["prompt_tokens"] == len(want.prompt_ids)


def test_tokenize_counts_the_video_tokens(qwen, clips) -> None:
    messages = _ask(_video_part(_video_url(clips.a)))
    status, _, body = qwen.http.request(
        "POST", "/tokenize", {"model": "tiny", "messages": messages}
    )
    assert status == 200, body
    assert body["tokens"] == qwen.want["four"].prompt_ids


def test_qwen3_vl_video_parts(tmp_path: Path, clips) -> None:
    """Qwen3-VL: a video_url part gives the offline tokens and prompt (its frames' timestamps
    between the groups), processed on the request thread and checked by the engine."""
    from paged_engine import LLM
    from paged_engine.testing import write_tiny_qwen2_vl

    llm = LLM(
        str(write_tiny_qwen2_vl(tmp_path / "q3", version="3", seed=2)),
        dtype="float32",
        max_model_len=1024,
        block_size=16,
    )
    messages = _ask(_video_part(_video_url(clips.a)))
    want = offline_chat(llm, _hf(messages), {"video": decode_video(clips.a)}, MAX_TOKENS)
    text = llm.get_tokenizer().decode(want.prompt_ids)  # 10 frames at 5 fps: pairs at 0.1 s, ...
    assert "<0.1 seconds><|vision_start|>" in text and "<1.7 seconds><|vision_start|>" in text
    try:
        with serve_in_process(COMMON_ARGS, llm.llm_engine) as (http, _):
            body = _chat(http, messages)
    finally:
        llm.llm_engine.shutdown()
    assert body["choices"][0]["token_ids"] == want.ids
    assert body["prompt_token_ids"] == want.prompt_ids


def test_the_data_parallel_front_counts_a_video_as_tokens_not_bytes() -> None:
    from paged_server.data_parallel import _VIDEO_TOKENS, _estimate_tokens

    url = "data:video/mp4;base64," + "A" * 400_000
    chat = {"max_tokens": 10, "messages": _ask({"type": "video_url", "video_url": {"url": url}})}
    size = len(json.dumps(chat))
    assert _estimate_tokens(chat, size) == (size - len(url)) // 4 + _VIDEO_TOKENS + 10


# ---- errors ----------------------------------------------------------------------------------
NOT_A_VIDEO = "data:video/mp4;base64," + base64.b64encode(b"hello, not a video").decode()
BAD = [
    (_ask(_video_part(NOT_A_VIDEO)), VIDEO, "cannot be read as a video"),
    (_ask(_video_part("data:image/png;base64,aGk=")), VIDEO, "not a video"),
    (_ask(_video_part("data:video/mp4;base64,@@")), VIDEO, "not valid base64"),
    (_ask(_video_part("{host}/missing.mp4")), VIDEO, "HTTP 404"),
    (_ask(_video_part("file:///etc/hostname")), VIDEO, "outside"),
    (_ask(_video_part("clip.mp4")), VIDEO, "no scheme"),
    (_ask({"type": "video_url", "video_url": {}}), VIDEO, "data:video/"),
    ([{"role": "system", "content": [_video_part("data:,")]}], VIDEO, "user messages only"),
    (_ask(*[_video_part("x")] * 3), "messages", "limit of 2"),
]


@pytest.mark.parametrize(("messages", "param", "says"), BAD)
def test_bad_videos_are_400s_naming_the_param(qwen, video_host, messages, param, says) -> None:
    fill_host(messages, video_host)
    err = _refused(qwen.http, {**GREEDY, "messages": messages})
    assert err["param"] == param, err
    assert says in err["message"], err


@pytest.mark.parametrize(
    "value",
    [{"video": {"num_frames": 0}}, {"video": {"fps": 2}}, {"audio": {}}, [4], "4"],
)
def test_bad_media_io_kwargs(qwen, clips, value) -> None:
    body = {**GREEDY, "messages": _ask(_video_part("x")), "media_io_kwargs": value}
    err = _refused(qwen.http, body)
    assert err["param"] == "media_io_kwargs", err


def test_a_model_without_videos_refuses_video_parts(qwen, monkeypatch) -> None:
    monkeypatch.setattr(qwen.app, "videos", None)
    err = _refused(qwen.http, {**GREEDY, "messages": _ask(_video_part("x"))})
    assert err["param"] == VIDEO and "takes no videos" in err["message"], err


def test_a_text_only_model_refuses_video_parts(tiny_model: str) -> None:
    from paged_engine import LLMEngine

    engine = LLMEngine(model=tiny_model, dtype="float32", max_model_len=128)
    try:
        with serve_in_process(COMMON_ARGS, engine) as (http, app):
            assert app.videos is None and not app.takes_media
            err = _refused(http, {**GREEDY, "messages": _ask(_video_part("x"))})
            assert err["param"] == "messages[0].content" and "text only" in err["message"]
    finally:
        engine.shutdown()


# ---- flags -----------------------------------------------------------------------------------
def test_video_flags_reach_the_engine_and_the_loader(monkeypatch, tmp_path: Path) -> None:
    import paged_engine
    from paged_server.cli import build_engine, parse_args

    seen = {}
    monkeypatch.setattr(paged_engine, "LLMEngine", lambda config: seen.update(c=config))
    build_engine(parse_args(["m", "--limit-mm-per-prompt", '{"image": 1, "video": 2}']))
    assert seen["c"].limit_mm_per_prompt == {"image": 1, "video": 2}
    build_engine(parse_args(["m", "--limit-mm-per-prompt", "video=0"]))
    assert seen["c"].limit_mm_per_prompt == {"video": 0}
    args = parse_args(["m", "--media-io-kwargs", '{"video": {"num_frames": 8}}'])
    assert args.media_io_kwargs == {"video": {"num_frames": 8}}
