"""EmbeddingGemma (`Gemma3TextModel`, `use_bidirectional_attention=True`:
models/gemma3_encoder.py) and sentence-transformers Dense modules (models/st_modules.py).

Reference: transformers' own `Gemma3TextModel` with bidirectional attention (its sliding layers
windowed both ways) on the same weights, and the sentence-transformers head written by the test
as EmbeddingGemma's release has it (mean pooling, 2_Dense, 3_Dense with Identity activations,
Normalize), run in torch on HF's `last_hidden_state` (sentence-transformers is not installed).
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from hf_parity import write_hf_checkpoint
from safetensors.torch import save_file

from paged_engine import LLM, PoolingParams, SamplingParams
from paged_engine.models import get_model_class
from paged_engine.testing import tiny_config

ST = "sentence_transformers.models."
IDENTITY = "torch.nn.modules.linear.Identity"
# 37 and 21 tokens: past the sliding layers' window (|i - j| <= 8 // 2) many times over
PROMPTS = [list(range(3, 40)), [5, 6, 7], list(range(50, 71)), [9]]
KW = {"device": "cpu", "dtype": "float32", "num_gpu_blocks_override": 64, "max_model_len": 128}


def write_st(path, pooling: str, dense: list[tuple[int, int, bool, str]], normalize=True) -> list:
    """sentence-transformers' files in `path`: Pooling (`pooling_mode_<pooling>`), one Dense
    module per (in, out, bias, activation) with random float32 weights (the odd ones as
    pytorch_model.bin), Normalize; returns the Dense modules' (weight, bias) pairs."""
    gen = torch.Generator().manual_seed(7)
    modules = [(ST + "Transformer", ""), (ST + "Pooling", "1_Pooling")]
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": dense[0][0] if dense else 0, pooling: True})
    )
    weights = []
    for i, (n_in, n_out, bias, act) in enumerate(dense):
        folder = path / f"{i + 2}_Dense"
        folder.mkdir(exist_ok=True)
        cfg = {"in_features": n_in, "out_features": n_out, "bias": bias}
        (folder / "config.json").write_text(json.dumps({**cfg, "activation_function": act}))
        w = torch.randn(n_out, n_in, generator=gen) * n_in**-0.5
        b = torch.randn(n_out, generator=gen) * 0.1 if bias else None
        state = {"linear.weight": w} | ({"linear.bias": b} if bias else {})
        if i % 2:
            torch.save(state, folder / "pytorch_model.bin")
        else:
            save_file(state, folder / "model.safetensors")
        modules.append((ST + "Dense", folder.name))
        weights.append((w, b))
    if normalize:
        modules.append((ST + "Normalize", f"{len(modules)}_Normalize"))
    entries = [{"idx": i, "name": str(i), "path": p, "type": t} for i, (t, p) in enumerate(modules)]
    (path / "modules.json").write_text(json.dumps(entries))
    return weights


def write_embedding_gemma(path, **overrides):
    """HF's tiny `Gemma3TextModel` with bidirectional attention, saved headless."""
    # query_pre_attn_scalar != head_dim: the attention's scale is Gemma's own
    config = tiny_config(
        "gemma3", use_bidirectional_attention=True, query_pre_attn_scalar=16, **overrides
    )
    path = write_hf_checkpoint(path, transformers.Gemma3TextModel, config)
    saved = json.loads((path / "config.json").read_text())
    assert saved["architectures"] == ["Gemma3TextModel"] and saved["sliding_window"] == 8
    return path


@torch.no_grad()
def hf_hidden(path, prompts: list[list[int]]) -> list[torch.Tensor]:
    model = transformers.AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    return [model(torch.tensor([p])).last_hidden_state[0] for p in prompts]


def st_head(rows: torch.Tensor, weights: list, act=lambda x: x) -> torch.Tensor:
    """sentence-transformers' Dense modules on pooled rows [N, D]."""
    for w, b in weights:
        rows = act(torch.nn.functional.linear(rows, w, b))
    return rows


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    path = write_embedding_gemma(tmp_path_factory.mktemp("embeddinggemma"))
    head = [(64, 96, False, IDENTITY), (96, 64, False, IDENTITY)]  # 2_Dense, 3_Dense
    dense = write_st(path, "pooling_mode_mean_tokens", head)
    return path, dense, hf_hidden(path, PROMPTS)


def test_embedding_gemma_matches_hf(gemma) -> None:
    """Mean pooling, 2_Dense, 3_Dense, Normalize, on prompts longer than the window, batched."""
    path, dense, hidden = gemma
    llm = LLM(str(path), **KW)
    outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    for out, h in zip(outs, hidden, strict=True):
        want = torch.nn.functional.normalize(st_head(h.mean(0, keepdim=True), dense)[0], dim=-1)
        assert out.outputs.embedding == pytest.approx(want.tolist(), abs=1e-4)
    # token_embed: every row through the Dense modules, each normalized (as vLLM)
    rows = llm.encode(
        [{"prompt_token_ids": PROMPTS[0]}], use_tqdm=False, pooling_task="token_embed"
    )
    want = torch.nn.functional.normalize(st_head(hidden[0], dense), dim=-1)
    torch.testing.assert_close(rows[0].outputs.data, want, atol=1e-4, rtol=1e-4)
    # an encoder: a generation request is refused
    with pytest.raises(ValueError, match="does not generate"):
        llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(max_tokens=2), use_tqdm=False)


def test_embedding_gemma_without_sentence_transformers_files(tmp_path, gemma) -> None:
    """No modules.json: the last token, normalized (vLLM's pooling of Gemma3TextModel)."""
    path, _, hidden = gemma
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in path.iterdir():
        if f.is_file() and f.name != "modules.json":
            (bare / f.name).write_bytes(f.read_bytes())
    outs = LLM(str(bare), **KW).embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    for out, h in zip(outs, hidden, strict=True):
        want = torch.nn.functional.normalize(h[-1], dim=-1)
        assert out.outputs.embedding == pytest.approx(want.tolist(), abs=1e-4)


def test_dense_modules_of_a_chunked_base_model(tmp_path) -> None:
    """Any embedder's Dense modules: a Mistral base model whose mean pooling adds up over
    chunked prefill, a biased Tanh Dense to a width of its own, no Normalize."""
    config = tiny_config("mistral")
    path = write_hf_checkpoint(tmp_path / "m", transformers.MistralModel, config)
    tanh = "torch.nn.modules.activation.Tanh"
    dense = write_st(path, "pooling_mode_mean_tokens", [(64, 48, True, tanh)], normalize=False)
    llm = LLM(str(path), max_num_batched_tokens=16, **KW)  # the 37-token prompt: 3 chunks
    outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    for out, h in zip(outs, hf_hidden(path, PROMPTS), strict=True):
        want = st_head(h.mean(0, keepdim=True), dense, torch.tanh)[0]
        assert len(out.outputs.embedding) == 48
        assert out.outputs.embedding == pytest.approx(want.tolist(), abs=1e-4)
    # the embedding's width is the Dense module's: `dimensions` is checked against it
    with pytest.raises(ValueError, match="dimensions=64"):
        llm.embed([{"prompt_token_ids": [5]}], PoolingParams(dimensions=64), use_tqdm=False)


def test_refusals_name_the_field(tmp_path, gemma) -> None:
    path, _, _ = gemma
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in path.iterdir():
        if f.is_file():
            (bad / f.name).write_bytes(f.read_bytes())
    softmax = "torch.nn.modules.activation.Softmax"
    write_st(bad, "pooling_mode_mean_tokens", [(64, 96, False, softmax)])
    with pytest.raises(ValueError, match=r"2_Dense/config.json: activation_function=.*Softmax"):
        LLM(str(bad), **KW)
    write_st(bad, "pooling_mode_mean_tokens", [(32, 96, False, IDENTITY)])
    with pytest.raises(ValueError, match=r"2_Dense/config.json: in_features=32"):
        LLM(str(bad), **KW)
    write_st(bad, "pooling_mode_mean_tokens", [(64, 96, False, IDENTITY)])
    (bad / "2_Dense" / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"2_Dense/config.json: no model.safetensors"):
        LLM(str(bad), **KW)
    # a module paged does not run (a base model's): refused by its type
    entries = json.loads((path / "modules.json").read_text())
    entries.insert(2, {"idx": 9, "name": "9", "path": "9_LayerNorm", "type": ST + "LayerNorm"})
    (bad / "modules.json").write_text(json.dumps(entries))
    with pytest.raises(ValueError, match=r"Gemma3TextModel.*LayerNorm.*9_LayerNorm"):
        LLM(str(bad), **KW)
    # bidirectional attention is read for Gemma 3's text model only (as vLLM): elsewhere refused
    bidi = tiny_config("gemma2", use_bidirectional_attention=True)
    bidi.architectures = ["Gemma2Model"]
    with pytest.raises(ValueError, match="Gemma2Model with use_bidirectional_attention"):
        get_model_class(bidi)


def test_a_dense_module_it_cannot_run_fails_only_embedding_requests(tmp_path) -> None:
    """A generative checkpoint whose sentence-transformers files list a Dense module paged
    cannot run: with runner "auto" it still generates and its embed requests are refused by
    name (the engine keeps serving); with runner "pooling" it does not start."""
    config = tiny_config("qwen2")
    path = write_hf_checkpoint(tmp_path / "q", transformers.Qwen2ForCausalLM, config)
    write_st(path, "pooling_mode_mean_tokens", [(config.hidden_size, 16, False, IDENTITY)])
    (path / "2_Dense" / "model.safetensors").unlink()
    llm = LLM(str(path), **KW)
    with pytest.raises(ValueError, match=r"params: 2_Dense/config.json: no model.safetensors"):
        llm.embed([{"prompt_token_ids": [5, 6]}], use_tqdm=False)
    (out,) = llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(max_tokens=3))
    assert len(out.outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match=r"2_Dense/config.json: no model.safetensors"):
        LLM(str(path), runner="pooling", **KW)
