"""Token embedding and LM head, split over the vocabulary for tensor parallelism."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.distributed.communication import tp_all_gather, tp_all_reduce
from paged_engine.distributed.parallel_state import get_tp_rank, get_tp_size


class VocabParallelEmbedding(nn.Module):
    """Rows [rank*ceil(V/tp), (rank+1)*ceil(V/tp)) of the embedding; tokens outside the shard
    embed to 0 and an all-reduce over the TP group completes the lookup."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        super().__init__()
        tp_rank = get_tp_rank() if tp_rank is None else tp_rank
        tp_size = get_tp_size() if tp_size is None else tp_size
        self.num_embeddings = num_embeddings
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.shard_size = -(-num_embeddings // tp_size)  # ceil; the last shard may be padded
        self.vocab_start = tp_rank * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, embedding_dim))
        self.weight.weight_loader = self.weight_loader

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        full = (self.num_embeddings, *param.shape[1:])
        if tuple(loaded_weight.shape) != full:
            raise ValueError(f"expected {full}, got {tuple(loaded_weight.shape)}")
        shard = loaded_weight[self.vocab_start : self.vocab_start + self.shard_size]
        param.data[: shard.shape[0]].copy_(shard)
        param.data[shard.shape[0] :].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, D]
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        valid = (local >= 0) & (local < self.shard_size)
        out = F.embedding(local.clamp(0, self.shard_size - 1), self.weight)
        return tp_all_reduce(out * valid.unsqueeze(-1).to(out.dtype))


class ParallelLMHead(VocabParallelEmbedding):
    """logits = hidden @ W^T (+ b). `tie_to(embedding)` shares the embedding's weight."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        bias: bool = False,
        tp_rank: int | None = None,
        tp_size: int | None = None,
    ) -> None:
        super().__init__(num_embeddings, embedding_dim, tp_rank, tp_size)
        if bias:
            self.bias = nn.Parameter(torch.empty(self.shard_size))
            self.bias.weight_loader = self._bias_loader
        else:
            self.register_parameter("bias", None)

    def _bias_loader(self, param, loaded_weight, shard_id=None) -> None:
        if tuple(loaded_weight.shape) != (self.num_embeddings,):
            raise ValueError(f"expected ({self.num_embeddings},), got {tuple(loaded_weight.shape)}")
        shard = loaded_weight[self.vocab_start : self.vocab_start + self.shard_size]
        param.data[: shard.shape[0]].copy_(shard)
        param.data[shard.shape[0] :].zero_()  # the padded rows of the last shard (dropped)

    linear_method = None  # an object with apply(layer, x, bias), set after loading

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def untie(self) -> None:
        """A weight of its own again (uninitialized; the shared one's width, dtype and device),
        loaded by this head's `weight_loader`."""
        shared = self.weight
        shape = (self.shard_size, shared.shape[1])
        self.weight = nn.Parameter(torch.empty(shape, dtype=shared.dtype, device=shared.device))
        self.weight.weight_loader = self.weight_loader

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, V] float32
        # Every TP rank ends with the same full logits (the gathered bits), so every rank
        # samples the same tokens from them.
        if self.linear_method is None:
            local = F.linear(hidden, self.weight, self.bias)
        else:  # quantized or batch-invariant (layers/quantization.py, batch_invariant.py)
            local = self.linear_method.apply(self, hidden, self.bias)
        logits = tp_all_gather(local, dim=-1)
        # Drop the padded rows of the last shard (only when the vocab does not split evenly).
        if logits.shape[-1] != self.num_embeddings:
            logits = logits[..., : self.num_embeddings]
        return logits.float()
