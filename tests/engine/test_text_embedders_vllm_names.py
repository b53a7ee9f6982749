"""Text embedders under vLLM's embedding-registry names: `RobertaForMaskedLM` served as its
encoder (models/bert.py), `BertSpladeSparseEmbeddingModel` (models/splade.py),
`LlamaBidirectionalModel` (models/llama_bidirectional.py) and `GritLM` (models/gritlm.py).

Reference: transformers' own classes on the same tiny random weights in float32
(`RobertaForMaskedLM`'s last hidden state; `BertForMaskedLM`'s MLM logits, pooled by SPLADE's
rule here in torch: max over tokens of log(1 + relu(logits)), without a leading [CLS] and a
trailing [SEP] when config.json names their ids; `LlamaModel` / `MistralModel` run with a full
4-D mask, i.e. non-causal, mean / CLS pooled as the config or GritLM's instruction rule says).
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from hf_parity import write_hf_checkpoint
from safetensors import safe_open

from paged_engine import LLM, PoolingParams, SamplingParams
from paged_engine.models.gritlm import TOKENS
from paged_engine.testing import (
    BOS_ID,
    EOS_ID,
    build_tiny_tokenizer,
    tiny_config,
    write_tiny_encoder,
)

# [CLS] text [SEP] (the tiny tokenizer's BOS / EOS stand for them), one without either, and
# [CLS] [SEP] alone (nothing left to pool when the ids are declared)
PROMPTS = [[BOS_ID, *range(5, 40), EOS_ID], [BOS_ID, 5, 6, 7, EOS_ID], list(range(50, 71))]
SPLADE_PROMPTS = [*PROMPTS, [BOS_ID, EOS_ID]]
KW = {"device": "cpu", "dtype": "float32", "num_gpu_blocks_override": 64, "max_model_len": 64}
SPLADE = {"architectures": ["BertSpladeSparseEmbeddingModel"]}


def test_roberta_masked_lm_embeds_as_its_encoder(tmp_path) -> None:
    path = write_tiny_encoder(tmp_path / "r", "RobertaForMaskedLM")
    model = transformers.RobertaForMaskedLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(model=str(path), **KW)
    outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    for out, p in zip(outs, PROMPTS, strict=True):
        with torch.no_grad():
            h = model(torch.tensor([p]), output_hidden_states=True).hidden_states[-1][0]
        want = torch.nn.functional.normalize(h[0], dim=-1)  # vLLM's default: [CLS], normalized
        assert out.outputs.embedding == pytest.approx(want.tolist(), abs=1e-4)


def splade_reference(path, prompts: list[list[int]], cls_id, sep_id) -> list[torch.Tensor]:
    model = transformers.BertForMaskedLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for p in prompts:
        with torch.no_grad():
            logits = model(torch.tensor([p])).logits[0]
        lo = int(cls_id is not None and p[0] == cls_id)
        hi = len(p) - int(sep_id is not None and p[-1] == sep_id)
        rows = torch.log1p(torch.relu(logits[lo:hi]))
        out.append(rows.max(0).values if hi > lo else torch.zeros(logits.shape[-1]))
    return out


@pytest.mark.parametrize("declared", [True, False])
def test_splade_matches_bert_masked_lm(tmp_path, declared) -> None:
    ids = {} if declared else {"cls_token_id": None, "sep_token_id": None}
    path = write_tiny_encoder(tmp_path / "s", "BertForMaskedLM", **ids)
    # a BERT tokenizer names [CLS] / [SEP]: the ids left out are still only config.json's
    tok = json.loads((path / "tokenizer_config.json").read_text())
    tok |= {"cls_token": tok["bos_token"], "sep_token": tok["eos_token"]}
    (path / "tokenizer_config.json").write_text(json.dumps(tok))
    saved = json.loads((path / "config.json").read_text())
    with safe_open(str(path / "model.safetensors"), "pt") as f:  # tied: the word embedding
        names = set(f.keys())
    assert "cls.predictions.bias" in names and "cls.predictions.decoder.weight" not in names
    cls_id, sep_id = saved.get("cls_token_id"), saved.get("sep_token_id")
    assert (cls_id, sep_id) == ((BOS_ID, EOS_ID) if declared else (None, None))
    want = splade_reference(path, SPLADE_PROMPTS, cls_id, sep_id)
    llm = LLM(model=str(path), hf_overrides=SPLADE, max_num_batched_tokens=64, **KW)
    outs = llm.embed([{"prompt_token_ids": p} for p in SPLADE_PROMPTS], use_tqdm=False)
    for out, w in zip(outs, want, strict=True):
        assert len(out.outputs.embedding) == 512  # the vocabulary, not normalized
        assert out.outputs.embedding == pytest.approx(w.tolist(), abs=1e-4)
    assert any(v > 0 for v in outs[0].outputs.embedding)
    if declared:
        assert not any(outs[-1].outputs.embedding)  # [CLS] [SEP] alone: zeros
    else:
        # the ids dropped or not change the vector: the test can tell them apart
        other = splade_reference(path, SPLADE_PROMPTS[:1], BOS_ID, EOS_ID)[0]
        assert not torch.allclose(other, want[0], atol=1e-4)
        with pytest.raises(ValueError, match="task='token_embed' is not supported"):
            llm.encode([{"prompt_token_ids": PROMPTS[1]}], pooling_task="token_embed")
        raw = llm.embed([PROMPTS[1]], PoolingParams(normalize=True), use_tqdm=False)
        norm = torch.nn.functional.normalize(want[1], dim=-1)
        assert raw[0].outputs.embedding == pytest.approx(norm.tolist(), abs=1e-4)
        # `dimensions` is checked against the vocabulary-wide vector, not the hidden size
        same = llm.embed([PROMPTS[1]], PoolingParams(dimensions=512), use_tqdm=False)
        assert same[0].outputs.embedding == pytest.approx(want[1].tolist(), abs=1e-4)
        with pytest.raises(ValueError, match="dimensions=32 is not supported"):
            llm.embed([PROMPTS[1]], PoolingParams(dimensions=32), use_tqdm=False)


def test_plain_bert_masked_lm_is_refused_by_name(tmp_path) -> None:
    path = write_tiny_encoder(tmp_path / "m", "BertForMaskedLM")
    with pytest.raises(ValueError, match="unsupported model architecture: BertForMaskedLM"):
        LLM(model=str(path), **KW)


def write_llama_bidirectional(path, pooling: str | None = "avg") -> tuple:
    """HF's tiny LlamaModel saved headless, its config.json rewritten as the nemotron embed
    releases have it (remote model type, auto_map, `pooling`); returns the path and the HF
    model for reference."""
    config = tiny_config("llama", tie_word_embeddings=False)
    path = write_hf_checkpoint(path, transformers.LlamaModel, config)
    model = transformers.LlamaModel.from_pretrained(path, dtype=torch.float32).eval()
    raw = json.loads((path / "config.json").read_text())
    raw |= {
        "architectures": ["LlamaBidirectionalModel"],
        "model_type": "llama_bidirec",
        "auto_map": {
            "AutoConfig": "llama_bidirectional_model.LlamaBidirectionalConfig",
            "AutoModel": "llama_bidirectional_model.LlamaBidirectionalModel",
        },
        "temperature": 1.0,
    }
    if pooling is not None:
        raw["pooling"] = pooling
    (path / "config.json").write_text(json.dumps(raw))
    return path, model


@torch.no_grad()
def bidirectional_hidden(model, prompt: list[int], causal: bool = False) -> torch.Tensor:
    """HF Llama's last hidden state with a full (non-causal) 4-D mask: the remote class's."""
    n = len(prompt)
    mask = None if causal else torch.zeros(1, 1, n, n)  # additive: every key visible
    return model(torch.tensor([prompt]), attention_mask=mask).last_hidden_state[0]


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory):
    return write_llama_bidirectional(tmp_path_factory.mktemp("llama_bidirec"))


def test_llama_bidirectional_matches_hf_with_a_full_mask(nemotron) -> None:
    path, model = nemotron
    llm = LLM(model=str(path), max_num_batched_tokens=64, **KW)
    assert llm.llm_engine.config.pooler_config == {"normalize": True, "pooling_type": "MEAN"}
    outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    for out, p in zip(outs, PROMPTS, strict=True):
        h = bidirectional_hidden(model, p)
        want = torch.nn.functional.normalize(h.mean(0), dim=-1)  # pooling "avg"
        assert out.outputs.embedding == pytest.approx(want.tolist(), abs=1e-4)
    # the causal model's first token differs: the test tells the two attentions apart
    causal = bidirectional_hidden(model, PROMPTS[0], causal=True)
    assert not torch.allclose(causal[0], bidirectional_hidden(model, PROMPTS[0])[0], atol=1e-3)
    rows = llm.encode([{"prompt_token_ids": PROMPTS[1]}], pooling_task="token_embed")
    want = torch.nn.functional.normalize(bidirectional_hidden(model, PROMPTS[1]), dim=-1)
    torch.testing.assert_close(rows[0].outputs.data, want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="does not generate"):
        llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(max_tokens=2), use_tqdm=False)


def test_llama_bidirectional_pooling_follows_the_config(tmp_path, nemotron) -> None:
    path, model = nemotron
    raw = json.loads((path / "config.json").read_text())
    other = tmp_path / "cls"
    other.mkdir()
    for f in path.iterdir():
        if f.is_file():
            (other / f.name).write_bytes(f.read_bytes())
    (other / "config.json").write_text(json.dumps(raw | {"pooling": "cls"}))
    out = LLM(model=str(other), **KW).embed([PROMPTS[0]], use_tqdm=False)[0]
    want = torch.nn.functional.normalize(bidirectional_hidden(model, PROMPTS[0])[0], dim=-1)
    assert out.outputs.embedding == pytest.approx(want.tolist(), abs=1e-4)
    with pytest.raises(ValueError, match="pooling_type 'LAST' is not supported"):
        LLM(model=str(other), pooler_config={"pooling_type": "LAST"}, **KW)
    (other / "config.json").write_text(json.dumps(raw | {"pooling": "weighted_avg"}))
    with pytest.raises(ValueError, match="field 'pooling'='weighted_avg'"):
        LLM(model=str(other), **KW)


@pytest.fixture(scope="module")
def gritlm(tmp_path_factory):
    """A tiny Mistral saved as GritLM (its LM head too), with a tokenizer holding the tokens of
    GritLM's instruction patterns; the window (8) is shorter than the prompts, and ignored."""
    path = tmp_path_factory.mktemp("gritlm")
    tok = build_tiny_tokenizer()
    tok.add_tokens(["<s>", "▁<", "<0x0A>", "embed", "user"])
    config = tiny_config("mistral", vocab_size=len(tok), sliding_window=8)
    path = write_hf_checkpoint(path, transformers.MistralForCausalLM, config)
    model = transformers.MistralModel.from_pretrained(path, dtype=torch.float32).eval()
    tok.save_pretrained(path)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(raw | {"architectures": ["GritLM"]}))
    ids = dict(zip(TOKENS, tok.convert_tokens_to_ids(list(TOKENS)), strict=True))
    assert all(i < len(tok) for i in ids.values())
    return path, model, ids


def test_gritlm_pools_after_the_instruction(gritlm) -> None:
    path, model, t = gritlm
    s, lt, bar, gt, nl = t["<s>"], t["▁<"], t["|"], t[">"], t["<0x0A>"]
    user = [lt, bar, t["user"], bar, gt, nl]
    embed = [lt, bar, t["embed"], bar, gt, nl]
    embed_nl = [nl, t["<"], bar, t["embed"], bar, gt, nl]
    text = list(range(40, 60))
    # (prompt, instruction length): "<|user|>\nINSTR\n<|embed|>\nTEXT", "<|embed|>\nTEXT",
    # "<s>" without a pattern (the "<s>" alone), no "<s>" (nothing)
    cases = [
        ([s, *user, 20, 21, 22, *embed_nl, *text], 1 + 6 + 3 + 7),
        ([s, *embed, *text[:9]], 1 + 6),
        ([s, *text], 1),
        (text[:12], 0),
    ]
    llm = LLM(model=str(path), max_num_batched_tokens=64, **KW)
    outs = llm.embed([{"prompt_token_ids": p} for p, _ in cases], use_tqdm=False)
    for out, (p, skip) in zip(outs, cases, strict=True):
        h = bidirectional_hidden(model, p)
        want = torch.nn.functional.normalize(h[skip:].mean(0), dim=-1)
        assert out.outputs.embedding == pytest.approx(want.tolist(), abs=1e-4)
        # the instruction matters: the whole prompt's mean differs
        if skip:
            whole = torch.nn.functional.normalize(h.mean(0), dim=-1)
            assert not torch.allclose(whole, want, atol=1e-3)
    with pytest.raises(ValueError, match="task='token_embed' is not supported"):
        llm.encode([{"prompt_token_ids": text}], pooling_task="token_embed")
    with pytest.raises(ValueError, match="GritLM's embedding model"):
        llm.generate([{"prompt_token_ids": text}], SamplingParams(max_tokens=2), use_tqdm=False)
