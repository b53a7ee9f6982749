"""vLLM's offline objects as user code touches them: output constructors (positional order,
keywords of other vLLM versions), the config tree on LLM / LLMEngine, and the SamplingParams /
StructuredOutputsParams helpers."""

from __future__ import annotations

import asyncio
import logging
import pickle
from typing import ClassVar

import pytest
import torch

from paged_engine import LLM, CompletionOutput, RequestOutput, SamplingParams
from paged_engine.engine.async_llm import AsyncLLM
from paged_engine.structured_output.params import StructuredOutputsParams
from paged_engine.testing import write_tiny_model


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory):
    path = write_tiny_model(tmp_path_factory.mktemp("surface") / "m", "llama")
    llm = LLM(
        str(path),
        dtype="float32",
        max_model_len=64,
        num_gpu_blocks_override=32,
        max_num_seqs=8,
        block_size=16,
    )
    yield llm
    llm.llm_engine.shutdown()


# ---- outputs --------------------------------------------------------------------------------
def test_completion_output_positional_order_is_vllms():
    # vLLM: index, text, token_ids, cumulative_logprob, logprobs, routed_experts,
    # finish_reason, stop_reason, lora_request, kv_transfer_params
    c = CompletionOutput(0, "a", [1], None, None, None, "stop", "###", "lora", {"k": 1})
    assert c.routed_experts is None and c.finish_reason == "stop" and c.stop_reason == "###"
    assert c.lora_request == "lora" and c.kv_transfer_params == {"k": 1}
    assert c.finished()
    text = repr(c)
    assert "routed_experts=None" in text and "kv_transfer_params={'k': 1}" in text


def test_request_output_positional_order_is_vllms():
    seq = CompletionOutput(0, "a", [1], None, None, finish_reason="length")
    # vLLM: ..., finished, metrics, lora_request, encoder_prompt, encoder_prompt_token_ids,
    # num_cached_tokens
    out = RequestOutput("r", "p", [1, 2], None, [seq], True, None, "lora", "enc", [7], 16)
    assert out.lora_request == "lora" and out.num_cached_tokens == 16
    assert out.encoder_prompt == "enc" and out.encoder_prompt_token_ids == [7]
    assert out.num_prompt_tokens == 2 and out.metrics is None
    text = repr(out)
    for name in ("encoder_prompt=", "lora_request=lora", "kv_transfer_params=None"):
        assert name in text
    assert pickle.loads(pickle.dumps(out)).lora_request == "lora"
    bare = RequestOutput("r", None, None, None, [], False)
    assert bare.lora_request is None and bare.encoder_prompt is None


def test_request_output_ignores_other_versions_keywords(caplog: pytest.LogCaptureFixture):
    seq = CompletionOutput(0, "", [], None, None, kv_transfer_params={"a": 1})
    with caplog.at_level(logging.WARNING, logger="paged_engine.outputs"):
        out = RequestOutput(
            "r", None, [1], None, [seq], True, multi_modal_placeholders={}, kv_transfer_params={}
        )
    # like vLLM's, the request's kv_transfer_params come from its sequences
    assert out.kv_transfer_params == {"a": 1}
    assert "kv_transfer_params" in caplog.text and "multi_modal_placeholders" in caplog.text


def test_engine_outputs_fill_the_right_fields(llm: LLM):
    (out,) = llm.generate("hello there", SamplingParams(max_tokens=3), use_tqdm=False)
    seq = out.outputs[0]
    assert seq.finish_reason == "length" and seq.stop_reason is None
    assert seq.routed_experts is None and seq.lora_request is None
    assert out.lora_request is None and isinstance(out.num_cached_tokens, int)
    assert out.num_prompt_tokens == len(out.prompt_token_ids)


# ---- config tree ----------------------------------------------------------------------------
def test_model_config_view(llm: LLM):
    engine = llm.llm_engine
    mc = llm.model_config
    assert engine.get_model_config().max_model_len == mc.max_model_len == 64
    assert mc.dtype == torch.float32  # resolved, where the option says "float32" / "auto"
    assert mc.hf_config is engine.hf_config and mc.hf_text_config is engine.hf_config
    assert mc.model == engine.config.model and mc.tokenizer == engine.config.model
    assert mc.served_model_name == engine.config.model
    assert mc.get_vocab_size() == engine.hf_config.vocab_size
    assert mc.get_hidden_size() == engine.hf_config.hidden_size
    assert mc.runner_type == "generate" and mc.architectures == ["LlamaForCausalLM"]
    assert mc.seed == engine.config.seed  # an EngineConfig field of the same name
    assert mc.get_diff_sampling_param() == engine.generation_defaults
    assert "max_model_len=64" in repr(mc)
    with pytest.raises(AttributeError, match="read-only"):
        mc.max_model_len = 128
    with pytest.raises(AttributeError, match="no_such_field"):
        _ = mc.no_such_field


def test_vllm_config_tree(llm: LLM):
    engine = llm.llm_engine
    vc = engine.vllm_config
    assert vc.model_config.max_model_len == 64
    assert vc.cache_config.block_size == 16 and vc.cache_config.num_gpu_blocks == 32
    assert vc.cache_config.cache_dtype == "auto" and vc.cache_config.enable_prefix_caching
    assert vc.scheduler_config.max_num_seqs == 8 and vc.scheduler_config.policy == "fcfs"
    assert vc.scheduler_config.max_num_batched_tokens == engine.config.max_num_batched_tokens
    pc = vc.parallel_config
    assert (pc.tensor_parallel_size, pc.pipeline_parallel_size, pc.world_size) == (1, 1, 1)
    assert pc.data_parallel_size == 1
    assert engine.get_tokenizer() is llm.get_tokenizer()


def test_async_llm_model_config_is_the_view(llm: LLM):
    client = AsyncLLM.__new__(AsyncLLM)  # only its engine is read: no engine thread needed
    client.engine = llm.llm_engine
    mc = asyncio.run(client.get_model_config())
    assert mc.max_model_len == 64 and mc.get_vocab_size() == llm.model_config.get_vocab_size()


# ---- SamplingParams / StructuredOutputsParams helpers ---------------------------------------
class _Tok:
    """encode() from a table; ids up to max_token_id."""

    max_token_id = 9
    table: ClassVar[dict[str, list[int]]] = {
        "foo": [5],
        " foo": [6],
        "bar": [7, 8],
        " bar": [9],
        "big": [12],
        "nil": [],
    }

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert not add_special_tokens
        return self.table.get(text, [1])


def test_update_from_tokenizer_resolves_bad_words():
    p = SamplingParams(bad_words=["foo", " bar"])
    assert p.bad_words_token_ids is None
    p.update_from_tokenizer(_Tok())
    # " foo": another first token, as long: banned too; " bar": a different length: not
    assert p.bad_words_token_ids == [[5], [6], [7, 8]]
    q = SamplingParams()
    q.update_from_tokenizer(_Tok())
    assert q.bad_words_token_ids is None
    with pytest.raises(ValueError, match=r"bad_words.*outside the vocabulary"):
        SamplingParams(bad_words=["big"]).update_from_tokenizer(_Tok())
    with pytest.raises(ValueError, match=r"bad_words.*no tokens"):
        SamplingParams(bad_words=["nil"]).update_from_tokenizer(_Tok())


def test_update_from_tokenizer_with_a_real_tokenizer(llm: LLM):
    tok = llm.get_tokenizer()
    p = SamplingParams(bad_words=["cat"])
    p.update_from_tokenizer(tok)
    assert p.bad_words_token_ids[0] == tok.encode("cat", add_special_tokens=False)
    assert p.clone().bad_words_token_ids == p.bad_words_token_ids


def test_structured_outputs_constraint_checks():
    s = StructuredOutputsParams(regex="a+")
    assert not s.all_constraints_none() and not s.all_non_structural_tag_constraints_none()
    s.regex = None
    assert s.all_constraints_none()
    t = StructuredOutputsParams(structural_tag='{"type": "structural_tag"}')
    assert not t.all_constraints_none() and t.all_non_structural_tag_constraints_none()
