"""/v1/audio/transcriptions over Moonshine (multimodal/moonshine.py) against `LLM.generate`.

The tiny random Moonshine of tests/engine/test_moonshine.py behind the server in this process:
a short clip's json / text / verbose_json answers are the engine's greedy output for the
decoder start token alone; a 31 s clip is split at its quiet point inside the last second of
Moonshine's 30 s window, each window one request, texts joined in order; translations and a
context prompt are 400s.
"""

from __future__ import annotations

import pytest
from server_proc import COMMON_ARGS, serve_in_process

np = pytest.importorskip("numpy")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.moonshine")

import test_moonshine  # noqa: E402  (tests/engine: the tiny checkpoint's builder)
from test_transcriptions import TOKENS, tone, transcribe, wav_bytes  # noqa: E402

from paged_engine import LLM, SamplingParams  # noqa: E402
from paged_engine.multimodal.audio_io import audio_item, load_audio  # noqa: E402
from paged_engine.testing import BOS_ID  # noqa: E402
from paged_server.transcriptions import split_windows  # noqa: E402

SR = 16000


def long_clip() -> np.ndarray:
    """31 s: a tone, a 0.1 s silence at 29.5 s (in the window's last second), another tone."""
    wave = np.zeros(31 * SR, dtype=np.float32)
    wave[:472000] = tone(29.5, 300)
    wave[473600:] = tone(1.4, 3000, 0.9, seed=1)[: 31 * SR - 473600]
    return wave


def assert_long_clip_windows(server, refs: dict, files: dict) -> None:
    """long_clip() is split at the silence's middle, each window its own request (`refs`'
    "windows": their answers), and the texts come back joined in order."""
    assert files["spans"] == [(0, 472800), (472800, 31 * SR)]
    texts = refs["windows"]
    assert texts[0] != texts[1]
    _, _, body = transcribe(server, files["long"])
    assert body["text"] == "".join(texts)


def assert_translation_and_prompt_refused(server, files: dict) -> None:
    """The translations route and a context prompt are 400s naming what is refused."""
    status, _, body = transcribe(server, files["short"], route="translations")
    assert status == 400 and "transcribes" in body["error"]["message"], body
    status, _, body = transcribe(server, files["short"], prompt="earlier words")
    assert status == 400 and body["error"]["param"] == "prompt", body


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = test_moonshine.write_tiny_moonshine(tmp_path_factory.mktemp("moonshine-stt"))
    llm = LLM(str(path), dtype="float32", block_size=16, num_gpu_blocks_override=64)
    params = SamplingParams(temperature=0, max_tokens=TOKENS)
    short, long_wav = wav_bytes(tone(1.3, 440)), wav_bytes(long_clip())

    def run(wave: np.ndarray) -> str:
        req = {"prompt_token_ids": [BOS_ID], "multi_modal_data": {"audio": (wave, SR)}}
        return llm.generate([req], params, use_tqdm=False)[0].outputs[0].text

    long_wave = audio_item(load_audio(long_wav, "file"), SR, "file")
    spans = split_windows(long_wave, SR, 30 * SR)
    refs = {
        "short": run(audio_item(load_audio(short, "file"), SR, "file")),
        "windows": [run(long_wave[a:b]) for a, b in spans],
    }
    files = {"short": short, "long": long_wav, "spans": spans}
    with serve_in_process(COMMON_ARGS, llm.llm_engine) as (http_, app):
        yield http_, app, refs, files


def test_transcriptions_match_generate(served) -> None:
    server, app, refs, files = served
    assert app.audios.transcription_window == 30 * SR
    status, _, body = transcribe(server, files["short"])
    assert status == 200, body
    assert body == {"text": refs["short"], "usage": {"type": "duration", "seconds": 2}}
    assert refs["short"]  # the tiny model says something
    _, ctype, text = transcribe(server, files["short"], response_format="text", language="en")
    assert text == refs["short"] and ctype.startswith("text/plain")
    _, _, body = transcribe(server, files["short"], response_format="verbose_json")
    assert body["text"] == refs["short"] and len(body["segments"]) == 1
    assert_long_clip_windows(server, refs, files)


def test_refused(served) -> None:
    server, _, _, files = served
    assert_translation_and_prompt_refused(server, files)
