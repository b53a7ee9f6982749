"""The worker's cross-attention state of an encoder-decoder model (Whisper, models/whisper.py).

    seq id     -> its audio: an ImageInput whose pixel_values are the log-mel features
                  (multimodal/whisper.py), sent with the sequence whenever it (re)joins
    audio hash -> each decoder layer's cross (k, v), each [H, S, Dh] (this rank's heads)

An audio is encoded (the model's encoder and every layer's k / v projections, one call for the
step's new audios) the first time a step runs a sequence holding it. Its K / V are shared by
every live sequence with that hash (n > 1 forks, beams, the same clip in two requests) and freed
when the last of them leaves (finished or preempted); a sequence that comes back recomputes
them unless another kept them. Unlike the decoder's self-attention K / V, they are not paged:
their length is fixed (the encoder's S frames) and they are written once.

A step: sequence i of the batch runs rows [cu[i], cu[i + 1]) of the flat batch; its queries are
padded to the step's longest run, [B, H, q_max, Dh], and one SDPA per layer attends them over
the batch's K / V stacked [B, H, S, Dh] (no mask: every query sees every frame). The stack is
kept while the next step runs the same audios in the same order (decode steps).

`encoder_decoder_engine_config` refuses by name (ValueError) the engine options these models
cannot run with and turns CUDA graphs off.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from paged_engine.models.whisper import ARCHITECTURES
from paged_engine.multimodal.inputs import ImageInput

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


@dataclass(slots=True)
class CrossBatch:
    """One step's cross-attention inputs: the batch's K / V and where each flat row sits."""

    keys: list[torch.Tensor]  # per decoder layer [B, H, S, Dh]
    values: list[torch.Tensor]
    seq_of_row: torch.Tensor  # [T] the batch index of each flat row
    pos_of_row: torch.Tensor  # [T] its index within its sequence's run
    max_q: int  # the longest run of the step

    def attend(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """[T, H*Dh] queries of the step -> [T, H*Dh] cross-attention outputs."""
        k, v = self.keys[layer], self.values[layer]
        b, h, _, dh = k.shape
        t = q.shape[0]
        if self.max_q == 1:  # one row a sequence (decode): rows are the batch
            out = F.scaled_dot_product_attention(q.view(b, h, 1, dh), k, v, scale=scale)
            return out.reshape(t, h * dh)
        padded = q.new_zeros(b, self.max_q, h, dh)
        padded[self.seq_of_row, self.pos_of_row] = q.view(t, h, dh)
        out = F.scaled_dot_product_attention(padded.transpose(1, 2), k, v, scale=scale)
        return out.transpose(1, 2)[self.seq_of_row, self.pos_of_row].reshape(t, h * dh)


class CrossAttentionState:
    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model = model  # .encode(features [B, n_mels, F]) -> per layer (k, v) [B, H, S, Dh]
        self.device = device
        self.audio: dict[int, ImageInput] = {}  # seq id -> its audio
        self.kv: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # hash -> per layer
        self.users: dict[str, int] = {}  # hash -> live sequences holding it
        # (hashes in batch order, keys, values) of the last step, reused by an equal one
        self._stacked: tuple[tuple[str, ...], list[torch.Tensor], list[torch.Tensor]] | None
        self._stacked = None
        self.encoded = 0  # audios the encoder ran on (tests)

    def add(self, seq_id: int, items: Sequence[ImageInput]) -> None:
        self.remove(seq_id)  # (the worker drops a sequence before it comes back)
        audio = [m for m in items if m.pixel_values is not None]
        if len(audio) != 1:
            raise RuntimeError(f"sequence {seq_id} reached the worker with {len(audio)} audios")
        m = audio[0]
        self.audio[seq_id] = m
        self.users[m.mm_hash] = self.users.get(m.mm_hash, 0) + 1

    def remove(self, seq_id: int) -> None:
        m = self.audio.pop(seq_id, None)
        if m is None:
            return
        left = self.users[m.mm_hash] - 1
        if left:
            self.users[m.mm_hash] = left
            return
        del self.users[m.mm_hash]
        self.kv.pop(m.mm_hash, None)
        if self._stacked is not None and m.mm_hash in self._stacked[0]:
            self._stacked = None

    def step(self, seq_ids: Sequence[int], num_new: np.ndarray) -> CrossBatch:
        """The step's CrossBatch (`num_new`: each sequence's rows), encoding new audios."""
        items = [self.audio[s] for s in seq_ids]
        todo = {m.mm_hash: m for m in items if m.mm_hash not in self.kv}
        if todo:
            self._encode(list(todo.values()))
        hashes = tuple(m.mm_hash for m in items)
        if self._stacked is None or self._stacked[0] != hashes:
            per_layer = zip(*(self.kv[h] for h in hashes), strict=True)
            stacked = [
                _batch([kv[0] for kv in layer], [kv[1] for kv in layer]) for layer in per_layer
            ]
            keys, values = [k for k, _ in stacked], [v for _, v in stacked]
            self._stacked = (hashes, keys, values)
        _, keys, values = self._stacked
        first = np.cumsum(num_new) - num_new
        rows = np.repeat(np.arange(len(items)), num_new)
        pos = np.arange(int(num_new.sum())) - np.repeat(first, num_new)
        both = torch.from_numpy(np.stack([rows, pos])).to(self.device)
        return CrossBatch(keys, values, both[0], both[1], int(num_new.max()))

    def _encode(self, items: list[ImageInput]) -> None:
        features = torch.stack([m.pixel_values for m in items]).to(self.device)
        self.encoded += len(items)
        per_layer = self.model.encode(features)
        apart = len(items) > 1  # copies apart: each frees alone
        for j, m in enumerate(items):
            self.kv[m.mm_hash] = [
                (k[j].clone(), v[j].clone()) if apart else (k[0], v[0]) for k, v in per_layer
            ]


def _batch(
    keys: list[torch.Tensor], values: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K / V of the batch's sequences [B, H, S, Dh] (one sequence: a view)."""
    if len(keys) == 1:
        return keys[0][None], values[0][None]
    return torch.stack(keys), torch.stack(values)


@contextmanager
def bound(model: nn.Module, cross: CrossBatch) -> Iterator[None]:
    """The model's decoder layers read `cross` for one forward."""
    inner = model.model  # type: ignore[union-attr]
    inner.cross = cross
    try:
        yield
    finally:
        inner.cross = None
