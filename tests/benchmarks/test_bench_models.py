from __future__ import annotations

import json

import torch

from benchmarks.models import default_dtype, load_hf, materialize


def test_materialize_writes_one_state_dict_for_both(tmp_path):
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 300,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 128,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    spec = materialize(tmp_path / "c.json", tmp_path / "m", default_dtype("cpu"), "cpu")
    assert (spec.path / "model.safetensors").exists() and (spec.path / "tokenizer.json").exists()
    stamp = (spec.path / "bench_stamp.json").stat().st_mtime_ns
    again = materialize(tmp_path / "c.json", tmp_path / "m", default_dtype("cpu"), "cpu")
    assert (again.path / "bench_stamp.json").stat().st_mtime_ns == stamp  # reused, not rewritten

    from safetensors.torch import load_file

    hf = load_hf(spec, "cpu")
    saved = load_file(spec.path / "model.safetensors")
    for name, tensor in saved.items():
        assert torch.equal(hf.state_dict()[name], tensor), name
