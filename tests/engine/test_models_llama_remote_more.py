"""Remote-code Llama releases of models/llama_remote.py against HF transformers: each test
writes a tiny HF model of a mathematically equal transformers class, rewrites its tensors and
config.json in the release's own layout (the Hub's fields, as literals), serves that through
paged and compares with the HF model: greedy tokens identical, top-5 logprobs within 1e-3
(float32).

    Tele-FLM (use_mup)      HF Granite: embedding_multiplier = input_mult, logits_scaling =
                            mup_scale_factor / output_mult, attention_multiplier head_dim^-0.5,
                            residual_multiplier 1
    openPangu-Embedded      HF Llama with attention_bias (q / k / v / o biases); HF Qwen2
                            where `qkv_bias` alone is on
    Fairseq2Llama           HF Llama: fairseq2's names, rotary-pair rows, a wrapped model.pt

Also: openPangu's other switches and fairseq2's tensor-parallel shards refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_parity import assert_llm_matches
from hf_reference import hf_greedy, load_hf_model, random_token_prompts

from paged_engine import LLM
from paged_engine.testing import write_tiny_model

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

TOKENS = 6
HEAD_DIM = 16  # the tiny Llama: hidden 64, 4 query heads, 2 KV heads


def _matches(path: Path, hf, seed: int, case: str) -> None:
    prompts = random_token_prompts(seed, 2)
    refs = [hf_greedy(hf, p, TOKENS, 5) for p in prompts]
    llm = LLM(model=str(path), dtype="float32", max_model_len=96, block_size=16)
    assert_llm_matches(case, llm, prompts, refs)


def _llama_fields(src: dict) -> dict:
    """The Llama fields a release's config.json spells as transformers does."""
    keep = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "rms_norm_eps",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    )
    return {k: src[k] for k in keep}


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


# the sizes a release's config.json needs before the switch a refusal test sets is read
_SIZES = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128}
_SIZES |= {"num_hidden_layers": 2, "num_attention_heads": 4}


def _assert_refused(path: Path, config: dict, name: str) -> None:
    """`config` written as `path`'s config.json: remote_config's ValueError names `name`."""
    from paged_engine.models.remote_aliases import remote_config

    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=name):
        remote_config(path)


def test_teleflm_mup(tmp_path):
    """Tele-FLM with use_mup: the embedding times input_mult, the logits times
    output_mult / mup_scale_factor; otherwise Llama's names and maths."""
    path = write_tiny_model(
        tmp_path,
        "granite",
        seed=11,
        embedding_multiplier=3.0,
        residual_multiplier=1.0,
        attention_multiplier=HEAD_DIM**-0.5,
        logits_scaling=4.0,
        tie_word_embeddings=False,
    )
    hf = load_hf_model(path)
    config = {
        "architectures": ["TeleFLMForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_teleflm.TeleFLMConfig"},
        "model_type": "teleflm",
        **_llama_fields(_config(path)),
        "hidden_act": "silu",
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "use_mup": True,
        "input_mult": 3.0,
        "output_mult": 8.0,
        "mup_scale_factor": 32.0,  # logits x 8 / 32: Granite's logits_scaling 4
    }
    (path / "config.json").write_text(json.dumps(config))
    _matches(path, hf, 11, "teleflm")


@pytest.mark.parametrize(("name", "value"), [("mup_scale_factor", None), ("input_mult", 0)])
def test_teleflm_refuses_missing_scalars(name, value, tmp_path):
    config = {"architectures": ["TeleFLMForCausalLM"], "model_type": "teleflm", **_SIZES}
    config |= {"use_mup": True, "input_mult": 1.0, "output_mult": 1.0, "mup_scale_factor": 4.0}
    _assert_refused(tmp_path, config | {name: value}, name)


def test_pangu_embedded_biases(tmp_path):
    """openPangu-Embedded: Llama with `bias` on q / k / v / o (its config class's default
    True: the field left out here), model_type PanguEmbedded."""
    path = write_tiny_model(tmp_path, "llama", seed=12, attention_bias=True, rope_theta=16000.0)
    hf = load_hf_model(path)
    config = {
        "architectures": ["PanguEmbeddedForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_openpangu_dense.PanguEmbeddedConfig"},
        "model_type": "PanguEmbedded",
        **_llama_fields(_config(path)),
        "hidden_act": "silu",
        "rope_theta": 16000.0,
        "tie_word_embeddings": False,
        "attention_dropout": 0.0,
    }
    (path / "config.json").write_text(json.dumps(config))
    _matches(path, hf, 12, "pangu_embedded")


def test_pangu_embedded_qkv_bias_apart(tmp_path):
    """`qkv_bias` true beside `bias` false: q / k / v biased, o_proj not (HF Qwen2); the rope
    base in transformers 5's `rope_parameters`."""
    path = write_tiny_model(tmp_path, "qwen2", seed=14, rope_theta=20000.0)
    hf = load_hf_model(path)
    config = {
        "architectures": ["PanguEmbeddedForCausalLM"],
        "model_type": "PanguEmbedded",
        **_llama_fields(_config(path)),
        "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default", "rope_theta": 20000.0},
        "tie_word_embeddings": True,
        "bias": False,
        "qkv_bias": True,
    }
    (path / "config.json").write_text(json.dumps(config))
    _matches(path, hf, 14, "pangu_embedded_qkv_bias")


@pytest.mark.parametrize(
    ("name", "value"),
    [("kv_lora_rank", 512), ("sandwich_norm", True), ("use_mhc", True), ("is_causal", False)],
)
def test_pangu_refuses_other_switches(name, value, tmp_path):
    config = {"architectures": ["PanguEmbeddedForCausalLM"], "model_type": "PanguEmbedded"}
    _assert_refused(tmp_path, {**config, **_SIZES, name: value}, name)


def _to_fairseq2_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's q / k rows (per head: halves i, i + d/2 rotated together) -> fairseq2's (pairs
    2i, 2i + 1)."""
    return w.reshape(heads, 2, HEAD_DIM // 2, -1).transpose(1, 2).reshape(w.shape)


def test_fairseq2_llama(tmp_path):
    """Fairseq2Llama: the HF Llama's tensors renamed to fairseq2's, q / k rows in rotary-pair
    order, saved wrapped as {"model_key": "model", "model": state} in model.pt (no
    safetensors); config.json is Llama's with the architecture renamed."""
    path = write_tiny_model(tmp_path, "llama", seed=13)
    hf = load_hf_model(path)
    state = load_file(str(path / "model.safetensors"))
    names = (
        ("model.embed_tokens.", "decoder_frontend.embed."),
        ("lm_head.", "final_proj."),
        ("model.norm.", "decoder.layer_norm."),
        ("model.", "decoder."),
        (".input_layernorm.", ".self_attn_layer_norm."),
        (".post_attention_layernorm.", ".ffn_layer_norm."),
        (".self_attn.o_proj.", ".self_attn.output_proj."),
        (".mlp.gate_proj.", ".ffn.gate_proj."),
        (".mlp.up_proj.", ".ffn.inner_proj."),
        (".mlp.down_proj.", ".ffn.output_proj."),
    )
    out = {}
    for name, w in state.items():
        if ".q_proj." in name:
            w = _to_fairseq2_rows(w, 4)
        elif ".k_proj." in name:
            w = _to_fairseq2_rows(w, 2)
        for ours, theirs in names:
            name = name.replace(ours, theirs)
        out[name] = w.clone()
    (path / "model.safetensors").unlink()
    torch.save({"model_key": "model", "model": out}, path / "model.pt")
    config = _config(path)
    config["architectures"] = ["Fairseq2LlamaForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    _matches(path, hf, 13, "fairseq2_llama")


def test_fairseq2_shards_refused(tmp_path):
    from paged_engine.models.llama_remote import fairseq2_files

    assert fairseq2_files(tmp_path) == []
    torch.save({"model_key": "model", "model": {}}, tmp_path / "model.0.pt")
    with pytest.raises(ValueError, match=r"model\.0\.pt"):
        fairseq2_files(tmp_path)
