"""Pure state-space models (models/mamba.py): Mamba, Falcon Mamba (layers/mamba.py, Mamba v1's
selective scan) and Mamba2 (layers/mamba2.py), no attention layer at all, against HF transformers.

Tiny random models (3 mixer layers; Mamba with tied embeddings and a dt rank apart from the
state size, also with projection biases and no conv bias; Falcon Mamba's weightless dt / B / C
norms with a state of 12 and a conv of 3; Mamba2 on 2 groups with a dt clamp): `LLM.generate`
must give HF `generate`'s greedy tokens and top-5 logprobs (1e-3, float32) on prompts of 1 to
70 tokens, whole and in prefill chunks of 16, on the CPU backend and the Triton one. The engine
runs them without KV (blocks count tokens, no context limit but max_model_len, every snapshot
row from the state budget); forks (n = 3) continue their parent's state, prefix caching resumes
from state snapshots with the outputs of an engine without it (also under preemption, which
the blocks still cause, and async scheduling), beam search gives HF's beams, TP=2 gives the
one-process results, and bfloat16 runs agree with HF's in bfloat16.
"""

from __future__ import annotations

import pytest
import torch
from hf_reference import assert_matches, assert_tp_matches_one_process, hf_greedy, load_hf_model
from hybrid_checks import (
    assert_beam_search_matches_hf,
    assert_greedy_forks_equal_one,
    assert_greedy_matches_hf,
    assert_preemption_keeps_outputs,
    assert_snapshots_keep_outputs,
    random_prompts,
    tiny_dirs,
    token_requests,
)

from paged_engine import LLM, SamplingParams
from paged_engine.worker.recurrent_state import MAX_COUNTING_BLOCKS

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

# name -> (tiny arch, config overrides)
CASES: dict[str, tuple[str, dict]] = {
    "mamba": ("mamba", {}),
    "mamba-bias": ("mamba", {"use_bias": True, "use_conv_bias": False}),
    "falcon_mamba": ("falcon_mamba", {}),
    "mamba2": ("mamba2", {}),
    "mamba2-one-group": ("mamba2", {"n_groups": 1, "use_bias": True}),
}


@pytest.fixture(scope="module")
def mamba_dirs(tmp_path_factory):
    return tiny_dirs(tmp_path_factory, CASES)


@pytest.mark.parametrize(
    ("name", "backend", "budget"),
    [
        ("mamba", "cpu", None),
        ("mamba", "cpu", 16),  # prefill chunks of 16: conv window and state carry across them
        ("mamba-bias", "cpu", 16),
        ("mamba", "triton", 16),  # paged_kernels' Triton selective scan (interpreted)
        ("falcon_mamba", "cpu", None),
        ("falcon_mamba", "cpu", 16),
        ("mamba2", "cpu", None),
        ("mamba2", "cpu", 16),
        ("mamba2-one-group", "cpu", None),
        ("mamba2", "triton", 16),
    ],
)
def test_greedy_tokens_and_logprobs_match_hf(name, backend, budget, mamba_dirs):
    llm = assert_greedy_matches_hf(name, mamba_dirs(name), backend, budget)
    engine = llm.llm_engine
    # every layer a state layer; no KV cache at all
    assert len(engine.model_runner.states.layers) == 3
    assert engine.model_runner.cache.kv_caches == []


def test_engine_without_kv_layers(mamba_dirs):
    """Blocks count tokens only (0 bytes); max_model_len is the user's (no position limit; the
    default 2048); the state budget gives every seat a snapshot row by default."""
    from paged_engine.worker.cache_engine import CacheEngine

    path = str(mamba_dirs("mamba"))
    llm = LLM(model=path, dtype="float32", max_num_seqs=4)
    engine, config = llm.llm_engine, llm.llm_engine.config
    assert config.max_model_len == 2048
    assert CacheEngine.bytes_per_block(engine.hf_config, 16, torch.float32) == 0
    assert engine.num_blocks == 4 * (2048 // 16) + 1
    assert config.enable_prefix_caching and config.prefix_state_snapshots == 4
    long = LLM(model=path, dtype="float32", max_num_seqs=2, max_model_len=100_000)
    assert long.llm_engine.config.max_model_len == 100_000
    assert long.llm_engine.num_blocks == 2 * 6250 + 1
    # bookkeeping blocks are capped (host memory): 256 seats x 100k tokens would be 1.6M
    many = LLM(model=path, dtype="float32", max_model_len=100_000)
    assert many.llm_engine.num_blocks == MAX_COUNTING_BLOCKS
    del many
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    a, b = (x.generate([{"prompt_token_ids": [5, 6, 7]}], params)[0] for x in (llm, long))
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    with pytest.raises(ValueError, match="prefix_state_snapshots=100000"):
        LLM(model=path, dtype="float32", max_num_seqs=2, prefix_state_snapshots=100_000)


def test_checkpoint_names(mamba_dirs, tmp_path):
    """HF's names (what the released checkpoints use), and early Mamba checkpoints' embedding
    name `backbone.embedding`, which loads the same model."""
    keys = set(safetensors_torch.load_file(mamba_dirs("mamba") / "model.safetensors"))
    want = {
        "backbone.embeddings.weight",
        "backbone.norm_f.weight",
        "backbone.layers.0.norm.weight",
        "backbone.layers.0.mixer.in_proj.weight",
        "backbone.layers.0.mixer.conv1d.weight",
        "backbone.layers.0.mixer.conv1d.bias",
        "backbone.layers.0.mixer.x_proj.weight",
        "backbone.layers.0.mixer.dt_proj.weight",
        "backbone.layers.0.mixer.dt_proj.bias",
        "backbone.layers.0.mixer.A_log",
        "backbone.layers.0.mixer.D",
        "backbone.layers.0.mixer.out_proj.weight",
    }
    assert want <= keys and "lm_head.weight" not in keys  # tied
    import shutil

    src = mamba_dirs("mamba")
    old = tmp_path / "old-names"
    shutil.copytree(src, old)
    tensors = safetensors_torch.load_file(src / "model.safetensors")
    tensors["backbone.embedding.weight"] = tensors.pop("backbone.embeddings.weight")
    safetensors_torch.save_file(tensors, old / "model.safetensors")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    reqs = token_requests(random_prompts(2, (9, 30)))
    want_out, got = (
        LLM(model=str(p), dtype="float32", max_model_len=128).generate(reqs, params)
        for p in (src, old)
    )
    for a, b in zip(want_out, got, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].cumulative_logprob == pytest.approx(b.outputs[0].cumulative_logprob)


@pytest.mark.parametrize("name", ["mamba", "mamba2"])
def test_forks_continue_their_parents_state(name, mamba_dirs):
    llm = LLM(model=str(mamba_dirs(name)), dtype="float32", max_model_len=128)
    assert_greedy_forks_equal_one(llm)


@pytest.mark.parametrize("name", ["mamba", "falcon_mamba", "mamba2"])
def test_prefix_cache_resumes_from_state_snapshots(name, mamba_dirs):
    assert_snapshots_keep_outputs(mamba_dirs(name))


@pytest.mark.parametrize("name", ["mamba", "mamba2"])
def test_tensor_parallel_matches_one_process(name, mamba_dirs):
    # Mamba: 128 channels split, x_proj and out_proj all-reduced; Mamba2: 8 heads, 2 groups
    assert_tp_matches_one_process(mamba_dirs(name), random_prompts(5, (5, 23, 40)), 8, 128)


def test_bfloat16_matches_hf(mamba_dirs):
    """bfloat16 (the residual stream in float32 between layers, residual_in_fp32, as HF's):
    the first greedy tokens agree with HF in bfloat16 and their logprobs to bf16 accuracy (the
    two differ by the order of the conv's and scan's roundings: ~0.1 at most here)."""
    path = mamba_dirs("mamba")
    prompts = random_prompts(11, (9, 30))
    hf = load_hf_model(path).to(torch.bfloat16)
    refs = [hf_greedy(hf, p, 3) for p in prompts]
    llm = LLM(model=str(path), dtype="bfloat16", max_model_len=128)
    assert llm.llm_engine.model_runner.model.backbone.residual_fp32
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=0)
    outs = llm.generate(token_requests(prompts), params, use_tqdm=False)
    for out, ref in zip(outs, refs, strict=True):
        c = out.outputs[0]
        assert c.token_ids == ref.tokens
        got = [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]
        assert got == pytest.approx(ref.logprobs, abs=0.2)


@pytest.mark.parametrize("name", ["mamba", "mamba2"])
def test_beam_search_matches_hf(name, mamba_dirs):
    assert_beam_search_matches_hf(mamba_dirs(name))


def test_preemption_async_and_prefix_cache_change_no_output(mamba_dirs):
    """Without KV the blocks still run out under num_gpu_blocks_override: requests sharing a
    system prompt in waves, greedy and sampled, n = 3 among them, preempted (recompute), with
    async scheduling and prefix caching, give the outputs of a plain engine; no row leaks."""
    assert_preemption_keeps_outputs(mamba_dirs("mamba2"))


def test_dt_clamp_follows_positions_not_chunks(mamba_dirs):
    """Mamba2's time_step_limit clamps prompt tokens (transformers' prefill scan), not generated
    ones: a prompt of 17 or 33 tokens in chunks of 16 ends in a one-token chunk that continues
    its state, which is still a prompt token (clamped): HF's greedy tokens and logprobs."""
    path = mamba_dirs("mamba2")  # its limit (0, 0.9) bites: softplus(dt) reaches ~1.3
    prompts = [list(range(5, 22)), list(range(30, 63))]
    hf = load_hf_model(path)
    refs = [hf_greedy(hf, p, 6, 5) for p in prompts]
    llm = LLM(model=str(path), dtype="float32", max_model_len=128, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)
    outs = llm.generate(token_requests(prompts), params, use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        assert_matches(f"mamba2-chunked-{i}", out, ref)
