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
