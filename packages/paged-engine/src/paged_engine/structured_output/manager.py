"""`StructuredOutputManager`: grammar compilation (cached, off the step thread) and each step's
token bitmask.

- `new_constraint(params, bad_words_ids)` (input processor, on add_request): checks the grammar
  (ValueError naming the field) and starts compiling it on the manager's own thread; a grammar
  compiled before (same constraint) is reused. The backend is built there too (its own copy of
  the tokenizer and its conversion: ~1.4 s for 50k tokens), by `warm` when paged-server starts,
  else with the first constrained request.
  The check is llguidance's own validation (vLLM's `validate_guidance_grammar`), without the
  tokenizer (`grammar.grammar_text`, also run by the server on its HTTP thread) and, for a
  grammar that names special tokens (`<|x|>`, `<name>`, `<[id]>`), against this engine's
  tokenizer (the first such request waits for the backend). What only compiling can find fails
  the request after admission (`EngineCore._admit_compiled`: RequestFailedError, not a reply).
- `fill_bitmask(sched, requests)` (engine core, after scheduling): one [R, W] int32 row per
  sampled sequence of a constrained request (d + 1 rows for one with d speculative drafts), as
  plain data in the `SchedulerOutput`; the sampler masks the logits with it in one batched op.
"""

from __future__ import annotations

import copy
import logging
from collections import OrderedDict
from collections.abc import Collection, Iterable
from concurrent.futures import Future, ThreadPoolExecutor

from paged_engine.core.request import Request
from paged_engine.core.sched_output import SchedulerOutput
from paged_engine.structured_output.backend import GrammarBackend, GrammarMatcher
from paged_engine.structured_output.bitmask import allocate_bitmask
from paged_engine.structured_output.grammar import grammar_text
from paged_engine.structured_output.params import StructuredOutputsParams
from paged_engine.structured_output.request_constraint import RequestConstraint
from paged_engine.structured_output.thinking_budget import ThinkingBudget

logger = logging.getLogger(__name__)

_CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped first)
# ...and at most this many characters of grammar text among them: a compiled grammar holds
# ~40 bytes of native memory per character of its text (measured: 0.75 MB for a 15k-character
# JSON schema, 19 MB for a 500k-character one), so 256 large schemas from clients held ~5 GB.
# 12M characters: ~500 MB, vLLM's bound for its compiled grammars (VLLM_XGRAMMAR_CACHE_MB).
_CACHE_CHARS = 12_000_000


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Collection[int]) -> None:
        self._tokenizer = tokenizer  # the engine thread's; the compile thread gets a copy
        # The masks cover every id the tokenizer has: one can hold added tokens past the model's
        # vocab_size (never sampled: the sampler reads the first vocab_size columns), and
        # llguidance refuses a vocabulary smaller than its tokenizer.
        self.vocab_size = max(vocab_size, _tokenizer_size(tokenizer))
        self._eos = tuple(eos_token_ids)
        self._backend: GrammarBackend | None = None  # built on the compile thread
        self._pool: ThreadPoolExecutor | None = None
        self._cache: OrderedDict[str, Future[GrammarMatcher]] = OrderedDict()
        self._chars: dict[str, int] = {}  # key -> its grammar text's length (same keys)
        self.cached_chars = 0  # their sum: at most _CACHE_CHARS but for the newest entry

    def new_constraint(
        self,
        params: StructuredOutputsParams | None,
        bad_words: list[list[int]],
        thinking: ThinkingBudget | None = None,
    ) -> RequestConstraint | None:
        if params is None and not bad_words and thinking is None:
            return None
        grammar = None if params is None else self._compile(params)
        return RequestConstraint(grammar, bad_words, thinking)

    def _compile(self, params: StructuredOutputsParams) -> Future[GrammarMatcher]:
        key = params.key()
        fut = self._cache.get(key)
        if fut is not None and not (fut.done() and fut.exception() is not None):
            self._cache.move_to_end(key)  # compiled, or compiling: shared
            return fut
        text = grammar_text(params)  # raises ValueError on this thread, before anything queues
        field = f"structured_outputs.{params.kind}"
        if params.kind in ("grammar", "structural_tag") and "<" in text:
            self._check_tokens(text, field)  # special tokens: only the tokenizer can say
        fut = self._thread().submit(self._compile_named, text, field)
        self._cache.pop(key, None)  # a failed compile's, replaced
        self.cached_chars -= self._chars.pop(key, 0)
        self._cache[key], self._chars[key] = fut, len(text)
        self.cached_chars += len(text)
        while len(self._cache) > 1 and (
            len(self._cache) > _CACHE_SIZE or self.cached_chars > _CACHE_CHARS
        ):  # the oldest go (requests compiling or running keep their own future)
            old, _ = self._cache.popitem(last=False)
            self.cached_chars -= self._chars.pop(old)
        return fut

    def _check_tokens(self, text: str, field: str) -> None:
        """ValueError if the grammar's special tokens (or token ids) are not this tokenizer's.
        (A `<` may as well sit in a literal: then the check passes, at the cost of the backend
        being built now rather than on the first compile.)"""
        backend = self._backend or self._thread().submit(self._backend_now).result()
        error = backend.check(text)
        if error:
            raise ValueError(f"{field} is invalid for this model's tokenizer: {error}")

    def warm(self) -> None:
        """Start building the backend on the compile thread now and return: paged-server calls
        it once serving, so that no request waits for it (a ~50k-token vocabulary: ~1.4 s, the
        engine thread stalled by the copy and, for a grammar naming special tokens, the build).
        A no-op without llguidance (a constrained request then names the extra)."""
        try:
            import llguidance  # noqa: F401
        except ImportError:
            return
        self._thread().submit(self._backend_now).add_done_callback(_log_failure)

    def _thread(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="paged-grammar")
        return self._pool

    def _backend_now(self) -> GrammarBackend:
        """The backend, built on the compile thread (the only thread that builds it) from its
        own copy of the tokenizer (copied there too: ~0.3 s for 50k tokens)."""
        if self._backend is None:
            from paged_engine.structured_output.llguidance_backend import LLGuidanceBackend

            tokenizer = copy.deepcopy(self._tokenizer)
            self._backend = LLGuidanceBackend(tokenizer, self.vocab_size, self._eos)
        return self._backend

    def _compile_named(self, text: str, field: str) -> GrammarMatcher:
        try:
            return self._compile_now(text)
        except ValueError as e:
            raise ValueError(f"{field}: {e}") from None

    def _compile_now(self, text: str) -> GrammarMatcher:
        return self._backend_now().compile(text)

    def fill_bitmask(self, sched: SchedulerOutput, requests: Iterable[Request]) -> None:
        """Set `sched.token_bitmask` for the sampled sequences of constrained `requests`: one
        row per sequence, or d + 1 consecutive rows for one with d drafts (the mask at each
        draft's position and the bonus position), filled with the drafts before it accepted;
        the matchers are rolled back after."""
        sampled = {sched.seq_ids[r] for r in sched.sample_rows}
        spec = sched.spec_token_ids
        seqs = [
            (req.constraint, seq, spec.get(seq.seq_id, ()))
            for req in requests
            for seq in req.live_seqs()
            if seq.seq_id in sampled
        ]
        if not seqs:
            return
        firsts = []
        num_rows = 0
        for _, _, drafts in seqs:
            firsts.append(num_rows)
            num_rows += 1 + len(drafts)
        bitmask = allocate_bitmask(num_rows, self.vocab_size)
        grammar = []
        for first, (c, seq, drafts) in zip(firsts, seqs):
            m = c.matcher(seq.seq_id)
            if m is not None:
                grammar.append((m, first, drafts))
        if grammar:
            assert self._backend is not None  # a ready grammar was compiled by it
            # Position by position: every matcher's mask at its j-th row in one call, then
            # those with a draft j accept it (the scheduler drafted only allowed tokens).
            j, live = 0, grammar
            while live:
                self._backend.fill_bitmasks([(m, first + j) for m, first, _ in live], bitmask)
                live = [g for g in live if j < len(g[2])]
                for m, _, drafts in live:
                    accepted = m.accept(drafts[j])
                    assert accepted, "a draft the grammar does not allow"
                j += 1
            for m, _, drafts in grammar:
                m.rollback(len(drafts))
        for first, (c, seq, drafts) in zip(firsts, seqs):
            if c.bad_words:
                history = seq.output_token_ids
                for j in range(len(drafts) + 1):
                    c.ban_bad_words([*history, *drafts[:j]] if j else history, bitmask[first + j])
            c.force(seq.seq_id, bitmask[first])  # after the rest: a forced id wins (no drafts)
        ids = [seq.seq_id for _, seq, drafts in seqs for _ in range(1 + len(drafts))]
        sched.token_bitmask = (ids, bitmask)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _log_failure(fut: Future) -> None:
    """A warm-up that failed is retried by the first compile, which reports the error."""
    error = None if fut.cancelled() else fut.exception()
    if error is not None:
        logger.warning("structured outputs: building the grammar backend failed: %s", error)


def _tokenizer_size(tokenizer) -> int:
    """Ids the tokenizer can produce (added tokens included); 0 where it cannot say."""
    try:
        return len(tokenizer)
    except TypeError:
        return 0
