"""benchmarks/wrapper_overhead.py: the wrappers' host time with the launches stubbed."""

from __future__ import annotations

import paged_kernels.attention as attention
from benchmarks import wrapper_overhead


def test_times_each_wrapper_and_restores_the_kernels():
    kernel = attention._paged_attention_kernel
    res = wrapper_overhead.run(tokens=64, reps=3)
    assert attention._paged_attention_kernel is kernel  # the real kernel is back
    us = res["us_per_call"]
    names = {"paged_attention", "add_rms_norm", "rope_qk_", "write_kv_cache", "silu_and_mul"}
    assert set(us) == names | {"rope_qk_+kv"}
    assert all(t > 0 for t in us.values())
    # a layer: attention, two norms, gated SiLU and the rope storing K/V (or rope, then write)
    common = us["paged_attention"] + 2 * us["add_rms_norm"] + us["silu_and_mul"]
    assert res["us_per_layer"] == round(common + us["rope_qk_+kv"], 1)
    assert res["us_per_layer_write_apart"] == round(
        common + us["rope_qk_"] + us["write_kv_cache"], 1
    )
