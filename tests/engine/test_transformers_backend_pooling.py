"""Pooling through the Transformers modeling backend (models/transformers_backend/pooling.py): HF's
backbone with paged attention embeds as HF's own base model pools (its `last_hidden_state`: last
token, mean or first, L2-normalized) and as paged's own classes embed; HF's
`*ForSequenceClassification` heads give HF's logits through the activation paged picks (softmax,
sigmoid for one label), also on HF's own MoE blocks (Qwen3-MoE); an architecture paged has no
class for is served by model_impl="auto" (CTRL, whose head is `classifier`); vLLM's backend class
names chosen by hf_overrides are served; what cannot run is refused by name."""

from __future__ import annotations

import pytest
import torch
import transformers
from hf_parity import checkpoint_dirs, write_hf_checkpoint

from paged_engine import LLM, PoolingParams, SamplingParams
from paged_engine.models.transformers_backend import check_transformers_config
from paged_engine.testing import tiny_config, write_tiny_classifier, write_tiny_model

# the 37-token prompt prefills in three chunks; the others share cached blocks of 4 with it
PROMPTS = [list(range(3, 40)), [5, 6, 7], list(range(3, 20)) + [60, 61], [9]]
KW = {
    "dtype": "float32",
    "max_model_len": 128,
    "num_gpu_blocks_override": 64,
    "block_size": 4,
    "max_num_batched_tokens": 16,
}


def _write(path, name: str):
    kind, arch = name.split(":")
    if kind == "base":  # HF's headless <Stem>Model, saved without the decoder prefix
        config = tiny_config(arch) if arch != "ctrl" else _ctrl_config()
        cls = getattr(transformers, type(config).__name__.removesuffix("Config") + "Model")
        return write_hf_checkpoint(path, cls, config)
    if kind == "causal":
        return write_tiny_model(path, arch, seed=1)
    if arch == "ctrl":  # CTRLForSequenceClassification: its head is `classifier`
        config = _ctrl_config(num_labels=1, pad_token_id=0)
        return write_hf_checkpoint(path, transformers.CTRLForSequenceClassification, config)
    return write_tiny_classifier(path, arch, num_labels=3, seed=2)


def _ctrl_config(**fields) -> transformers.CTRLConfig:
    return transformers.CTRLConfig(
        vocab_size=512, n_positions=128, n_embd=32, dff=64, n_layer=2, n_head=4, **fields
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return checkpoint_dirs(tmp_path_factory, _write)


def _model(llm: LLM):
    return llm.llm_engine.model_runner.model


@torch.no_grad()
def _hf_pooled(path, pooling: str) -> list[torch.Tensor]:
    """HF's base model's last_hidden_state of each prompt, pooled, L2-normalized."""
    model = transformers.AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    rows = []
    for p in PROMPTS:
        h = model(torch.tensor([p])).last_hidden_state[0]
        h = {"LAST": h[-1], "MEAN": h.mean(0), "CLS": h[0]}[pooling]
        rows.append(torch.nn.functional.normalize(h, dim=-1))
    return rows


def _embed(llm: LLM) -> list[torch.Tensor]:
    outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    return [torch.tensor(o.outputs.embedding) for o in outs]


@pytest.mark.parametrize(
    ("name", "pooling", "served_as"),
    [
        ("base:llama", "LAST", "TransformersEmbeddingModel"),
        ("causal:qwen3", "MEAN", "TransformersForCausalLM"),  # runner="pooling" pools the LM
        ("base:qwen3_moe", "CLS", "TransformersEmbeddingModel"),  # experts stacked at load
    ],
)
def test_embeddings_match_hf_and_native_class(
    checkpoint, name: str, pooling: str, served_as: str
) -> None:
    path = checkpoint(name)
    kw = {**KW, "runner": "pooling", "pooler_config": {"pooling_type": pooling}}
    llm = LLM(str(path), model_impl="transformers", **kw)
    assert type(_model(llm)).__name__ == served_as
    assert type(_model(llm).model).__module__.startswith("transformers.models.")
    got = _embed(llm)
    for g, want in zip(got, _hf_pooled(path, pooling), strict=True):
        assert torch.allclose(g, want, atol=1e-5), (g - want).abs().max()
    native = LLM(str(path), **kw)
    assert not type(_model(native)).__name__.startswith("Transformers")
    for g, n in zip(got, _embed(native), strict=True):
        assert torch.allclose(g, n, atol=1e-5)


@torch.no_grad()
def _hf_logits(path) -> list[torch.Tensor]:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    return [model(torch.tensor([p])).logits[0] for p in PROMPTS]


def _classify(llm: LLM, **kw) -> list[torch.Tensor]:
    outs = llm.classify([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False, **kw)
    return [torch.tensor(o.outputs.probs) for o in outs]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
def test_classifiers_match_hf_and_native_class(checkpoint, arch: str) -> None:
    path = checkpoint(f"classify:{arch}")
    llm = LLM(str(path), model_impl="transformers", **KW)
    model = _model(llm)
    assert type(model).__name__ == "TransformersForSequenceClassification"
    assert type(model.model).__module__.startswith("transformers.models.")
    got = _classify(llm)
    for g, logits in zip(got, _hf_logits(path), strict=True):
        assert torch.allclose(g, logits.softmax(-1), atol=1e-5), (g, logits.softmax(-1))
    native = LLM(str(path), **KW)
    assert type(_model(native)).__name__ != "TransformersForSequenceClassification"
    for g, n in zip(got, _classify(native), strict=True):
        assert torch.allclose(g, n, atol=1e-5)
    if arch == "qwen3":  # the raw logits (no activation); a classifier never generates
        raw = _classify(llm, pooling_params=PoolingParams(use_activation=False))
        for g, logits in zip(raw, _hf_logits(path), strict=True):
            assert torch.allclose(g, logits, atol=1e-5)
        with pytest.raises(ValueError, match="runner='generate'"):
            LLM(str(path), model_impl="transformers", runner="generate", **KW)


def test_auto_serves_pooling_architectures_without_a_native_class(checkpoint) -> None:
    """CTRL has no class of paged's own: its sequence classifier (head `classifier`, one label:
    sigmoid) and its base model (names under HF's `transformer.` prefix) run through the
    backend under model_impl="auto"; model_impl="vllm" refuses them."""
    path = checkpoint("classify:ctrl")
    llm = LLM(str(path), **KW)
    assert type(_model(llm)).__name__ == "TransformersForSequenceClassification"
    for g, logits in zip(_classify(llm), _hf_logits(path), strict=True):
        assert g.shape == (1,) and torch.allclose(g, logits.sigmoid(), atol=1e-5)
    with pytest.raises(ValueError, match="unsupported model architecture: CTRLForSequence"):
        LLM(str(path), model_impl="vllm", **KW)
    base = checkpoint("base:ctrl")
    llm = LLM(str(base), **KW)
    assert type(_model(llm)).__name__ == "TransformersEmbeddingModel"
    for g, want in zip(_embed(llm), _hf_pooled(base, "LAST"), strict=True):
        assert torch.allclose(g, want, atol=1e-5)
    with pytest.raises(ValueError, match="does not generate"):
        llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(max_tokens=2), use_tqdm=False)


def test_vllm_backend_architecture_names(checkpoint) -> None:
    """hf_overrides naming vLLM's backend classes select the backend (even under
    model_impl="vllm", as vLLM's registry serves them): the model is the config's model type."""
    path = checkpoint("classify:qwen3")
    over = {"architectures": ["TransformersForSequenceClassification"]}
    llm = LLM(str(path), model_impl="vllm", hf_overrides=over, **KW)
    assert type(_model(llm)).__name__ == "TransformersForSequenceClassification"
    for g, logits in zip(_classify(llm), _hf_logits(path), strict=True):
        assert torch.allclose(g, logits.softmax(-1), atol=1e-5)
    causal = checkpoint("causal:qwen3")
    over = {"architectures": ["TransformersMoEEmbeddingModel"]}  # the MoE spelling: same class
    llm = LLM(str(causal), hf_overrides=over, **KW)  # a causal checkpoint: its LM head skipped
    assert type(_model(llm)).__name__ == "TransformersEmbeddingModel"
    with pytest.raises(ValueError, match="does not generate"):
        llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(max_tokens=2), use_tqdm=False)
    want = [torch.nn.functional.normalize(h, dim=-1) for h in _hf_causal_last(causal)]
    for g, w in zip(_embed(llm), want, strict=True):
        assert torch.allclose(g, w, atol=1e-5)


@torch.no_grad()
def _hf_causal_last(path) -> list[torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return [model.model(torch.tensor([p])).last_hidden_state[0, -1] for p in PROMPTS]


def _config(arch: str, model_type: str = "qwen3"):
    config = tiny_config(model_type)
    config.architectures = [arch]
    return config


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (_config("Qwen3ForTokenClassification"), "Qwen3ForTokenClassification: token classif"),
        (_config("Qwen2ForRewardModel"), "Qwen2ForRewardModel: token classifiers and reward"),
        (_config("TransformersMultiModalEmbeddingModel"), "multimodal models"),
        (
            _config("CohereForSequenceClassification", "cohere"),
            "transformers has no \\*ForSequenceClassification of 'cohere'",
        ),
        (transformers.BloomConfig(architectures=["BloomModel"]), "BloomForCausalLM does not"),
    ],
)
def test_pooling_configs_it_cannot_run_are_refused_by_name(config, match: str) -> None:
    with pytest.raises(ValueError, match=f"model_impl='transformers': .*{match}"):
        check_transformers_config(config)
