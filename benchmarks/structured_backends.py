"""xgrammar against llguidance on our workload: which grammar engine backs structured outputs.

    python -m benchmarks.structured_backends [--steps 64] [--batch 32] [--out FILE]

Per backend and vocabulary (SmolLM2-135M's 49,152 tokens; a synthetic 150,000-token byte-level
vocabulary built from it, the size of Qwen's):
- tokenizer set-up: once per engine;
- compile: each schema of `structured_schemas.SCHEMAS` compiled by a fresh compiler (no cache),
  the time until its first token mask can be filled;
- mask per step: `--batch` matchers (the schemas in turn), each walked through its instance's
  tokens; per step every row's bitmask is filled (one by one, and with the backend's own
  multi-threaded batch call) and the row's next token accepted; a row that reaches the end of
  its instance starts over with a new matcher of the cached grammar (counted in accept). The
  mean over `--steps` steps, in ms for the whole batch.
- apply: unpacking the [batch, V/32] int32 bitmask and masking float32 logits in torch, one op
  for the batch (what the sampler does).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.structured_schemas import SCHEMAS

SEPARATORS = (", ", ": ")


def default_tokenizer():
    from paged_engine.default_model import default_model_path
    from paged_engine.loader import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(str(default_model_path())))


def widen_vocab(tokenizer, size: int, seed: int = 0):
    """A fast tokenizer whose vocabulary is `tokenizer`'s plus byte-level tokens made by joining
    two random existing tokens, up to `size` (masks cost scales with the vocabulary, not with
    how it was learned)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    words = [w for w in vocab if len(w) > 1]
    rng = np.random.default_rng(seed)
    while len(vocab) < size:
        a, b = rng.integers(0, len(words), 2)
        vocab.setdefault(words[a] + words[b], len(vocab))
    wide = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)))
    wide.eos_token = tokenizer.eos_token
    return wide


class XGrammarBench:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)

    def compile(self, schema: dict):
        compiler = self.xgr.GrammarCompiler(self.info, cache_enabled=False)
        return compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=SEPARATORS
        )

    def matcher(self, grammar):
        return self.xgr.GrammarMatcher(grammar)

    def fill(self, matcher, bitmask: torch.Tensor, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def fill_batch(self, matchers, bitmask: torch.Tensor) -> None:
        if not hasattr(self, "_batch"):
            self._batch = self.xgr.BatchGrammarMatcher()
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)


class LLGuidanceBench:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.numpy

        self.llg = llguidance
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.executor = llguidance.LLExecutor()

    def compile(self, schema: dict):
        opts = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, overrides=opts)
        error = self.llg.LLMatcher.validate_grammar(grammar, self.tok)
        assert not error, error
        return grammar

    def matcher(self, grammar):
        matcher = self.llg.LLMatcher(self.tok, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def fill(self, matcher, bitmask: torch.Tensor, row: int) -> None:
        self.llg.numpy.fill_next_token_bitmask(matcher, bitmask.numpy(), row)

    def fill_batch(self, matchers, bitmask: torch.Tensor) -> None:
        pairs = [(m, i) for i, m in enumerate(matchers)]
        self.llg.numpy.fill_next_token_bitmask_par(self.executor, pairs, bitmask.numpy())

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)


def _instance_tokens(tokenizer, eos: int) -> dict[str, list[int]]:
    return {
        name: tokenizer.encode(json.dumps(inst, separators=SEPARATORS), add_special_tokens=False)
        + [eos]
        for name, (_, inst) in SCHEMAS.items()
    }


def measure(backend_cls, tokenizer, vocab_size: int, batch: int, steps: int) -> dict:
    t0 = time.perf_counter()
    bench = backend_cls(tokenizer, vocab_size)
    setup_s = time.perf_counter() - t0
    compile_ms = {}
    for name, (schema, _) in SCHEMAS.items():
        t0 = time.perf_counter()
        m = bench.matcher(bench.compile(schema))
        bitmask = torch.zeros(1, (vocab_size + 31) // 32, dtype=torch.int32)
        bench.fill(m, bitmask, 0)  # the first mask: lazily built tables are paid here
        compile_ms[name] = (time.perf_counter() - t0) * 1e3
    tokens = _instance_tokens(tokenizer, tokenizer.eos_token_id)
    names = list(SCHEMAS)
    grammars = {n: bench.compile(SCHEMAS[n][0]) for n in names}  # compiled once (the cache)
    rows = [names[i % len(names)] for i in range(batch)]
    bitmask = torch.zeros(batch, (vocab_size + 31) // 32, dtype=torch.int32)
    result = {}
    for mode in ("per_row", "batch_call"):
        matchers = [bench.matcher(grammars[n]) for n in rows]
        pos = [0] * batch
        fill_s = accept_s = 0.0
        for _ in range(steps):
            t0 = time.perf_counter()
            if mode == "per_row":
                for i, m in enumerate(matchers):
                    bench.fill(m, bitmask, i)
            else:
                bench.fill_batch(matchers, bitmask)
            t1 = time.perf_counter()
            for i, m in enumerate(matchers):
                toks = tokens[rows[i]]
                tok = toks[pos[i]]
                word, bit = divmod(tok, 32)
                assert (int(bitmask[i, word]) >> bit) & 1, (bench.name, rows[i], pos[i])
                assert bench.accept(m, tok), (bench.name, rows[i], pos[i])
                pos[i] += 1
                if pos[i] == len(toks):  # the document is done: a new matcher starts over
                    matchers[i], pos[i] = bench.matcher(grammars[rows[i]]), 0
            t2 = time.perf_counter()
            fill_s += t1 - t0
            accept_s += t2 - t1
        result[f"mask_ms_per_step_{mode}"] = round(fill_s / steps * 1e3, 3)
        if mode == "per_row":
            result["accept_ms_per_step"] = round(accept_s / steps * 1e3, 3)
    return {
        "backend": bench.name,
        "vocab_size": vocab_size,
        "tokenizer_setup_s": round(setup_s, 3),
        "compile_ms": {k: round(v, 2) for k, v in compile_ms.items()},
        "compile_ms_median": round(statistics.median(compile_ms.values()), 2),
        "compile_ms_max": round(max(compile_ms.values()), 2),
        **result,
    }


def apply_ms(batch: int, vocab_size: int, reps: int = 20) -> float:
    from paged_engine.structured_output.bitmask import apply_token_bitmask

    logits = torch.randn(batch, vocab_size)
    bitmask = torch.randint(
        -(2**31), 2**31 - 1, (batch, (vocab_size + 31) // 32), dtype=torch.int32
    )
    rows = torch.arange(batch)
    apply_token_bitmask(logits, rows, bitmask)
    t0 = time.perf_counter()
    for _ in range(reps):
        apply_token_bitmask(logits, rows, bitmask)
    return round((time.perf_counter() - t0) / reps * 1e3, 3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--wide-vocab", type=int, default=150_000)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    small = default_tokenizer()
    tokenizers = [(small, 49152), (widen_vocab(small, args.wide_vocab), args.wide_vocab)]
    runs = []
    for tok, vocab in tokenizers:
        for cls in (XGrammarBench, LLGuidanceBench):
            runs.append(measure(cls, tok, vocab, args.batch, args.steps))
            print(json.dumps(runs[-1]))
        runs.append({"backend": "torch apply (sampler)", "vocab_size": vocab,
                     "apply_ms_per_step": apply_ms(args.batch, vocab)})  # fmt: skip
        print(json.dumps(runs[-1]))
    record = {
        "workload": f"{len(SCHEMAS)} schemas, batch {args.batch}, {args.steps} steps",
        "command": "python -m benchmarks.structured_backends",
        "machine": f"{platform.machine()}, {_cores()} cores, torch threads 1",
        "runs": runs,
    }
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


if __name__ == "__main__":
    main()
