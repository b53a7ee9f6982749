"""Encoder-only models through the Transformers backend (models/transformers_backend/encoder.py):
HF's BERT / XLM-RoBERTa / ELECTRA code with paged's per-sequence bidirectional attention embeds
as HF's base model pools (CLS by default, MEAN as sentence-transformers files say; normalized)
and as paged's native encoders do; HF's own classification heads (BERT's pooler + classifier,
ELECTRA's dense + out_proj) give HF's probabilities and cross-encoder scores; ELECTRA, which
paged has no class for, is served by model_impl="auto"; what cannot run is refused by name."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from paged_engine import LLM, PoolingParams
from paged_engine.models.transformers_backend import check_transformers_config
from paged_engine.testing import BOS_ID, EOS_ID, write_tiny_encoder

# [CLS] text [SEP] prompts of different lengths, batched in one step; the last is a text pair
# (BERT's token types: 1 after the first [SEP])
PROMPTS = [
    [BOS_ID, *range(5, 40), EOS_ID],
    [BOS_ID, 5, 6, 7, EOS_ID],
    [BOS_ID, *range(50, 61), EOS_ID, *range(61, 66), EOS_ID],
]
KW = {"device": "cpu", "dtype": "float32", "num_gpu_blocks_override": 64, "max_model_len": 64}
ELECTRA = {"embedding_size": 16}  # ELECTRA's embeddings project 16 -> hidden 32


def _types(p: list[int], arch: str) -> torch.Tensor:
    """What a tokenizer gives: BERT's / ELECTRA's 1 after the first [SEP]; XLM-R's none."""
    sep = (torch.tensor(p) == EOS_ID).long()
    return ((torch.cumsum(sep, 0) - sep) > 0).long()[None] * ("Roberta" not in arch)


def _hf_outputs(path, arch: str, field: str) -> list[torch.Tensor]:
    model = getattr(transformers, arch).from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        outs = [model(torch.tensor([p]), token_type_ids=_types(p, arch)) for p in PROMPTS]
    return [getattr(o, field)[0] for o in outs]


def _hf_hidden(path, arch: str) -> list[torch.Tensor]:
    return _hf_outputs(path, arch, "last_hidden_state")


def _hf_logits(path, arch: str) -> list[torch.Tensor]:
    return _hf_outputs(path, arch, "logits")


def _model(llm: LLM):
    return llm.llm_engine.model_runner.model


def _embed(llm: LLM, **kw) -> list[torch.Tensor]:
    outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False, **kw)
    return [torch.tensor(o.outputs.embedding) for o in outs]


def _classify(llm: LLM, **kw) -> list[torch.Tensor]:
    outs = llm.classify([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False, **kw)
    return [torch.tensor(o.outputs.probs) for o in outs]


def _close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for g, w in zip(got, want, strict=True):
        assert torch.allclose(g, w, atol=1e-5), (g - w).abs().max()


@pytest.mark.parametrize("arch", ["BertModel", "XLMRobertaModel"])
def test_embeddings_match_hf_and_the_native_encoder(tmp_path, arch: str) -> None:
    path = write_tiny_encoder(tmp_path / arch, arch, seed=1)
    llm = LLM(str(path), model_impl="transformers", **KW)
    model = _model(llm)
    assert type(model).__name__ == "TransformersEncoderModel"
    assert type(model.get_submodule(model.inner_name)).__module__.startswith("transformers.")
    engine = llm.llm_engine
    assert engine.is_encoder and engine.config.enable_chunked_prefill is False
    assert engine.model_runner.cache.kv_caches == []  # no KV memory
    assert engine.config.pooler_config == {"pooling_type": "CLS", "normalize": True}
    hidden = _hf_hidden(path, arch)
    got = _embed(llm)
    _close(got, [torch.nn.functional.normalize(h[0], dim=-1) for h in hidden])
    native = LLM(str(path), **KW)
    assert not type(_model(native)).__name__.startswith("Transformers")
    _close(got, _embed(native))
    # XLM-R's positions start past pad_token_id: the same context limit as the native class
    limit = type(_model(native)).max_positions(engine.hf_config)
    assert type(model).max_positions(engine.hf_config) == limit
    raw = PoolingParams(normalize=False)
    mean = LLM(str(path), model_impl="transformers", pooler_config={"pooling_type": "MEAN"}, **KW)
    _close(_embed(mean, pooling_params=raw), [h.mean(0) for h in hidden])


def test_bert_classifier_matches_hf_and_the_native_class(tmp_path) -> None:
    arch = "BertForSequenceClassification"
    path = write_tiny_encoder(tmp_path / "cls", arch, num_labels=3, seed=2)
    llm = LLM(str(path), model_impl="transformers", **KW)
    assert type(_model(llm)).__name__ == "TransformersEncoderForSequenceClassification"
    logits = _hf_logits(path, arch)
    got = _classify(llm)
    _close(got, [x.softmax(-1) for x in logits])
    _close(_classify(llm, pooling_params=PoolingParams(use_activation=False)), logits)
    _close(got, _classify(LLM(str(path), **KW)))
    # vLLM's backend class name asks for the backend whatever model_impl says
    over = {"architectures": ["TransformersForSequenceClassification"]}
    named = LLM(str(path), model_impl="vllm", hf_overrides=over, **KW)
    assert type(_model(named)).__name__ == "TransformersEncoderForSequenceClassification"
    _close(_classify(named), got)


def _sentence_transformers_mean(path) -> None:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    pooling = {"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))


def test_auto_serves_an_encoder_paged_has_no_class_for(tmp_path) -> None:
    """ELECTRA: its embeddings pooled as its sentence-transformers files say (MEAN, not
    normalized), its cross-encoder (one label, HF's dense + out_proj head) scoring a pair;
    model_impl="vllm" refuses it."""
    path = write_tiny_encoder(tmp_path / "e", "ElectraModel", seed=3, **ELECTRA)
    _sentence_transformers_mean(path)
    llm = LLM(str(path), **KW)
    assert type(_model(llm)).__name__ == "TransformersEncoderModel"
    assert llm.llm_engine.config.pooler_config == {"pooling_type": "MEAN", "normalize": False}
    _close(_embed(llm), [h.mean(0) for h in _hf_hidden(path, "ElectraModel")])
    arch = "ElectraForSequenceClassification"
    path = write_tiny_encoder(tmp_path / "ce", arch, num_labels=1, seed=4, **ELECTRA)
    llm = LLM(str(path), **KW)
    assert type(_model(llm)).__name__ == "TransformersEncoderForSequenceClassification"
    _close(_classify(llm), [x.sigmoid() for x in _hf_logits(path, arch)])
    first, second = PROMPTS[2][:13], PROMPTS[2][13:]
    score = llm.score([first], [second], use_tqdm=False)[0]
    assert score.prompt_token_ids == PROMPTS[2]
    assert score.outputs.score == pytest.approx(
        _hf_logits(path, arch)[2].sigmoid().item(), abs=1e-5
    )
    with pytest.raises(ValueError, match="unsupported model architecture: ElectraForSequence"):
        LLM(str(path), model_impl="vllm", **KW)


def _bert(arch: str) -> transformers.BertConfig:
    return transformers.BertConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
        architectures=[arch],
    )  # fmt: skip


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (_bert("BertForTokenClassification"), "BertForTokenClassification: token classification"),
        (_bert("BertForMaskedLM"), "BertForMaskedLM: masked-LM heads"),
        (_bert("BertForQuestionAnswering"), "BertForQuestionAnswering: question answering"),
        (transformers.BartConfig(architectures=["BartModel"]), "encoder-decoder models"),
        (  # ModernBERT's local layers window through HF's mask, not the attention function
            transformers.ModernBertConfig(architectures=["ModernBertModel"]),
            "config.sliding_window=64: windowed encoders are not supported",
        ),
    ],
)
def test_encoders_it_cannot_run_are_refused_by_name(config, match: str) -> None:
    with pytest.raises(ValueError, match=f"model_impl='transformers': .*{match}"):
        check_transformers_config(config)


TINY = {"hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 64, "num_labels": 3}


@pytest.mark.parametrize(
    ("config", "match"),
    [
        # ALBERT's pooler is a bare linear layer (its tanh a sibling): the head reads [N, 1, D]
        (
            transformers.AlbertConfig(embedding_size=16, num_hidden_layers=1, **TINY),
            r"AlbertForSequenceClassification's head gives \(2, 1, 3\)",
        ),
        (
            transformers.DistilBertConfig(
                dim=32, n_heads=4, hidden_dim=64, n_layers=1, num_labels=3
            ),
            r"DistilBertForSequenceClassification has weights outside .*'pre_classifier'",
        ),
    ],
)
def test_classifier_heads_of_another_shape_are_refused_by_name(config, match: str) -> None:
    from paged_engine.models.transformers_backend import (
        TransformersEncoderForSequenceClassification,
    )

    config.architectures = [
        type(config).__name__.removesuffix("Config") + "ForSequenceClassification"
    ]
    with pytest.raises(ValueError, match=f"model_impl='transformers': {match}"):
        TransformersEncoderForSequenceClassification(config)
