"""Weight loading, reported: an INFO line when it starts and when it ends, and a tqdm bar (on
stderr, tensors done / total) for a load that takes longer than a second.

Quiet when paged_engine's logger is above INFO: the bar follows the log level.
"""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import Iterable, Iterator

import torch

logger = logging.getLogger("paged_engine.loader")

BAR_DELAY_S = 1.0  # a faster load shows its two log lines only


def count_weights(resolved, load_format: str) -> int | None:
    """Tensors the load will yield, from file headers only; None where that costs a full read
    (PyTorch .bin) or the format is unknown."""
    from paged_engine.loader import _open_gguf, _weight_files, safetensors_header, weights_format

    try:
        fmt = weights_format(resolved, load_format)
        if fmt == "gguf" and resolved.is_gguf:
            return len(_open_gguf(resolved.gguf_file).tensors)
        if fmt != "safetensors":
            return None
        total = 0
        for file in _weight_files(resolved.path, fmt):
            with open(file, "rb") as f:
                header, _ = safetensors_header(f)
            total += len(header) - ("__metadata__" in header)
        return total
    except (OSError, ValueError, KeyError, struct.error):
        return None  # the load itself reports a broken file


def track_weights(
    weights: Iterable[tuple[str, torch.Tensor]],
    total: int | None,
    *,
    source: str = "",
    delay: float = BAR_DELAY_S,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `weights` unchanged while reporting how far the load is."""
    show = logger.isEnabledFor(logging.INFO)
    if show:
        logger.info("loading weights%s (%s tensors)", f" from {source}" if source else "", total)
    bar = None
    if show:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc="Loading weights", unit="tensor", delay=delay, leave=False)
    t0 = time.perf_counter()
    count = nbytes = 0
    try:
        for name, tensor in weights:
            yield name, tensor
            count += 1
            nbytes += tensor.numel() * tensor.element_size()
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    if show:
        logger.info(
            "loaded %d tensors (%.1f MiB) in %.1fs",
            count,
            nbytes / 2**20,
            time.perf_counter() - t0,
        )
