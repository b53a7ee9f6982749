"""Release configs: the config.json of popular open models as their authors published them
(release_configs.py: every field, odd ones included), with only size fields made tiny
(`shrink`), served by `LLM` (float32) on random weights and compared with transformers'
greedy tokens and top-3 logprobs (1e-3, config_variant_check.serve_and_compare) on prompts
shorter and longer than the (8-token) sliding windows. The tests elsewhere build configs from
transformers' config classes, which drop or rename what a release carries (rope_scaling
`type` keys and extra entries, torch_dtype, eos lists, sliding_window beside
use_sliding_window false, max_window_layers past the layer count, pretraining_tp, ...); here
paged reads the release's own file, and transformers reads the same file.

Also served: a few releases as transformers 5 saves them (rope_parameters, dtype, per-layer-type
ropes), and with chunked prefill and prefix caching (twice, the second pass from the cache).

MiniCPM4 (model_type "minicpm": its config class is the release's own code, and transformers
has no model for it) is served with trust_remote_code beside a stand-in for that config class;
the reference is HF Granite with MiniCPM's scalars under Granite's names.

Regressions:
- Phi-3.5-mini and Phi-4-mini (longrope) served with the default max_model_len (the config's
  131072 positions) put every sequence on the long factors, unlike transformers (and vLLM,
  whose default for longrope is original_max_position_embeddings, 4096): now that default.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from config_variant_check import CHUNKED_PREFIX_CACHE, hf_refs, serve_and_compare
from hf_parity import checkpoint_dirs, save_hf_checkpoint, write_hf_checkpoint
from release_configs import FILES, MINICPM4, MINICPM_CONFIG_CODE, RELEASES, release, shrink

from paged_engine import LLM, SamplingParams
from paged_engine.testing import _randomize

transformers = pytest.importorskip("transformers")

LENGTHS = (5, 20, 60)  # the later two prompts pass the shrunk 8-token windows
NAMES = [*FILES, *RELEASES]
# releases whose fields transformers 5 rewrites on saving (rope_scaling -> rope_parameters,
# Gemma 3's rope per layer type, longrope lists, yarn / dynamic extras)
RESAVED = [
    "llama-3.1-8b",
    "deepseek-v3",
    "gemma-3-1b-it",
    "gemma-3-4b-it-text",
    "phi-3.5-mini-instruct",
    "hunyuan-7b-instruct",
    "internlm3-8b-instruct",
    "smollm3-3b",
    "seed-oss-36b-instruct",
]
# releases with sliding windows, hybrid layers or MLA, served from chunks and the prefix cache
CHUNKED = [
    "gpt-oss-20b",
    "mistral-7b-v0.1",
    "gemma-2-2b-it",
    "gemma-3-270m-it",
    "exaone-4.0-32b",
    "c4ai-command-r7b-12-2024",
    "qwen3-next-80b-a3b-instruct",
    "deepseek-v2-chat-0628",
    "olmo-3-7b-instruct",
]
# longrope: vLLM's default max_model_len is original_max_position_embeddings
DEFAULT_LENGTHS = {
    "phi-3.5-mini-instruct": 4096,
    "phi-4-mini-instruct": 4096,
    "phi-4": 16384,
    "llama-3.1-8b": 131072,
}


def write_release(path: Path, config: dict) -> Path:
    """A checkpoint at `path` whose config.json is `config` verbatim: transformers' model of it
    (its own reading of the file) with testing.py's random weights, the tiny tokenizer and
    generation config."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(path)
    )
    _randomize(model.float(), seed=1)
    save_hf_checkpoint(model, path, seed=1)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return checkpoint_dirs(
        tmp_path_factory, lambda d, name: write_release(d, shrink(release(name)))
    )


@pytest.mark.parametrize("name", NAMES)
def test_release_config_serves_like_hf(name, checkpoint):
    path = checkpoint(name)
    prompts, refs = hf_refs(path, LENGTHS)
    serve_and_compare(name, path, prompts, refs)


@pytest.mark.parametrize("name", RESAVED)
def test_release_config_as_transformers5_saves_it(name, tmp_path):
    path = write_release(tmp_path / name, shrink(release(name)))
    transformers.AutoConfig.from_pretrained(path).save_pretrained(path)
    assert "rope_parameters" in json.loads((path / "config.json").read_text())
    prompts, refs = hf_refs(path, LENGTHS)
    serve_and_compare(f"{name}-resaved", path, prompts, refs)


@pytest.mark.parametrize("name", CHUNKED)
def test_release_config_chunked_prefill_and_prefix_cache(name, checkpoint):
    path = checkpoint(name)
    prompts, refs = hf_refs(path, LENGTHS)
    serve_and_compare(name, path, prompts, refs, passes=2, **CHUNKED_PREFIX_CACHE)


@pytest.mark.parametrize("name", DEFAULT_LENGTHS)
def test_default_max_model_len_serves_like_hf(name, checkpoint):
    """Without max_model_len: vLLM's default length, and transformers' outputs."""
    from hf_reference import assert_matches

    path = checkpoint(name)
    prompts, refs = hf_refs(path, LENGTHS)
    llm = LLM(model=str(path), dtype="float32")
    try:
        assert llm.llm_engine.config.max_model_len == DEFAULT_LENGTHS[name]
        params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=3)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for out, ref in zip(outs, refs, strict=True):
            assert_matches(name, out, ref)
    finally:
        llm.llm_engine.shutdown()


def test_minicpm4_release_config_serves_like_hf_granite(tmp_path):
    c = shrink(MINICPM4)
    layers, hidden, heads = c["num_hidden_layers"], c["hidden_size"], c["num_attention_heads"]
    granite = transformers.GraniteConfig(
        **{k: c[k] for k in ("vocab_size", "intermediate_size", "num_key_value_heads")},
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        max_position_embeddings=c["max_position_embeddings"],
        rms_norm_eps=c["rms_norm_eps"],
        rope_parameters={**c["rope_scaling"], "rope_theta": 10000.0},  # (MiniCPM's default)
        embedding_multiplier=float(c["scale_emb"]),
        residual_multiplier=c["scale_depth"] / layers**0.5,
        attention_multiplier=(hidden // heads) ** -0.5,
        logits_scaling=hidden / c["dim_model_base"],
        tie_word_embeddings=False,
    )
    path = write_hf_checkpoint(tmp_path / "minicpm4", transformers.GraniteForCausalLM, granite)
    prompts, refs = hf_refs(path, LENGTHS)
    (path / "config.json").write_text(json.dumps(c, indent=2))
    (path / "configuration_minicpm.py").write_text(MINICPM_CONFIG_CODE)
    serve_and_compare("minicpm4", path, prompts, refs, trust_remote_code=True)


def test_shrink_keeps_every_field_but_sizes():
    """shrink changes only size fields (and ids into the tiny vocab): the rest as released."""
    sizes = {
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "vocab_size", "head_dim", "attention_head_dim",
        "moe_intermediate_size", "shared_expert_intermediate_size", "num_experts",
        "n_routed_experts", "num_local_experts", "moe_num_experts", "kv_lora_rank",
        "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
        "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
        "linear_value_head_dim", "moe_topk", "num_shared_expert", "sliding_window",
        "sliding_window_size", "max_window_layers", "layer_types", "no_rope_layers",
        "bos_token_id", "eos_token_id", "pad_token_id",
        "eod_token_id", "sep_token_id", "pad_id", "rope_scaling", "rope_parameters",
    }  # fmt: skip
    for name in NAMES:
        full, tiny = release(name), shrink(release(name))
        assert tiny.keys() == full.keys(), name
        assert {k for k in full if full[k] != tiny[k]} <= sizes, name
        for key in ("rope_scaling", "rope_parameters"):  # only the per-dimension lists cut
            if isinstance(full.get(key), dict):
                same = {k for k, v in full[key].items() if not isinstance(v, list)}
                assert {k: tiny[key][k] for k in same} == {k: full[key][k] for k in same}, name
