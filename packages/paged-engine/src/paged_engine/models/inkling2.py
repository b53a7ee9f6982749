"""Thinking Machines' Inkling 2 (`Inkling2ForCausalLM`, model_type "inkling2_text") and Inkling 2
Loop (`Inkling2LoopForCausalLM`, "inkling2_loop_text"), served as transformers runs them; the
layers are models/inkling2_layers.py's.

    embedding  the token row, RMS-normed (`embed_tokens.embed_norm`), as Inkling 1's
    stack      layers carry, beside the residual x, the list of block states (each boundary
               layer's input); after the last layer `final_input` attends over [blocks, x]
               and the final norm follows
    loop       (Loop) layers [loop_layer_index_start, loop_layer_index_end) run
               `loop_num_passes` times. Each later pass restarts from the pre-loop x and blocks;
               its layer j first reads four messages (`message_input`, queries [L, 4, D]) from
               the previous pass's blocks (less the first: the pre-loop x) and its final x. The
               layers after the loop see the last pass's blocks
    head       lm_head has `unpadded_vocab_size` rows; logits are tanh-softcapped at
               `final_logit_softcapping`, and -inf on the ids up to vocab_size (the head is
               padded with zero rows at load)

KV caches: one per layer in layer order, then, for passes 1.. of the loop, one per looped
layer (`kv_cache_layout`: transformers' order of the extra cache layers it appends). Conv
windows of later passes live in the layers' `pass_states`. Every layer holds KV and state, so
the engine runs these as hybrid models (models/hybrid.py), which refuses pipeline parallelism,
swap, CPU offload and batch-invariant mode by name; prefix caching resumes from state snapshots.
The attention is Inkling 1's torch path over the paged cache (exact, not fast) and the experts
run grouped in torch (`ActExperts`): eager only (CUDA graphs are refused when captured).

Refused by name: tensor_parallel_size > 1 (the block residuals and convs are not split),
`layer_types` other than hybrid / hybrid_sliding or without a full layer, scoring_func other
than sigmoid, conv_kernel_size < 2, and loop bounds transformers refuses.

Weights: the releases' names (`model.llm.*`), which transformers also writes on save, map to
ours by models/inkling_names.py (interleaved gate / up expert rows split into halves; the two
message-query tensors of the Loop fill `message_input.query` [L, 4, D], `MESSAGE_QUERY_RULES`);
names already in transformers' in-memory layout load as they are. Quantized experts (MXFP8 /
NVFP4 scales) are refused by the loader as unexpected weights.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from paged_engine.distributed.parallel_state import get_tp_size
from paged_engine.models.inkling import InklingEmbedding
from paged_engine.models.inkling2_layers import (
    FULL,
    SLIDING,
    Inkling2BlockResidual,
    Inkling2DecoderLayer,
    Inkling2RMSNorm,
)
from paged_engine.models.inkling_names import MESSAGE_QUERY_RULES, inkling2_name, split_pairs
from paged_engine.models.utils import CausalLMBase


def _load_message_queries(param: nn.Parameter, w: torch.Tensor, shard: int | None = None):
    """[L, 4, D] (q, k, v, mlp) from [2L, D] rows (q, mlp) of each layer (shard 0) and (k, v)
    (shard 1), or whole (no shard)."""
    if shard is None:
        param.data.copy_(w)
        return
    rows = w.view(param.shape[0], 2, param.shape[2])
    cols = [0, 3] if shard == 0 else [1, 2]
    param.data[:, cols] = rows.to(param.dtype)


def loop_bounds(config) -> tuple[int, int, int]:
    """(start, end, passes) of the looped layers; (0, 0, 1) without a loop."""
    if getattr(config, "loop_num_passes", None) is None:
        return 0, 0, 1
    start, end = int(config.loop_layer_index_start), int(config.loop_layer_index_end)
    passes, block = int(config.loop_num_passes), int(config.n_layers_per_attn_res_block)
    if passes < 1 or start <= 0 or start % block or end % block or not start < end:
        raise ValueError(
            "Inkling 2 Loop needs loop_num_passes >= 1 and 0 < loop_layer_index_start < "
            "loop_layer_index_end, both multiples of n_layers_per_attn_res_block, got "
            f"{passes}, {start}, {end} ({block})"
        )
    if end > config.num_hidden_layers:
        raise ValueError(f"loop_layer_index_end={end} is past num_hidden_layers")
    return start, end, passes


def _check(config) -> None:
    if get_tp_size() > 1:
        raise ValueError("Inkling 2 does not support tensor_parallel_size > 1")
    types = list(config.layer_types)
    if any(t not in (SLIDING, FULL) for t in types) or FULL not in types:
        raise ValueError(
            f"Inkling 2 layer_types must be {SLIDING!r} / {FULL!r} with at least one {FULL!r} "
            f"layer, got {types!r}"
        )
    if config.scoring_func != "sigmoid":
        raise ValueError(f"Inkling 2 supports scoring_func 'sigmoid' only: {config.scoring_func!r}")
    if int(config.conv_kernel_size) < 2:
        raise ValueError(f"Inkling 2 needs conv_kernel_size >= 2, got {config.conv_kernel_size}")


class Inkling2Model(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, float(config.rms_norm_eps)
        self.start, self.end, self.passes = loop_bounds(config)
        self.embed_tokens = InklingEmbedding(config.vocab_size, hidden, eps)
        self.embed_tokens.embed_norm = Inkling2RMSNorm(hidden, eps)
        self.layers = nn.ModuleList(
            Inkling2DecoderLayer(config, i, self.passes if self.start <= i < self.end else 1)
            for i in range(config.num_hidden_layers)
        )
        self.norm = Inkling2RMSNorm(hidden, eps)
        self.final_input = Inkling2BlockResidual(hidden)
        if self.passes > 1:
            self.message_input = Inkling2BlockResidual(
                hidden, shape=(self.end - self.start, 4, hidden)
            )
            self.message_input.query.weight_loader = _load_message_queries

    def cache_index(self, layer: int, pass_idx: int) -> int:
        """HF's order: the model's layers, then each later pass's looped layers."""
        if pass_idx == 0:
            return layer
        span = self.end - self.start
        return len(self.layers) + (pass_idx - 1) * span + layer - self.start

    def _run(self, idx: range, positions, x, blocks, kv_caches, md, pass_idx=0, previous=None):
        for i in idx:
            messages = None
            if previous is not None:  # (previous pass's blocks, its x)
                query = self.message_input.query[i - self.start]
                messages = self.message_input(*previous, query=query)
            x, blocks = self.layers[i](
                positions, x, blocks, kv_caches[self.cache_index(i, pass_idx)], md, pass_idx,
                messages,
            )  # fmt: skip
        return x, blocks

    def forward(self, input_ids, positions, kv_caches, md, hidden=None) -> torch.Tensor:
        x = self.embed_tokens(input_ids) if hidden is None else hidden
        dtype = x.dtype
        # without a loop start = end = 0: every layer runs in the last call
        x, blocks = self._run(range(self.start), positions, x, [], kv_caches, md)
        if self.end > self.start:
            pre_x, pre_blocks = x, blocks
            loop = range(self.start, self.end)
            x, blocks = self._run(loop, positions, x, blocks, kv_caches, md)
            for p in range(1, self.passes):
                previous = (blocks[len(pre_blocks) + 1 :], x)
                x, blocks = self._run(
                    loop, positions, pre_x, pre_blocks, kv_caches, md, p, previous
                )
        tail = range(self.end, len(self.layers))
        x, blocks = self._run(tail, positions, x, blocks, kv_caches, md)
        return self.norm(self.final_input(blocks, x)[:, 0]).to(dtype)


class Inkling2ForCausalLM(CausalLMBase):
    stacked_params = MESSAGE_QUERY_RULES
    ties_head = False  # HF keeps lm_head apart whatever tie_word_embeddings says

    def __init__(self, config) -> None:
        _check(config)
        super().__init__(config, Inkling2Model(config))
        self.softcap = float(config.final_logit_softcapping)
        self.unpadded_vocab = int(config.unpadded_vocab_size)

    @staticmethod
    def kv_cache_layout(config) -> list[tuple[int, int]]:
        """(num_kv_heads, head_dim) of each cache: the layers', then the later passes'."""
        full = (int(config.num_key_value_heads), int(config.head_dim))
        swa = (int(config.swa_num_key_value_heads), int(config.swa_head_dim))
        layers = [swa if t == SLIDING else full for t in config.layer_types]
        start, end, passes = loop_bounds(config)
        return layers + layers[start:end] * (passes - 1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, D] -> [N, V] fp32
        logits = super().compute_logits(hidden).float()
        logits = torch.tanh(logits / self.softcap) * self.softcap
        if self.unpadded_vocab < logits.shape[-1]:
            logits[:, self.unpadded_vocab :] = float("-inf")
        return logits

    def convert_weight(self, name: str, w: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if name.startswith("model.llm."):
            name = inkling2_name(name)
            if name.endswith("mlp.experts.gate_up_proj"):  # rows g0 u0 g1 u1 .. -> gate | up
                w = split_pairs(w, 1)
        if name == "lm_head.weight" and w.shape[0] < self.config.vocab_size:
            w = F.pad(w, (0, 0, 0, self.config.vocab_size - w.shape[0]))  # zero rows: -inf
        return ((name, w),)


class Inkling2LoopForCausalLM(Inkling2ForCausalLM):
    """Inkling 2 Loop: the same class; its config's loop fields turn the loop on."""


__all__ = ["Inkling2ForCausalLM", "Inkling2LoopForCausalLM"]
