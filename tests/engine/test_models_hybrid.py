"""Hybrid models (Qwen3-Next, Qwen3.5, Qwen3.5-MoE: Gated DeltaNet; Granite 4.0-H: Mamba2) against
HF transformers, and the recurrent state's bookkeeping through forks, beams, preemption and
async scheduling.

Tiny random models (3 linear layers and 1 full one; Gated DeltaNet with 4 value heads on 2 key
heads, conv width 4, partial rope; Mamba2 with 8 heads on 2 groups, Granite's multipliers, a MoE
or the shared MLP alone, with and without rope; a time-step clamp, applied as transformers
applies it: to multi-token scans, not to one-token decode updates): `LLM.generate` must give HF
`generate`'s greedy tokens and top-5 logprobs (1e-3, float32), on prompts of 1 to 70 tokens (one
state chunk is 64), whole and in prefill chunks of 16. Each fork (n > 1) and beam must continue
its parent's state: n greedy samples equal the single greedy output, sampled continuations'
logprobs equal a fresh forward over prompt + continuation, and beam search gives HF's beams.
Preemption by recompute (with n > 1 requests, which share their prefix again, state included)
and async scheduling change no output; TP=2 gives the one-process results. Prefix caching
resumes from state snapshots (a shared system prompt from its third request on, a repeated
prompt, the next turn of a chat) with the outputs of an engine without it, also when snapshots
are evicted. What a hybrid model cannot combine with is refused, naming the option.
"""

from __future__ import annotations

import random
import shutil

import numpy as np
import pytest
import torch
from hf_reference import assert_tp_matches_one_process
from hybrid_checks import (
    CHAT_HITS,
    NEMOTRON_MOE,
    PROMPT_CHAT_HITS,
    assert_beam_search_matches_hf,
    assert_chat_turns_keep_outputs,
    assert_greedy_forks_equal_one,
    assert_greedy_matches_hf,
    assert_preemption_keeps_outputs,
    assert_snapshots_keep_outputs,
    mixed_params,
    random_prompts,
    tiny_dirs,
    token_requests,
)

from paged_engine import LLM, SamplingParams
from paged_engine.core.state_slots import StateSlots
from paged_engine.testing import write_tiny_model
from paged_engine.worker.cache_engine import CacheEngine
from paged_engine.worker.recurrent_state import RecurrentStatePool
from paged_server.metrics import Metrics

transformers = pytest.importorskip("transformers")

# name -> (tiny arch, config overrides)
CASES: dict[str, tuple[str, dict]] = {
    "qwen3_next": ("qwen3_next", {}),
    "qwen3_5": ("qwen3_5", {}),
    "qwen3_5_moe": ("qwen3_5_moe", {}),
    # Granite 4.0-H: Mamba2 layers (2 groups of 4 heads), attention without rope, a MoE
    "granitemoehybrid": ("granitemoehybrid", {}),
    # dense (the shared MLP alone), rope on the attention layers, one group, a time-step clamp
    "granitemoehybrid-dense": (
        "granitemoehybrid",
        {
            "num_local_experts": 0,
            "position_embedding_type": "rope",
            "mamba_n_groups": 1,
            "time_step_limit": [0.1, 3.0],
        },
    ),
    # Nemotron-H (dense): Mamba2, relu^2 MLP and attention blocks, a time-step clamp from below
    "nemotron_h": ("nemotron_h", {}),
    # its time_step_limit bites at both ends and time_step_min (not a clamp) would not
    "nemotron_h-limit": ("nemotron_h", {"time_step_min": 0.001, "time_step_limit": [0.4, 0.9]}),
    # Nemotron 3: MoE blocks (DeepSeek-V3's router over 2 groups, non-gated relu^2 experts and
    # shared experts), also with the experts in a latent space
    "nemotron_h-moe": ("nemotron_h", NEMOTRON_MOE),
    # mlp_bias: the latent fc2's bias, which only TP rank 0 adds
    "nemotron_h-moe-latent": (
        "nemotron_h",
        {**NEMOTRON_MOE, "moe_latent_size": 24, "mlp_bias": True},
    ),
}


@pytest.fixture(scope="module")
def hybrid_dirs(tmp_path_factory):
    return tiny_dirs(tmp_path_factory, CASES)


@pytest.mark.parametrize(
    ("name", "backend", "budget"),
    [
        ("qwen3_next", "cpu", None),
        ("qwen3_next", "cpu", 16),  # prefill chunks of 16: the state carries across them
        ("qwen3_5", "cpu", None),
        ("qwen3_5_moe", "cpu", None),
        ("qwen3_5", "triton", 16),  # paged_kernels' Triton kernels (interpreted on the CPU)
        ("granitemoehybrid", "cpu", None),
        ("granitemoehybrid", "cpu", 16),
        ("granitemoehybrid-dense", "cpu", None),
        ("nemotron_h", "cpu", 16),
        ("nemotron_h-moe", "cpu", None),
        ("nemotron_h-moe", "triton", 16),
        ("nemotron_h-moe-latent", "cpu", None),
    ],
)
def test_greedy_tokens_and_logprobs_match_hf(name, backend, budget, hybrid_dirs):
    assert_greedy_matches_hf(name, hybrid_dirs(name), backend, budget)


@pytest.mark.skipif(
    tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (5, 25),
    reason="transformers < 5.25 clamps Nemotron-H's dt at time_step_min, not time_step_limit",
)
def test_nemotron_h_clamps_dt_to_time_step_limit(hybrid_dirs):
    assert_greedy_matches_hf("nemotron_h-limit", hybrid_dirs("nemotron_h-limit"), "cpu", 16)


def test_forks_continue_their_parents_state(hybrid_dirs):
    llm = LLM(model=str(hybrid_dirs("qwen3_next")), dtype="float32", max_model_len=128)
    reqs = assert_greedy_forks_equal_one(llm)
    sampled = SamplingParams(
        n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True, logprobs=0
    )
    for req, out in zip(reqs, llm.generate(reqs, sampled, use_tqdm=False), strict=True):
        prompt = req["prompt_token_ids"]
        assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # the forks did diverge
        for c in out.outputs:
            fresh = llm.generate(
                [{"prompt_token_ids": prompt + c.token_ids}],
                SamplingParams(max_tokens=1, prompt_logprobs=0),
                use_tqdm=False,
            )[0]
            want = [
                fresh.prompt_logprobs[len(prompt) + i][t].logprob for i, t in enumerate(c.token_ids)
            ]
            got = [e[t].logprob for e, t in zip(c.logprobs, c.token_ids)]
            assert got == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize("name", ["qwen3_5", "granitemoehybrid"])
def test_beam_search_matches_hf(name, hybrid_dirs):
    assert_beam_search_matches_hf(hybrid_dirs(name))


def test_preemption_and_async_scheduling_change_no_output(hybrid_dirs):
    path = str(hybrid_dirs("qwen3_next"))
    rng = random.Random(0)
    reqs = token_requests(
        [[rng.randrange(3, 500) for _ in range(rng.randrange(20, 60))] for _ in range(8)]
    )
    params = mixed_params(len(reqs), 30)

    def run(**kw):
        llm = LLM(model=path, dtype="float32", max_model_len=128, **kw)
        outs = llm.generate(reqs, params, use_tqdm=False)
        return [[c.token_ids for c in o.outputs] for o in outs], llm.llm_engine.scheduler

    want, _ = run()
    for async_scheduling in (False, True):
        got, scheduler = run(
            num_gpu_blocks_override=20,
            max_num_batched_tokens=32,
            async_scheduling=async_scheduling,
            swap_space=1,  # unused: a hybrid preempts by recompute
        )
        assert scheduler.num_preemptions > 0 and scheduler.num_swap_preemptions == 0
        assert got == want
        assert scheduler.state_slots.num_free == scheduler.state_slots.num_slots  # none leaked


@pytest.mark.parametrize(
    ("name", "kw", "hits"),
    [
        ("qwen3_5", {}, CHAT_HITS),
        # its Mamba2 layers clamp dt for prompt tokens only: no snapshot after generated ones
        ("nemotron_h", {}, PROMPT_CHAT_HITS),
        # async scheduling (the snapshot copy runs a step later); prompts in one step each
        ("qwen3_5", {"async_scheduling": True, "enable_chunked_prefill": False}, CHAT_HITS),
        # one snapshot row: each new one evicts the last (the third prompt's end evicts the
        # system prompt's, which the fourth takes again)
        ("qwen3_5", {"prefix_state_snapshots": 1}, [0, 0, 32, 0, 32, 48]),
    ],
)
def test_prefix_cache_resumes_from_state_snapshots(name, kw, hits, hybrid_dirs):
    llm = assert_snapshots_keep_outputs(hybrid_dirs(name), hits, **kw)
    slots = llm.llm_engine.scheduler.state_slots
    stats = llm.get_stats()  # and in /metrics
    assert stats.state_snapshot_hits == slots.snapshot_hits > 0
    assert stats.state_snapshots_cached == slots.num_cached_snapshots > 0
    assert stats.state_decode_snapshots == slots.decode_snapshots
    text = Metrics("m").render(stats)
    lab = 'engine="0",model_name="m"'
    assert f"paged:state_snapshot_hits_total{{{lab}}} {slots.snapshot_hits}" in text
    assert llm.llm_engine.reset_prefix_cache() and slots.num_cached_snapshots == 0


@pytest.mark.parametrize("name", ["qwen3_5", "nemotron_h"])
def test_chat_turns_resume_from_decode_snapshots(name, hybrid_dirs):
    assert_chat_turns_keep_outputs(hybrid_dirs(name))


def test_prefix_cache_with_preemption_and_async_scheduling(hybrid_dirs):
    assert_preemption_keeps_outputs(hybrid_dirs("qwen3_next"))


def test_state_snapshots_take_their_memory_from_the_kv_cache(hybrid_dirs):
    path = str(hybrid_dirs("qwen3_5"))
    kw = {"dtype": "float32", "max_model_len": 128, "cpu_kv_cache_gib": 0.01}
    plain = LLM(model=path, prefix_state_snapshots=0, **kw)
    row = plain.llm_engine.model_runner.states.nbytes_per_row
    blocks = plain.llm_engine.num_blocks  # the whole budget: no snapshot
    block = CacheEngine.bytes_per_block(plain.llm_engine.hf_config, 16, torch.float32)
    assert blocks == int((1 << 30) * 0.01) // block
    for asked, want in ((None, int(0.1 * blocks * block // row)), (3, 3)):
        # auto: a tenth of the KV cache's memory (fewer than max_num_seqs at this budget)
        engine = LLM(model=path, prefix_state_snapshots=asked, **kw).llm_engine
        assert 0 < want < engine.config.max_num_seqs
        assert engine.config.prefix_state_snapshots == want
        assert engine.scheduler.state_slots.num_snapshots == want
        assert engine.model_runner.states.scratch_row == engine.config.max_num_seqs + want
        assert engine.num_blocks == blocks - -(-want * row // block)
    # under num_gpu_blocks_override the blocks stay as told
    engine = LLM(model=path, dtype="float32", max_model_len=128, num_gpu_blocks_override=40)
    assert engine.llm_engine.num_blocks == 40
    # a snapshot larger than a tenth of the KV cache: prefix caching off
    kw["cpu_kv_cache_gib"] = 40 * block / 2**30
    config = LLM(model=path, **kw).llm_engine.config
    assert not config.enable_prefix_caching and config.prefix_state_snapshots == 0


class _Seq:
    """What StateSlots reads of a Sequence; `keys`: its blocks' keys (None: a token pending)."""

    def __init__(self, seat: int, keys: list, num_pending: int = 0) -> None:
        self.state_slot, self.keys, self.num_pending = seat, keys, num_pending
        self.snapshot_row = -1


def _key_of(seq: _Seq, i: int):
    return seq.keys[i]


def test_state_snapshots_register_a_step_late_and_evict_lru():
    slots = StateSlots(2, num_snapshots=2)
    seat = slots.allocate()
    key = (11, None, (1, 2))
    seq = _Seq(seat, [key, (12, 11, (3,)), (13, 12, (4,))])
    slots.snapshot(seat, seq, 0)  # taken when the step reaching the boundary was emitted
    assert slots.lookup(key) is None  # not before its copy runs
    assert slots.take_copies(_key_of) == [(seat, 2)]  # with the next step, into a free row
    assert slots.lookup(key) == 2 and slots.lookup((11, 5, (1, 2))) is None  # parent checked
    slots.snapshot(seat, seq, 1)
    slots.snapshot(seat, seq, 0)  # already kept: no copy
    assert slots.take_copies(_key_of) == [(seat, 3)]
    assert slots.lookup(key) == 2  # now the most recently used: row 3 goes first
    other = slots.allocate()
    slots.copy(2, other)  # a hit reading row 2 in the step that evicts it (reads come first)
    slots.snapshot(seat, seq, 2)
    slots.snapshot(other, _Seq(other, [None, (14, 12, (5,))]), 1)
    assert slots.take_copies(_key_of) == [(2, other), (seat, 3), (other, 2)]
    assert slots.lookup(key) is None and slots.lookup((12, 11, (3,))) is None
    assert slots.lookup((13, 12, (4,))) == 3 and slots.lookup((14, 12, (5,))) == 2
    slots.reset_snapshots()
    assert slots.num_cached_snapshots == 0 and slots.lookup(key) is None
    # the same block reached by two sequences in one step: one copy (nothing else evicted)
    same = (15, 13, (6,))
    slots.snapshot(seat, _Seq(seat, [same]), 0)
    slots.snapshot(other, _Seq(other, [same]), 0)
    assert len(slots.take_copies(_key_of)) == 1 and slots.num_cached_snapshots == 1
    one = StateSlots(2, num_snapshots=1)
    one.snapshot(0, _Seq(0, [(1, None, (1,))]), 0)
    one.snapshot(1, _Seq(1, [(2, None, (2,))]), 0)  # no second row: one batch writes a row once
    assert one.take_copies(_key_of) == [(0, 2)] and one.lookup((1, None, (1,))) == 2


def test_decode_snapshots_keep_one_row_per_live_sequence():
    slots = StateSlots(4, num_snapshots=4)  # rows 4-7; live sequences hold at most 2
    a, b, c = (_Seq(slots.allocate(), [None] * 4, num_pending=1) for _ in range(3))
    shared = (1, None, (0,))
    slots.snapshot(a.state_slot, _Seq(a.state_slot, [shared]), 0)  # a prompt snapshot
    for seq in (a, b, c):
        slots.snapshot(seq.state_slot, seq, 1, decode=True)
    # a and b take a row each, c none (the cap); under async scheduling their blocks' last
    # tokens are still pending: copied now, findable once known
    assert slots.take_copies(_key_of) == [(0, 4), (a.state_slot, 5), (b.state_slot, 6)]
    assert (a.snapshot_row, b.snapshot_row, c.snapshot_row) == (5, 6, -1)
    assert slots.num_cached_snapshots == 1 and slots.decode_snapshots == 2
    a.keys[1], a.num_pending = (21, 1, (5,)), 0
    b.keys[1], b.num_pending = None, 0  # b ended before its last token landed: dropped
    assert slots.take_copies(_key_of) == []
    assert slots.lookup((21, 1, (5,))) == 5 and b.snapshot_row == -1
    # a's next boundary overwrites its own row, which stops being found under the old key
    a.keys[2] = (22, 21, (6,))
    slots.snapshot(a.state_slot, a, 2, decode=True)
    assert slots.take_copies(_key_of) == [(a.state_slot, 5)]
    assert slots.lookup((21, 1, (5,))) is None and slots.lookup((22, 21, (6,))) == 5
    # a live sequence's row is never evicted: with the free rows gone the prompt snapshot goes
    for i in range(3):
        slots.snapshot(0, _Seq(0, [(30 + i, None, (i,))]), 0)
        assert slots.take_copies(_key_of) == [(0, (6, 7, 4)[i])]
    assert slots.lookup(shared) is None and a.snapshot_row == 5
    # once `a` leaves, its row is an ordinary snapshot, here the least recently used
    slots.release(a)
    assert a.snapshot_row == -1
    slots.snapshot(0, _Seq(0, [(40, None, (9,))]), 0)
    assert slots.take_copies(_key_of) == [(0, 5)]
    assert slots.lookup((22, 21, (6,))) is None and slots.lookup((40, None, (9,))) == 5


@pytest.mark.parametrize("name", ["qwen3_next", "nemotron_h-moe-latent", "granitemoehybrid-dense"])
def test_tensor_parallel_matches_one_process(name, hybrid_dirs):
    assert_tp_matches_one_process(hybrid_dirs(name), random_prompts(5, (5, 23, 40)), 8, 128)


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("batch_invariant", True),
        ("cpu_offload_gib", 1),
        ("preemption_mode", "swap"),
        ("compilation_config", 3),
    ],
)
def test_unsupported_options_are_refused(option, value, hybrid_dirs):
    kw = {option: value}
    if option == "preemption_mode":
        kw["swap_space"] = 1
    with pytest.raises(ValueError, match=option):
        LLM(model=str(hybrid_dirs("qwen3_5")), dtype="float32", max_model_len=128, **kw)


def test_pipeline_stages_without_an_attention_layer_are_refused(hybrid_dirs):
    # Qwen3.5 runs in pipeline stages (tests/distributed/test_hybrid_pp.py), but this tiny one's
    # only attention layer (2 of 4) leaves the first stage none to cache KV for
    with pytest.raises(ValueError, match=r"stage 0 holds decoder layers \[0, 2\) of Qwen3_5"):
        LLM(
            model=str(hybrid_dirs("qwen3_5")),
            dtype="float32",
            max_model_len=128,
            pipeline_parallel_size=2,
        )


def test_ssm_cache_dtype(hybrid_dirs, tmp_path):
    path = str(hybrid_dirs("qwen3_5"))
    with pytest.raises(ValueError, match="mamba_ssm_cache_dtype"):
        LLM(model=path, mamba_ssm_cache_dtype="fp8")
    with pytest.raises(ValueError, match="prefix_state_snapshots"):
        LLM(model=path, prefix_state_snapshots=-1)

    def state_dtypes(model, **kw):
        llm = LLM(model=model, dtype="bfloat16", max_model_len=128, **kw)
        layer = llm.llm_engine.model_runner.states.layers[0]
        out = llm.generate(
            token_requests(random_prompts(2, (9,))), SamplingParams(temperature=0, max_tokens=4)
        )
        assert len(out[0].outputs[0].token_ids) == 4
        return layer.ssm_state.dtype, layer.conv_state.dtype

    assert state_dtypes(path) == (torch.bfloat16, torch.bfloat16)  # auto: the model's
    float32 = (torch.float32, torch.bfloat16)
    assert state_dtypes(path, mamba_ssm_cache_dtype="float32") == float32
    # auto follows a config's mamba_ssm_dtype (Qwen3.5's releases ask for float32)
    asks = write_tiny_model(tmp_path, "qwen3_5", seed=1, mamba_ssm_dtype="float32")
    assert state_dtypes(str(asks)) == float32


@pytest.mark.parametrize(("name", "past_prompt"), [("qwen3_5", True), ("nemotron_h", False)])
def test_decode_snapshots_only_where_prompt_tokens_update_the_state_alike(
    name, past_prompt, hybrid_dirs
):
    """Nemotron-H's Mamba2 layers clamp dt for prompt tokens only (its tiny config's
    time_step_limit bites), so its prefix cache, KV blocks and snapshots, stays within prompts."""
    llm = LLM(model=str(hybrid_dirs(name)), dtype="float32", max_model_len=128)
    scheduler = llm.llm_engine.scheduler
    slots = scheduler.state_slots
    assert slots.past_prompt is past_prompt and (slots.max_held > 0) is past_prompt
    assert scheduler.block_manager.prompt_only is not past_prompt


def test_state_slots_drop_copies_into_freed_slots():
    slots = StateSlots(3)
    a, b = slots.allocate(), slots.allocate()
    slots.copy(a, b)
    slots.free(b)  # its sequence left before the step ran: the copy must not land
    c = slots.allocate()
    assert c == b and slots.take_copies(_key_of) == []
    slots.copy(a, c)
    assert slots.take_copies(_key_of) == [(a, c)] and slots.take_copies(_key_of) == []
    slots.allocate()
    with pytest.raises(RuntimeError, match="recurrent-state slots"):
        slots.allocate()


def test_state_pool_refuses_a_stale_continuation(hybrid_dirs):
    llm = LLM(model=str(hybrid_dirs("qwen3_5")), dtype="float32", max_model_len=128)
    pool: RecurrentStatePool = llm.llm_engine.model_runner.states
    config = llm.llm_engine.config
    assert pool.scratch_row == config.max_num_seqs + config.prefix_state_snapshots
    rows = np.array([0, 1])
    pool.advance(rows, np.array([0, 0]), np.array([5, 3]))
    pool.copy_rows([(0, 2)])
    pool.advance(np.array([2]), np.array([5]), np.array([1]))  # continues the copied state
    with pytest.raises(RuntimeError, match="holds 3 tokens"):
        pool.advance(rows[1:], np.array([4]), np.array([1]))


def test_too_small_a_cache_names_the_state_seats(hybrid_dirs):
    with pytest.raises(ValueError, match=r"lower max_num_seqs or prefix_state_snapshots .* MiB"):
        LLM(
            model=str(hybrid_dirs("qwen3_5")),
            dtype="float32",
            max_model_len=128,
            num_gpu_blocks_override=4,
        )


def test_layer_types_without_full_attention_are_refused(tmp_path):
    write_tiny_model(tmp_path, "qwen3_5", layer_types=["linear_attention"] * 4)
    with pytest.raises(ValueError, match="at least one full"):
        LLM(model=str(tmp_path), dtype="float32", max_model_len=128)


def test_nemotron_h_loads_either_checkpoint_naming(hybrid_dirs, tmp_path):
    """The Hub's `backbone.` names (what transformers still writes) and transformers 5's
    in-memory `model.` names give the same model."""
    from safetensors.torch import load_file, save_file

    src = hybrid_dirs("nemotron_h")
    shutil.copytree(src, tmp_path, dirs_exist_ok=True)
    weights = load_file(str(src / "model.safetensors"))
    assert any(k.startswith("backbone.") for k in weights)
    renamed = {k.replace("backbone.", "model.", 1): v for k, v in weights.items()}
    save_file(renamed, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = [
        LLM(model=str(p), dtype="float32", max_model_len=128).generate(
            token_requests(random_prompts(4, (9, 30))), params, use_tqdm=False
        )
        for p in (src, tmp_path)
    ]
    assert [o.outputs[0].token_ids for o in outs[0]] == [o.outputs[0].token_ids for o in outs[1]]
