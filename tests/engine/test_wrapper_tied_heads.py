"""Whether a VLM wrapper's text model ties lm_head, decided as transformers 5 loads it.

transformers' BLIP-2 and Llama 4 wrappers hold a whole *ForCausalLM built from text_config,
which ties by text_config.tie_word_embeddings: the top-level flag is never read, so a config
saying False at the top and True in text_config saves no lm_head and loads tied (and the
reverse saves its own head). LLaVA's head is the wrapper's own, tied by the top-level flag
(its config class folds text_config's True in). The unit test runs `text_only_config` over the
four flag pairs (what the checkpoint then holds decides as test_tied_weights.py checks); the
others save tiny random wrappers with the mixed flags through transformers and check `LLM`'s
greedy tokens and top-5 logprobs against HF's text model, and that an untied config without a
head is refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_parity import assert_serves_like_hf
from safetensors import safe_open
from vlm_checkpoints import load_hf_vlm

from paged_engine import LLM
from paged_engine.models.multimodal_text import text_only_config
from paged_engine.testing import tiny_config

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 9, 14, 3, 77], [120, 8, 8, 31]]
FLAGS = [(True, True), (True, False), (False, True), (False, False)]


def _config(wrapper: str, top: bool, text: bool):
    inner = tiny_config("opt" if wrapper == "blip2" else "llama", vocab_size=256).to_dict()
    inner["tie_word_embeddings"] = text
    if wrapper == "blip2":
        cls, arch = transformers.Blip2Config, "Blip2ForConditionalGeneration"
    else:
        cls, arch = transformers.LlavaConfig, "LlavaForConditionalGeneration"
    return cls(text_config=inner, tie_word_embeddings=top, architectures=[arch])


@pytest.mark.parametrize(("top", "text"), FLAGS)
@pytest.mark.parametrize("wrapper", ["blip2", "llava"])
def test_tie_decision(wrapper, top, text):
    """BLIP-2 ties by text_config's flag alone, LLaVA by either."""
    flag = text if wrapper == "blip2" else top or text
    assert text_only_config(_config(wrapper, top, text)).tie_word_embeddings is flag


def _resave(path: Path, cls, top: bool, text: bool) -> torch.nn.Module:
    """The wrapper at `path` re-saved by transformers with the flags `top` / `text` (tied
    again where text_config says so); HF's model of the new save."""
    model = cls.from_pretrained(path, dtype=torch.float32)
    model.config.tie_word_embeddings = top
    model.config.text_config.tie_word_embeddings = text
    model.tie_weights(recompute_mapping=True)
    model.save_pretrained(path)
    return load_hf_vlm(cls, path)


def _names(path: Path) -> list[str]:
    with safe_open(path / "model.safetensors", "pt") as f:
        return list(f.keys())


def _check_tied_like_hf(name: str, path: Path, hf) -> None:
    """`path` holds no head and HF ties it; `LLM` matches HF's text model."""
    assert not any("lm_head" in n for n in _names(path))
    text_model = hf.language_model
    head, embed = text_model.get_output_embeddings(), text_model.get_input_embeddings()
    assert head.weight.data_ptr() == embed.weight.data_ptr()
    text_model.generation_config.eos_token_id = None
    text_model.generation_config.pad_token_id = 0
    assert_serves_like_hf(name, path, PROMPTS, max_tokens=6, hf=text_model)


def test_blip2_opt_ties_by_text_config(tmp_path):
    """Top-level False, text_config True: no lm_head saved, HF ties; then the reverse flags
    on the same headless weights (HF would start the head random) are refused by name."""
    from test_blip2_images import write_tiny_blip2

    path = write_tiny_blip2(tmp_path, seed=5)
    hf = _resave(path, transformers.Blip2ForConditionalGeneration, top=False, text=True)
    _check_tied_like_hf("blip2-opt", path, hf)
    config = json.loads((path / "config.json").read_text())
    config["tie_word_embeddings"] = True
    config["text_config"]["tie_word_embeddings"] = False
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"missing weights.*lm_head"):
        LLM(model=str(path), dtype="float32", max_model_len=128)


def test_llama4_ties_by_text_config(tmp_path):
    """Llama 4's wrapper the same way (top-level False, text_config True)."""
    pytest.importorskip("transformers.models.llama4")
    from test_llama4_images import write_tiny_llama4_vlm

    path = write_tiny_llama4_vlm(tmp_path, seed=5)
    hf = _resave(path, transformers.Llama4ForConditionalGeneration, top=False, text=True)
    _check_tied_like_hf("llama4", path, hf)
