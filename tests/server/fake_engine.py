"""A deterministic stand-in for `paged_engine.LLMEngine` with the same methods (no torch).

Tokens are bytes (+ BOS 1, EOS 2); each step appends one token to every running sequence after a
fixed `step_time`, so tests can reason about timing. It takes the engine's own `SamplingParams`
and returns its `RequestOutput`s, shaped by `output_kind` as the engine shapes them: CUMULATIVE
every step; DELTA only what is new (beams and best_of > n: once, whole, at the end); FINAL_ONLY
once, at the end. Its step is the engine's three: `step_core` (token ids, as
`EngineCoreOutput`s), `process_outputs` (text, stop strings, outputs: a `ProcessedOutputs`),
`finish_seqs` (free what stop strings ended). It records which thread called each method. Used
for fast in-process tests of the engine loop and the routes.

LoRA (`enable_lora=True`): `add_lora` / `remove_lora` / `list_loras` as the engine has them, and
`add_request(lora_request=...)`. An adapter is valid when its directory holds an
`adapter_config.json`; a request with one writes the adapter's name over and over ("sqlsql...")
instead of the base model's letters, so a test sees which adapter ran.

A lost rank: from `die_at` (a time.monotonic() value) on, `check_health` and `step_core` raise
the EngineDeadError a multi-process engine raises when a worker rank exits.
"""

from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from paged_engine.core.core_output import EngineCoreOutput, SeqUpdate
from paged_engine.engine.detokenizer import find_stop, stop_holdback
from paged_engine.engine.output_processor import ProcessedOutputs
from paged_engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from paged_engine.sampling_params import RequestOutputKind, SamplingParams


class FakeTokenizer:
    """Records which threads used it, how often it encoded and the last chat template
    variables: one owner per tokenizer."""

    bos_token_id, eos_token_id = 1, 2
    chat_template = "fake"

    def __init__(self) -> None:
        self.threads: set[str] = set()
        self.num_encodes = 0
        self.template_vars: dict[str, Any] = {}  # the last render's extra template variables
        self.messages: list[dict[str, Any]] = []  # the last render's messages

    def __len__(self) -> int:
        return 259

    def _used(self) -> None:
        self.threads.add(threading.current_thread().name)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self._used()
        self.num_encodes += 1
        ids = [b + 3 for b in text.encode()]
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        self._used()
        return bytes(i - 3 for i in ids if i >= 3).decode("utf-8", "replace")

    def apply_chat_template(
        self,
        messages,
        *,
        chat_template=None,
        tokenize=True,
        add_generation_prompt=True,
        **template_vars,
    ):
        self._used()
        self.template_vars, self.messages = template_vars, messages
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        text += "<assistant>" if add_generation_prompt else ""
        return text if not tokenize else self.encode(text, add_special_tokens=False)


@dataclass
class _CoreSeq:
    """Token-level: what the engine core knows of a sequence."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False


@dataclass
class _Req:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[_CoreSeq]
    arrival: float
    first_scheduled: float | None = None
    lora: Any = None  # its LoRARequest


@dataclass
class _Seq:
    """Text-level: what the output stage knows of a sequence."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_sent_tokens: int = 0  # DELTA: what earlier outputs carried
    num_sent_chars: int = 0


@dataclass
class _State:
    rid: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[_Seq]
    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None


class ById(dict):
    """Records by the engine's request id, which the server makes unique by a suffix
    ("cmpl-x-0-1a2b3c4d", engine_client.internal_request_id): a lookup by the client's id
    ("cmpl-x-0") finds the newest record of it."""

    def __missing__(self, key: str) -> Any:
        for k in reversed(self):
            if k.rsplit("-", 1)[0] == key:
                return self[k]
        raise KeyError(key)

    def __contains__(self, key: object) -> bool:
        return super().__contains__(key) or any(k.rsplit("-", 1)[0] == key for k in self)


class FakeEngine:
    """The engine core (`waiting`, `running`) and the output stage (`states`) are apart, as in
    the engine: `step_core` returns token ids, `process_outputs` turns them into text and
    `RequestOutput`s and reports stop strings, `finish_seqs` frees what they ended."""

    def __init__(
        self,
        max_model_len: int = 256,
        step_time: float = 0.002,
        max_num_seqs: int = 256,
        num_blocks: int = 4096,
        enable_lora: bool = False,
    ) -> None:
        self.tokenizer = FakeTokenizer()
        self.config = SimpleNamespace(
            model="fake",
            max_model_len=max_model_len,
            block_size=16,
            scheduling_policy="fcfs",
        )
        self.step_time = step_time
        self.max_num_seqs = max_num_seqs
        self.num_blocks = num_blocks
        self.running: dict[str, _Req] = {}
        self.waiting: list[_Req] = []
        self.states: dict[str, _State] = {}  # the output stage's, like OutputProcessor.states
        self.prompt_tokens = self.gen_tokens = 0
        self.params: dict[str, SamplingParams] = ById()  # every request ever added, by id
        self.priorities: dict[str, int] = ById()  # the priority each request was added with
        self.prompts: dict[str, Any] = ById()  # the prompt each request was added with
        self.threads: dict[str, set[str]] = {}  # method -> names of the threads that called it
        self.stopped: list[tuple[str, int, str]] = []  # every finish_seqs entry
        self.enable_lora = enable_lora
        self.lora_requests: dict[str, Any] = ById()  # every request's LoRARequest (or None)
        self.loras: dict[int, Any] = {}  # loaded adapters by lora_int_id
        self.die_at: float | None = None  # see the module docstring: a rank lost then

    def check_health(self) -> None:
        self._called("check_health")
        if self.die_at is not None and time.monotonic() >= self.die_at:
            from paged_engine.executor.base import EngineDeadError

            raise EngineDeadError(
                "a worker rank failed, the engine cannot continue: "
                "paged-worker-1 (pid 4242) exited with -9"
            )

    def _called(self, method: str) -> None:
        self.threads.setdefault(method, set()).add(threading.current_thread().name)

    # ---- LoRA -----------------------------------------------------------------------------
    def _load(self, lora_request) -> None:
        if not self.enable_lora:
            raise ValueError("lora_request given, but LoRA is not enabled (enable_lora=True)")
        path = lora_request.lora_path
        if not os.path.isfile(os.path.join(path, "adapter_config.json")):
            raise ValueError(f"lora_request: {path!r} is not a PEFT adapter directory")
        self.loras.setdefault(lora_request.lora_int_id, lora_request)

    def add_lora(self, lora_request) -> bool:
        self._called("add_lora")
        self._load(lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """False when unknown or used by a request (as the engine: it keeps it until then)."""
        self._called("remove_lora")
        used = any(r.lora and r.lora.lora_int_id == lora_int_id for r in self._requests())
        return not used and self.loras.pop(lora_int_id, None) is not None

    def list_loras(self) -> set[int]:
        self._called("list_loras")
        return set(self.loras)

    # start_profile / stop_profile: the engine's contract (worker/profiler.py), no recording.
    profiling = False
    traces_written = 0

    def start_profile(self) -> None:
        self._called("start_profile")
        if self.profiling:
            raise RuntimeError("the profiler is already running: stop_profile() first")
        self.profiling = True

    def stop_profile(self) -> list[str]:
        self._called("stop_profile")
        if not self.profiling:
            raise RuntimeError("the profiler is not running: start_profile() first")
        self.profiling = False
        self.traces_written += 1
        return [f"rank0.{id(self):x}.{self.traces_written}.pt.trace.json.gz"]

    def _requests(self) -> list[_Req]:
        return [*self.waiting, *self.running.values()]

    def add_request(
        self, request_id, prompt, params, arrival_time=None, *, lora_request=None, priority=0
    ) -> None:
        self._called("add_request")
        if priority and self.config.scheduling_policy != "priority":
            raise ValueError(f"priority={priority} needs priority scheduling")
        self.priorities[request_id] = priority
        self.prompts[request_id] = prompt
        if lora_request is not None:
            self._load(lora_request)
        text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = list(prompt["prompt_token_ids"])
        else:
            ids = self.tokenizer.encode(text) if isinstance(text, str) else list(text)
        if len(ids) >= self.config.max_model_len:
            raise ValueError(f"prompt length {len(ids)} exceeds max_model_len")
        if params.num_sequences > self.max_num_seqs:
            raise ValueError(f"n/best_of={params.num_sequences} exceeds max_num_seqs")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        text = text if isinstance(text, str) else None
        n = params.num_sequences
        core_seqs = [_CoreSeq(i) for i in range(n)]
        self.waiting.append(_Req(request_id, ids, params, core_seqs, arrival, lora=lora_request))
        self.lora_requests[request_id] = lora_request
        seqs = [_Seq(i) for i in range(n)]
        self.states[request_id] = _State(request_id, text, ids, params, seqs, arrival)
        self.params[request_id] = params

    def abort_request(self, request_id) -> None:
        self._called("abort_request")
        rids = {request_id} if isinstance(request_id, str) else set(request_id)
        self.waiting = [r for r in self.waiting if r.rid not in rids]
        for rid in rids:
            self.running.pop(rid, None)
            self.states.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting)

    def can_step(self) -> bool:  # no sleep mode here: the real engine's when never paused
        return self.has_unfinished_requests()

    # ---- the step: step() = step_core -> process_outputs -> finish_seqs, as in the engine ----
    def step(self) -> list[RequestOutput]:
        processed = self.process_outputs(self.step_core())
        if processed.stopped:
            self.finish_seqs(processed.stopped)
        return processed.request_outputs

    def step_core(self) -> list[EngineCoreOutput]:
        """One token for every running sequence: token ids and length limits only."""
        self._called("step_core")
        self.check_health()
        time.sleep(self.step_time)
        now = time.monotonic()
        while self.waiting and len(self.running) < self.max_num_seqs:
            r = self.waiting.pop(0)
            r.first_scheduled = now
            self.running[r.rid] = r
            self.prompt_tokens += len(r.prompt_ids)
        outs = []
        for rid, r in list(self.running.items()):
            updates = []
            max_tokens = r.params.max_tokens or self.config.max_model_len - len(r.prompt_ids)
            for s in r.seqs:
                if s.finished:
                    continue
                s.token_ids.append(self._next_token(r, s))
                self.gen_tokens += 1
                eos = s.token_ids[-1] == self.tokenizer.eos_token_id  # only ScriptedEngine's
                s.finished = eos or len(s.token_ids) >= max_tokens
                finish = "stop" if eos else "length" if s.finished else None
                updates.append(SeqUpdate(s.index, s.token_ids[-1:], finish_reason=finish))
            finished = all(s.finished for s in r.seqs)
            if finished:
                del self.running[rid]
            outs.append(EngineCoreOutput(rid, updates, finished, first_scheduled_time=now))
        return outs

    def _next_token(self, req: _Req, seq: _CoreSeq) -> int:
        if req.lora is not None:  # the adapter's name, over and over
            name = req.lora.lora_name.encode()
            return 3 + name[len(seq.token_ids) % len(name)]
        last = (seq.token_ids or req.prompt_ids)[-1]
        return 3 + 97 + (last * 7 + 3 + seq.index) % 26  # 'a'..'z'

    def process_outputs(self, core_outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        """Text, stop strings and outputs: touches `states` and the tokenizer, never the core."""
        self._called("process_outputs")
        now = time.monotonic()
        result = ProcessedOutputs([], [])
        for co in core_outputs:
            st = self.states.get(co.request_id)
            if st is None:  # aborted, or ended by stop strings already
                continue
            st.first_scheduled = st.first_scheduled or co.first_scheduled_time
            st.first_token = st.first_token or now
            for upd in co.seqs:
                s = st.seqs[upd.index]
                if s.finish_reason is None and self._apply(st.params, s, upd):
                    result.stopped.append((st.rid, s.index, s.stop_reason))
            finished = co.finished or all(s.finish_reason for s in st.seqs)
            if finished:
                self.states.pop(st.rid, None)
            out = self._output(st, finished, now)
            if out is not None:
                result.request_outputs.append(out)
        return result

    def _apply(self, p: SamplingParams, s: _Seq, upd: SeqUpdate) -> bool:
        """Append the update's token to `s`; True when a stop string ended it here."""
        (tid,) = upd.new_token_ids
        s.token_ids.append(tid)
        piece = self.tokenizer.decode([tid])
        s.text += piece
        if p.logprobs is not None:
            alt = 3 + 97 + (tid - 3 - 97 + 1) % 26
            s.logprobs.append({tid: Logprob(-0.5, 1), alt: Logprob(-1.5, 2)})
        hit = find_stop(s.text, len(piece), p.stop, p.include_stop_str_in_output)
        if hit is not None:
            s.text = s.text[: hit[0]]
            s.finish_reason, s.stop_reason = "stop", hit[1]
            return upd.finish_reason is None  # the core still runs it: free it
        s.finish_reason = upd.finish_reason
        return False

    def finish_seqs(self, stopped: list[tuple[str, int, str]]) -> None:
        """Free the sequences stop strings ended (the request may be gone already)."""
        self._called("finish_seqs")
        self.stopped += stopped
        for rid, index, _ in stopped:
            r = self.running.get(rid)
            if r is None:
                continue
            r.seqs[index].finished = True
            if all(s.finished for s in r.seqs):
                del self.running[rid]

    def _output(self, r: _State, finished: bool, now: float) -> RequestOutput | None:
        kind, n = r.params.output_kind, r.params.n
        whole_at_end = r.params.use_beam_search or len(r.seqs) > n
        if not finished and (
            kind == RequestOutputKind.FINAL_ONLY
            or (kind == RequestOutputKind.DELTA and whole_at_end)
        ):
            return None
        delta = kind == RequestOutputKind.DELTA and not whole_at_end
        # Every sequence scores alike here: the "best" n of a finished request are the first n.
        seqs = r.seqs[:n] if finished else r.seqs
        return RequestOutput(
            request_id=r.rid,
            prompt=r.prompt,
            prompt_token_ids=r.prompt_ids,
            prompt_logprobs=None,
            outputs=[self._completion(r.params, s, delta) for s in seqs],
            finished=finished,
            metrics=RequestMetrics(
                r.arrival, r.first_scheduled, r.first_token, now, now if finished else None
            ),
        )

    @staticmethod
    def _completion(p: SamplingParams, s: _Seq, delta: bool) -> CompletionOutput:
        text = s.text
        if s.finish_reason is None:  # a tail that may still become a stop string waits
            text = text[: len(text) - stop_holdback(text, p.stop)]
        token_ids, logprobs = s.token_ids, s.logprobs if p.logprobs is not None else None
        t0 = c0 = 0
        if delta:
            t0, c0 = s.num_sent_tokens, s.num_sent_chars
            s.num_sent_tokens, s.num_sent_chars = len(token_ids), len(text)
        return CompletionOutput(
            index=s.index,
            text=text[c0:],
            token_ids=token_ids[t0:],
            cumulative_logprob=-0.5 * len(token_ids) if p.logprobs is not None else None,
            logprobs=None if logprobs is None else logprobs[t0:],
            finish_reason=s.finish_reason,
            stop_reason=s.stop_reason,
        )

    def get_stats(self):
        used = sum(
            math.ceil((len(r.prompt_ids) + len(s.token_ids)) / 16)
            for r in self.running.values()
            for s in r.seqs
        )
        return SimpleNamespace(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_waiting_deferred=0,
            kv_cache_usage=used / self.num_blocks,
            num_total_blocks=self.num_blocks,
            num_used_blocks=used,
            num_free_blocks=self.num_blocks - used,
            num_cached_blocks=0,
            kv_slots_allocated=used * 16,
            kv_tokens_stored=0,
            kv_waste_perc=0.0,
            blocks_saved_by_sharing=0,
            prefix_cache_queries=0,
            prefix_cache_hits=0,
            num_preemptions=0,
            prompt_tokens_total=self.prompt_tokens,
            generation_tokens_total=self.gen_tokens,
        )


class ScriptedEngine(FakeEngine):
    """A FakeEngine whose every sequence writes `script` (ASCII: one token per character),
    then EOS (finish_reason "stop"): tests set the model's text before a request."""

    script = ""

    def _next_token(self, req: _Req, seq: _CoreSeq) -> int:
        data = self.script.encode("ascii")
        k = len(seq.token_ids)
        return data[k] + 3 if k < len(data) else self.tokenizer.eos_token_id
