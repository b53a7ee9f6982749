"""Broken speculative-decoding checkpoints fail at engine start with a ValueError that names
`speculative_config.model`: a draft model or an EAGLE head whose weights do not fit
its config (a weight of the wrong shape, a missing weight, a config without hidden_size so
the defaults' shapes apply, no weight files at all). The config-level refusals (k, method,
lookup bounds, vocab / tokenizer / context-length mismatches; EAGLE-3's weights) are tested
beside each method."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from paged_engine import LLM
from paged_engine.testing import write_tiny_eagle_head, write_tiny_model

pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hostile-spec")
    target = write_tiny_model(root / "target", "llama", seed=1)
    draft = write_tiny_model(root / "draft", "llama", seed=7, num_hidden_layers=1, hidden_size=32)
    for f in target.iterdir():  # the draft shares the target's tokenizer
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, draft / f.name)
    return {
        "target": target,
        "draft_model": draft,
        "eagle": write_tiny_eagle_head(root / "eagle", target, seed=1),
    }


def _edit_weights(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def apply(d: Path) -> None:
        f = d / "model.safetensors"
        weights = load_file(f)
        edit(weights)
        save_file(weights, f, metadata={"format": "pt"})

    return apply


def _first_2d(weights: dict, part: str) -> str:
    return next(k for k in sorted(weights) if part in k and weights[k].dim() == 2)


def _shrink(part: str) -> Callable[[Path], None]:  # a weight one column short
    def edit(w: dict) -> None:
        k = _first_2d(w, part)
        w[k] = w[k][:, :-1].contiguous()

    return _edit_weights(edit)


def _drop(part: str) -> Callable[[Path], None]:
    def edit(w: dict) -> None:
        del w[_first_2d(w, part)]

    return _edit_weights(edit)


def _drop_hidden_size(d: Path) -> None:  # HF's default hidden_size (4096) then sizes the model
    c = json.loads((d / "config.json").read_text())
    del c["hidden_size"]
    (d / "config.json").write_text(json.dumps(c))


def _no_weight_files(d: Path) -> None:
    (d / "model.safetensors").unlink()


CASES = {
    "draft_weight_wrong_shape": ("draft_model", _shrink("q_proj")),
    "draft_weight_missing": ("draft_model", _drop("q_proj")),
    "draft_config_without_hidden_size": ("draft_model", _drop_hidden_size),
    "draft_without_weight_files": ("draft_model", _no_weight_files),
    "eagle_weight_wrong_shape": ("eagle", _shrink("fc")),
    "eagle_without_weight_files": ("eagle", _no_weight_files),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_broken_checkpoint_is_a_value_error_naming_the_model(models, tmp_path, case):
    method, breaks = CASES[case]
    broken = tmp_path / case
    shutil.copytree(models[method], broken)
    breaks(broken)
    spec = {"method": method, "model": str(broken), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match=r"speculative_config\.model="):
        LLM(
            model=str(models["target"]),
            dtype="float32",
            block_size=8,
            max_model_len=128,
            speculative_config=spec,
        )
