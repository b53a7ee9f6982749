"""benchmarks.gpu_profile: the trace arithmetic on a synthetic Kineto trace, and a CPU run."""

from __future__ import annotations

import json

from benchmarks import gpu_profile


def _x(cat: str, name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_union_clips_and_merges():
    # [0,10) and [5,15) merge to [0,15); [20,30) clipped to [20,25); [40,50) is outside
    got = gpu_profile._union_us([(5, 15), (0, 10), (20, 30), (40, 50)], 0, 25)
    assert got == 20


def test_summary_of_a_synthetic_trace(tmp_path):
    # two 100 us steps; kernels cover 150 us of the 200 us span; 30 us of host sync per step
    events = [
        _x("user_annotation", gpu_profile.STEP, 0, 100),
        _x("user_annotation", gpu_profile.STEP, 100, 100),
        _x("kernel", "attn", 0, 60),
        _x("kernel", "gemm", 50, 30),  # overlaps attn by 10
        _x("kernel", "attn", 100, 60),
        _x("gpu_memcpy", "Memcpy DtoH", 170, 10),
        _x("cuda_runtime", "cudaStreamSynchronize", 60, 30),
        _x("cuda_runtime", "cudaEventSynchronize", 160, 30),
        _x("cuda_runtime", "cudaLaunchKernel", 0, 5),
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    s = gpu_profile.summarize_trace(path)
    assert s["steps"] == 2
    assert s["wall_ms_per_step"] == 0.1
    assert s["sync_wait_ms_per_step"] == 0.03 and s["host_ms_per_step"] == 0.07
    # busy = [0,80) + [100,160) + [170,180) = 150 of 200 us
    assert s["gpu_idle_fraction"] == 0.25 and s["gpu_ms_per_step"] == 0.075
    top = s["top_kernels"][0]
    assert top["name"] == "attn" and top["calls"] == 2 and top["total_ms"] == 0.12
    calls = {c["name"]: c for c in s["runtime_calls"]}  # host time in CUDA calls, per step
    assert calls["cudaStreamSynchronize"] == {
        "name": "cudaStreamSynchronize",
        "calls_per_step": 0.5,
        "ms_per_step": 0.015,
    }
    assert s["runtime_calls"][-1]["name"] == "cudaLaunchKernel"
    assert abs(sum(k["share"] for k in s["top_kernels"]) - 1.0) < 1e-3


def test_host_only_trace_reports_host_ops(tmp_path):
    events = [
        _x("user_annotation", gpu_profile.STEP, 0, 100),
        _x("cpu_op", "aten::mm", 10, 40),
        _x("cpu_op", "aten::mm", 60, 20),
        _x("cpu_op", "aten::add", 90, 5),
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    s = gpu_profile.summarize_trace(path)
    assert s["gpu_idle_fraction"] is None
    assert s["top_host_ops_inclusive"][0] == {"name": "aten::mm", "ms_per_step": 0.06}


def test_sync_points_name_each_call_site_once(monkeypatch):
    """Every warning torch's sync debug mode raises in the steps is one call site, counted."""
    import warnings

    modes = []
    monkeypatch.setattr(gpu_profile.torch.cuda, "set_sync_debug_mode", modes.append)

    def step(engine):
        warnings.warn("Synchronization debug mode is a prototype feature", stacklevel=1)
        for _ in range(2):
            warnings.warn("called a synchronizing CUDA operation", stacklevel=1)
        return 1

    monkeypatch.setattr(gpu_profile, "_engine_step", step)
    sites = gpu_profile._sync_points(None, 3)
    assert modes == ["warn", "default"]  # switched on for the steps only
    assert len(sites) == 1 and sites[0]["count"] == 6
    assert "test_gpu_profile.py" in sites[0]["site"] or "gpu_profile.py" in sites[0]["site"]


def test_host_functions_profile_the_steps(monkeypatch):
    def step(engine):
        sum(range(20_000))
        return 1

    monkeypatch.setattr(gpu_profile, "_engine_step", step)
    res = gpu_profile._host_functions(None, 4)
    names = [r["function"] for r in res["by_inclusive_time"]]
    assert any("step" in n for n in names)
    assert all(r["calls_per_step"] > 0 for r in res["by_own_time"])


def test_jit_builds_by_phase():
    """Triton's compile hooks are installed for the run, each build lands in the phase it
    happened in, and the hooks that were there before come back."""
    from triton import knobs

    saved = knobs.runtime.jit_cache_hook
    with gpu_profile.JitBuilds() as jit:
        assert knobs.runtime.jit_cache_hook == jit.before
        assert jit.before(key="k") is False  # never tells Triton to skip the compile
        jit.after(repr="_rope_qk_kernel[num_warps=4](qkv_ptr: *bf16)")
        jit.phase = "prefill"
        for _ in range(2):
            jit.before()
            jit.after(repr="_paged_attention_kernel[num_warps=4](q_ptr: *bf16)")
    assert knobs.runtime.jit_cache_hook is saved
    got = jit.summary()
    assert got["start"]["builds"] == 1 and got["start"]["kernels"] == {"_rope_qk_kernel": 1}
    assert got["prefill"]["kernels"] == {"_paged_attention_kernel": 2}
    assert got["prefill"]["seconds"] >= 0 and "decode" not in got
    # after the start each build keeps its specialization: what a step changed
    assert "variants" not in got["start"]
    assert got["prefill"]["variants"] == ["_paged_attention_kernel[num_warps=4](q_ptr: *bf16)"] * 2


def test_cpu_run_with_final_outputs_only(tmp_path):
    """The whole profile on CPU (smoke sizes): engine start, steady steps, host functions; with
    --final-only the requests ask for their final output alone, as LLM.generate's do."""
    args = ["--smoke", "--final-only", "--profile-prefill", "--batch", "2", "--steps", "2"]
    assert gpu_profile.main([*args, "--out", str(tmp_path), "--work-dir", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "gpu_profile.json").read_text())
    assert res["outputs"].startswith("final only") and res["norms"] == "torch ops"
    assert res["rope"] == res["residual_adds"] == res["gated_silu"] == "torch ops"  # CPU backend
    assert res["batch"] == 2 and res["steps"] == 2 and res["gpu_idle_fraction"] is None
    prefill = res["prefill_profile"]  # --profile-prefill: the admission steps summarized too
    assert prefill["steps"] == res["warmup_steps"] and prefill["wall_ms_per_step"] > 0
    assert prefill["host_functions"]["by_inclusive_time"]  # and its Python functions
    assert res["jit_builds"] is None  # the interpreter builds nothing
    assert res["host_functions"]["by_inclusive_time"] and res["decode_tokens_per_s_unprofiled"] > 0


def test_layer_kernels_and_unfused(tmp_path, monkeypatch):
    """The record names the kernels the Triton backend swapped into the layers; --unfused
    leaves the norms alone on their kernel (the engine before the fused epilogues)."""
    from paged_engine import LLM
    from paged_engine.testing import write_tiny_model
    from paged_engine.worker import worker

    kw = dict(model=str(write_tiny_model(tmp_path, "qwen3")), attention_backend="triton")
    kw.update(dtype="float32", max_model_len=64, num_gpu_blocks_override=32)
    fused = gpu_profile._layer_kernels(LLM(**kw).llm_engine)
    assert fused == {
        "norms": "paged_kernels.rms_norm",
        "residual_adds": "paged_kernels.add_rms_norm",
        "rope": "paged_kernels.rope_qk_",
        "gated_silu": "paged_kernels.silu_and_mul",
        "sampler_race": "torch ops",  # gumbel_race on CUDA engines only
    }
    for name in ("use_triton_norms", "use_triton_rope", "use_triton_activations"):
        monkeypatch.setattr(worker, name, getattr(worker, name))  # restored after the test
    gpu_profile._unfuse_layers()
    unfused = gpu_profile._layer_kernels(LLM(**kw).llm_engine)
    assert unfused == {**dict.fromkeys(fused, "torch ops"), "norms": "paged_kernels.rms_norm"}


def test_idle_gaps_split_host_late_from_queued():
    """A gap whose op was launched before the GPU went idle is the device's; one launched after
    is the host's, named by the host op around the launch."""

    def op(cat, name, ts, dur, corr=None, tid=1):
        e = _x(cat, name, ts, dur) | {"tid": tid}
        return e | {"args": {"correlation": corr}} if corr is not None else e

    spans = [
        op("kernel", "A", 0, 10, corr=1),
        op("cuda_runtime", "cudaLaunchKernel", 0, 1, corr=1),
        op("kernel", "B", 15, 5, corr=2),  # queued at 2, idle 10..15: the device's
        op("cuda_runtime", "cudaGraphLaunch", 2, 1, corr=2),
        op("cpu_op", "aten::copy_", 24, 6),
        op("cpu_op", "aten::to", 23, 8),
        op("cuda_runtime", "cudaMemcpyAsync", 25, 1, corr=3),
        op("gpu_memcpy", "Memcpy HtoD", 27, 3, corr=3),  # launched at 25, idle 20..27: host late
    ]
    g = gpu_profile.idle_gaps(spans, 0, 40, steps=2)
    assert g["idle_ms_per_step"] == 0.011  # (5 + 7 + 10 after the last op) / 2 steps
    assert g["host_late_ms_per_step"] == 0.0035 and g["gaps_per_step"] == 1.0
    late, queued = g["top"]
    assert late == {
        "before": "B",
        "after": "Memcpy HtoD",
        "launched_by": "cudaMemcpyAsync in aten::copy_",
        "gaps_per_step": 0.5,
        "ms_per_step": 0.0035,
        "host_late_share": 1.0,
    }
    assert queued["before"] == "A" and queued["after"] == "B"
    assert queued["launched_by"] == "cudaGraphLaunch in (no op)" and queued["host_late_share"] == 0
