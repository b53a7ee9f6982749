"""Llama's decoder under other names or with one switch (models/llama_variants.py) against HF
transformers: EXAONE 3.x's checkpoint names, Meta CWM's sliding layers, InternLM's `bias`,
MiMo's skipped multi-token-prediction layers, and Llama's other architecture names. Greedy
tokens and top-5 logprobs (1e-3, float32) on tiny random models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_reference import (
    assert_matches,
    assert_tiny_case_matches_hf,
    hf_greedy,
    load_hf_model,
    random_token_prompts,
)

from paged_engine import LLM, SamplingParams
from paged_engine.testing import write_tiny_model

transformers = pytest.importorskip("transformers")


def _architectures(path: Path, names: list[str], **config) -> None:
    """config.json as a release writes it (its own architecture name, extra fields)."""
    data = json.loads((path / "config.json").read_text())
    data.update(architectures=names, **config)
    (path / "config.json").write_text(json.dumps(data))


def _matches(path: Path, refs, prompts, case: str) -> LLM:
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, ref in zip(outs, refs, strict=True):
        assert_matches(case, out, ref)
    return llm


def test_exaone_checkpoint_names(tmp_path):
    """EXAONE 3.x (model_type "exaone"): its release's GPT-2-style tensor names load as
    transformers' Llama reads them."""
    if not hasattr(transformers, "ExaoneConfig"):
        pytest.skip("this transformers has no EXAONE 3 config")
    from safetensors.torch import load_file, save_file

    path = write_tiny_model(tmp_path, "exaone", seed=1)
    hf = load_hf_model(path)
    state = load_file(str(path / "model.safetensors"))
    if "model.embed_tokens.weight" in state:  # a transformers that saves its own names
        released = (
            ("model.embed_tokens.", "transformer.wte."),
            ("model.layers.", "transformer.h."),
            ("model.norm.", "transformer.ln_f."),
            (".self_attn.o_proj.", ".attn.attention.out_proj."),
            (".self_attn.", ".attn.attention."),
            (".input_layernorm.", ".ln_1."),
            (".post_attention_layernorm.", ".ln_2."),
            (".mlp.gate_proj.", ".mlp.c_fc_0."),
            (".mlp.up_proj.", ".mlp.c_fc_1."),
            (".mlp.down_proj.", ".mlp.c_proj."),
        )
        renamed = {}
        for name, w in state.items():
            for ours, theirs in released:
                name = name.replace(ours, theirs)
            renamed[name] = w
        save_file(renamed, str(path / "model.safetensors"), metadata={"format": "pt"})
        state = renamed
    assert any(n.startswith("transformer.h.0.attn.attention.") for n in state)
    _architectures(path, ["ExaoneForCausalLM"])
    prompts = random_token_prompts(3, 3)
    llm = _matches(path, [hf_greedy(hf, p, 10, 5) for p in prompts], prompts, "exaone")
    assert type(llm.llm_engine.model_runner.model).__name__ == "ExaoneForCausalLM"
    # a checkpoint transformers saved names its Llama class: the model type decides
    _architectures(path, ["LlamaForCausalLM"])
    llm = _matches(path, [hf_greedy(hf, p, 10, 5) for p in prompts], prompts, "exaone-as-llama")
    assert type(llm.llm_engine.model_runner.model).__name__ == "ExaoneForCausalLM"


def test_cwm_sliding_layers(tmp_path):
    if not hasattr(transformers, "CwmConfig"):
        pytest.skip("this transformers has no CWM")
    assert_tiny_case_matches_hf("cwm", "cwm", {}, tmp_path, seed=4)


def test_internlm_bias_switch(tmp_path):
    """InternLM (v1) names its q / k / v / o biases `bias`: Llama with attention_bias."""
    path = write_tiny_model(tmp_path, "llama", seed=2, attention_bias=True)
    hf = load_hf_model(path)
    _architectures(path, ["InternLMForCausalLM"], bias=True, attention_bias=False)
    prompts = random_token_prompts(5, 3)
    _matches(path, [hf_greedy(hf, p, 10, 5) for p in prompts], prompts, "internlm")


def test_mimo_skips_its_mtp_layers(tmp_path):
    from safetensors.torch import load_file, save_file

    path = write_tiny_model(tmp_path, "qwen2", seed=3)
    hf = load_hf_model(path)
    state = load_file(str(path / "model.safetensors"))
    state["model.mtp_layers.0.input_layernorm.weight"] = torch.ones(64)
    state["model.mtp_layers.0.self_attn.q_proj.weight"] = torch.ones(64, 64)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    _architectures(path, ["MiMoForCausalLM"], num_nextn_predict_layers=1)
    prompts = random_token_prompts(6, 3)
    _matches(path, [hf_greedy(hf, p, 10, 5) for p in prompts], prompts, "mimo")


@pytest.mark.parametrize(
    "name", ["LLaMAForCausalLM", "AquilaForCausalLM", "AquilaModel", "XverseForCausalLM"]
)
def test_llama_under_other_names(name, tmp_path):
    path = write_tiny_model(tmp_path, "llama", seed=1)
    hf = load_hf_model(path)
    _architectures(path, [name])
    prompts = random_token_prompts(7, 2)
    _matches(path, [hf_greedy(hf, p, 10, 5) for p in prompts], prompts, name)


def internlm2_tensors(state: dict, d: int, heads: int, kv_heads: int) -> dict:
    """A Llama checkpoint's tensors in InternLM2's layout (packed wqkv, its own names)."""
    out = {}
    for name, w in state.items():
        if ".self_attn.q_proj." in name:
            q = w.reshape(kv_heads, heads // kv_heads, d, -1)
            k = state[name.replace("q_proj", "k_proj")].reshape(kv_heads, 1, d, -1)
            v = state[name.replace("q_proj", "v_proj")].reshape(kv_heads, 1, d, -1)
            packed = torch.cat((q, k, v), dim=1).reshape(-1, w.shape[-1])
            out[name.replace(".self_attn.q_proj.", ".attention.wqkv.")] = packed
        elif ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            continue
        else:
            for theirs, ours in (
                ("model.embed_tokens.", "model.tok_embeddings."),
                (".self_attn.o_proj.", ".attention.wo."),
                (".mlp.gate_proj.", ".feed_forward.w1."),
                (".mlp.up_proj.", ".feed_forward.w3."),
                (".mlp.down_proj.", ".feed_forward.w2."),
                (".input_layernorm.", ".attention_norm."),
                (".post_attention_layernorm.", ".ffn_norm."),
                ("lm_head.", "output."),
            ):
                name = name.replace(theirs, ours)
            out[name] = w
    return out


def test_internlm2_packed_wqkv(tmp_path):
    """InternLM2's checkpoint: q, k, v packed per KV head in wqkv ([q, q, k, v] for 4 query heads
    on 2 KV heads), its own tensor names; the same model as the Llama it was packed from."""
    from safetensors.torch import load_file, save_file

    path = write_tiny_model(tmp_path, "llama", seed=4)
    hf = load_hf_model(path)
    out = internlm2_tensors(load_file(str(path / "model.safetensors")), 16, 4, 2)
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    _architectures(path, ["InternLM2ForCausalLM"], bias=False)
    prompts = random_token_prompts(8, 3)
    _matches(path, [hf_greedy(hf, p, 10, 5) for p in prompts], prompts, "internlm2")


def test_minicpm_scalars(tmp_path):
    """MiniCPM's scale_emb / scale_depth / dim_model_base equal Granite's multipliers: the
    checkpoint served as MiniCPM (its config with MiniCPM's names only) gives HF Granite's
    tokens for the same weights."""
    layers, hidden, head_dim = 2, 64, 16
    granite = {
        "embedding_multiplier": 12.0,
        "residual_multiplier": 1.4 / layers**0.5,
        "attention_multiplier": head_dim**-0.5,
        "logits_scaling": hidden / 16,
    }
    path = write_tiny_model(tmp_path, "granite", seed=5, **granite)
    hf = load_hf_model(path)
    data = json.loads((path / "config.json").read_text())
    for name in granite:
        data.pop(name, None)
    data.update(model_type="llama", scale_emb=12, scale_depth=1.4, dim_model_base=16)
    (path / "config.json").write_text(json.dumps(data))
    _architectures(path, ["MiniCPMForCausalLM"])
    prompts = random_token_prompts(9, 3)
    _matches(path, [hf_greedy(hf, p, 10, 5) for p in prompts], prompts, "minicpm")


def test_minicpm_leaves_the_callers_config_alone():
    """The model reads MiniCPM's scalars under Granite's names on a copy of the config."""
    from paged_engine.models.llama_variants import MiniCPMForCausalLM
    from paged_engine.testing import tiny_config

    config = tiny_config("llama", scale_emb=12, scale_depth=1.4, dim_model_base=16)
    model = MiniCPMForCausalLM(config)
    assert not hasattr(config, "embedding_multiplier")
    assert model.config.embedding_multiplier == 12
