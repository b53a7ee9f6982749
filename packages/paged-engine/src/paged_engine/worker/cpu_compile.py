"""`compilation_config` level >= 1 on the CPU: the model's forward through `torch.compile`.

Inductor turns the decoder's small ops (RMSNorm, RoPE, residual adds, SiLU * up: ~60 ATen calls
a layer, ~4 us of dispatch each) into a few fused C++ loops, and its generated code calls the
rest without Python in between. Two operators stay opaque (layers/compiled_ops.py): a quantized
layer's eager kernels (fbgemm's fp16 GEMM, int8 / int4 with several rows) and the paged attention
of the step's backend, which reads the step's metadata and caches from the forward context set
around each call. An int8 layer's single-row GEMV is traced instead (`Int8Linear._gemv` over
weights reordered into int32 words): inductor's loop reads the int8 weights at ~22 GB/s on 2
AVX2 cores, 2.4x the weights per second of fbgemm's fp16 GEMV. An int8 tied LM head gets a
compiled `compute_logits` of its own for the same reason.

Three graphs serve every step, all compiled while the engine starts:

    single   one token (one sequence decoding): static shapes but for the sequence's block
             count; its attention is traced (`CpuBackend.attend_decode`: KV write, block
             gather, two matmuls, softmax) and an int8 layer's GEMV too, so the whole forward
             is one C++ call sequence
    decode   S >= 2 sequences of one token each: the row and block counts symbolic, attention
             traced the same way, linear layers as in the general graph
    general  any other step (prefill, chunked prefill beside decode): the token count
             symbolic, attention through the operator

The warm-up forwards write nothing but into the null block (zeroed after) and read only it.

Guards: dynamo would check ~50 guards per layer before each call (~1 ms for 30 layers); the
model's modules never change after loading, so guards on them are dropped. Dynamo caches
graphs per code object, so each engine compiles through its own copy of `_forward`'s code:
another engine's model of the same class never runs this one's graphs.
"""

from __future__ import annotations

import logging
import time
import types
from typing import TYPE_CHECKING

import numpy as np
import torch

from paged_engine.attention import AttentionMetadata, HostLengths
from paged_engine.attention.cpu_backend import CpuBackend, DecodeRows
from paged_engine.layers import compiled_ops
from paged_engine.layers.attention import Attention
from paged_engine.layers.quantization import Int8Linear, QuantizedLinearMethod, QuantizedTiedHead
from paged_kernels import FP8_DTYPES

if TYPE_CHECKING:
    from paged_engine.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def _forward(model, input_ids, positions, kv_caches, md):
    return model(input_ids, positions, kv_caches, md)


def _logits(model, hidden):
    return model.compute_logits(hidden)


def _own_copy(fn: types.FunctionType, owner: object, tag: str) -> types.FunctionType:
    """`fn` with a code object of its own: dynamo's graph cache is per code object."""
    code = fn.__code__.replace(co_name=f"compiled_{tag}_{id(owner):x}")
    return types.FunctionType(code, fn.__globals__, code.co_name)


def _skip_module_guards(entries) -> list[bool]:
    return [not e.orig_guard.source.is_unspecialized_nn_module() for e in entries]


def _null_rows(num_rows: int, num_blocks: int) -> DecodeRows:
    """Warm-up rows: one token each at position 0, written to the null block's slot 0, over
    tables of null blocks; both sizes marked dynamic (the block count always, the row count
    where it is not the one-token graph's static 1)."""
    tables = torch.zeros(num_rows, num_blocks, dtype=torch.int64)
    seq_lens = torch.ones(num_rows, dtype=torch.int64)
    slots = torch.zeros(num_rows, dtype=torch.int64)
    torch._dynamo.mark_dynamic(tables, 1)
    if num_rows > 1:
        for t in (tables, seq_lens, slots):
            torch._dynamo.mark_dynamic(t, 0)
    return DecodeRows(tables, seq_lens, slots)


def _compile(fn: types.FunctionType):
    # A fresh options dict per call: torch.compile takes guard_filter_fn out of the one it
    # gets, so a shared dict would leave every later graph with its ~9,000 module guards.
    # No size / alignment asserts after each opaque operator (~1 us each, 10 per layer):
    # their fake implementations state the shapes.
    options = {
        "guard_filter_fn": _skip_module_guards,
        "size_asserts": False,
        "alignment_asserts": False,
    }
    return torch.compile(fn, fullgraph=True, options=options)


class CompiledForward:
    """The runner's model forward, compiled; `compile()` once the KV cache exists."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        traced_head = False  # an int8 head: its single-row GEMV is worth a graph of its own
        for module in runner.model.modules():
            lm = getattr(module, "linear_method", None)
            if isinstance(lm, QuantizedLinearMethod | QuantizedTiedHead):
                method = lm.method
                if isinstance(method, Int8Linear):
                    method.use_words()
                method.op_handle = compiled_ops.register(method)
                if isinstance(lm, QuantizedTiedHead):
                    lm.op_handle = compiled_ops.register(lm)
                    traced_head = isinstance(method, Int8Linear) and method.words is not None
        self.compiled = _compile(_own_copy(_forward, self, "general"))
        self.single = self.decode = None
        if isinstance(runner.backend, CpuBackend) and runner.backend.kv_multiple == 1:
            self.single = _compile(_own_copy(_forward, self, "single"))
            if runner.config.max_num_seqs > 1:
                self.decode = _compile(_own_copy(_forward, self, "decode"))
        self.head = None
        if traced_head:
            self.head = _compile(_own_copy(_logits, self, "logits"))

    def _dummy_meta(self, num_tokens: int) -> AttentionMetadata:
        """`num_tokens` sequences of one token at position 0 that write nothing."""
        n = num_tokens
        cu = np.arange(n + 1, dtype=np.int64)
        seq_lens = np.ones(n, dtype=np.int64)
        tables = np.zeros((n, 1), dtype=np.int32)
        slots = np.full(n, -1, dtype=np.int64)
        return self.runner.backend.build_metadata(
            slot_mapping=torch.from_numpy(slots),
            block_tables=torch.from_numpy(tables),
            cu_seqlens_q=torch.from_numpy(cu.astype(np.int32)),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
            max_seqlen_q=1,
            max_seqlen_k=1,
            host=HostLengths(cu, seq_lens, tables, slots),
        )

    def _map_caches(self) -> None:
        """Each Attention layer's index in kv_caches, from one eager forward (the model hands
        each layer its cache; nothing else says which is whose)."""
        r = self.runner
        assert r.cache is not None
        attention = [m for m in r.model.modules() if isinstance(m, Attention)]
        index = {id(k): i for i, (k, _) in enumerate(r.cache.kv_caches)}
        seen: dict[int, int] = {}

        def hook(module, args, kwargs):
            kv_cache = args[3] if len(args) > 3 else kwargs["kv_cache"]
            seen[id(module)] = index[id(kv_cache[0])]

        hooks = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in attention]
        try:
            ids = torch.zeros(1, dtype=torch.int64)
            r.model(ids, ids.clone(), r.cache.kv_caches, self._dummy_meta(1))
        finally:
            for h in hooks:
                h.remove()
        for m in attention:
            m.kv_index = seen[id(m)]
            m.op_handle = compiled_ops.register(m)
            # attend_decode covers windows, attention chunks, soft caps and sinks, not an fp8
            # cache, ALiBi or a layer reading another's cache (those run `Attention.run` in the
            # operator, which passes everything on).
            key_cache = r.cache.kv_caches[m.kv_index][0]
            m.trace_decode = (
                self.single is not None
                and key_cache.dtype not in FP8_DTYPES
                and m.alibi_slopes is None
                and m.kv_source is None
            )

    @torch.inference_mode()
    def compile(self) -> None:
        t0 = time.perf_counter()
        self._map_caches()
        r = self.runner
        assert r.cache is not None
        # general: 2 tokens, marked dynamic (symbolic from 2 up; decode steps run the others).
        ids = torch.zeros(2, dtype=torch.int64)
        pos = ids.clone()
        torch._dynamo.mark_dynamic(ids, 0)
        torch._dynamo.mark_dynamic(pos, 0)
        rows = self._forward(ids, pos, self._dummy_meta(2))
        if self.decode is not None:
            # 2 rows of 3-block tables (unequal sizes: dynamo would tie equal ones together).
            meta = self._dummy_meta(2)
            meta.decode = _null_rows(2, 3)
            self._forward(ids, pos, meta)
        # single: one token at position 0 of a 2-block table of null blocks (block count
        # symbolic), writing its K/V into the null block's slot 0.
        ids = torch.zeros(1, dtype=torch.int64)
        meta = self._dummy_meta(1)
        if self.single is not None:
            meta.decode = _null_rows(1, 2)
        hidden = self._forward(ids, ids.clone(), meta)
        for key_cache, value_cache in r.cache.kv_caches:  # nothing real lives in block 0
            key_cache[:, 0].zero_()
            value_cache[:, 0].zero_()
        if self.head is not None:  # one row (traced GEMV), then a symbolic row count
            self.head(r.model, hidden)
            torch._dynamo.mark_dynamic(rows, 0)
            self.head(r.model, rows)
        logger.info("torch.compile: model forward compiled in %.1fs", time.perf_counter() - t0)

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        num_tokens = input_ids.shape[0]
        if self.decode is not None or (num_tokens == 1 and self.single is not None):
            block_size = self.runner.cache.kv_caches[0][0].shape[2]  # type: ignore[union-attr]
            meta.decode = DecodeRows.from_metadata(meta, block_size)
        return self._forward(input_ids, positions, meta)

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        r = self.runner
        assert r.cache is not None
        kv_caches = r.cache.kv_caches
        fn = self.compiled
        if meta.decode is not None:
            fn = self.single if input_ids.shape[0] == 1 else self.decode
        with compiled_ops.forward_context(kv_caches, meta):
            return fn(r.model, input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.head is None:
            return self.runner.model.compute_logits(hidden)
        return self.head(self.runner.model, hidden)
