"""Gemma 4 Unified (text) and LaraMini against HF transformers.

`LLM.generate` on a tiny random Gemma 4 Unified text model (tiny_config "gemma4_unified":
sliding layers of head size 16 with window 8 shorter than the prompts, full layers of head size
32 with one KV head whose values are the key projection and proportional rope, the last two
layers reading earlier layers' KV with double-wide MLPs, per-layer output scalars, a final
soft-cap) gives HF `generate`'s greedy tokens and top-5 logprobs (1e-3, float32). The released
checkpoints are `Gemma4UnifiedForConditionalGeneration` wrappers: served text-only, the language
model loads from the wrapper's names and the vision / audio embedders are dropped; the reference
is HF's wrapper itself. Also: TP=2 gives the one-process results, and a config carrying Gemma 4's
per-layer inputs or MoE block is refused by name.

LaraMini (tiny_config "lara_mini": the released period-5 layout of Gated DeltaNet layers,
sliding-window RoPE layers (window 8) and a full NoPE layer, softmax top-2 MoE with an ungated
shared expert on every layer, weight-scaled float32 norms) gives HF's greedy tokens and top-5
logprobs from the checkpoint transformers saves (the release's fused `in_proj` and `out_norm`)
and from one under transformers' in-memory names; also without top-k renormalization, on prompts
of 1 to 70 tokens whole and in prefill chunks, and under TP=2.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from hf_reference import (
    assert_matches,
    assert_tiny_case_matches_hf,
    assert_tp_matches_one_process,
    hf_greedy,
    load_hf_model,
    random_token_prompts,
)

from paged_engine import LLM, SamplingParams
from paged_engine.testing import _randomize, write_tiny_model

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.gemma4_unified")
safetensors_torch = pytest.importorskip("safetensors.torch")

MAX_TOKENS, TOP = 8, 5
# a tiny encoder-free vision embedder (never run on text prompts; its weights are dropped)
VISION = {"patch_size": 2, "pooling_kernel_size": 2, "mm_embed_dim": 16, "mm_posemb_size": 8}
VISION["output_proj_dims"] = VISION["mm_embed_dim"]


@pytest.fixture(scope="module")
def gemma4u_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("gemma4u"), "gemma4_unified", seed=1)


def _generate(path: Path, prompts: list[list[int]], **kw):
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, block_size=16, **kw)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def test_gemma4_unified_matches_hf(tmp_path):
    assert_tiny_case_matches_hf("gemma4_unified", "gemma4_unified", {}, tmp_path)


def test_gemma4_unified_default_rope_everywhere_and_own_values_match_hf(tmp_path):
    """Both full-layer variants: without attention_k_eq_v (own value projection, the global KV
    head count unused) and a rope base of its own on the full layers."""
    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        "full_attention": {
            "rope_type": "proportional",
            "partial_rotary_factor": 0.5,
            "rope_theta": 10000.0,
        },
    }
    overrides = {"attention_k_eq_v": False, "rope_parameters": rope}
    assert_tiny_case_matches_hf("gemma4_unified-own-v", "gemma4_unified", overrides, tmp_path)


def _wrapper_dir(text_dir: Path, path: Path) -> Path:
    """`text_dir` as a Gemma4UnifiedForConditionalGeneration checkpoint saved by HF: the language
    model's weights, random vision / audio embedders."""
    text = json.loads((text_dir / "config.json").read_text())
    config = transformers.Gemma4UnifiedConfig(
        text_config=text,
        vision_config=VISION,
        audio_config={"audio_embed_dim": 8},
        tie_word_embeddings=True,
    )
    torch.manual_seed(3)
    model = transformers.Gemma4UnifiedForConditionalGeneration(config).float().eval()
    _randomize(model, 3)
    state = safetensors_torch.load_file(str(text_dir / "model.safetensors"))
    lm = model.model.language_model
    missing, unexpected = lm.load_state_dict(
        {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")},
        strict=False,
    )
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (text_dir / name).exists():
            (path / name).write_bytes((text_dir / name).read_bytes())
    return path


def test_gemma4_unified_wrapper_text_only_matches_hf(gemma4u_dir, tmp_path):
    """HF's wrapper (text-only: causal / sliding masks, soft-capped lm_head) on text prompts
    gives our text model's results loaded from the wrapper checkpoint's language model."""
    path = _wrapper_dir(gemma4u_dir, tmp_path / "wrapper")
    hf = transformers.Gemma4UnifiedForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32
    ).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    prompts = random_token_prompts("gemma4u-wrapper", 3)
    refs = [hf_greedy(hf, p, MAX_TOKENS, TOP) for p in prompts]
    for out, ref in zip(_generate(path, prompts), refs, strict=True):
        assert_matches("gemma4_unified-wrapper", out, ref)


def test_gemma4_unified_tensor_parallel_matches_one_process(gemma4u_dir):
    prompts = random_token_prompts("gemma4u-tp", 2)
    assert_tp_matches_one_process(gemma4u_dir, prompts, 6, max_model_len=64)


@pytest.mark.parametrize(
    ("field", "value"), [("hidden_size_per_layer_input", 8), ("enable_moe_block", True)]
)
def test_gemma4_unified_refuses_gemma4_only_fields(gemma4u_dir, tmp_path, field, value):
    path = tmp_path / "m"
    path.mkdir()
    for f in gemma4u_dir.iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    config = json.loads((path / "config.json").read_text())
    config[field] = value
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=field):
        LLM(model=str(path), dtype="float32", max_model_len=64)


@pytest.fixture(scope="module")
def lara_dir(tmp_path_factory) -> Path:
    pytest.importorskip("transformers.models.lara_mini")
    return write_tiny_model(tmp_path_factory.mktemp("lara"), "lara_mini", seed=1)


def test_lara_mini_matches_hf(tmp_path):
    pytest.importorskip("transformers.models.lara_mini")
    assert_tiny_case_matches_hf("lara_mini", "lara_mini", {}, tmp_path)


def test_lara_mini_unnormalized_topk_matches_hf(tmp_path):
    pytest.importorskip("transformers.models.lara_mini")
    overrides = {"norm_topk_prob": False, "tie_word_embeddings": False}
    assert_tiny_case_matches_hf("lara_mini-raw-topk", "lara_mini", overrides, tmp_path)


@pytest.mark.parametrize("budget", [None, 16])
def test_lara_mini_prompt_lengths_and_chunked_prefill_match_hf(lara_dir, budget):
    """Prompts of 1, 5, 23 and 70 tokens (past the window, across conv / state carry-over),
    whole or in prefill chunks of 16."""
    rng = random.Random(12)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 23, 70, 1)]
    hf = load_hf_model(lara_dir)
    refs = [hf_greedy(hf, p, MAX_TOKENS, TOP) for p in prompts]
    kw = {} if budget is None else {"max_num_batched_tokens": budget}
    for out, ref in zip(_generate(lara_dir, prompts, **kw), refs, strict=True):
        assert_matches(f"lara_mini-{budget}", out, ref)


def test_lara_mini_in_memory_names_load_alike(lara_dir, tmp_path):
    """transformers' in-memory names (in_proj_qkv / _z / _b / _a, norm) load as the saved
    (fused, release-named) checkpoint does."""
    hf = load_hf_model(lara_dir)
    path = tmp_path / "split"
    path.mkdir()
    for f in lara_dir.iterdir():
        if f.name != "model.safetensors":
            (path / f.name).write_bytes(f.read_bytes())
    state = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    assert any(".linear_attn.in_proj_qkv." in k for k in state)
    safetensors_torch.save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    prompts = random_token_prompts("lara-split", 2)
    want, got = _generate(lara_dir, prompts), _generate(path, prompts)
    assert [o.outputs[0].token_ids for o in want] == [o.outputs[0].token_ids for o in got]


def test_lara_mini_tensor_parallel_matches_one_process(lara_dir):
    prompts = random_token_prompts("lara-tp", 2)
    assert_tp_matches_one_process(lara_dir, prompts, 6, max_model_len=64)


def test_lara_mini_refuses_other_activations(lara_dir, tmp_path):
    path = tmp_path / "m"
    path.mkdir()
    for f in lara_dir.iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    config = json.loads((path / "config.json").read_text())
    config["hidden_act"] = "gelu"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="hidden_act"):
        LLM(model=str(path), dtype="float32", max_model_len=64)
