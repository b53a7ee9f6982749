"""/v1/audio/transcriptions and /v1/audio/translations (transcriptions.py, multipart.py) over a
tiny random Whisper (tests/engine/test_whisper.py's checkpoint: 2 s windows, with
<|startofprev|> added to its tokenizer) served in this process.

A WAV upload must give exactly what `LLM.generate` gives on the same decoded clip and the
host side's transcription prompt: without `language`, in the language transformers'
`detect_language` picks for the (first window of the) clip (not "en": the tiny checkpoint's
pick); json (with its duration usage), text, verbose_json (the language, duration, and the
segments `timestamp_segments` parses from the tokens generated after the timestamp prompt:
times offset by each window's start, their tokens and mean logprobs; sampled at temperature 100
so that timestamp tokens come out), an SSE stream of transcription.chunk deltas
(and its usage chunk), the client's `prompt` as <|startofprev|> context, a translation, the
official openai client's upload; a clip over the window is split at its quiet points (checked
against `split_windows`' spans) and its text is the windows' texts joined, each run alone by
`LLM.generate` (srt / vtt cues at the segments' times). Malformed forms and bad fields are 400s
naming the field, a text-only model answers 400 naming `model`, and the server keeps serving.
"""

from __future__ import annotations

import http.client
import io
import itertools
import json
import wave as wavfile
from pathlib import Path

import pytest
from server_proc import COMMON_ARGS, serve_in_process

np = pytest.importorskip("numpy")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.whisper")

import test_whisper  # noqa: E402  (tests/engine: the tiny checkpoint's builder)

from paged_engine import LLM, SamplingParams  # noqa: E402
from paged_engine.multimodal.audio_io import audio_item, load_audio  # noqa: E402
from paged_engine.multimodal.whisper import whisper_prompt  # noqa: E402
from paged_server.errors import APIError  # noqa: E402
from paged_server.multipart import parse_form  # noqa: E402
from paged_server.transcriptions import split_windows  # noqa: E402

SR = 16000
TOKENS = 6  # max_completion_tokens of every request
BOUNDARY = "paged-test-boundary"
CONTEXT = "the previous words"


def wav_bytes(samples: np.ndarray, rate: int = SR) -> bytes:
    """A 16-bit PCM mono WAV file of `samples` (floats in [-1, 1])."""
    buf = io.BytesIO()
    with wavfile.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def tone(seconds: float, freq: float, amp: float = 0.4, rate: int = SR, seed: int = 0):
    t = np.arange(int(seconds * rate)) / rate
    noise = np.random.default_rng(seed).standard_normal(t.size)
    return (amp * np.sin(2 * np.pi * freq * t) + 0.05 * noise).astype(np.float32)


def long_clip() -> np.ndarray:
    """4.6 s at 16 kHz: three tones (the tiny model says something else for each) between
    0.1 s silences at 1.5 s and 3.05 s, each a whole 0.1 s stretch of the last second of the
    window its split looks in ([1, 2) s, then [2.55, 3.55) s)."""
    wave = np.zeros(73600, dtype=np.float32)
    wave[:24000] = tone(1.5, 300)
    wave[25600:48800] = tone(1.45, 3000, 0.9, seed=1)
    wave[50400:] = tone(1.45, 4000, 0.9, seed=2)
    return wave


def form(fields: dict[str, object], file: bytes | None = None, name: str = "a.wav") -> bytes:
    """A multipart/form-data body: each field (a list: repeated), then the file part."""
    out = b""
    for key, value in fields.items():
        for v in value if isinstance(value, list) else [value]:
            out += (
                f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{key}"\r\n\r\n{v}\r\n'
            ).encode()
    if file is not None:
        head = (
            f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="{name}"'
            "\r\nContent-Type: audio/wav\r\n\r\n"
        )
        out += head.encode() + file + b"\r\n"
    return out + f"--{BOUNDARY}--\r\n".encode()


def post(server, path: str, body: bytes, ctype: str | None = None):
    """(status, content type, parsed JSON or text)."""
    ctype = ctype or f"multipart/form-data; boundary={BOUNDARY}"
    status, headers, data = server.request("POST", path, body, {"Content-Type": ctype})
    return status, headers.get("Content-Type", ""), data


def transcribe(server, file: bytes, route: str = "transcriptions", **fields):
    fields = {"model": "tiny", "max_completion_tokens": TOKENS, **fields}
    return post(server, f"/v1/audio/{route}", form(fields, file))


def events(server, file: bytes, route: str = "transcriptions", **fields) -> list[dict]:
    """The SSE events of a streamed transcription; asserts [DONE] ends them."""
    body = form(
        {"model": "tiny", "max_completion_tokens": TOKENS, "stream": "true", **fields}, file
    )
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    try:
        ctype = f"multipart/form-data; boundary={BOUNDARY}"
        conn.request("POST", f"/v1/audio/{route}", body, {"Content-Type": ctype})
        r = conn.getresponse()
        assert r.status == 200, r.read()
        out = []
        for line in r:
            if line.startswith(b"data: "):
                if line[6:].strip() == b"[DONE]":
                    return out
                out.append(json.loads(line[6:]))
        raise AssertionError("no [DONE]")
    finally:
        conn.close()


@pytest.fixture(scope="module")
def whisper(tmp_path_factory) -> Path:
    return test_whisper.write_tiny_whisper(tmp_path_factory.mktemp("whisper-stt"))


def detect(path: Path, waves: list[np.ndarray]) -> list[str]:
    """transformers' detect_language on each clip (its language tokens: the tokenizer's)."""
    hf = transformers.WhisperForConditionalGeneration.from_pretrained(path).float().eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    codes = {tok.convert_tokens_to_ids(f"<|{c}|>"): c for c in test_whisper.LANGS}
    hf.generation_config.lang_to_id = {f"<|{c}|>": i for i, c in codes.items()}
    return [codes[hf.detect_language(test_whisper.features(path, w)).item()] for w in waves]


def timed_segments(host, outs: list, spans: list[tuple[int, int]]) -> list[dict]:
    """The segments the server must answer for windows `spans` whose generated tokens (after
    the timestamp prompt) are `outs`: the host side's parse, offset by each window's start."""
    want = []
    for (a, b), out in zip(spans, outs, strict=True):
        lps = [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs, strict=True)]
        for seg in host.timestamp_segments(list(out.token_ids), (b - a) / SR):
            mine = lps[seg.sampled[0] : seg.sampled[1]]
            want.append(
                {
                    "id": len(want),
                    "seek": round(a / SR * 100),
                    "start": pytest.approx(a / SR + seg.start),
                    "end": pytest.approx(a / SR + seg.end),
                    "text": seg.text,
                    "tokens": seg.tokens,
                    "avg_logprob": pytest.approx(np.mean(mine) if mine else 0.0, abs=1e-5),
                }
            )
    return want


def picked(segments: list[dict]) -> list[dict]:
    return [
        {k: s[k] for k in ("id", "seek", "start", "end", "text", "tokens", "avg_logprob")}
        for s in segments
    ]


@pytest.fixture(scope="module")
def served(whisper):
    """(the HTTP handle, the offline references) over one engine: the references are computed
    before the server's engine loop starts (one thread drives the engine)."""
    llm = LLM(str(whisper), dtype="float32", block_size=16, num_gpu_blocks_override=128)
    tok = llm.get_tokenizer()
    short = wav_bytes(tone(1.3, 440))
    long_wav = wav_bytes(long_clip())
    clip, sr = load_audio(short, "file")
    prev = tok.get_vocab()["<|startofprev|>"]
    hf_prompt = tok("<|startofprev|>", f" {CONTEXT}", add_special_tokens=False)["input_ids"]
    long_wave = audio_item(load_audio(long_wav, "file"), SR, "file")
    spans = split_windows(long_wave, SR, 2 * SR)
    windows = [long_wave[a:b] for a, b in spans]
    lang, long_lang = detect(whisper, [audio_item((clip, sr), SR, "file"), windows[0]])
    timed = [*whisper_prompt(tok, timestamps=True), tok.convert_tokens_to_ids("<|0.00|>")]
    prompts = {
        "en": whisper_prompt(tok),
        "auto": whisper_prompt(tok, lang),
        # HF's get_prompt_ids, then the prefix
        "context": hf_prompt + whisper_prompt(tok, lang),
        "fr-translate": whisper_prompt(tok, "fr", "translate"),
        "timed": timed,
        "timed-auto": [*whisper_prompt(tok, lang, timestamps=True), timed[-1]],
    }
    assert hf_prompt[0] == prev
    params = SamplingParams(temperature=0, max_tokens=TOKENS, logprobs=0)
    hot = SamplingParams(temperature=100, seed=5, max_tokens=24, logprobs=0)

    def run(ids: list[int], wave: np.ndarray, rate: int, p=params) -> object:
        req = {"prompt_token_ids": ids, "multi_modal_data": {"audio": (wave, rate)}}
        return llm.generate([req], p, use_tqdm=False)[0].outputs[0]

    refs = {k: run(ids, clip, sr) for k, ids in prompts.items()}
    refs["windows"] = [run(whisper_prompt(tok, long_lang), w, SR) for w in windows]
    refs["timed-windows"] = [run(timed, w, SR) for w in windows]
    refs["hot-windows"] = [run(timed, w, SR, hot) for w in windows]
    files = {"short": short, "long": long_wav, "duration": clip.size / sr, "spans": spans}
    files["languages"] = (lang, long_lang)
    with serve_in_process(COMMON_ARGS, llm.llm_engine) as (http_, app):
        yield http_, app, refs, files, prompts


def test_transcription_formats_match_generate(served) -> None:
    server, app, refs, files, prompts = served
    assert app.audios.transcription_window == 2 * SR
    ref, lang = refs["auto"], files["languages"][0]
    assert lang != "en"  # detected: not the default
    assert ref.cumulative_logprob != pytest.approx(refs["en"].cumulative_logprob, abs=1e-3)
    status, ctype, body = transcribe(server, files["short"])
    assert status == 200, body
    assert body == {"text": ref.text, "usage": {"type": "duration", "seconds": 2}}
    assert ref.text  # the tiny model says something
    status, ctype, body = transcribe(server, files["short"], response_format="text")
    assert (status, body) == (200, ref.text) and ctype.startswith("text/plain")
    _, _, body = transcribe(server, files["short"], response_format="text", language="en")
    assert body == refs["en"].text
    # verbose_json: the detected language; the timestamp prompt's segments (none emitted
    # greedily: one segment, <|0.00|> to the clip's end)
    _, _, body = transcribe(
        server,
        files["short"],
        response_format="verbose_json",
        language="en",
        **{"timestamp_granularities[]": "segment"},
    )
    timed = refs["timed"]
    assert (body["task"], body["language"]) == ("transcribe", "en")
    assert float(body["duration"]) == pytest.approx(files["duration"])
    n = int(files["duration"] * SR)
    assert picked(body["segments"]) == timed_segments(served[1].audios, [timed], [(0, n)])
    (seg,) = body["segments"]
    assert seg["tokens"] == [prompts["timed"][-1], *timed.token_ids]
    assert body["text"] == seg["text"] and seg["text"]
    assert seg["no_speech_prob"] is None and seg["temperature"] == 0.0
    _, _, body = transcribe(server, files["short"], response_format="verbose_json")
    assert body["language"] == lang  # and its prompt's logprobs, not English's
    auto = timed_segments(served[1].audios, [refs["timed-auto"]], [(0, n)])
    assert picked(body["segments"]) == auto
    assert auto[0]["avg_logprob"] != seg["avg_logprob"]
    # the client's prompt: <|startofprev|> context before the prefix, as HF's get_prompt_ids
    _, _, body = transcribe(server, files["short"], prompt=CONTEXT)
    assert body["text"] == refs["context"].text
    assert refs["context"].token_ids != ref.token_ids  # the context changes the answer
    # a context past the decoder's length keeps its last tokens (tests/engine/test_whisper.py)
    words = " ".join(f"w{i}" for i in range(300))
    status, _, body = transcribe(server, files["short"], prompt=words, language="en")
    assert status == 200 and body["text"], body


def test_stream_and_usage(served) -> None:
    server, _, refs, files, prompts = served
    ref = refs["auto"]  # the detected language's
    got = events(server, files["short"], stream_include_usage="true")
    *chunks, last = got
    assert {c["object"] for c in got} == {"transcription.chunk"}
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == ref.text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all("finish_reason" not in c["choices"][0] for c in chunks[:-1])
    assert last["choices"] == [] and last["usage"] == {
        "prompt_tokens": len(prompts["auto"]),
        "completion_tokens": TOKENS,
        "total_tokens": len(prompts["auto"]) + TOKENS,
    }
    continuous = events(
        server, files["short"], stream_include_usage="true", stream_continuous_usage_stats="1"
    )
    assert all("usage" in c for c in continuous)
    plain = events(server, files["short"])
    assert all("usage" not in c for c in plain)


def test_translation(served) -> None:
    server, _, refs, files, _ = served
    status, _, body = transcribe(server, files["short"], "translations", language="fr")
    assert (status, body) == (200, {"text": refs["fr-translate"].text})
    assert refs["fr-translate"].token_ids != refs["en"].token_ids
    got = events(server, files["short"], "translations", language="fr")
    assert {c["object"] for c in got} == {"translation.chunk"}
    assert "".join(c["choices"][0]["delta"]["content"] for c in got) == refs["fr-translate"].text
    status, _, body = transcribe(server, files["short"], "translations", to_language="de")
    assert (status, body["error"]["param"]) == (400, "to_language")


def test_long_clip_split_at_quiet_points(served) -> None:
    server, app, refs, files, _ = served
    spans = files["spans"]
    assert spans == [(0, 24800), (24800, 49600), (49600, 73600)]  # each silence's middle
    texts = [o.text for o in refs["windows"]]  # (the first window's detected language)
    assert len(set(texts)) == 3  # each window's text is its own: their order shows
    _, _, body = transcribe(server, files["long"])
    assert body == {"text": "".join(texts), "usage": {"type": "duration", "seconds": 5}}
    got = events(server, files["long"])  # windows streamed in order
    assert "".join(c["choices"][0]["delta"]["content"] for c in got) == "".join(texts)
    assert sum(c["choices"][0].get("finish_reason") is not None for c in got) == 3
    # timed formats: each window's segments, offset by its start
    timed = timed_segments(app.audios, refs["timed-windows"], spans)
    _, _, body = transcribe(server, files["long"], response_format="verbose_json", language="en")
    assert picked(body["segments"]) == timed
    assert body["text"] == "".join(s["text"] for s in body["segments"])
    cues = [(s["start"], s["end"], s["text"].strip()) for s in body["segments"]]
    _, ctype, srt = transcribe(server, files["long"], response_format="srt", language="en")
    assert srt == "".join(
        f"{i + 1}\n{clock(a, ',')} --> {clock(b, ',')}\n{t}\n\n" for i, (a, b, t) in enumerate(cues)
    )
    _, ctype, vtt = transcribe(server, files["long"], response_format="vtt", language="en")
    assert ctype.startswith("text/vtt")
    assert vtt == "WEBVTT\n\n" + "".join(
        f"{clock(a, '.')} --> {clock(b, '.')}\n{t}\n\n" for a, b, t in cues
    )
    assert srt.startswith("1\n00:00:00,000 --> ")
    # sampled hot, the tiny model writes timestamp tokens: segments within windows
    _, _, body = transcribe(
        server,
        files["long"],
        response_format="verbose_json",
        language="en",
        temperature=100,
        seed=5,
        max_completion_tokens=24,
    )
    hot = timed_segments(app.audios, refs["hot-windows"], spans)
    assert picked(body["segments"]) == hot
    assert len(hot) > len(spans)  # some window holds several segments
    assert any(s["start"] > s["seek"] / 100 for s in body["segments"])  # one starts inside


def clock(seconds: float, sep: str) -> str:
    ms = round(seconds * 1000)
    return (
        f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d}{sep}{ms % 1000:03d}"
    )


def test_openai_client(served) -> None:
    openai = pytest.importorskip("openai")
    server, _, refs, files, _ = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="EMPTY", max_retries=0)
    got = client.audio.transcriptions.create(
        model="tiny",
        file=("clip.wav", files["short"], "audio/wav"),
        temperature=0,
        extra_body={"max_completion_tokens": TOKENS},
    )
    assert got.text == refs["auto"].text


BAD_FORMS = [
    ("multipart/form-data", None, "Content-Type", "boundary"),
    ("application/json", None, "Content-Type", "multipart/form-data"),
    (None, form({"model": "tiny"}), "file", "required"),
    (None, form({"model": "tiny", "file": "text"}), "file", "file part"),
    (None, form({"model": "tiny", "colour": "red"}, b"x"), "colour", "Unrecognized"),
    (None, form({"model": ["tiny", "tiny"]}, b"x"), "model", "2 times"),
    (None, form({"prompt": "x" * (65 << 10)}, b"x"), "prompt", "over the limit"),
    (None, form({"model": "tiny"}, b"RIFF")[:-30], "file", "ends inside"),
    (None, form({"temperature": "hot"}, b"x"), "temperature", "a number"),
    (None, form({"top_p": "0"}, b"x"), "top_p", "(0.0, 1.0]"),
    (None, form({"stream": "maybe"}, b"x"), "stream", "boolean"),
    (None, form({"stream_include_usage": "true"}, b"x"), "stream_include_usage", "stream"),
    (None, form({"response_format": "xml"}, b"x"), "response_format", "one of"),
    (None, form({"response_format": "srt", "stream": "true"}, b"x"), "response_format", "stream"),
    (None, form({"timestamp_granularities[]": "word"}, b"x"), "timestamp_granularities[]", "word"),
    (None, form({"model": "other"}, b"x"), "model", "does not exist"),
    (None, form({"language": "xx"}, b"x"), "language", "language='xx'"),
    (None, form({}, b"not audio"), "file", "file"),
]


@pytest.mark.parametrize(("ctype", "body", "param", "says"), BAD_FORMS)
def test_bad_forms_are_400s_naming_the_field(served, ctype, body, param, says) -> None:
    server, *_ = served
    status, _, err = post(server, "/v1/audio/transcriptions", body or form({}, b"x"), ctype)
    assert status in (400, 404), err
    assert err["error"]["param"] == param, err
    assert says in err["error"]["message"], err


def test_file_cap_and_still_serving(served, monkeypatch) -> None:
    server, _, refs, files, _ = served
    monkeypatch.setenv("VLLM_MAX_AUDIO_CLIP_FILESIZE_MB", "0.01")  # 10 KiB
    status, _, err = transcribe(server, files["short"])
    assert (status, err["error"]["param"]) == (400, "file")
    assert "over the limit" in err["error"]["message"]
    monkeypatch.delenv("VLLM_MAX_AUDIO_CLIP_FILESIZE_MB")
    assert transcribe(server, files["short"])[2]["text"] == refs["auto"].text


def test_a_model_without_audio(tiny_model: str) -> None:
    from paged_engine import LLMEngine

    engine = LLMEngine(model=tiny_model, dtype="float32", max_model_len=128)
    try:
        with serve_in_process(COMMON_ARGS, engine) as (server, app):
            assert app.audios is None
            for route in ("transcriptions", "translations"):
                status, _, err = transcribe(server, wav_bytes(tone(0.5, 200)), route)
                assert (status, err["error"]["param"]) == (400, "model"), err
            status, _, _ = server.request(
                "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}
            )
            assert status == 200
    finally:
        engine.shutdown()


# ---- the pieces alone ------------------------------------------------------------------------
def test_multipart_parser() -> None:
    ct = f'multipart/form-data; boundary="{BOUNDARY}"'
    body = b"preamble\r\n" + form({"a": "1", "b": ["x", "y"]}, b"\x00\r\n--data")
    parts = parse_form(ct, body + b"epilogue")
    assert parts["a"][0].text() == "1" and [p.text() for p in parts["b"]] == ["x", "y"]
    (f,) = parts["file"]
    assert (f.filename, f.content_type, f.data) == ("a.wav", "audio/wav", b"\x00\r\n--data")
    cases = [
        (body.replace(b"--\r\n", b""), "file", "cut short"),  # no close delimiter
        (body[: body.index(b"a.wav")], "file", "headers are cut short"),
        (body.replace(b'name="a"', b""), None, "no field name"),
        (body.replace(b"Content-Disposition: form-data", b"X: y", 1), None, "form-data"),
        (form({"a": "1"}).replace(b"\r\n\r\n", b"\r\n", 1), "a", "cut short"),
    ]
    for bad, param, says in cases:
        with pytest.raises(APIError, match=says) as e:
            parse_form(ct, bad)
        assert (e.value.status, e.value.param) == (400, param)
    with pytest.raises(APIError, match="more than 2 parts"):
        parse_form(ct, form({"a": ["1", "2", "3"]}), max_parts=2)
    with pytest.raises(APIError, match="'file': a file of 2 bytes") as e:
        parse_form(ct, form({}, b"xy"), max_file_bytes=1)
    assert e.value.param == "file"
    with pytest.raises(APIError, match="not UTF-8") as e:
        parse_form(ct, form({"a": "ok"}).replace(b"ok", b"\xff"))["a"][0].text()
    assert e.value.param == "a"


def test_split_windows() -> None:
    rate, window = 1000, 2000  # 0.1 s stretches of 100 samples, sought in [1000, 2000)
    wave = np.ones(4500, dtype=np.float32)
    wave[1700:1800] = 0  # the quietest stretch of the first window's last second
    spans = split_windows(wave, rate, window)
    assert spans[0] == (0, 1750) and spans[-1][1] == 4500
    assert all(b - a <= window for a, b in spans)
    assert all(a == b for (_, a), (b, _) in itertools.pairwise(spans))
    assert split_windows(wave[:2000], rate, window) == [(0, 2000)]
    assert split_windows(wave, rate, None) == [(0, 4500)]
    flat = split_windows(np.ones(5000, dtype=np.float32), rate, window)  # no quiet: the first
    assert flat[0] == (0, 1050)
    assert flat == [(0, 1050), (1050, 2100), (2100, 3150), (3150, 5000)]
