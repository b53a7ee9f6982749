"""Per-layer scales of an fp8 KV cache: read from the checkpoint, else calibrated at load.

Every attention layer stores key / k_scale and value / v_scale in 8 bits, one scale for its K
and one for its V (vLLM's per-tensor `k_scale` / `v_scale`). `init_kv_scales` sets them once,
before the first cache write (and before any CUDA graph captures them), and nothing changes
them afterwards, so every block ever written is read back with the scales it was written with:

1. From the checkpoint, where it carries them (the loader lifts them out of the weight stream
   with `split_kv_scales`): vLLM / llm-compressor's `...self_attn.k_scale` / `.v_scale`,
   ModelOpt's `...k_proj.k_scale` / `...v_proj.v_scale`, compressed-tensors / Quark's
   `...k_proj.output_scale` / `...v_proj.output_scale`, and the older single `...kv_scale`
   (both K and V). A scale tensor with several entries (per head) gives its largest.
2. Else calibrated at load: one forward of `CALIBRATION_TOKENS` token ids drawn from a fixed
   seed (the same input on every run and every rank) through a scratch cache in the model's
   dtype records each layer's largest |K| and |V| (amax); tensor-parallel ranks take the max
   over their shards, so every rank gets the same scales. The scale is the smallest power of
   two with amax / scale <= fmax / HEADROOM: calibrated values land in (fmax/4, fmax/2], which
   leaves 2-4x room above the calibration's amax before saturation, and a power of two makes
   quantizing (x * 2^-n) exact up to the fp8 rounding itself.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from paged_engine.distributed.communication import recv_tensor, send_tensor, tp_all_reduce_max
from paged_engine.layers.attention import Attention

if TYPE_CHECKING:
    from paged_engine.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

CALIBRATION_TOKENS = 512
CALIBRATION_SEQ_LEN = 128
CALIBRATION_SEED = 0
HEADROOM = 2.0
_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}

# Checkpoint name suffix -> the scales it sets ("k", "v" or both). Longest suffixes first.
_SCALE_SUFFIXES: tuple[tuple[str, str], ...] = (
    (".k_proj.output_scale", "k"),
    (".v_proj.output_scale", "v"),
    (".k_proj.k_scale", "k"),
    (".v_proj.v_scale", "v"),
    (".kv_scale", "kv"),
    (".k_scale", "k"),
    (".v_scale", "v"),
)
# Scales of fp8 attention math (query, softmax probabilities): no use with an fp8 KV cache alone.
_IGNORED_SUFFIXES = (".q_proj.output_scale", ".prob_output_scale", ".q_scale", ".prob_scale")
_LAYER = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)\.")


def split_kv_scales(
    weights: Iterable[tuple[str, torch.Tensor]], found: dict[int, dict[str, float]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights minus the KV-cache scale tensors, which land in `found` as
    {layer index: {"k": scale, "v": scale}} while the stream is consumed."""
    for name, tensor in weights:
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        which = next((w for suffix, w in _SCALE_SUFFIXES if name.endswith(suffix)), None)
        layer = _LAYER.search(name)
        if which is None or layer is None:
            yield name, tensor
            continue
        value = float(tensor.float().max()) if tensor.numel() else float("nan")
        if not 0.0 < value < math.inf:
            raise ValueError(
                f"checkpoint KV-cache scale {name!r} = {value}: must be > 0 and finite"
            )
        for w in which:
            found.setdefault(int(layer.group(1)), {})[w] = value


def attention_layers(model: nn.Module) -> dict[int, Attention]:
    """This rank's paged attention layers by decoder-layer index."""
    layers = {}
    for name, module in model.named_modules():
        if isinstance(module, Attention):
            match = _LAYER.search(name)
            assert match is not None, f"attention layer {name!r} has no layer index"
            layers[int(match.group(1))] = module
    return layers


def scale_from_amax(amax: float, cache_dtype: torch.dtype) -> float:
    """The smallest power of two s with amax / s <= fmax / HEADROOM (1.0 for amax 0)."""
    if amax <= 0.0:
        return 1.0
    return 2.0 ** math.ceil(math.log2(amax * HEADROOM / _FP8_MAX[cache_dtype]))


def init_kv_scales(runner: ModelRunner) -> None:
    """Set k_scale / v_scale on every attention layer of an fp8 cache (no-op otherwise): the
    checkpoint's where it has both for a layer, calibrated for the rest. Every rank calls this
    at the same point (calibration runs collectives)."""
    cache_dtype = runner.kv_cache_dtype
    if cache_dtype not in _FP8_MAX:
        return
    if not getattr(runner.model, "fp8_kv_cache", True):
        raise ValueError(
            f"kv_cache_dtype {cache_dtype}: an fp8 KV cache is not supported for "
            f"{type(runner.model).__name__} ({runner.model.fp8_kv_refusal}); "
            "use kv_cache_dtype='auto'"
        )
    layers = attention_layers(runner.model)
    if any(attn.kv_source is not None for attn in layers.values()):
        raise ValueError(
            f"kv_cache_dtype {cache_dtype}: an fp8 KV cache is not supported "
            "for models whose layers share KV caches (Gemma 4, Gemma 3n, Kolibri 1.1); "
            "use kv_cache_dtype='auto'"
        )
    stored: dict[int, dict[str, float]] = getattr(runner.model, "checkpoint_kv_scales", {})
    missing = sorted(i for i in layers if set(stored.get(i, ())) != {"k", "v"})
    for i, attn in layers.items():
        if i not in missing:
            attn.k_scale, attn.v_scale = stored[i]["k"], stored[i]["v"]
    source = "checkpoint"
    # `stored` holds the whole checkpoint's scales (every pipeline stage's layers), so every
    # rank takes the same decision here: the calibration forward passes hidden states from
    # stage to stage, and all stages must run it, even one whose own layers need nothing.
    num_layers = int(runner.hf_config.num_hidden_layers)
    if any(set(stored.get(i, ())) != {"k", "v"} for i in range(num_layers)):
        amax = calibration_amax(runner, [layers[i] for i in missing])  # [len(missing), 2]
        for i, (k, v) in zip(missing, amax.tolist()):
            if not (math.isfinite(k) and math.isfinite(v)):
                raise ValueError(f"fp8 KV-scale calibration: layer {i} produced non-finite K/V")
            layers[i].k_scale = scale_from_amax(k, cache_dtype)
            layers[i].v_scale = scale_from_amax(v, cache_dtype)
        if missing:
            source = "calibrated" if len(missing) == len(layers) else "checkpoint + calibrated"
    logger.info(
        "fp8 KV cache (%s): %s scales for %d layers, k_scale %s, v_scale %s",
        cache_dtype,
        source,
        len(layers),
        _span([a.k_scale for a in layers.values()]),
        _span([a.v_scale for a in layers.values()]),
    )


def _span(values: list[float]) -> str:
    return f"{min(values):.3g}..{max(values):.3g}" if values else "-"


@torch.inference_mode()
def calibration_amax(runner: ModelRunner, layers: list[Attention]) -> torch.Tensor:
    """[len(layers), 2] fp32 on the CPU: each layer's max |K| and |V| over one forward of the
    calibration tokens, max-reduced over the tensor-parallel group. The forward writes into a
    scratch cache in the model's dtype (K/V unquantized), discarded afterwards."""
    from paged_engine.worker.cache_engine import CacheEngine

    cfg, dev, bs = runner.config, runner.device, runner.block_size
    assert cfg.max_num_batched_tokens is not None and cfg.max_model_len is not None
    num_tokens = min(CALIBRATION_TOKENS, cfg.max_num_batched_tokens)
    seq_len = min(CALIBRATION_SEQ_LEN, cfg.max_model_len, num_tokens)
    lens = [seq_len] * (num_tokens // seq_len)
    num_tokens = sum(lens)
    gen = torch.Generator().manual_seed(CALIBRATION_SEED)
    ids = torch.randint(0, runner.vocab_size, (num_tokens,), generator=gen).to(dev)
    blocks_per_seq = -(-seq_len // bs)
    model_dtype = next(runner.model.parameters()).dtype
    scratch = CacheEngine(
        runner.hf_config,
        1 + len(lens) * blocks_per_seq,
        bs,
        dtype=model_dtype,
        device=dev,
        backend=runner.backend,
    )
    tables = 1 + torch.arange(len(lens) * blocks_per_seq).view(len(lens), blocks_per_seq)
    pos = torch.arange(seq_len)
    slots = (tables[:, pos // bs] * bs + pos % bs).reshape(-1)
    meta = runner.backend.build_metadata(
        slot_mapping=slots.to(dev),
        block_tables=tables.to(torch.int32).to(dev),
        cu_seqlens_q=torch.arange(0, num_tokens + 1, seq_len, dtype=torch.int32).to(dev),
        seq_lens=torch.full((len(lens),), seq_len, dtype=torch.int32).to(dev),
        max_seqlen_q=seq_len,
        max_seqlen_k=seq_len,
    )
    amax = torch.zeros(len(layers), 2, dtype=torch.float32, device=dev)

    def record(row: int):
        def hook(module, args) -> None:  # args: (q, k, v, kv_cache, metadata)
            amax[row, 0] = torch.maximum(amax[row, 0], args[1].abs().max().float())
            amax[row, 1] = torch.maximum(amax[row, 1], args[2].abs().max().float())

        return hook

    handles = [attn.register_forward_pre_hook(record(row)) for row, attn in enumerate(layers)]
    # The scratch cache is not fp8: every layer runs with unit scales meanwhile.
    every = list(attention_layers(runner.model).values())
    kept = [(a.k_scale, a.v_scale) for a in every]
    for a in every:
        a.k_scale = a.v_scale = 1.0
    try:
        state = runner.parallel
        hidden_in = None
        if not state.is_first_stage:  # a later pipeline stage runs on the previous one's output
            prev = state.stage_rank(state.pp_rank - 1)
            hidden_in = recv_tensor((num_tokens, runner.stage_width), model_dtype, dev, prev)
        hidden = runner.model(
            ids, pos.repeat(len(lens)).to(dev), scratch.kv_caches, meta, hidden_in
        )
        if not state.is_last_stage:
            send_tensor(hidden, state.stage_rank(state.pp_rank + 1))
    finally:
        for h in handles:
            h.remove()
        for a, (k, v) in zip(every, kept):
            a.k_scale, a.v_scale = k, v
    return tp_all_reduce_max(amax).cpu()
