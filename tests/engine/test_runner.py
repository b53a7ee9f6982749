"""vLLM's runner / convert / task options (runner.py): which requests an engine serves, and a
causal checkpoint served as its sequence classifier."""

from __future__ import annotations

import pytest
import torch

from paged_engine import LLM, SamplingParams
from paged_engine.testing import write_tiny_classifier, write_tiny_model

KW = {"device": "cpu", "dtype": "float32", "num_gpu_blocks_override": 64, "max_model_len": 128}


@pytest.fixture(scope="module")
def causal(tmp_path_factory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("lm"), "qwen3"))


@pytest.mark.parametrize("opts", [{"runner": "pooling"}, {"task": "embed"}, {"convert": "embed"}])
def test_a_pooling_engine_embeds_and_refuses_generation(causal, opts) -> None:
    llm = LLM(model=causal, **opts, **KW)
    both = LLM(model=causal, **KW)  # auto: a decoder does both
    got = llm.embed([[5, 6, 7]], use_tqdm=False)[0].outputs.embedding
    assert got == pytest.approx(both.embed([[5, 6, 7]], use_tqdm=False)[0].outputs.embedding)
    with pytest.raises(ValueError, match="runner='pooling'"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(both.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False)) == 1


@pytest.mark.parametrize("opts", [{"runner": "generate"}, {"task": "generate"}])
def test_a_generate_engine_refuses_pooling(causal, opts) -> None:
    llm = LLM(model=causal, **opts, **KW)
    with pytest.raises(ValueError, match="runner='generate'"):
        llm.embed([[5, 6, 7]], use_tqdm=False)
    out = llm.generate([[5, 6]], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_convert_classify_serves_a_causal_lm_as_a_reranker(causal) -> None:
    """convert="classify" plus the from-token override gives the same scores as naming the
    *ForSequenceClassification architecture in the override."""
    tokens = LLM(model=causal, **KW).get_tokenizer().convert_ids_to_tokens([10, 11])
    rows = {"classifier_from_token": tokens, "method": "from_2_way_softmax"}
    by_convert = LLM(model=causal, convert="classify", hf_overrides=rows, **KW)
    arch = {"architectures": ["Qwen3ForSequenceClassification"], **rows}
    by_arch = LLM(model=causal, hf_overrides=arch, **KW)
    pairs = ([[5, 6, 7], [1, 2]], [[8, 9], [3, 4, 5]])
    a = [o.outputs.score for o in by_convert.score(*pairs, use_tqdm=False)]
    b = [o.outputs.score for o in by_arch.score(*pairs, use_tqdm=False)]
    assert a == b and by_convert.llm_engine.serves == "pooling"
    # task="score" is the same option in vLLM's older spelling
    by_task = LLM(model=causal, task="score", hf_overrides=rows, **KW)
    assert [o.outputs.score for o in by_task.score(*pairs, use_tqdm=False)] == a
    # without a head to build, the checkpoint lacks score.weight
    with pytest.raises(ValueError, match=r"score\.weight"):
        LLM(model=causal, convert="classify", **KW)


def test_convert_classify_keeps_a_classifier_and_bad_options_are_named(tmp_path, causal) -> None:
    path = write_tiny_classifier(tmp_path / "c", "llama", num_labels=2)
    plain = LLM(model=str(path), **KW).classify([[5, 6]], use_tqdm=False)[0].outputs.probs
    converted = LLM(model=str(path), convert="classify", **KW)
    assert converted.classify([[5, 6]], use_tqdm=False)[0].outputs.probs == plain
    for opts, name in (
        ({"runner": "generate"}, "runner"),
        ({"task": "reward"}, "task"),
        ({"convert": "mean"}, "convert"),
        ({"task": "embed", "runner": "generate"}, "task"),
    ):
        with pytest.raises(ValueError, match=name):
            LLM(model=str(path), **opts, **KW)
    assert torch.tensor(plain).sum().item() == pytest.approx(1.0, abs=1e-6)
