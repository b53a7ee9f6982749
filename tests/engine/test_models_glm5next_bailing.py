"""GLM-5.3-Flash's language model and Ling / Ring 2.5 (BailingHybrid) against HF transformers.

GLM-5.3-Flash: a tiny random `Glm5NextForConditionalGeneration` (HF's, a one-block vision
tower) is the reference on text prompts; its language model, saved as our
`Glm5NextTextForCausalLM` (`model.language_model.*` -> `model.*`, the config's text_config),
must give HF's greedy tokens and top-5 logprobs (1e-3, float32). The tiny config makes every
piece bite: 3 hyper-connection streams (few Sinkhorn steps), KDA layers with the bounded
forget gate (and Kimi's unbounded one in a second case), NoPE MLA layers with an indexer that
shares its choice, a dense MLP before DeepSeek-V3 MoE layers (2 groups, 1 kept; a correction
bias; scaling 2.5), and swiglu_limit 1 (gate and up clamp); a second model's indexer keeps
index_topk 8 of 12-48 keys in pools of 4 (its pooled choice against HF's). Also: TP=2, prefix
caching and chunked prefill give the one-process results, and a dropped tail is refused by
name.

Ling / Ring 2.5: tiny `BailingHybridForCausalLM`s (tiny_config "bailing_hybrid", and one with
Kimi's unbounded forget gate and clipping everywhere) match HF alike; TP=2 gives the
one-process results; a tied head (transformers never ties it) is refused by name.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hf_reference import (
    assert_matches,
    assert_same_greedy,
    assert_tiny_case_matches_hf,
    assert_tp_matches_one_process,
    engine_greedy,
    hf_greedy,
    random_token_prompts,
)

from paged_engine import LLM, SamplingParams
from paged_engine.testing import _randomize, build_tiny_tokenizer, write_tiny_model

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.glm5_next")

MAX_TOKENS, TOP = 8, 5

GLM5_TEXT = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_shared_experts": 1,
    "n_routed_experts": 8,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 32,
    "q_lora_rank": 48,
    "qk_rope_head_dim": 0,
    "qk_nope_head_dim": 32,
    "v_head_dim": 16,
    "n_group": 2,
    "topk_group": 1,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
    "layer_types": [
        "linear_attention",
        "indexed_attention",
        "indexed_attention",
        "linear_attention",
    ],
    # HF hands a full layer's choice on to the next layer only
    "indexer_types": ["full", "full", "shared", "full"],
    "index_topk": 128,
    "index_head_dim": 16,
    "index_n_heads": 2,
    "index_kpool": 16,
    "swiglu_limit": 1.0,
    "linear_head_dim": 16,
    "linear_num_heads": 4,
    "linear_conv_kernel_dim": 4,
    "linear_lower_bound": -5.0,
    "hc_mult": 3,
    "hc_sinkhorn_iters": 4,
    "rms_norm_eps": 0.05,  # large enough that the MLA latent norms' eps shows
    "max_position_embeddings": 128,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}
TINY_VISION = {
    "depth": 1,
    "hidden_size": 32,
    "num_heads": 2,
    "intermediate_size": 32,
    "out_hidden_size": 64,
    "projection_intermediate_size": 32,
    "patch_size": 14,
    "image_size": 28,
    "spatial_merge_size": 2,
}


def write_glm5_next(path: Path, **text_overrides) -> tuple[Path, object]:
    """(our text-model dir, HF's wrapper model) for a tiny random GLM-5.3-Flash."""
    from safetensors.torch import load_file, save_file

    config = transformers.Glm5NextConfig(
        text_config={**GLM5_TEXT, **text_overrides}, vision_config=TINY_VISION
    )
    torch.manual_seed(0)
    hf = transformers.Glm5NextForConditionalGeneration(config).to(torch.float32)
    _randomize(hf, 1)
    hf.eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    wrapper = path / "wrapper"
    hf.save_pretrained(wrapper)
    text = path / "text"
    text.mkdir()
    weights = {}
    for name, w in load_file(wrapper / "model.safetensors").items():
        if name.startswith("model.language_model."):
            weights["model." + name.removeprefix("model.language_model.")] = w
        elif name.startswith("lm_head."):
            weights[name] = w
    save_file(weights, text / "model.safetensors")
    text_config = config.text_config.to_dict()
    text_config["architectures"] = ["Glm5NextTextForCausalLM"]
    (text / "config.json").write_text(json.dumps(text_config))
    build_tiny_tokenizer(512, 0).save_pretrained(text)
    return text, hf


def _engine(path: Path, **kw) -> LLM:
    return LLM(model=str(path), dtype="float32", max_model_len=128, block_size=16, **kw)


def _check_against_hf(path: Path, hf, seed: str) -> None:
    prompts = random_token_prompts(seed, 3)
    refs = [hf_greedy(hf, p, MAX_TOKENS, TOP) for p in prompts]
    llm = _engine(path)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, ref in zip(outs, refs, strict=True):
        assert_matches(seed, out, ref)
    assert llm.get_stats().num_used_blocks == 0


@pytest.fixture(scope="module")
def glm5(tmp_path_factory) -> tuple[Path, object]:
    return write_glm5_next(tmp_path_factory.mktemp("glm5_next"))


def test_glm5_next_matches_hf(glm5) -> None:
    _check_against_hf(*glm5, "glm5_next")


def test_glm5_next_wrapper_served_text_only(glm5) -> None:
    # HF's saved Glm5NextForConditionalGeneration itself (models/multimodal_text.py)
    text, hf = glm5
    wrapper = text.parent / "wrapper"
    build_tiny_tokenizer(512, 0).save_pretrained(wrapper)
    _check_against_hf(wrapper, hf, "glm5_next-wrapper")


def test_glm5_next_unbounded_forget_gate_matches_hf(tmp_path) -> None:
    path, hf = write_glm5_next(tmp_path, linear_lower_bound=None)
    _check_against_hf(path, hf, "glm5_next_softplus")


def test_glm5_next_engine_modes(glm5) -> None:
    path, _ = glm5
    prompts = random_token_prompts("glm5_modes", 3)
    kw = dict(model=str(path), dtype="float32", max_model_len=128, block_size=16)
    want = engine_greedy(prompts, MAX_TOKENS, **kw)
    assert_same_greedy(want, engine_greedy(prompts, MAX_TOKENS, enable_prefix_caching=True, **kw))
    chunked = engine_greedy(
        prompts, MAX_TOKENS, enable_chunked_prefill=True, max_num_batched_tokens=16, **kw
    )
    assert_same_greedy(want, chunked)


def test_glm5_next_tp2(glm5) -> None:
    path, _ = glm5
    assert_tp_matches_one_process(path, random_token_prompts("glm5_tp", 2), MAX_TOKENS, 128)


# index_topk 8 in pools of 4 over 12-40 token prompts: each query past its 8th token keeps
# its 2 best whole pools and its tail, in prefill and in decode, on the full layers and (by
# reuse) the shared one. 16 indexer heads: with 2, whole pools often score exactly 0 (every
# head's relu), and transformers' topk breaks such ties by no fixed rule.
SPARSE = {"index_topk": 8, "index_kpool": 4, "index_n_heads": 16}


@pytest.fixture(scope="module")
def glm5_sparse(tmp_path_factory) -> tuple[Path, object]:
    return write_glm5_next(tmp_path_factory.mktemp("glm5_sparse"), **SPARSE)


def test_glm5_next_pooled_choice_matches_hf(glm5_sparse) -> None:
    _check_against_hf(*glm5_sparse, "glm5_next_sparse")


def test_glm5_next_pooled_choice_engine_modes(glm5_sparse) -> None:
    """The choice reads every key of the sequence from the paged cache: chunks of 5 tokens and
    prefix caching (prompt 3 shares prompt 0's first block) see what one prefill sees."""
    path, _ = glm5_sparse
    prompts = random_token_prompts("glm5_sparse_modes", 3)
    prompts.append(prompts[0][:20] + [7, 8, 9])  # hits prompt 0's first block
    kw = dict(model=str(path), dtype="float32", max_model_len=128, block_size=16)
    want = engine_greedy(prompts, MAX_TOKENS, **kw)
    cached = engine_greedy(prompts, MAX_TOKENS, enable_prefix_caching=True, **kw)
    assert_same_greedy(want, cached)
    chunked = engine_greedy(
        prompts, MAX_TOKENS, enable_chunked_prefill=True, max_num_batched_tokens=5, **kw
    )
    assert_same_greedy(want, chunked)


def test_glm5_next_pooled_choice_tp2(glm5_sparse) -> None:
    path, _ = glm5_sparse
    assert_tp_matches_one_process(path, random_token_prompts("glm5_sp_tp", 2), MAX_TOKENS, 128)


def test_glm5_next_refuses_a_dropped_tail(glm5, tmp_path) -> None:
    """Without the tail a sequence's first tokens would attend to nothing: refused by name."""
    path, _ = glm5
    shutil.copytree(path, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["index_kpool_always_select_tail"] = False
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="index_kpool_always_select_tail"):
        _engine(tmp_path / "m")


# ---- Ling / Ring 2.5 (BailingHybrid) ----------------------------------------------------------
# tiny_config "bailing_hybrid": KDA / MLA alternating, the forget gate bounded at -3, a dense
# layer then MoE layers whose routed and shared experts clip at per-layer limits (some 0: off).
BAILING_CASES = {
    "bailing_hybrid": {},
    # Kimi's unbounded forget gate; clipping everywhere at tighter limits
    "bailing_hybrid_softplus": {
        "kda_safe_gate": False,
        "expert_swiglu_limit_list": [0, 0.3, 0.4, 0.5],
        "share_expert_swiglu_limit_list": [0, 0.3, 0.4, 0.5],
    },
}


@pytest.mark.parametrize("case", sorted(BAILING_CASES))
def test_bailing_hybrid_matches_hf(case, tmp_path) -> None:
    pytest.importorskip("transformers.models.bailing_hybrid")
    assert_tiny_case_matches_hf(case, "bailing_hybrid", BAILING_CASES[case], tmp_path)


def test_bailing_hybrid_tp2(tmp_path) -> None:
    pytest.importorskip("transformers.models.bailing_hybrid")
    path = write_tiny_model(tmp_path, "bailing_hybrid", seed=1)
    assert_tp_matches_one_process(path, random_token_prompts("bailing_tp", 2), MAX_TOKENS, 128)


def test_bailing_hybrid_refuses_tied_head(tmp_path) -> None:
    pytest.importorskip("transformers.models.bailing_hybrid")
    path = write_tiny_model(tmp_path, "bailing_hybrid", seed=1)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        _engine(path)
