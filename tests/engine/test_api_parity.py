"""vLLM's offline API surface on paged (llm.py, sampling_params.py, outputs.py, __init__.py): the
names, keyword arguments and helpers that vLLM code ports with, each run on one tiny model."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

import paged_engine
from paged_engine import LLM, RequestOutputKind, SamplingParams
from paged_engine.multimodal.processor_cache import ProcessorCache
from paged_engine.outputs import CompletionOutput, RequestOutput
from paged_engine.sampling_params import BeamSearchParams
from paged_engine.testing import write_tiny_model
from paged_engine.testing.tokenizer import BOS_ID, SPECIAL_TOKENS

GREEDY = SamplingParams(max_tokens=4, temperature=0)
TEXT = "the cat sat on the mat and then it ran"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama whose tokenizer adds BOS (as Llama's does), so add_special_tokens shows."""
    path = write_tiny_model(tmp_path_factory.mktemp("parity") / "m", "llama")
    tok = json.loads((path / "tokenizer.json").read_text())
    bos = SPECIAL_TOKENS[BOS_ID]
    tok["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": bos, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {bos: {"id": bos, "ids": [BOS_ID], "tokens": [bos]}},
    }
    (path / "tokenizer.json").write_text(json.dumps(tok))
    return path


@pytest.fixture(scope="module")
def llm(model_dir: Path):
    llm = LLM(str(model_dir), dtype="float32", max_model_len=64, num_gpu_blocks_override=64)
    yield llm
    llm.llm_engine.shutdown()


def ids_of(llm: LLM, text: str, special: bool = True) -> list[int]:
    return llm.get_tokenizer().encode(text, add_special_tokens=special)


def test_top_level_exports_match_vllm():
    # vLLM's MODULE_ATTRS, less ModelRegistry and initialize_ray_cluster (no such machinery)
    names = [
        "AsyncEngineArgs",
        "EngineArgs",
        "AsyncLLMEngine",
        "LLMEngine",
        "LLM",
        "PromptType",
        "TextPrompt",
        "TokensPrompt",
        "SamplingParams",
        "PoolingParams",
        "ClassificationOutput",
        "ClassificationRequestOutput",
        "CompletionOutput",
        "EmbeddingOutput",
        "EmbeddingRequestOutput",
        "PoolingOutput",
        "PoolingRequestOutput",
        "RequestOutput",
        "ScoringOutput",
        "ScoringRequestOutput",
    ]
    for name in names:
        assert name in paged_engine.__all__, name
        assert getattr(paged_engine, name) is not None
    from paged_engine.classification import ClassificationOutput
    from paged_engine.pooling import EmbeddingOutput, PoolingOutput
    from paged_engine.scoring import ScoringOutput

    assert paged_engine.PoolingOutput is PoolingOutput
    assert paged_engine.EmbeddingOutput is EmbeddingOutput
    assert paged_engine.ClassificationOutput is ClassificationOutput
    assert paged_engine.ScoringOutput is ScoringOutput


def test_generate_tokenization_kwargs_add_special_tokens(llm):
    plain = llm.generate(TEXT, GREEDY, use_tqdm=False)[0]
    assert plain.prompt_token_ids == ids_of(llm, TEXT)
    assert plain.prompt_token_ids[0] == BOS_ID
    bare = llm.generate(
        [TEXT, {"prompt": TEXT}],
        GREEDY,
        use_tqdm=False,
        tokenization_kwargs={"add_special_tokens": False},
    )
    for out in bare:
        assert out.prompt == TEXT
        assert out.prompt_token_ids == ids_of(llm, TEXT, special=False)
    same = llm.generate(
        {"prompt_token_ids": ids_of(llm, TEXT, special=False)}, GREEDY, use_tqdm=False
    )[0]
    assert bare[0].outputs[0].token_ids == same.outputs[0].token_ids


def test_generate_tokenization_kwargs_truncation(llm):
    full = ids_of(llm, TEXT)
    out = llm.generate(
        TEXT, GREEDY, use_tqdm=False, tokenization_kwargs={"truncation": True, "max_length": 3}
    )[0]
    # text: the tokenizer cuts (vLLM's renderer), so its BOS stays before the last tokens
    assert out.prompt_token_ids == [full[0], *full[-2:]]
    out = llm.generate(
        TEXT, GREEDY, use_tqdm=False, tokenization_kwargs={"truncate_prompt_tokens": 2}
    )
    assert out[0].prompt_token_ids == [full[0], full[-1]]
    # a params' own truncate_prompt_tokens wins over tokenization_kwargs' (vLLM's order)
    own = SamplingParams(max_tokens=2, temperature=0, truncate_prompt_tokens=4)
    out = llm.generate(TEXT, own, use_tqdm=False, tokenization_kwargs={"truncate_prompt_tokens": 2})
    assert out[0].prompt_token_ids == [full[0], *full[-3:]]
    assert own.truncate_prompt_tokens == 4  # the caller's object is left as it was


def test_tokenization_kwargs_refusals(llm, caplog):
    want = llm.generate("hi", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="max_length"):
        llm.generate(TEXT, GREEDY, use_tqdm=False, tokenization_kwargs={"max_length": 3})
    with pytest.raises(ValueError, match="tokenization_kwargs must be a dict"):
        llm.generate(TEXT, GREEDY, use_tqdm=False, tokenization_kwargs=[("max_length", 3)])
    with pytest.raises(ValueError, match="add_special_tokens"):
        llm.generate(TEXT, GREEDY, use_tqdm=False, tokenization_kwargs={"add_special_tokens": 1})
    with pytest.raises(ValueError, match="BeamSearchParams"):
        llm.generate(
            TEXT,
            BeamSearchParams(beam_width=2, max_tokens=2),
            use_tqdm=False,
            tokenization_kwargs={"truncate_prompt_tokens": 2},
        )
    with caplog.at_level(logging.WARNING, logger="paged_engine.offline_args"):
        out = llm.generate("hi", GREEDY, use_tqdm=False, tokenization_kwargs={"padding": True})
    assert "padding" in caplog.text
    assert out[0].outputs[0].token_ids == want  # ignored, and the LLM serves on


def test_chat_tokenization_kwargs(llm):
    msgs = [{"role": "user", "content": TEXT}]
    base = llm.chat(msgs, GREEDY, use_tqdm=False)[0]
    assert base.prompt_token_ids == ids_of(llm, base.prompt, special=False)
    with_bos = llm.chat(
        msgs, GREEDY, use_tqdm=False, tokenization_kwargs={"add_special_tokens": True}
    )[0]
    assert with_bos.prompt_token_ids == [BOS_ID, *base.prompt_token_ids]
    cut = llm.chat(msgs, GREEDY, use_tqdm=False, tokenization_kwargs={"truncate_prompt_tokens": 5})
    assert cut[0].prompt_token_ids == base.prompt_token_ids[-5:]


def test_pooling_tokenization_kwargs(llm):
    full = ids_of(llm, TEXT)
    emb = llm.embed(TEXT, use_tqdm=False, tokenization_kwargs={"truncate_prompt_tokens": 3})
    assert emb[0].prompt_token_ids == [full[0], *full[-2:]]  # (the tokenizer's BOS stays)
    enc = llm.encode(TEXT, use_tqdm=False, tokenization_kwargs={"add_special_tokens": False})
    assert enc[0].prompt_token_ids == full[1:]
    # an explicit truncate_prompt_tokens argument wins over tokenization_kwargs
    emb = llm.embed(
        TEXT,
        use_tqdm=False,
        truncate_prompt_tokens=2,
        tokenization_kwargs={"truncate_prompt_tokens": 3},
    )
    assert emb[0].prompt_token_ids == [full[0], full[-1]]
    scores = llm.score(
        "a cat",
        ["a dog", "GDP"],
        use_tqdm=False,
        lora_request=[None, None, None],
        tokenization_kwargs={"add_special_tokens": False},
    )
    assert len(scores) == 2
    assert scores[0].prompt_token_ids[0] != BOS_ID
    with pytest.raises(ValueError, match="lora_request"):
        llm.score("a cat", ["a dog", "GDP"], use_tqdm=False, lora_request=[None, None])
    with pytest.raises(ValueError, match="chat_template"):
        llm.score("a cat", "a dog", use_tqdm=False, chat_template="{{ x }}")


def test_reset_prefix_cache_running_requests(llm):
    want = llm.generate(TEXT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    engine = llm.llm_engine
    engine.add_request("parity-running", TEXT, GREEDY)
    engine.step()
    assert llm.reset_prefix_cache() is False  # a request runs: nothing changes
    assert llm.reset_prefix_cache(reset_running_requests=True) is True
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert [o.outputs[0].token_ids for o in outs] == [want]  # preempted, recomputed
    with pytest.raises(ValueError, match="reset_running_requests"):
        llm.reset_prefix_cache(reset_running_requests="yes")


def test_world_size_and_mm_cache(llm):
    assert llm.get_world_size() == 1
    assert llm.get_world_size(include_dp=False) == 1
    llm.reset_mm_cache()  # a text model: no processor cache, nothing to do
    images = llm.llm_engine.input_processor.images

    class Images:  # the one attribute reset_mm_cache reads of an ImageProcessor
        cache = ProcessorCache(2**20)

    fake = Images()
    fake.cache.put("k", (torch.zeros(4),))
    assert len(fake.cache) == 1
    llm.llm_engine.input_processor.images = fake
    try:
        llm.reset_mm_cache()
    finally:
        llm.llm_engine.input_processor.images = images
    assert len(fake.cache) == 0 and fake.cache.max_bytes == 2**20


def test_sampling_params_vllm_helpers():
    p = SamplingParams.from_optional(
        n=None,
        temperature=None,
        top_p=None,
        presence_penalty=None,
        frequency_penalty=None,
        repetition_penalty=None,
        max_tokens=5,
        top_k=3,
        logit_bias={"7": 500.0},
    )
    assert (p.n, p.temperature, p.top_p, p.max_tokens, p.top_k) == (1, 1.0, 1.0, 5, 3)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.logit_bias == {7: 100.0}
    assert SamplingParams.from_optional(temperature=0.5).temperature == 0.5
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams.from_optional(top_p=2.0)

    p = SamplingParams(stop_token_ids=[9])
    p.update_from_generation_config({"eos_token_id": [2, 5, 6]}, eos_token_id=2)
    assert p.eos_token_id == 2
    assert p.all_stop_token_ids == {2, 5, 6, 9}
    assert p.stop_token_ids == [9, 5, 6]
    q = SamplingParams(ignore_eos=True)
    q.update_from_generation_config({"eos_token_id": 6}, eos_token_id=2)
    assert q.eos_token_id is None and q.stop_token_ids == [] and q.all_stop_token_ids == {2, 6}

    assert SamplingParams().num_logprobs is None
    assert SamplingParams(logprobs=3).num_logprobs == 3
    assert SamplingParams(logprob_token_ids=[4, 5]).num_logprobs == 2


def run_streamed(llm: LLM, rid: str, kind: RequestOutputKind) -> list[RequestOutput]:
    params = SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=3, logprobs=2)
    params.output_kind = kind
    llm.llm_engine.add_request(rid, TEXT, params)
    outs = []
    while llm.llm_engine.has_unfinished_requests():
        outs += [o for o in llm.llm_engine.step() if o.request_id == rid]
    return outs


def test_request_output_add(llm):
    final = run_streamed(llm, "parity-final", RequestOutputKind.FINAL_ONLY)
    assert len(final) == 1 and final[0].finished
    want = {c.index: c for c in final[0].outputs}
    for kind, aggregate in ((RequestOutputKind.DELTA, True), (RequestOutputKind.CUMULATIVE, False)):
        outs = run_streamed(llm, f"parity-{kind.name}", kind)
        assert len(outs) > 1
        merged = outs[0]
        for later in outs[1:]:
            merged.add(later, aggregate=aggregate)
        assert merged.finished
        got = {c.index: c for c in merged.outputs}
        assert sorted(got) == sorted(want)
        for i, c in got.items():
            assert list(c.token_ids) == list(want[i].token_ids)
            assert c.text == want[i].text
            assert c.finish_reason == want[i].finish_reason
            assert c.cumulative_logprob == pytest.approx(want[i].cumulative_logprob)
            assert [sorted(d) for d in c.logprobs] == [sorted(d) for d in want[i].logprobs]


def test_kv_transfer_params(llm):
    out = llm.generate("hi", GREEDY, use_tqdm=False)[0]
    assert out.kv_transfer_params is None
    assert out.outputs[0].kv_transfer_params is None

    def seq(i: int, params: dict | None) -> CompletionOutput:
        return CompletionOutput(i, "", [], None, None, kv_transfer_params=params)

    one = RequestOutput("r", None, [1], None, [seq(0, {"a": 1}), seq(1, None)], True)
    assert one.kv_transfer_params == {"a": 1}
    two = RequestOutput("r", None, [1], None, [seq(0, {"a": 1}), seq(1, {"b": 2})], True)
    assert two.kv_transfer_params == [{"a": 1}, {"b": 2}]


def test_beam_search_sequences_carry_the_prompts_mm_fields(llm):
    params = BeamSearchParams(beam_width=2, max_tokens=2)
    kwargs = {"num_crops": 4}
    outs = llm.beam_search(["hi", {"prompt": "hi", "mm_processor_kwargs": kwargs}], params)
    assert all(s.multi_modal_data is None for o in outs for s in o.sequences)
    assert [s.mm_processor_kwargs for s in outs[0].sequences] == [None, None]
    assert [s.mm_processor_kwargs for s in outs[1].sequences] == [kwargs, kwargs]
    assert [s.tokens for s in outs[0].sequences] == [s.tokens for s in outs[1].sequences]


def test_pooling_outputs_count_cached_tokens(llm):
    ids = list(range(100, 140))  # 40 tokens: two full 16-token blocks can be cached
    first = llm.embed({"prompt_token_ids": ids}, use_tqdm=False)[0]
    again = llm.embed({"prompt_token_ids": ids}, use_tqdm=False)[0]
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 32)
    assert again.outputs.embedding == pytest.approx(first.outputs.embedding, abs=1e-5)
    assert llm.encode({"prompt_token_ids": ids}, use_tqdm=False)[0].num_cached_tokens == 32
    other = {"prompt_token_ids": [*ids[:-1], 7]}
    score = llm.score({"prompt_token_ids": ids}, other, use_tqdm=False)[0]
    assert score.num_cached_tokens == 64  # both texts' (vLLM adds them up)


def test_supported_tasks(llm, model_dir):
    # vllm/tasks.py names; a decoder under runner="auto" generates and embeds (paged's "both")
    want = ("generate", "embed", "token_embed")
    assert llm.supported_tasks == want
    assert llm.llm_engine.get_supported_tasks() == want
    for runner, tasks in (("generate", ("generate",)), ("pooling", ("embed", "token_embed"))):
        other = LLM(
            str(model_dir),
            runner=runner,
            dtype="float32",
            max_model_len=64,
            num_gpu_blocks_override=64,
        )
        try:
            assert other.supported_tasks == tasks
        finally:
            other.llm_engine.shutdown()


def test_truncation_side(llm, model_dir):
    """vLLM's tokenizer truncation_side: "left" (keep the last k) where the engine generates,
    "right" (keep the first k) on a pooling runner; tokenization_kwargs' truncation_side
    overrides it per call."""
    full = ids_of(llm, TEXT)
    assert llm.get_tokenizer().truncation_side == "left"
    right = {"truncation_side": "right", "truncate_prompt_tokens": 3}
    out = llm.generate(TEXT, GREEDY, use_tqdm=False, tokenization_kwargs=right)[0]
    assert out.prompt_token_ids == full[:3]
    ids = llm.generate(
        {"prompt_token_ids": full}, GREEDY, use_tqdm=False, tokenization_kwargs=right
    )
    assert ids[0].prompt_token_ids == full[:3]
    cut = llm.embed(TEXT, use_tqdm=False, truncate_prompt_tokens=3)[0].prompt_token_ids
    assert cut == [full[0], *full[-2:]]  # text: the tokenizer cuts, keeping its BOS
    with pytest.raises(ValueError, match="truncation_side"):
        llm.generate(TEXT, GREEDY, use_tqdm=False, tokenization_kwargs={"truncation_side": "up"})

    pool = LLM(
        str(model_dir),
        runner="pooling",
        dtype="float32",
        max_model_len=64,
        num_gpu_blocks_override=64,
    )
    try:
        assert pool.get_tokenizer().truncation_side == "right"
        cut = pool.embed(TEXT, use_tqdm=False, truncate_prompt_tokens=3)[0]
        assert cut.prompt_token_ids == full[:3]
        whole = pool.embed({"prompt_token_ids": full[:3]}, use_tqdm=False)[0]
        assert cut.outputs.embedding == pytest.approx(whole.outputs.embedding, abs=1e-5)
        left = pool.embed(
            TEXT,
            use_tqdm=False,
            tokenization_kwargs={"truncation_side": "left", "truncate_prompt_tokens": 3},
        )
        assert left[0].prompt_token_ids == [full[0], *full[-2:]]
        most = pool.encode(
            TEXT * 9, pooling_task="embed", truncate_prompt_tokens=-1, use_tqdm=False
        )
        assert most[0].prompt_token_ids == ids_of(pool, TEXT * 9)[:64]  # -1: max_model_len
    finally:
        pool.llm_engine.shutdown()


def test_reset_prefix_cache_connector(llm, model_dir, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="paged_engine.engine.llm_engine"):
        assert llm.reset_prefix_cache(reset_connector=True) is False  # no connector
    assert "no KV connector" in caplog.text
    with pytest.raises(ValueError, match="reset_connector"):
        llm.reset_prefix_cache(reset_connector=1)
    kv = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)},
    }
    both = LLM(
        str(model_dir),
        dtype="float32",
        max_model_len=64,
        num_gpu_blocks_override=64,
        kv_transfer_config=kv,
    )
    prompt = {"prompt_token_ids": list(range(100, 140))}  # two full 16-token blocks stored

    def cached() -> int:
        return both.generate(prompt, GREEDY, use_tqdm=False)[0].num_cached_tokens

    try:
        want = both.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        assert both.reset_prefix_cache() is True
        assert cached() == 32  # loaded from the connector's storage
        assert both.reset_prefix_cache(reset_connector=True) is True
        out = both.generate(prompt, GREEDY, use_tqdm=False)[0]
        assert out.num_cached_tokens == 0  # the stored blocks are not loaded again
        assert out.outputs[0].token_ids == want
        assert both.reset_prefix_cache() is True
        assert cached() == 32  # stored anew, under the new keys
    finally:
        both.llm_engine.shutdown()


def test_method_signatures_match_vllm():
    import inspect

    def names(fn) -> list[str]:
        return [p for p in inspect.signature(fn).parameters if p != "self"]

    assert names(LLM.sleep)[:2] == ["level", "mode"]  # vLLM's order: sleep(1, "abort")
    assert names(LLM.reset_prefix_cache) == ["reset_running_requests", "reset_connector"]
    assert names(LLM.start_profile) == ["profile_prefix"]


def test_profile_prefix(tmp_path, llm):
    from paged_engine.worker.profiler import WorkerProfiler

    prof = WorkerProfiler(str(tmp_path), 0, torch.device("cpu"))
    prof.start("run7")
    assert Path(prof.stop()).name == "run7_tp0-1.pt.trace.json.gz"
    prof.start()
    assert Path(prof.stop()).name.startswith("rank0.")
    with pytest.raises(ValueError, match="profile_prefix"):
        llm.start_profile("a/b")


def test_pooling_task_is_not_overwritten(llm):
    from paged_engine import PoolingParams

    with pytest.raises(ValueError, match="pooling_task"):
        llm.embed(TEXT, PoolingParams(task="token_embed"), use_tqdm=False)
    with pytest.raises(ValueError, match="pooling_task"):
        llm.encode(TEXT, PoolingParams(task="embed"), pooling_task="token_embed", use_tqdm=False)
    out = llm.encode(TEXT, PoolingParams(task="embed"), pooling_task="embed", use_tqdm=False)
    assert out[0].outputs.data.dim() == 1


def test_sampling_params_newer_vllm_fields():
    p = SamplingParams(stop=["abc", "x"], logprobs=True, prompt_logprobs=True)
    assert (p.logprobs, p.prompt_logprobs) == (1, 1)  # vLLM reads True as 1
    assert p.output_text_buffer_length == 2
    assert (
        SamplingParams(stop=["abc"], include_stop_str_in_output=True).output_text_buffer_length == 0
    )
    defaults = SamplingParams(
        prompt_logprob_token_ids=None,
        prompt_logprob_start=None,
        routed_experts_prompt_start=0,
        trace_decode_token_ids=None,
    )
    assert defaults.output_text_buffer_length == 0
    for name, value in (
        ("prompt_logprob_token_ids", [3]),
        ("prompt_logprob_start", 1),
        ("routed_experts_prompt_start", 4),
        ("trace_decode_token_ids", [5, 6]),
    ):
        with pytest.raises(ValueError, match=name):
            SamplingParams(**{name: value})


def test_lora_request_newer_vllm_fields():
    from paged_engine.lora.request import LoRARequest

    r = LoRARequest("a", 1, "/adapters/a", base_model_name="base", is_3d_lora_weight=True)
    assert (r.base_model_name, r.tensorizer_config_dict, r.load_inplace) == ("base", None, False)
    assert r == LoRARequest("a", 1, "/adapters/a")
    for name, value in (("tensorizer_config_dict", {"uri": "s3://x"}), ("load_inplace", True)):
        with pytest.raises(ValueError, match=name):
            LoRARequest("a", 1, "/adapters/a", **{name: value})
    with pytest.raises(ValueError, match="is_3d_lora_weight"):
        LoRARequest("a", 1, "/adapters/a", is_3d_lora_weight="yes")
