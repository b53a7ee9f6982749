"""Hostile media inputs and hostile MODEL output (a fine-tuned model can write anything), kept as
regressions of an outside-style audit:

- Tool-call text nested past Python's recursion limit (`<tool_call>` then 1500 "["): json.loads
  raises RecursionError, not ValueError, and the chat answer was a 500 (streamed: an error
  event instead of the text). It is content now, as any call that cannot be read (vLLM's rule).
- Streaming tool calls rescanned the whole text on every piece: quadratic (20k characters of
  arguments took over 10 s in 4-character pieces for hermes, llama3_json, internlm, pythonic).
  The rescans are amortized now (streaming.py): O(n) characters scanned for an n-character
  output, a 200k-character one streams in well under a second of CPU (xlam also passes over
  the blocks it already found closed and not calls: 200k characters of ``` took 5 s).
- qwen3_coder dropped the whole text of an output with `<tool_call>` but no `<function=`
  (content None, no calls); it is content now.
- Idefics3's mm_processor_kwargs max_image_size {"longest_edge": 10**6} resized a 72 x 40 image
  to multiples of that edge (10 s, 2.7 GB before its 400); refused by the pixel budget now.
- A PNG of 12000 x 12000 (550 KB) decoded into 2.7 GB: Pillow only warns between
  MAX_IMAGE_PIXELS and twice that. Refused (400 naming the part) before decoding now.
- A 3.6 KB WAV file claiming 1 Hz took 300 s to resample (the direct filter, 12 x the output);
  rates of many phases and few taps take the polyphase table now (0.4 s).
- A WAV file of millions of empty chunks was walked for seconds (6 s for 16 MB); only the
  first 1024 chunks are read now.
- A video whose container claims a huge frame count made a list (and a set) of every index
  before the pixel budget was checked; the budget is checked on the count first now.
"""

from __future__ import annotations

import base64
import struct
import threading
import time
import tracemalloc
import zlib
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from fake_engine import ScriptedEngine
from server_proc import chat_stream, serve_in_process

from paged_server.errors import APIError
from paged_server.media import MediaLoader, MediaRef
from paged_server.tool_parsers import TOOL_PARSERS, ToolParser
from paged_server.tool_parsers.base import parse_or_content

# past the recursion limit of json.loads / ast: 1000, or 2000 once torch inductor has compiled
# something in the process (compile_fx raises it), as in a full suite
DEPTH = 3000  # (the {"a": script must fit max_model_len below)
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
ARGS = ["--max-model-len", "16384", "--served-model-name", "tiny", "--client-timeout", "3"]


@pytest.fixture(scope="module")
def hermes() -> Iterator[SimpleNamespace]:
    engine = ScriptedEngine(max_model_len=16384, step_time=0.0)
    with serve_in_process([*ARGS, "--tool-call-parser", "hermes"], engine) as (http, _):
        yield SimpleNamespace(http=http, engine=engine)


@pytest.mark.parametrize("nest", ["[", '{"a":'])
def test_deeply_nested_tool_call_text_is_content_not_a_500(hermes, nest: str) -> None:
    script = "<tool_call>" + nest * DEPTH
    hermes.engine.script = script
    body = {"messages": [{"role": "user", "content": "Hi"}], "tools": TOOLS}
    status, _, payload = hermes.http.request("POST", "/v1/chat/completions", body)
    assert status == 200, payload
    (choice,) = payload["choices"]
    assert choice["message"]["content"] == script and not choice["message"].get("tool_calls")
    streamed = chat_stream(hermes, script, tools=TOOLS)  # (asserts it ends with [DONE])
    assert streamed["content"] == script and not streamed["calls"]
    assert streamed["finish"] == "stop"


def _hostile(marker: str) -> dict[str, str]:
    return {
        "deep list": marker + "[" * DEPTH,
        "deep object": marker + '{"name": "f", "arguments": ' + '{"a":' * DEPTH,
        "deep args": marker + '{"name": "f", "arguments": {"a": ' + "[" * DEPTH + "]" * DEPTH,
        "deep call": marker + "f(a=" + "(" * DEPTH,
        "unterminated": marker + '{"name": "f", "arguments": {"a": "' + "x" * 3000,
    }


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_every_parser_keeps_unreadable_output_as_content(name: str) -> None:
    """Whole and streamed: no exception, and text that is no call comes back whole."""
    cls = TOOL_PARSERS[name]
    for case, text in _hostile((cls.start_markers or ("",))[0]).items():
        content, calls = parse_or_content(cls(), text)
        stream = cls().streamer()
        shown = "".join(stream.feed(text[i : i + 7])[0] for i in range(0, len(text), 7))
        rest, _, streamed_calls = stream.finish()
        if not calls:
            assert content == text, (name, case)
        if not streamed_calls:
            assert shown + rest == text, (name, case)


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("seed_oss", "<seed:tool_call><function=f><parameter=a>{}</parameter></function>"),
        ("minimax_m2", '<minimax:tool_call><invoke name="f"><parameter name="a">{}</parameter>'),
    ],
)
def test_a_deep_value_typed_by_the_schema_streams_as_content(name: str, text: str) -> None:
    """These parsers read a value the schema types as an array with json.loads while the
    call streams: past the recursion limit, the stream goes on and the text stays content."""
    text = text.format("[" * DEPTH + "]" * DEPTH)
    parser = TOOL_PARSERS[name]()
    parser.schemas = {"f": {"type": "object", "properties": {"a": {"type": "array"}}}}
    stream = parser.streamer()
    sent = [stream.feed(text[i : i + 5]) for i in range(0, len(text), 5)]
    rest, entries, calls = stream.finish()
    assert not calls and not entries  # (the call's name went out when it arrived)
    assert "".join(c for c, _ in sent) + rest == text


class _CountingParser(ToolParser):
    """Counts the characters its partial_calls is given (what a real parser rescans)."""

    start_markers = ("<tool_call>",)

    def __init__(self) -> None:
        self.scanned = 0

    def parse(self, text: str):
        return text, []

    def partial_calls(self, text: str) -> list:
        self.scanned += len(text)
        return []


def test_streaming_rescans_are_linear_in_the_output() -> None:
    parser = _CountingParser()
    stream = parser.streamer()
    text = "<tool_call>" + "x" * 200_000
    for i in range(0, len(text), 4):
        stream.feed(text[i : i + 4])
    assert parser.scanned < 20 * len(text)  # every piece rescanned: 5e9 characters


@pytest.mark.parametrize(
    ("name", "body"),
    [
        ("hermes", '{"name": "f", "arguments": {"a": [' + "1," * 25_000 + "1]}}"),
        ("llama3_json", '{"name": "f", "parameters": {"a": [' + "[]," * 16_000 + "1]}}"),
        ("pythonic", "[f(a=(" + "1," * 25_000 + "1))]"),
        ("qwen3_coder", "<function=f><parameter=a>" + "<" * 50_000),
        ("xlam", "```" * 16_000),
    ],
)
def test_a_long_call_streams_in_linear_time(name: str, body: str) -> None:
    """50k characters in 4-character pieces (the audit's numbers at 200k are in the commit
    message: 0.05-1 s a parser); quadratic, these took minutes."""
    parser = TOOL_PARSERS[name]()
    text = (parser.start_markers[0] if name == "hermes" else "") + body
    stream = parser.streamer()
    t0 = time.perf_counter()
    for i in range(0, len(text), 4):
        stream.feed(text[i : i + 4])
    stream.finish()
    assert time.perf_counter() - t0 < 5.0  # ~0.1 s; generous: the CPUs are shared


def test_xlam_passes_over_closed_blocks_once(monkeypatch) -> None:
    """A stream of 16k empty ``` fences: each closed block is read (json.loads) about once,
    not again on every rescan (400k reads; 5 s for 200k characters)."""
    from paged_server.tool_parsers.xlam import XlamToolParser

    reads = []
    read = XlamToolParser._calls
    monkeypatch.setattr(
        XlamToolParser, "_calls", lambda self, body: reads.append(1) or read(self, body)
    )
    text = "```" * 16_000
    stream = XlamToolParser().streamer()
    for i in range(0, len(text), 4):
        stream.feed(text[i : i + 4])
    assert len(reads) < 3 * 16_000
    assert stream.finish()[0] == text  # no calls: all content


def _png(width: int, height: int) -> bytes:
    """A 1-bit grayscale PNG of zeros: a few KB however many pixels it claims."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    row = b"\x00" * (1 + (width + 7) // 8)
    pixels = zlib.compress(row * height, 9)
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")
    )


def _url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


@pytest.mark.filterwarnings("ignore:Image size")  # (Pillow warns at open, as it should)
def test_an_image_over_max_image_pixels_is_refused_before_decoding(monkeypatch) -> None:
    """Pillow raises only past twice its limit; between, it decodes (and warns)."""
    image_mod = pytest.importorskip("PIL.Image")
    monkeypatch.setattr(image_mod, "MAX_IMAGE_PIXELS", 1000)
    ref = MediaRef(_url(_png(40, 40), "image/png"), "messages[0].content[1].image_url")
    with pytest.raises(APIError) as e:
        MediaLoader().load(ref)
    assert e.value.status == 400 and "40 x 40 pixels" in str(e.value)
    assert "messages[0].content[1].image_url" in str(e.value)
    monkeypatch.setattr(image_mod, "MAX_IMAGE_PIXELS", None)  # the operator lifted the limit
    assert MediaLoader().load(ref).size == (40, 40)
    monkeypatch.setattr(image_mod, "MAX_IMAGE_PIXELS", 1600)  # at the limit: taken
    assert MediaLoader().load(ref).size == (40, 40)


def _wav(rate: int, samples: bytes, junk_chunks: int = 0) -> bytes:
    """8-bit mono PCM, `junk_chunks` empty chunks before the fmt chunk."""
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate, 1, 8)
    body = b"WAVE" + b"junk\x00\x00\x00\x00" * junk_chunks + b"fmt " + struct.pack("<I", 16) + fmt
    body += b"data" + struct.pack("<I", len(samples)) + samples
    return b"RIFF" + struct.pack("<I", len(body)) + body


def test_a_wav_of_millions_of_empty_chunks_is_refused_quickly() -> None:
    ref = MediaRef(_url(_wav(16000, b"\x80" * 8, 2_000_000), "audio/wav"), "p", kind="audio")
    t0 = time.perf_counter()
    with pytest.raises(APIError) as e:
        MediaLoader().load(ref)
    assert e.value.status == 400 and "fmt and a data chunk" in str(e.value)
    assert time.perf_counter() - t0 < 3.0  # was 6 s (~0.3 s now, loaded: slack for CI)
    few = MediaRef(_url(_wav(16000, b"\x80" * 8, 10), "audio/wav"), "p", kind="audio")
    wave, rate = MediaLoader().load(few)
    assert rate == 16000 and wave.size == 8


def test_a_clip_of_a_few_hertz_takes_the_polyphase_table(monkeypatch) -> None:
    """7 Hz -> 16 kHz: 16000 phases of 21 taps (a small table); the direct filter costs 12 x
    the output (300 s for a 3.6 KB file claiming 1 Hz). Same filter: same samples."""
    np = pytest.importorskip("numpy")
    from paged_engine.multimodal import audio_io

    x = np.random.default_rng(0).standard_normal(30).astype(np.float32)
    want = audio_io._resample_direct(x, 7, 16000)

    def direct(*args) -> None:
        raise AssertionError("the direct filter")

    monkeypatch.setattr(audio_io, "_resample_direct", direct)
    np.testing.assert_allclose(audio_io.resample(x, 7, 16000), want, atol=1e-5)


def test_a_video_claiming_a_huge_frame_count_is_refused_before_listing_them(monkeypatch) -> None:
    pytest.importorskip("av")
    from paged_engine.multimodal import video_io

    # the container says 3M frames of 10 x 10: 300M pixels, over MAX_VIDEO_PIXELS
    monkeypatch.setattr(video_io, "_probe", lambda av, data: (3_000_000, 24.0, (10, 10)))
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="over"):
            video_io.decode_video(b"", -1, what="p")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 20 << 20  # a list and a set of 3M indices: over 250 MB


def test_idefics3_tiles_over_the_pixel_budget_are_refused_before_resizing() -> None:
    """Idefics3 resizes an image to multiples of max_image_size's edge before cutting tiles:
    {"longest_edge": 10**6} made a 72 x 40 image into 10**12 pixels (10 s, 2.7 GB, then a 400);
    the budget refuses it by name before any pixel is made."""
    from paged_engine.multimodal.kwargs_budget import MOST_PIXELS, check_budget

    defaults = SimpleNamespace(size={"longest_edge": 1456}, max_image_size={"longest_edge": 364})
    huge = {"do_image_splitting": True, "max_image_size": {"longest_edge": 10**6}}
    with pytest.raises(ValueError, match=r"mm_processor_kwargs\['max_image_size'\]"):
        check_budget(huge, defaults, (72, 40), None, None)
    check_budget({"max_image_size": {"longest_edge": 512}}, defaults, (72, 40), None, None)
    side = int(MOST_PIXELS**0.5)  # one tile of the whole budget: taken; 2 x 2 of them: not
    check_budget({"max_image_size": {"longest_edge": side}}, defaults, (72, 40), None, None)
    bigger = {"size": {"longest_edge": 4096}, "max_image_size": {"longest_edge": 3000}}
    with pytest.raises(ValueError, match="4 tiles of 3000 x 3000"):
        check_budget(bigger, defaults, (72, 40), None, None)


def test_the_server_keeps_serving_after_hostile_output(hermes) -> None:
    """Several hostile answers at once, then a plain one."""
    hermes.engine.script = "<tool_call>" + "[" * DEPTH
    body = {"messages": [{"role": "user", "content": "Hi"}], "tools": TOOLS, "max_tokens": 64}
    answers: list[int] = []
    workers = [
        threading.Thread(
            target=lambda: answers.append(
                hermes.http.request("POST", "/v1/chat/completions", body)[0]
            )
        )
        for _ in range(4)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert answers == [200] * 4
    hermes.engine.script = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    status, _, payload = hermes.http.request("POST", "/v1/chat/completions", body)
    assert status == 200
    (call,) = payload["choices"][0]["message"]["tool_calls"]
    assert call["function"] == {"name": "f", "arguments": '{"a": 1}'}


def test_a_truncated_or_foreign_file_is_a_400_naming_the_part() -> None:
    """What was already right, kept: bad base64 padding, a wrong mime, an SVG, a PNG cut short,
    a WAV of 0 Hz or of 0 channels."""
    png = _png(4, 4)
    mono = _wav(16000, b"\x80" * 8)
    no_channels = mono.replace(b"\x01\x00\x01\x00", b"\x01\x00\x00\x00", 1)
    cases = [
        MediaRef("data:image/png;base64,AAAAA", "p"),
        MediaRef(_url(b"hi", "text/plain"), "p"),
        MediaRef(_url(b'<svg xmlns="http://www.w3.org/2000/svg"/>', "image/svg+xml"), "p"),
        MediaRef(_url(png[:40], "image/png"), "p"),
        MediaRef(_url(_wav(0, b"\x80" * 8), "audio/wav"), "p", kind="audio"),
        MediaRef(_url(no_channels, "audio/wav"), "p", kind="audio"),
    ]
    for ref in cases:
        with pytest.raises(APIError) as e:
            MediaLoader().load(ref)
        assert e.value.status == 400 and e.value.message.startswith("p: "), ref.url[:40]
    assert MediaLoader().load(MediaRef(_url(png, "image/png"), "p")).size == (4, 4)


@pytest.mark.parametrize("name", ["glm45", "llama3_json", "hermes"])
def test_a_long_stream_of_whitespace_or_text_stays_linear(name) -> None:
    """A streamed output is fed a piece at a time: each feed reads only what it added (the
    marker search, the no-content check under the whitespace rule), and the text grows in
    place. 200k spaces through glm45 took 15 s (each feed re-read and re-stripped the held
    whitespace); ~0.5 s now."""
    from paged_server.tool_parsers import TOOL_PARSERS

    for piece, n in ((" ", 200_000), ("ab ", 100_000)):
        stream = TOOL_PARSERS[name]().streamer()
        start = time.perf_counter()
        for _ in range(n):
            stream.feed(piece)
        _, _, calls = stream.finish()
        assert time.perf_counter() - start < 4.0, (name, repr(piece))
        assert calls == []
