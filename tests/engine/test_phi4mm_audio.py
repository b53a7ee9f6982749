"""Audio through Phi-4-multimodal checkpoints (multimodal/phi4mm_audio.py) against HF.

test_phi4mm_images.py's tiny random `Phi4MultimodalForCausalLM`, its conformer audio tower
(hidden 32, one block, NeMo subsampling by 8, a T5-style relative bias, chunks of 4 rows seeing
one chunk back: HF's chunk mask, which adds +1 / +0 to the scores) and the speech projector;
transformers' Phi4MultimodalFeatureExtractor. `LLM.generate` with `multi_modal_data["audio"]`
must give HF's expanded prompt ids (each <|audio|> repeated audio_embed_sizes times) and HF
`generate`'s greedy tokens and top-5 logprobs (1e-3, float32), a clip past 500 encoder rows
(HF's windows of 500) included. Then the engine's paths and refusals by name, the server's chat
path with an input_audio part (images with audio in one prompt: test_phi4mm_mixed.py).
"""

from __future__ import annotations

import pytest
import torch
from audio_checks import check_audio_paths, check_chat_input_audio, check_matches_hf, noise_clip
from hf_reference import hf_greedy
from image_checks import greedy
from test_phi4mm_images import AUDIO, write_tiny_phi4mm

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.phi4_multimodal")

ONE = f"<|user|>{AUDIO}What is it?<|end|><|assistant|>"
TWO = f"<|user|>{AUDIO} then {AUDIO}Same?<|end|><|assistant|>"
TEXT = "<|user|>Say something about the sea.<|end|><|assistant|>"


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_phi4mm(tmp_path_factory.mktemp("phi4mm-audio"), seed=5)


def _engine(path, **kw):
    from image_checks import LLM

    return LLM(model=str(path), dtype="float32", block_size=16, max_model_len=4096, **kw)


@pytest.fixture(autouse=True)
def _long_prompts(monkeypatch):
    """audio_checks' engines with room for a 41 s clip's run (641 tokens)."""
    import audio_checks

    monkeypatch.setattr(audio_checks, "engine", _engine)


def _hf_inputs(path, text: str, clips: list) -> tuple[list[int], dict]:
    """Phi4MultimodalProcessor's ids (each <|audio|> repeated audio_embed_sizes times) and the
    features; clips of one length (HF pads a batch and its mask then changes the scores)."""
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ids = tok.encode(text, add_special_tokens=False)
    if not clips:
        return ids, {}
    extractor = transformers.AutoFeatureExtractor.from_pretrained(path)
    out = extractor(clips, sampling_rate=16000, return_tensors="pt")
    mark = tok.convert_tokens_to_ids(AUDIO)
    runs = iter(int(n) for n in out["audio_embed_sizes"])
    expanded: list[int] = []
    for t in ids:
        expanded += [t] * next(runs) if t == mark else [t]
    keys = ("audio_input_features", "audio_embed_sizes")
    return expanded, {k: out[k] for k in keys}


def test_audio_matches_hf(path):
    model = transformers.Phi4MultimodalForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval().generation_config.eos_token_id = None
    cases = [
        (ONE, [noise_clip(1, 1.3)]),
        (TEXT, []),
        (TWO, [noise_clip(2, 0.7), noise_clip(3, 0.7)]),
        (ONE, [noise_clip(4, 41.0)]),  # 4098 frames -> 513 rows: two windows of 500
    ]
    refs = []
    for text, clips in cases:
        ids, extra = _hf_inputs(path, text, clips)
        refs.append((ids, hf_greedy(model, ids, 8, 5, **extra)))
    assert len(refs[3][0]) - len(refs[1][0]) > 500
    check_matches_hf(_engine(path), cases, refs, "phi4mm_audio")


def test_engine_paths_and_refusals(path):
    """audio_checks' paths (chunks through the clips, prefix-cache hits, clips processed
    ahead); a clip shorter than a frame is refused by name, and the engine serves on."""
    prompts = [
        {"prompt": ONE, "multi_modal_data": {"audio": noise_clip(i, 0.5 + 0.2 * i)}}
        for i in range(2)
    ] + [{"prompt": TWO, "multi_modal_data": {"audio": [noise_clip(7, 0.4), noise_clip(8, 0.9)]}}]
    cached = check_audio_paths(path, prompts, TWO, chunk=8)
    short = {"prompt": ONE, "multi_modal_data": {"audio": noise_clip(1, 0.01)}}
    with pytest.raises(ValueError, match="too short"):
        cached.generate([short], greedy(0), use_tqdm=False)
    out = cached.generate([prompts[0]], greedy(0), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 8


def test_chat_input_audio_gives_the_offline_tokens(path):
    check_chat_input_audio(_engine(path), noise_clip(9, 0.8))


def test_encoder_rows_match_hf(path):
    """The tower and projector alone: a clip's rows equal HF's audio embedding at its
    placeholders (chunk mask and relative bias inside the windows; 41 s: two windows)."""
    from safetensors.torch import load_file

    from paged_engine.multimodal.audio_archs import build_audio_encoder

    model = transformers.Phi4MultimodalForCausalLM.from_pretrained(path, dtype=torch.float32)
    config = model.config
    encoder = build_audio_encoder(config).float()
    encoder.load_weights(load_file(path / "model.safetensors").items())
    llm = _engine(path)
    audios = llm.llm_engine.input_processor.audios
    tok = llm.get_tokenizer()
    for seconds in (1.3, 41.0):
        clip = noise_clip(6, seconds)
        ids, extra = _hf_inputs(path, ONE, [clip])
        _, placed, _ = audios.process(tok.encode(ONE, add_special_tokens=False), [clip])
        input_ids = torch.tensor([ids])
        with torch.no_grad():
            base = model.model.embed_tokens(input_ids)
            want = model.model.embed_tokens_extend.audio_embed(input_ids, base, **extra)
            (got,) = encoder.encode(placed)
        mark = input_ids[0] == config.audio_config.audio_token_id
        torch.testing.assert_close(got, want[0, mark], atol=2e-5, rtol=1e-5)
