"""Checks shared by the audio tests (test_*_audio.py): noise clips, WAV bytes, HF's model as a
reference (`HFAudio`), the engine against HF's references, the engine's own paths with audio
against its plain run, and the server's chat path with an input_audio part against the offline
answer."""

from __future__ import annotations

import base64
import io
import wave
from collections.abc import Callable

import numpy as np
import pytest
from hf_reference import assert_matches, assert_same_greedy, hf_greedy
from image_checks import engine, greedy

from paged_engine import LLM


def noise_clip(seed: int, seconds: float, sr: int = 16_000) -> np.ndarray:
    """A mono float32 clip: a few random tones in noise, `seconds` long at `sr`."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * sr)) / sr
    tones = sum(np.sin(2 * np.pi * f * t + p) for f, p in rng.uniform(80, 3000, (3, 2)))
    return (0.2 * tones + 0.05 * rng.standard_normal(t.size)).astype(np.float32)


def wav_bytes(clip: np.ndarray, sr: int = 16_000) -> bytes:
    """`clip` as a 16-bit PCM mono WAV file."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sr)
        w.writeframes((np.clip(clip, -1, 1) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def wav_base64(clip: np.ndarray, sr: int = 16_000) -> str:
    return base64.b64encode(wav_bytes(clip, sr)).decode()


def check_audio_paths(path, prompts: list[dict], text: str, *, chunk: int = 8) -> LLM:
    """Against one plain run of `prompts` (each with audio; the last one's text `text`):
    `chunk`-token chunks through the clips; a prefix-cache hit on the same clip and none past
    the text for another clip; the last prompt's clips processed ahead
    (`AudioProcessor.process`) and handed over with the expanded ids, and moved one token
    (refused). Returns the prefix-caching engine, still serving."""
    params = greedy(0, 16)

    def run(llm, batch=prompts):
        return [o.outputs[0] for o in llm.generate(batch, params, use_tqdm=False)]

    plain = run(engine(path))
    chunked = engine(
        path, max_num_batched_tokens=chunk, enable_chunked_prefill=True, max_num_seqs=3
    )
    assert_same_greedy(plain, run(chunked))

    cached = engine(path, enable_prefix_caching=True)
    run(cached, prompts[:1])
    again = cached.generate(prompts[:1], params, use_tqdm=False)[0]
    assert again.num_cached_tokens >= (len(again.prompt_token_ids) - 1) // 16 * 16
    assert_same_greedy(plain[:1], [again.outputs[0]])
    audios = cached.llm_engine.input_processor.audios
    other = cached.generate(prompts[1:2], params, use_tqdm=False)[0]
    first = other.prompt_token_ids.index(audios.placeholder)
    assert other.num_cached_tokens <= first // 16 * 16

    clips = prompts[-1]["multi_modal_data"]["audio"]
    expanded, done, _ = audios.process(cached.get_tokenizer().encode(text), clips)
    ahead = {"prompt_token_ids": expanded, "multi_modal_data": {"audio": list(done)}}
    assert_same_greedy(plain[-1:], run(cached, [ahead]))
    moved = {"prompt_token_ids": [5, *expanded], "multi_modal_data": {"audio": list(done)}}
    with pytest.raises(ValueError, match="does not match"):
        cached.generate([moved], params, use_tqdm=False)
    return cached


def check_matches_hf(llm: LLM, cases: list[tuple[str, list]], refs: list, name: str) -> None:
    """Each case (prompt text, its clips) through `llm` gives HF's prompt ids and its reference
    (`refs[i]`: (HF's ids, hf_greedy's result)); the same clips with HF's expanded ids as
    `prompt_token_ids` are taken as they are and give the same tokens."""
    prompts = [
        {"prompt": text, "multi_modal_data": {"audio": clips}} if clips else text
        for text, clips in cases
    ]
    for (ids, ref), out in zip(refs, llm.generate(prompts, greedy(), use_tqdm=False), strict=True):
        assert out.prompt_token_ids == ids
        assert_matches(name, out, ref)
    with_clips = [(r, clips) for r, (_, clips) in zip(refs, cases, strict=True) if clips]
    ahead = [
        {"prompt_token_ids": ids, "multi_modal_data": {"audio": clips}}
        for (ids, _), clips in with_clips
    ]
    outs = llm.generate(ahead, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [ref.tokens for (_, ref), _ in with_clips]


def held(clip: np.ndarray) -> np.ndarray:
    """`clip` as its 16-bit WAV file holds it (what the server decodes)."""
    return (np.clip(clip, -1, 1) * 32767).astype(np.int16).astype(np.float32) / 32768


def check_chat_input_audio(
    llm: LLM,
    clip: np.ndarray,
    *,
    more: Callable[[object, dict, object], None] | None = None,
) -> None:
    """The server's chat path over `llm` (shut down after): a user turn of an input_audio part
    (`clip` as a base64 WAV) and a text part gives the offline greedy tokens (6) and prompt ids
    of the chat template's prompt with the clip. `more(http, body, want)` runs further requests
    on the same server (`body`: the request that gave the offline answer `want`)."""
    pytest.importorskip("paged_server")
    from server.server_proc import COMMON_ARGS, serve_in_process

    question = {"type": "text", "text": "What is it?"}
    prompt = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": [{"type": "audio"}, question]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    want = llm.generate(
        [{"prompt": prompt, "multi_modal_data": {"audio": held(clip)}}], greedy(0, 6)
    )[0]
    part = {"type": "input_audio", "input_audio": {"data": wav_base64(clip), "format": "wav"}}
    body = {
        "model": "tiny",
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "messages": [{"role": "user", "content": [part, question]}],
    }
    try:
        with serve_in_process(COMMON_ARGS, llm.llm_engine) as (http, _):
            status, _, out = http.request("POST", "/v1/chat/completions", body)
            assert status == 200, out
            assert out["prompt_token_ids"] == want.prompt_token_ids
            assert out["choices"][0]["token_ids"] == want.outputs[0].token_ids
            if more is not None:
                more(http, body, want)
    finally:
        llm.llm_engine.shutdown()


class HFAudio:
    """HF's model of a tiny audio checkpoint, for references: float32, eval, no EOS (greedy runs
    its whole length), its tokenizer and paged's `features` (HF's extractors need torchaudio).
    `ids` expands each placeholder of a prompt as HF's processors do; subclasses set
    `model_class` and `audio` (the placeholder's text) and say how many placeholders a clip
    takes (`placeholders`) and how HF encodes clips (`greedy(text, clips) -> (ids, ref)`)."""

    model_class: type
    audio: str
    max_tokens = 8

    def __init__(self, path, features) -> None:
        import torch
        from transformers import AutoTokenizer

        self.model = self.model_class.from_pretrained(path, dtype=torch.float32).eval()
        self.model.generation_config.eos_token_id = None
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.features = features

    def placeholders(self, clip: np.ndarray) -> int:
        raise NotImplementedError

    def ids(self, text: str, clips: list) -> list[int]:
        """The processor's ids: each placeholder in turn repeated per its clip."""
        pieces = text.split(self.audio)
        assert len(pieces) == len(clips) + 1
        runs = [self.audio * self.placeholders(c) for c in clips]
        expanded = pieces[0] + "".join(r + p for r, p in zip(runs, pieces[1:], strict=True))
        return self.tokenizer(expanded)["input_ids"]

    def generate(self, ids: list[int], **kw):
        """hf_greedy's tokens and top-5 logprobs of `ids` (`kw`: more inputs of generate)."""
        return hf_greedy(self.model, ids, self.max_tokens, 5, **kw)


def check_clips_match_hf(llm: LLM, hf: HFAudio, one: str, text: str, two: str, name: str) -> list:
    """Prompt `one` with one clip (1 s), `text` alone, and `two` with two clips of different
    lengths (0.7 s and 1.9 s) through `llm` (check_matches_hf against `hf.greedy`). Returns
    the references: (HF's ids, hf_greedy's result) per case."""
    cases = [
        (one, [noise_clip(1, 1.0)]),
        (text, []),
        (two, [noise_clip(2, 0.7), noise_clip(3, 1.9)]),
    ]
    refs = [hf.greedy(t, clips) for t, clips in cases]
    check_matches_hf(llm, cases, refs, name)
    return refs


def check_prompt_matches_hf(llm: LLM, hf: HFAudio, prompt: dict, clip: np.ndarray, name: str):
    """`prompt` ({"prompt": text}, e.g. a transcription_prompt) with `clip` gives HF's prompt
    ids and reference (`hf.greedy(text, [clip])`)."""
    ids, ref = hf.greedy(prompt["prompt"], [clip])
    out = llm.generate([{**prompt, "multi_modal_data": {"audio": clip}}], greedy(), use_tqdm=False)
    assert out[0].prompt_token_ids == ids
    assert_matches(name, out[0], ref)


def check_one_two_paths(path, one: str, two: str, longest: float = 1.3) -> LLM:
    """check_audio_paths on `one` (one placeholder) with clips of 0.6 s and 1.1 s, then `two`
    (two placeholders) with clips of 0.4 s and `longest` s. Returns its engine."""
    prompts = [
        {"prompt": one, "multi_modal_data": {"audio": noise_clip(10 + i, 0.6 + 0.5 * i)}}
        for i in range(2)
    ]
    clips = [noise_clip(12, 0.4), noise_clip(13, longest)]
    prompts.append({"prompt": two, "multi_modal_data": {"audio": clips}})
    return check_audio_paths(path, prompts, two)


def tone_clip(seed: int, seconds: float, sr: int = 16_000) -> np.ndarray:
    """A mono float32 clip: one tone of 200 + 150 * `seed` Hz in noise, `seconds` long."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * sr)) / sr
    tone = np.sin(2 * np.pi * (200 + 150 * seed) * t)
    return (0.3 * tone + 0.1 * rng.standard_normal(t.size)).astype(np.float32)


def check_chat_writes_placeholder(
    llm: LLM, clip: np.ndarray, placeholder: str, token: int, count: int
) -> None:
    """`LLM.chat` with a user turn of an input_audio part (`clip` as a base64 WAV) and the
    question "What is it?" gives the prompt ids and greedy tokens of the ChatML prompt written
    out with `placeholder` before the question, the ids holding `token` `count` times."""
    part = {"type": "input_audio", "input_audio": {"data": wav_base64(clip), "format": "wav"}}
    question = {"type": "text", "text": "What is it?"}
    got = llm.chat([{"role": "user", "content": [part, question]}], greedy(0), use_tqdm=False)
    prompt = f"<|im_start|>user\n{placeholder}\nWhat is it?<|im_end|>\n<|im_start|>assistant\n"
    want = llm.generate([{"prompt": prompt, "multi_modal_data": {"audio": held(clip)}}], greedy(0))
    assert got[0].prompt_token_ids == want[0].prompt_token_ids
    assert got[0].prompt_token_ids.count(token) == count
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids


def check_transcription_refusals(llm: LLM, name: str, shortest: str) -> None:
    """An encoder-decoder ASR model `name` (as its messages spell it) refuses by name the
    translate task and a context prompt for its transcription prompt, and clips shorter than
    `shortest` seconds ("0.050"), over 30 s or two to a prompt."""
    host = llm.llm_engine.input_processor.audios
    with pytest.raises(ValueError, match="task"):
        host.transcription_prompt("en", "translate", "")
    with pytest.raises(ValueError, match="prompt"):
        host.transcription_prompt("en", "transcribe", "earlier words")
    bad = [
        (tone_clip(1, 0.03), f"a clip of 0.030 s; {name} takes {shortest} s to 30 s"),
        (tone_clip(1, 30.5), "a clip of 30.500 s"),
        ([tone_clip(1, 0.5), tone_clip(2, 0.5)], f"{name} takes one clip a prompt, got 2"),
    ]
    for audio, why in bad:
        with pytest.raises(ValueError, match=r"multi_modal_data\['audio'\]: " + why):
            llm.generate([{"prompt": "", "multi_modal_data": {"audio": audio}}], greedy())
