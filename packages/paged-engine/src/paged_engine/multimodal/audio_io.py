"""Audio as the engine takes it: a mono float32 waveform at the model's sampling rate.

    multi_modal_data={"audio": item or [items]}, each item in vLLM's forms:
      (waveform, sampling_rate)   a 1-D array (or [samples, channels] / [channels, samples]
                                  with the channel axis the shorter one), resampled if needed
      waveform                    taken as sampled at the model's rate already
    waveform: numpy array or torch tensor (in a tuple also a list of floats); integer samples
    are scaled to [-1, 1); a list of items is several clips

`load_audio` decodes a file's bytes (the server's `input_audio` / `audio_url` parts, LLM.chat's):
WAV (PCM 8 / 16 / 24 / 32-bit, IEEE float) with the standard library alone, anything else
(MP3, FLAC, OGG, M4A, ...) through PyAV (`pip install 'paged-engine[audio]'`). Channels are
averaged, as librosa's `load(mono=True)` does.

`resample` is band-limited (Hann-windowed sinc, 6 zero crossings, cutoff 0.99 of the lower
Nyquist rate; the defaults of torchaudio's `resample`): vLLM resamples with librosa, so samples
may differ slightly from a vLLM server's for a clip not at the model's rate.
"""

from __future__ import annotations

import io
import math
import struct
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

MAX_SECONDS = 3600.0  # a clip longer than an hour is refused (memory, not meaning)
_ZERO_CROSSINGS = 6
_ROLLOFF = 0.99
_MAX_TABLE = 1 << 22  # polyphase table elements (phases x taps); beyond, the direct path
MAX_RATE = 1_000_000  # Hz: a kernel spans ~12 x rate / target inputs, so the rate is bounded
_MAX_CHUNKS = 1024  # chunks read before a WAV file's data chunk


def audio_item(item: Any, target_sr: int, what: str) -> np.ndarray:
    """One item of multi_modal_data['audio'] as a mono float32 waveform at `target_sr`;
    ValueError naming `what` for anything else."""
    sr: float | None = None
    if isinstance(item, tuple):
        if len(item) != 2:
            raise ValueError(
                f"{what}: an audio item is (waveform, sampling_rate) or a waveform, got a "
                f"tuple of {len(item)}"
            )
        item, sr = item
        if isinstance(sr, bool) or not isinstance(sr, (int, float)) or not 0 < sr <= MAX_RATE:
            raise ValueError(
                f"{what}: the sampling rate must be a positive number up to {MAX_RATE} Hz, "
                f"got {sr!r}"
            )
    wave = _waveform(item, what)
    rate = float(sr) if sr is not None else float(target_sr)
    if wave.size / rate > MAX_SECONDS:
        raise ValueError(f"{what}: {wave.size / rate:.0f} s of audio is over {MAX_SECONDS:.0f} s")
    if rate != target_sr:
        if rate != int(rate):
            raise ValueError(f"{what}: the sampling rate must be a whole number, got {sr!r}")
        wave = resample(wave, int(rate), target_sr)
    return wave


def _waveform(data: Any, what: str) -> np.ndarray:
    if isinstance(data, torch.Tensor):
        data = data.detach().cpu()
        data = data.float().numpy() if data.is_floating_point() else data.numpy()
    elif isinstance(data, (list, tuple)):
        data = np.asarray(data)
    if not isinstance(data, np.ndarray):
        raise ValueError(
            f"{what}: an audio item is a waveform (numpy array, torch tensor or list of "
            f"floats) or (waveform, sampling_rate), got {type(data).__name__}"
        )
    if data.dtype.kind in "iu":
        data = _int_to_float(data)
    elif data.dtype.kind != "f":
        raise ValueError(f"{what}: audio samples must be numbers, got dtype {data.dtype}")
    if data.ndim == 2 and data.size:  # the channel axis is the shorter one
        data = data.mean(axis=0 if data.shape[0] < data.shape[1] else 1)
    if data.ndim != 1 or data.size == 0:
        raise ValueError(
            f"{what}: a waveform must be 1-D (or 2-D with channels) and not empty, got shape "
            f"{tuple(data.shape)}"
        )
    data = np.ascontiguousarray(data, dtype=np.float32)
    if not np.isfinite(data).all():
        raise ValueError(f"{what}: the waveform holds NaN or infinite samples")
    return data


def _int_to_float(data: np.ndarray) -> np.ndarray:
    info = np.iinfo(data.dtype)
    if info.min == 0:  # unsigned: centred on the middle of the range
        mid = (int(info.max) + 1) // 2
        return (data.astype(np.float64) - mid).astype(np.float32) / mid
    return data.astype(np.float32) / float(-int(info.min))


def resample(wave: np.ndarray, orig_sr: int, target_sr: int) -> np.ndarray:
    """`wave` (1-D float32) from `orig_sr` to `target_sr` samples a second: a polyphase filter
    of windowed-sinc kernels, one per output phase."""
    if orig_sr == target_sr:
        return wave
    g = math.gcd(orig_sr, target_sr)
    up, down = target_sr // g, orig_sr // g  # `up` outputs for every `down` inputs
    cutoff = min(up, down) * _ROLLOFF
    width = math.ceil(_ZERO_CROSSINGS * down / cutoff)
    # (e.g. 16001 -> 16000 Hz, 16000 phases of 16015 taps; 199995 Hz: 3200 phases of 40151
    # taps, 5 GB) no table past _MAX_TABLE: the direct path costs ~12 x the input. Many phases
    # of few taps (a 1 Hz clip: 16000 phases of 15 taps) take the table: the direct path costs
    # ~12 x the OUTPUT there, minutes for a 3.6 KB WAV file claiming 1 Hz
    if up * (2 * width + down) > _MAX_TABLE:
        return _resample_direct(wave, orig_sr, target_sr)
    # kernel of output phase j over inputs i - width .. i + width + down - 1 (i = block start)
    taps = torch.arange(-width, width + down, dtype=torch.float64) / down
    t = (taps[None, :] - torch.arange(up, dtype=torch.float64)[:, None] / up) * cutoff
    t = t.clamp(-_ZERO_CROSSINGS, _ZERO_CROSSINGS)
    window = torch.cos(t * math.pi / _ZERO_CROSSINGS / 2) ** 2
    t = t * math.pi
    sinc = torch.where(t == 0, torch.ones_like(t), torch.sin(t) / t)
    kernels = (sinc * window * cutoff / down).float()[:, None, :]
    x = torch.from_numpy(wave)[None, None, :]
    x = F.pad(x, (width, width + down))
    out = F.conv1d(x, kernels, stride=down)  # [1, up, blocks]
    n = math.ceil(up * wave.size / down)
    return out[0].t().reshape(-1)[:n].contiguous().numpy()


def _resample_direct(wave: np.ndarray, orig_sr: int, target_sr: int) -> np.ndarray:
    """The same filter evaluated at each output sample's own offset (any rate ratio), in
    blocks of outputs."""
    cutoff = min(orig_sr, target_sr) / orig_sr * _ROLLOFF  # in cycles per input sample * 2
    width = math.ceil(_ZERO_CROSSINGS / cutoff)
    x = torch.from_numpy(np.pad(wave, (width, width + 1))).double()
    taps = torch.arange(-width, width + 1, dtype=torch.float64)
    n = math.ceil(wave.size * target_sr / orig_sr)
    out = np.empty(n, dtype=np.float32)
    step = max(1, 2**22 // taps.numel())
    for lo in range(0, n, step):
        pos = torch.arange(lo, min(n, lo + step), dtype=torch.float64) * orig_sr / target_sr
        base = pos.floor()
        t = ((base[:, None] + taps[None, :] - pos[:, None]) * cutoff).clamp(
            -_ZERO_CROSSINGS, _ZERO_CROSSINGS
        )
        window = torch.cos(t * math.pi / _ZERO_CROSSINGS / 2) ** 2
        t = t * math.pi
        sinc = torch.where(t == 0, torch.ones_like(t), torch.sin(t) / t)
        rows = x[(base.long() + width)[:, None] + taps.long()[None, :]]
        out[lo : lo + step] = (rows * sinc * window).sum(1).mul(cutoff).float().numpy()
    return out


def load_audio(data: bytes, what: str) -> tuple[np.ndarray, int]:
    """(mono float32 waveform, sampling rate) of an audio file's bytes; ValueError naming
    `what` for bytes that are no audio."""
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return _read_wav(data, what)
    return _read_av(data, what)


def _read_wav(data: bytes, what: str) -> tuple[np.ndarray, int]:
    fmt = None
    pos = 12
    # a WAV file has a handful of chunks: 25 MB of empty 8-byte ones read for seconds
    for _ in range(_MAX_CHUNKS):
        if pos + 8 > len(data):
            break
        chunk, size = data[pos : pos + 4], struct.unpack("<I", data[pos + 4 : pos + 8])[0]
        body = data[pos + 8 : pos + 8 + size]
        if chunk == b"fmt " and len(body) >= 16:
            tag, channels, rate, _, _, bits = struct.unpack("<HHIIHH", body[:16])
            if tag == 0xFFFE and len(body) >= 26:  # WAVE_FORMAT_EXTENSIBLE: the subformat's tag
                tag = struct.unpack("<H", body[24:26])[0]
            fmt = (tag, channels, rate, bits)
        elif chunk == b"data":
            if fmt is None:
                break
            return _wav_samples(body, *fmt, what=what), fmt[2]
        pos += 8 + size + (size & 1)  # chunks are padded to even sizes
    raise ValueError(
        f"{what}: not a WAV file with a fmt and a data chunk (in its first {_MAX_CHUNKS} chunks)"
    )


def _wav_samples(body: bytes, tag: int, channels: int, rate: int, bits: int, *, what: str):
    if not channels or not rate:
        raise ValueError(f"{what}: a WAV file of {channels} channels at {rate} Hz")
    width = bits // 8
    if tag == 3 and bits in (32, 64):
        samples = np.frombuffer(body[: len(body) // width * width], dtype=f"<f{width}")
    elif tag == 1 and bits in (8, 16, 32):
        dtype = np.uint8 if bits == 8 else np.dtype(f"<i{width}")
        samples = _int_to_float(np.frombuffer(body[: len(body) // width * width], dtype=dtype))
    elif tag == 1 and bits == 24:
        raw = np.frombuffer(body[: len(body) // 3 * 3], dtype=np.uint8).reshape(-1, 3)
        ints = (raw[:, 0].astype(np.int32) | raw[:, 1].astype(np.int32) << 8) | (
            raw[:, 2].astype(np.int8).astype(np.int32) << 16
        )
        samples = ints.astype(np.float32) / float(1 << 23)
    else:
        raise ValueError(
            f"{what}: WAV format {tag} with {bits}-bit samples is not read (PCM 8/16/24/32-bit "
            "and 32/64-bit float are)"
        )
    frames = samples.size // channels
    if frames == 0:
        raise ValueError(f"{what}: the WAV file holds no samples")
    wave = samples[: frames * channels].reshape(frames, channels).mean(axis=1)
    return _waveform(wave.astype(np.float32), what)


def _read_av(data: bytes, what: str) -> tuple[np.ndarray, int]:
    try:
        import av
    except ImportError:
        raise ValueError(
            f"{what}: audio other than WAV is decoded with PyAV: pip install 'paged-engine[audio]'"
        ) from None
    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.audio:
                raise ValueError(f"{what}: the file has no audio stream")
            stream = container.streams.audio[0]
            rate = int(stream.rate or stream.codec_context.sample_rate)
            chunks = []
            for frame in container.decode(stream):
                arr = frame.to_ndarray()  # planar [channels, n] or packed [1, n * channels]
                if not frame.format.is_planar:
                    arr = arr.reshape(-1, len(frame.layout.channels)).T
                chunks.append(_waveform_rows(arr))
    except av.error.FFmpegError as e:  # (some are ValueErrors too): bytes it cannot decode
        raise ValueError(f"{what}: not an audio file PyAV can decode: {e}") from None
    except ValueError:
        raise
    except Exception as e:
        raise ValueError(f"{what}: not an audio file PyAV can decode: {e}") from None
    if not chunks or not rate:
        raise ValueError(f"{what}: the file holds no audio samples")
    return _waveform(np.concatenate(chunks), what), rate


def _waveform_rows(arr: np.ndarray) -> np.ndarray:
    """[channels, n] samples of any dtype -> mono float32 [n]."""
    if arr.dtype.kind in "iu":
        arr = _int_to_float(arr)
    return arr.astype(np.float32).mean(axis=0)
