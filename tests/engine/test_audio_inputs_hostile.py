"""Hostile clips against every audio family: each either runs or is a ValueError naming
multi_modal_data['audio'] (or a prompt too long for the context), and the engine serves the
next request either way.

Clips: an empty one, one holding a NaN, silence, one sample, a DC offset, samples far outside
[-1, 1], a clip one sample short of the feature window and one far past it, int8 and uint8
samples, 8 kHz stereo int16, 96 kHz, an odd rate (16001 Hz), two channels laid out [samples, 2].
"""

from __future__ import annotations

import numpy as np
import pytest
from audio_checks import noise_clip
from image_checks import engine, greedy

pytest.importorskip("transformers")


def _qwen2_audio(path):
    from test_qwen2_audio import ONE, write_tiny_qwen2_audio

    return write_tiny_qwen2_audio(path), ONE


def _granite_speech(path):
    from test_granite_speech_audio import ONE, write_tiny_granite_speech

    return write_tiny_granite_speech(path), ONE


def _granite_speech_plus(path):
    from test_granite_speech_plus_audio import ONE, write_tiny_granite_speech_plus

    return write_tiny_granite_speech_plus(path), ONE


def _fun_asr_nano(path):
    from test_fun_asr_nano_audio import ONE, write_tiny_fun_asr_nano

    return write_tiny_fun_asr_nano(path), ONE


def _whisper_llm(name: str):
    def build(path):
        from test_whisper_llm_audio import FAMILIES as WHISPER_LLMS
        from test_whisper_llm_audio import prompts, write_tiny

        family = WHISPER_LLMS[name]
        return write_tiny(family, path), prompts(family)[0]

    return build


def _voxtral(path):
    from test_voxtral_audio import write_tiny_voxtral

    return write_tiny_voxtral(path), "[INST][BEGIN_AUDIO][AUDIO]What is it?[/INST]"


def _voxtral_realtime(path):
    from test_voxtral_realtime import write_tiny_voxtral_realtime

    return write_tiny_voxtral_realtime(path), "hi"


def _whisper(path):
    from test_whisper import write_tiny_whisper

    return write_tiny_whisper(path), "<|startoftranscript|>"


def _phi4mm(path):
    from test_phi4mm_audio import ONE
    from test_phi4mm_images import write_tiny_phi4mm

    return write_tiny_phi4mm(path), ONE


# family -> its tiny checkpoint in a directory and a prompt with one clip's placeholder
FAMILIES = {
    "qwen2_audio": _qwen2_audio,
    "granite_speech": _granite_speech,
    "phi4mm": _phi4mm,
    "audioflamingo3": _whisper_llm("audioflamingo3"),
    "glmasr": _whisper_llm("glmasr"),
    "musicflamingo": _whisper_llm("musicflamingo"),
    "voxtral": _voxtral,
    "whisper": _whisper,
    "granite_speech_plus": _granite_speech_plus,
    "fun_asr_nano": _fun_asr_nano,
    "voxtral_realtime": _voxtral_realtime,  # no placeholder: the clip spans the text stream
}


def _clips() -> list[tuple[str, object]]:
    tone = noise_clip(1, 1.0)
    nan = tone.copy()
    nan[100] = np.nan
    return [
        ("empty", np.zeros(0, dtype=np.float32)),
        ("NaN", nan),
        ("silence", np.zeros(16_000, dtype=np.float32)),
        ("one sample", np.ones(1, dtype=np.float32)),
        ("dc", np.full(8_000, 0.7, dtype=np.float32)),
        ("loud", tone * 1e6),
        ("window - 1", noise_clip(2, 3.0)[:-1]),
        ("long", noise_clip(3, 20.0)),
        ("int8", (tone * 100).astype(np.int8)),
        ("uint8", (tone * 100 + 128).astype(np.uint8)),
        ("8 kHz stereo", ((np.stack([tone[::2], -tone[::2]]) * 3e4).astype(np.int16), 8_000)),
        ("96 kHz", (noise_clip(4, 0.5, sr=96_000), 96_000)),
        ("16001 Hz", (noise_clip(5, 0.5, sr=16_001), 16_001)),
        ("[n, 2]", np.stack([tone, tone], 1)),
    ]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hostile_clips_run_or_are_refused_by_name(family, tmp_path):
    path, text = FAMILIES[family](tmp_path / family)
    llm = engine(path, max_model_len=256)
    ran = 0
    for name, clip in _clips():
        try:
            out = llm.generate(
                [{"prompt": text, "multi_modal_data": {"audio": clip}}],
                greedy(0, 2),
                use_tqdm=False,
            )[0]
        except ValueError as e:
            # (a clip of many windows can outgrow the context: refused as any long prompt)
            assert "multi_modal_data['audio']" in str(e) or "prompt is too long" in str(e), (
                name,
                e,
            )
            continue
        assert len(out.outputs[0].token_ids) == 2, name
        ran += 1
    assert ran >= 8  # most of them are ordinary clips
    good = {"prompt": text, "multi_modal_data": {"audio": noise_clip(6, 0.5)}}
    assert len(llm.generate([good], greedy(0, 4), use_tqdm=False)[0].outputs[0].token_ids) == 4
