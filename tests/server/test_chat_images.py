"""Images in the OpenAI server (a tiny random LLaVA, CLIP tower): a chat request's image parts
(data: / http(s): / file: URLs, OpenAI's `{"url": ...}` or vLLM's bare string) give exactly the
greedy tokens of offline `LLM.generate` over the same rendered prompt and PIL images; usage,
/tokenize and the Responses API count the expanded placeholders; every unreadable image, refused
URL or part, and too many images is a 400 naming the parameter, and the server keeps serving;
a text-only model refuses image parts; the flags (--limit-mm-per-prompt,
--allowed-local-media-path, the fetch timeout variable) and the loader's limits."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest
from server_proc import (
    COMMON_ARGS,
    ServerProc,
    data_parallel_front,
    fill_host,
    offline_chat,
    serve_in_process,
)

np = pytest.importorskip("numpy")
Image = pytest.importorskip("PIL.Image")

from paged_server.errors import APIError  # noqa: E402
from paged_server.media import MediaLoader, MediaRef, fetch_timeout  # noqa: E402

MAX_TOKENS = 6
QUESTION = "What is it?"
GREEDY = {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
PLAIN = {**GREEDY, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


def _png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def _data_url(image) -> str:
    return "data:image/png;base64," + base64.b64encode(_png(image)).decode()


def _image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def _ask(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}]


def _two_turns(first_url: str, second_url: str) -> list[dict]:
    """A conversation with an image in each user turn: the first before its text, the second
    after."""
    return [
        {"role": "user", "content": [_image_part(first_url), {"type": "text", "text": "first"}]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "text", "text": "and"}, _image_part(second_url)]},
    ]


def _hf(messages: list[dict]) -> list[dict]:
    """The same conversation in Hugging Face's parts form, as the chat template takes it."""
    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            content = [p if p["type"] == "text" else {"type": "image"} for p in content]
        out.append({"role": m["role"], "content": content})
    return out


@pytest.fixture(scope="module")
def pictures() -> list:
    rng = np.random.default_rng(0)
    noise = [Image.fromarray(rng.integers(0, 255, (40, 50, 3), dtype=np.uint8)) for _ in range(2)]
    return [*noise, Image.new("RGB", (30, 30), (255, 0, 0))]


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory, pictures: list) -> Path:
    d = tmp_path_factory.mktemp("media")
    (d / "first.png").write_bytes(_png(pictures[0]))
    return d


@pytest.fixture(scope="module")
def image_host(pictures: list) -> Iterator[str]:
    """A local HTTP server: /first.png, /text (not an image), /slow.png (half a second late),
    /to-localhost (a redirect to /first.png at host "localhost"), anything else a 404."""
    files = {"/first.png": _png(pictures[0]), "/text": b"hello, not an image"}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/to-localhost":
                self.send_response(302)
                where = f"http://localhost:{self.server.server_address[1]}/first.png"
                self.send_header("Location", where)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            if self.path == "/slow.png":
                time.sleep(0.5)
            body = files.get(self.path.replace("/slow.png", "/first.png"))
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            with contextlib.suppress(ConnectionError):  # /slow.png: the client gave up
                self.wfile.write(body or b"")

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    yield "http://127.0.0.1:{}".format(*server.server_address[1:])
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def llava(
    tmp_path_factory: pytest.TempPathFactory, pictures: list, media_dir: Path
) -> Iterator[SimpleNamespace]:
    """A tiny LLaVA (at most 2 images a prompt) behind a server in this process, with the
    offline answers to compare with computed first on the same engine."""
    from paged_engine import LLM
    from paged_engine.testing import write_tiny_llava

    path = write_tiny_llava(tmp_path_factory.mktemp("tiny-llava"), vision="clip", seed=0)
    llm = LLM(
        str(path),
        dtype="float32",
        max_model_len=256,
        num_gpu_blocks_override=128,
        limit_mm_per_prompt={"image": 2},
    )

    def offline(messages: list[dict], images: list) -> SimpleNamespace:
        return offline_chat(llm, _hf(messages), {"image": images}, MAX_TOKENS)

    want = {
        "first": offline(_ask(_image_part("A")), [pictures[0]]),
        "second": offline(_ask(_image_part("A")), [pictures[1]]),
        "two": offline(_two_turns("A", "B"), [pictures[0], pictures[1]]),
    }
    args = [*COMMON_ARGS, "--allowed-local-media-path", str(media_dir)]
    try:
        with serve_in_process(args, llm.llm_engine) as (http, app):
            yield SimpleNamespace(http=http, app=app, want=want)
    finally:
        llm.llm_engine.shutdown()


def _chat(server: ServerProc, messages: list[dict], **extra) -> dict:
    status, _, body = server.request(
        "POST", "/v1/chat/completions", {**GREEDY, "messages": messages, **extra}
    )
    assert status == 200, body
    return body


def _refused(server: ServerProc, path: str, body: dict) -> dict:
    """The 400's error object; the server then still answers a plain chat request."""
    status, _, payload = server.request("POST", path, body)
    assert status == 400, payload
    ok, _, after = server.request("POST", "/v1/chat/completions", PLAIN)
    assert ok == 200, after
    return payload["error"]


# ---- answers ---------------------------------------------------------------------------------
def test_a_data_url_image_gives_the_offline_greedy_tokens(llava, pictures) -> None:
    want = llava.want["first"]
    body = _chat(llava.http, _ask(_image_part(_data_url(pictures[0]))), return_token_ids=True)
    assert body["choices"][0]["token_ids"] == want.ids
    assert body["prompt_token_ids"] == want.prompt_ids
    # the one placeholder became the image's run of tokens, and usage counts them
    images = llava.app.images
    n_text = len(want.prompt_ids) - images.tokens_per_image + 1
    assert want.prompt_ids.count(images.image_token_id) == images.tokens_per_image
    assert body["usage"]["prompt_tokens"] == len(want.prompt_ids) > n_text
    # the image reaches the model: another picture, another answer
    other = _chat(llava.http, _ask(_image_part(_data_url(pictures[1]))), return_token_ids=True)
    assert other["choices"][0]["token_ids"] == llava.want["second"].ids != want.ids


def test_metrics_count_the_processor_caches_queries_and_hits(llava) -> None:
    """vLLM's mm_cache_queries / mm_cache_hits (items): an image the cache has not seen is a
    query and a miss, the same image again a query and a hit."""

    def counts() -> tuple[float, float]:
        m = llava.http.metrics()
        return m["paged:mm_cache_queries_total"], m["paged:mm_cache_hits_total"]

    fresh = Image.fromarray(np.random.default_rng(7).integers(0, 255, (20, 24, 3), np.uint8))
    before = counts()
    for _ in range(2):
        _chat(llava.http, _ask(_image_part(_data_url(fresh))), max_tokens=1)
    after = counts()
    assert (after[0] - before[0], after[1] - before[1]) == (2, 1)


def test_http_and_bare_string_urls_and_a_stream(llava, image_host) -> None:
    want = llava.want["first"]
    body = _chat(llava.http, _ask(_image_part(image_host + "/first.png")), return_token_ids=True)
    assert body["choices"][0]["token_ids"] == want.ids
    bare = {"type": "image_url", "image_url": image_host + "/first.png"}  # vLLM's form
    events = llava.http.stream(
        {**GREEDY, "messages": _ask(bare), "stream_options": {"include_usage": True}},
        "/v1/chat/completions",
    )
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert text == body["choices"][0]["message"]["content"]
    assert events[-1]["usage"]["prompt_tokens"] == len(want.prompt_ids)


def test_images_across_messages_keep_their_order(llava, pictures) -> None:
    messages = _two_turns(_data_url(pictures[0]), _data_url(pictures[1]))
    body = _chat(llava.http, messages, return_token_ids=True)
    assert body["choices"][0]["token_ids"] == llava.want["two"].ids
    assert body["usage"]["prompt_tokens"] == len(llava.want["two"].prompt_ids)


def test_a_file_url_inside_the_allowed_dir(llava, media_dir, monkeypatch) -> None:
    url = (media_dir / "first.png").as_uri()
    body = _chat(llava.http, _ask(_image_part(url)), return_token_ids=True)
    assert body["choices"][0]["token_ids"] == llava.want["first"].ids
    outside = _refused(
        llava.http,
        "/v1/chat/completions",
        {**GREEDY, "messages": _ask(_image_part(f"file://{media_dir}/../first.png"))},
    )
    assert "outside --allowed-local-media-path" in outside["message"]
    monkeypatch.setattr(llava.app, "media", MediaLoader())  # a server without the flag
    err = _refused(
        llava.http, "/v1/chat/completions", {**GREEDY, "messages": _ask(_image_part(url))}
    )
    assert err["param"] == "messages[0].content[0].image_url"
    assert "--allowed-local-media-path" in err["message"]


def test_tokenize_counts_the_image_tokens(llava, pictures) -> None:
    body = {"model": "tiny", "messages": _ask(_image_part(_data_url(pictures[0])))}
    status, _, out = llava.http.request("POST", "/tokenize", body)
    assert status == 200, out
    assert out["tokens"] == llava.want["first"].prompt_ids


def test_responses_api_input_image(llava, pictures) -> None:
    url = _data_url(pictures[0])
    content = [{"type": "input_image", "image_url": url}, {"type": "input_text", "text": QUESTION}]
    body = {"model": "tiny", "input": [{"role": "user", "content": content}], "temperature": 0}
    status, _, resp = llava.http.request("POST", "/v1/responses", {**body, "max_output_tokens": 4})
    assert status == 200, resp
    n_prompt = len(llava.want["first"].prompt_ids)
    assert resp["usage"]["input_tokens"] == n_prompt
    chat = _chat(llava.http, _ask(_image_part(url)), max_tokens=4, ignore_eos=False)
    assert resp["output"][-1]["content"][0]["text"] == chat["choices"][0]["message"]["content"]
    status, _, count = llava.http.request("POST", "/v1/responses/input_tokens", body)
    assert (status, count["input_tokens"]) == (200, n_prompt)
    status, _, items = llava.http.request("GET", f"/v1/responses/{resp['id']}/input_items")
    assert status == 200, items
    assert items["data"][0]["content"][0] == {
        "type": "input_image",
        "image_url": url,
        "detail": "auto",
    }
    follow = {"model": "tiny", "input": "And now?", "previous_response_id": resp["id"]}
    status, _, again = llava.http.request(
        "POST", "/v1/responses", {**follow, "max_output_tokens": 2}
    )
    assert status == 200, again  # the earlier turn's image runs again
    assert again["usage"]["input_tokens"] > n_prompt
    ftp = [{"type": "input_text", "text": "x"}, {"type": "input_image", "image_url": "ftp://a/b"}]
    err = _refused(
        llava.http, "/v1/responses", {**body, "input": [{"role": "user", "content": ftp}]}
    )
    assert err["param"] == "input[0].content[1].image_url", err
    assert err["message"].startswith("input[0].content[1].image_url: ")
    file_id = [{"type": "input_image", "file_id": "file-1"}]
    err = _refused(
        llava.http, "/v1/responses", {**body, "input": [{"role": "user", "content": file_id}]}
    )
    assert err["param"] == "input[0].content[0].image_url"


def test_through_the_data_parallel_front(llava, pictures) -> None:
    with data_parallel_front([llava.http]) as front:
        body = _chat(front, _ask(_image_part(_data_url(pictures[0]))), return_token_ids=True)
    assert body["choices"][0]["token_ids"] == llava.want["first"].ids


def test_the_front_counts_an_image_as_tokens_not_bytes() -> None:
    from paged_server.data_parallel import _estimate_tokens

    url = "data:image/png;base64," + "A" * 400_000
    chat = {"max_tokens": 10, "messages": _ask({"type": "image_url", "image_url": url})}
    size = len(json.dumps(chat))
    assert _estimate_tokens(chat, size) == (size - len(url)) // 4 + 576 + 10
    part = {"type": "input_image", "image_url": url}
    responses = {"max_output_tokens": 10, "input": [{"role": "user", "content": [part]}]}
    size = len(json.dumps(responses))
    assert _estimate_tokens(responses, size) == (size - len(url)) // 4 + 576 + 10


# ---- errors ----------------------------------------------------------------------------------
IMAGE = "messages[0].content[0].image_url"
NOT_AN_IMAGE = "data:image/png;base64," + base64.b64encode(b"hello, not an image").decode()
BAD = [
    (_ask(_image_part("data:image/png;base64,@@not base64@@")), IMAGE, "not valid base64"),
    (_ask(_image_part(NOT_AN_IMAGE)), IMAGE, "not an image"),
    (_ask(_image_part("data:text/plain;base64,aGk=")), IMAGE, "not an image"),
    (_ask(_image_part("ftp://example.com/a.png")), IMAGE, "'ftp:' is not supported"),
    (_ask(_image_part("a.png")), IMAGE, "no scheme"),
    (_ask(_image_part("file:///etc/hostname")), IMAGE, "outside"),
    (_ask(_image_part("{host}/missing.png")), IMAGE, "HTTP 404"),
    (_ask(_image_part("{host}/text")), IMAGE, "not an image"),
    (_ask(_image_part("http://127.0.0.1:1/a.png")), IMAGE, "could not be fetched"),
    (_ask({"type": "image_url", "image_url": {}}), IMAGE, "must be {'url': URL}"),
    (
        _ask({"type": "image_url", "image_url": {"url": "x", "detail": "max"}}),
        IMAGE + ".detail",
        "detail",
    ),
    (
        _ask({"type": "input_audio", "input_audio": {}}),
        "messages[0].content[0].input_audio",
        "base64 'data'",
    ),
    (  # a well-formed clip to a model without audio
        _ask({"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}),
        "messages[0].content[0].input_audio",
        "takes no audio (audio runs on",
    ),
    (_ask({"type": "file", "file": {}}), "messages[0].content", "'file'"),
    (
        [{"role": "system", "content": [_image_part("data:,")]}],
        IMAGE,
        "user messages only",
    ),
    (  # the text holds the image token itself: two placeholders for one image
        [{"role": "user", "content": [_image_part("x"), {"type": "text", "text": "<image>"}]}],
        "messages",
        "one image placeholder per image",
    ),
    (_ask(*[_image_part("x")] * 3), "messages", "limit of 2"),
]


@pytest.mark.parametrize(("messages", "param", "says"), BAD)
def test_bad_images_are_400s_naming_the_param(llava, image_host, messages, param, says) -> None:
    fill_host(messages, image_host)
    err = _refused(llava.http, "/v1/chat/completions", {**GREEDY, "messages": messages})
    assert err["param"] == param, err
    assert says in err["message"], err


def test_a_text_only_model_refuses_images(tiny_model: str, pictures) -> None:
    from paged_engine import LLMEngine

    engine = LLMEngine(model=tiny_model, dtype="float32", max_model_len=128)
    try:
        with serve_in_process(COMMON_ARGS, engine) as (http, app):
            assert app.images is None
            body = {**GREEDY, "messages": _ask(_image_part(_data_url(pictures[0])))}
            err = _refused(http, "/v1/chat/completions", body)
            assert err["param"] == "messages[0].content"
            assert "text only" in err["message"]
            content = [{"type": "input_image", "image_url": "data:,"}]
            resp = {"input": [{"role": "user", "content": content}]}
            assert _refused(http, "/v1/responses", resp)["param"] == "input[0].content[0]"
    finally:
        engine.shutdown()


# ---- the loader ------------------------------------------------------------------------------
def test_loader_limits_timeout_and_transparency(image_host, pictures) -> None:
    ref = MediaRef(image_host + "/first.png", "p")
    assert MediaLoader().load(ref).size == pictures[0].size
    with pytest.raises(APIError, match="over 0 MiB") as e:
        MediaLoader(max_bytes={"image": 100}).load(ref)
    assert (e.value.status, e.value.param) == (400, "p")
    with pytest.raises(APIError, match="timed out"):
        MediaLoader(timeout={"image": 0.1}).load(MediaRef(image_host + "/slow.png", "p"))
    clear = Image.new("RGBA", (4, 4), (10, 20, 30, 0))  # fully transparent: white, as vLLM
    loaded = MediaLoader().load(MediaRef(_data_url(clear), "p"))
    assert loaded.mode == "RGB" and loaded.getpixel((0, 0)) == (255, 255, 255)
    gray = MediaLoader().load(MediaRef(_data_url(Image.new("L", (4, 4), 7)), "p"))
    assert (gray.mode, gray.getpixel((0, 0))) == ("RGB", (7, 7, 7))


def test_allowed_media_domains_and_their_redirects(image_host, pictures) -> None:
    """--allowed-media-domains: URLs from other hosts are 400s naming the part, and so is a
    redirect from a listed host to one that is not."""
    ref = MediaRef(image_host + "/first.png", "messages[0].content[1].image_url")
    assert MediaLoader(domains=["127.0.0.1"]).load(ref).size == pictures[0].size
    with pytest.raises(APIError, match=r"'127\.0\.0\.1' are refused.*example\.com") as e:
        MediaLoader(domains=["example.com"]).load(ref)
    assert (e.value.status, e.value.param) == (400, ref.param)
    hop = MediaRef(image_host + "/to-localhost", "p")
    with pytest.raises(APIError, match="'localhost' are refused") as e:
        MediaLoader(domains=["127.0.0.1"]).load(hop)
    assert e.value.param == "p"
    both = MediaLoader(domains=["127.0.0.1", "LocalHost"])
    assert both.load(hop).size == pictures[0].size
    assert MediaLoader().load(hop).size == pictures[0].size  # no list: any host


def test_fetch_timeout_variables() -> None:
    assert fetch_timeout({}) == 5.0
    assert fetch_timeout({"VLLM_IMAGE_FETCH_TIMEOUT": "2.5"}) == 2.5
    both = {"PAGED_IMAGE_FETCH_TIMEOUT": "1", "VLLM_IMAGE_FETCH_TIMEOUT": "9"}
    assert fetch_timeout(both) == 1.0
    for bad in ("0", "-1", "soon", "inf"):
        with pytest.raises(ValueError, match="VLLM_IMAGE_FETCH_TIMEOUT"):
            fetch_timeout({"VLLM_IMAGE_FETCH_TIMEOUT": bad})


# ---- flags -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "limit"),
    [
        ('{"image": 2}', {"image": 2}),
        ('{"image": 1, "video": 0}', {"image": 1, "video": 0}),
        ('{"image": {"count": 3, "width": 512, "height": 512}}', {"image": 3}),
        ("image=0", {"image": 0}),
        ("image=4,audio=0", {"image": 4, "audio": 0}),
    ],
)
def test_limit_mm_per_prompt_reaches_the_engine(monkeypatch, value, limit) -> None:
    import paged_engine
    from paged_server.cli import build_engine, parse_args

    seen = {}
    monkeypatch.setattr(paged_engine, "LLMEngine", lambda config: seen.update(c=config))
    build_engine(parse_args(["m", "--limit-mm-per-prompt", value]))
    assert seen["c"].limit_mm_per_prompt == limit
    build_engine(parse_args(["m", "--mm-processor-kwargs", '{"max_pixels": 1003520}']))
    assert seen["c"].mm_processor_kwargs == {"max_pixels": 1003520}
    assert seen["c"].mm_processor_cache_gb == 4.0
    build_engine(parse_args(["m", "--mm-processor-cache-gb", "0"]))
    assert seen["c"].mm_processor_cache_gb == 0


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--limit-mm-per-prompt", '{"image": -1}'], "integer >= 0"),
        (["--limit-mm-per-prompt", '{"audio": "one"}'], "integer >= 0"),
        (["--limit-mm-per-prompt", '{"pictures": 1}'], "unknown modality"),
        (["--limit-mm-per-prompt", "image"], "MODALITY=COUNT"),
        (["--limit-mm-per-prompt", "{image: 2}"], "not JSON"),
        (["--allowed-local-media-path", "/no/such/dir"], "not an existing directory"),
        (["--mm-processor-kwargs", "max_pixels=3"], "JSON"),
        (["--media-io-kwargs", '{"video": {"num_frames": 0}}'], "num_frames"),
        (["--media-io-kwargs", '{"video": {"frames": 3}}'], "num_frames"),
    ],
)
def test_bad_media_flags_stop_at_startup(capsys, argv, says) -> None:
    from paged_server.cli import parse_args

    with pytest.raises(SystemExit):
        parse_args(["m", *argv])
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("variable", ["VLLM_IMAGE_FETCH_TIMEOUT", "VLLM_VIDEO_FETCH_TIMEOUT"])
def test_a_bad_fetch_timeout_stops_at_startup(capsys, monkeypatch, variable) -> None:
    from paged_server.cli import parse_args
    from paged_server.vllm_flags import IGNORED

    assert "--limit-mm-per-prompt" not in IGNORED and "--media-io-kwargs" not in IGNORED
    monkeypatch.setenv(variable, "soon")
    with pytest.raises(SystemExit):
        parse_args(["m"])
    assert variable in capsys.readouterr().err


# ---- LLaVA-NeXT: an image's size decides its run -------------------------------------------
@pytest.fixture(scope="module")
def llava_next(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    """A tiny LLaVA-NeXT (anyres tiles) behind a server in this process."""
    from paged_engine import LLM, SamplingParams
    from paged_engine.testing import write_tiny_llava

    path = write_tiny_llava(
        tmp_path_factory.mktemp("tiny-llava-next"),
        seed=1,
        grid_pinpoints=[[30, 60], [60, 30], [60, 60]],
    )
    llm = LLM(str(path), dtype="float32", max_model_len=512, num_gpu_blocks_override=128)
    tok = llm.llm_engine.tokenizer

    def offline(image) -> SimpleNamespace:
        text = tok.apply_chat_template(
            _hf(_ask(_image_part("A"))), tokenize=False, add_generation_prompt=True
        )
        ids = tok.encode(text, add_special_tokens=False)
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        (out,) = llm.generate(
            [{"prompt_token_ids": ids, "multi_modal_data": {"image": image}}], params
        )
        return SimpleNamespace(ids=list(out.outputs[0].token_ids), prompt_ids=out.prompt_token_ids)

    # a wide, a tall and a square picture; answered offline before the server's loop runs
    # the engine (two threads stepping one engine would race)
    rng = np.random.default_rng(3)
    shapes = [(24, 70, 3), (64, 30, 3), (50, 50, 3)]
    pictures = [Image.fromarray(rng.integers(0, 255, s, dtype=np.uint8)) for s in shapes]
    wants = [offline(p) for p in pictures]
    try:
        with serve_in_process(COMMON_ARGS, llm.llm_engine) as (http, app):
            yield SimpleNamespace(http=http, app=app, pictures=pictures, wants=wants)
    finally:
        llm.llm_engine.shutdown()


def test_llava_next_runs_follow_each_images_size(llava_next) -> None:
    """A wide, a tall and a square picture: each the offline tokens and prompt (a run as long
    as its size gives, counted in usage and by /tokenize); an unreadable one a 400."""
    lengths = set()
    for picture, want in zip(llava_next.pictures, llava_next.wants):
        messages = _ask(_image_part(_data_url(picture)))
        body = _chat(llava_next.http, messages, return_token_ids=True)
        assert body["choices"][0]["token_ids"] == want.ids
        assert body["prompt_token_ids"] == want.prompt_ids
        assert body["usage"]["prompt_tokens"] == len(want.prompt_ids)
        status, _, out = llava_next.http.request(
            "POST", "/tokenize", {"model": "tiny", "messages": messages}
        )
        assert status == 200 and out["tokens"] == want.prompt_ids
        lengths.add(len(want.prompt_ids))
    assert len(lengths) == len(llava_next.pictures)
    bad = {**GREEDY, "messages": _ask(_image_part("data:image/png;base64,aGVsbG8="))}
    error = _refused(llava_next.http, "/v1/chat/completions", bad)
    assert error["param"] == "messages[0].content[0].image_url"


# ---- Qwen2-VL (M-RoPE), Idefics3 (tiles between text), Mistral 3 (lines): sizes decide ------
@pytest.mark.parametrize("arch", ["qwen2_vl", "idefics3", "mistral3", "internvl", "gemma3"])
def test_sized_chat_images_give_the_offline_tokens(tmp_path: Path, arch: str) -> None:
    """A chat request's image on Qwen2-VL, Idefics3, Mistral 3, InternVL and Gemma 3: the
    offline tokens and prompt; usage and /tokenize count the image's tokens (by its size);
    mm_processor_kwargs reach the image processor (Gemma 3's images have one size)."""
    from paged_engine import LLM, SamplingParams
    from paged_engine.testing import (
        write_tiny_gemma3,
        write_tiny_idefics3,
        write_tiny_internvl,
        write_tiny_mistral3,
        write_tiny_qwen2_vl,
    )

    if arch == "qwen2_vl":
        path = write_tiny_qwen2_vl(tmp_path, seed=4)
        smaller = {"max_pixels": 16 * 64}
    elif arch == "idefics3":
        path = write_tiny_idefics3(tmp_path, seed=4)
        smaller = {"do_image_splitting": False}
    elif arch == "mistral3":
        path = write_tiny_mistral3(tmp_path, seed=4)
        smaller = {"size": {"longest_edge": 32}}
    elif arch == "internvl":
        path = write_tiny_internvl(tmp_path, seed=4)
        smaller = {"crop_to_patches": False}
    else:
        path = write_tiny_gemma3(tmp_path, seed=4)
        smaller = None
    llm = LLM(str(path), dtype="float32", max_model_len=512, num_gpu_blocks_override=64)
    tok = llm.llm_engine.tokenizer
    rng = np.random.default_rng(5)
    picture = Image.fromarray(rng.integers(0, 255, (40, 72, 3), dtype=np.uint8))
    text = tok.apply_chat_template(
        _hf(_ask(_image_part("A"))), tokenize=False, add_generation_prompt=True
    )
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompt = {"prompt_token_ids": tok.encode(text, add_special_tokens=False)}
    (want,) = llm.generate([{**prompt, "multi_modal_data": {"image": picture}}], params)
    try:
        with serve_in_process(COMMON_ARGS, llm.llm_engine) as (http, _):
            messages = _ask(_image_part(_data_url(picture)))
            body = _chat(http, messages, return_token_ids=True)
            assert body["choices"][0]["token_ids"] == list(want.outputs[0].token_ids)
            assert body["prompt_token_ids"] == want.prompt_token_ids
            assert body["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
            status, _, out = http.request(
                "POST", "/tokenize", {"model": "tiny", "messages": messages}
            )
            assert status == 200 and out["tokens"] == want.prompt_token_ids
            # vLLM's mm_processor_kwargs: a smaller image, fewer tokens; a bad name a 400
            if smaller is not None:
                small = _chat(http, messages, mm_processor_kwargs=smaller)
                assert small["usage"]["prompt_tokens"] < len(want.prompt_token_ids)
            for bad in ({"merge_size": 1}, [1]):
                err = _refused(http, "/v1/chat/completions", {**GREEDY, "messages": messages,
                               "mm_processor_kwargs": bad})  # fmt: skip
                assert err["param"] == "mm_processor_kwargs"
    finally:
        llm.llm_engine.shutdown()
