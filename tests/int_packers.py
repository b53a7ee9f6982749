"""GPTQ, AWQ and llm-compressor pack-quantized copies of a tiny checkpoint, packed here the way
those tools lay out their tensors (checked once against compressed-tensors' own packer and AWQ's
reference unpacking), for the engine's and the server's packed-checkpoint tests."""

from __future__ import annotations

import torch
from checkpoint_copies import quantized_copy

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column 8 j + AWQ_ORDER[i]


def _quantize(w: torch.Tensor, bits: int, group: int, sym: bool, perm: torch.Tensor | None):
    """w [N, K] -> (q [N, K] in [0, 2**bits), zero [N, G], scale [N, G] float16, g [K]): the
    inputs taken in `perm` order (GPTQ's act-order) fall into groups of `group`; zeros kept in
    [1, 2**bits - 1] (GPTQ v1 stores zero - 1)."""
    n, k = w.shape
    order = torch.arange(k) if perm is None else perm
    g = torch.empty(k, dtype=torch.long)
    g[order] = torch.arange(k) // group
    num_groups = k // group
    top = (1 << bits) - 1
    scale = torch.empty(n, num_groups)
    zero = torch.empty(n, num_groups, dtype=torch.int32)
    for j in range(num_groups):
        cols = w[:, g == j]
        if sym:
            scale[:, j] = cols.abs().amax(1) / ((top + 1) // 2 - 1)
            zero[:, j] = (top + 1) // 2
        else:
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            scale[:, j] = (hi - lo) / (top - 1)
            zero[:, j] = (torch.round(-lo / scale[:, j]) + 1).clamp(1, top).to(torch.int32)
    scale = scale.clamp(min=1e-4).half()
    q = torch.round(w / scale.float()[:, g]) + zero[:, g]
    return q.clamp(0, top).to(torch.int32), zero, scale, g


def _pack(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Pack int values along `dim`: word j holds entries j * (32 / bits) + i at bit bits * i."""
    per = 32 // bits
    v = values.to(torch.int64).movedim(dim, 0)
    out = torch.zeros((v.shape[0] // per, *v.shape[1:]), dtype=torch.int64)
    for i in range(per):
        out |= (v[i::per] & ((1 << bits) - 1)) << (bits * i)
    out = torch.where(out >= 2**31, out - 2**32, out)  # the same 32 bits as int32
    return out.to(torch.int32).movedim(0, dim).contiguous()


def _gptq(w, bits, group, sym, desc_act, fmt):
    perm = torch.randperm(w.shape[1], generator=torch.Generator().manual_seed(0))
    q, zero, scale, g = _quantize(w, bits, group, sym, perm if desc_act else None)
    stored_zero = zero - (1 if fmt == "gptq" else 0)
    tensors = {
        "qweight": _pack(q.t(), bits, 0),  # [K / per, N]
        "qzeros": _pack(stored_zero.t(), bits, 1),  # [G, N / per]
        "scales": scale.t().contiguous(),  # [G, N]
        "g_idx": g.to(torch.int32),
    }
    return tensors, (q - zero[:, g]).float() * scale.float()[:, g]


def _awq(w, group):
    q, zero, scale, g = _quantize(w, 4, group, False, None)

    def pack_awq(v):  # v [R, N] -> [R, N / 8]
        out = torch.zeros(v.shape[0], v.shape[1] // 8, dtype=torch.int64)
        for i, col in enumerate(AWQ_ORDER):
            out |= v[:, col::8].to(torch.int64) << (4 * i)
        return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)

    tensors = {
        "qweight": pack_awq(q.t()),
        "qzeros": pack_awq(zero.t()),
        "scales": scale.t().contiguous(),
    }
    return tensors, (q - zero[:, g]).float() * scale.float()[:, g]


def _compressed(w, bits, group, sym, actorder):
    perm = torch.randperm(w.shape[1], generator=torch.Generator().manual_seed(1))
    q, zero, scale, g = _quantize(w, bits, group, sym, perm if actorder else None)
    # pack-quantized stores each signed value plus 2**(bits-1): q and zero as _quantize has
    # them (a symmetric scheme's zero, 2**(bits-1), is the signed 0 and is not stored)
    tensors = {
        "weight_packed": _pack(q, bits, 1),  # [N, K / per]
        "weight_shape": torch.tensor(list(w.shape)),
        "weight_scale": scale,  # [N, G]
    }
    if not sym:
        tensors["weight_zero_point"] = _pack(zero, bits, 0)  # [N / per, G]
    if actorder:
        tensors["weight_g_idx"] = g.to(torch.int32)
    return tensors, (q - zero[:, g]).float() * scale.float()[:, g]


SCHEMES = {
    "gptq-4bit": dict(method="gptq", bits=4, group=16, sym=True, desc_act=False, fmt="gptq"),
    "gptq-4bit-act-order": dict(
        method="gptq", bits=4, group=16, sym=False, desc_act=True, fmt="gptq"
    ),
    "gptq-8bit-v2": dict(method="gptq", bits=8, group=32, sym=False, desc_act=False, fmt="gptq_v2"),
    "gptq-2bit-one-group": dict(
        method="gptq", bits=2, group=None, sym=True, desc_act=False, fmt="gptq"
    ),
    "awq": dict(method="awq", group=16),
    "w4a16": dict(method="compressed", bits=4, group=16, sym=True, actorder=False),
    "w4a16-asym-act-order": dict(method="compressed", bits=4, group=16, sym=False, actorder=True),
    "w8a16-channel": dict(method="compressed", bits=8, group=None, sym=True, actorder=False),
    # groups of a multiple of 32 inputs: their codes can run as they are (packed_codes.py)
    "gptq-4bit-g32": dict(method="gptq", bits=4, group=32, sym=False, desc_act=False, fmt="gptq"),
    "awq-g64": dict(method="awq", group=64),
    "w4a16-channel": dict(method="compressed", bits=4, group=None, sym=True, actorder=False),
}


def _config(s: dict) -> dict:
    group = -1 if s.get("group") is None else s["group"]
    if s["method"] == "gptq":
        return {
            "quant_method": "gptq",
            "bits": s["bits"],
            "group_size": group,
            "desc_act": s["desc_act"],
            "sym": s["sym"],
            "checkpoint_format": s["fmt"],
        }
    if s["method"] == "awq":
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": group,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": None,
        }
    weights = {
        "num_bits": s["bits"],
        "type": "int",
        "symmetric": s["sym"],
        "strategy": "channel" if s["group"] is None else "group",
        "group_size": s["group"],
        "actorder": "group" if s["actorder"] else None,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
        "ignore": ["lm_head"],
    }


def is_proj_weight(name: str, t: torch.Tensor) -> bool:
    return t.dim() == 2 and name.endswith("_proj.weight")


def packed_copy(src, scheme: str, dst, packs=is_proj_weight):
    """`src` with its linear weights (those `packs` picks) packed by `scheme` (and, for GPTQ,
    the zero bias its writers keep on layers without one), and beside it `dst/dense`: the
    dequantized values; its tensors stored in a shuffled order (a layer's pieces apart)."""
    from safetensors import safe_open

    s = SCHEMES[scheme]
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        names = set(f.keys())

    def quantize(name: str, w: torch.Tensor):
        group = w.shape[1] if s.get("group") is None else s["group"]
        if s["method"] == "gptq":
            tensors, deq = _gptq(w, s["bits"], group, s["sym"], s["desc_act"], s["fmt"])
        elif s["method"] == "awq":
            tensors, deq = _awq(w, group)
        else:
            tensors, deq = _compressed(w, s["bits"], group, s["sym"], s["actorder"])
        prefix = name.removesuffix(".weight")
        tensors = {f"{prefix}.{k}": v for k, v in tensors.items()}
        if s["method"] == "gptq" and f"{prefix}.bias" not in names:
            tensors[f"{prefix}.bias"] = torch.zeros(w.shape[0], dtype=torch.float16)
        return tensors, deq

    return quantized_copy(src, dst, _config(s), quantize, packs, shuffle=scheme)
