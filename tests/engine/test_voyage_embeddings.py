"""`VoyageQwen3BidirectionalEmbedModel` (models/voyage.py): Voyage AI's Qwen3 embedders.

Reference: transformers' `Qwen3Model` on the same tiny random weights in float32, run with a full
(non-causal) 4-D mask, its last hidden state through the release's bias-free `linear` head,
mean-pooled and normalized in torch. The checkpoint is written in the release's layout: the
decoder under `model.`, the head as top-level `linear.weight`, `num_labels` its width.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from hf_parity import write_hf_checkpoint
from safetensors.torch import load_file, save_file

from paged_engine import LLM
from paged_engine.testing import tiny_config

PROMPTS = [list(range(5, 40)), [5, 6, 7], list(range(50, 71))]
KW = {"device": "cpu", "dtype": "float32", "num_gpu_blocks_override": 64, "max_model_len": 64}
WIDTH = 48  # num_labels: the embedding width, unlike hidden (64)


def write_voyage(path: Path) -> tuple[Path, transformers.Qwen3Model, torch.Tensor]:
    """A tiny Qwen3Model saved in the Voyage layout: (dir, the HF model, the head [WIDTH, 64])."""
    config = tiny_config("qwen3", tie_word_embeddings=False)
    path = write_hf_checkpoint(path, transformers.Qwen3Model, config)
    model = transformers.Qwen3Model.from_pretrained(path, dtype=torch.float32).eval()
    weights = {"model." + k: v for k, v in load_file(path / "model.safetensors").items()}
    head = torch.randn(WIDTH, config.hidden_size, generator=torch.Generator().manual_seed(3))
    save_file({**weights, "linear.weight": head * 0.2}, path / "model.safetensors")
    raw = json.loads((path / "config.json").read_text())
    raw |= {"architectures": ["VoyageQwen3BidirectionalEmbedModel"], "num_labels": WIDTH}
    raw.pop("id2label", None), raw.pop("label2id", None)
    (path / "config.json").write_text(json.dumps(raw))
    return path, model, head * 0.2


@torch.no_grad()
def voyage_reference(model, head: torch.Tensor, prompt: list[int], causal=False) -> torch.Tensor:
    """Bidirectional Qwen3, the linear head on every row, mean pooled, normalized."""
    n = len(prompt)
    mask = None if causal else torch.zeros(1, 1, n, n)  # additive: every key visible
    h = model(torch.tensor([prompt]), attention_mask=mask).last_hidden_state[0]
    return torch.nn.functional.normalize((h @ head.T).mean(0), dim=-1)


@pytest.fixture(scope="module")
def voyage(tmp_path_factory):
    return write_voyage(tmp_path_factory.mktemp("voyage"))


def test_voyage_matches_bidirectional_qwen3(voyage) -> None:
    path, model, head = voyage
    llm = LLM(model=str(path), max_num_batched_tokens=64, **KW)
    assert llm.llm_engine.config.pooler_config == {"pooling_type": "MEAN", "normalize": True}
    outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    for out, p in zip(outs, PROMPTS, strict=True):
        want = voyage_reference(model, head, p)
        assert len(out.outputs.embedding) == WIDTH
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), want, atol=1e-5, rtol=0)
    # the causal model differs: the test tells the two attentions apart
    causal = voyage_reference(model, head, PROMPTS[0], causal=True)
    assert not torch.allclose(causal, voyage_reference(model, head, PROMPTS[0]), atol=1e-3)
    # the server's /v1/embeddings over the same engine
    from server.server_proc import COMMON_ARGS, serve_in_process

    try:
        with serve_in_process(COMMON_ARGS, llm.llm_engine) as (http, _):
            body = {"model": "tiny", "input": PROMPTS[1], "encoding_format": "float"}
            status, _, r = http.request("POST", "/v1/embeddings", body)
            assert status == 200, r
            got = torch.tensor(r["data"][0]["embedding"])
            want = voyage_reference(model, head, PROMPTS[1])
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    finally:
        llm.llm_engine.shutdown()


def test_voyage_refuses_a_sliding_window(tmp_path, voyage) -> None:
    path = voyage[0]
    for f in path.iterdir():
        if f.is_file():
            (tmp_path / f.name).write_bytes(f.read_bytes())
    raw = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(raw | {"use_sliding_window": True}))
    with pytest.raises(ValueError, match="'use_sliding_window'=true is not supported"):
        LLM(model=str(tmp_path), **KW)
