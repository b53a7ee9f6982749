"""The Transformers modeling backend (models/transformers_backend/): HF's modeling code with paged
attention gives HF `generate`'s greedy tokens and top-5 logprobs (float32, 1e-3) under paged's
batching, chunked prefill and prefix caching, the same tokens as paged's own class (also through
HF's own MoE blocks: Qwen3-MoE, Mixtral), applies the soft caps and logit scales HF's classes apply
(Gemma 2, Cohere, Granite, HyperCLOVA X), serves by itself an architecture paged has no class for
(CTRL), and refuses by name what it cannot run."""

from __future__ import annotations

import copy

import pytest
import transformers
from hf_parity import (
    assert_llm_matches,
    assert_serves_like_hf,
    checkpoint_dirs,
    load_hf_as_saved,
    write_hf_checkpoint,
)
from hf_reference import assert_same_greedy, hf_greedy, random_token_prompts

from paged_engine import LLM, SamplingParams
from paged_engine.config import EngineConfig
from paged_engine.models.transformers_backend import (
    IMPL_FIELD,
    check_transformers_config,
    select_model_impl,
)
from paged_engine.testing import tiny_config, write_tiny_model

BACKEND = "TransformersForCausalLM"
# batches of different lengths, prefilled in chunks of 16 over cached prefix blocks of 4
STRESS = {"max_num_batched_tokens": 16, "block_size": 4, "enable_prefix_caching": True}


def _write(path, name: str):
    if name == "ctrl":  # no class of paged's own
        config = transformers.CTRLConfig(
            vocab_size=512, n_positions=128, n_embd=32, dff=64, n_layer=2, n_head=4
        )
        return write_hf_checkpoint(path, transformers.CTRLLMHeadModel, config, seed=2)
    if name == "mistral_swa":  # HF's sliding_window reaches paged's Attention per layer
        return write_tiny_model(path, "mistral", seed=1, sliding_window=8)
    return write_tiny_model(path, name, seed=1)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return checkpoint_dirs(tmp_path_factory, _write)


def _prompts(seed: int) -> list[list[int]]:
    shared = list(range(7, 26))  # 19 tokens: a second request reuses its first 4 blocks
    return [*random_token_prompts(seed, 2), shared + [30, 31], shared + [40, 41, 42]]


def _serve(path, prompts: list[list[int]], **kw) -> tuple[LLM, list]:
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, **kw)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, outs


# qwen3_moe / mixtral: HF's own sparse MoE blocks route the flattened step's tokens one by one
@pytest.mark.parametrize(
    "family", ["llama", "qwen3", "mistral_swa", "gemma3", "qwen3_moe", "mixtral"]
)
def test_backend_matches_hf_and_native_class(checkpoint, family: str) -> None:
    path = checkpoint(family)
    prompts = _prompts(len(family))
    hf = load_hf_as_saved(path)
    refs = [hf_greedy(hf, p, 8, 5) for p in prompts]
    llm = LLM(
        model=str(path), dtype="float32", max_model_len=128, model_impl="transformers", **STRESS
    )
    model = llm.llm_engine.model_runner.model
    assert type(model).__name__ == BACKEND
    assert type(model.model).__module__.startswith("transformers.models.")  # HF's backbone
    outs = assert_llm_matches(family, llm, prompts, refs)
    assert llm.get_stats().prefix_cache_hits > 0
    assert llm.get_stats().num_used_blocks == 0
    native, native_outs = _serve(path, prompts)
    assert type(native.llm_engine.model_runner.model).__name__ != BACKEND
    assert_same_greedy([o.outputs[0] for o in native_outs], [o.outputs[0] for o in outs], 1e-3)


@pytest.mark.parametrize(
    ("family", "applied"),
    [
        # attention soft cap 10 (passed as HF's `softcap` kwarg) and final soft cap 30
        ("gemma2", {"final_soft_cap": 30.0}),
        ("cohere", {"logit_scale": 0.5}),  # logits * logit_scale
        ("cohere2", {"logit_scale": 0.5}),  # with a sliding layer and a NoPE one
        ("nanochat", {"final_soft_cap": 5.0}),  # no attention cap
        ("granite", {"logits_divisor": 2.5}),  # logits / logits_scaling
        ("hyperclovax", {"logit_scale": 0.4}),  # logits * logits_scaling
    ],
)
def test_backend_applies_hf_soft_caps_and_logit_scales(
    checkpoint, family: str, applied: dict
) -> None:
    """The tiny configs' caps and scales bite (testing.py): a dropped or inverted one changes
    the top-5 logprobs."""
    llm = assert_serves_like_hf(
        family, checkpoint(family), _prompts(len(family)), model_impl="transformers", **STRESS
    )
    model = llm.llm_engine.model_runner.model
    assert type(model).__name__ == BACKEND
    for name, value in applied.items():
        assert getattr(model, name) == pytest.approx(value)


def test_auto_falls_back_for_an_architecture_without_a_native_class(checkpoint) -> None:
    """CTRL (a tied LM head with a bias, sinusoidal positions, "transformer." names) has no
    class in paged's registry: model_impl="auto" serves it through the backend as HF does;
    model_impl="vllm" refuses it."""
    path = checkpoint("ctrl")
    prompts = _prompts(3)
    hf = load_hf_as_saved(path)
    refs = [hf_greedy(hf, p, 8, 5) for p in prompts]
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, **STRESS)
    assert type(llm.llm_engine.model_runner.model).__name__ == BACKEND
    assert_llm_matches("ctrl", llm, prompts, refs)
    with pytest.raises(ValueError, match="unsupported model architecture: CTRLLMHeadModel"):
        LLM(model=str(path), dtype="float32", max_model_len=128, model_impl="vllm")


def _config(name: str, **fields):
    """tiny_config(name) with HF's causal LM as its architecture, then `fields` set."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = copy.deepcopy(tiny_config(name))
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    for key, value in fields.items():
        setattr(config, key, value)
    return config


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (transformers.T5Config(architectures=["T5ForConditionalGeneration"]), "encoder-decoder"),
        (
            _config("llama", architectures=["FooForCausalLM"]),
            "architectures FooForCausalLM name no transformers",
        ),
        (
            transformers.BloomConfig(architectures=["BloomForCausalLM"]),
            "BloomForCausalLM does not support custom attention",
        ),
        (_config("qwen3_moe", expert_capacity=4), "config.expert_capacity=4"),
        (
            transformers.PhimoeConfig(architectures=["PhimoeForCausalLM"]),
            "mixture-of-experts checkpoints of model_type 'phimoe' \\(config.num_local_experts\\)",
        ),
        (_config("qwen3_moe", kv_lora_rank=16), "config.kv_lora_rank=16"),
        (
            _config("llama", logits_scaling=2.0),
            "config.logits_scaling=2.0 is not supported for model_type 'llama'",
        ),
        (
            _config("gemma3", use_bidirectional_attention=True),
            "config.use_bidirectional_attention=True",
        ),
        (
            _config("llama", layer_types=["full_attention", "linear_attention"]),
            "config.layer_types \\['linear_attention'\\]",
        ),
        (
            transformers.LlavaConfig(architectures=["LlavaForConditionalGeneration"]),
            "multimodal models",
        ),
    ],
)
def test_configs_it_cannot_run_are_refused_by_name(config, match: str) -> None:
    with pytest.raises(ValueError, match=f"model_impl='transformers': {match}"):
        check_transformers_config(config)


@pytest.mark.parametrize(
    "option",
    [
        {"tensor_parallel_size": 2},
        {"pipeline_parallel_size": 2},
        {"enable_lora": True},
        {"enable_prompt_embeds": True},
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
    ],
)
def test_engine_options_it_cannot_run_are_refused_by_name(option: dict) -> None:
    config = EngineConfig(model="m", model_impl="transformers", **option)
    hf_config = _config("llama")
    with pytest.raises(ValueError, match=f"model_impl='transformers': {next(iter(option))}="):
        select_model_impl(config, hf_config)
    assert not hasattr(hf_config, IMPL_FIELD)
    with pytest.raises(ValueError, match="model_impl"):
        EngineConfig(model="m", model_impl="hf")
