"""Speculative decoding under pipeline parallelism (2 gloo stages on the CPU): n-gram and suffix
drafts come from the host's tokens and the last stage verifies them; the first stage takes each
drafted row's last emitted token as its next input. Outputs equal the single-process engine's
with the same speculative_config (greedy and seeded tokens, logprobs within 1e-4), and the
greedy ones equal the engine's without speculation; two micro-batches run at once.
Worker-side proposers (a draft model, an EAGLE-1 head, an MTP layer) run on the last stage,
which sends each step's drafts to the first stage before the forward: greedy outputs equal one
process's (sampled ones too with greedy drafts), drafts accepted. EAGLE-3 and the other heads
are refused by name (as vLLM's model runner), and so are worker-side proposers for models with
recurrent state (n-gram and suffix drafts are served for them: test_hybrid_pp.py)."""

from __future__ import annotations

import random

import pytest
import torch

from paged_engine import LLM, SamplingParams
from paged_engine.structured_output.params import StructuredOutputsParams
from paged_engine.testing import (
    write_tiny_eagle3_head,
    write_tiny_eagle_head,
    write_tiny_model,
    write_tiny_mtp_target,
)

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


def _agree(path, proj: str | None = None) -> None:
    """Zero every attention and MLP output and set the norms to 1 (test_spec_mtp_more.py's
    agreeing layer): a target's next token is then a function of its current one, which a
    head that reads only the embedding (`proj` [I | 0], no bias) predicts."""
    from safetensors.torch import load_file, save_file

    w = load_file(path / "model.safetensors")
    for name in list(w):
        bias = proj is not None and name == proj.removesuffix(".weight") + ".bias"
        if "o_proj" in name or "down_proj" in name or bias:
            w[name] = torch.zeros_like(w[name])
        elif "norm" in name and "q_a_" not in name and "kv_a_" not in name:
            w[name] = torch.ones_like(w[name])
    if proj is not None:
        d = w[proj].shape[0]
        w[proj] = torch.cat([torch.eye(d), torch.zeros(d, d)], 1)
    save_file(w, path / "model.safetensors", metadata={"format": "pt"})


def _worker_pair(root, method: str) -> tuple[object, dict]:
    """(target, speculative_config) of a worker-side proposer: the target as its own draft
    model; an EAGLE-1 head and DeepSeek-V3's MTP layer built to agree with their target
    (`_agree`), so drafts are accepted."""
    if method == "mtp":
        target = write_tiny_mtp_target(root / "mtp", own_embed=False, own_head=False)
        _agree(target, "model.layers.3.eh_proj.weight")
        return target, {"method": "mtp", "num_speculative_tokens": 2}
    target = write_tiny_model(root / "target", "llama", seed=4)
    if method == "draft_model":
        return target, {"model": str(target), "num_speculative_tokens": 3}
    _agree(target)
    head = write_tiny_eagle_head(root / "head", target, seed=1)
    _agree(head, "fc.weight")
    return target, {"method": "eagle", "model": str(head), "num_speculative_tokens": 2}


@pytest.mark.parametrize(
    ("method", "drafts"),
    [("draft_model", "probabilistic"), ("draft_model", "greedy"), ("eagle", "greedy"),
     ("mtp", "greedy")],
)  # fmt: skip
def test_worker_proposers_on_the_last_stage_match_one_process(tmp_path, method, drafts):
    # The last stage proposes before each step's forward and the first stage embeds its drafts.
    # Sampled drafts (q) make a sampled row's tokens depend on which steps drafted, and
    # micro-batches schedule other steps than one process: then only greedy rows compare.
    target, spec = _worker_pair(tmp_path, method)
    spec = {**spec, "draft_sample_method": drafts}
    requests = _requests()
    one, one_stats, _ = _run(target, requests, speculative_config=spec)
    staged, stats, depth = _run(target, requests, pipeline_parallel_size=2, speculative_config=spec)
    assert one_stats.spec_decode_num_accepted_tokens > 0
    assert stats.spec_decode_num_accepted_tokens > 0
    assert depth == 2
    assert stats.num_preemptions > 0
    greedy = [i for i, (_, sp) in enumerate(requests) if sp.temperature == 0]
    _assert_same(staged, one, greedy if drafts == "probabilistic" else range(len(requests)))


@pytest.mark.parametrize(
    "spec",
    [
        {"method": "eagle3", "model": "some/head", "num_speculative_tokens": 2},
        {"method": "medusa", "model": "some/heads", "num_speculative_tokens": 2},
        {"method": "mlp_speculator", "model": "some/speculator", "num_speculative_tokens": 2},
        {"method": "gemma4_assistant", "model": "some/assistant", "num_speculative_tokens": 2},
    ],
    ids=lambda spec: spec["method"],
)
def test_pipeline_parallelism_refuses_other_worker_proposers_by_name(setup, spec):
    # vLLM's model runner V2 (the one that drafts under pipeline stages) refuses EAGLE-3 there
    # (it reads layers of every stage) and has no path for the other heads
    model = setup[0]
    with pytest.raises(ValueError, match=rf"method '{spec['method']}' .* pipeline_parallel_size"):
        LLM(str(model), pipeline_parallel_size=2, speculative_config=spec)


def test_an_eagle3_head_told_by_its_checkpoint_is_refused(setup, tmp_path):
    # no method given: the head's config says EAGLE-3 (draft_loader), refused then
    model = setup[0]
    head = write_tiny_eagle3_head(tmp_path / "head", model)
    with pytest.raises(ValueError, match=r"method 'eagle3' .* pipeline_parallel_size"):
        LLM(
            str(model),
            pipeline_parallel_size=2,
            speculative_config={"model": str(head), "num_speculative_tokens": 2},
        )


def test_pipeline_speculation_refuses_worker_proposers_for_models_with_recurrent_state(tmp_path):
    # n-gram and suffix drafts are served there (test_hybrid_pp.py); a draft model is not
    path = write_tiny_model(tmp_path, "jamba", seed=3, attn_layer_period=2, attn_layer_offset=1)
    with pytest.raises(
        ValueError,
        match=r"method 'draft_model' is not supported with pipeline_parallel_size > 1 for "
        r"JambaForCausalLM \(a model with recurrent state\); methods that are: ngram, suffix",
    ):
        LLM(
            str(path),
            pipeline_parallel_size=2,
            speculative_config={"model": str(path), "num_speculative_tokens": 2},
        )
