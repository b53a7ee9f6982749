"""Kernel launches in one decode forward, with the fused layer epilogues and without them.

    python -m benchmarks.launch_count [--model-config qwen3-0.6b] [--out DIR]     (CPU)

A real architecture's config (benchmarks/configs/, dummy bf16 weights) built with one and with
two layers runs one decode forward of 2 sequences on the Triton path (Triton's interpreter, so
no GPU is needed); every launch the host issues is counted: each aten op that computes (views
and allocations are not launches) and each Triton kernel call. Two layers minus one layer is
what a layer launches; the rest (embedding, final norm, LM head) is fixed, so the count at the
config's real depth follows. Two modes on the same weights:
- fused: what the worker switches in where the Triton backend runs (layers/triton_layers.py);
- unfused: norms as paged_kernels.rms_norm alone, residual adds, rope and gated SiLU on torch
  ops (the engine before its fused epilogues; `gpu_profile --unfused` on a GPU).
A GPU launches what the host issues (cuBLAS may split a GEMM, which both modes share); each
launch costs a GPU ~1-2 us of gap inside a CUDA graph and its own memory traffic outside one.
Writes `launch_count.json`.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: a CPU count

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

NOT_LAUNCHES = {
    "view", "_unsafe_view", "reshape", "_reshape_alias", "split", "split_with_sizes", "slice",
    "select", "unsqueeze", "squeeze", "expand", "t", "transpose", "permute", "as_strided",
    "detach", "alias", "unbind", "narrow", "chunk", "lift_fresh", "empty", "empty_like",
    "empty_strided", "new_empty",
}  # fmt: skip
SEQS, PROMPT = 2, 6


class _Launches(TorchDispatchMode):
    """Counts aten ops that compute, and Triton launches (none of the ops inside one)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.inside = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if not self.inside and name not in NOT_LAUNCHES:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))

    def triton(self, name: str) -> None:
        self.counts[f"triton:{name.lstrip('_')}"] += 1


def _decode_forward_launches(model, counter: _Launches) -> Counter[str]:
    """Launches of one decode forward (logits included) after a prefill, over a small paged
    cache on the Triton backend."""
    from paged_engine.attention import get_attention_backend
    from paged_engine.layers.attention import Attention, AttentionMetadata

    backend = get_attention_backend("triton", torch.device("cpu"))
    attn = [m for m in model.modules() if isinstance(m, Attention)]
    block, blocks = 16, 1 + SEQS * 2
    caches = [
        tuple(
            torch.zeros(blocks, block, a.num_kv_heads, a.head_dim, dtype=torch.bfloat16)
            for _ in "kv"
        )
        for a in attn
    ]

    def forward(lens_before: list[int], new: int):
        tokens = [(5 + s) % 100 for s in range(SEQS) for _ in range(new)]
        pos = [p for n in lens_before for p in range(n, n + new)]
        slots = [
            (1 + 2 * s) * block + p for s, n in enumerate(lens_before) for p in range(n, n + new)
        ]
        md = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=torch.tensor(
                [[1 + 2 * s, 2 + 2 * s] for s in range(SEQS)], dtype=torch.int32
            ),
            cu_seqlens_q=torch.arange(0, SEQS * new + 1, new, dtype=torch.int32),
            seq_lens=torch.tensor([n + new for n in lens_before], dtype=torch.int32),
            max_seqlen_q=new,
            max_seqlen_k=max(lens_before) + new,
            backend=backend,
        )
        hidden = model(torch.tensor(tokens), torch.tensor(pos), caches, md)
        return model.compute_logits(hidden)

    with torch.no_grad():  # (inference mode would show ops before their decomposition)
        forward([0] * SEQS, PROMPT)  # prefill, not counted
        counter.counts.clear()
        with counter:
            forward([PROMPT] * SEQS, 1)
    return Counter(counter.counts)


def count(model_config: str, work_dir: Path, **overrides) -> dict:
    """Both modes' launches a layer and a forward; `overrides` change the config (e.g. smaller
    widths: the launches do not depend on them)."""
    import triton.runtime.interpreter as interpreter

    from benchmarks.models import CONFIGS, config_dir
    from paged_engine.layers.norm import RMSNorm
    from paged_engine.layers.triton_layers import (
        use_triton_activations,
        use_triton_norms,
        use_triton_rope,
    )
    from paged_engine.loader import load_hf_config, load_model, resolve_model

    counter = _Launches()
    launch = interpreter.GridExecutor.__call__

    def counted(self, *args, **kwargs):
        counter.triton(getattr(self.fn, "__name__", "?"))
        counter.inside += 1
        try:
            return launch(self, *args, **kwargs)
        finally:
            counter.inside -= 1

    interpreter.GridExecutor.__call__ = counted
    depth = json.loads(CONFIGS[model_config].read_text())["num_hidden_layers"]
    modes: dict[str, dict] = {}
    try:
        for mode in ("unfused", "fused"):
            by_layers = {}
            for layers in (1, 2):
                spec = config_dir(model_config, work_dir / f"{model_config}-{layers}l", "cpu",
                                  **overrides, num_hidden_layers=layers)  # fmt: skip
                resolved = resolve_model(str(spec.path))
                model = load_model(resolved, load_hf_config(resolved), dtype=torch.bfloat16,
                                   device="cpu", load_format="dummy").eval()  # fmt: skip
                use_triton_norms(model)
                if mode == "fused":
                    use_triton_rope(model)
                    use_triton_activations(model)
                else:
                    for m in model.modules():
                        if isinstance(m, RMSNorm):
                            m.add_kernel = None
                by_layers[layers] = _decode_forward_launches(model, counter)
            layer = by_layers[2] - by_layers[1]
            fixed = by_layers[1] - layer
            per_layer, fixed_n = sum(layer.values()), sum(fixed.values())
            modes[mode] = {
                "per_layer": per_layer,
                "per_layer_ops": dict(layer.most_common()),
                "fixed": fixed_n,
                "fixed_ops": dict(fixed.most_common()),
                "per_forward_at_depth": fixed_n + per_layer * depth,
            }
    finally:
        interpreter.GridExecutor.__call__ = launch
    return {
        "model": f"{model_config} config{f' with {overrides}' if overrides else ''}, dummy bf16 "
        "weights",
        "depth": depth,
        "decode_batch": SEQS,
        "counted": "aten ops that compute + Triton kernel calls, one decode forward (logits "
        "included), Triton's interpreter on CPU",
        **modes,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-config", default="qwen3-0.6b", help="a name in benchmarks/configs")
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/paged-bench"))
    p.add_argument("--out", type=Path, default=Path("."))
    args = p.parse_args(argv)
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") in ("", "0"):
        sys.exit("launch_count counts on CPU: run it with TRITON_INTERPRET=1")
    rec = count(args.model_config, args.work_dir)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "launch_count.json").write_text(json.dumps(rec, indent=1) + "\n")
    for mode in ("unfused", "fused"):
        m = rec[mode]
        print(f"{mode:8s} {m['per_layer']} launches a layer ({m['per_layer_ops']}), "
              f"{m['per_forward_at_depth']} a decode forward at {rec['depth']} layers")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
