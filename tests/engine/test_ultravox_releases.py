"""Ultravox in fixie-ai's release form: config.json names the language model and the Whisper
model by `text_model_id` / `audio_model_id` (no inline text_config / audio_config, as fixie's
saves drop them) and the checkpoint's own safetensors hold some of the weights
(models/ultravox_linked.py). The ids here are local directories (what the Hub ids resolve to):
a tiny LlamaForCausalLM and a tiny WhisperForConditionalGeneration saved by transformers, whose
encoder is the reference's tower. Against test_ultravox_audio's composed reference on the same
clip: the prompt ids, greedy tokens and top-5 logprobs (1e-3, float32), with the checkpoint
holding only the projector (its tokenizer and feature extractor its own), and with it holding
everything while the linked repos hold other random weights (its own win; its tokenizer and
feature extractor then come from the ids' repos). An id that does not resolve is refused by
name.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from audio_checks import check_matches_hf, noise_clip
from image_checks import engine
from test_ultravox_audio import ONE, Reference, tiny_ultravox

transformers = pytest.importorskip("transformers")

from paged_engine.testing import _randomize  # noqa: E402

# what fixie's UltravoxModel.save_pretrained leaves out when the ids are set
INLINE = ("text_config", "audio_config")
OWN_FILES = ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json")


def write_linked(ref: Reference, root: Path, other_seed: int | None = None) -> tuple[Path, Path]:
    """The repos the ids name: the reference's LlamaForCausalLM (with its tokenizer) and a
    WhisperForConditionalGeneration whose encoder is the reference's tower (with its feature
    extractor); `other_seed`: both with other random weights instead."""
    llama_dir, whisper_dir = root / "llama", root / "whisper"
    lm = ref.language_model
    config = transformers.WhisperConfig(
        **ref.audio,
        decoder_layers=1,
        decoder_attention_heads=2,
        decoder_ffn_dim=32,
        vocab_size=96,
        max_target_positions=16,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
    )
    whisper = transformers.WhisperForConditionalGeneration(config).eval()
    whisper.model.encoder.load_state_dict(ref.audio_tower.state_dict())
    if other_seed is not None:
        lm = copy.deepcopy(lm)
        with torch.no_grad():
            _randomize(lm, other_seed)
            _randomize(whisper, other_seed)
    lm.save_pretrained(llama_dir)
    ref.tokenizer.save_pretrained(llama_dir)
    whisper.save_pretrained(whisper_dir)
    ref.extractor.save_pretrained(whisper_dir)
    return llama_dir, whisper_dir


def write_release(
    ref: Reference, root: Path, own: tuple[str, ...], other_seed: int | None = None
) -> Path:
    """An Ultravox checkpoint naming the linked repos by path, its safetensors holding the
    reference's tensors under the prefixes `own`; with other_seed, no tokenizer or feature
    extractor files of its own."""
    from safetensors.torch import load_file, save_file

    llama_dir, whisper_dir = write_linked(ref, root, other_seed)
    ids = {"text_model_id": str(llama_dir), "audio_model_id": str(whisper_dir)}
    path = ref.save(root / "ultravox", **ids)
    data = json.loads((path / "config.json").read_text())
    data = {k: v for k, v in data.items() if k not in INLINE}
    (path / "config.json").write_text(json.dumps(data))
    state = load_file(str(path / "model.safetensors"))
    kept = {k: v for k, v in state.items() if k.startswith(own)}
    save_file(kept, str(path / "model.safetensors"), metadata={"format": "pt"})
    if other_seed is not None:
        for name in OWN_FILES:
            (path / name).unlink()
    return path


def check_clip(ref: Reference, path: Path, seed: int) -> None:
    clip = noise_clip(seed, 1.1)
    check_matches_hf(engine(path), [(ONE, [clip])], [ref.greedy(ONE, [clip])], "ultravox release")


def test_projector_only_checkpoint_loads_the_linked_models(tmp_path):
    """The release form: only `multi_modal_projector.*` in the checkpoint; the language model
    and the tower from the repos the ids name."""
    ref = tiny_ultravox(seed=3)
    check_clip(ref, write_release(ref, tmp_path, ("multi_modal_projector.",)), 11)


def test_the_checkpoints_own_weights_win(tmp_path):
    """A checkpoint carrying the tower and the language model too (fine-tuned or merged):
    its tensors are used, not the linked repos' (other random weights here); its tokenizer
    and feature extractor, absent, are text_model_id's and audio_model_id's."""
    ref = tiny_ultravox(seed=4)
    own = ("multi_modal_projector.", "audio_tower.", "language_model.")
    check_clip(ref, write_release(ref, tmp_path, own, other_seed=99), 12)


@pytest.mark.parametrize("field", ["text_model_id", "audio_model_id"])
def test_missing_linked_model_is_refused_by_name(tmp_path, field):
    ref = tiny_ultravox(seed=5)
    path = write_release(ref, tmp_path, ("multi_modal_projector.",))
    data = json.loads((path / "config.json").read_text())
    data[field] = str(tmp_path / "nowhere")
    (path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=f"{field}=.*nowhere"):
        engine(path)
