"""A step's input embeddings with images in them: token embeddings, image features spliced in.

    step rows of sequence i: positions [start, start + n)  ->  flat rows [cu[i], cu[i + 1])
    an image at prompt positions [offset, offset + length) that overlaps them puts its feature
    rows [max(start, offset) - offset, min(start + n, offset + length) - offset) there

Features are kept by the image's hash (`ImageInput.mm_hash`, of its pixels), like vLLM's
encoder cache: an image is encoded the first time a step runs one of its placeholders (images
of one step in one call of the vision encoder) unless its features are at hand; they stay while
a sequence has placeholders of it to run (a prompt chunked through an image needs them again;
the same image in other prompts of the batch, or twice in one, shares them), then move to a
least-recently-used pool of at most `cache_elems` elements (max_num_batched_tokens rows of the
text hidden size: a chat that resends its images skips the encoder when the prefix cache does
not cover all of them). A sequence the scheduler drops (finished, preempted) lets go of its
images; one that comes back brings those it has yet to run. An image given as its features
(vLLM's image_embeds, `ImageInput.embeds`) is not encoded.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from paged_engine.core.sched_output import SchedulerOutput
from paged_engine.models.llama import LayerAdditions
from paged_engine.multimodal.inputs import ImageInput


class ImageEmbedder:
    def __init__(
        self,
        encoder: nn.Module,
        embed_tokens: nn.Module,
        device: torch.device,
        cache_elems: int = 0,
    ) -> None:
        self.encoder = encoder  # multimodal/archs.py build_encoder: .encode(images) -> [rows]
        self.embed_tokens = embed_tokens  # the text model's token embedding
        self.device = device
        self.images: dict[int, list[ImageInput]] = {}  # seq id -> images it has yet to run
        # mm_hash -> feature rows [L, D] (or [L, 1 + k, D]) while an image in `images` has it
        self.features: dict[str, torch.Tensor] = {}
        self.users: dict[str, int] = {}  # mm_hash -> images in `images` with that hash
        self.idle: OrderedDict[str, torch.Tensor] = OrderedDict()  # no user: oldest first
        self.idle_elems = 0
        self.cache_elems = cache_elems  # the idle pool's bound
        self.encoded = 0  # images the encoder ran on (tests, stats)

    def add(self, seq_id: int, images: tuple[ImageInput, ...]) -> None:
        self.remove(seq_id)  # (the worker drops a sequence before it comes back)
        if images:
            self.images[seq_id] = list(images)
            for m in images:
                self.users[m.mm_hash] = self.users.get(m.mm_hash, 0) + 1

    def remove(self, seq_id: int) -> None:
        for m in self.images.pop(seq_id, ()):
            self._release(m.mm_hash)

    def clear_idle(self) -> None:
        """Drop the features no sequence needs (sleep mode gives their memory back)."""
        self.idle.clear()
        self.idle_elems = 0

    def _release(self, key: str) -> None:
        left = self.users[key] - 1
        if left:
            self.users[key] = left
            return
        del self.users[key]
        f = self.features.pop(key, None)
        if f is None or f.numel() > self.cache_elems:
            return
        self.idle[key] = f
        self.idle_elems += f.numel()
        while self.idle_elems > self.cache_elems:
            self.idle_elems -= self.idle.popitem(last=False)[1].numel()

    def inputs_embeds(
        self, sched: SchedulerOutput, cu: np.ndarray, input_ids: torch.Tensor
    ) -> tuple[torch.Tensor, LayerAdditions | None] | None:
        """([T, D] embeddings of the step's tokens with image rows in place, the rows the
        decoder adds after its first layers where the encoder gives them (Qwen3-VL's
        deepstack: features [rows, 1 + k, D]) or None), or None when no placeholder of an
        image runs this step."""
        if not self.images:
            return None
        # (flat rows of the step, the image's hash, its feature rows there)
        pieces: list[tuple[np.ndarray, str, np.ndarray]] = []
        todo: list[ImageInput] = []
        for i, seq_id in enumerate(sched.seq_ids):
            start = sched.start_positions[i]
            end = start + sched.num_new_tokens[i]
            for m in self.images.get(seq_id, ()):
                if m.overlaps(start, end):
                    lo, hi = max(start, m.offset), min(end, m.end)
                    span, feats = m.feature_rows(lo - m.offset, hi - m.offset)
                    flat = int(cu[i]) + span + m.offset - start
                    pieces.append((flat, m.mm_hash, feats))
                    todo.append(m)
        if not pieces:
            return None
        self._encode(todo)
        x = self.embed_tokens(input_ids)
        taken = [self.features[key][torch.from_numpy(f)] for _, key, f in pieces if f.size]
        self._retire(sched)
        if not taken:  # the step runs only line-break tokens of its images (Pixtral)
            return x, None
        rows = torch.cat(taken).to(x.dtype)
        index = torch.from_numpy(np.concatenate([flat for flat, _, _ in pieces])).to(x.device)
        additions = None
        if rows.dim() == 3:  # [N, 1 + k, D]: the input rows, then one per deepstack layer
            additions = LayerAdditions(index, list(rows[:, 1:].unbind(1)))
            rows = rows[:, 0]
        x[index] = rows
        return x, additions

    def _encode(self, todo: list[ImageInput]) -> None:
        """Features for every image of `todo`: at hand, back from the idle pool, the client's
        own, or one encoder call for the rest (each hash once)."""
        run: dict[str, ImageInput] = {}
        for m in todo:
            key = m.mm_hash
            if key in self.features or key in run:
                continue
            f = self.idle.pop(key, None)
            if f is not None:
                self.idle_elems -= f.numel()
                self.features[key] = f
            elif m.embeds is not None:  # the client's own features: no encoder run
                self.features[key] = m.embeds.to(self.device)
            else:
                run[key] = m
        if not run:
            return
        images = list(run.values())
        self.encoded += len(images)
        for m, f in zip(images, self.encoder.encode(images), strict=True):
            if f.shape[0] != m.num_features:  # (any extra dims: deepstack layers)
                raise RuntimeError(
                    f"an image gave {f.shape[0]} feature rows for {m.num_features} placeholders"
                )
            self.features[m.mm_hash] = f

    def _retire(self, sched: SchedulerOutput) -> None:
        """Images whose last placeholder ran this step: no later step needs them."""
        for i, seq_id in enumerate(sched.seq_ids):
            images = self.images.get(seq_id)
            if not images:
                continue
            end = sched.start_positions[i] + sched.num_new_tokens[i]
            done = [m for m in images if m.end <= end]
            for m in done:
                self._release(m.mm_hash)
            left = [m for m in images if m.end > end]
            if left:
                self.images[seq_id] = left
            else:
                del self.images[seq_id]
