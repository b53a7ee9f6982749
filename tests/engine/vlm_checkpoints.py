"""Pieces the image tests' tiny checkpoints share (test_*_images.py): a tokenizer holding the
family's special tokens, the files saved beside the random weights, HF's processor without
its video half and HF's model loaded as the reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from paged_engine.testing import _COMMON, TINY_VOCAB_SIZE, build_tiny_tokenizer

transformers = pytest.importorskip("transformers")


def tokenizer_with(special: list[str], seed: int) -> tuple[object, dict[str, int]]:
    """testing.py's tiny tokenizer (TINY_VOCAB_SIZE, `seed`) with `special` added as special
    tokens, and each of them -> its id."""
    tokenizer = build_tiny_tokenizer(TINY_VOCAB_SIZE, seed)
    tokenizer.add_special_tokens({"additional_special_tokens": special})
    return tokenizer, dict(zip(special, tokenizer.convert_tokens_to_ids(special), strict=True))


def saved_tokenizer(path: Path, special: list[str], template: str, seed: int, **names: str):
    """testing.py's tiny tokenizer (`seed`, its default size) with `special` and the chat
    `template`, saved at `path` and read back with `names` (image_token=...) as the extra
    special tokens a processor looks up."""
    base = build_tiny_tokenizer(seed=seed)
    base.add_special_tokens({"additional_special_tokens": special})
    base.chat_template = template
    base.save_pretrained(path)
    return transformers.AutoTokenizer.from_pretrained(path, extra_special_tokens=names)


def finish_checkpoint(path: Path, saved, template: str | None = None) -> Path:
    """`saved` (a tokenizer, which takes the chat `template` unless None, or a processor)
    and the tiny models' generation config written to `path`, beside the weights."""
    if template is not None:
        saved.chat_template = template
    saved.save_pretrained(path)
    transformers.GenerationConfig(**_COMMON).save_pretrained(path)
    return path


def save_grid_image_processor(cls, path: Path, temporal: int, factor: int) -> None:
    """Qwen2-VL's image processor `cls` (or a sibling of its arguments) saved at `path`:
    4-pixel patches of `temporal` frames merged 2 x 2, images resized to 8 * `factor` to
    48 * `factor` pixels."""
    cls(
        patch_size=4,
        merge_size=2,
        temporal_patch_size=temporal,
        size={"shortest_edge": 8 * factor, "longest_edge": 48 * factor},
    ).save_pretrained(path)


def processor_without_video(cls, path: Path):
    """HF's processor `cls` of `path`'s image processor and tokenizer, its video processor left
    out (it needs torchvision, and the processor's class check looks it up)."""
    with pytest.MonkeyPatch.context() as mp:
        mixin = transformers.ProcessorMixin
        mp.setattr(mixin, "check_argument_for_proper_class", _any_class, raising=False)
        return cls(
            image_processor=transformers.AutoImageProcessor.from_pretrained(path),
            tokenizer=transformers.AutoTokenizer.from_pretrained(path),
        )


def _any_class(self, name: str, value: object) -> None:
    return None


def load_hf_vlm(cls, path: Path):
    """HF's `cls` of `path` in float32, eval mode, generating without EOS (the engine's runs
    use ignore_eos)."""
    model = cls.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model
