"""The output stage: token-level `EngineCoreOutput`s -> text -> `RequestOutput`s.

Per new token of a sequence: logprob dicts (when asked), incremental detokenization, stop
strings. A stop string ends the sequence here; `process` reports it so the caller tells the
engine core to free it (`EngineCore.finish_seqs`). Tokens the core sent for a sequence this
stage already finished (an async step was in flight) are ignored.

It holds no engine object and reads no scheduler state: its input is plain data, so it can run
on another thread than the step. The tokenizer it decodes with is its own to use (the caller
must not share it with a thread that changes its settings).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from paged_engine.core.core_output import EngineCoreOutput, PromptLogprobsChunk, SeqUpdate
from paged_engine.engine.bytelevel_detokenizer import byte_level_vocab, make_detokenizer
from paged_engine.engine.detokenizer import find_stop, stop_holdback
from paged_engine.logprobs import FlatLogprobs, Logprob, PromptLogprobs, SampleLogprobs
from paged_engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from paged_engine.pooling import (
    PooledChunks,
    PoolingOutput,
    PoolingRequestOutput,
    PoolingSamplingParams,
    Projection,
    row_width,
)
from paged_engine.sample.beam_search import trace_steps
from paged_engine.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

_CUMULATIVE = RequestOutputKind.CUMULATIVE
_DELTA = RequestOutputKind.DELTA
_FINAL_ONLY = RequestOutputKind.FINAL_ONLY


@dataclass(slots=True, eq=False)
class SeqText:
    """One sequence's text-level state."""

    index: int
    detokenizer: Any
    token_ids: list[int] = field(default_factory=list)  # outputs
    text: str = ""
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent_tokens: int = 0  # DELTA: what earlier outputs carried
    num_sent_chars: int = 0
    finish_sent: bool = False  # DELTA: an output carried the finish reason

    def fork(self, index: int) -> SeqText:
        detok = self.detokenizer
        return SeqText(
            index=index,
            detokenizer=None if detok is None else detok.fork(),
            token_ids=self.token_ids.copy(),
            text=self.text,
            logprobs=None if self.logprobs is None else self.logprobs.copy(),
            cumulative_logprob=self.cumulative_logprob,
        )


@dataclass(slots=True, eq=False)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None  # None: the prompt came as prompt_embeds
    num_prompt_tokens: int
    params: SamplingParams | BeamSearchParams
    kind: RequestOutputKind
    num_samples: int  # sequences generated (best_of, or the beam width)
    num_returned: int  # outputs returned (n)
    arrival_time: float
    is_beam: bool
    # finished beams' logprobs: None none, -1 every candidate, k the top k and the chosen token
    beam_logprobs: int | None
    # Beams change wholesale and best_of > n ranks at the end: a DELTA request of either kind
    # gets its outputs once, whole, when it finishes.
    whole_at_end: bool
    text_at_end: bool  # FINAL_ONLY without stop strings: detokenize once, at the end
    # Derived once from the fields above (and params), read per step:
    streams: bool  # outputs before the end (not FINAL_ONLY, not whole_at_end DELTA)
    delta: bool  # each output holds only what is new (DELTA and not whole_at_end)
    plain: bool  # sampled without stop strings: a step's tokens end nothing here
    single: bool  # sampled, one sequence (n = best_of = 1)
    seqs: dict[int, SeqText] = field(default_factory=dict)
    prompt_logprobs: PromptLogprobs | None = None
    beams: list | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_cached_tokens: int = 0
    pooled: PooledChunks | None = None  # embedding requests (pooling.py)
    lora_request: Any = None  # echoed on its RequestOutputs
    # a text encoder-decoder's (encoder prompt text, its ids) for its RequestOutputs, else None
    encoder_prompt: tuple[str | None, list[int]] | None = None
    # the caller's id when `request_id` is an internal one (a duplicate's: LLMEngine.add_request);
    # its outputs carry it
    external_req_id: str | None = None
    # A stop string ended one of its sequences here. The core learns of it only when the
    # caller runs `finish_seqs`, which may come after the core ended the last other sequence
    # (a step in flight, or the server's output thread): the core then finishes the request
    # without another output, so this stage must see the end itself.
    text_stopped: bool = False
    # Streaming outputs every `interval` new tokens (stream_interval; 1: every step): tokens
    # generated since the last output sent, and whether one was sent
    interval: int = 1
    held: int = 0
    sent: bool = False


@dataclass(slots=True)
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    # (request id, sequence index, stop string): sequences a stop string ended this step
    stopped: list[tuple[str, int, str]]
    # pooling requests aborted before their prefill ended (a pause): they have no output
    aborted: list[str] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer: Any, stream_interval: int = 1) -> None:
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval  # EngineConfig.stream_interval
        self.states: dict[str, RequestState] = {}  # every request not finished here yet
        # the model's sentence-transformers Dense modules, for embeddings (pooling.py)
        self.project: Projection | None = None
        self._byte_vocab = byte_level_vocab(tokenizer)  # None: not byte-level, general path
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decode = (
            (lambda t: backend.decode([t], skip_special_tokens=False))
            if backend is not None
            else (lambda t: tokenizer.decode([t]))
        )
        # A token's text alone never changes: logprobs name k + 1 tokens a position, mostly
        # the same few thousand, so each is decoded once (at most the vocabulary's strings).
        texts: dict[int, str] = {}

        def decode_one(t: int) -> str:
            text = texts.get(t)
            if text is None:
                text = texts[t] = decode(t)
            return text

        self._decode_one_fn = decode_one

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int] | None,
        params: SamplingParams | BeamSearchParams,
        arrival_time: float,
        *,
        num_prompt_tokens: int | None = None,
        num_returned: int,
        kind: RequestOutputKind,
        lora_request: Any = None,
        beam_logprobs: int | None = None,
        encoder_prompt: tuple[str | None, list[int]] | None = None,
        external_req_id: str | None = None,
    ) -> None:
        beam = isinstance(params, BeamSearchParams)
        num_samples = params.beam_width if beam else params.num_sequences
        whole_at_end = beam or num_samples > num_returned
        text_at_end = kind == _FINAL_ONLY and not beam and not params.stop
        state = RequestState(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            num_prompt_tokens=(
                len(prompt_token_ids) if num_prompt_tokens is None else num_prompt_tokens
            ),
            params=params,
            kind=kind,
            num_samples=num_samples,
            num_returned=num_returned,
            arrival_time=arrival_time,
            is_beam=beam,
            beam_logprobs=beam_logprobs,
            whole_at_end=whole_at_end,
            text_at_end=text_at_end,
            streams=kind == _CUMULATIVE or (kind == _DELTA and not whole_at_end),
            delta=kind == _DELTA and not whole_at_end,
            plain=not beam and not params.stop,
            single=not beam and num_samples == 1 and not isinstance(params, PoolingSamplingParams),
            lora_request=lora_request,
            encoder_prompt=encoder_prompt,
            external_req_id=external_req_id,
            interval=1 if beam else max(self.stream_interval, params.stream_interval or 1),
        )
        detok = None
        if not beam and params.detokenize:
            detok = make_detokenizer(
                self.tokenizer,
                prompt_token_ids or [],
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
                vocab=self._byte_vocab,
            )
        state.seqs[0] = SeqText(0, detok)
        if isinstance(params, PoolingSamplingParams):
            state.pooled = PooledChunks()
        self.states[request_id] = state

    def duplicates_of(self, request_ids: list[str]) -> list[str]:
        """The internal ids of the requests in flight added under one of these ids."""
        wanted = set(request_ids)
        # list(): one copy under the GIL; paged-server's output thread removes finished states
        # while the engine thread aborts ("dictionary changed size during iteration")
        return [s.request_id for s in list(self.states.values()) if s.external_req_id in wanted]

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.states.pop(rid, None)

    # ---- per step -------------------------------------------------------------------------------
    def process(self, core_outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        now = time.monotonic()
        result = ProcessedOutputs([], [])
        states, outputs = self.states, result.request_outputs
        for co in core_outputs:
            state = states.get(co.request_id)
            if state is None:  # aborted, or finished by a stop string earlier
                continue
            if state.first_scheduled_time is None:
                state.first_scheduled_time = co.first_scheduled_time
                state.num_cached_tokens = co.num_cached_tokens
            if co.prompt_logprobs is not None:
                self._add_prompt_logprobs(state, co.prompt_logprobs)
            if co.pooled is not None and state.pooled is not None:
                state.pooled.add(*co.pooled)
            elif state.pooled is not None and co.finished and _aborted(co):  # by a pause
                states.pop(co.request_id, None)
                result.aborted.append(co.request_id)
                continue
            if co.beams is not None:
                state.beams = co.beams
            updates, seqs = co.seqs, state.seqs
            if len(updates) > 1:  # forks copy their parent as it was before this step
                for upd in updates:
                    if upd.fork_of is not None and upd.index not in seqs:
                        seqs[upd.index] = seqs[upd.fork_of].fork(upd.index)
            for upd in updates:
                seq = seqs[upd.index]
                if seq.finish_reason is not None:
                    continue
                if state.plain and upd.finish_reason is None and upd.logprobs is None:
                    # The common step: tokens, and their text unless that comes at the end.
                    seq.token_ids += upd.new_token_ids
                    detok = seq.detokenizer
                    if detok is not None and not state.text_at_end:
                        seq.text = ""  # the detokenizer appends in place only to an unshared text
                        detok.add_tokens(upd.new_token_ids)
                        seq.text = detok.output_text
                elif self._apply(state, seq, upd):
                    result.stopped.append((state.request_id, seq.index, seq.stop_reason))
                    state.text_stopped = True
            if not updates and co.beams is None and not co.finished:
                continue  # a prompt-logprobs chunk alone: nothing to report yet
            if state.first_token_time is None:
                state.first_token_time = now
            state.last_token_time = now
            finished = co.finished or (
                state.text_stopped
                and len(seqs) == state.num_samples
                and all(s.finish_reason is not None for s in seqs.values())
            )
            if finished:  # pop: an abort from another thread may have dropped it already
                states.pop(state.request_id, None)
            elif not state.streams:
                continue  # nothing to report before the end
            elif state.interval > 1:  # stream_interval: hold outputs until enough tokens came
                state.held += sum(len(u.new_token_ids) for u in updates)
                if state.sent and state.held < state.interval:
                    continue
                state.held, state.sent = 0, True
            if state.single:  # _make_output's common case, without its branches
                completion = self._completion(state.params, seqs[0], 0, state.delta)
                outputs.append(self._request_output(state, [completion], finished, now))
            elif (out := self._make_output(state, finished, now)) is not None:
                outputs.append(out)
        return result

    def _apply(self, state: RequestState, seq: SeqText, upd: SeqUpdate) -> bool:
        """Append the update's tokens to `seq` (all but `process`'s common step); True when a
        stop string ended it."""
        params: SamplingParams = state.params  # beams send no SeqUpdates
        detok = seq.detokenizer
        if state.text_at_end:
            return self._apply_deferred(params, seq, upd)
        last = len(upd.new_token_ids) - 1
        for k, token in enumerate(upd.new_token_ids):
            seq.token_ids.append(token)
            if upd.logprobs is not None:
                seq.cumulative_logprob += upd.logprobs[k]
                if params.logprobs is not None:
                    self._add_logprobs(seq, params, token, upd, k)
            stop_token = k == last and upd.finish_reason == "stop" and not upd.grammar_end
            if detok is None or (stop_token and not params.include_stop_str_in_output):
                continue
            seq.text = ""
            delta = detok.add_tokens([token])
            seq.text = detok.output_text
            if params.stop and delta and _cut_at_stop(seq, params, len(delta)):
                # The core already freed it when it also ended there (eos, max_tokens).
                return upd.finish_reason is None
        if upd.finish_reason is not None:
            seq.finish_reason, seq.stop_reason = upd.finish_reason, upd.stop_reason
            if seq.detokenizer is not None:
                seq.text = ""
                # flush text held for streaming (an unfinished character, a byte-fallback run)
                delta = seq.detokenizer.finalize()
                seq.text = seq.detokenizer.output_text
                if params.stop and delta:  # it can hold a stop string, as any other delta
                    _cut_at_stop(seq, params, len(delta))
        return False

    def _apply_deferred(self, params: SamplingParams, seq: SeqText, upd: SeqUpdate) -> bool:
        """FINAL_ONLY without stop strings: nobody reads text before the end, so the output is
        detokenized once, when it finishes (the same text as token by token)."""
        seq.token_ids += upd.new_token_ids
        if upd.logprobs is not None:
            for k, token in enumerate(upd.new_token_ids):
                seq.cumulative_logprob += upd.logprobs[k]
                if params.logprobs is not None:
                    self._add_logprobs(seq, params, token, upd, k)
        if upd.finish_reason is not None:
            seq.finish_reason, seq.stop_reason = upd.finish_reason, upd.stop_reason
            detok = seq.detokenizer
            if detok is not None:
                ids = seq.token_ids
                hidden = upd.finish_reason == "stop" and not upd.grammar_end
                if hidden and not params.include_stop_str_in_output:
                    ids = ids[:-1]  # the core stops on tokens: eos or a stop id, not shown
                detok.add_tokens(ids)
                detok.finalize()
                seq.text = detok.output_text
        return False

    def _add_logprobs(
        self, seq: SeqText, params: SamplingParams, token: int, upd: SeqUpdate, i: int
    ) -> None:
        """The sampled token's entry, then the top-k's (or the explicit ids'); a top-k entry of
        the sampled token keeps the top-k's rank (a tie: the top-k's order decides)."""
        top = upd.top[i][: params.num_top_logprobs] if upd.top is not None else []
        ids, lps, ranks = [token], [upd.logprobs[i]], [upd.ranks[i]]
        for tid, lp, rank in top:
            if tid == token:
                ranks[0] = rank
            else:
                ids.append(tid)
                lps.append(lp)
                ranks.append(rank)
        texts = [self._decode_one_fn(t) for t in ids]
        if seq.logprobs is None:
            seq.logprobs = FlatLogprobs() if params.flat_logprobs else []
        if isinstance(seq.logprobs, FlatLogprobs):
            seq.logprobs.append_position(ids, lps, ranks, texts)
        else:
            seq.logprobs.append({t: Logprob(*row) for t, *row in zip(ids, lps, ranks, texts)})

    def _add_prompt_logprobs(self, state: RequestState, chunk: PromptLogprobsChunk) -> None:
        """Row j of the chunk scores prompt token chunk.start + j + 1 (the actual token first,
        with its own rank, then the top-k's others). After a preemption the prompt is
        recomputed: positions already covered are not added twice."""
        if state.prompt_logprobs is None:
            flat = getattr(state.params, "flat_logprobs", False)
            state.prompt_logprobs = FlatLogprobs() if flat else []
            state.prompt_logprobs.append(None)  # position 0 has no predecessor
        out, lists, decode = state.prompt_logprobs, chunk.lists, self._decode_one_fn
        for j in range(len(out) - 1 - chunk.start, len(lists.token_ids)):
            actual = lists.token_ids[j]
            ids, lps, ranks = [actual], [lists.logprobs[j]], [lists.ranks[j]]
            for t, lp, rank in lists.top[j]:
                if t != actual:
                    ids.append(t)
                    lps.append(lp)
                    ranks.append(rank)
            texts = [decode(t) for t in ids]
            if isinstance(out, FlatLogprobs):
                out.append_position(ids, lps, ranks, texts)
            else:
                out.append({t: Logprob(*row) for t, *row in zip(ids, lps, ranks, texts)})

    # ---- outputs --------------------------------------------------------------------------------
    def _make_output(self, state: RequestState, finished: bool, now: float) -> RequestOutput | None:
        if state.pooled is not None:  # an embedding: one output, when its prefill is done
            if not finished:
                return None
            params = state.params
            assert isinstance(params, PoolingSamplingParams)
            ids = state.prompt_token_ids or ()
            vec = state.pooled.finish(params, state.num_prompt_tokens, ids, self.project)
            tensor = torch.tensor(vec, dtype=torch.float32)
            if params.pooling_type == "ALL" and not vec:  # no step tag: [0, width], as vLLM
                tensor = tensor.reshape(0, row_width(state.pooled, params))
            data = PoolingOutput(tensor)
            return PoolingRequestOutput(
                state.external_req_id or state.request_id,
                data,
                state.prompt_token_ids,
                True,
                state.prompt,
                num_cached_tokens=state.num_cached_tokens,
            )
        if not finished and not state.streams:
            return None
        delta = state.delta
        if state.is_beam:
            completions = self._beam_outputs(state, finished)
        elif len(state.seqs) == 1:
            completions = [self._completion(state.params, state.seqs[0], 0, delta)]
        else:
            seqs = sorted(state.seqs.values(), key=lambda s: s.index)
            if delta:  # only sequences with news: new tokens, or a finish not reported yet
                seqs = [
                    s
                    for s in seqs
                    if s.num_sent_tokens < len(s.token_ids)
                    or (s.finish_reason and not s.finish_sent)
                ]
            ranked = finished and state.num_samples > state.num_returned
            if ranked:
                seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)
                seqs = seqs[: state.num_returned]
            completions = [
                self._completion(state.params, s, i if ranked else s.index, delta)
                for i, s in enumerate(seqs)
            ]
        return self._request_output(state, completions, finished, now)

    @staticmethod
    def _request_output(
        state: RequestState, completions: list[CompletionOutput], finished: bool, now: float
    ) -> RequestOutput:
        metrics = RequestMetrics(
            state.arrival_time,
            state.first_scheduled_time,
            state.first_token_time,
            state.last_token_time,
            now if finished else None,
        )
        out = RequestOutput(
            state.external_req_id or state.request_id,
            state.prompt,
            state.prompt_token_ids,
            state.prompt_logprobs,
            completions,
            finished,
            metrics,
            state.lora_request,
            num_cached_tokens=state.num_cached_tokens,
            num_prompt_tokens=state.num_prompt_tokens,
        )
        if state.encoder_prompt is not None:
            out.encoder_prompt, out.encoder_prompt_token_ids = state.encoder_prompt
        return out

    @staticmethod
    def _completion(
        params: SamplingParams, seq: SeqText, index: int, delta: bool
    ) -> CompletionOutput:
        text = seq.text
        if seq.finish_reason is None and params.stop and not params.include_stop_str_in_output:
            # Hold back a tail that may still grow into a stop string: a streaming client must
            # never receive text that is cut later. (A kept stop string ends in new text, and
            # the cut comes after it: nothing sent is cut, so nothing is held, as in vLLM.)
            hold = stop_holdback(text, params.stop)
            text = text[: len(text) - hold] if hold else text
        token_ids, logprobs = seq.token_ids, seq.logprobs
        if delta:
            t0, c0 = seq.num_sent_tokens, seq.num_sent_chars
            seq.num_sent_tokens, seq.num_sent_chars = len(token_ids), len(text)
            seq.finish_sent = seq.finish_reason is not None
            token_ids, text = token_ids[t0:], text[c0:]
            logprobs = None if logprobs is None else logprobs[t0:]
        else:
            # Snapshots: a streamed output must not grow after step() returned it.
            token_ids = list(token_ids)
            logprobs = None if logprobs is None else logprobs.copy()
        cumulative = seq.cumulative_logprob if params.logprobs is not None else None
        return CompletionOutput(
            index,
            text,
            token_ids,
            cumulative,
            logprobs,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )

    def _beam_outputs(self, state: RequestState, finished: bool) -> list[CompletionOutput]:
        """The beams, best first; once finished each with its logprobs as vLLM's beam search
        keeps them: per generated token, the candidates its beam chose from (2 x beam_width
        raw logprobs, ranked), the chosen one among them."""
        beams = state.beams or []
        if finished:
            beams = beams[: state.num_returned]
        return [
            CompletionOutput(
                index=i,
                text=self.tokenizer.decode(b.token_ids, skip_special_tokens=True),
                token_ids=list(b.token_ids),
                cumulative_logprob=b.cumulative_logprob,
                logprobs=self._beam_logprobs(b, state.beam_logprobs) if finished else None,
                finish_reason=b.finish_reason if finished else None,
                stop_reason=None,
            )
            for i, b in enumerate(beams)
        ]

    def _beam_logprobs(self, beam, k: int | None) -> list[dict[int, Logprob]] | None:
        """Per token of `beam`, the candidates it was chosen from (`k`: the top k of them and
        the chosen one; -1 all), ranked."""
        if k is None or beam.trace is None:
            return None
        decode = self._decode_one_fn
        out = []
        for token, (lps, ids) in zip(beam.token_ids, trace_steps(beam.trace)):
            entry = {}
            for rank, (lp, t) in enumerate(zip(lps, ids), 1):
                if k < 0 or rank <= k or t == token:
                    entry[t] = Logprob(lp, rank, decode(t))
            out.append(entry)
        return out


def _aborted(co: EngineCoreOutput) -> bool:
    return any(u.finish_reason == "abort" for u in co.seqs)


def _cut_at_stop(seq: SeqText, params: SamplingParams, num_new_chars: int) -> bool:
    """Does the text's last `num_new_chars` complete a stop string? Then the text is cut there
    and the sequence finishes ("stop"). Stop strings skip the text of the first min_tokens
    tokens (vLLM's detokenizer)."""
    if len(seq.token_ids) <= params.min_tokens:
        return False
    hit = find_stop(seq.text, num_new_chars, params.stop, params.include_stop_str_in_output)
    if hit is None:
        return False
    seq.text = seq.text[: hit[0]]
    seq.finish_reason, seq.stop_reason = "stop", hit[1]
    return True
