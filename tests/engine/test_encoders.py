"""Encoder-only models (models/bert.py, engine/encoder.py): BERT and XLM-RoBERTa embeddings and
classifiers / cross-encoders against transformers' own classes on the same weights."""

from __future__ import annotations

import json

import pytest
import torch

from paged_engine import LLM, PoolingParams, SamplingParams
from paged_engine.testing import BOS_ID, EOS_ID, write_tiny_encoder

# [CLS] text [SEP] prompts (the tiny tokenizer's BOS / EOS ids stand for them); none holds a
# [SEP] inside, as a tokenizer never puts one there.
PROMPTS = [
    [BOS_ID, *range(5, 40), EOS_ID],
    [BOS_ID, 5, 6, 7, EOS_ID],
    [BOS_ID, *range(50, 71), EOS_ID],
]
KW = {"device": "cpu", "dtype": "float32", "num_gpu_blocks_override": 64}


def hf(path, arch: str):
    import transformers

    return getattr(transformers, arch).from_pretrained(path, dtype=torch.float32).eval()


# ModernBERT with a window (4 each side) shorter than the long prompt, and 3 layers: a global
# one, then two windowed ones, each type with its own rope theta
MODERNBERT = {"local_attention": 8, "num_hidden_layers": 3}


@pytest.mark.parametrize("arch", ["BertModel", "XLMRobertaModel", "ModernBertModel"])
def test_embeddings_match_hf(tmp_path, arch) -> None:
    path = write_tiny_encoder(tmp_path / arch, arch, **(MODERNBERT if "Modern" in arch else {}))
    model = hf(path, arch)
    # small token budget: several steps, each sequence whole in one of them
    llm = LLM(model=str(path), max_num_batched_tokens=64, max_model_len=64, **KW)
    assert llm.llm_engine.config.enable_chunked_prefill is False
    assert llm.llm_engine.model_runner.cache.kv_caches == []  # no KV memory at all
    outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    with torch.no_grad():
        hidden = [model(torch.tensor([p])).last_hidden_state[0] for p in PROMPTS]
    for out, h in zip(outs, hidden):  # default: [CLS], normalized
        want = torch.nn.functional.normalize(h[0], dim=-1)
        assert out.outputs.embedding == pytest.approx(want.tolist(), abs=1e-5)
    mean = LLM(model=str(path), pooler_config={"pooling_type": "MEAN"}, **KW)
    raw = PoolingParams(normalize=False)
    for out, h in zip(mean.embed(PROMPTS, use_tqdm=False, pooling_params=raw), hidden):
        assert out.outputs.embedding == pytest.approx(h.mean(0).tolist(), abs=1e-5)


def test_sentence_transformers_files_choose_the_pooling(tmp_path) -> None:
    path = write_tiny_encoder(tmp_path / "st", "BertModel")
    (path / "modules.json").write_text(
        json.dumps(
            [
                {
                    "idx": 0,
                    "name": "0",
                    "path": "",
                    "type": "sentence_transformers.models.Transformer",
                },
                {
                    "idx": 1,
                    "name": "1",
                    "path": "1_Pooling",
                    "type": "sentence_transformers.models.Pooling",
                },
                {
                    "idx": 2,
                    "name": "2",
                    "path": "2_Normalize",
                    "type": "sentence_transformers.models.Normalize",
                },
            ]
        )
    )
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(
        json.dumps({"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True})
    )
    llm = LLM(model=str(path), **KW)
    assert llm.llm_engine.config.pooler_config == {"pooling_type": "MEAN", "normalize": True}
    with torch.no_grad():
        h = hf(path, "BertModel")(torch.tensor([PROMPTS[0]])).last_hidden_state[0]
    want = torch.nn.functional.normalize(h.mean(0), dim=-1)
    got = llm.embed(PROMPTS[0], use_tqdm=False)[0].outputs.embedding
    assert got == pytest.approx(want.tolist(), abs=1e-5)


@pytest.mark.parametrize(
    ("arch", "num_labels"),
    [
        ("BertForSequenceClassification", 3),
        ("XLMRobertaForSequenceClassification", 1),
        ("ModernBertForSequenceClassification", 1),
    ],
)
def test_classifiers_and_cross_encoders_match_hf(tmp_path, arch, num_labels) -> None:
    extra = MODERNBERT if "Modern" in arch else {}
    path = write_tiny_encoder(tmp_path / arch, arch, num_labels=num_labels, **extra)
    model = hf(path, arch)
    llm = LLM(model=str(path), **KW)
    off = PoolingParams(use_activation=False)
    outs = llm.classify(PROMPTS, use_tqdm=False, pooling_params=off)
    for out, p in zip(outs, PROMPTS):
        with torch.no_grad():
            want = model(torch.tensor([p])).logits[0]
        assert out.outputs.probs == pytest.approx(want.tolist(), abs=1e-5)
    # a pair [CLS] a [SEP] b [SEP]: BERT's second segment has token type 1, as tokenizers give
    first, second = [BOS_ID, 10, 11, EOS_ID], [12, 13, 14, EOS_ID]
    ids = first + second
    types = {"token_type_ids": torch.tensor([[0] * 4 + [1] * 4])} if "Bert" in arch else {}
    with torch.no_grad():
        logits = model(torch.tensor([ids]), **types).logits[0]
    if num_labels == 1:  # a cross-encoder scores the pair: sigmoid of its logit
        got = llm.score([first], [second], use_tqdm=False)[0]
        assert got.prompt_token_ids == ids
        assert got.outputs.score == pytest.approx(logits.sigmoid().item(), abs=1e-5)
    else:
        got = llm.classify([ids], use_tqdm=False)[0].outputs.probs
        assert got == pytest.approx(logits.softmax(-1).tolist(), abs=1e-5)


def test_encoders_refuse_what_they_cannot_run(tmp_path) -> None:
    path = write_tiny_encoder(tmp_path / "r", "XLMRobertaModel")
    llm = LLM(model=str(path), **KW)
    # RoBERTa's positions start past the padding id: 130 - 2 - 1 of them
    assert llm.llm_engine.config.max_model_len == 127
    with pytest.raises(ValueError, match="encoder-only"):
        llm.generate([[BOS_ID, 5]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(llm.embed([[BOS_ID, 5, EOS_ID]], use_tqdm=False)) == 1
    for opts, name in (
        ({"max_model_len": 128}, "max_model_len"),
        ({"tensor_parallel_size": 2}, "tensor_parallel_size"),
        ({"runner": "generate"}, "runner"),
    ):
        with pytest.raises(ValueError, match=name):
            LLM(model=str(path), **opts, **KW)
    cls = write_tiny_encoder(tmp_path / "c", "BertForSequenceClassification", num_labels=2)
    with pytest.raises(ValueError, match="pooler_config"):
        LLM(model=str(cls), pooler_config={"pooling_type": "MEAN"}, **KW)
    from types import SimpleNamespace

    from paged_engine.models.modernbert import ModernBertForSequenceClassification

    with pytest.raises(ValueError, match="classifier_pooling"):  # transformers' own check too
        ModernBertForSequenceClassification.classifier_pooling_type(
            SimpleNamespace(classifier_pooling="max")
        )


def test_a_mean_pooled_modernbert_classifier_matches_hf(tmp_path) -> None:
    """ModernBERT's classifier_pooling="mean" (its base config's default): the non-linear head
    runs on the sequence's mean, which the worker pools first."""
    arch = "ModernBertForSequenceClassification"
    path = write_tiny_encoder(
        tmp_path / "mean", arch, num_labels=3, classifier_pooling="mean", **MODERNBERT
    )
    model = hf(path, arch)
    llm = LLM(model=str(path), max_num_batched_tokens=64, max_model_len=64, **KW)
    assert llm.llm_engine.config.pooler_config["pooling_type"] == "MEAN"
    for out, p in zip(llm.classify(PROMPTS, use_tqdm=False), PROMPTS):
        with torch.no_grad():
            want = model(torch.tensor([p])).logits[0].softmax(-1)
        assert out.outputs.probs == pytest.approx(want.tolist(), abs=1e-5)


def test_cls_pooling_on_a_decoder_pools_its_first_token(tmp_path) -> None:
    """pooler_config CLS works for any model: position 0's final hidden state, taken in the
    first of a chunked prompt's steps."""
    from transformers import AutoModelForCausalLM

    from paged_engine.testing import write_tiny_model

    path = write_tiny_model(tmp_path / "lm", "llama")
    llm = LLM(
        model=str(path),
        pooler_config={"pooling_type": "CLS", "normalize": False},
        max_num_batched_tokens=16,  # the 37-token prompt runs in 3 chunks
        max_model_len=128,
        **KW,
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for out, p in zip(llm.embed(PROMPTS, use_tqdm=False), PROMPTS):
        with torch.no_grad():
            want = model.base_model(torch.tensor([p])).last_hidden_state[0, 0]
        assert out.outputs.embedding == pytest.approx(want.tolist(), abs=1e-5)
