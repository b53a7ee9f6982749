"""`GritLM` (parasail-ai/GritLM-7B-vllm: GritLM-7B's Mistral weights under vLLM's architecture
name): the embedding side of a generative / embedding model, as vLLM's `GritLM` serves it.

The weights are a Mistral / Llama decoder's (`model.` prefix, an LM head this class skips). As
vLLM does for its pooling runner, every layer attends bidirectionally over the whole prompt
(`BidirectionalAttention`, models/gemma3_encoder.py; the config's `sliding_window` dropped), so
the engine runs it as an encoder (engine/encoder.py: one step per sequence, no KV cache).

Pooling (vLLM's `GritLMMeanPool`): the mean of the final normed hidden states over the prompt
tokens after its instruction, normalized. The instruction is found by token ids, looked up in
the tokenizer at start (`read_tokenizer`):

    "<s>" first, else no instruction (instruction length 0);
    "<s>" "▁<" "|" "user" "|" ">" "<0x0A>" ...: "<0x0A>" "<" "|" "embed" "|" ">" "<0x0A>" ends it;
    otherwise "▁<" "|" "embed" "|" ">" "<0x0A>" (from position 1 on) ends it;
    no such pattern: the "<s>" alone is the instruction (length 1).

(vLLM's prompt forms: "<|user|>\\nINSTRUCTION\\n<|embed|>\\nTEXT" and "<|embed|>\\nTEXT".) A
prompt with nothing after its instruction pools zeros (vLLM's mean of no rows is NaN). The
model's forward writes each sequence's pooled vector into all of its rows, so the engine's
pooling of any one row returns it; per-token tasks ("token_embed") are refused by name.

Generation under this name is refused (`pooling_only`): vLLM's `GritLM` also generates with its
runner "generate"; here the same checkpoint generates as `MistralForCausalLM`
(`hf_overrides={"architectures": ["MistralForCausalLM"]}`).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from paged_engine.models.base_model import headless
from paged_engine.models.bert import sequence_bounds
from paged_engine.models.gemma3_encoder import BidirectionalDecoder
from paged_engine.models.llama import LlamaForCausalLM

# the tokens vLLM matches ("▁<": "<" starting a word; "<0x0A>": the newline byte token)
TOKENS = ("<s>", "▁<", "<", "|", "embed", ">", "<0x0A>", "user")
USER = ("▁<", "|", "user", "|", ">", "<0x0A>")
EMBED_AFTER_USER = ("<0x0A>", "<", "|", "embed", "|", ">", "<0x0A>")
EMBED = ("▁<", "|", "embed", "|", ">", "<0x0A>")


def _find(ids: list[int], pattern: list[int], start: int, end: int | None = None) -> int:
    """The first i in [start, end) with ids[i : i + len(pattern)] == pattern, else -1."""
    n = len(pattern)
    stop = len(ids) - n + 1 if end is None else min(end, len(ids) - n + 1)
    return next((i for i in range(start, stop) if ids[i : i + n] == pattern), -1)


def instruction_length(ids: list[int], token_ids: dict[str, int]) -> int:
    """How many leading prompt tokens are GritLM's instruction (vLLM's rule, above)."""
    if not ids or ids[0] != token_ids["<s>"]:
        return 0
    embed = EMBED
    if _find(ids, [token_ids[t] for t in USER], 1, 2) == 1:
        embed = EMBED_AFTER_USER
    at = _find(ids, [token_ids[t] for t in embed], 1)
    return 1 if at == -1 else at + len(embed)


class GritLM(
    BidirectionalDecoder,
    headless(LlamaForCausalLM, "LlamaForCausalLM"),  # type: ignore[misc]
):
    """Llama's stack run bidirectionally, mean-pooled after the prompt's instruction."""

    pooling_only = (
        "GritLM's embedding model (it generates as MistralForCausalLM: hf_overrides="
        '{"architectures": ["MistralForCausalLM"]})'
    )
    default_pooler_config: ClassVar[dict] = {"pooling_type": "CLS", "normalize": True}
    pooled_rows: ClassVar[bool] = True  # every row of a sequence is its pooled vector

    def __init__(self, config) -> None:
        super().__init__(config)
        found = getattr(config, "gritlm_token_ids", None)  # set by `read_tokenizer`
        self.token_ids: dict[str, int] = dict(found or {t: -1 for t in TOKENS})

    @staticmethod
    def read_tokenizer(hf_config: Any, tokenizer: Any) -> None:
        """The ids of the tokens the instruction patterns use (-1: not in the vocabulary)."""
        ids = tokenizer.convert_tokens_to_ids(list(TOKENS))
        hf_config.gritlm_token_ids = {
            t: (i if isinstance(i, int) else -1) for t, i in zip(TOKENS, ids, strict=True)
        }

    def forward(self, input_ids, positions, kv_caches, attn_metadata, hidden=None):
        # the bidirectional stack (run with no caches): [T, D]
        h = super().forward(input_ids, positions, kv_caches, attn_metadata, hidden)
        out = torch.zeros(h.shape, dtype=torch.float32, device=h.device)  # pooled in float32
        for lo, hi in sequence_bounds(attn_metadata):
            skip = instruction_length(input_ids[lo:hi].tolist(), self.token_ids)
            if lo + skip < hi:
                out[lo:hi] = h[lo + skip : hi].float().mean(0)
        return out


GRITLM: dict[str, type[nn.Module]] = {"GritLM": GritLM}
