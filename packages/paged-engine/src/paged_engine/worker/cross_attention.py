"""The worker's cross-attention memory of an encoder-decoder model (Whisper, models/whisper.py).

    pool, per decoder layer: K and V in the attention backend's cache layout, `blocks_per_clip`
        blocks of block_size frames a slot (a clip's S encoder frames, the last block's tail
        unused), slot s owning blocks [s * blocks_per_clip, (s + 1) * blocks_per_clip)
    audio hash -> its slot, while live sequences of the worker hold it (refcounted)
    seq id     -> (slot, hash)

The pool has one slot per seat (max_num_seqs), allocated with the KV cache and carved out of the
memory the KV cache was sized for (`fit_cross_slots`): where that memory cannot hold max_num_seqs
seats (a slot and max_model_len tokens of decoder KV each) max_num_seqs is lowered to the seats
it holds, so the scheduler queues what does not fit. A slot is taken when a sequence with a clip
no live sequence holds reaches the worker, and encoded (the encoder and each decoder layer's k / v
projections, a few clips a call) before that step's forward; forks, beams and the same clip in
two requests share it. The last holder leaving (finished, aborted, preempted) frees it at once,
for the same step's newcomers: a sequence that comes back is encoded again unless another kept
its clip. With num_gpu_blocks_override the pool takes max_num_seqs slots beside the fixed blocks.

A step attends in place: each sequence's block table is its slot's blocks, every query sees all S
keys (`key_ends` = S for prefill rows; a decode row's causal range is all of them already), and
the backend's paged attention reads the pool as it reads the KV cache (Triton's kernel straight
from the slots; the CPU backend gathers one layer's keys at a time, as for self-attention): no
copy of the batch's K / V outlives a layer. The pool is in the model's dtype (kv_cache_dtype is
the decoder's self-attention cache's). transformers keeps each layer's encoder K / V per batch in
an `EncoderDecoderCache`; vLLM in cross-attention blocks each request takes from the KV cache's
block pool. Fixed slots rather than blocks: a clip's K / V have one length, are written once and
read whole, so the scheduler keeps no second block table; the split between slots and blocks is
fixed when the cache is sized instead of following the load.

`encoder_decoder_engine_config` refuses by name (ValueError) the engine options these models
cannot run with and turns CUDA graphs off; `fit_cross_slots` refuses (naming
gpu_memory_utilization / cpu_kv_cache_gib / kv_cache_memory_bytes) a KV cache too small for one
seat.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from paged_engine.attention.backend import AttentionBackend, AttentionMetadata
from paged_engine.models.whisper import ARCHITECTURES
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.worker import host_memory

logger = logging.getLogger(__name__)


def is_encoder_decoder(hf_config) -> bool:
    """Whether the checkpoint is an encoder-decoder model paged serves (Whisper)."""
    return any(a in ARCHITECTURES for a in getattr(hf_config, "architectures", None) or ())


def encoder_decoder_engine_config(config, hf_config) -> None:
    """Refuse (ValueError naming the option) or set what an encoder-decoder model needs:
    max_model_len within the decoder's position table, eager CUDA, recompute preemption."""
    if not is_encoder_decoder(hf_config):
        return
    arch = ", ".join(hf_config.architectures)
    unsupported = {
        "speculative_config": config.speculative_config is not None,
        "pipeline_parallel_size > 1": config.pipeline_parallel_size > 1,
        "enable_prompt_embeds": bool(config.enable_prompt_embeds),
        "enable_lora": bool(config.enable_lora),
        "compilation_config (torch.compile)": bool(config.compilation_level),
    }
    if config.audio_limit == 0:
        unsupported["limit_mm_per_prompt={'audio': 0}"] = True
    for what, on in unsupported.items():
        if on:
            raise ValueError(
                f"{what} is not supported for encoder-decoder models ({arch}): their decoder "
                "also reads each sequence's encoder output"
            )
    limit = int(hf_config.max_target_positions)
    if config.max_model_len is None:
        config.max_model_len = limit
    elif config.max_model_len > limit:
        raise ValueError(
            f"max_model_len={config.max_model_len} exceeds the decoder's position table "
            f"(config.max_target_positions={limit})"
        )
    heads = int(hf_config.decoder_attention_heads)
    if heads % config.tensor_parallel_size:
        raise ValueError(
            f"tensor_parallel_size={config.tensor_parallel_size} does not divide the decoder's "
            f"{heads} attention heads (config.decoder_attention_heads)"
        )
    if not config.enforce_eager:
        logger.info("%s: CUDA graphs are off (enforce_eager): steps read cross-attention", arch)
        config.enforce_eager = True
    config.preemption_mode = "recompute"


def fit_cross_slots(config, num_blocks: int, block_bytes: int, slot_bytes: int) -> int:
    """The KV blocks left once the cross-attention pool's slots (one a seat, `slot_bytes` each)
    come out of `num_blocks` blocks' memory; lowers `config.max_num_seqs` to the seats that
    memory holds, each a slot and max_model_len tokens of blocks (beside the null block).
    num_gpu_blocks_override fixes the blocks: the pool's max_num_seqs slots come beside them."""
    if config.num_gpu_blocks_override is not None:
        return num_blocks
    per_seq = -(-config.max_model_len // config.block_size) * block_bytes
    seats = (num_blocks - 1) * block_bytes // (slot_bytes + per_seq)
    if seats < 1:
        raise ValueError(
            f"the KV cache's {num_blocks * block_bytes / 2**20:.1f} MiB holds no sequence: one "
            f"clip's cross-attention K / V ({slot_bytes / 2**20:.1f} MiB) and max_model_len="
            f"{config.max_model_len} tokens ({per_seq / 2**20:.1f} MiB): raise "
            "gpu_memory_utilization (or cpu_kv_cache_gib / kv_cache_memory_bytes) or lower "
            "max_model_len"
        )
    if seats < config.max_num_seqs:
        logger.info(
            "max_num_seqs=%d lowered to %d: each running sequence holds its clip's "
            "cross-attention K / V (%.1f MiB) in the KV cache's memory",
            config.max_num_seqs,
            seats,
            slot_bytes / 2**20,
        )
        config.max_num_seqs = seats
    return num_blocks - -(-config.max_num_seqs * slot_bytes // block_bytes)


@dataclass(slots=True)
class CrossBatch:
    """One step's cross-attention inputs: the pool and each sequence's slot as metadata."""

    keys: list[torch.Tensor]  # per decoder layer, the pool in the backend's cache layout
    values: list[torch.Tensor]
    md: AttentionMetadata  # block tables: the slots' blocks; seq_lens: S; every key visible
    num_heads: int  # this rank's
    head_dim: int

    def attend(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """[T, H*Dh] queries of the step -> [T, H*Dh] cross-attention outputs."""
        t = q.shape[0]
        out = self.md.backend.attend(
            q.view(t, self.num_heads, self.head_dim),
            self.keys[layer],
            self.values[layer],
            self.md,
            scale=scale,
            sliding_window=None,
            soft_cap=None,
            alibi_slopes=None,
        )
        return out.reshape(t, self.num_heads * self.head_dim)


# Clips one encoder call takes: bounds the encoder's activations and the k / v it hands over.
ENCODE_BATCH = 8


class CrossAttentionState:
    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        backend: AttentionBackend,
        block_size: int,
        frames: int,
    ) -> None:
        # .encode(features [B, n_mels, 2S]) -> per layer (k, v) [B, S, H, Dh], lazily
        self.model = model
        self.device, self.backend, self.block_size = device, backend, block_size
        self.frames = frames  # S: the encoder's output frames (config.max_source_positions)
        self.blocks_per_clip = -(-frames // block_size)
        attn = [layer.encoder_attn for layer in model.model.decoder.layers]  # type: ignore
        self.num_layers = len(attn)
        self.num_heads, self.head_dim = attn[0].num_heads, attn[0].head_dim
        self.dtype = next(model.parameters()).dtype
        self.keys: list[torch.Tensor] = []  # per layer, set by allocate()
        self.values: list[torch.Tensor] = []
        self.num_slots = 0
        self.users = np.zeros(0, dtype=np.int64)  # slot -> live sequences holding it
        self._free: list[int] = []  # popped from the end: the lowest slot first
        self.kv: dict[str, int] = {}  # audio hash -> the slot holding its K / V
        self.seqs: dict[int, tuple[int, str]] = {}  # seq id -> (slot, audio hash)
        self._pending: dict[int, ImageInput] = {}  # slot -> the clip to encode into it
        self.encoded = 0  # audios the encoder ran on (tests)

    @property
    def slot_bytes(self) -> int:
        """One slot's K and V over every layer."""
        per = self.blocks_per_clip * self.block_size * self.num_heads * self.head_dim
        return 2 * self.num_layers * per * self.dtype.itemsize

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, num_slots: int) -> None:
        """The pool, `num_slots` slots; nothing may be held."""
        assert not self.seqs, "the cross-attention pool is allocated before any step"
        shape = self.backend.kv_cache_shape(
            num_slots * self.blocks_per_clip, self.block_size, self.num_heads, self.head_dim
        )

        def pool() -> list[torch.Tensor]:
            return [
                host_memory.cache_zeros(shape, dtype=self.dtype, device=self.device)
                for _ in range(self.num_layers)
            ]

        self.keys, self.values = pool(), pool()
        self.num_slots = num_slots
        self.users = np.zeros(num_slots, dtype=np.int64)
        self._free = list(range(num_slots - 1, -1, -1))
        self.kv.clear()
        self._pending.clear()
        logger.info("cross-attention pool: %d slots x %.1f MiB", num_slots, self.slot_bytes / 2**20)

    def tensors(self) -> list[torch.Tensor]:
        return [*self.keys, *self.values]

    def add(self, seq_id: int, items: Sequence[ImageInput]) -> None:
        self.remove(seq_id)  # (the worker drops a sequence before it comes back)
        audio = [m for m in items if m.pixel_values is not None]
        if len(audio) != 1:
            raise RuntimeError(f"sequence {seq_id} reached the worker with {len(audio)} audios")
        m = audio[0]
        slot = self.kv.get(m.mm_hash)
        if slot is None:
            if not self._free:
                raise RuntimeError(
                    f"all {self.num_slots} cross-attention slots are taken (more live "
                    "sequences than max_num_seqs)"
                )
            slot = self.kv[m.mm_hash] = self._free.pop()
            self._pending[slot] = m
        self.users[slot] += 1
        self.seqs[seq_id] = (slot, m.mm_hash)

    def remove(self, seq_id: int) -> None:
        held = self.seqs.pop(seq_id, None)
        if held is None:
            return
        slot, mm_hash = held
        self.users[slot] -= 1
        if self.users[slot]:
            return
        del self.kv[mm_hash]
        self._pending.pop(slot, None)
        self._free.append(slot)

    def step(
        self, seq_ids: Sequence[int], num_new: np.ndarray, step_md: AttentionMetadata
    ) -> CrossBatch:
        """The step's CrossBatch (`num_new`: each sequence's rows; `step_md`: the step's
        self-attention metadata, whose rows these are), encoding the clips of new slots."""
        if self._pending:
            self._encode()
        slots = np.fromiter((self.seqs[s][0] for s in seq_ids), np.int64, len(seq_ids))
        nb, s = self.blocks_per_clip, self.frames
        tables = (slots[:, None] * nb + np.arange(nb)).astype(np.int32)  # [B, nb]
        num_tokens = int(num_new.sum())
        max_q = int(num_new.max())
        dev = self.device
        md = AttentionMetadata(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=dev),
            block_tables=torch.from_numpy(tables).to(dev),
            cu_seqlens_q=step_md.cu_seqlens_q,
            seq_lens=torch.full((len(slots),), s, dtype=torch.int32, device=dev),
            max_seqlen_q=max_q,
            max_seqlen_k=s,
            backend=self.backend,
            # a prefill row at position S - q + i would see keys up to itself: all S instead
            key_ends=None
            if max_q == 1
            else torch.full((num_tokens,), s, dtype=torch.int32, device=dev),
        )
        return CrossBatch(self.keys, self.values, md, self.num_heads, self.head_dim)

    def _encode(self) -> None:
        """Each pending clip's K / V into its slot, ENCODE_BATCH clips an encoder call."""
        todo, self._pending = list(self._pending.items()), {}
        span = self.blocks_per_clip * self.block_size
        frames = torch.arange(self.frames, device=self.device)
        for i in range(0, len(todo), ENCODE_BATCH):
            chunk = todo[i : i + ENCODE_BATCH]
            features = torch.stack([m.pixel_values for _, m in chunk]).to(self.device)
            slots = torch.tensor([slot for slot, _ in chunk], device=self.device)
            mapping = (slots[:, None] * span + frames).reshape(-1)  # [n * S] pool positions
            for layer, (k, v) in enumerate(self.model.encode(features)):
                assert k.shape[1] == self.frames, "the encoder's frames are max_source_positions"
                kv = [x.reshape(-1, self.num_heads, self.head_dim) for x in (k, v)]
                self.backend.write_kv(*kv, self.keys[layer], self.values[layer], mapping)
            self.encoded += len(chunk)


@contextmanager
def bound(model: nn.Module, cross: CrossBatch) -> Iterator[None]:
    """The model's decoder layers read `cross` for one forward."""
    inner = model.model  # type: ignore[union-attr]
    inner.cross = cross
    try:
        yield
    finally:
        inner.cross = None
