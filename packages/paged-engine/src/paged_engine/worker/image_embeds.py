"""A step's input embeddings with images in them: token embeddings, image features spliced in.

    step rows of sequence i: positions [start, start + n)  ->  flat rows [cu[i], cu[i + 1])
    an image at prompt positions [offset, offset + length) that overlaps them puts its feature
    rows [max(start, offset) - offset, min(start + n, offset + length) - offset) there

An image is encoded the first time a step runs one of its placeholders (images of one step in
one call of the vision encoder); its features stay until a step has run its last placeholder
(a prompt chunked through an image needs them again), then go. A sequence the scheduler drops
(finished, preempted) drops its images; one that comes back brings those it has yet to run.
An image given as its features (vLLM's image_embeds, `ImageInput.embeds`) is not encoded.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from paged_engine.core.sched_output import SchedulerOutput
from paged_engine.models.llama import LayerAdditions
from paged_engine.multimodal.inputs import ImageInput


class ImageEmbedder:
    def __init__(self, encoder: nn.Module, embed_tokens: nn.Module, device: torch.device) -> None:
        self.encoder = encoder  # multimodal/archs.py build_encoder: .encode(images) -> [rows]
        self.embed_tokens = embed_tokens  # the text model's token embedding
        self.device = device
        self.images: dict[int, list[ImageInput]] = {}  # seq id -> images it has yet to run
        self.features: dict[tuple[int, int], torch.Tensor] = {}  # (seq id, offset) -> [L, D]

    def add(self, seq_id: int, images: tuple[ImageInput, ...]) -> None:
        if images:
            self.images[seq_id] = list(images)

    def remove(self, seq_id: int) -> None:
        for m in self.images.pop(seq_id, ()):
            self.features.pop((seq_id, m.offset), None)

    def inputs_embeds(
        self, sched: SchedulerOutput, cu: np.ndarray, input_ids: torch.Tensor
    ) -> tuple[torch.Tensor, LayerAdditions | None] | None:
        """([T, D] embeddings of the step's tokens with image rows in place, the rows the
        decoder adds after its first layers where the encoder gives them (Qwen3-VL's
        deepstack: features [rows, 1 + k, D]) or None), or None when no placeholder of an
        image runs this step."""
        if not self.images:
            return None
        # (flat rows of the step, the image's key, its feature rows there)
        pieces: list[tuple[np.ndarray, tuple[int, int], np.ndarray]] = []
        todo: list[tuple[int, ImageInput]] = []
        for i, seq_id in enumerate(sched.seq_ids):
            start = sched.start_positions[i]
            end = start + sched.num_new_tokens[i]
            for m in self.images.get(seq_id, ()):
                if m.overlaps(start, end):
                    lo, hi = max(start, m.offset), min(end, m.end)
                    span, feats = m.feature_rows(lo - m.offset, hi - m.offset)
                    flat = int(cu[i]) + span + m.offset - start
                    pieces.append((flat, (seq_id, m.offset), feats))
                    todo.append((seq_id, m))
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

    def _encode(self, todo: list[tuple[int, ImageInput]]) -> None:
        todo = [(s, m) for s, m in todo if (s, m.offset) not in self.features]
        for seq_id, m in todo:
            if m.embeds is not None:  # the client's own features: no encoder run
                self.features[(seq_id, m.offset)] = m.embeds.to(self.device)
        todo = [(s, m) for s, m in todo if m.embeds is None]
        if not todo:
            return
        features = self.encoder.encode([m for _, m in todo])
        for (seq_id, m), f in zip(todo, features, strict=True):
            if f.shape[0] != m.num_features:  # (any extra dims: deepstack layers)
                raise RuntimeError(
                    f"an image gave {f.shape[0]} feature rows for {m.num_features} placeholders"
                )
            self.features[(seq_id, m.offset)] = f

    def _retire(self, sched: SchedulerOutput) -> None:
        """Images whose last placeholder ran this step: no later step needs them."""
        for i, seq_id in enumerate(sched.seq_ids):
            images = self.images.get(seq_id)
            if not images:
                continue
            end = sched.start_positions[i] + sched.num_new_tokens[i]
            done = [m for m in images if m.end <= end]
            for m in done:
                self.features.pop((seq_id, m.offset), None)
            left = [m for m in images if m.end > end]
            if left:
                self.images[seq_id] = left
            else:
                del self.images[seq_id]
