"""EXAONE 4.0, Apertus, Arcee AFM and AFMoE, OLMoE and FlexOlmo against HF transformers.

`LLM.generate` on tiny random models whose special features bite must give HF `generate`'s
greedy tokens and the same top-5 logprobs (1e-3, float32): EXAONE 4.0's post-norms and per-head
q / k norms, its sliding layers (window 8, shorter than every prompt) with rope beside global
NoPE layers, and the 1.2B model's layout (no window: every layer global with rope, tied head);
Apertus's xIELU MLP and q / k norms; Arcee's relu^2 MLP (also with attention and MLP biases);
OLMoE's whole-projection q / k norms and experts (also with clip_qkv clamping and renormalized
routing). Checkpoints are save_pretrained's (OLMoE: per-expert names, as released); OLMoE also
loads the fused experts transformers 5 holds in memory. Long EXAONE prompts prefilled in chunks
cross the window inside a chunk; TP=2 gives the one-process results (EXAONE 4.0, OLMoE).
xIELU matches HF's activation bit for bit.
"""

from __future__ import annotations

import random

import pytest
import torch
from hf_reference import (
    assert_hf_names_load_like_checkpoint,
    assert_matches,
    assert_tiny_case_matches_hf,
    assert_tp_matches_one_process,
    hf_greedy,
    load_hf_model,
)

from paged_engine import LLM, SamplingParams
from paged_engine.layers.activation import XIELU
from paged_engine.testing import write_tiny_model

transformers = pytest.importorskip("transformers")

MAX_TOKENS = 8
TOP = 5
# name -> (arch, config overrides)
CASES: dict[str, tuple[str, dict]] = {
    "exaone4": ("exaone4", {}),
    # EXAONE-4.0-1.2B's layout: no window, so every layer is global and rotates; tied head
    "exaone4-global": (
        "exaone4",
        {
            "sliding_window": None,
            "layer_types": ["full_attention"] * 4,
            "tie_word_embeddings": True,
        },
    ),
    "apertus": ("apertus", {}),
    "arcee": ("arcee", {}),
    "arcee-bias": ("arcee", {"attention_bias": True, "mlp_bias": True}),
    # Arcee AFMoE (Trinity): testing.py's tiny model; without muP's scale too
    "afmoe": ("afmoe", {}),
    "afmoe-no-mup": ("afmoe", {"mup_enabled": False}),
    "olmoe": ("olmoe", {}),
    # q / k / v clamped (the normalized q and k often pass 1.5), a token's 2 weights renormalized
    "olmoe-clip": ("olmoe", {"clip_qkv": 1.5, "norm_topk_prob": True}),
    # FlexOlmo: the experts in OLMo 2's post-norm layers (renormalized routing too)
    "flex_olmo": ("flex_olmo", {}),
    "flex_olmo-renorm": ("flex_olmo", {"norm_topk_prob": True}),
}


def _generate(llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_tokens_and_logprobs_match_hf(name, tmp_path):
    needs = {"flex_olmo": "FlexOlmoConfig", "afmoe": "AfmoeConfig"}.get(name.split("-")[0])
    if needs and not hasattr(transformers, needs):
        pytest.skip(f"this transformers has no {needs}")
    assert_tiny_case_matches_hf(name, *CASES[name], tmp_path, seed=name, max_tokens=MAX_TOKENS)


def test_exaone4_long_prompts_prefilled_in_chunks_match_hf(tmp_path):
    """Prompts of 10-15 windows, prefilled 32 tokens a step: a chunk's queries see the previous
    chunks' keys through the window on the sliding layers, all of them on the NoPE ones."""
    path = write_tiny_model(tmp_path, "exaone4", seed=2)
    hf = load_hf_model(path)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (83, 120)]
    refs = [hf_greedy(hf, p, MAX_TOKENS, TOP) for p in prompts]
    llm = LLM(
        model=str(path),
        dtype="float32",
        max_model_len=192,
        block_size=16,
        max_num_batched_tokens=32,
        max_num_seqs=2,
    )
    for out, ref in zip(_generate(llm, prompts), refs, strict=True):
        assert_matches("exaone4 long", out, ref)


@pytest.mark.parametrize("name", ["exaone4", "olmoe-clip"])
def test_tensor_parallel_matches_one_process(name, tmp_path):
    """TP=2 (gloo): EXAONE's per-head norms on sharded heads in sliding and NoPE layers; OLMoE's
    whole-projection q / k norms over sharded heads (their sums of squares all-reduced), the
    clamp, and the experts split over the ranks."""
    arch, overrides = CASES[name]
    path = write_tiny_model(tmp_path, arch, seed=3, **overrides)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (30, 50)]
    assert_tp_matches_one_process(path, prompts, max_tokens=MAX_TOKENS, max_model_len=128)


def test_olmoe_transformers5_names_load_like_the_checkpoint(tmp_path):
    """HF's in-memory state dict (experts fused as `experts.gate_up_proj` / `down_proj`) loads
    the values the checkpoint's per-expert names gave."""
    path = write_tiny_model(tmp_path, "olmoe", seed=2)
    assert_hf_names_load_like_checkpoint(path, ".experts.gate_up_proj")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_xielu_matches_hf_bit_for_bit(dtype):
    """Both branches (x > 0; x <= 0 with expm1 capped at eps) with all four scalars away from
    their defaults, loaded by HF's names; and our defaults (dummy weights) are HF's."""
    from transformers.activations import XIELUActivation

    hf = XIELUActivation(dtype=dtype)
    with torch.no_grad():
        hf.alpha_p.fill_(1.1)
        hf.alpha_n.fill_(-0.3)
        hf.beta.fill_(0.4)
        hf.eps.fill_(-1e-3)
    ours = XIELU().to(dtype)
    ours.load_state_dict(hf.state_dict())
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(4096, generator=gen) * 3).to(dtype)
    x[:6] = torch.tensor([0.0, -1e-4, 1e-4, -5e-4, -2e-3, 1e-30])
    assert torch.equal(ours(x), hf(x))
    defaults = XIELU().to(dtype)
    defaults._defaults()
    assert torch.equal(defaults(x), XIELUActivation(dtype=dtype)(x))
