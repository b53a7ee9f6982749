"""Speculative decoding under pipeline parallelism (2 gloo stages on the CPU): n-gram and suffix
drafts come from the host's tokens and the last stage verifies them; the first stage takes each
drafted row's last emitted token as its next input. Outputs equal the single-process engine's
with the same speculative_config (greedy and seeded tokens, logprobs within 1e-4), and the
greedy ones equal the engine's without speculation; two micro-batches run at once. Methods that
propose on the worker (a draft model, a head, an MTP layer) are refused by name, and so are
models with recurrent state (only the last stage learns which drafts to undo)."""

from __future__ import annotations

import random

import pytest

from paged_engine import LLM, SamplingParams
from paged_engine.structured_output.params import StructuredOutputsParams
from paged_engine.testing import write_tiny_model

pytest.importorskip("transformers")

LP_TOL = 1e-4
# 48-token steps over ~14 requests: prompts spread over several steps, so two micro-batches form;
# 12 blocks of 16 tokens: some sequences are preempted and recomputed
ENGINE = {
    "dtype": "float32",
    "max_model_len": 160,
    "block_size": 16,
    "num_gpu_blocks_override": 12,
    "max_num_batched_tokens": 48,
    "max_num_seqs": 8,
}
SPECS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2},
    "suffix": {"method": "suffix", "num_speculative_tokens": 4},
}


def _requests() -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(3)
    g = {"temperature": 0, "ignore_eos": True}
    reqs = []
    for i in range(8):  # repetitive prompts: the drafts find their n-grams
        unit = [rng.randrange(3, 200) for _ in range(rng.randint(3, 6))]
        sp = SamplingParams(max_tokens=14 + i, logprobs=2, **g)
        reqs.append((unit * rng.randint(3, 5), sp))
    reqs.append(([5, 6, 7, 8] * 5, SamplingParams(max_tokens=16, repetition_penalty=1.2, **g)))
    reqs.append(([9, 10, 11] * 6, SamplingParams(max_tokens=12, stop_token_ids=[10], **g)))
    fan = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=10, logprobs=1, ignore_eos=True)
    reqs.append(([12, 13, 14, 15] * 4, fan))
    seeded = SamplingParams(temperature=0.7, seed=11, max_tokens=12, logprobs=1, ignore_eos=True)
    reqs.append(([20, 21, 22] * 5, seeded))
    reqs.append(([30, 31, 32, 33] * 4, SamplingParams(max_tokens=16, stop=["e"], **g)))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    json = StructuredOutputsParams(json=schema)
    reqs.append(([40, 41] * 6, SamplingParams(max_tokens=20, structured_outputs=json, **g)))
    return reqs


def _run(model, requests, **kwargs) -> tuple[list, object, int]:
    """(outputs, stats, the most steps in flight while a drafted step was submitted)."""
    llm = LLM(str(model), **ENGINE, **kwargs)
    core = llm.llm_engine.engine_core
    submit = core.executor.execute_model
    depths = [0]

    def counted(sched):
        if sched.spec_token_ids:
            depths.append(len(core._in_flight) + 1)  # (this step joins them after the call)
        return submit(sched)

    core.executor.execute_model = counted
    try:
        outs = llm.generate([p for p, _ in requests], [sp for _, sp in requests], use_tqdm=False)
        stats = llm.llm_engine.get_stats()
    finally:
        llm.llm_engine.shutdown()
    got = [
        [
            (
                list(c.token_ids),
                [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs or [])],
                c.finish_reason,
            )
            for c in o.outputs
        ]
        for o in outs
    ]
    return got, stats, max(depths)


def _assert_same(got: list, want: list, indices) -> None:
    for i in indices:
        assert len(got[i]) == len(want[i])
        for (gt, glp, gf), (wt, wlp, wf) in zip(got[i], want[i]):
            assert (gt, gf) == (wt, wf), i
            assert glp == pytest.approx(wlp, abs=LP_TOL), i


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model = write_tiny_model(tmp_path_factory.mktemp("m"), "llama", seed=4)
    requests = _requests()
    plain, _, _ = _run(model, requests)
    return model, requests, plain


@pytest.mark.parametrize("method", sorted(SPECS))
def test_pipeline_speculation_matches_one_process(setup, method):
    model, requests, plain = setup
    spec = SPECS[method]
    one, one_stats, _ = _run(model, requests, speculative_config=spec)
    staged, stats, depth = _run(model, requests, pipeline_parallel_size=2, speculative_config=spec)
    # drafts were verified and some kept, a drafted step ran beside another step, sequences
    # were preempted
    assert one_stats.spec_decode_num_accepted_tokens > 0
    assert stats.spec_decode_num_accepted_tokens > 0
    assert depth == 2
    assert stats.num_preemptions > 0
    _assert_same(staged, one, range(len(requests)))
    greedy = [i for i, (_, sp) in enumerate(requests) if sp.temperature == 0]
    _assert_same(staged, plain, greedy)


@pytest.mark.parametrize(
    "spec",
    [
        {"method": "mtp", "num_speculative_tokens": 1},
        {"model": "some/draft", "num_speculative_tokens": 2},
        {"method": "eagle3", "model": "some/head", "num_speculative_tokens": 2},
    ],
    ids=["mtp", "draft_model", "eagle3"],
)
def test_pipeline_parallelism_refuses_worker_proposers_by_name(setup, spec):
    model = setup[0]
    method = spec.get("method", "draft_model")
    with pytest.raises(ValueError, match=rf"method '{method}' .* pipeline_parallel_size > 1"):
        LLM(str(model), pipeline_parallel_size=2, speculative_config=spec)


def test_pipeline_speculation_refuses_models_with_recurrent_state(tmp_path):
    # a rejected draft restores each stage's state rows; only the last stage knows the count
    # (Jamba serves pipeline stages: test_hybrid_pp.py)
    path = write_tiny_model(tmp_path, "jamba", seed=3, attn_layer_period=2, attn_layer_offset=1)
    with pytest.raises(ValueError, match=r"speculative_config .* > 1 for JambaForCausalLM"):
        LLM(
            str(path),
            pipeline_parallel_size=2,
            speculative_config=SPECS["ngram"],
        )
