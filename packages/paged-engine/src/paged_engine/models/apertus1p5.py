"""Swiss AI Apertus 1.5 served text-only (`Apertus1p5TextForCausalLM`, and the released
`Apertus1p5ForConditionalGeneration` checkpoints through models/multimodal_text.py).

The decoder is Apertus 1's as transformers runs it (models/apertus.py: ungated xIELU MLP,
per-head q / k RMSNorms before RoPE, Llama 3 rope scaling, the same norm names); what changes
is the vocabulary:

    embedding  one table over the extended vocabulary (`vocab_size`, 266,752 released): text,
               then the vision tokenizer's codes from `image_token_offset`, then the audio
               codes from `audio_token_offset`. The wrapper embeds an image's or a clip's codes
               with this same table (its towers only pick the code ids), so a prompt holding
               code ids (or the `<image>` / `<audio>` placeholders, which embed as their own
               rows without media) gives the wrapper's result text-only.
    LM head    may be pruned to the first `output_vocab_size` rows (the text ids; retained
               output ids equal their token ids). transformers' logits are then that wide; ours
               stay `vocab_size` wide, the pruned ids at -inf: the same softmax and greedy
               choice over the kept ids, never sampled, a logprob of -inf where asked for one.
               A tied head (`tie_word_embeddings`) is the whole embedding in transformers 5,
               which ties the weight whatever `output_vocab_size` says: unpruned here too.

The wrapper's vision tokenizer (an EMU3.5 VQGAN encoder and codebook) and WavTokenizer audio
encoder are dropped by name on load; images and audio (`multi_modal_data`) are refused by the
input processor, as for every wrapper served text-only. Refused: `output_vocab_size` outside
[1, vocab_size] (ValueError naming it; transformers' config refuses it too).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paged_engine.layers.embedding import ParallelLMHead
from paged_engine.models.apertus import ApertusForCausalLM


def head_rows(config) -> int:
    """The LM head's rows: `output_vocab_size`, or the whole vocabulary when it is unset or
    the head is tied to the embedding."""
    vocab = int(config.vocab_size)
    rows = getattr(config, "output_vocab_size", None)
    if rows is None or getattr(config, "tie_word_embeddings", False):
        return vocab
    if not 1 <= int(rows) <= vocab:
        raise ValueError(f"output_vocab_size={rows} must be in [1, vocab_size={vocab}]")
    return int(rows)


class PrunedLMHead(ParallelLMHead):
    """The first `num_embeddings` rows of a `vocab_size`-wide head: [N, D] -> [N, vocab_size]
    float32 logits, -inf past `num_embeddings` (so every consumer sees the whole vocabulary)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, vocab_size: int) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.vocab_size = vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().forward(hidden)  # [N, num_embeddings], gathered over TP ranks
        return F.pad(logits, (0, self.vocab_size - self.num_embeddings), value=float("-inf"))


class Apertus1p5TextForCausalLM(ApertusForCausalLM):
    def __init__(self, config) -> None:
        super().__init__(config)
        rows = head_rows(config)
        if rows != config.vocab_size:
            # replaces the base's full-width head before any weight loads (its memory is
            # returned before the KV cache is sized)
            width = self.lm_head.weight.shape[1]
            self.lm_head = PrunedLMHead(rows, width, int(config.vocab_size))
