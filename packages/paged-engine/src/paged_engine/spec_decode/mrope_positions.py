"""The positions a draft head turns its tokens by when the target uses M-RoPE (Qwen2-VL,
Qwen2.5-VL, Qwen3-VL, Qwen3.5 with images; the table: multimodal/mrope.py).

A head that reads the target's features runs at sequence position p on the target's feature of
p (spec_decode/eagle.py). vLLM's EAGLE proposer gives it the target's own rope position of p:
the M-RoPE table's three rows over a prompt's images and the text after them, p + delta after
the prompt, p before the first image. A head whose config carries `mrope_section` (the EAGLE-3
heads trained for Qwen2.5-VL / Qwen3-VL, vLLM's Eagle3Qwen2_5vlForCausalLM and
Eagle3Qwen3vlForCausalLM; Qwen3.5's own MTP layer) rotates by those rows here too; a head with
a plain rope keeps the sequence positions (vLLM runs no such head on an M-RoPE target).

Only where the drafts come from matters: the target verifies them at its own positions
(worker/rope_positions.py), so the outputs do not depend on this choice.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from paged_engine.layers.rotary import MRotaryEmbedding
from paged_engine.worker.rope_positions import rope_positions

if TYPE_CHECKING:
    from paged_engine.worker.model_runner import ModelRunner


def uses_mrope(head: torch.nn.Module) -> bool:
    """Whether the head turns q / k by M-RoPE (its config has `mrope_section`)."""
    return any(isinstance(m, MRotaryEmbedding) for m in head.modules())


def target_rope_positions(
    runner: ModelRunner,
    seq_ids: list[int],
    q_lens: np.ndarray,
    ends: np.ndarray,
    positions: torch.Tensor,
) -> torch.Tensor:
    """The target's rope positions ([T] or [3, T]) of `q_lens[i]` tokens of sequence seq_ids[i]
    ending at position ends[i] - 1; `positions` (those sequence positions, on the device)
    where no sequence of them has an M-RoPE table."""
    if not runner.rope_tables:
        return positions
    cu = np.zeros(len(seq_ids) + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu[1:])
    starts = np.asarray(ends, dtype=np.int64) - q_lens
    host = np.arange(int(cu[-1]), dtype=np.int64) + np.repeat(starts - cu[:-1], q_lens)
    rope = rope_positions(runner.rope_tables, seq_ids, starts, cu, host)
    if rope is None:
        return positions
    return runner._to_dev(rope.reshape(-1)).view(rope.shape)
