"""Audio decoding and resampling (multimodal/audio_io.py): what a clip becomes before any model.

WAV in every sample format the standard library's writers and other tools produce (8-bit
unsigned, 16 / 24 / 32-bit PCM, 32 / 64-bit float, WAVE_FORMAT_EXTENSIBLE, odd-sized chunks
before the data), stereo averaged to mono; FLAC and MP3 through PyAV; resampling against the
analytic signal; vLLM's item forms; and bytes that are no audio refused by name.
"""

from __future__ import annotations

import io
import struct

import numpy as np
import pytest
import torch

from paged_engine.multimodal.audio_io import audio_item, load_audio, resample


def _tone(sr: int, seconds: float = 0.5, hz: float = 440.0) -> np.ndarray:
    t = np.arange(int(sr * seconds)) / sr
    return (0.5 * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def _wav(samples: bytes, tag: int, channels: int, sr: int, bits: int, extra: bytes = b"") -> bytes:
    """A RIFF/WAVE file by hand: fmt (tag, or EXTENSIBLE with `tag` as its subformat), an odd
    LIST chunk (padded), then data."""
    block = channels * bits // 8
    fmt = struct.pack("<HHIIHH", tag, channels, sr, sr * block, block, bits)
    if tag == 0xFFFE:
        raise AssertionError
    if extra:  # EXTENSIBLE: cbSize, valid bits, channel mask, subformat GUID (tag first)
        fmt = struct.pack("<HHIIHH", 0xFFFE, channels, sr, sr * block, block, bits)
        fmt += struct.pack("<HHI", 22, bits, 0) + struct.pack("<H", tag) + extra
    chunks = b"fmt " + struct.pack("<I", len(fmt)) + fmt
    chunks += b"LIST" + struct.pack("<I", 3) + b"abc\x00"  # odd size: one pad byte
    chunks += b"data" + struct.pack("<I", len(samples)) + samples
    return b"RIFF" + struct.pack("<I", 4 + len(chunks)) + b"WAVE" + chunks


GUID_TAIL = bytes(14)


@pytest.mark.parametrize(
    ("name", "encode", "tag", "bits", "tol"),
    [
        ("u8", lambda x: (np.round(x * 127) + 128).astype(np.uint8).tobytes(), 1, 8, 1e-2),
        ("s16", lambda x: np.round(x * 32767).astype("<i2").tobytes(), 1, 16, 1e-4),
        ("s32", lambda x: np.round(x * 2**31 * 0.99).astype("<i4").tobytes(), 1, 32, 1e-2),
        ("f32", lambda x: x.astype("<f4").tobytes(), 3, 32, 0),
        ("f64", lambda x: x.astype("<f8").tobytes(), 3, 64, 1e-7),
    ],
)
def test_wav_sample_formats(name, encode, tag, bits, tol):
    x = _tone(16_000)
    stereo = np.stack([x, x], 1).reshape(-1)  # interleaved: both channels the tone
    for extra in (b"", GUID_TAIL):
        got, sr = load_audio(_wav(encode(stereo), tag, 2, 16_000, bits, extra), "clip")
        assert sr == 16_000 and got.dtype == np.float32 and got.shape == x.shape
        np.testing.assert_allclose(got, x * (0.99 if name == "s32" else 1), atol=tol or 1e-7)


def test_wav_24_bit():
    x = _tone(8_000)
    ints = np.round(x * (2**23 - 1)).astype(np.int32)
    raw = np.stack([ints & 0xFF, (ints >> 8) & 0xFF, (ints >> 16) & 0xFF], 1).astype(np.uint8)
    got, sr = load_audio(_wav(raw.tobytes(), 1, 1, 8_000, 24), "clip")
    assert sr == 8_000
    np.testing.assert_allclose(got, x, atol=1e-6)


@pytest.mark.parametrize(
    ("fmt", "codec", "tol"), [("flac", "flac", 1e-4), ("mp3", "libmp3lame", 0.2)]
)
def test_compressed_formats_through_pyav(fmt, codec, tol):
    av = pytest.importorskip("av")
    x = _tone(22_050, 1.0)
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as out:
        stream = out.add_stream(codec, rate=22_050)
        stream.layout = "mono"
        pcm = np.round(x * 32767).astype(np.int16)[None, :]
        if codec != "flac":  # the MP3 encoder takes planar float
            frame = av.AudioFrame.from_ndarray(x[None, :], format="fltp", layout="mono")
        else:
            frame = av.AudioFrame.from_ndarray(pcm, format="s16", layout="mono")
        frame.sample_rate = 22_050
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            out.mux(packet)
    got, sr = load_audio(buf.getvalue(), "clip")
    assert sr == 22_050
    if fmt == "flac":  # lossless
        np.testing.assert_allclose(got, x, atol=tol)
    else:  # lossy, with the encoder's delay: the tone's level and pitch survive
        assert abs(got.size - x.size) < 3000
        spectrum = np.abs(np.fft.rfft(got))
        assert abs(np.argmax(spectrum) * sr / got.size - 440) < 5


@pytest.mark.parametrize(("orig", "target"), [(44_100, 16_000), (8_000, 16_000), (48_000, 24_000)])
def test_resampling_keeps_the_tone(orig, target):
    x = _tone(orig, 1.0, 440.0)
    y = resample(x, orig, target)
    assert y.size == target
    want = _tone(target, 1.0, 440.0)
    np.testing.assert_allclose(y[200:-200], want[200:-200], atol=2e-3)
    # a tone over the new Nyquist rate is filtered out, not folded back
    high = resample(_tone(orig, 1.0, target * 0.6), orig, target) if orig > target else None
    if high is not None:
        assert np.abs(high[200:-200]).max() < 0.05  # (0.5 unfiltered)


def test_item_forms():
    x = _tone(16_000)
    base = audio_item(x, 16_000, "a")
    np.testing.assert_array_equal(audio_item((x, 16_000), 16_000, "a"), base)
    np.testing.assert_array_equal(audio_item(torch.from_numpy(x), 16_000, "a"), base)
    np.testing.assert_allclose(audio_item(np.stack([x, x], 1), 16_000, "a"), base)
    np.testing.assert_allclose(audio_item((np.stack([x, x]), 16_000.0), 16_000, "a"), base)
    ints = np.round(x * 32767).astype(np.int16)
    np.testing.assert_allclose(audio_item(ints, 16_000, "a"), base, atol=1e-4)
    assert audio_item((x, 8_000), 16_000, "a").size == 2 * x.size


@pytest.mark.parametrize(
    ("item", "match"),
    [
        ((np.zeros(10), 0), "sampling rate must be a positive number"),
        ((np.zeros(10), True), "sampling rate"),
        ((np.zeros(10), 16_000.5), "whole number"),
        ((np.zeros(10), float("inf")), "sampling rate"),  # was an OverflowError
        ((np.zeros(10), 10**400), "sampling rate"),  # was an OverflowError
        ((np.zeros(10), 10**12), "sampling rate"),  # its kernels: terabytes
        ((np.zeros(10), 16_000, 1), "tuple of 3"),
        (np.zeros(0), "not empty"),
        (np.zeros((0, 2)), "not empty"),  # an empty stereo clip (was reported as NaN)
        (np.zeros((2, 3, 4)), "1-D"),
        (np.array(["a", "b"]), "numbers"),
        (np.array([np.inf, 0.0]), "NaN or infinite"),
        ("clip.wav", "waveform"),
        ((np.zeros(8_000), 2), "over 3600 s"),
    ],
)
def test_bad_items_are_refused_by_name(item, match):
    with pytest.raises(ValueError, match=match) as e:
        audio_item(item, 16_000, "multi_modal_data['audio'][0]")
    assert "multi_modal_data['audio'][0]" in str(e.value)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"RIFF\x00\x00\x00\x00WAVE", "fmt and a data chunk"),
        (_wav(b"\x00" * 8, 2, 1, 16_000, 16), "WAV format 2"),
        (_wav(b"", 1, 1, 16_000, 16), "no samples"),
        (_wav(b"\x00" * 8, 1, 0, 16_000, 16), "0 channels"),
        (b"hello, not audio at all", "not an audio file"),
    ],
)
def test_bytes_that_are_no_audio_are_refused(data, match):
    pytest.importorskip("av")
    with pytest.raises(ValueError, match=match):
        load_audio(data, "messages[0].content[0].input_audio")


def test_odd_rate_ratios_take_the_direct_filter():
    """A ratio with more phases than the polyphase table holds (16001 -> 16000 Hz) is filtered
    per output sample: the same filter (equal to the polyphase result where both apply)."""
    from paged_engine.multimodal import audio_io

    x = _tone(44_100, 0.2)
    np.testing.assert_allclose(
        audio_io._resample_direct(x, 44_100, 16_000), resample(x, 44_100, 16_000), atol=1e-6
    )
    y = resample(_tone(16_001, 0.2), 16_001, 16_000)
    assert y.size == 3200
    np.testing.assert_allclose(y[100:-100], _tone(16_000, 0.2)[100:-100], atol=2e-3)


def test_rates_with_huge_polyphase_tables_take_the_direct_filter():
    """199995 Hz -> 16000 Hz is 3200 phases of 40151 taps (a 5 GB table, 9 s for a 1 s clip;
    999995 Hz: killed for memory): past _MAX_TABLE the direct filter, exactly its result."""
    from paged_engine.multimodal import audio_io

    x = _tone(20_005, 0.5)  # 3200 phases of 4017 taps: over the table budget
    np.testing.assert_array_equal(
        resample(x, 20_005, 16_000), audio_io._resample_direct(x, 20_005, 16_000)
    )
    assert audio_item((np.zeros(999_995, np.float32), 999_995), 16_000, "a").size == 16_000
