"""Mistral Large 4 (models/mistral_large4.py) against HF transformers.

A tiny random `MistralLarge4ForConditionalGeneration` (a one-layer Pixtral tower) saved by
transformers; `LLM.generate` on text prompts must give HF `generate`'s greedy tokens and top-5
logprobs (1e-3, float32), served through the wrapper and as the bare text model
(`MistralLarge4TextForCausalLM`: the wrapper's language model and head, renamed; transformers
has no text-only causal LM, so the wrapper is the reference for both). The tiny text config
makes every feature bite: an indexer keeping 6 keys (prompts of 12-40 tokens) on full layers
0 and 2 reused by shared layers 1 and 3, a NoPE layer (2, a full one: its indexer unrotated
too), learned LeRoPE `alpha` and per-head log-position query scaling (random, about 1), YaRN
with attention_factor 0.8, a dense layer before MoE ones with 8 experts in 2 groups (one kept,
x2.0), rms_norm_eps 0.3 (the latent norm reads it), logits soft-capped at 2. Also TP=2 gives the
one-process results, and what the engine does not run is refused by name.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from hf_reference import assert_matches, assert_tp_matches_one_process, hf_greedy

from paged_engine import LLM, SamplingParams
from paged_engine.testing import _COMMON, _quiet_progress, _randomize, build_tiny_tokenizer

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.mistral_large4")
safetensors_torch = pytest.importorskip("safetensors.torch")

VOCAB = 512
MAX_TOKENS = 10
TEXT = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "routed_scaling_factor": 2.0,
    "index_topk": 6,
    "index_head_dim": 16,
    "index_n_heads": 8,
    "indexer_types": ["full", "shared", "full", "shared"],
    "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
    "no_rope_layers": [1, 1, 0, 1],
    "rms_norm_eps": 0.3,
    "final_logit_softcapping": 2.0,
    "max_position_embeddings": 1024,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 10_000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 256,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "attention_factor": 0.8,
    },
    "tie_word_embeddings": False,
    **_COMMON,
}
VISION = {
    "model_type": "pixtral",
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "head_dim": 8,
    "patch_size": 4,
    "image_size": 32,
}


def _prompts(seed: str, n: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(20, VOCAB) for _ in range(rng.randint(12, 40))] for _ in range(n)]


def write_wrapper(path: Path, seed: int = 1, **text) -> Path:
    config = transformers.MistralLarge4Config(
        text_config={**TEXT, **text}, vision_config=VISION, image_token_index=10, **_COMMON
    )
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = transformers.MistralLarge4ForConditionalGeneration(config).to(torch.float32)
    _randomize(model, seed)
    with _quiet_progress():
        model.save_pretrained(path)
    build_tiny_tokenizer(VOCAB, seed).save_pretrained(path)
    transformers.GenerationConfig(**_COMMON).save_pretrained(path)
    return path


def write_text(wrapper: Path, path: Path) -> Path:
    """The wrapper's language model and head (Mistral's native names, as transformers saves
    them) as a bare `MistralLarge4TextForCausalLM`."""
    path.mkdir(parents=True, exist_ok=True)
    text = json.loads((wrapper / "config.json").read_text())["text_config"]
    text["architectures"] = ["MistralLarge4TextForCausalLM"]
    (path / "config.json").write_text(json.dumps(text))
    weights = safetensors_torch.load_file(str(wrapper / "model.safetensors"))
    native = ("tok_embeddings.", "layers.", "norm.", "output.", "lerope.")  # what HF saves
    keep = {k: v for k, v in weights.items() if k.startswith(native)}
    safetensors_torch.save_file(keep, str(path / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (wrapper / name).exists():
            (path / name).write_bytes((wrapper / name).read_bytes())
    return path


def load_hf(path: Path):
    model = transformers.MistralLarge4ForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32
    ).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(scope="module")
def wrapper_dir(tmp_path_factory) -> Path:
    return write_wrapper(tmp_path_factory.mktemp("mistral_large4"))


def _check(name: str, hf_path: Path, ours: Path) -> None:
    hf = load_hf(hf_path)
    prompts = _prompts(name)
    refs = [hf_greedy(hf, p, MAX_TOKENS, 5) for p in prompts]
    llm = LLM(model=str(ours), dtype="float32", max_model_len=128, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, ref in zip(outs, refs, strict=True):
        assert_matches(name, out, ref)
    assert llm.get_stats().num_used_blocks == 0


def test_wrapper_text_only_matches_hf(wrapper_dir):
    _check("mistral_large4 wrapper", wrapper_dir, wrapper_dir)


def test_text_model_matches_hf(wrapper_dir, tmp_path):
    _check("mistral_large4 text", wrapper_dir, write_text(wrapper_dir, tmp_path / "text"))


def test_tp2_matches_one_process(wrapper_dir, tmp_path):
    text = write_text(wrapper_dir, tmp_path / "text")
    assert_tp_matches_one_process(text, _prompts("tp", 2), MAX_TOKENS, 128)


@pytest.mark.parametrize(
    ("field", "value"),
    [("kv_source_layers", [0, 0, 2, 3]), ("no_rope_layers", [1, 1, 0])],
)
def test_refused_by_name(tmp_path, wrapper_dir, field, value):
    text = write_text(wrapper_dir, tmp_path / "text")
    config = json.loads((text / "config.json").read_text())
    config[field] = value
    (text / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=field):
        LLM(model=str(text), dtype="float32", max_model_len=64)
