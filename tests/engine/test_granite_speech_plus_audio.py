"""Audio through Granite Speech Plus (multimodal/granite_speech_plus.py) against HF transformers.

The Granite Speech checkpoint of test_granite_speech_audio.py (its tokenizer, chat template,
extractor settings and HF reference, reused from there) rebuilt as a tiny random
GraniteSpeechPlusForConditionalGeneration whose projector reads the input projection's and
block 1's outputs beside the last (cat_hidden_layers [1, 0]: given out of order, and block 1
is block num_layers // 2, whose export carries the CTC head's added distribution): HF's
prompt ids, greedy tokens and top-5 logprobs (1e-3, float32) for one clip, text alone and two
clips; chunked prefill and prefix caching through clips; the transcription prompt; configs it
cannot run refused by name.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from audio_checks import check_audio_paths, check_matches_hf, noise_clip
from hf_reference import assert_matches
from image_checks import engine, greedy

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.granite_speech_plus")

from test_granite_speech_audio import (  # noqa: E402
    _HF,
    AUDIO,
    ONE,
    SETTINGS,
    TEXT,
    TWO,
    MelFeatures,
    write_tiny_granite_speech,
)

from paged_engine.multimodal.granite_speech_plus import exported_layers  # noqa: E402
from paged_engine.testing import _COMMON, _randomize  # noqa: E402

CAT = [1, 0]


def write_tiny_granite_speech_plus(path: Path, seed: int = 0) -> Path:
    """The sibling's checkpoint (tokenizer, processor_config.json) with a Plus model saved over."""
    write_tiny_granite_speech(path, seed)
    saved = json.loads((path / "config.json").read_text())
    saved["encoder_config"] |= {"model_type": "granite_speech_plus_encoder"}
    saved["encoder_config"]["cat_hidden_layers"] = CAT
    saved["projector_config"]["encoder_hidden_size"] = 32 * (len(CAT) + 1)
    keep = ("text_config", "encoder_config", "projector_config", "audio_token_index")
    config = transformers.GraniteSpeechPlusConfig(
        **{k: saved[k] for k in keep},
        window_size=6,
        downsample_rate=3,
        has_lora_adapter=False,
        tie_word_embeddings=False,
        **_COMMON,
    )
    torch.manual_seed(seed)
    model = transformers.GraniteSpeechPlusForConditionalGeneration(config).to(torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        _randomize(model, seed)
        for name, b in model.named_buffers():  # BatchNorm statistics other than (0, 1)
            if name.endswith("running_mean"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.3)
            elif name.endswith("running_var"):
                b.copy_(torch.rand(b.shape, generator=gen) + 0.5)
    model.save_pretrained(path)
    return path


class _HFPlus(_HF):
    def __init__(self, path: Path) -> None:
        cls = transformers.GraniteSpeechPlusForConditionalGeneration
        self.model = cls.from_pretrained(path, dtype=torch.float32).eval()
        self.model.generation_config.eos_token_id = None
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        self.features = MelFeatures(SETTINGS)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_granite_speech_plus(tmp_path_factory.mktemp("granite_speech_plus"))


def test_audio_matches_hf(tiny):
    """One clip, text alone, two clips (0.7 s and 1.9 s: several attention blocks and windows,
    one ending mid-block); then the transcription prompt through the chat template."""
    hf = _HFPlus(tiny)
    assert hf.model.config.encoder_config.cat_hidden_layers == CAT
    cases = [
        (ONE, [noise_clip(1, 1.0)]),
        (TEXT, []),
        (TWO, [noise_clip(2, 0.7), noise_clip(3, 1.9)]),
    ]
    refs = [hf.greedy(t, clips) for t, clips in cases]
    llm = engine(tiny)
    check_matches_hf(llm, cases, refs, "granite_speech_plus")
    assert refs[0][0].count(llm.get_tokenizer().convert_tokens_to_ids(AUDIO)) == 18

    host = llm.llm_engine.input_processor.audios
    prompt = host.transcription_prompt("en", "transcribe", "")
    clip = noise_clip(20, 0.9)
    ids, ref = hf.greedy(prompt["prompt"], [clip])
    out = llm.generate([{**prompt, "multi_modal_data": {"audio": clip}}], greedy(), use_tqdm=False)
    assert out[0].prompt_token_ids == ids
    assert_matches("granite_speech_plus transcription", out[0], ref)


def test_chunked_prefill_and_prefix_caching(tiny):
    prompts = [
        {"prompt": ONE, "multi_modal_data": {"audio": noise_clip(10 + i, 0.6 + 0.5 * i)}}
        for i in range(2)
    ]
    prompts.append(
        {"prompt": TWO, "multi_modal_data": {"audio": [noise_clip(12, 0.4), noise_clip(13, 1.3)]}}
    )
    check_audio_paths(tiny, prompts, TWO)


def test_configs_it_cannot_run_are_refused_by_name(tiny, tmp_path):
    """A repeated cat_hidden_layers index passes HF's config checks (its width counts the
    repeat, its forward does not): refused by the real loader. The other two HF's config class
    refuses itself, so they are set on a loaded config."""
    other = shutil.copytree(tiny, tmp_path / "other")
    saved = json.loads((other / "config.json").read_text())
    saved["encoder_config"]["cat_hidden_layers"] = [1, 1]
    (other / "config.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=r"cat_hidden_layers \[1, 1\] repeats an index"):
        engine(other)
    for cat, width, match in (
        ([0, 3], 96, r"cat_hidden_layers: 3 is not a layer index in \[0, num_layers 3\)"),
        ([0, 1], 64, r"encoder_hidden_size 64 must be encoder hidden_dim 32"),
    ):
        config = transformers.AutoConfig.from_pretrained(tiny)
        config.encoder_config.cat_hidden_layers = cat
        config.projector_config.encoder_hidden_size = width
        with pytest.raises(ValueError, match=match):
            exported_layers(config)
