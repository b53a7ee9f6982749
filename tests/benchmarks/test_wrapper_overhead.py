"""benchmarks/wrapper_overhead.py: the wrappers' host time with the launches stubbed."""

from __future__ import annotations

import paged_kernels.attention as attention
from benchmarks import wrapper_overhead


def test_times_each_wrapper_and_restores_the_kernels():
    kernel = attention._paged_attention_kernel
    res = wrapper_overhead.run(tokens=64, reps=3)
    assert attention._paged_attention_kernel is kernel  # the real kernel is back
    names = {"paged_attention", "add_rms_norm", "rope_qk_", "write_kv_cache", "silu_and_mul"}
    assert set(res["us_per_call"]) == names
    assert all(us > 0 for us in res["us_per_call"].values())
    assert res["us_per_layer"] > sum(res["us_per_call"].values())  # two norms a layer
