"""vLLM's LLM(...) options paged has no field for (vllm_options.py): the ones that change no
answer start the engine with one warning naming them, the ones paged serves at their default
only are refused by name at any other value, an older name is renamed, and anything else is
still an unknown option."""

from __future__ import annotations

import logging

import pytest

from paged_engine import LLM, SamplingParams

VLLM_SCRIPT_OPTIONS = {  # what vLLM scripts commonly pass
    "disable_custom_all_reduce": True,
    "max_seq_len_to_capture": 8192,
    "enable_expert_parallel": False,
    "tokenizer_mode": "auto",
    "distributed_executor_backend": "mp",
    "logprobs_mode": "raw_logprobs",
    "num_scheduler_steps": 1,
    "data_parallel_size": 1,
    "cpu_offload_gb": 0,
    "guided_decoding_backend": "xgrammar",
}


def test_a_vllm_scripts_options_start_the_engine(tiny_llama_dir, caplog):
    params = SamplingParams(temperature=0, max_tokens=4)
    want = LLM(str(tiny_llama_dir), max_model_len=64).generate(["hi"], params, use_tqdm=False)
    with caplog.at_level(logging.WARNING, logger="paged_engine.vllm_options"):
        llm = LLM(str(tiny_llama_dir), max_model_len=64, **VLLM_SCRIPT_OPTIONS)
    got = llm.generate(["hi"], params, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    (warning,) = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert "disable_custom_all_reduce" in warning and "max_seq_len_to_capture" in warning


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"tokenizer_mode": "slow"}, "tokenizer_mode='slow' is not supported"),
        ({"distributed_executor_backend": "ray"}, "distributed_executor_backend='ray'"),
        (
            {"distributed_executor_backend": "uni", "tensor_parallel_size": 2},
            "'uni' runs one process",
        ),
        ({"logprobs_mode": "processed_logprobs"}, "logprobs_mode"),
        ({"data_parallel_size": 2}, "data_parallel_size=2"),
        ({"skip_tokenizer_init": True}, "skip_tokenizer_init"),
        ({"kv_transfer_config": {"kv_connector": "x"}}, "kv_transfer_config"),
        ({"num_scheduler_steps": 8}, "num_scheduler_steps=8"),
        ({"override_pooler_config": {}, "pooler_config": {}}, "override_pooler_config and"),
        ({"no_such_option": 1}, r"unknown engine option\(s\) \['no_such_option'\]"),
    ],
)
def test_what_is_not_served_is_refused_by_name(tiny_llama_dir, options, match):
    with pytest.raises(ValueError, match=match):
        LLM(str(tiny_llama_dir), max_model_len=64, **options)


def test_an_older_name_is_renamed():
    from paged_engine.config import EngineConfig

    config = EngineConfig.from_kwargs(model="m", override_pooler_config={"pooling_type": "MEAN"})
    assert config.pooler_config == {"pooling_type": "MEAN"}


@pytest.mark.parametrize(
    ("options", "field", "value"),
    [
        ({"kv_offloading_size": 2.0, "kv_offloading_backend": "native"}, "cpu_offload_gib", 2.0),
        ({"optimization_level": 1}, "compilation_config", 1),
        (
            {"optimization_level": 3, "compilation_config": {"level": 1}},
            "compilation_config",
            {"level": 1},
        ),
        ({"max_model_len": -1}, "max_model_len", None),
        ({"max_model_len": "auto"}, "max_model_len", None),
        (
            {"language_model_only": True},
            "limit_mm_per_prompt",
            {"image": 0, "video": 0, "audio": 0},
        ),
        ({"disable_mm_preprocessor_cache": True}, "mm_processor_cache_gb", 0.0),
        ({"attention_backend": "FLASH_ATTN"}, "attention_backend", "auto"),
        ({"structured_outputs_config": {"backend": "xgrammar"}}, "seed", 0),
        ({"cudagraph_capture_sizes": [1, 2], "enable_dbo": False}, "seed", 0),
    ],
)
def test_vllm_engine_args_forms(options, field, value):
    """vLLM EngineArgs fields paged has under another name or form (no model is loaded)."""
    from paged_engine.config import EngineConfig

    assert getattr(EngineConfig.from_kwargs(model="m", **options), field) == value


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"kv_offloading_backend": "lmcache"}, "kv_offloading_backend='lmcache'"),
        ({"decode_context_parallel_size": 2}, "decode_context_parallel_size=2"),
        ({"structured_outputs_config": {"disable_any_whitespace": True}}, "structured_outputs"),
        ({"kv_offloading_size": 1.0, "cpu_offload_gib": 1.0}, "kv_offloading_size and"),
    ],
)
def test_vllm_engine_args_paged_cannot_honour(options, match):
    from paged_engine.config import EngineConfig

    with pytest.raises(ValueError, match=match):
        EngineConfig.from_kwargs(model="m", **options)
