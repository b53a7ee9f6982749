"""kv_cache_dtype="fp8" / "fp8_e5m2": the engine stores K/V in 8 bits with per-layer k_scale /
v_scale (the checkpoint's, else calibrated at load: worker/kv_scales.py), so the same memory
holds 2x the blocks of a 16-bit cache (4x of fp32), and greedy outputs stay close to the
unquantized cache's.

How close, measured on the 7 tiny random-weight architectures (float32 model, greedy tokens of
the float32 cache, then every position re-scored by the fp8 engine with the float32 outputs as
its input, "teacher forcing"; the CPU backend). With 6 prompts x 24 tokens (this test): e4m3
picks the same argmax at 98.2% of the 1008 positions (94.4% for the worst architectures, llama
and mistral), e5m2 at 95.9%. With 30 prompts (5040 positions): e4m3 97.8%, worst 93.9% (llama);
e5m2 95.8%, worst 88.3%; the chosen tokens' logprobs differ by 0.014 (e4m3) / 0.027 (e5m2) on
average, 0.32 / 0.75 at most. Calibrated scales change none of this against scales of 1.0
(llama 676 vs 675 of 720): these models' K/V (|x| up to ~7) sit in e4m3's normal range either
way. The flips are near-ties: the float32 cache's top-2 logprob margin at llama's flipped
positions is 0.005-0.06, under e4m3's 3-bit-mantissa noise (mean |dlogprob| 0.024), and 15% of
its positions have a margin under 0.03. The bounds below leave some room over those numbers.
Free-running sequences agree less (one flipped near-tie changes the rest of a sequence), which is
why the comparison is position by position.
"""

from __future__ import annotations

import json
import math
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_cpu_attention import make_batch, random_mix, to_planes  # tests/engine is on sys.path

from paged_engine import LLM, EngineConfig, SamplingParams
from paged_engine.attention.cpu_backend import CpuBackend
from paged_engine.testing import SUPPORTED_TINY_ARCHS
from paged_engine.worker.cache_engine import CacheEngine
from paged_engine.worker.kv_scales import attention_layers, calibration_amax
from paged_kernels import (
    alibi_slopes,
    ref_copy_blocks,
    ref_paged_attention,
    ref_quantize,
    ref_write_kv_cache,
)

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]

# kv_cache_dtype -> (overall argmax agreement, worst architecture's, max |logprob diff|, mean)
BOUNDS = {"fp8": (0.95, 0.9, 0.3, 0.03), "fp8_e5m2": (0.9, 0.8, 0.5, 0.06)}


def _llm(path, kv_cache_dtype: str, **kw) -> LLM:
    kw.setdefault("cpu_kv_cache_gib", 2**-6)
    kw.setdefault("max_model_len", 256)
    return LLM(model=str(path), dtype="float32", kv_cache_dtype=kv_cache_dtype, **kw)


def _scales(llm: LLM) -> list[tuple[float, float]]:
    layers = attention_layers(llm.llm_engine.model_runner.model)
    return [(layers[i].k_scale, layers[i].v_scale) for i in sorted(layers)]


def _prompts() -> list[dict]:
    rng = random.Random(0)
    return [
        {"prompt_token_ids": [rng.randrange(3, 500) for _ in range(rng.randrange(5, 60))]}
        for _ in range(6)
    ]


def _greedy(llm: LLM, prompts, max_tokens: int = 24):
    """[(prompt ids, output ids, output logprobs)]."""
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=0, ignore_eos=True)
    out = []
    for o in llm.generate(prompts, sp, use_tqdm=False):
        c = o.outputs[0]
        lps = [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]
        out.append((list(o.prompt_token_ids), list(c.token_ids), lps))
    return out


def _teacher_forced(llm: LLM, ref) -> tuple[int, int, list[float]]:
    """(positions where llm's argmax is the reference token, positions, |logprob diffs|)."""
    full = [{"prompt_token_ids": p + o} for p, o, _ in ref]
    outs = llm.generate(full, SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    agree, diffs = 0, []
    for (p, o, lps), out in zip(ref, outs):
        for j, (token, lp) in enumerate(zip(o, lps)):
            got = out.prompt_logprobs[len(p) + j][token]
            agree += got.rank == 1
            diffs.append(abs(got.logprob - lp))
    return agree, len(diffs), diffs


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_fp8_greedy_close_to_float_cache(tiny_model_factory, kv_cache_dtype):
    overall, worst_arch, max_diff, mean_diff = BOUNDS[kv_cache_dtype]
    expected = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kv_cache_dtype]
    agree = total = 0
    diffs: list[float] = []
    for arch in SUPPORTED_TINY_ARCHS:
        path = tiny_model_factory(arch)
        llm = _llm(path, "auto")
        ref = _greedy(llm, _prompts())
        llm.llm_engine.shutdown()
        llm = _llm(path, kv_cache_dtype)
        assert llm.llm_engine.model_runner.cache.kv_caches[0][0].dtype == expected
        a, n, d = _teacher_forced(llm, ref)
        llm.llm_engine.shutdown()
        print(f"{arch} {kv_cache_dtype}: {a}/{n} agree, |dlogprob| max {max(d):.3f}")
        assert a / n >= worst_arch, f"{arch}: {a}/{n} positions agree"
        agree, total = agree + a, total + n
        diffs += d
    assert agree / total >= overall, f"{agree}/{total} positions agree"
    assert max(diffs) <= max_diff and sum(diffs) / len(diffs) <= mean_diff


@pytest.mark.parametrize("backend", ["triton", "cpu"])
def test_fp8_backends_match_reference(tiny_model_factory, backend):
    """The Triton kernels (interpreter) and the CPU backend on an fp8 cache give the torch
    reference's tokens and logprobs (the same calibrated scales everywhere)."""
    path = tiny_model_factory("llama")
    prompts, max_tokens, kw = _prompts()[:3], 8, {}
    if backend == "triton":
        # The interpreter runs each program in Python, and the per-token kernels launch one
        # per token: a 36-token step budget (which also caps the scales' calibration forward,
        # 512 tokens by default), prompts of 12 tokens (two 8-token blocks), 3 decode steps.
        max_tokens, kw = 4, {"max_num_batched_tokens": 36, "block_size": 8}
        prompts = [{"prompt_token_ids": p["prompt_token_ids"][:12]} for p in prompts]
    runs = []
    for name in ("torch", backend):
        llm = _llm(path, "fp8", attention_backend=name, **kw)
        runs.append((_scales(llm), _greedy(llm, prompts, max_tokens=max_tokens)))
        llm.llm_engine.shutdown()
    (ref_scales, ref), (got_scales, got) = runs
    assert got_scales == ref_scales
    assert [o for _, o, _ in got] == [o for _, o, _ in ref]
    for (_, _, a), (_, _, b) in zip(got, ref):
        assert a == pytest.approx(b, abs=1e-4)


def test_fp8_doubles_blocks_for_the_same_memory(tiny_model_factory):
    path = tiny_model_factory("qwen2")
    blocks = {}
    for dtype, kv in (("float32", "auto"), ("float16", "auto"), ("float16", "fp8")):
        llm = LLM(
            model=str(path), dtype=dtype, max_model_len=128, kv_cache_dtype=kv,
            cpu_kv_cache_gib=2**-10, attention_backend="torch",  # 1 MiB
        )  # fmt: skip
        blocks[(dtype, kv)] = llm.llm_engine.num_blocks
        llm.llm_engine.shutdown()
    assert blocks[("float16", "fp8")] == 2 * blocks[("float16", "auto")]
    assert blocks[("float16", "fp8")] == 4 * blocks[("float32", "auto")]
    hf = _hf(path)
    fp16 = CacheEngine.bytes_per_block(hf, 16, torch.float16)
    assert CacheEngine.bytes_per_block(hf, 16, torch.float8_e4m3fn) * 2 == fp16


def test_fp8_swap_preemption_and_cpu_tier_keep_outputs(tiny_model_factory):
    """fp8 blocks swapped to the CPU pool and back, or kept in the prefix cache's CPU tier,
    come back byte for byte: the outputs of an unconstrained fp8 engine, every block free."""
    path = tiny_model_factory("llama")
    block_bytes = CacheEngine.bytes_per_block(_hf(path), 16, torch.float8_e4m3fn)
    cpu_gib = 64 * block_bytes / 2**30
    prompts = _prompts()
    llm = _llm(path, "fp8", max_model_len=128)
    want = _greedy(llm, prompts)
    llm.llm_engine.shutdown()
    for kw in (
        {"preemption_mode": "swap", "swap_space": cpu_gib, "enable_prefix_caching": False},
        {"cpu_offload_gib": cpu_gib},
    ):
        llm = _llm(path, "fp8", num_gpu_blocks_override=14, max_model_len=128, **kw)
        got = _greedy(llm, prompts)
        got += _greedy(llm, prompts[:2])  # the tier: prompts seen before, evicted since
        stats = llm.llm_engine.get_stats()
        llm.llm_engine.shutdown()
        assert [o for _, o, _ in got] == [o for _, o, _ in want + want[:2]]
        for (_, _, a), (_, _, b) in zip(got, want + want[:2]):
            assert a == pytest.approx(b, abs=1e-4)
        if "swap_space" in kw:
            assert stats.num_swap_preemptions > 0
        else:
            assert stats.prefix_cache_cpu_hits > 0
        assert stats.num_used_blocks == 0 and stats.num_free_cpu_blocks == stats.num_cpu_blocks


def _hf(path):
    import transformers

    return transformers.AutoConfig.from_pretrained(path)


def test_kv_cache_dtype_validation():
    with pytest.raises(ValueError, match="kv_cache_dtype='int8'"):
        EngineConfig(kv_cache_dtype="int8")


def test_server_flags_and_option_errors():
    from paged_server.cli import parse_args

    args = parse_args(["m", "--kv-cache-dtype", "fp8_e5m2", "--swap-space", "2",
                       "--preemption-mode", "swap", "--cpu-offload-gib", "0.5"])  # fmt: skip
    assert (args.kv_cache_dtype, args.swap_space) == ("fp8_e5m2", 2.0)
    assert (args.preemption_mode, args.cpu_offload_gib) == ("swap", 0.5)
    with pytest.raises(ValueError, match="preemption_mode='swap' needs swap_space"):
        EngineConfig(preemption_mode="swap")
    with pytest.raises(ValueError, match="preemption_mode='later'"):
        EngineConfig(preemption_mode="later", swap_space=1)
    with pytest.raises(ValueError, match="swap_space=-1"):
        EngineConfig(swap_space=-1)
    with pytest.raises(ValueError, match="cpu_offload_gib=inf"):
        EngineConfig(cpu_offload_gib=float("inf"))


def test_calibrated_scales(tiny_model_factory):
    """Without checkpoint scales, each layer's K and V scales are powers of two that put the
    calibration forward's amax in (fmax/4, fmax/2]; the same on every load, unchanged by
    serving (blocks already written keep their meaning)."""
    path = tiny_model_factory("qwen2")
    runs = []
    for kv, fmax in (("fp8", 448.0), ("fp8", 448.0), ("fp8_e5m2", 57344.0)):
        llm = _llm(path, kv)
        runner = llm.llm_engine.model_runner
        scales = _scales(llm)
        layers = attention_layers(runner.model)
        amax = calibration_amax(runner, [layers[i] for i in sorted(layers)])
        for (k, v), (k_amax, v_amax) in zip(scales, amax.tolist()):
            for s, a in ((k, k_amax), (v, v_amax)):
                assert math.log2(s).is_integer() and fmax / 4 < a / s <= fmax / 2, (s, a)
        _greedy(llm, _prompts()[:2], max_tokens=4)
        assert _scales(llm) == scales
        runs.append(scales)
        llm.llm_engine.shutdown()
    assert runs[0] == runs[1] and runs[0] != [(1.0, 1.0)] * len(runs[0])
    assert runs[2] != runs[0]  # e5m2's range is wider: smaller scales


def _f32(x: float) -> float:
    """x as a checkpoint stores it (float32)."""
    return float(torch.tensor(x))


def _with_scales(src, dst, scales: dict[str, float]):
    """A copy of model dir `src` whose checkpoint also carries the given scale tensors."""
    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    weights.update({name: torch.tensor(value) for name, value in scales.items()})
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_scales_loaded_from_the_checkpoint(tiny_model_factory, tmp_path):
    """vLLM / llm-compressor (`self_attn.k_scale`), compressed-tensors (`k_proj.output_scale`)
    and the older single `kv_scale` load into the layers; a layer without them is calibrated; an
    auto cache ignores them; a non-positive scale is refused naming the tensor."""
    src = tiny_model_factory("llama")  # 2 layers
    path = _with_scales(src, tmp_path / "a", {
        "model.layers.0.self_attn.k_scale": 0.05,
        "model.layers.0.self_attn.v_scale": 0.0625,
        "model.layers.1.self_attn.k_proj.output_scale": 0.02,
        "model.layers.1.self_attn.v_proj.output_scale": 0.03,
        "model.layers.1.self_attn.q_proj.output_scale": 0.5,  # fp8 attention only: ignored
    })  # fmt: skip
    plain = _llm(src, "auto")
    ref = _greedy(plain, _prompts())
    plain.llm_engine.shutdown()
    llm = _llm(path, "auto")  # the scale tensors load (and are ignored) with a float cache
    assert _greedy(llm, _prompts()) == ref and _scales(llm) == [(1.0, 1.0)] * 2
    llm.llm_engine.shutdown()
    llm = _llm(path, "fp8")
    assert _scales(llm) == [(_f32(0.05), 0.0625), (_f32(0.02), _f32(0.03))]
    agree, total, _ = _teacher_forced(llm, ref)  # the scales are used by writes and reads
    llm.llm_engine.shutdown()
    assert agree / total >= 0.9, f"{agree}/{total}"

    partial = _with_scales(src, tmp_path / "b", {"model.layers.1.self_attn.kv_scale": 0.04})
    llm = _llm(partial, "fp8")
    (k0, _), layer1 = _scales(llm)
    llm.llm_engine.shutdown()
    assert layer1 == (_f32(0.04), _f32(0.04)) and math.log2(k0).is_integer()

    bad = _with_scales(src, tmp_path / "c", {"model.layers.0.self_attn.v_scale": 0.0})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.v_scale"):
        _llm(bad, "fp8")


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_parallel_ranks_calibrate_the_single_process_scales(tiny_model_factory, tmp_path, tp, pp):
    """Tensor parallelism: each rank sees only its KV heads, and the scales are the max over
    the ranks, so every rank has the single process's scales. Layer 0's second KV head (rank
    1's shard) is made 8x larger, so rank 0's own amax alone would give a smaller scale (1/8 for
    K). Pipeline parallelism: the second stage calibrates on the first stage's hidden states
    (outputs equal the single process's)."""
    src = tiny_model_factory("llama")  # 2 KV heads: one per rank
    path = tmp_path / "skewed"
    shutil.copytree(src, path)
    weights = load_file(path / "model.safetensors")
    head_dim = json.loads((path / "config.json").read_text())["head_dim"]
    for proj in ("k_proj", "v_proj"):
        weights[f"model.layers.0.self_attn.{proj}.weight"][head_dim:] *= 8
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    prompts = _prompts()[:3]
    one = _llm(path, "fp8")
    want_scales, want = _scales(one), _greedy(one, prompts, max_tokens=6)
    one.llm_engine.shutdown()
    two = _llm(path, "fp8", tensor_parallel_size=tp, pipeline_parallel_size=pp)
    got_scales, got = _scales(two), _greedy(two, prompts, max_tokens=6)  # rank 0's scales
    two.llm_engine.shutdown()
    assert got_scales == want_scales[: len(got_scales)] and len(got_scales) == 2 // pp
    assert [o for _, o, _ in got] == [o for _, o, _ in want]
    for (_, _, a), (_, _, b) in zip(got, want):
        assert a == pytest.approx(b, abs=1e-4)


def test_pp2_with_scales_for_the_first_stage_only(tiny_model_factory, tmp_path):
    """Checkpoint scales for layer 0 (stage 0) only: stage 1 calibrates, and stage 0 still runs
    the calibration forward that feeds it (no hang); the outputs are the single process's."""
    src = tiny_model_factory("llama")
    path = _with_scales(src, tmp_path / "a", {"model.layers.0.self_attn.kv_scale": 0.0625})
    runs = []
    for pp in (1, 2):
        llm = _llm(path, "fp8", pipeline_parallel_size=pp)
        runs.append((_scales(llm)[0], _greedy(llm, _prompts()[:2], max_tokens=6)))
        llm.llm_engine.shutdown()
    (one_scales, one), (two_scales, two) = runs
    assert one_scales == two_scales == (0.0625, 0.0625)
    assert [o for _, o, _ in two] == [o for _, o, _ in one]
    for (_, _, a), (_, _, b) in zip(two, one):
        assert a == pytest.approx(b, abs=1e-4)


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_backend_fp8_matches_reference(cache_dtype, dtype):
    """The CPU backend's fp8 writes give the reference's bits; its attention over an fp8 cache
    (non-unit scales, mixed decode / prefill / chunked rows, GQA, window, soft cap, ALiBi)
    matches the reference's; block copies move the bytes."""
    rng = random.Random(str((cache_dtype, dtype)))
    torch.manual_seed(rng.randrange(2**31))
    k_scale, v_scale = 0.3, 2.0**-3
    q_lens, ctx = random_mix(rng, 9, 40)
    q, kc, vc, md = make_batch(
        q_lens, ctx, num_heads=8, num_kv_heads=2, head_dim=32, block_size=4, dtype=dtype
    )
    key_cache = ref_quantize(kc * 0.2, cache_dtype, k_scale)
    value_cache = ref_quantize(vc * 3.0, cache_dtype, v_scale)
    # This step's K/V (some padding slots) through both writers: the same bits.
    num_tokens = int(md.cu_seqlens_q[-1])
    new_k, new_v = (torch.randn(num_tokens, 2, 32).to(dtype) for _ in range(2))
    slots = torch.randperm(key_cache.shape[0] * key_cache.shape[1])[:num_tokens]
    slots[torch.rand(num_tokens) < 0.2] = -1
    backend = CpuBackend()
    planes_k, planes_v = to_planes(key_cache), to_planes(value_cache)
    backend.write_kv(new_k, new_v, planes_k, planes_v, slots, k_scale=k_scale, v_scale=v_scale)
    ref_write_kv_cache(
        new_k, new_v, key_cache, value_cache, slots, k_scale=k_scale, v_scale=v_scale
    )
    for got, want in ((planes_k, key_cache), (planes_v, value_cache)):
        assert torch.equal(got.view(torch.uint8), to_planes(want).view(torch.uint8))
    md.backend = backend
    scale = 32**-0.5
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    cases = [{}, {"sliding_window": 7}, {"soft_cap": 5.0, "alibi_slopes": alibi_slopes(8)}]
    for kw in cases:
        want = ref_paged_attention(
            q, key_cache, value_cache, md.block_tables, md.cu_seqlens_q, md.seq_lens, scale,
            k_scale=k_scale, v_scale=v_scale, **kw,
        )  # fmt: skip
        args = {"sliding_window": None, "soft_cap": None, "alibi_slopes": None, **kw}
        got = backend.attend(
            q, planes_k, planes_v, md, scale=scale, k_scale=k_scale, v_scale=v_scale, **args
        )
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    mapping = torch.tensor([[1, 5], [3, 6]])
    backend.copy_blocks([planes_k], [planes_v], mapping)
    ref_copy_blocks([key_cache], [value_cache], mapping)
    for got, want in ((planes_k, key_cache), (planes_v, value_cache)):
        assert torch.equal(got.view(torch.uint8), to_planes(want).view(torch.uint8))
