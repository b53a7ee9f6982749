"""OpenAI's speech-to-text routes, as vLLM serves them: `POST /v1/audio/transcriptions` and
`POST /v1/audio/translations` (into English).

    multipart/form-data (multipart.py): file (the audio bytes), model, language, prompt,
    response_format ("json" | "text" | "verbose_json" | "srt" | "vtt"), temperature (0 unless
    sent), stream, stream_include_usage, stream_continuous_usage_stats,
    timestamp_granularities[] ("segment"), and vLLM's sampling extras: seed, top_p, top_k,
    min_p, frequency_penalty, presence_penalty, repetition_penalty, max_completion_tokens;
    to_language ("en" only, translations)
    -> json {"text", "usage": {"type": "duration", "seconds"}} (translations: {"text"}),
       text (the text alone, text/plain, as OpenAI answers it; vLLM answers its json),
       verbose_json {"task", "language", "duration", "text", "segments", "words": null},
       srt / vtt (one cue a segment), or an SSE stream of "transcription.chunk" /
       "translation.chunk" deltas ended by an optional usage chunk and [DONE].

The engine's audio host side (`app.audios`, an AudioProcessor) gives the prompt:
`transcription_prompt(language, task, prompt)` (an engine prompt without the audio; a model
that does not transcribe refuses: 400 naming `model`). The file is decoded with the engine's
`load_audio` and resampled to the model's rate. A clip longer than the host side's
`transcription_window` (samples; Whisper: its 30 s window) is split as vLLM splits it: each
window ends at the quietest 0.1 s (least RMS energy; cut in its middle) within the window's
last second, and the next starts there. Each window is one engine request (run together,
features extracted on this thread as the chat path does); their texts are joined in order.

No `language` and a host side with `language_detection()` (Whisper): the language is
detected first, as transformers' `detect_language` does, by one engine request over the first
window (the detection prompt, max_tokens=1, greedy over allowed_token_ids = the language
tokens); the prompt then names it and verbose_json reports it. Other models write their
`default_language` (or none).

verbose_json, srt and vtt on a host side whose `has_timestamps` (Whisper with timestamp tokens)
ask for timestamps
(`transcription_prompt(..., timestamps=True)`: <|0.00|> forced where <|notimestamps|> was, as
vLLM does) and answer the segments it parses from each window's tokens, their times offset by
the window's start: id, seek (the window's start in 10 ms frames), start, end, text, tokens
(timestamp tokens included), temperature, avg_logprob (the mean logprob of the segment's
sampled tokens), compression_ratio (of its text); no_speech_prob is not computed (null). The
text is then the segments' texts joined. Other models (and json / text) keep
<|notimestamps|>-style prompts: a window is one segment with the window's times.
Refused by name: timestamp_granularities[] "word", streaming with verbose_json / srt / vtt, a
file over VLLM_MAX_AUDIO_CLIP_FILESIZE_MB (25), any field not listed above.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
import uuid
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from paged_server.errors import bad_request
from paged_server.multipart import Part, parse_form
from paged_server.openai_protocol import check_context, parse_xargs
from paged_server.openai_responses import envelope, usage

if TYPE_CHECKING:
    import numpy as np

    from paged_server.app import OpenAIApp
    from paged_server.http import Handler
    from paged_server.request_group import RequestGroup

FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
_GRANULARITIES = "timestamp_granularities[]"
# (form field, type, low, high, low excluded): vLLM's sampling extras, checked as the JSON
# routes check them (openai_protocol._sampling)
_NUMBERS = {
    "temperature": (float, 0.0, 100.0, False),
    "top_p": (float, 0.0, 1.0, True),
    "top_k": (int, -1, 1 << 20, False),
    "min_p": (float, 0.0, 1.0, False),
    "seed": (int, -(1 << 63), (1 << 64) - 1, False),
    "frequency_penalty": (float, -2.0, 2.0, False),
    "presence_penalty": (float, -2.0, 2.0, False),
    "repetition_penalty": (float, 0.0, 100.0, True),
    "max_completion_tokens": (int, 1, 1 << 31, False),
}
_FLAGS = ("stream", "stream_include_usage", "stream_continuous_usage_stats")
_TEXTS = ("model", "language", "prompt", "response_format", "to_language")
_FIELDS = frozenset({"file", _GRANULARITIES, "vllm_xargs", *_NUMBERS, *_FLAGS, *_TEXTS})
_PARAM = re.compile(r"(\w+)\s*[:=]")  # a host-side ValueError starts with what it names
_OVERLAP_S = 1.0  # the split point is sought in each window's last second (vLLM's)
_QUIET_S = 0.1  # energy is measured over 0.1 s stretches (vLLM's 1600 samples at 16 kHz)
_TIMED = ("verbose_json", "srt", "vtt")  # the formats that carry segment times


@dataclass(slots=True)
class SpeechRequest:
    task: str  # "transcribe" | "translate"
    file: Part
    model: str | None = None
    language: str | None = None
    prompt: str = ""
    response_format: str = "json"
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams keywords
    max_tokens: int | None = None


def parse_speech(form: dict[str, list[Part]], task: str) -> SpeechRequest:
    """The form's fields, typed and checked; a 400 naming the first bad one."""
    for name, parts in form.items():
        if name not in _FIELDS:
            raise bad_request(f"Unrecognized request argument supplied: {name}", name)
        if len(parts) > 1 and name != _GRANULARITIES:
            raise bad_request(f"'{name}' is given {len(parts)} times", name)
    files = form.get("file")
    if not files:
        raise bad_request("'file' (the audio file, a multipart file part) is required", "file")
    if files[0].filename is None:
        raise bad_request("'file' must be a file part (with a filename), not a text field", "file")
    values = {name: parts[0].text() for name, parts in form.items() if name != "file"}
    req = SpeechRequest(task, files[0])
    req.model = values.get("model")
    req.language = values.get("language") or None
    req.prompt = values.get("prompt", "")
    req.response_format = values.get("response_format", "json")
    if req.response_format not in FORMATS:
        raise bad_request(
            f"'response_format' must be one of {', '.join(FORMATS)}, got {req.response_format!r}",
            "response_format",
        )
    to_language = values.get("to_language")
    if to_language is not None and (task != "translate" or to_language != "en"):
        raise bad_request(
            "'to_language' is only 'en', on /v1/audio/translations (Whisper translates into "
            f"English), got {to_language!r}",
            "to_language",
        )
    req.stream, req.include_usage, req.continuous_usage = (_flag(values, f) for f in _FLAGS)
    for opt in _FLAGS[1:]:
        if _flag(values, opt) and not req.stream:
            raise bad_request(f"'{opt}' is only allowed when 'stream' is true", opt)
    if req.stream and req.response_format not in ("json", "text"):
        raise bad_request(
            f"response_format {req.response_format!r} is not streamed: stream json or text",
            "response_format",
        )
    granularities = [p.text() for p in form.get(_GRANULARITIES, [])]
    for g in granularities:
        if g not in ("segment", "word"):
            raise bad_request(
                f"'{_GRANULARITIES}' takes 'segment' or 'word', got {g!r}", _GRANULARITIES
            )
        if g == "word":
            raise bad_request(
                f"'{_GRANULARITIES}': word timestamps are not computed (segments are)",
                _GRANULARITIES,
            )
    if granularities and req.response_format != "verbose_json":
        raise bad_request(
            f"'{_GRANULARITIES}' needs response_format 'verbose_json'", _GRANULARITIES
        )
    numbers = {k: _number(values[k], k, *spec) for k, spec in _NUMBERS.items() if k in values}
    req.max_tokens = numbers.pop("max_completion_tokens", None)
    req.sampling = {"temperature": 0.0, **numbers}  # vLLM's default temperature here: 0
    xargs = _xargs(values.get("vllm_xargs"))
    if xargs:
        req.sampling["extra_args"] = xargs
    return req


def _xargs(text: str | None) -> dict[str, Any] | None:
    """vLLM's `vllm_xargs` form field: a JSON object, checked as the JSON bodies' field is
    (openai_protocol.parse_xargs), handed to SamplingParams.extra_args."""
    if text is None or not text.strip():
        return None
    try:
        value = json.loads(text)
    except ValueError:
        raise bad_request("'vllm_xargs' must be a JSON object", "vllm_xargs") from None
    return parse_xargs(value)


def _flag(values: dict[str, str], name: str) -> bool:
    v = values.get(name)
    if v is None:
        return False
    if v.lower() not in ("true", "false", "1", "0"):
        raise bad_request(f"'{name}' must be a boolean (true / false), got {v!r}", name)
    return v.lower() in ("true", "1")


def _number(text: str, name: str, kind: type, lo: float, hi: float, lo_open: bool) -> Any:
    try:
        v = kind(text.strip())
    except ValueError:
        raise bad_request(
            f"'{name}' must be {'an integer' if kind is int else 'a number'}, got {text!r}", name
        ) from None
    if not math.isfinite(v) or v < lo or v > hi or (lo_open and v == lo):
        bracket = "(" if lo_open else "["
        raise bad_request(f"'{name}' must be in {bracket}{lo}, {hi}], got {text!r}", name)
    return v


def max_file_bytes() -> int:
    """vLLM's VLLM_MAX_AUDIO_CLIP_FILESIZE_MB (default 25) in bytes."""
    raw = os.environ.get("VLLM_MAX_AUDIO_CLIP_FILESIZE_MB", "25")
    try:
        mb = float(raw)
    except ValueError:
        raise ValueError(f"VLLM_MAX_AUDIO_CLIP_FILESIZE_MB must be a number, got {raw!r}") from None
    return int(mb * (1 << 20))


# ---- audio ------------------------------------------------------------------------------------
def split_windows(wave: np.ndarray, rate: int, window: int | None) -> list[tuple[int, int]]:
    """(start, end) sample ranges covering `wave`, each at most `window` samples; a range that
    does not reach the end stops at the middle of the quietest `_QUIET_S` stretch of its last
    `_OVERLAP_S` seconds (at most half the window)."""
    import numpy as np

    n = int(wave.shape[0])
    if window is None or n <= window:
        return [(0, n)]
    quiet = max(1, int(rate * _QUIET_S))
    overlap = min(int(rate * _OVERLAP_S), window // 2)
    spans, start = [], 0
    while n - start > window:
        lo = start + window - overlap
        count = overlap // quiet  # whole stretches inside [lo, start + window)
        if count == 0:
            cut = start + window
        else:
            stretches = wave[lo : lo + count * quiet].astype(np.float64).reshape(count, quiet)
            k = int(np.argmin((stretches**2).mean(axis=1)))  # the first of equal minima
            cut = lo + k * quiet + quiet // 2
        spans.append((start, cut))
        start = cut
    spans.append((start, n))
    return spans


def _decode(app: OpenAIApp, file: Part) -> tuple[np.ndarray, int, float]:
    """(the waveform at the model's rate, that rate, the clip's duration in seconds)."""
    from paged_engine.multimodal.audio_io import audio_item, load_audio

    rate = int(app.audios.sampling_rate)
    try:
        wave, sr = load_audio(file.data, "file")
        duration = wave.shape[0] / sr
        return audio_item((wave, sr), rate, "file"), rate, duration
    except ValueError as e:
        raise bad_request(str(e), "file") from None


def _audios(app: OpenAIApp) -> Any:
    """The engine's audio host side; a 400 naming `model` for a model without audio."""
    if app.audios is None:
        raise bad_request(
            "model: this model takes no audio, so it serves no transcriptions or translations",
            "model",
        )
    return app.audios


def _prompt(
    app: OpenAIApp, req: SpeechRequest, language: str | None, timed: bool
) -> tuple[dict[str, Any], list[int]]:
    """(the host side's prompt, its token ids before any audio run); `timed`: with timestamp
    tokens."""
    audios = _audios(app)
    try:
        if timed:
            prompt = audios.transcription_prompt(language, req.task, req.prompt, timestamps=True)
        else:
            prompt = audios.transcription_prompt(language, req.task, req.prompt)
    except ValueError as e:
        m = _PARAM.match(str(e))
        param = m.group(1) if m and m.group(1) in ("language", "prompt") else "model"
        raise bad_request(str(e), param) from None
    if "prompt_token_ids" in prompt:
        ids = list(prompt["prompt_token_ids"])
    else:  # as the engine tokenizes a text prompt
        ids = app._encode(prompt["prompt"], True)
    return prompt, ids


def _clip_prompt(
    app: OpenAIApp, prompt: dict[str, Any], ids: list[int], clip: tuple[np.ndarray, int]
) -> dict[str, Any]:
    """The engine prompt of one window: its features extracted on this thread (the engine's
    thread only checks them)."""
    try:
        expanded, items = app.multimodal(ids, {"audio": [clip]}, prompt.get("mm_processor_kwargs"))
    except ValueError as e:
        raise bad_request(str(e), "file") from None
    extra = {k: v for k, v in prompt.items() if k not in ("prompt", "prompt_token_ids")}
    return {**extra, "prompt_token_ids": expanded, "multi_modal_data": {"audio": list(items)}}


def _detect(app: OpenAIApp, h: Handler, clip: tuple[np.ndarray, int], lora: Any) -> str | None:
    """The language the host side's detection request picks for `clip` (one greedy step over
    the language tokens, through the engine); None where the host side detects none."""
    found = app.audios.language_detection()
    if found is None:
        return None
    prompt, languages = found
    ids = list(prompt["prompt_token_ids"])
    request = _clip_prompt(app, prompt, ids, clip)
    app.client.check_queue()
    kwargs = {"temperature": 0.0, "max_tokens": 1, "allowed_token_ids": sorted(languages)}
    params = app.client.make_params(kwargs, beam=False, stream=False)
    rid = f"language-{uuid.uuid4().hex}"
    group = app.client.add([rid], [request], params, lora, 0)
    with app._in_flight(h, group, [rid]):
        app._wait(h, group)
    return languages[group.latest[0].outputs[0].token_ids[0]]


# ---- the route --------------------------------------------------------------------------------
def serve_speech(app: OpenAIApp, h: Handler, task: str) -> None:
    """One transcription (task "transcribe") or translation request: its windows run as one
    group of engine requests, answered whole or streamed in window order."""
    body = h.read_body()
    form = parse_form(h.headers.get("Content-Type"), body, max_file_bytes=max_file_bytes())
    req = parse_speech(form, task)
    model, lora = app._resolve(req.model)
    audios = _audios(app)
    timed = req.response_format in _TIMED and getattr(audios, "has_timestamps", False)
    language = req.language or getattr(audios, "default_language", None)
    prompt, ids = _prompt(app, req, language, timed)  # refused before the file is read
    wave, rate, duration = _decode(app, req.file)
    spans = split_windows(wave, rate, getattr(audios, "transcription_window", None))
    if req.language is None and hasattr(audios, "language_detection"):
        detected = _detect(app, h, (wave[spans[0][0] : spans[0][1]], rate), lora)
        if detected is not None:  # over the first window, as Whisper detects
            language = detected
            prompt, ids = _prompt(app, req, language, timed)
    prompts = [_clip_prompt(app, prompt, ids, (wave[a:b], rate)) for a, b in spans]
    lengths = [len(p["prompt_token_ids"]) for p in prompts]
    max_tokens = min(check_context(n, None, app.max_model_len, "prompt") for n in lengths)
    for cap in (req.max_tokens, app.sampling_defaults.get("max_tokens")):
        if cap is not None:
            max_tokens = min(max_tokens, cap)
    app.client.check_queue()
    kwargs = {**app.sampling_defaults, **req.sampling, "max_tokens": max_tokens}
    if req.response_format in ("verbose_json", "srt", "vtt"):
        kwargs["logprobs"] = 0  # the sampled token's: a segment's avg_logprob
    params = app.client.make_params(kwargs, beam=False, stream=req.stream)
    rid = f"{task}-{app.base_request_id(h)}"  # vLLM's: X-Request-Id names the stream's chunks
    rids = [f"{rid}-{i}" for i in range(len(prompts))]
    if app.log_requests is not None:
        app._log_request(rids, [None] * len(rids), [p["prompt_token_ids"] for p in prompts], params)
    group = app.client.add(rids, prompts, params, lora, 0)
    with app._in_flight(h, group, rids):
        if req.stream:
            _stream(app, h, req, model, rid, group, sum(lengths))
            return
        app._wait(h, group)
        outs = [out.outputs[0] for out in group.latest]
        times = [(s / rate, e / rate) for s, e in spans]
        segments = _segments(audios if timed else None, times, outs, req.sampling["temperature"])
        _answer(h, req, language, duration, segments)


def _segments(
    audios: Any, times: list[tuple[float, float]], outs: list[Any], temperature: float
) -> list[dict[str, Any]]:
    """Each window's timed segments (`audios.timestamp_segments`, offset by the window's
    start), or (audios None) each window as one segment."""
    segments: list[dict[str, Any]] = []
    for (start, end), out in zip(times, outs, strict=True):
        ids, lps = list(out.token_ids), _logprobs(out)
        seek = round(start * 100)  # in 10 ms feature frames, as Whisper counts
        if audios is None:
            parts = [(0.0, end - start, out.text, ids, lps)]
        else:
            parts = [
                (s.start, s.end, s.text, s.tokens, lps[s.sampled[0] : s.sampled[1]])
                for s in audios.timestamp_segments(ids, end - start)
            ]
        for a, b, text, tokens, seg_lps in parts:
            raw = text.encode()
            segments.append(
                {
                    "id": len(segments),
                    "seek": seek,
                    "start": start + a,
                    "end": start + b,
                    "text": text,
                    "tokens": tokens,
                    "temperature": temperature,
                    "avg_logprob": sum(seg_lps) / len(seg_lps) if seg_lps else 0.0,
                    "compression_ratio": len(raw) / len(zlib.compress(raw)) if raw else 0.0,
                    "no_speech_prob": None,
                }
            )
    return segments


def _logprobs(out: Any) -> list[float]:
    """The sampled tokens' logprobs (the request asked for logprobs=0)."""
    return [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs or []) if t in lp]


def _answer(
    h: Handler,
    req: SpeechRequest,
    language: str | None,
    duration: float,
    segments: list[dict[str, Any]],
) -> None:
    fmt = req.response_format
    text = "".join(s["text"] for s in segments)  # (timed ones' without timestamp tokens)
    if fmt == "text":
        h.send_bytes(200, text.encode(), "text/plain; charset=utf-8")
        return
    if fmt == "json":
        body: dict[str, Any] = {"text": text}
        if req.task == "transcribe":  # OpenAI bills transcriptions by the second
            body["usage"] = {"type": "duration", "seconds": math.ceil(duration)}
        h.send_json(200, body)
        return
    if fmt == "verbose_json":
        h.send_json(
            200,
            {
                "task": req.task,
                "language": language,
                "duration": str(duration),
                "text": text,
                "segments": segments,
                "words": None,
            },
        )
        return
    cues = [_cue(fmt, i, s) for i, s in enumerate(segments)]
    if fmt == "vtt":
        h.send_bytes(200, ("WEBVTT\n\n" + "".join(cues)).encode(), "text/vtt; charset=utf-8")
    else:
        h.send_bytes(200, "".join(cues).encode(), "text/plain; charset=utf-8")


def _cue(fmt: str, i: int, seg: dict[str, Any]) -> str:
    """One SubRip (`1`, `00:00:01,500 --> ...`) or WebVTT (`00:00:01.500 --> ...`) cue."""
    sep = "," if fmt == "srt" else "."
    times = f"{_clock(seg['start'], sep)} --> {_clock(seg['end'], sep)}"
    head = f"{i + 1}\n" if fmt == "srt" else ""
    return f"{head}{times}\n{seg['text'].strip()}\n\n"


def _clock(seconds: float, sep: str) -> str:
    ms = round(seconds * 1000)
    return (
        f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d}{sep}{ms % 1000:03d}"
    )


def _stream(
    app: OpenAIApp,
    h: Handler,
    req: SpeechRequest,
    model: str,
    rid: str,
    group: RequestGroup,
    num_prompt: int,
) -> None:
    """vLLM's chunks: {"object": "<task>.chunk", "choices": [{"delta": {"content": ...}}]},
    the window's last with its finish_reason and stop_reason; window i's deltas wait until
    window i - 1 finished. Usage: in every chunk (continuous) and / or after the last."""
    obj = "transcription.chunk" if req.task == "transcribe" else "translation.chunk"
    created = int(time.time())
    include_usage = req.include_usage or app.force_include_usage
    continuous = req.continuous_usage and include_usage  # vLLM: usage in every chunk
    held: list[list[Any]] = [[] for _ in group.request_ids]  # each window's deltas not sent
    current, generated = 0, 0
    h.start_stream()

    def send(delta: Any) -> None:
        nonlocal generated
        generated += len(delta.token_ids)
        choice: dict[str, Any] = {"delta": {"content": delta.text}}
        if delta.finish_reason is not None:
            choice.update(finish_reason=delta.finish_reason, stop_reason=delta.stop_reason)
        chunk = {**envelope(rid, obj, model, created), "choices": [choice]}
        if continuous:
            chunk["usage"] = usage(num_prompt, generated)
        h.send_event(chunk)

    for arrived in app.arrivals(h, group):
        for index, out in arrived:
            held[index].append(out.outputs[0])
        while current < len(held) and held[current]:
            finished = False
            for delta in held[current]:
                send(delta)
                finished = delta.finish_reason is not None
            held[current] = []
            if not finished:
                break
            current += 1
    if include_usage:
        h.send_event(
            {
                **envelope(rid, obj, model, created),
                "choices": [],
                "usage": usage(num_prompt, generated),
            }
        )
    h.end_stream()
