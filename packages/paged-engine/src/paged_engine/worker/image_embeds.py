"""A step's input embeddings with images in them: token embeddings, image features spliced in.

Audio clips (`ImageInput.modality == "audio"`) take the same path through the audio encoder.

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
(vLLM's image_embeds, `ImageInput.embeds`) is not encoded, nor kept once used (it comes with
its request).

prompt_embeds rows (`ImageInput.token_rows`, engine/prompt_embeds.py) stand for the token
embedding lookup's output, not for features put after the model's own scaling: they go into the
lookup's output (a forward hook on the embedding module, `spliced_lookup`), so whatever a model
does to its token embeddings (Gemma's scale, GPT-2's position embeddings, OPT's projection) is
done to them too.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from paged_engine.core.sched_output import SchedulerOutput
from paged_engine.models.llama import LayerAdditions
from paged_engine.multimodal.inputs import ImageInput


@dataclass(frozen=True, slots=True)
class LookupRows:
    """prompt_embeds rows of a step: the token embedding's output gets out[index] = rows."""

    index: torch.Tensor  # [N] flat step rows
    rows: torch.Tensor  # [N, D]


@contextmanager
def spliced_lookup(embedding: nn.Module | None, lookup: LookupRows | None) -> Iterator[None]:
    """While open, `embedding`'s output carries `lookup`'s rows (nothing when None)."""
    if lookup is None:
        yield
        return
    assert embedding is not None, "prompt_embeds rows reach a model without their lookup"

    def splice(_module: nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
        out[lookup.index] = lookup.rows.to(out.dtype)
        return out

    handle = embedding.register_forward_hook(splice)
    try:
        yield
    finally:
        handle.remove()


class ImageEmbedder:
    def __init__(
        self,
        encoder: nn.Module | None,
        embed_tokens: Callable[[torch.Tensor], torch.Tensor],
        lookup: nn.Module | None,
        device: torch.device,
        cache_elems: int = 0,
        audio_encoder: nn.Module | None = None,
    ) -> None:
        # multimodal/archs.py build_encoder: .encode(images) -> [rows]; None for a model that
        # only takes prompt_embeds (or audio)
        self.encoder = encoder
        # multimodal/audio_archs.py build_audio_encoder: .encode(clips) -> [rows] (items of
        # modality "audio"); None where audio does not run
        self.audio_encoder = audio_encoder
        self.embed_tokens = embed_tokens  # the token embedding as the model's first stage has it
        # the embedding module whose output prompt_embeds rows replace; None where they go
        # with the images, after `embed_tokens` (Gemma: HF's input embedding is scaled)
        self.lookup = lookup
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
            self._release(m)

    def clear_idle(self) -> None:
        """Drop the features no sequence needs (sleep mode gives their memory back)."""
        self.idle.clear()
        self.idle_elems = 0

    def _release(self, m: ImageInput) -> None:
        key = m.mm_hash
        left = self.users[key] - 1
        if left:
            self.users[key] = left
            return
        del self.users[key]
        f = self.features.pop(key, None)
        if f is None or f.numel() > self.cache_elems or m.embeds is not None:
            return
        self.idle[key] = f
        self.idle_elems += f.numel()
        while self.idle_elems > self.cache_elems:
            self.idle_elems -= self.idle.popitem(last=False)[1].numel()

    def inputs_embeds(
        self, sched: SchedulerOutput, cu: np.ndarray, input_ids: torch.Tensor
    ) -> tuple[torch.Tensor | None, LayerAdditions | None, LookupRows | None] | None:
        """(embeds, additions, lookup), or None when no placeholder runs this step:
        embeds: [T, D] embeddings of the step's tokens with image rows in place (None when only
        prompt_embeds rows run: the model embeds its tokens itself); additions: the rows the
        decoder adds after its first layers where the encoder gives them (Qwen3-VL's deepstack:
        features [rows, 1 + k, D]) or None; lookup: the step's prompt_embeds rows, for
        `spliced_lookup` while the model embeds its tokens (here, for `embeds`, and then not
        returned)."""
        if not self.images:
            return None
        # (flat rows of the step, the image's hash, its feature rows there): rows put after the
        # token embedding (images), rows put into its output (prompt_embeds, `lookup`)
        pieces: list[tuple[np.ndarray, str, np.ndarray]] = []
        rows_of_prompts: list[tuple[np.ndarray, str, np.ndarray]] = []
        todo: list[ImageInput] = []
        for i, seq_id in enumerate(sched.seq_ids):
            start = sched.start_positions[i]
            end = start + sched.num_new_tokens[i]
            for m in self.images.get(seq_id, ()):
                if m.overlaps(start, end):
                    lo, hi = max(start, m.offset), min(end, m.end)
                    span, feats = m.feature_rows(lo - m.offset, hi - m.offset)
                    flat = int(cu[i]) + span + m.offset - start
                    before = m.token_rows and self.lookup is not None
                    (rows_of_prompts if before else pieces).append((flat, m.mm_hash, feats))
                    todo.append(m)
        if not todo:
            return None
        self._encode(todo)
        found = self._gather(rows_of_prompts)
        lookup = None if found is None else LookupRows(*found)
        if not pieces:
            self._retire(sched)
            return None, None, lookup
        with spliced_lookup(self.lookup, lookup):
            # (a worker-side draft's slot holds DRAFT_PLACEHOLDER, -1, until the proposer
            # writes the draft and its embedding: spec_decode/draft_model.py `_finish`)
            x = self.embed_tokens(input_ids.clamp(min=0))
        gathered = self._gather(pieces)
        self._retire(sched)
        if gathered is None:  # the step runs only line-break tokens of its images (Pixtral)
            return x, None, None
        index, rows = gathered
        rows = rows.to(x.dtype)
        additions = None
        if rows.dim() == 3:  # [N, 1 + k, D]: the input rows, then one per deepstack layer
            additions = LayerAdditions(index, list(rows[:, 1:].unbind(1)))
            rows = rows[:, 0]
        if getattr(self.audio_encoder, "adds_to_tokens", False):  # Voxtral Realtime: audio only
            x[index] += rows
        else:
            x[index] = rows
        return x, additions, None

    def _gather(
        self, pieces: list[tuple[np.ndarray, str, np.ndarray]]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(flat step rows, their feature rows) of `pieces`, None when they take none."""
        taken = [self.features[key][torch.from_numpy(f)] for _, key, f in pieces if f.size]
        if not taken:
            return None
        index = np.concatenate([flat for flat, _, f in pieces if f.size])
        return torch.from_numpy(index).to(self.device), torch.cat(taken)

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
        for audio, encoder in ((False, self.encoder), (True, self.audio_encoder)):
            items = [m for m in run.values() if (m.modality == "audio") == audio]
            if not items:
                continue
            assert encoder is not None, f"{items[0].modality} reaches a worker without its encoder"
            self.encoded += len(items)
            for m, f in zip(items, encoder.encode(items), strict=True):
                if f.shape[0] != m.num_features:  # (any extra dims: deepstack layers)
                    raise RuntimeError(
                        f"an item gave {f.shape[0]} feature rows for {m.num_features} placeholders"
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
                self._release(m)
            left = [m for m in images if m.end > end]
            if left:
                self.images[seq_id] = left
            else:
                del self.images[seq_id]
