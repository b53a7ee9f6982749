"""Images and audio in one Phi-4-multimodal prompt (multimodal/phi4mm.py, phi4mm_audio.py)
against HF.

test_phi4mm_images.py's tiny random `Phi4MultimodalForCausalLM`. HF expands each <|image|> and
each <|audio|> in place and, whenever the forward carries image pixels, projects the clips with
its vision-speech projector (`*_for_vision_speech`, random here and unlike the speech one), as
vLLM's `embed_multimodal` does after the images. `LLM.generate` must give HF's expanded ids,
greedy tokens and top-5 logprobs (1e-3, float32) for an image then a clip, a clip then an image,
two of each interleaved, and, in the same batch, the same clip alone (the speech projector: the
clip's hash differs, so neither the encoder cache nor the prefix cache mixes the two); HF's
expanded ids with the media (clips processed ahead for an audio-only prompt included) give the
same tokens, and so do prefill chunks through the runs and a prefix-cache hit. `LLM.chat` with
OpenAI image_url and input_audio parts, in either order, gives the offline answer.
"""

from __future__ import annotations

import pytest
import torch
from audio_checks import held, noise_clip, wav_base64
from hf_reference import assert_matches, hf_greedy
from image_checks import data_url, greedy, noise_image
from test_phi4mm_images import AUDIO, IMAGE, write_tiny_phi4mm
from test_phi4mm_images import _hf_inputs as _hf_image_inputs

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.phi4_multimodal")

IMAGE_AUDIO = f"<|user|>{IMAGE}{AUDIO}What do you see and hear?<|end|><|assistant|>"
AUDIO_IMAGE = f"<|user|>{AUDIO} and then {IMAGE}Same?<|end|><|assistant|>"
INTERLEAVED = f"<|user|>{IMAGE}{AUDIO} then {AUDIO}{IMAGE}Which?<|end|><|assistant|>"
AUDIO_ONLY = f"<|user|>{AUDIO}What is it?<|end|><|assistant|>"


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_phi4mm(tmp_path_factory.mktemp("phi4mm-mixed"), seed=6)


def _engine(path):
    from image_checks import LLM

    return LLM(model=str(path), dtype="float32", block_size=16, max_model_len=4096)


def _hf_inputs(path, text: str, images: list, clips: list) -> tuple[list[int], dict]:
    """Phi4MultimodalProcessor's ids (each <|image|> and <|audio|> repeated in place) and the
    image and audio inputs; clips of one length (HF pads a batch of clips)."""
    ids, extra = _hf_image_inputs(path, text, images)
    if not clips:
        return ids, extra
    out = transformers.AutoFeatureExtractor.from_pretrained(path)(
        clips, sampling_rate=16000, return_tensors="pt"
    )
    mark = transformers.AutoTokenizer.from_pretrained(path).convert_tokens_to_ids(AUDIO)
    runs = iter(int(n) for n in out["audio_embed_sizes"])
    expanded: list[int] = []
    for t in ids:
        expanded += [t] * next(runs) if t == mark else [t]
    extra |= {k: out[k] for k in ("audio_input_features", "audio_embed_sizes")}
    return expanded, extra


def _cases() -> list[tuple[str, list, list]]:
    return [
        (IMAGE_AUDIO, [noise_image(1, (40, 100))], [noise_clip(1, 0.6)]),
        (AUDIO_IMAGE, [noise_image(2, (70, 50))], [noise_clip(2, 0.9)]),
        (
            INTERLEAVED,
            [noise_image(3, (20, 30)), noise_image(4, (100, 150))],
            [noise_clip(3, 0.5), noise_clip(4, 0.5)],
        ),
        (AUDIO_ONLY, [], [noise_clip(1, 0.6)]),  # case 0's clip: the speech projector
    ]


def _data(images: list, clips: list) -> dict:
    return {"image": images, "audio": clips} if images else {"audio": clips}


def test_images_and_audio_match_hf(path):
    model = transformers.Phi4MultimodalForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval().generation_config.eos_token_id = None
    audio = model.model.embed_tokens_extend.audio_embed
    assert not torch.equal(audio.up_proj_for_speech.weight, audio.up_proj_for_vision_speech.weight)
    cases = _cases()
    refs = []
    for text, images, clips in cases:
        ids, extra = _hf_inputs(path, text, images, clips)
        refs.append((ids, hf_greedy(model, ids, 8, 5, **extra)))
    llm = _engine(path)
    prompts = [{"prompt": t, "multi_modal_data": _data(i, c)} for t, i, c in cases]
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    for (text, *_), (ids, ref), out in zip(cases, refs, outs, strict=True):
        assert out.prompt_token_ids == ids
        assert_matches(f"phi4mm {text!r}", out, ref)
    # HF's expanded ids as they are; case 0's clip processed ahead for an audio-only prompt
    # (the speech projector's hash) takes the vision-speech one beside the image
    (ids0, ref0), (_, images0, clips0) = refs[0], cases[0]
    _, ahead, _ = llm.llm_engine.input_processor.audios.process(ids0, clips0)
    again = [
        {"prompt_token_ids": ids, "multi_modal_data": _data(c[1], c[2])}
        for (ids, _), c in zip(refs, cases, strict=True)
    ]
    again.append({"prompt_token_ids": ids0, "multi_modal_data": _data(images0, list(ahead))})
    outs = llm.generate(again, greedy(), use_tqdm=False)
    want = [ref.tokens for _, ref in refs] + [ref0.tokens]
    assert [o.outputs[0].token_ids for o in outs] == want
    # 96-token chunks through the runs, then the same prompt again from the prefix cache
    from image_checks import LLM

    chunked = LLM(
        model=str(path),
        dtype="float32",
        block_size=16,
        max_model_len=4096,
        max_num_batched_tokens=96,
        enable_chunked_prefill=True,
    )
    (ids2, ref2), (text2, images2, clips2) = refs[2], cases[2]
    prompt = {"prompt": text2, "multi_modal_data": _data(images2, clips2)}
    for _ in range(2):
        (out,) = chunked.generate([prompt], greedy(), use_tqdm=False)
        assert_matches("phi4mm chunked", out, ref2)
    assert out.num_cached_tokens >= len(ids2) - 16


def test_chat_image_url_and_input_audio(path):
    """LLM.chat with OpenAI parts (an image_url data: URL and an input_audio WAV, in either
    order) gives the chat template's prompt with the media through LLM.generate."""
    llm = _engine(path)
    image, clip = noise_image(5, (60, 90)), held(noise_clip(5, 0.7))
    image_part = {"type": "image_url", "image_url": {"url": data_url(image)}}
    audio_part = {"type": "input_audio", "input_audio": {"data": wav_base64(clip), "format": "wav"}}
    question = {"type": "text", "text": "Describe both."}
    tok = llm.get_tokenizer()
    for parts, forms in [
        ([image_part, audio_part], [{"type": "image"}, {"type": "audio"}]),
        ([audio_part, image_part], [{"type": "audio"}, {"type": "image"}]),
    ]:
        (got,) = llm.chat(
            [{"role": "user", "content": [*parts, question]}], greedy(), use_tqdm=False
        )
        text = tok.apply_chat_template(
            [{"role": "user", "content": [*forms, question]}],
            tokenize=False,
            add_generation_prompt=True,
        )
        prompt = {"prompt": text, "multi_modal_data": {"image": [image], "audio": [clip]}}
        (want,) = llm.generate([prompt], greedy(), use_tqdm=False)
        assert got.prompt_token_ids == want.prompt_token_ids
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
