"""Encoder token classifiers (models/bert.py `TokenClassifierHead`, models/modernbert.py
`ModernBertForTokenClassification`): NER / POS taggers served as vLLM serves them, task
"token_classify", one row of label probabilities per prompt token. References: transformers'
`*ForTokenClassification` on the same weights (softmax of its logits per token)."""

from __future__ import annotations

import pytest
import torch

from paged_engine import LLM, PoolingParams, SamplingParams
from paged_engine.testing import BOS_ID, EOS_ID, write_tiny_encoder

# [CLS] text [SEP] prompts of different lengths (the tiny tokenizer's BOS / EOS ids stand for
# them), batched in one step; the last is a text pair, whose BERT token types turn 1 after the
# first [SEP]
PAIR = [BOS_ID, 10, 11, EOS_ID, 12, 13, 14, EOS_ID]
PROMPTS = [[BOS_ID, *range(5, 30), EOS_ID], [BOS_ID, 5, 6, 7, EOS_ID], [BOS_ID, EOS_ID], PAIR]
LABELS = {0: "O", 1: "B-PER", 2: "I-PER", 3: "B-LOC", 4: "I-LOC"}
KW = {"device": "cpu", "dtype": "float32", "num_gpu_blocks_override": 64}
# ModernBERT with a window (4 each side) shorter than the long prompt: a global layer, then a
# windowed one
MODERNBERT = {"local_attention": 8, "num_hidden_layers": 2, "classifier_pooling": "mean"}
ARCHS = ["BertForTokenClassification", "XLMRobertaForTokenClassification"]
ARCHS += ["ModernBertForTokenClassification"]


def _hf_logits(model, arch: str, ids: list[int]) -> torch.Tensor:
    """HF's [T, labels] logits; BERT's token types as its tokenizer gives a pair."""
    extra = {}
    if arch.startswith("Bert"):
        sep = ids.index(EOS_ID)
        extra["token_type_ids"] = torch.tensor([[0] * (sep + 1) + [1] * (len(ids) - sep - 1)])
    with torch.no_grad():
        return model(torch.tensor([ids]), **extra).logits[0]


@pytest.fixture(scope="module", params=ARCHS)
def tagger(request, tmp_path_factory):
    import transformers

    arch = request.param
    extra = MODERNBERT if "Modern" in arch else {}
    path = write_tiny_encoder(
        tmp_path_factory.mktemp(arch), arch, num_labels=len(LABELS), id2label=LABELS, **extra
    )
    model = getattr(transformers, arch).from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(model=str(path), max_model_len=64, **KW)
    return arch, model, llm


def test_token_classify_rows_match_hf_softmax_per_token(tagger) -> None:
    arch, model, llm = tagger
    info = llm.llm_engine.classifier
    assert info.per_token and info.labels == tuple(LABELS.values())
    assert not info.head_after_pooling  # ModernBERT's classifier_pooling is not read
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    named = llm.encode(prompts, pooling_task="token_classify", use_tqdm=False)
    default = llm.encode(prompts, use_tqdm=False)  # a token classifier's own task
    for out, own, p in zip(named, default, PROMPTS):
        want = _hf_logits(model, arch, p).softmax(-1)
        assert out.outputs.data.shape == (len(p), len(LABELS))
        torch.testing.assert_close(out.outputs.data, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(own.outputs.data, out.outputs.data)
    raw = llm.encode(PROMPTS[1], PoolingParams(use_activation=False), use_tqdm=False)[0]
    want = _hf_logits(model, arch, PROMPTS[1])
    torch.testing.assert_close(raw.outputs.data, want, atol=1e-5, rtol=1e-5)


def test_a_token_classifier_refuses_other_tasks_by_name(tagger) -> None:
    _, _, llm = tagger
    with pytest.raises(ValueError, match="token classifier"):
        llm.generate([[BOS_ID, 5]], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="labels each token"):
        llm.classify([PROMPTS[1]], use_tqdm=False)
    with pytest.raises(ValueError, match="labels each token"):
        llm.score("a", "b", use_tqdm=False)
    with pytest.raises(ValueError, match="classifier"):
        llm.embed([PROMPTS[1]], use_tqdm=False)
    with pytest.raises(ValueError, match="token_embed"):
        llm.encode([PROMPTS[1]], pooling_task="token_embed", use_tqdm=False)
