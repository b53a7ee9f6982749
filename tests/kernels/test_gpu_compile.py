"""Every kernel launch of the wrappers compiles for Hopper (sm_90) down to a cubin, on this CPU
machine (tests/kernels/gpu_compile.py; Triton bundles ptxas), fits its shared memory and
spills no registers.

The interpreter tests check what the kernels compute; this checks that the GPU compiler accepts
them with the wrappers' real constexprs, warps and stages before a GPU is rented.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from paged_kernels import triton_available

SCRIPT = Path(__file__).with_name("gpu_compile.py")


def _run(arch: int) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton's default until 3.10; set to keep it quiet
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--arch", str(arch), "--no-spills"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )


@pytest.mark.skipif(not triton_available(), reason="needs triton")
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU compiles the kernels natively")
def test_every_kernel_launch_compiles_for_hopper():
    proc = _run(90)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "paged_attention mixed bf16 batch_invariant" in proc.stdout
    assert "int4_linear bf16 T=512" in proc.stdout
    assert "add_rms_norm bf16 width 32" in proc.stdout  # 64 rows a program
    assert proc.stdout.count("\nok ") + proc.stdout.startswith("ok ") >= 25
