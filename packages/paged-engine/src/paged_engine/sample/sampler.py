"""Batched sampling over a logits tensor [N, V]: one row per sequence that samples this step.

Processing order (vLLM's): token rules (grammar bitmask, allowed_token_ids, logit_bias) ->
min_tokens -> custom logits processors (sample/logits_processor.py) -> repetition / frequency /
presence penalties -> temperature -> argmax-invariant custom processors -> top-k -> top-p ->
min-p -> sample. Greedy rows take the argmax of the processed
logits; random rows use the exponential race (argmax of probs / Exp(1) noise), so nothing reads
the device on the host: the sampled ids stay on the device (the next step's inputs read them
there) and the worker copies them to the host asynchronously. Every pass is row-wise: a row's
result never depends on the other rows, so a seeded row samples the same tokens whatever else is
in the batch.

With a `race` (paged_kernels.gumbel_race, which the worker passes on CUDA) the random rows race
in one kernel pass instead: argmax of x / T + Gumbel noise from Philox keyed by a seed per row
(the draw's seed for a seeded row, one drawn from the engine-seeded host generator for the
others). Every random row races through it, plain or processed, dividing by T in the kernel or
before it to the same bits, so the promise above holds there too. Speculative verification
races with `noise` (torch's generators), so an engine that verifies drafts samples without the
kernel: one noise source for all its rows.

Logprobs are always those of the RAW model distribution (log_softmax of the unprocessed logits).

On a CPU top-p needs no whole-row sort where a row's most likely tokens hold top_p of the mass
(`_nucleus`); the bits are those of the sort.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from paged_engine.sample.logprobs import LogSumExp, gather_logprobs, torch_logsumexp
from paged_engine.sample.metadata import Penalties, SamplingMetadata
from paged_engine.structured_output.bitmask import apply_token_bitmask


@dataclass(slots=True)
class SamplerOutput:
    """Device tensors; `logprobs` is None when no row reports logprobs (see `gather_logprobs`
    for its packed layout)."""

    token_ids: Tensor  # [N] int64
    logprobs: Tensor | None  # [N, 3 + 3k] float64


def apply_penalties(x: Tensor, pen: Penalties, tally: Tensor | None = None) -> None:
    """Repetition penalty over prompt + output tokens, then frequency and presence over output
    tokens (in place, rows `pen.rows` only).

    Only the logits of tokens a row holds change, so the logits are read and written at the
    rows' histories [P, L] only, never in passes over [P, V]: each (row, token) of the history
    computes its new value from its own logit (the same arithmetic, in the same order, as a
    dense pass), and every occurrence of a token writes that same value back. `tally`: a zero
    scratch [>= P, V + 1] of x's dtype, zero again on return (the sampler keeps one, so a step
    neither allocates nor clears [P, V]); None allocates one.
    """
    prompt, output = pen.prompt_ids, pen.output_ids
    ids = torch.cat([prompt, output], dim=1)  # [P, L], PAD-padded
    real = ids >= 0
    # Padding takes a token the row holds (its largest id; PAD sorts below every id), whose own
    # new value it then writes again. A row without tokens points at token 0 and keeps it.
    fill = ids.max(dim=1, keepdim=True).values.clamp_(min=0)
    ids = torch.where(real, ids, fill)
    rows = pen.rows[:, None].expand_as(ids)
    old = x[rows, ids]
    rp = pen.repetition
    new = torch.where(old > 0, old / rp, old * rp)
    # Output token counts: scattered into the tally (column V absorbs PAD), read at the ids,
    # then cleared at the same places.
    vocab = x.shape[1]
    if tally is None:
        tally = torch.zeros(ids.shape[0], vocab + 1, dtype=x.dtype, device=x.device)
    else:
        assert tally.shape[0] >= ids.shape[0] and tally.shape[1] == vocab + 1, tally.shape
        tally = tally[: ids.shape[0]]
    out_ids = output.masked_fill(output < 0, vocab)
    tally.scatter_add_(1, out_ids, torch.ones(out_ids.shape, dtype=x.dtype, device=x.device))
    counts = tally.gather(1, ids)
    tally.scatter_(1, out_ids, 0.0)
    new = new - pen.frequency * counts - pen.presence * (counts > 0).to(x.dtype)
    new = torch.where(real.any(dim=1, keepdim=True), new, old)
    x.index_put_((rows, ids), new)


def apply_top_k_top_p(x: Tensor, md: SamplingMetadata) -> None:
    """Mask (to -inf) the filtered rows of x outside their top-k, then outside their top-p
    nucleus. top_k = vocab means off; ties at the k-th value are all kept. Top-k alone needs only
    a topk of the largest k; with top-p one ascending sort serves both (on a CPU: `_nucleus`)."""
    rows, top_k, top_p = md.top_k_top_p
    vocab = x.shape[1]
    sub = x[rows]
    if md.top_k_only:
        kth = sub.topk(min(md.max_top_k, vocab), dim=-1).values.gather(1, top_k - 1)
        x[rows] = sub.masked_fill(sub < kth, float("-inf"))
        return
    if x.device.type == "cpu":  # (host reads: free on a CPU)
        x[rows] = _nucleus(sub, top_k, top_p, md.max_top_k)
    else:
        x[rows] = _sorted_top_k_top_p(sub, top_k, top_p)


def _sorted_top_k_top_p(sub: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Top-k then top-p over each row sorted whole: no host read (a GPU's path)."""
    vocab = sub.shape[1]
    sorted_x, order = sub.sort(dim=-1)
    sorted_x.masked_fill_(sorted_x < sorted_x.gather(1, vocab - top_k), float("-inf"))
    cum = sorted_x.softmax(dim=-1).cumsum(dim=-1)
    drop = cum <= 1.0 - top_p
    drop[:, -1] = False  # always keep the most likely token
    sorted_x.masked_fill_(drop, float("-inf"))
    return torch.empty_like(sorted_x).scatter_(1, order, sorted_x)


# A CPU row's top-p is decided on its most likely tokens (this many, then more; at least the
# rows' top_k where every row has one) once they hold top_p of the mass: a whole-row sort costs
# ~4 ms a row at a 49,152-token vocabulary on a 2-core CPU, a topk of 128 a tenth of it.
NUCLEUS_CANDIDATES = (128, 1024)


def _nucleus(sub: Tensor, top_k: Tensor, top_p: Tensor, max_top_k: int) -> Tensor:
    """The rows of `sub` [R, V] masked to -inf outside their top-k (ties at the k-th kept), then
    outside their nucleus: by descending probability, token i stays while the mass before it
    is below top_p (the most likely always), and every token as likely as the last one kept
    stays too. Decided on each row's C most likely tokens where their mass reaches top_p, else
    on more, at last on the whole row sorted: all give the same bits, the prefix sums over the
    C first being the same numbers (a CPU cumsum runs in order), so a row's result depends on
    neither the other rows nor C."""
    vocab = sub.shape[1]
    floor = max_top_k if max_top_k < vocab else 0
    sizes = sorted({min(vocab, max(c, floor)) for c in NUCLEUS_CANDIDATES} | {vocab})
    out = torch.empty_like(sub)
    todo = torch.arange(sub.shape[0], device=sub.device)
    reach = None  # [R] the most mass the next size's candidates could hold
    for c, after in zip(sizes, sizes[1:] + [vocab]):
        if reach is not None and c < vocab:
            hopeless = reach < top_p[todo, 0]  # skip to the whole row (the same bits)
            if bool(hopeless.all()):
                continue
        masked, decided, mass, least = _nucleus_of(sub[todo], top_k[todo], top_p[todo], c)
        if c == vocab:
            out[todo] = masked
            break
        out[todo[decided]] = masked[decided]
        todo = todo[~decided]
        # the next c' tokens are each at most as likely as the c-th: mass + (c' - c) * least
        reach = (mass + (after - c) * least)[~decided]
        if not len(todo):
            break
    return out


def _nucleus_of(
    sub: Tensor, top_k: Tensor, top_p: Tensor, c: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`_nucleus` over each row's c most likely tokens: masked rows, and [R] each: whether c
    decided, the c tokens' mass, the c-th token's probability."""
    vocab = sub.shape[1]
    values, order = sub.topk(c, dim=-1)  # descending
    has_k = top_k < vocab
    masked = sub
    if bool(has_k.any()):
        kth = values.gather(1, top_k.clamp(max=c) - 1)
        masked = sub.masked_fill(has_k & (sub < kth), float("-inf"))
    probs = masked.softmax(dim=-1)
    cum = probs.gather(1, order).cumsum(dim=-1)
    kept = 1 + (cum[:, :-1] < top_p).sum(dim=-1, keepdim=True)  # a prefix: cum never falls
    last = probs.gather(1, order.gather(1, kept - 1))
    decided = (cum[:, -1:] >= top_p) & ~(has_k & (top_k > c))
    least = probs.gather(1, order[:, -1:])
    out = masked.masked_fill(probs < last, float("-inf"))
    return out, decided[:, 0], cum[:, -1], least[:, 0]


def apply_min_p(x: Tensor, rows: Tensor, min_p: Tensor) -> None:
    """Mask tokens whose probability is below min_p times the row's top probability."""
    sub = x[rows]
    probs = sub.softmax(dim=-1)
    keep_min = probs.amax(dim=-1, keepdim=True) * min_p
    x[rows] = sub.masked_fill(probs < keep_min, float("-inf"))


logger = logging.getLogger(__name__)

# (logits [N, V], seeds [N] int64, temperature [N, 1] float32 or None) -> tokens [N] int64: one
# pass of the Gumbel-max race (paged_kernels.gumbel_race); x / T when a temperature is passed.
Race = Callable[[Tensor, Tensor, Tensor | None], Tensor]

# The penalties' scratch stays under [256, V + 1] (155 MB of float32 at a 151,936 vocabulary);
# more penalty rows in one step (speculative rows at large batches) allocate per step.
_MAX_TALLY_ROWS = 256


def argmax(x: Tensor) -> Tensor:
    """[N, V] -> [N] int64, the first maximal index per row (as torch.argmax): `max` is twice as
    fast as `argmax` on CPUs."""
    return x.max(dim=-1).indices


def argmin(x: Tensor) -> Tensor:
    """[N, V] -> [N] int64, the first minimal index per row (argmax of -x, ties alike)."""
    return x.min(dim=-1).indices


def sampling_race(backend_name: str, device: torch.device) -> Race | None:
    """The one-pass race for an engine: paged_kernels.gumbel_race where Triton runs natively
    (the triton attention backend on CUDA), else None (torch's race)."""
    if backend_name != "triton" or device.type != "cuda":
        return None
    from paged_kernels import gumbel_race

    return gumbel_race


def _temperature_only(md: SamplingMetadata) -> bool:
    """No processing of the logits but (maybe) the temperature's division."""
    return (
        md.banned is None
        and md.token_bitmask is None
        and md.allowed is None
        and md.logit_bias is None
        and md.penalties is None
        and md.top_k_top_p is None
        and md.min_p is None
        and md.custom is None
    )


class Sampler:
    """`Sampler(seed)(logits, metadata)` samples one token per row. Holds one generator per
    device for seeded rows, reseeded per draw (`metadata.seeds` carries each draw's seed), and
    one per device for unseeded rows, seeded once with the engine's `seed`: never torch's
    global RNG, so tensor-parallel ranks draw the same noise whatever else their process
    draws, and sample the same tokens from the same logits."""

    def __init__(
        self, seed: int = 0, logsumexp: LogSumExp = torch_logsumexp, race: Race | None = None
    ) -> None:
        self._seed = seed
        self.logsumexp = logsumexp  # of the logprobs (sample/logprobs.py)
        self.race = race
        # the race's seeds for unseeded rows: a host generator, so no step reads the device
        # and tensor-parallel ranks (same engine seed, same steps) draw the same ones
        self._race_seeds = np.random.Generator(np.random.PCG64(seed))
        self._generators: dict[torch.device, torch.Generator] = {}
        self._unseeded: dict[torch.device, torch.Generator] = {}
        # Per device: the penalties' zero scratch [rows, V + 1] (apply_penalties), made on the
        # first penalty row and grown to the most penalty rows seen, up to _MAX_TALLY_ROWS.
        self._tallies: dict[torch.device, Tensor] = {}

    def __call__(self, logits: Tensor, md: SamplingMetadata) -> SamplerOutput:
        # logits: [N, V], any float dtype; md describes its rows.
        assert logits.dim() == 2 and logits.shape[0] == md.num_rows, (logits.shape, md.num_rows)
        if not md.need_logprobs and _temperature_only(md):
            # Nobody reads the raw float32 logits: the race divides the model's logits by the
            # float32 temperature in its pass, torch's race into the processed rows directly
            # (the same bits as a float32 copy divided: [N, V] written once, not three times)
            return SamplerOutput(self.sample(logits, md, md.temperature), None)
        raw = logits.float()
        tokens = self.sample(self.process_logits(raw, md), md)
        packed = None
        if md.need_logprobs:
            packed = gather_logprobs(
                raw, tokens, md.max_num_logprobs, self.logsumexp, md.logprob_ids
            )
        return SamplerOutput(tokens, packed)

    def process_logits(self, raw: Tensor, md: SamplingMetadata) -> Tensor:
        """The processed logits [N, V]: a new tensor when any processing applies (`raw` is left
        untouched), `raw` itself when none does."""
        if _temperature_only(md):
            return raw if md.temperature is None else raw.div(md.temperature)
        x = raw.clone()
        if md.token_bitmask is not None:
            apply_token_bitmask(x, *md.token_bitmask)
        if md.allowed is not None:
            apply_token_bitmask(x, *md.allowed)
        if md.logit_bias is not None:
            rows, ids, bias = md.logit_bias
            x.index_put_((rows, ids), bias, accumulate=True)
        if md.banned is not None:
            x[md.banned] = float("-inf")
        if md.custom is not None:
            md.custom.run(x, argmax_invariant=False)
        if md.penalties is not None:
            apply_penalties(x, md.penalties, self._tally(md.penalties.rows.shape[0], x))
        if md.temperature is not None:
            x.div_(md.temperature)
        if md.custom is not None and not md.all_greedy:  # they cannot change a greedy token
            md.custom.run(x, argmax_invariant=True)
        if md.top_k_top_p is not None:  # greedy rows never land here: their filters are off
            apply_top_k_top_p(x, md)
        if md.min_p is not None:
            apply_min_p(x, *md.min_p)
        return x

    def _tally(self, rows: int, x: Tensor) -> Tensor | None:
        """The zero scratch for `rows` penalty rows of logits like `x`; None (apply_penalties
        then allocates its own) past _MAX_TALLY_ROWS rows."""
        if rows > _MAX_TALLY_ROWS:
            return None
        tally = self._tallies.get(x.device)
        width = x.shape[1] + 1
        if (
            tally is None
            or tally.shape[0] < rows
            or tally.shape[1] != width
            or tally.dtype != x.dtype
        ):
            size = min(_MAX_TALLY_ROWS, 1 << (rows - 1).bit_length())
            tally = torch.zeros(size, width, dtype=x.dtype, device=x.device)
            self._tallies[x.device] = tally
        return tally

    def sample(self, x: Tensor, md: SamplingMetadata, temperature: Tensor | None = None) -> Tensor:
        """[N] int64 token ids: argmax for greedy rows, the exponential race for the others:
        argmax(probs / E) with E = -log(U) ~ Exp(1), taken as argmin(probs / log(U)), the
        same quotients negated exactly (one pass over [N, V] fewer); with a `race`, its
        Gumbel-max pass over x instead. x: the processed logits, or with `temperature` [N, 1]
        the model's, still to be divided (greedy rows' temperature is 1: x / 1 is x)."""
        if md.all_greedy:
            return argmax(x)
        if self.race is not None:
            sampled = self.race(x.contiguous(), self._seeds(md, x.device), temperature)
        else:
            x = x.div(temperature) if temperature is not None else x.float()
            probs = x.softmax(dim=-1)
            sampled = argmin(probs.div_(self._log_uniform(x.shape, md, x.device)))
        if md.greedy is not None:
            sampled = torch.where(md.greedy, argmax(x), sampled)
        return sampled

    def warm_up(self, vocab_size: int, device: torch.device) -> None:
        """Run the race kernel once in each form the sampler calls it (the temperature divided
        in it, and not) on float32 logits like the model's, so a GPU builds it at the engine's
        start, not on the first step that samples. Draws nothing from the seed generator. A
        race that fails here (a GPU or Triton it does not build for) is dropped with a warning:
        the engine samples with torch's race instead."""
        if self.race is None:
            return
        logits = torch.zeros(2, vocab_size, device=device)
        seeds = torch.zeros(2, dtype=torch.int64, device=device)
        try:
            self.race(logits, seeds, torch.ones(2, 1, device=device))
            self.race(logits, seeds, None)
        except Exception as e:
            logger.warning("the sampler's race kernel failed; sampling with torch's: %r", e)
            self.race = None

    def _seeds(self, md: SamplingMetadata, device: torch.device) -> Tensor:
        """[N] int64, the race's seed per row: the draw's own for a seeded row, a fresh one from
        the engine-seeded host generator for the others (drawn for every row each call)."""
        seeds = self._race_seeds.integers(-(2**63), 2**63, size=md.num_rows, dtype=np.int64)
        for row, seed in md.seeds:
            seeds[row] = seed  # draw_seed: below 2**63
        t = torch.from_numpy(seeds)
        if device.type == "cuda":
            return t.pin_memory().to(device, non_blocking=True)
        return t.to(device)

    def noise(self, shape: torch.Size, md: SamplingMetadata, device) -> Tensor:
        """The Exp(1) noise rows `sample` races with (speculative verification reuses it)."""
        return self._exponential_noise(shape, md, device)

    def _exponential_noise(self, shape: torch.Size, md: SamplingMetadata, device) -> Tensor:
        """Exp(1) noise [N, V] as -log(U). U = 0 gives +inf noise (that token loses), never 0
        noise, so probs / noise is never NaN."""
        return self._log_uniform(shape, md, device).neg_()

    def _log_uniform(self, shape: torch.Size, md: SamplingMetadata, device) -> Tensor:
        """log(U) [N, V], U ~ Uniform[0, 1): the engine-seeded generator for unseeded rows (one
        op), a reseeded generator for each seeded row."""
        q = torch.empty(shape, device=device)
        if len(md.seeds) < md.num_rows:
            gen = self._unseeded.get(device)
            if gen is None:
                gen = self._unseeded[device] = torch.Generator(device=device)
                gen.manual_seed(self._seed)
            q.uniform_(generator=gen)
        if md.seeds:
            gen = self._generators.get(device)
            if gen is None:
                gen = self._generators[device] = torch.Generator(device=device)
            for row, seed in md.seeds:
                gen.manual_seed(seed)
                q[row].uniform_(generator=gen)
        return q.log_()
