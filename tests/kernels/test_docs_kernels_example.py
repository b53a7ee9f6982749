"""docs/kernels.md's usage example, run as written (on the CPU in Triton's interpreter when no
GPU is there): its calls match the wrappers' signatures and its output matches the reference."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from paged_kernels import ref_paged_attention

KERNELS_MD = Path(__file__).resolve().parents[2] / "docs" / "kernels.md"


def _example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", KERNELS_MD.read_text(), re.S)
    found = [b for b in blocks if "paged_attention(" in b and "write_kv_cache(" in b]
    assert len(found) == 1, f"expected one paged_attention example in docs/kernels.md: {found}"
    return found[0]


def test_kernels_md_example_runs_and_matches_reference(seed: int) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    code = _example().replace('device="cuda"', f'device="{device}"')
    ns: dict[str, Any] = {}
    exec(compile(code, "<docs/kernels.md example>", "exec"), ns)
    out, q = ns["out"], ns["q"]
    assert out.shape == (6, ns["heads"], ns["dim"]) and out.dtype == q.dtype  # "[6, heads, dim]"
    # write_kv_cache put each token's K / V at its slot
    slots = ns["slot_mapping"]
    k_flat = ns["k_cache"].view(-1, ns["kv_heads"], ns["dim"])
    assert torch.equal(k_flat[slots], ns["k"])
    ref = ref_paged_attention(
        q,
        ns["k_cache"],
        ns["v_cache"],
        ns["block_tables"],
        ns["cu_seqlens_q"],
        ns["seq_lens"],
        ns["dim"] ** -0.5,
    )
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
