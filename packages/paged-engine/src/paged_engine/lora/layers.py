"""Adapter slots on a linear layer, and the per-step token -> slot mapping.

Every LoRA-capable linear layer holds `max_loras` slots, each one adapter packed for this layer
and this rank's shard (lora/model.py packs them):

    a [L, S * R, in_local]    the sub-projections' A matrices stacked (S = 3 for q|k|v, 2 for
                              gate|up, else 1; R = max_lora_rank, unused rows zero)
    b [L, out_local, S * R]   the B matrices, scale folded in, block-diagonal: sub-projection j's
                              output rows read only columns [j*R, (j+1)*R)

so one shrink and one expand serve a fused layer: y[t] += (x[t] a[l]^T) b[l]^T for a token t that
runs with slot l. A row-parallel layer's shrink is a partial sum over its input shard: it is
all-reduced (a [T, S*R] tensor) and the delta is added after the layer's own all-reduce, whole on
every rank.

`LoRAMapping` lists the tokens of each slot (`token_idx[seg_start[l]:seg_start[l+1]]`), set by
the model runner before each forward. Its device tensors are allocated once, so a CUDA graph
captured with the Triton kernels (paged_kernels.lora_shrink / lora_expand) reads each replay's
mapping; on other devices each segment is a torch gather (or a slice when its tokens are
contiguous) and two matmuls.
"""

from __future__ import annotations

import numpy as np
import torch

from paged_engine.distributed.communication import tp_all_reduce
from paged_kernels import lora_segments


class LoRAMapping:
    """The tokens each adapter slot runs this step; shared by every LoRAWeights of a model."""

    def __init__(self, num_slots: int, max_tokens: int, device: torch.device) -> None:
        self.num_slots = num_slots
        self.device = device
        # The Triton kernels on CUDA (tests may turn them on for CPU tensors: the interpreter).
        self.use_kernels = device.type == "cuda"
        self.token_idx = torch.zeros(max(max_tokens, 1), dtype=torch.int32, device=device)
        self.seg_start = torch.zeros(num_slots + 1, dtype=torch.int32, device=device)
        # Host view, for the torch path: (slot, first token, end token) of a contiguous run, or
        # (slot, index tensor, None).
        self.groups: list[tuple[int, int | torch.Tensor, int | None]] = []
        self.num_lora_tokens = 0
        # While a CUDA graph is captured the kernels must be recorded whatever this step's
        # mapping holds (an empty one makes them return at once).
        self.capturing = False

    def set(self, token_slots: np.ndarray) -> None:
        """token_slots[t]: the slot token t runs with, -1 for none."""
        has = token_slots >= 0
        num = int(np.count_nonzero(has))
        if num == 0:
            if self.num_lora_tokens or self.groups:
                self.seg_start.zero_()
            self.groups, self.num_lora_tokens = [], 0
            return
        # The kernels' layout (paged_kernels.lora_segments): slot l's tokens in
        # order[starts[l]:starts[l + 1]]; tokens without an adapter after starts[-1] == num.
        order, starts = lora_segments(token_slots, self.num_slots)
        self.num_lora_tokens = num
        if self.use_kernels:
            packed = torch.cat([starts, order[:num]])
            if self.device.type == "cuda":
                packed = packed.pin_memory().to(self.device, non_blocking=True)
            self.seg_start.copy_(packed[: self.num_slots + 1])
            self.token_idx[:num].copy_(packed[self.num_slots + 1 :])
            self.groups = []
            return
        order_np, starts_np = order.numpy(), starts.numpy()
        groups: list[tuple[int, int | torch.Tensor, int | None]] = []
        for slot in np.flatnonzero(np.diff(starts_np)).tolist():
            idx = order_np[starts_np[slot] : starts_np[slot + 1]]
            first, last = int(idx[0]), int(idx[-1])
            if last - first + 1 == idx.size:  # one run of consecutive tokens: a slice
                groups.append((slot, first, last + 1))
            else:
                groups.append((slot, torch.from_numpy(idx.astype(np.int64)), None))
        self.groups = groups


class LoRAWeights:
    """The adapter slots of one linear layer (see the module docstring)."""

    def __init__(
        self,
        mapping: LoRAMapping,
        *,
        num_subs: int,
        max_rank: int,
        in_local: int,
        out_local: int,
        row_parallel: bool,
        tp_size: int,
        dtype: torch.dtype,
    ) -> None:
        self.mapping = mapping
        self.row_parallel = row_parallel
        self.reduce = row_parallel and tp_size > 1
        width = num_subs * max_rank
        n, dev = mapping.num_slots, mapping.device
        self.a = torch.zeros(n, width, in_local, dtype=dtype, device=dev)
        self.b = torch.zeros(n, out_local, width, dtype=dtype, device=dev)

    def nbytes(self) -> int:
        return self.a.numel() * self.a.element_size() + self.b.numel() * self.b.element_size()

    def apply(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out + each token's adapter delta (in place when out is the layer's fresh output)."""
        m = self.mapping
        if m.use_kernels:
            if not m.num_lora_tokens and not m.capturing:
                return out
            from paged_kernels import lora_expand, lora_shrink

            x2 = x.reshape(-1, x.shape[-1])
            s = lora_shrink(x2, self.a, m.token_idx, m.seg_start)
            if self.reduce:
                s = tp_all_reduce(s)
            lora_expand(s, self.b, m.token_idx, m.seg_start, out.view(-1, out.shape[-1]))
            return out
        if not m.groups:
            return out
        if self.reduce:  # partial shrinks of every slot, reduced once
            s = x.new_zeros(x.shape[0], self.a.shape[1])
            for slot, rows, end in m.groups:
                sel = slice(rows, end) if end is not None else rows
                s[sel] = x[sel] @ self.a[slot].t()
            s = tp_all_reduce(s)
            for slot, rows, end in m.groups:
                sel = slice(rows, end) if end is not None else rows
                out[sel] += s[sel] @ self.b[slot].t()
            return out
        for slot, rows, end in m.groups:
            if end is not None:
                out[rows:end] += (x[rows:end] @ self.a[slot].t()) @ self.b[slot].t()
            else:
                delta = (x.index_select(0, rows) @ self.a[slot].t()) @ self.b[slot].t()
                out.index_add_(0, rows, delta)
        return out
