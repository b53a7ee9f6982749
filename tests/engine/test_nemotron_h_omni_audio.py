"""Nemotron-H Omni's audio (multimodal/nemotron_h_omni_audio.py) against HF's
NemotronH_Omni_Reasoning_V3 with a tiny Parakeet encoder (one conformer block, 16 mels, three
stride-2 stages) and its projector, saved as transformers saves it (the Hub's `sound_encoder.`,
`sound_projection.` names), the image checkpoint of test_nemotron_h_omni.py plus the audio
tokens and ParakeetFeatureExtractor's settings in processor_config.json. HF's prompt and
features come from NemotronH_Omni_Reasoning_V3Processor's own code (its image side over the
engine's torch copy, as the image test has it): the engine must give its prompt ids
(<so_start>, the run, <so_end>), greedy tokens and top-5 logprobs (1e-3, float32) for a clip
alone, two clips, text, and a clip beside an image; the same clips with HF's expanded ids
are taken as they are. The BatchNorm statistics are randomized (HF's init leaves them 0 / 1).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from audio_checks import check_matches_hf, noise_clip
from hf_reference import assert_matches, hf_greedy
from image_checks import engine, greedy, noise_image
from test_nemotron_h_omni import PROCESSOR, SPECIAL, _config, _hf_processor
from vlm_checkpoints import finish_checkpoint, load_hf_vlm, tokenizer_with

from paged_engine.testing import _COMMON, _save_random, tiny_config

transformers = pytest.importorskip("transformers")

MARKS = ["<so_start>", "<so_end>"]
FEATURES = {
    "feature_extractor_type": "ParakeetFeatureExtractor",
    "feature_size": 16,
    "sampling_rate": 16000,
    "hop_length": 160,
    "n_fft": 512,
    "win_length": 400,
}
ONE = "User: <so_embedding>\nWhat is said? Assistant:"
TWO = "User: <so_embedding> then <so_embedding>\nSame voice? Assistant:"
TEXT = "User: Say something about the sea. Assistant:"
BOTH = "User: <image> and <so_embedding>\nDescribe both. Assistant:"


def write_tiny_audio(path: Path, seed: int) -> Path:
    """The image checkpoint's tokenizer and settings plus <so_start> / <so_end>, an
    audio_config and the feature extractor's settings; BatchNorm statistics randomized."""
    from safetensors.torch import load_file, save_file

    path.mkdir(parents=True, exist_ok=True)
    tokenizer, ids = tokenizer_with(SPECIAL + MARKS, seed)
    tokenizer._set_model_specific_special_tokens(
        {"image_token": "<image>", "image_start_token": "<img>", "image_end_token": "</img>"}
    )
    text = tiny_config("nemotron_h", vocab_size=len(tokenizer)).to_dict()
    ids = {
        "image_token_id": ids["<image>"],
        "video_token_id": ids["<video>"],
        "audio_token_id": ids["<so_embedding>"],
    }
    config = _config(text, audio=True, **ids, **_COMMON)
    _save_random(transformers.NemotronH_Omni_Reasoning_V3, config, seed, path)
    weights = load_file(str(path / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    for name, t in weights.items():
        if name.endswith("running_mean"):
            weights[name] = 0.3 * torch.randn(t.shape, generator=g)
        elif name.endswith("running_var"):
            weights[name] = 0.5 + torch.rand(t.shape, generator=g)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    (path / "processor_config.json").write_text(json.dumps({"feature_extractor": FEATURES}))
    return finish_checkpoint(path, tokenizer)


def _processor(path: Path):
    """HF's processor (as the image test builds it) with its audio attributes as its
    __init__ sets them and the saved ParakeetFeatureExtractor."""
    processor = _hf_processor(path)
    settings = {k: v for k, v in FEATURES.items() if k != "feature_extractor_type"}
    processor.feature_extractor = transformers.ParakeetFeatureExtractor(**settings)
    processor.audio_token, (processor.audio_start_token, processor.audio_end_token) = (
        "<so_embedding>",
        MARKS,
    )
    processor.audio_token_id = processor.tokenizer.convert_tokens_to_ids("<so_embedding>")
    processor.audio_sampling_rate, processor.audio_hop_length = 16000, 160
    processor.audio_subsampling_factor = 8
    return processor


def _hf_greedy(model, processor, text: str, clips: list, images: list):
    if not clips and not images:
        ids = processor.tokenizer.encode(text, add_special_tokens=False)
        return ids, hf_greedy(model, ids, 8, 5)
    out = processor(text=[text], images=images or None, audio=clips or None, return_tensors="pt")
    keys = ("pixel_values", "image_grid_hw", "input_features", "input_features_mask")
    extra = {k: out[k] for k in keys if k in out}
    return out["input_ids"][0].tolist(), hf_greedy(
        model, out["input_ids"][0].tolist(), 8, 5, **extra
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_audio(tmp_path_factory.mktemp("nemotron-h-omni-audio"), seed=7)


def test_audio_matches_hf(tiny):
    """A 0.96 s clip (96 valid frames: its 13th row is past the encoder's mask, which HF keeps
    and fills from a fully masked attention row), text alone, two clips of 0.7 s and 1.3 s,
    and a clip beside an image: HF's prompt ids, greedy tokens and top-5 logprobs."""
    model = load_hf_vlm(transformers.NemotronH_Omni_Reasoning_V3, tiny)
    processor = _processor(tiny)
    cases = [
        (ONE, [noise_clip(1, 0.96)]),
        (TEXT, []),
        (TWO, [noise_clip(2, 0.7), noise_clip(3, 1.3)]),
    ]
    refs = [_hf_greedy(model, processor, text, clips, []) for text, clips in cases]
    audio = model.config.audio_token_id
    assert [ids.count(audio) for ids, _ in refs] == [13, 0, 9 + 17]
    llm = engine(tiny)
    check_matches_hf(llm, cases, refs, "nemotron_h_omni audio")
    clip, image = noise_clip(4, 1.1), noise_image(5, (30, 40))
    ids, ref = _hf_greedy(model, processor, BOTH, [clip], [image])
    data = {"audio": clip, "image": image}
    out = llm.generate([{"prompt": BOTH, "multi_modal_data": data}], greedy(), use_tqdm=False)
    assert out[0].prompt_token_ids == ids
    assert_matches("nemotron_h_omni audio + image", out[0], ref)


def test_bad_input_is_refused_by_name(tiny):
    """A clip too short, a clip short of its placeholder, video: ValueErrors naming what is
    wrong; the engine serves on."""
    llm = engine(tiny)
    clip = noise_clip(6, 0.5)
    cases = [
        ({"prompt": ONE, "multi_modal_data": {"audio": noise_clip(6, 0.01)}}, "too short"),
        ({"prompt": TWO, "multi_modal_data": {"audio": [clip]}}, "placeholder"),
        ({"prompt": ONE, "multi_modal_data": {"video": [noise_image(1, (16, 16))] * 2}}, "video"),
    ]
    for bad, match in cases:
        with pytest.raises(ValueError, match=match):
            llm.generate([bad], greedy(0), use_tqdm=False)
    out = llm.generate([{"prompt": ONE, "multi_modal_data": {"audio": clip}}], greedy(0))[0]
    assert len(out.outputs[0].token_ids) == 8


def test_config_refusals_name_the_field(tiny):
    from paged_engine.multimodal.nemotron_h_omni_audio import NemotronOmniAudioEncoder

    config = transformers.AutoConfig.from_pretrained(tiny)
    config.audio_config.num_key_value_heads = 1
    with pytest.raises(ValueError, match="num_key_value_heads"):
        NemotronOmniAudioEncoder(config)
    config.audio_config = None
    with pytest.raises(ValueError, match="without audio_config"):
        NemotronOmniAudioEncoder(config)
