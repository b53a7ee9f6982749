"""Pipeline parallelism for hybrid models (2 gloo stages on the CPU): each stage builds its own
decoder layers and holds KV caches for its attention layers and recurrent state for its linear
layers only, and greedy tokens and logprobs equal the single-process engine's: Jamba through
prefill chunks over several steps, preemption by recompute and prefix-cache state snapshots;
the other families of HybridModel's forward (Granite 4.0-H, Nemotron-H, Qwen3-Next, Qwen3.5,
Bamba, Falcon-H1, LFM2 / LFM2-MoE / LFM3, Kimi Linear, MiniMax-01 under both config dialects,
PLaMo 2, OLMo Hybrid, Ling 2.5, Inkling, RecurrentGemma, Lara-Mini) on plain requests; Jamba
and Bamba with n-gram and suffix speculation (a rejected draft restores every stage's state
rows) equal one process's with and without it. Hybrids
with a forward of their own, pure state-space models, and a split that leaves a stage without
an attention layer, are refused by name before any rank starts."""

from __future__ import annotations

import random

import pytest
from test_pp_layer_partition import _stage_kv_layers
from test_world_sizes import _assert_same, _built_layers
from torch import nn

from paged_engine import LLM, SamplingParams
from paged_engine.engine import llm_engine
from paged_engine.models.utils import PPMissingLayer
from paged_engine.testing import tiny_config, write_tiny_model
from paged_engine.worker.recurrent_state import state_layers, states_depend_on_prompt

pytest.importorskip("transformers")

_ALTERNATING = ["linear_attention", "full_attention"] * 2
# Each tiny config puts an attention layer in each half of its stack, so both stages cache KV.
FAMILIES = {
    # attention at 1 and 3, Mamba (v1) at 0 and 2, a MoE feed-forward at 1 and 3
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1},
    "granitemoehybrid": {"layer_types": ["mamba", "attention", "mamba", "attention"]},
    "nemotron_h": {
        "num_hidden_layers": 4,
        "layers_block_type": ["mamba", "attention", "mlp", "attention"],
    },
    "qwen3_next": {"layer_types": _ALTERNATING},
    "bamba": {"attn_layer_indices": [1, 3]},
    # every layer attention beside a Mamba2 mixer; muP multipliers on the embedding (stage 0)
    # and the logits (the last stage)
    "falcon_h1": {"num_hidden_layers": 4},
    "lfm2": {"layer_types": ["conv", "full_attention", "conv", "full_attention"]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention", "conv", "full_attention"]},
    # a sliding layer in the first half, a full one (a rope of its own) in the second
    "lfm3": {"layer_types": ["conv", "sliding_attention", "conv", "full_attention"]},
    "kimi_linear": {
        "linear_attn_config": {
            "kda_layers": [1, 3],
            "full_attn_layers": [2, 4],
            "num_heads": 4,
            "head_dim": 16,
            "short_conv_kernel_size": 4,
        }
    },
    "minimax": {"layer_types": _ALTERNATING},
    "olmo_hybrid": {"layer_types": _ALTERNATING},
    "bailing_hybrid": {},  # KDA / MLA alternating already
    "qwen3_5": {"layer_types": _ALTERNATING},
    "qwen3_5_moe": {"layer_types": _ALTERNATING},
    "inkling": {},  # 3 layers, every one attention and a short conv
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    "lara_mini": {},  # 5 layers: [0, 3) and [3, 5), the second stage without a state layer
}
# (each rank's built layers, each rank's (KV caches, state layers)) where not [[0, 1], [2, 3]]
# and one of each a stage
STAGES = {
    "nemotron_h": ([[0, 1], [2, 3]], [(1, 1), (1, 0)]),  # layer 2 an MLP: no state there
    "falcon_h1": ([[0, 1], [2, 3]], [(2, 2), (2, 2)]),
    "inkling": ([[0, 1], [2]], [(2, 8), (1, 4)]),  # four short convs a layer
    "lara_mini": ([[0, 1, 2], [3, 4]], [(1, 2), (2, 0)]),
}


def test_a_stage_caches_kv_for_its_attention_layers_only(monkeypatch):
    types = ["attention", "mamba", "attention", "attention"]
    granite = tiny_config("granitemoehybrid", layer_types=types)
    assert _stage_kv_layers(monkeypatch, granite, 2) == [1, 2]  # layers [0, 2) and [2, 4)
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "3,1")
    assert _stage_kv_layers(monkeypatch, granite, 2) == [2, 1]
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "1,3")
    assert _stage_kv_layers(monkeypatch, granite, 2) == [1, 2]


class _Mixer(nn.Module):
    def __init__(self, depends: bool) -> None:
        super().__init__()
        self.state_depends_on_prompt = depends

    def allocate_state(self, *args) -> None:
        pass


def test_a_stage_without_state_layers_snapshots_prompts_only():
    # another stage's mixers decide: prompt-only snapshots are right whatever they are
    assert states_depend_on_prompt(nn.ModuleList([nn.Linear(2, 2), PPMissingLayer()]))
    assert not states_depend_on_prompt(nn.ModuleList([_Mixer(False), PPMissingLayer()]))
    assert states_depend_on_prompt(nn.ModuleList([_Mixer(True), PPMissingLayer()]))
    assert not states_depend_on_prompt(nn.ModuleList([nn.Linear(2, 2)]))  # one process


def _stage_counts(worker) -> tuple[int, int]:
    """(KV cache entries, layers holding recurrent state) of this rank."""
    runner = worker.model_runner
    return len(runner.cache.kv_caches), len(state_layers(runner.model))


def _summary(outs) -> list[tuple[list[int], list[float]]]:
    got = []
    for o in outs:
        for c in o.outputs:
            lps = [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]
            got.append((list(c.token_ids), lps))
    return got


def _run(path, prompts, waves: int = 1, **kwargs):
    """(outputs, the scheduler, each rank's built layers and (KV, state) counts)."""
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, **kwargs)
    try:
        sp = SamplingParams(temperature=0, max_tokens=12, logprobs=1, ignore_eos=True)
        reqs = [{"prompt_token_ids": p} for p in prompts]
        step = -(-len(reqs) // waves)
        outs = []
        for lo in range(0, len(reqs), step):  # later waves hit earlier requests' snapshots
            outs += llm.generate(reqs[lo : lo + step], sp, use_tqdm=False)
        ranks = llm.collective_rpc(_built_layers), llm.collective_rpc(_stage_counts)
        return _summary(outs), llm.llm_engine.scheduler, ranks
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.slow
def test_jamba_pp2_with_chunks_preemption_and_snapshots_matches_one_process(tmp_path):
    path = write_tiny_model(tmp_path, "jamba", seed=3, **FAMILIES["jamba"])
    rng = random.Random(0)
    system = [rng.randrange(3, 200) for _ in range(36)]
    prompts = [
        system + [rng.randrange(3, 200) for _ in range(rng.randint(1, 30))] for _ in range(8)
    ]
    # 12 blocks of 16 for ~600 tokens of work: recompute preemptions; 32 tokens a step: prompts
    # run in chunks over several steps; 8 snapshot rows: later requests resume the system prompt
    engine = {
        "block_size": 16,
        "num_gpu_blocks_override": 12,
        "max_num_batched_tokens": 32,
        "max_num_seqs": 6,
        "prefix_state_snapshots": 8,
    }
    want, one, _ = _run(path, prompts, waves=2, **engine)
    got, sched, (built, counts) = _run(path, prompts, waves=2, pipeline_parallel_size=2, **engine)
    _assert_same(got, want)
    assert sched.num_preemptions > 0 and sched.state_slots.snapshot_hits > 0
    assert built == [[0, 1], [2, 3]]
    assert counts == [(1, 1), (1, 1)]  # each stage: its attention layer's KV, its Mamba's state
    assert one.num_preemptions > 0


# Families whose checkpoints come with remote code: (path, LLM options) of a tiny one.
def _remote_family(tmp_path, family: str):
    if family == "plamo2":  # the reference's writer: attention at 1 and 3
        from test_models_plamo2 import CONFIG, _write

        _write(tmp_path, CONFIG, 3)
        return tmp_path, {}
    # MiniMax-01 / M1 release configs (attn_type_list, layernorm_* factors): the same model
    from test_models_minimax import _RELEASE_CONFIG, _release_copy

    src = write_tiny_model(tmp_path / "hf", "minimax", seed=3, **FAMILIES["minimax"])
    name = {"minimax_text_01": "MiniMaxText01", "minimax_m1": "MiniMaxM1"}[family]
    source = _RELEASE_CONFIG.replace("MiniMaxText01", name).replace("minimax_text_01", family)
    path = _release_copy(
        src,
        tmp_path / "release",
        architectures=[f"{name}ForCausalLM"],
        model_type=family,
        auto_map={"AutoConfig": f"configuration_{family}.{name}Config"},
    )
    (path / f"configuration_{family}.py").write_text(source)
    return path, {"trust_remote_code": True}


REMOTE_FAMILIES = ["plamo2", "minimax_text_01", "minimax_m1"]


@pytest.mark.slow
@pytest.mark.parametrize("family", [*sorted(set(FAMILIES) - {"jamba"}), *REMOTE_FAMILIES])
def test_hybrid_family_pp2_matches_one_process(tmp_path, family):
    if family in REMOTE_FAMILIES:
        path, options = _remote_family(tmp_path, family)
    else:
        path, options = write_tiny_model(tmp_path, family, seed=3, **FAMILIES[family]), {}
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randint(3, 40))] for _ in range(3)]
    want, _, _ = _run(path, prompts, **options)
    got, _, (built, counts) = _run(path, prompts, pipeline_parallel_size=2, **options)
    _assert_same(got, want)
    assert (built, counts) == STAGES.get(family, ([[0, 1], [2, 3]], [(1, 1), (1, 1)]))


def _damp_mixers(path, scale: float) -> None:
    """Scale every mixer's and feed-forward's output projection: each next token then depends
    mostly on the current one, so greedy text falls into cycles that n-gram drafts predict,
    while the state layers still move every logprob."""
    from safetensors.torch import load_file, save_file

    w = load_file(path / "model.safetensors")
    for name in w:
        if any(p in name for p in ("o_proj", "out_proj", "down_proj")):
            w[name] = w[name] * scale
    save_file(w, path / "model.safetensors", metadata={"format": "pt"})


def _run_speculating(path, prompts, **kwargs):
    """(outputs, draft tokens verified, draft tokens accepted)."""
    llm = LLM(
        model=str(path),
        dtype="float32",
        max_model_len=128,
        max_num_batched_tokens=48,
        max_num_seqs=6,
        **kwargs,
    )
    try:
        sp = SamplingParams(temperature=0, max_tokens=32, logprobs=1, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        stats = llm.llm_engine.get_stats()
        drafted, accepted = (
            stats.spec_decode_num_draft_tokens,
            stats.spec_decode_num_accepted_tokens,
        )
        return _summary(outs), drafted, accepted
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["jamba", "bamba"])  # Mamba (v1) / Mamba2 state layers
@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_hybrid_pp2_speculation_matches_one_process(tmp_path, family, method):
    # A rejected draft: the last stage restores its state rows when it samples, the first
    # stage when the rolled-back sequence runs again.
    path = write_tiny_model(tmp_path, family, seed=3, **FAMILIES[family])
    _damp_mixers(path, 0.03)
    rng = random.Random(2)
    prompts = []  # repetitive prompts: the drafts find their n-grams
    for _ in range(6):
        unit = [rng.randrange(3, 200) for _ in range(rng.randint(3, 6))]
        prompts.append(unit * rng.randint(3, 5))
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "ngram":
        spec["prompt_lookup_min"] = 1
    plain, _, _ = _run_speculating(path, prompts)
    one, one_drafted, one_accepted = _run_speculating(path, prompts, speculative_config=spec)
    got, drafted, accepted = _run_speculating(
        path, prompts, pipeline_parallel_size=2, speculative_config=spec
    )
    assert 0 < accepted < drafted  # drafts kept, and drafts rejected (state rows restored)
    assert 0 < one_accepted < one_drafted
    _assert_same(got, one)
    _assert_same(got, plain)


def _no_ranks(*args, **kwargs):
    raise AssertionError("the engine started its ranks")


@pytest.mark.parametrize(
    ("arch", "overrides", "message"),
    [
        (
            "zamba2",
            {},
            r"pipeline_parallel_size > 1 is not supported for Zamba2ForCausalLM \(model_type "
            r"'zamba2'\): of the models with a recurrent state, pipeline stages serve "
            r"bailing_hybrid, bamba, ",
        ),
        # stacks with a forward of their own (models/hybrid.py says what crosses a stage)
        ("zamba", {}, r"not supported for ZambaForCausalLM \(model_type 'zamba'\)"),
        ("zaya", {}, r"not supported for ZayaForCausalLM \(model_type 'zaya'\)"),
        ("qwen4_exp", {}, r"not supported for Qwen4ExpForCausalLM \(model_type 'qwen4_exp_text'\)"),
        ("mamba", {}, r"not supported for MambaForCausalLM \(model_type 'mamba'\)"),
        ("mamba2", {}, r"not supported for Mamba2ForCausalLM \(model_type 'mamba2'\)"),
        # the tiny Jamba's one attention layer (1 of 4): the second stage would cache nothing
        (
            "jamba",
            {},
            r"pipeline_parallel_size=2: stage 1 holds decoder layers \[2, 4\) of "
            r"JambaForCausalLM, none with attention",
        ),
    ],
)
def test_unverified_hybrids_and_stages_without_attention_are_refused(
    tmp_path, monkeypatch, arch, overrides, message
):
    path = write_tiny_model(tmp_path, arch, seed=3, **overrides)
    monkeypatch.setattr(llm_engine, "MultiprocExecutor", _no_ranks)
    with pytest.raises(ValueError, match=message):
        LLM(model=str(path), dtype="float32", max_model_len=128, pipeline_parallel_size=2)


def _snapshot_costs(worker) -> tuple[int, int]:
    return worker.snapshot_costs()


@pytest.mark.slow
def test_state_snapshots_are_sized_by_the_stage_they_cost_most(tmp_path, monkeypatch):
    """Stage 0 holds two attention layers and one Mamba layer, stage 1 one and two: a snapshot
    takes 4x more of a freed block's memory there, so the KV blocks given up for snapshots are
    counted with stage 1's sizes (rank 0's would leave stage 1 short of its budget)."""
    types = ["attention", "attention", "mamba", "attention", "mamba", "mamba"]
    path = write_tiny_model(
        tmp_path, "granitemoehybrid", seed=0, num_hidden_layers=6, layer_types=types
    )
    seen = []
    real_fit = llm_engine.fit_state_snapshots

    def fit(config, num_blocks, block_bytes, row_bytes):
        seen.append((block_bytes, row_bytes))
        return real_fit(config, num_blocks, block_bytes, row_bytes)

    monkeypatch.setattr(llm_engine, "fit_state_snapshots", fit)
    llm = LLM(
        model=str(path),
        dtype="float32",
        max_model_len=128,
        pipeline_parallel_size=2,
        enable_prefix_caching=True,
    )
    try:
        costs = llm.collective_rpc(_snapshot_costs)
    finally:
        llm.llm_engine.shutdown()
    (block0, row0), (block1, row1) = costs
    assert row1 * block0 == 4 * row0 * block1  # the stages differ as built
    assert seen == [(block1, row1)]
