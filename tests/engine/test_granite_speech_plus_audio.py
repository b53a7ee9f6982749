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
from audio_checks import (
    check_clips_match_hf,
    check_one_two_paths,
    check_prompt_matches_hf,
    noise_clip,
)
from image_checks import engine

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.granite_speech_plus")

from test_granite_speech_audio import (  # noqa: E402
    _HF,
    AUDIO,
    ONE,
    TEXT,
    TWO,
    save_random,
    write_tiny_granite_speech,
)

from paged_engine.multimodal.granite_speech_plus import exported_layers  # noqa: E402
from paged_engine.testing import _COMMON  # noqa: E402

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
    save_random(transformers.GraniteSpeechPlusForConditionalGeneration, config, path, seed)
    return path


class _HFPlus(_HF):
    model_class = transformers.GraniteSpeechPlusForConditionalGeneration


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_granite_speech_plus(tmp_path_factory.mktemp("granite_speech_plus"))


def test_audio_matches_hf(tiny):
    """One clip, text alone, two clips (0.7 s and 1.9 s: several attention blocks and windows,
    one ending mid-block); then the transcription prompt through the chat template."""
    hf = _HFPlus(tiny)
    assert hf.model.config.encoder_config.cat_hidden_layers == CAT
    llm = engine(tiny)
    refs = check_clips_match_hf(llm, hf, ONE, TEXT, TWO, "granite_speech_plus")
    assert refs[0][0].count(llm.get_tokenizer().convert_tokens_to_ids(AUDIO)) == 18

    host = llm.llm_engine.input_processor.audios
    prompt = host.transcription_prompt("en", "transcribe", "")
    clip = noise_clip(20, 0.9)
    check_prompt_matches_hf(llm, hf, prompt, clip, "granite_speech_plus transcription")


def test_chunked_prefill_and_prefix_caching(tiny):
    check_one_two_paths(tiny, ONE, TWO)


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
