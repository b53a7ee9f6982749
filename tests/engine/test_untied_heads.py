"""Families whose transformers class never ties lm_head, whatever tie_word_embeddings says.

transformers 5 ties a head only where the class lists it in `_tied_weights_keys`; Inkling,
Inkling 2 (and Loop, which inherits it), Ergo and Mllama's wrapper list nothing, so a config
with tie_word_embeddings=True still serves the checkpoint's own lm_head (our classes say so with
`ties_head = False`, models/utils.py's CausalLMBase). Each case saves a tiny random model whose
config says tie_word_embeddings=True and whose head differs from its token embedding; `LLM`
must give HF's greedy tokens and top-5 logprobs. Nemotron-H and Kimi Linear, the same fix, are
covered by test_config_fuzz_hybrid_regressions.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_parity import assert_serves_like_hf, load_hf_as_saved, write_hf_checkpoint
from hybrid_checks import random_prompts

from paged_engine.testing import write_tiny_model

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.inkling2")


def _tiny(arch: str):
    return lambda path: write_tiny_model(path, arch, seed=1, tie_word_embeddings=True)


def _inkling2(path: Path) -> Path:
    from test_models_inkling2 import TEXT

    config = transformers.Inkling2TextConfig(**TEXT, tie_word_embeddings=True)
    return write_hf_checkpoint(path, transformers.Inkling2ForCausalLM, config)


def _mllama(path: Path) -> Path:
    from test_mllama_images import write_tiny_mllama

    write_tiny_mllama(path, seed=3)  # its builder says False; the saved weights are the same
    file = path / "config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), "tie_word_embeddings": True}))
    return path


CASES = {
    "inkling": _tiny("inkling"),
    "inkling2": _inkling2,
    "ergo": _tiny("ergo"),
    "mllama": _mllama,
}


@pytest.mark.parametrize("name", list(CASES))
def test_tied_flag_keeps_the_checkpoint_head(name, tmp_path):
    path = CASES[name](tmp_path)
    hf = load_hf_as_saved(path)
    assert hf.config.tie_word_embeddings
    head, embed = hf.get_output_embeddings().weight, hf.get_input_embeddings().weight
    assert head.shape != embed.shape or not torch.equal(head, embed)  # HF kept its own head
    assert_serves_like_hf(name, path, random_prompts(0, (5, 9)), max_tokens=6, hf=hf)
