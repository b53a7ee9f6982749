"""MiniMax M3 (models/minimax_m3.py) against HF transformers.

A tiny random `MiniMaxM3VLForCausalLM` (2 layers: a sparse-attention layer with a dense MLP, a
full-attention layer with the MoE; 4 query heads over 1 KV head, 2 index heads each choosing for
2 query heads; blocks of 4 keys, 3 of them kept, the local one always; half of each head
rotated; a SwiGLU-OAI clamp of 1.5 that bites) served by `LLM.generate` gives HF `generate`'s
greedy tokens and top-5 logprobs (1e-3, float32) on prompts of 12-40 tokens: plainly, with
chunked prefill splitting the prompts and with prefix-cache hits (the index keys come back
from cached blocks), through the `MiniMaxM3SparseForConditionalGeneration` wrapper served
text-only (its vision tower and projector dropped), and with two local blocks; the release's
weight names (per-expert w1 / w3 / w2, `block_sparse_moe`, `index_*`, `mtp.*` passed over) serve
the same tokens. TP=2 gives the
one-process results (each rank maps its query heads to their index heads). Unsupported configs
are refused by name.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from hf_parity import assert_llm_matches, assert_serves_like_hf, write_hf_checkpoint
from hf_reference import (
    assert_tp_matches_one_process,
    hf_greedy,
    load_hf_model,
    random_token_prompts,
)

from paged_engine import LLM, SamplingParams
from paged_engine.testing import _COMMON

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.minimax_m3_vl")

MAX_TOKENS, TOP, VOCAB = 8, 5, 512
TEXT = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "max_position_embeddings": 1024,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
    },
    "layer_types": ["minimax_m3_sparse", "full_attention"],
    "mlp_layer_types": ["dense", "sparse"],
    "intermediate_size": 32,
    "dense_intermediate_size": 64,
    "shared_intermediate_size": 48,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "routed_scaling_factor": 2.0,
    "swiglu_limit": 1.5,
    "index_n_heads": 2,
    "index_head_dim": 16,
    "index_block_size": 4,
    "index_topk_blocks": 3,
    "index_local_blocks": 1,
    "tie_word_embeddings": False,
    **_COMMON,
}
VISION = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "patch_size": 14,
}


def _text_checkpoint(path: Path, **overrides) -> Path:
    config = transformers.MiniMaxM3VLTextConfig(**{**TEXT, **overrides})
    return write_hf_checkpoint(path, transformers.MiniMaxM3VLForCausalLM, config, seed=1)


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory) -> Path:
    return _text_checkpoint(tmp_path_factory.mktemp("minimax_m3"))


def _llm(path: Path, **kw) -> LLM:
    return LLM(model=str(path), dtype="float32", max_model_len=128, block_size=16, **kw)


def test_matches_hf_chunked_and_prefix_cached(text_dir):
    hf = load_hf_model(text_dir)
    prompts = random_token_prompts("minimax_m3", 3)
    refs = [hf_greedy(hf, p, MAX_TOKENS, TOP) for p in prompts]
    assert_llm_matches("minimax_m3", _llm(text_dir), prompts, refs)
    chunked = _llm(text_dir, max_num_batched_tokens=16, enable_chunked_prefill=True)
    assert_llm_matches("minimax_m3 chunked", chunked, prompts, refs)
    # the second round's prompts share their first 32 tokens with the first round's
    rng = random.Random(5)
    first = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (37, 34)]
    second = [p[:32] + [rng.randrange(3, VOCAB) for _ in range(5)] for p in first]
    cached = _llm(text_dir, enable_prefix_caching=True)
    refs = [hf_greedy(hf, p, MAX_TOKENS, TOP) for p in first]
    assert_llm_matches("minimax_m3 cache", cached, first, refs)
    refs = [hf_greedy(hf, p, MAX_TOKENS, TOP) for p in second]
    outs = assert_llm_matches("minimax_m3 cache hit", cached, second, refs)
    assert all(o.num_cached_tokens == 32 for o in outs)


def test_two_local_blocks_match_hf(tmp_path):
    path = _text_checkpoint(tmp_path, index_local_blocks=2, index_topk_blocks=4)
    assert_serves_like_hf("minimax_m3 local 2", path, random_token_prompts("local", 2))


def test_wrapper_served_text_only(tmp_path):
    config = transformers.MiniMaxM3VLConfig(
        text_config=TEXT, vision_config=VISION, projector_hidden_size=32
    )
    cls = transformers.MiniMaxM3SparseForConditionalGeneration
    path = write_hf_checkpoint(tmp_path, cls, config, seed=2)
    assert_serves_like_hf("minimax_m3 wrapper", path, random_token_prompts("wrapper", 2))


def _release_names(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5's tensors under the release's names (transformers' conversion mapping
    run backwards): per-expert w1 / w3 / w2, `block_sparse_moe`, split gate / up projections,
    `index_*` indexer names; plus an `mtp.*` tensor."""
    out = {"mtp.layers.0.fc.weight": torch.ones(4, 4)}
    for name, w in weights.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            stem = name.replace("mlp.experts.gate_up_proj", "block_sparse_moe.experts")
            for m, (gate, up) in enumerate(x.chunk(2, dim=0) for x in w):
                out[f"{stem}.{m}.w1.weight"], out[f"{stem}.{m}.w3.weight"] = gate, up
        elif name.endswith("mlp.experts.down_proj"):
            stem = name.replace("mlp.experts.down_proj", "block_sparse_moe.experts")
            for m, down in enumerate(w):
                out[f"{stem}.{m}.w2.weight"] = down
        elif name.endswith("gate_up_proj.weight"):
            gate, up = w.chunk(2, dim=0)
            out[name.replace("gate_up_proj", "gate_proj")] = gate
            out[name.replace("gate_up_proj", "up_proj")] = up
        else:
            out[name] = w
    renames = [
        ("mlp.gate.e_score_correction_bias", "block_sparse_moe.e_score_correction_bias"),
        ("mlp.gate.", "block_sparse_moe.gate."),
        ("mlp.shared_experts.", "block_sparse_moe.shared_experts."),
        ("self_attn.indexer.", "self_attn.index_"),
    ]
    for theirs, ours in renames:
        out = {n.replace(theirs, ours): w for n, w in out.items()}
    return out


def test_release_names_load(text_dir, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(text_dir, tmp_path, dirs_exist_ok=True)
    weights = _release_names(load_file(text_dir / "model.safetensors"))
    assert "model.layers.0.self_attn.index_q_proj.weight" in weights
    assert "model.layers.1.block_sparse_moe.experts.7.w2.weight" in weights
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    prompts = random_token_prompts("release", 2)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP)
    want, got = (
        _llm(p).generate([{"prompt_token_ids": x} for x in prompts], params, use_tqdm=False)
        for p in (text_dir, tmp_path)
    )
    for a, b in zip(want, got, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].cumulative_logprob == pytest.approx(b.outputs[0].cumulative_logprob)


@pytest.mark.slow
def test_tensor_parallel_matches_one_process(text_dir):
    assert_tp_matches_one_process(text_dir, random_token_prompts("tp", 2), MAX_TOKENS, 128)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"index_n_heads": 3}, "index_n_heads=3 must divide"),
        ({"index_local_blocks": 4}, "index_local_blocks=4 > index_topk_blocks"),
        ({"index_head_dim": 4}, "index_head_dim=4 is narrower"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types: unsupported"),
        ({"mlp_layer_types": ["dense", "moe"]}, "mlp_layer_types: unsupported"),
    ],
)
def test_refused_by_name(overrides, match):
    from paged_engine.models.minimax_m3 import MiniMaxM3ForCausalLM

    config = transformers.MiniMaxM3VLTextConfig(**TEXT)
    for field, value in overrides.items():  # past the config's own validation
        object.__setattr__(config, field, value)
    with pytest.raises(ValueError, match=match):
        MiniMaxM3ForCausalLM(config)
