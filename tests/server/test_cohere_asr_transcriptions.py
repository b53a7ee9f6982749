"""/v1/audio/transcriptions over Cohere ASR (multimodal/cohere_asr.py) against `LLM.generate`.

The tiny random Cohere ASR of tests/engine/test_cohere_asr.py behind the server in this
process: a short clip's answer is the engine's greedy output for the language's ten control
tokens ("en" when `language` is left out, as vLLM defaults it; "fr" when asked); a 31 s clip is
split inside the last second of the 30 s window, each window one request, texts joined in
order; translations, a context prompt and a language outside the 14 are 400s.
"""

from __future__ import annotations

import pytest
from server_proc import COMMON_ARGS, serve_in_process

np = pytest.importorskip("numpy")
transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.cohere_asr")

import test_cohere_asr  # noqa: E402  (tests/engine: the tiny checkpoint's builder)
from test_moonshine_transcriptions import (  # noqa: E402
    assert_long_clip_windows,
    assert_translation_and_prompt_refused,
    long_clip,
)
from test_transcriptions import TOKENS, tone, transcribe, wav_bytes  # noqa: E402

from paged_engine import LLM, SamplingParams  # noqa: E402
from paged_engine.multimodal.audio_io import audio_item, load_audio  # noqa: E402
from paged_server.transcriptions import split_windows  # noqa: E402

SR = 16000


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = test_cohere_asr.write_tiny_cohere_asr(tmp_path_factory.mktemp("cohere-asr-stt"))
    llm = LLM(str(path), dtype="float32", block_size=16, num_gpu_blocks_override=64)
    params = SamplingParams(temperature=0, max_tokens=TOKENS)
    vocab = llm.get_tokenizer().get_vocab()
    short, long_wav = wav_bytes(tone(1.3, 440)), wav_bytes(long_clip())

    def run(wave: np.ndarray, language: str = "en") -> str:
        names = test_cohere_asr.CONTROL[:4] + [f"<|{language}|>"] * 2 + test_cohere_asr.CONTROL[6:]
        req = {"prompt_token_ids": [vocab[t] for t in names], "multi_modal_data": {"audio": wave}}
        return llm.generate([req], params, use_tqdm=False)[0].outputs[0].text

    short_wave = audio_item(load_audio(short, "file"), SR, "file")
    long_wave = audio_item(load_audio(long_wav, "file"), SR, "file")
    spans = split_windows(long_wave, SR, 30 * SR)
    refs = {
        "short": run(short_wave),
        "short_fr": run(short_wave, "fr"),
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
    assert refs["short"] and refs["short"] != refs["short_fr"]  # the language token decides
    _, _, body = transcribe(server, files["short"], language="fr")
    assert body["text"] == refs["short_fr"]
    assert_long_clip_windows(server, refs, files)


def test_refused(served) -> None:
    server, _, _, files = served
    assert_translation_and_prompt_refused(server, files)
    status, _, body = transcribe(server, files["short"], language="xx")
    assert status == 400 and body["error"]["param"] == "language", body
