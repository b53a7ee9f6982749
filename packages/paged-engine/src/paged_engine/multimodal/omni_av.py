"""Qwen-Omni videos with their own soundtrack: mm_processor_kwargs={"use_audio_in_video": True}.

    request: multi_modal_data={"video": [v0, ...], "audio": [a0, ...]}, clip i the audio track
             of video i; the prompt writes each video's one placeholder as usual
             (<|vision_bos|><|VIDEO|><|vision_eos|>) and no audio placeholder for its clip
    prompt:  <|VIDEO|> -> <|audio_bos|> V0 A0 V1 A1 ... <|audio_eos|> (transformers' Omni
             processors), V / A runs of the video's frame groups and of the clip's rows

The runs' order, as transformers builds it (time in positions: frame group k at
t_k = floor(k * step), step = temporal_patch_size / fps * position_id_per_seconds, audio row i
at i):
- Qwen2.5-Omni: chunks of N = int(position_id_per_seconds * seconds_per_chunk) positions; chunk
  j's video groups, then its audio rows (`_chunk_bounds`: HF's rule, which starts a chunk at the
  first value reaching j * N). A step over N would split a frame group between chunks: refused.
- Qwen3-Omni: merged by time, a frame group before the audio rows i >= t_k.

Each V run is its own video item (a slice of the video's frame groups: the towers read frame
by frame, so its rows are those of the whole video's) and each A run an audio item whose
`image_size` is (valid frames, first row, end row): the audio encoder runs the whole clip and
keeps those rows (omni_audio.py). M-RoPE (get_rope_index with use_audio_in_video):
- Qwen2.5-Omni: <|vision_bos|> and <|audio_bos|> both at the next text position s; a video
  group at s + 1 + (t_k, h, w), audio row i at s + 1 + i; <|audio_eos|> and <|vision_eos|> both
  one past the largest position of the block's last run, the text after them one further.
- Qwen3-Omni: the bos pair at s, s + 1; runs from s + 2; the eos pair at m + 1, m + 2 (m the
  last run's largest position).

Items this module made (a server's chat thread processes them ahead) come back without the
kwarg: the usual checks take each run as it is (audio.py, qwen_video.py `_placed`) and the
table sees the clips' runs (OmniVideoProcessor.places_audio).

Refused by name: counts of videos and clips that differ (mm_processor_kwargs
['use_audio_in_video']), a prompt with audio placeholders of its own beside them, items
processed ahead given with the kwarg, and a Qwen2.5-Omni step over a chunk
(mm_processor_kwargs['fps']: 2 / fps * 25 > 50, fps under 1, with the Hub's settings).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from paged_engine.multimodal.audio_io import audio_item
from paged_engine.multimodal.inputs import ImageInput, shift_offsets
from paged_engine.multimodal.layouts import digest
from paged_engine.multimodal.mrope import MropePositions
from paged_engine.multimodal.qwen_video import video_list

KWARG = "mm_processor_kwargs['use_audio_in_video']"
VIDEO_ONLY = ("fps", "do_sample_frames", "use_audio_in_video")  # not for the image processor

Segment = tuple[str, int, int]  # ("video", first group, end group) or ("audio", row, end row)


def _chunk_bounds(values: np.ndarray, per_chunk: int) -> list[tuple[int, int]]:
    """[start, end) of each chunk of non-decreasing `values`: a chunk ends before the first
    value reaching (chunks so far + 1) * per_chunk."""
    bounds, start, chunk = [], 0, 1
    for i, v in enumerate(values.tolist()):
        if v >= chunk * per_chunk:
            bounds.append((start, i))
            start, chunk = i, chunk + 1
    bounds.append((start, len(values)))
    return bounds


def temporal(groups: int, step: float, first: int = 0) -> np.ndarray:
    """Temporal positions of frame groups first, first + 1, ... (float32, floored, as
    transformers scales them)."""
    k = np.arange(first, first + groups, dtype=np.float32)
    return (k * np.float32(step)).astype(np.int64)


def interleave(groups: int, step: float, rows: int, qwen3: bool, per_chunk: int) -> list[Segment]:
    """The block's runs in prompt order (adjacent runs of one kind merged)."""
    t = temporal(groups, step)
    out: list[Segment] = []

    def put(kind: str, lo: int, hi: int) -> None:
        if hi <= lo:
            return
        if out and out[-1][0] == kind and out[-1][2] == lo:
            out[-1] = (kind, out[-1][1], hi)
        else:
            out.append((kind, lo, hi))

    if qwen3:
        a = 0
        for g in range(groups):  # the rows before t_g, then group g
            hi = min(rows, max(a, int(t[g])))
            put("audio", a, hi)
            a = hi
            put("video", g, g + 1)
        put("audio", a, rows)
        return out
    video = _chunk_bounds(t, per_chunk)
    audio = _chunk_bounds(np.arange(rows), per_chunk)
    for j in range(max(len(video), len(audio))):
        if j < len(video):
            put("video", *video[j])
        if j < len(audio):
            put("audio", *audio[j])
    return out


def process(inputs: Any, token_ids: list[int], mm_data: dict, kw: dict) -> tuple[list[int], tuple]:
    """InputProcessor.multimodal for use_audio_in_video=True (`inputs`: the InputProcessor):
    (the expanded prompt, its items in prompt order)."""
    videos, audios = inputs.videos, inputs.audios
    if not isinstance(kw["use_audio_in_video"], bool):
        raise ValueError(f"{KWARG} must be a bool, got {kw['use_audio_in_video']!r}")
    if audios is None:
        raise ValueError(f"{KWARG}: this model takes no audio (limit_mm_per_prompt)")
    vids = video_list(mm_data["video"], videos.limit) if "video" in mm_data else []
    data = mm_data.get("audio")
    clips = [] if data is None else data if isinstance(data, list) else [data]
    if len(vids) != len(clips) or not vids:
        raise ValueError(
            f"{KWARG}: each video needs its own audio track, in order: multi_modal_data has "
            f"{len(vids)} videos and {len(clips)} audio clips"
        )
    if any(isinstance(m, ImageInput) for m in [*vids, *clips]):
        raise ValueError(
            f"{KWARG}: give the videos and clips themselves (items processed ahead "
            "come without the kwarg)"
        )
    if audios.limit is not None and len(clips) > audios.limit:
        raise ValueError(
            f"multi_modal_data['audio'] has {len(clips)} clips, over "
            f"limit_mm_per_prompt['audio']={audios.limit}"
        )
    if audios.placeholder in token_ids:
        raise ValueError(
            f"{KWARG}: a video's audio has no placeholder of its own: drop the prompt's audio "
            "tokens (each clip goes where its video's token is)"
        )
    video_kw = {k: v for k, v in kw.items() if k in videos.kwargs_names}
    rest = {k: v for k, v in kw.items() if k not in videos.kwargs_names}
    video_kw.pop("use_audio_in_video")
    images: tuple = ()
    if "image" in mm_data:
        image_kw = {k: v for k, v in kw.items() if k not in VIDEO_ONLY}
        token_ids, images = inputs._images(token_ids, mm_data["image"], image_kw)
    elif rest:
        videos.check_kwargs(rest)  # names the first it does not take
    video_kw = videos.check_kwargs(video_kw)
    loaded = [videos._load(i, v, video_kw) for i, v in enumerate(vids)]
    whats = [f"multi_modal_data['audio'][{i}]" for i in range(len(clips))]
    waves = [audio_item(c, audios.sampling_rate, w) for c, w in zip(clips, whats, strict=True)]
    sounds = audios.load_clips(waves, whats)
    return _place(videos, audios.placeholder, token_ids, images, loaded, sounds)


def _place(
    videos: Any, audio_token: int, token_ids: list[int], images: tuple, loaded: list, sounds: list
) -> tuple[list[int], tuple]:
    """Each video token -> its block; the items (images moved with the text) in prompt order."""
    config = videos.config
    at = [i for i, t in enumerate(token_ids) if t == videos.video_token_id]
    if len(at) != len(loaded):
        raise ValueError(
            f"multi_modal_data['video']: the prompt has {len(at)} video tokens for "
            f"{len(loaded)} videos (with {KWARG}, one token a video)"
        )
    merge = videos.settings["merge_size"]
    pps = videos.position_id_per_seconds
    per_chunk = int(pps * float(getattr(config, "seconds_per_chunk", 2)))
    bos, eos = int(config.audio_start_token_id), int(config.audio_end_token_id)
    out: list[int] = []
    items: list[ImageInput] = []
    added: list[tuple[int, int]] = []  # (video token's index, tokens its block adds)
    last = 0
    for where, (rows, grid, step), (feats, size, n) in zip(at, loaded, sounds, strict=True):
        if not videos.qwen3 and step > per_chunk:
            raise ValueError(
                f"mm_processor_kwargs['fps']: with {KWARG} a frame group's step ({step:.4g} "
                f"positions) must fit a chunk ({per_chunk}): give a higher fps"
            )
        out += token_ids[last:where] + [bos]
        begin = len(out) - 1
        t, h, w = grid
        per_group = h * w
        for kind, lo, hi in interleave(t, step, n, videos.qwen3, per_chunk):
            if kind == "video":
                part = rows[lo * per_group : hi * per_group]
                sub = (hi - lo, h, w)
                count = (hi - lo) * per_group // merge**2
                items.append(ImageInput(part, len(out), count, digest(part, sub), sub, t_step=step))
                out += [videos.video_token_id] * count
            else:
                cut = (size[0], lo, hi)
                key = digest(feats, cut)
                items.append(ImageInput(feats, len(out), hi - lo, key, cut, modality="audio"))
                out += [audio_token] * (hi - lo)
        out.append(eos)
        added.append((where, len(out) - begin - 1))
        last = where + 1
    out += token_ids[last:]
    moved = shift_offsets(images, added)
    return out, tuple(sorted([*moved, *items], key=lambda m: m.offset))


def is_cut(m: ImageInput) -> bool:
    """Whether `m` is a run of a clip's rows (an audio item of a video's block)."""
    return m.modality == "audio" and m.image_size is not None and len(m.image_size) == 3


def _groups(items: tuple[ImageInput, ...]) -> list[list[ImageInput]]:
    """Visual items alone, and each video's block (runs that touch, with a clip's run in
    them: bos / eos tokens keep any two blocks or items apart); lone clips left out (text
    positions, as get_rope_index gives them)."""
    out: list[list[ImageInput]] = []
    for m in items:
        if m.modality == "audio" and not is_cut(m):
            continue
        if out and out[-1][-1].end == m.offset:
            out[-1].append(m)
        else:
            out.append([m])
    return out


def av_positions(
    num_tokens: int, items: tuple[ImageInput, ...], merge: int, qwen3: bool
) -> MropePositions:
    """The M-RoPE table of a prompt with videos' blocks (and images, videos, clips)."""
    table = np.empty((3, num_tokens), dtype=np.int64)
    pos, last = 0, 0  # the next position; the prompt index up to which the table is written
    groups = _groups(items)
    for group in groups:
        block = any(is_cut(m) for m in group)
        start = group[0].offset - (2 if block else 0)  # (the block's bos pair)
        table[:, last:start] = np.arange(pos, pos + start - last)
        pos += start - last
        if block:  # the bos pair: s, s (Qwen2.5-Omni) or s, s + 1 (Qwen3-Omni)
            table[:, start] = pos
            table[:, start + 1] = pos + 1 if qwen3 else pos
            pos += 2 if qwen3 else 1
        k = 0  # the video's frame groups before this run
        for m in group:
            assert m.image_size is not None
            if is_cut(m):
                lo, hi = m.image_size[1:]
                table[:, m.offset : m.end] = pos + np.arange(lo, hi)
                continue
            t, h, w = m.image_size[0], m.image_size[1] // merge, m.image_size[2] // merge
            if t * h * w != m.length:
                raise ValueError(f"an item's grid {m.image_size} does not give its {m.length} rows")
            times = temporal(t, m.t_step, k) if block else temporal(t, m.t_step)
            grid = np.stack(np.meshgrid(times, np.arange(h), np.arange(w), indexing="ij"))
            table[:, m.offset : m.end] = grid.reshape(3, -1) + pos
            k += t
        tail = group[-1]  # the next position: one past the last run's largest
        pos = int(table[:, tail.offset : tail.end].max()) + 1
        last = tail.end
        if block:  # the eos pair: m + 1, m + 1 (Qwen2.5-Omni) or m + 1, m + 2 (Qwen3-Omni)
            table[:, last] = pos
            table[:, last + 1] = pos + 1 if qwen3 else pos
            pos += 2 if qwen3 else 1
            last += 2
    table[:, last:] = np.arange(pos, pos + num_tokens - last)
    first = groups[0][0].offset - 2 if groups else num_tokens
    delta = int(table.max()) + 1 - num_tokens if num_tokens else 0
    return MropePositions(table, max(first, 0), delta)
