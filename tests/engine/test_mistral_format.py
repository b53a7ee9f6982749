"""Mistral's native format (config_format / load_format "mistral", mistral_format.py): a tiny
HF Mistral / Mixtral is rewritten here as params.json + consolidated.safetensors by a writer of
its own (Mistral's names, wq / wk rows back in Mistral's interleaved rotary layout), its HF
files deleted, and served: HF's greedy tokens and logprobs on the original. Also: "auto"
picks params.json only without config.json, refusals by name, and the hub's file choice."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_reference import assert_matches, hf_greedy, load_hf_model
from safetensors.torch import load_file, save_file

from paged_engine import LLM, SamplingParams
from paged_engine.config import EngineConfig
from paged_engine.loader import iter_weights, load_hf_config, resolve_model, weights_format
from paged_engine.mistral_format import mistral_hf_config
from paged_engine.testing import write_tiny_model

_HF_ONLY = ("config.json", "model.safetensors")


def _to_interleaved(w: torch.Tensor, heads: int) -> torch.Tensor:
    """HF's rotate-half rows -> Mistral's pairs: within a head, row i of the first half and
    row i of the second half become rows 2i and 2i + 1."""
    half = w.shape[0] // heads // 2
    out = torch.empty_like(w)
    for h in range(heads):
        base = h * 2 * half
        for i in range(half):
            out[base + 2 * i] = w[base + i]
            out[base + 2 * i + 1] = w[base + half + i]
    return out


def _native_name(name: str) -> str:
    """model.safetensors name -> Mistral's consolidated name."""
    name = name.removeprefix("model.")
    for hf, ours in (
        ("embed_tokens", "tok_embeddings"),
        ("lm_head", "output"),
        ("input_layernorm", "attention_norm"),
        ("post_attention_layernorm", "ffn_norm"),
        ("self_attn.q_proj", "attention.wq"),
        ("self_attn.k_proj", "attention.wk"),
        ("self_attn.v_proj", "attention.wv"),
        ("self_attn.o_proj", "attention.wo"),
        ("mlp.gate_proj", "feed_forward.w1"),
        ("mlp.down_proj", "feed_forward.w2"),
        ("mlp.up_proj", "feed_forward.w3"),
        ("block_sparse_moe", "feed_forward"),
    ):
        name = name.replace(hf, ours)
    return name


def native_text_params(text: dict[str, Any]) -> dict[str, Any]:
    """params.json's text-model fields for an HF Mistral text config (its config.json dict)."""
    heads = text["num_attention_heads"]
    return {
        "dim": text["hidden_size"],
        "n_layers": text["num_hidden_layers"],
        "head_dim": text.get("head_dim") or text["hidden_size"] // heads,
        "hidden_dim": text["intermediate_size"],
        "n_heads": heads,
        "n_kv_heads": text["num_key_value_heads"],
        "norm_eps": text["rms_norm_eps"],
        "vocab_size": text["vocab_size"],
        "rope_theta": text["rope_parameters"]["rope_theta"],
        "max_seq_len": text["max_position_embeddings"],
        "sliding_window": text["sliding_window"],
    }


def native_text_weight(
    name: str, w: torch.Tensor, heads: int, kv_heads: int
) -> tuple[str, torch.Tensor]:
    """An HF text-model weight (model.safetensors name, no `language_model.` prefix) as Mistral
    ships it: its consolidated name, wq / wk rows interleaved per head."""
    name = _native_name(name)
    if name.endswith("attention.wq.weight"):
        w = _to_interleaved(w, heads)
    elif name.endswith("attention.wk.weight"):
        w = _to_interleaved(w, kv_heads)
    return name, w.contiguous()


def assert_native_weights_are_hf(hf_dir: Path, native: Path) -> None:
    """The mistral load format reads `native`'s consolidated weights back as `hf_dir`'s
    model.safetensors: the same names, each tensor equal."""
    want = load_file(hf_dir / "model.safetensors")
    got = dict(iter_weights(resolve_model(native), "mistral"))
    assert got.keys() == want.keys()
    for name, w in want.items():
        assert torch.equal(got[name], w), name


def write_native(hf_dir: Path, out: Path) -> Path:
    """`hf_dir` as Mistral ships it: params.json, consolidated.safetensors, tokenizer files."""
    shutil.copytree(hf_dir, out)
    cfg = json.loads((out / "config.json").read_text())
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    params = native_text_params(cfg)
    if cfg["tie_word_embeddings"]:  # the checkpoint then has no output.weight
        params["tied_embeddings"] = True
    if "num_local_experts" in cfg:
        params["moe"] = {
            "num_experts": cfg["num_local_experts"],
            "num_experts_per_tok": cfg["num_experts_per_tok"],
        }
    (out / "params.json").write_text(json.dumps(params))
    native = {}
    for name, w in load_file(out / "model.safetensors").items():
        name, w = native_text_weight(name, w, heads, kv_heads)
        native[name] = w
    save_file(native, out / "consolidated.safetensors")
    for name in _HF_ONLY:
        (out / name).unlink()
    return out


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (9, 40)]  # 40 > window


@pytest.fixture(scope="module")
def mistral_dirs(tmp_path_factory) -> tuple[Path, Path]:
    """(the HF original, its native rewrite) of a tiny Mistral (sliding window 32)."""
    hf_dir = write_tiny_model(tmp_path_factory.mktemp("hf"), "mistral", seed=1)
    return hf_dir, write_native(hf_dir, tmp_path_factory.mktemp("native") / "m")


def _assert_serves_like_hf(hf_dir: Path, native: Path, **formats: str) -> None:
    hf = load_hf_model(hf_dir)
    prompts = _prompts()
    refs = [hf_greedy(hf, p, 6) for p in prompts]
    llm = LLM(model=str(native), dtype="float32", max_model_len=64, block_size=16, **formats)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, ref in zip(outs, refs, strict=True):
        assert_matches("mistral native", out, ref, abs_tol=1e-4)
    llm.llm_engine.shutdown()


@pytest.mark.parametrize("fmt", ["mistral", "auto"])  # auto: no config.json, so params.json
def test_native_mistral_serves_like_hf(mistral_dirs, fmt):
    _assert_serves_like_hf(*mistral_dirs, config_format=fmt, load_format=fmt)


def test_native_mixtral_with_tied_embeddings_serves_like_hf(tmp_path):
    hf_dir = write_tiny_model(tmp_path / "hf", "mixtral", seed=1, tie_word_embeddings=True)
    native = write_native(hf_dir, tmp_path / "native")
    params = json.loads((native / "params.json").read_text())
    assert "moe" in params and params["tied_embeddings"]
    _assert_serves_like_hf(hf_dir, native, config_format="mistral", load_format="mistral")


def test_weights_and_config_equal_the_hf_checkpoint(mistral_dirs):
    hf_dir, native = mistral_dirs
    assert_native_weights_are_hf(hf_dir, native)
    ours, theirs = mistral_hf_config(native), load_hf_config(resolve_model(hf_dir))
    for field in ("hidden_size", "num_key_value_heads", "head_dim", "sliding_window"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.rope_parameters == theirs.rope_parameters
    assert ours.architectures == theirs.architectures == ["MistralForCausalLM"]


def test_auto_takes_params_json_only_without_config_json(mistral_dirs, tmp_path):
    hf_dir, native = mistral_dirs
    resolved = resolve_model(native)  # a dir with params.json and no config.json resolves
    assert load_hf_config(resolved).model_type == "mistral"
    assert weights_format(resolved) == "mistral"
    both = tmp_path / "both"
    shutil.copytree(native, both)
    for name in _HF_ONLY:
        shutil.copy(hf_dir / name, both / name)
    (both / "params.json").write_text('{"dim": 1}')  # "auto" must not read it
    resolved = resolve_model(both)
    assert load_hf_config(resolved).hidden_size == 64
    assert weights_format(resolved) == "safetensors"  # HF-named weights first; only them
    assert sorted(dict(iter_weights(resolved)).keys()) == sorted(load_file(hf_dir / _HF_ONLY[1]))


def _params_with(native: Path, out: Path, **fields) -> Path:
    shutil.copytree(native, out)
    params = {**json.loads((native / "params.json").read_text()), **fields}
    (out / "params.json").write_text(json.dumps(params))
    return out


def test_refusals_name_what_they_refuse(mistral_dirs, tmp_path):
    _, native = mistral_dirs
    for name in ("config_format", "load_format"):
        with pytest.raises(ValueError, match=name):
            EngineConfig(model=str(native), **{name: "mistal"})
    # an incomplete vision section (mistral_vision.py maps complete ones) names what is missing
    vision = _params_with(native, tmp_path / "v", vision_encoder={"hidden_size": 8})
    with pytest.raises(ValueError, match=r"vision_encoder\.num_attention_heads is missing"):
        load_hf_config(resolve_model(vision), config_format="mistral")
    unknown = _params_with(native, tmp_path / "u", lora={"rank": 8})
    with pytest.raises(ValueError, match="'lora'"):
        load_hf_config(resolve_model(unknown))
    missing = tmp_path / "missing"
    shutil.copytree(native, missing)
    (missing / "consolidated.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"load_format='mistral'.*consolidated"):
        LLM(model=str(missing), dtype="float32", max_model_len=64, load_format="mistral")


def test_yarn_and_layer_pattern_map_as_vllm_does(mistral_dirs, tmp_path):
    _, native = mistral_dirs
    yarn = {"factor": 4.0, "original_max_position_embeddings": 32, "beta": 32, "alpha": 1}
    path = _params_with(native, tmp_path / "y", yarn=yarn, sliding_window=[16, None])
    config = mistral_hf_config(path)
    assert config.rope_parameters["rope_type"] == "yarn"
    assert config.rope_parameters["beta_fast"] == 32.0 and config.rope_parameters["factor"] == 4.0
    assert config.sliding_window == 16
    assert config.layer_types == ["sliding_attention", "full_attention"]
    bad = _params_with(native, tmp_path / "b", yarn={**yarn, "mystery": 1})
    with pytest.raises(ValueError, match="mystery"):
        mistral_hf_config(bad)


def test_hub_fetches_one_copy_of_the_weights(mistral_dirs, tmp_path, monkeypatch):
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.utils import filter_repo_objects

    hf_dir, native = mistral_dirs
    repo = tmp_path / "repo"  # a Mistral release: both formats
    shutil.copytree(native, repo)
    for name in _HF_ONLY:
        shutil.copy(hf_dir / name, repo / name)

    def snapshot_download(repo_id, allow_patterns, ignore_patterns, **kw) -> str:
        out = tmp_path / f"snap{len(list(tmp_path.glob('snap*')))}"
        out.mkdir()
        names = [p.name for p in repo.iterdir()]
        for name in filter_repo_objects(
            names, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns
        ):
            shutil.copy(repo / name, out / name)
        return str(out)

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    files = {p.name for p in resolve_model("org/m").path.iterdir()}
    assert "model.safetensors" in files and "consolidated.safetensors" not in files
    files = {p.name for p in resolve_model("org/m", mistral=True).path.iterdir()}
    assert {"consolidated.safetensors", "params.json", "tokenizer.json"} <= files
    assert "model.safetensors" not in files


def test_server_flags_reach_the_engine(mistral_dirs):
    from paged_server.cli import build_engine, parse_args

    _, native = mistral_dirs
    flags = ["--config-format", "mistral", "--load-format", "mistral", "--dtype", "float32"]
    engine = build_engine(parse_args([str(native), *flags, "--max-model-len", "64"]))
    try:
        assert engine.config.config_format == engine.config.load_format == "mistral"
        assert engine.hf_config.architectures == ["MistralForCausalLM"]
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match="load_format"):
        build_engine(parse_args([str(native), "--load-format", "mistal"]))
