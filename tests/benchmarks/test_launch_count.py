"""benchmarks.launch_count: the launches of a decode forward's layer, fused and unfused, on two
real architectures' configs at small widths (the launches do not depend on them)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import launch_count

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="launch_count counts in Triton's interpreter (CPU)"
)

SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=512, bos_token_id=1, eos_token_id=2)  # fmt: skip


@pytest.mark.parametrize(("config", "unfused"), [("qwen3-0.6b", 23), ("llama-3.2-1b", 18)])
def test_fused_layer_launches(tmp_path, config, unfused):
    rec = launch_count.count(config, tmp_path, **SMALL)
    fused = rec["fused"]
    # 4 GEMMs, two residual adds each fused with the norm after it, rope (Qwen3's q/k norms in
    # it, the KV write too), attention, gated SiLU
    assert fused["per_layer_ops"] == {
        "mm": 4,
        "triton:add_rms_norm_kernel": 2,
        "triton:rope_qk_kernel": 1,
        "triton:paged_attention_kernel": 1,
        "triton:silu_and_mul_kernel": 1,
    }
    assert rec["unfused"]["per_layer"] == unfused  # the torch ops of the layers before
    assert "triton:rms_norm_kernel" in rec["unfused"]["per_layer_ops"]
    depth = rec["depth"]
    assert fused["per_forward_at_depth"] == fused["fixed"] + 9 * depth
