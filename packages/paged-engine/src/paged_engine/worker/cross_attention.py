"""The worker's cross-attention memory of an encoder-decoder model (Whisper, models/whisper.py;
Llama 3.2 Vision, models/mllama.py).

    pool, per cross-attending layer: K and V in the attention backend's cache layout,
        `blocks_per_clip` blocks of block_size rows a slot (Whisper: a clip's S encoder frames;
        Mllama: limit_mm_per_prompt images of max_num_tiles tiles; the tail unused), slot s
        owning blocks [s * blocks_per_clip, (s + 1) * blocks_per_clip)
    content key -> its slot, while live sequences of the worker hold it (refcounted)
    seq id      -> (slot, its CrossPlan)

What a sequence holds is the model's `CrossPlan` (models/encoder_decoder.py; Whisper's built here):
its content key (the clip's hash; the hash of Mllama's images), the rows it writes, and which
prefix of the slot each of its rows attends to (a Whisper row: all S frames; a Mllama row at
its j-th <|image|> or after: the real tiles of images 0..j; a Mllama row before its first
image: every image row, its MLP branch zeroed by the model through `CrossBatch.row_scale`). A
model without a plan for a sequence (Mllama's text-only prompts) takes no slot, and its rows
skip the cross-attention layers (`CrossBatch.rows`).

With tensor parallelism each rank's pool holds its own KV heads (Whisper's decoder heads split
evenly; Mllama's `cross_dims` as its self-attention's, one replicated KV head a rank where there
are fewer than the ranks): every rank takes the same slots, as every rank sees the same
steps, and encodes its heads of the same content.

The pool has one slot per seat (max_num_seqs), allocated with the KV cache and carved out of the
memory the KV cache was sized for (`fit_cross_slots`): where that memory cannot hold max_num_seqs
seats (a slot and max_model_len tokens of decoder KV each) max_num_seqs is lowered to the seats
it holds, so the scheduler queues what does not fit. A slot is taken when a sequence with a clip
no live sequence holds reaches the worker, and encoded (the encoder and each decoder layer's k / v
projections, a few clips a call) before that step's forward; forks, beams and the same clip in
two requests share it. The last holder leaving (finished, aborted, preempted) frees it at once,
for the same step's newcomers: a sequence that comes back is encoded again unless another kept
its clip. With num_gpu_blocks_override the pool takes max_num_seqs slots beside the fixed blocks.

A step attends in place: each run of a sequence's rows that see one prefix of its slot is an
entry of the metadata whose block table is the slot's blocks and whose seq_len is that prefix
(`key_ends` = it for prefill rows; a decode row's causal range is all of it already), and
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
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from paged_engine.attention.backend import AttentionBackend, AttentionMetadata
from paged_engine.models.bart import bart_engine_config, is_bart
from paged_engine.models.cohere_asr import ARCH as COHERE_ASR
from paged_engine.models.cohere_asr import cohere_asr_engine_config
from paged_engine.models.encoder_decoder import CrossPlan, fit_decoder_length, tp_divides_heads
from paged_engine.models.mllama import ARCH as MLLAMA
from paged_engine.models.mllama import mllama_engine_config
from paged_engine.models.moonshine import ARCH as MOONSHINE
from paged_engine.models.moonshine import moonshine_engine_config
from paged_engine.models.whisper import ARCHITECTURES
from paged_engine.multimodal.donut import donut_engine_config, is_donut
from paged_engine.multimodal.florence2 import florence2_engine_config, is_florence2
from paged_engine.multimodal.inputs import ImageInput
from paged_engine.worker import host_memory

logger = logging.getLogger(__name__)


def is_encoder_decoder(hf_config) -> bool:
    """Whether the checkpoint is an encoder-decoder model paged serves (Whisper, Mllama)."""
    archs = getattr(hf_config, "architectures", None) or ()
    return (
        is_bart(hf_config)
        or is_florence2(hf_config)
        or is_donut(hf_config)
        or any(a in ARCHITECTURES or a in (MLLAMA, MOONSHINE, COHERE_ASR) for a in archs)
    )


def is_moonshine(hf_config) -> bool:
    return MOONSHINE in (getattr(hf_config, "architectures", None) or ())


def is_mllama(hf_config) -> bool:
    return MLLAMA in (getattr(hf_config, "architectures", None) or ())


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
    text_in = is_bart(hf_config) or is_florence2(hf_config) or is_donut(hf_config)  # (no audio)
    if config.audio_limit == 0 and not is_mllama(hf_config) and not text_in:
        unsupported["limit_mm_per_prompt={'audio': 0}"] = True
    for what, on in unsupported.items():
        if on:
            raise ValueError(
                f"{what} is not supported for encoder-decoder models ({arch}): their decoder "
                "also reads each sequence's encoder output"
            )
    if is_mllama(hf_config):
        mllama_engine_config(config, hf_config)
    elif is_moonshine(hf_config):
        moonshine_engine_config(config, hf_config)
    elif COHERE_ASR in hf_config.architectures:
        cohere_asr_engine_config(config, hf_config)
    elif is_bart(hf_config):  # (models/bart.py: text encoder prompts)
        bart_engine_config(config, hf_config)
    elif is_florence2(hf_config):  # (multimodal/florence2.py: BART's, an image in front)
        florence2_engine_config(config, hf_config)
    elif is_donut(hf_config):  # (multimodal/donut.py: Swin rows, an mBART decoder)
        donut_engine_config(config, hf_config)
    else:
        _whisper_lengths(config, hf_config)
    if not config.enforce_eager:
        logger.info("%s: CUDA graphs are off (enforce_eager): steps read cross-attention", arch)
        config.enforce_eager = True
    config.preemption_mode = "recompute"


def _whisper_lengths(config, hf_config) -> None:
    fit_decoder_length(config, int(hf_config.max_target_positions), "config.max_target_positions")
    heads = int(hf_config.decoder_attention_heads)
    tp_divides_heads(config, heads, "config.decoder_attention_heads")


def cross_slot_rows(config, hf_config) -> int:
    """Rows of K / V one slot holds: a Whisper clip's encoder frames, Mllama's images."""
    if is_mllama(hf_config):
        from paged_engine.models.mllama import image_limit, slot_rows

        return slot_rows(hf_config, image_limit(config))
    if is_moonshine(hf_config):  # a WINDOW_SECONDS clip's frames (models/moonshine.py)
        from paged_engine.models.moonshine import slot_rows as moonshine_rows

        return moonshine_rows(hf_config)
    if COHERE_ASR in (getattr(hf_config, "architectures", None) or ()):
        from paged_engine.models.cohere_asr import slot_rows as cohere_asr_rows

        return cohere_asr_rows(hf_config)
    if is_bart(hf_config):  # the longest encoder prompt: the encoder's position table
        return int(hf_config.max_position_embeddings)
    if is_florence2(hf_config):  # image rows and encoder text: the same table
        return int(hf_config.text_config.max_position_embeddings)
    if is_donut(hf_config):  # the tower's rows for config.encoder.image_size
        from paged_engine.multimodal.donut import slot_rows

        return slot_rows(hf_config)
    return int(hf_config.max_source_positions)


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
    """One step's cross-attention inputs: the pool and, as metadata, one entry per run of a
    sequence's rows that see the same keys (a sequence's slot; a prefix of it)."""

    keys: list[torch.Tensor]  # per cross-attention layer, the pool in the backend's layout
    values: list[torch.Tensor]
    md: AttentionMetadata  # block tables: the slots' blocks; seq_lens: keys seen; all visible
    num_heads: int  # this rank's query heads
    num_kv_heads: int
    head_dim: int
    # the step's rows that attend (sequences with a slot), None: all of them
    rows: torch.Tensor | None = None
    num_rows: int = 0
    # [R, 1] 0 for rows before the sequence's first image (Mllama), else 1; None: no such row
    row_scale: torch.Tensor | None = None

    def attend(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """[R, H*Dh] queries of the attending rows -> [R, H*Dh] cross-attention outputs."""
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


# Slots one encoder call fills: bounds the encoder's activations and the k / v it hands over.
ENCODE_BATCH = 8


def _whisper_plan(frames: int) -> Callable[[Sequence[ImageInput]], CrossPlan]:
    """Whisper's sequences: one clip, every decoder row sees all its S frames."""

    def plan(items: Sequence[ImageInput]) -> CrossPlan:
        audio = [m for m in items if m.pixel_values is not None]
        if len(audio) != 1:
            raise RuntimeError(f"a sequence reached the worker with {len(audio)} audios")
        m = audio[0]
        return CrossPlan(m.mm_hash, frames, (frames,), 0, frames, m.pixel_values)

    return plan


class CrossAttentionState:
    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        backend: AttentionBackend,
        block_size: int,
        rows: int,
    ) -> None:
        # The model's hooks (Mllama's), else Whisper's: `cross_plan(items) -> CrossPlan | None`
        # (None: the sequence reads no encoder output), `encode_cross(payloads)` -> per layer
        # (k, v) [rows of all payloads, Hkv, Dh], lazily; `cross_dims()`.
        self.model = model
        self.device, self.backend, self.block_size = device, backend, block_size
        self.rows = rows  # a slot's capacity (Whisper: config.max_source_positions)
        self.blocks_per_clip = -(-rows // block_size)
        self._plan = getattr(model, "cross_plan", None) or _whisper_plan(rows)
        if hasattr(model, "cross_dims"):
            self.num_layers, self.num_heads, self.num_kv_heads, self.head_dim = model.cross_dims()
            self._encode_fn = model.encode_cross
        else:
            attn = [layer.encoder_attn for layer in model.model.decoder.layers]  # type: ignore
            self.num_layers = len(attn)
            self.num_heads, self.head_dim = attn[0].num_heads, attn[0].head_dim
            self.num_kv_heads = self.num_heads
            self._encode_fn = self._whisper_encode
        self.dtype = next(model.parameters()).dtype
        self.keys: list[torch.Tensor] = []  # per layer, set by allocate()
        self.values: list[torch.Tensor] = []
        self.num_slots = 0
        self.users = np.zeros(0, dtype=np.int64)  # slot -> live sequences holding it
        self._free: list[int] = []  # popped from the end: the lowest slot first
        self.kv: dict[str, int] = {}  # content key -> the slot holding its K / V
        self.seqs: dict[int, tuple[int, CrossPlan]] = {}  # seq id -> (its slot, its plan)
        self._pending: dict[int, CrossPlan] = {}  # slot -> the content to encode into it
        self.encoded = 0  # slots the encoder filled (tests)

    @property
    def slot_bytes(self) -> int:
        """One slot's K and V over every layer."""
        per = self.blocks_per_clip * self.block_size * self.num_kv_heads * self.head_dim
        return 2 * self.num_layers * per * self.dtype.itemsize

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, num_slots: int) -> None:
        """The pool, `num_slots` slots; nothing may be held."""
        assert not self.seqs, "the cross-attention pool is allocated before any step"
        shape = self.backend.kv_cache_shape(
            num_slots * self.blocks_per_clip, self.block_size, self.num_kv_heads, self.head_dim
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
        plan = self._plan(items)
        if plan is None:  # (Mllama's text-only prompts)
            return
        assert plan.rows <= self.rows, "a sequence's cross rows exceed its slot"
        slot = self.kv.get(plan.key)
        if slot is None:
            if not self._free:
                raise RuntimeError(
                    f"all {self.num_slots} cross-attention slots are taken (more live "
                    "sequences than max_num_seqs)"
                )
            slot = self.kv[plan.key] = self._free.pop()
            self._pending[slot] = plan
        self.users[slot] += 1
        self.seqs[seq_id] = (slot, plan)

    def remove(self, seq_id: int) -> None:
        held = self.seqs.pop(seq_id, None)
        if held is None:
            return
        slot, plan = held
        self.users[slot] -= 1
        if self.users[slot]:
            return
        del self.kv[plan.key]
        self._pending.pop(slot, None)
        self._free.append(slot)

    def step(
        self,
        seq_ids: Sequence[int],
        num_new: np.ndarray,
        step_md: AttentionMetadata,
        starts: np.ndarray,
    ) -> CrossBatch:
        """The step's CrossBatch (`starts` / `num_new`: each sequence's first position and
        rows; `step_md`: the step's self-attention metadata), encoding new slots' content.

            a sequence's rows:  | before plan.start: masked | start + j ... |
            each run of rows that see the same prefix of the slot (masked_seen keys, or
            seen[j]) one entry of the metadata; rows of sequences without a slot are left
            out (`rows`)"""
        if self._pending:
            self._encode()
        cu = np.zeros(len(seq_ids) + 1, dtype=np.int64)
        np.cumsum(num_new, out=cu[1:])
        slots: list[int] = []
        lens: list[int] = []
        counts: list[int] = []
        rows: list[np.ndarray] = []
        scale: list[np.ndarray] = []
        for i, s in enumerate(seq_ids):
            held = self.seqs.get(s)
            if held is None:
                continue
            (slot, p), n = held, int(num_new[i])
            pos = np.arange(n) + (int(starts[i]) - p.start)  # relative to the first image
            seen = np.asarray(p.seen)[np.clip(pos, 0, len(p.seen) - 1)]
            seen[pos < 0] = p.masked_seen
            cuts = np.flatnonzero(np.diff(seen)) + 1
            edges = np.concatenate(([0], cuts, [n]))
            slots += [slot] * (len(edges) - 1)
            lens += seen[edges[:-1]].tolist()
            counts += np.diff(edges).tolist()
            scale.append((pos >= 0).astype(np.float32))
            rows.append(np.arange(cu[i], cu[i + 1]))
        dev, nb = self.device, self.blocks_per_clip
        num_rows = sum(counts)
        picked = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
        all_rows = num_rows == int(cu[-1])
        seg_cu = np.zeros(len(counts) + 1, dtype=np.int32)
        np.cumsum(counts, out=seg_cu[1:])
        tables = (np.asarray(slots, dtype=np.int64)[:, None] * nb + np.arange(nb)).astype(np.int32)
        max_q = max(counts, default=1)
        seq_lens = np.asarray(lens, dtype=np.int32)
        md = AttentionMetadata(
            slot_mapping=torch.full((num_rows,), -1, dtype=torch.int64, device=dev),
            block_tables=torch.from_numpy(tables).to(dev),
            cu_seqlens_q=step_md.cu_seqlens_q
            if all_rows and len(counts) == len(seq_ids)
            else torch.from_numpy(seg_cu).to(dev),
            seq_lens=torch.from_numpy(seq_lens).to(dev),
            max_seqlen_q=max_q,
            max_seqlen_k=int(seq_lens.max(initial=1)),
            backend=self.backend,
            # a prefill row at position L - q + i would see keys up to itself: all L instead
            key_ends=None if max_q == 1 else torch.from_numpy(np.repeat(seq_lens, counts)).to(dev),
        )
        masked_any = bool(scale) and not all(bool(x.all()) for x in scale)
        return CrossBatch(
            self.keys,
            self.values,
            md,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            rows=None if all_rows else torch.from_numpy(picked).to(dev),
            num_rows=num_rows,
            row_scale=torch.from_numpy(np.concatenate(scale)).to(dev, self.dtype)[:, None]
            if masked_any
            else None,
        )

    def _whisper_encode(self, payloads: list) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for k, v in self.model.encode(torch.stack(payloads).to(self.device)):  # type: ignore
            assert k.shape[1] == self.rows, "the encoder's frames are max_source_positions"
            yield (
                k.reshape(-1, self.num_heads, self.head_dim),
                v.reshape(-1, self.num_heads, self.head_dim),
            )

    def _encode(self) -> None:
        """Each pending slot's K / V, ENCODE_BATCH slots an encoder call."""
        todo, self._pending = list(self._pending.items()), {}
        span = self.blocks_per_clip * self.block_size
        for i in range(0, len(todo), ENCODE_BATCH):
            chunk = todo[i : i + ENCODE_BATCH]
            mapping = torch.cat(  # each slot's first plan.rows pool positions
                [slot * span + torch.arange(p.rows, device=self.device) for slot, p in chunk]
            )
            for layer, (k, v) in enumerate(self._encode_fn([p.payload for _, p in chunk])):
                self.backend.write_kv(k, v, self.keys[layer], self.values[layer], mapping)
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
