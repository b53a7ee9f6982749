"""Hybrid, state-space and more MoE release configs (release_configs_hybrid.py: each config.json
as published, only size fields made tiny) served by `LLM` (float32) on random weights and
compared with transformers' greedy tokens and top-3 logprobs (1e-3) on prompts shorter and
longer than the tiny SSM chunk (16) and windows (8): Jamba, Falcon-H1, Nemotron-H, Granite 4
(hybrid MoE, hybrid dense, dense), Bamba, Zamba2, LFM2 (dense, MoE), Mamba2, Falcon-Mamba,
Mamba, Qwen3 MoE 2507, Llama 4 Scout's text model, OLMoE, Phi-3.5-MoE, Moonlight / Kimi K2
(DeepSeek-V3), MiniMax-M2, Kimi-Linear, gpt-oss-120b, DBRX. Also: the hybrid ones from chunked
prefill and the prefix cache, and every one started with the defaults (dtype "auto", no
max_model_len): vLLM's length and dtype, and the KV / state pool sized for it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from config_variant_check import CHUNKED_PREFIX_CACHE, hf_refs, serve_and_compare
from hf_parity import checkpoint_dirs, save_hf_checkpoint
from hf_reference import edited_checkpoint
from release_configs_hybrid import HYBRID_RELEASES, release_hybrid, shrink_hybrid
from test_release_configs import write_release

from paged_engine import LLM, SamplingParams
from paged_engine.testing import _randomize

transformers = pytest.importorskip("transformers")

LENGTHS = (5, 20, 60)
NAMES = list(HYBRID_RELEASES)
# recurrent-state layers beside attention, served from chunks and the prefix cache
CHUNKED = [
    "jamba-v0.1",
    "falcon-h1-0.5b-instruct",
    "nvidia-nemotron-nano-9b-v2",
    "granite-4.0-h-tiny",
    "zamba2-1.2b",
    "lfm2-8b-a1b",
    "mamba-codestral-7b-v0.1",
    "llama-4-scout-17b-16e-instruct-text",
]


# releases whose layer pattern transformers 5 rewrites on saving (Nemotron-H's
# hybrid_override_pattern -> layers_block_type, Kimi-Linear's 1-based linear_attn_config lists
# -> layer_types, Llama 4's no_rope_layers -> layer_types, rope_theta -> rope_parameters)
RESAVED = [
    "nvidia-nemotron-nano-9b-v2",
    "zamba2-1.2b",
    "granite-4.0-h-tiny",
    "lfm2-8b-a1b",
    "llama-4-scout-17b-16e-instruct-text",
    "kimi-linear-48b-a3b-instruct",
]
# vLLM's default max_model_len of each (no max_model_len given): max_position_embeddings,
# DBRX's max_seq_len, Kimi-Linear's model_max_length, longrope's original context (Phi-3.5-MoE),
# 2048 where the config names none (the pure Mamba releases)
DEFAULT_LENGTHS = {
    "jamba-v0.1": 262144,
    "ai21-jamba-mini-1.7": 262144,
    "falcon-h1-0.5b-instruct": 16384,
    "falcon-h1-1.5b-deep-instruct": 131072,
    "nemotron-h-8b-base-8k": 8192,
    "nvidia-nemotron-nano-9b-v2": 131072,
    "granite-4.0-h-tiny": 131072,
    "granite-4.0-h-micro": 131072,
    "granite-4.0-micro": 131072,
    "bamba-9b": 262144,
    "zamba2-1.2b": 4096,
    "lfm2-1.2b": 128000,
    "lfm2-8b-a1b": 128000,
    "mamba-codestral-7b-v0.1": 2048,
    "falcon-mamba-7b": 2048,
    "mamba-130m-hf": 2048,
    "qwen3-30b-a3b-instruct-2507": 262144,
    "qwen3-coder-30b-a3b-instruct": 262144,
    "olmoe-1b-7b-0924": 4096,
    "phi-3.5-moe-instruct": 4096,
    "moonlight-16b-a3b-instruct": 8192,
    "kimi-k2-instruct": 131072,
    "minimax-m2": 196608,
    "kimi-linear-48b-a3b-instruct": 1048576,
    "gpt-oss-120b": 131072,
    "dbrx-instruct": 32768,
}
# a quarter of the default 1 GiB CPU pool: enough for every default length above (the tiny
# models' KV rows are a few hundred bytes a token), quick to allocate
KV_GIB = 0.25
# what a release means that transformers 5 does not read, spelled for HF's reference only:
# DBRX's rope base sits in attn_config.rope_theta (500000; vLLM and paged read it there,
# transformers' DBRX config falls back to 10000)
HF_SPELLING = {"dbrx-instruct": {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}}


# Granite 4's muP attention_multiplier (1/128, 1/64) leaves random weights' scores near 0 (the
# attention a plain average, blind to positions and to the multiplier itself): their q / k
# projections scaled up so both show in the logits
QK_SCALE = {"granite-4.0-h-tiny": 8.0, "granite-4.0-h-micro": 8.0, "granite-4.0-micro": 8.0}


def write_hybrid_release(path: Path, name: str) -> Path:
    """write_release of `name`'s tiny config, with q_proj / k_proj scaled by QK_SCALE[name]."""
    config = shrink_hybrid(release_hybrid(name))
    if name not in QK_SCALE:
        return write_release(path, config)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(path)
    )
    _randomize(model.float(), seed=1)
    with torch.no_grad():
        for key, p in model.named_parameters():
            if key.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(QK_SCALE[name])
    save_hf_checkpoint(model, path, seed=1)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return checkpoint_dirs(tmp_path_factory, lambda d, name: write_hybrid_release(d, name))


@pytest.fixture(scope="module")
def references(checkpoint, tmp_path_factory):
    """name -> (checkpoint, prompts, HF's greedy references), computed once."""
    cache: dict[str, tuple[Path, list, list]] = {}

    def refs(name: str) -> tuple[Path, list, list]:
        if name not in cache:
            path = ref_path = checkpoint(name)
            if name in HF_SPELLING:
                ref_path = edited_checkpoint(
                    path, tmp_path_factory.mktemp(name) / "hf", **HF_SPELLING[name]
                )
            cache[name] = (path, *hf_refs(ref_path, LENGTHS))
        return cache[name]

    return refs


@pytest.mark.parametrize("name", NAMES)
def test_hybrid_release_config_serves_like_hf(name, references):
    path, prompts, refs = references(name)
    serve_and_compare(name, path, prompts, refs)


@pytest.mark.parametrize("name", CHUNKED)
def test_hybrid_release_config_chunked_prefill_and_prefix_cache(name, references):
    path, prompts, refs = references(name)
    serve_and_compare(name, path, prompts, refs, passes=2, **CHUNKED_PREFIX_CACHE)


@pytest.mark.parametrize("name", RESAVED)
def test_hybrid_release_config_as_transformers5_saves_it(name, checkpoint, tmp_path):
    path = Path(shutil.copytree(checkpoint(name), tmp_path / name))  # (resaved in the copy)
    before = json.loads((path / "config.json").read_text())
    transformers.AutoConfig.from_pretrained(path).save_pretrained(path)
    assert json.loads((path / "config.json").read_text()) != before
    prompts, refs = hf_refs(path, LENGTHS)
    serve_and_compare(f"{name}-resaved", path, prompts, refs)


@pytest.mark.parametrize("name", DEFAULT_LENGTHS)
def test_hybrid_release_config_starts_with_defaults(name, checkpoint):
    """dtype "auto" is the release's dtype, max_model_len vLLM's default, and the KV / state
    pool holds a sequence of that length."""
    llm = LLM(model=str(checkpoint(name)), cpu_kv_cache_gib=KV_GIB)
    try:
        engine = llm.llm_engine
        assert engine.config.max_model_len == DEFAULT_LENGTHS[name]
        want = release_hybrid(name).get("torch_dtype") or release_hybrid(name)["dtype"]
        assert engine.model_config.dtype == getattr(torch, want)
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 2
        stats = llm.get_stats()
        assert stats.num_used_blocks == 0
        assert stats.num_total_blocks * stats.block_size >= DEFAULT_LENGTHS[name]
    finally:
        llm.llm_engine.shutdown()


def test_llama4_scout_default_length_is_refused_by_name(checkpoint):
    """Llama 4 Scout's 10M-token default does not fit the pool (its chunked layers hold full KV,
    as vLLM's without the hybrid KV manager): a ValueError naming max_model_len, as vLLM's;
    a max_model_len that fits serves."""
    path = checkpoint("llama-4-scout-17b-16e-instruct-text")
    with pytest.raises(ValueError, match="max_model_len=10485760"):
        LLM(model=str(path), cpu_kv_cache_gib=KV_GIB)
    llm = LLM(model=str(path), cpu_kv_cache_gib=KV_GIB, max_model_len=1 << 19)
    try:
        assert llm.llm_engine.model_config.dtype == torch.bfloat16
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 2
    finally:
        llm.llm_engine.shutdown()


def test_shrink_hybrid_keeps_every_field_but_sizes():
    """shrink_hybrid changes only size fields (widths, heads, layers and the per-layer patterns
    cut with them, SSM sizes, experts, vocab, ids into the tiny vocab, position counts of the
    local-attention chunk / temperature floor): the rest as released."""
    sizes = {
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "vocab_size", "head_dim", "attention_head_dim",
        "moe_intermediate_size", "num_experts", "n_routed_experts", "num_local_experts",
        "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
        "sliding_window", "layer_types", "bos_token_id", "eos_token_id", "pad_token_id",
        "rope_scaling", "mamba_d_state", "mamba_dt_rank", "mamba_n_heads", "mamba_d_head",
        "mamba_d_ssm", "mamba_chunk_size", "mamba_num_heads", "mamba_head_dim",
        "ssm_state_size", "chunk_size", "time_step_rank", "hybrid_override_pattern",
        "attn_layer_indices", "attn_rotary_emb", "layers_block_type", "hybrid_layer_ids",
        "kv_channels", "num_query_groups", "ffn_hidden_size", "adapter_rank", "n_mamba_heads",
        "mamba_headdim", "block_dim", "block_ff_dim", "conv_dim", "conv_dim_out", "num_heads",
        "state_size", "d_model", "d_inner", "n_layer", "moe_layers", "no_rope_layers",
        "intermediate_size_mlp", "attention_chunk_size", "floor_scale", "attn_type_list",
        "rotary_dim", "shared_intermediate_size", "n_heads", "n_layers",
        "moe_shared_expert_intermediate_size",
    }  # fmt: skip
    nested = {  # sub-dicts: their size entries
        "attn_config": {"kv_n_heads"},
        "ffn_config": {"ffn_hidden_size", "moe_num_experts"},
        "linear_attn_config": {"full_attn_layers", "kda_layers", "head_dim", "num_heads"},
    }
    for name in NAMES:
        full, tiny = release_hybrid(name), shrink_hybrid(release_hybrid(name))
        assert tiny.keys() == full.keys(), name
        assert {k for k in full if full[k] != tiny[k]} <= sizes | nested.keys(), name
        for key, inner in nested.items():
            if key in full:
                same = full[key].keys() - inner
                assert {k: tiny[key][k] for k in same} == {k: full[key][k] for k in same}, name
        if isinstance(full.get("rope_scaling"), dict):  # only the per-dimension lists cut
            same = {k for k, v in full["rope_scaling"].items() if not isinstance(v, list)}
            assert {k: tiny["rope_scaling"][k] for k in same} == {
                k: full["rope_scaling"][k] for k in same
            }, name
