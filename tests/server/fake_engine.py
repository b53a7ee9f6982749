"""A deterministic stand-in for `paged_engine.LLMEngine` with the same methods (no torch).

Tokens are bytes (+ BOS 1, EOS 2); each step appends one token to every running sequence after a
fixed `step_time`, so tests can reason about timing. Used for fast in-process tests of the engine
loop and for developing the server while the real engine was being written.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from types import SimpleNamespace


class FakeTokenizer:
    bos_token_id, eos_token_id = 1, 2

    def __len__(self) -> int:
        return 259

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [b + 3 for b in text.encode()]
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return bytes(i - 3 for i in ids if i >= 3).decode("utf-8", "replace")


@dataclass
class SamplingParams:
    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class _Seq:
    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass
class _Req:
    rid: str
    prompt: str | list[int] | None
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[_Seq]


class FakeEngine:
    def __init__(
        self,
        max_model_len: int = 256,
        step_time: float = 0.002,
        max_num_seqs: int = 256,
        num_blocks: int = 4096,
    ) -> None:
        self.tokenizer = FakeTokenizer()
        self.config = SimpleNamespace(model="fake", max_model_len=max_model_len, block_size=16)
        self.step_time = step_time
        self.max_num_seqs = max_num_seqs
        self.num_blocks = num_blocks
        self.running: dict[str, _Req] = {}
        self.waiting: list[_Req] = []
        self.prompt_tokens = self.gen_tokens = 0

    def apply_chat_template(self, messages, *, chat_template=None, add_generation_prompt=True):
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def add_request(self, request_id, prompt, params, arrival_time=None) -> None:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if len(ids) >= self.config.max_model_len:
            raise ValueError(f"prompt length {len(ids)} exceeds max_model_len")
        seqs = [_Seq(i) for i in range(params.n)]
        self.waiting.append(_Req(request_id, prompt, ids, params, seqs))

    def abort_request(self, request_id) -> None:
        rids = {request_id} if isinstance(request_id, str) else set(request_id)
        self.waiting = [r for r in self.waiting if r.rid not in rids]
        for rid in rids:
            self.running.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting)

    def _next_token(self, req: _Req, seq: _Seq) -> int:
        last = (seq.token_ids or req.prompt_ids)[-1]
        return 3 + 97 + (last * 7 + 3 + seq.index) % 26  # 'a'..'z'

    def step(self):
        time.sleep(self.step_time)
        while self.waiting and len(self.running) < self.max_num_seqs:
            r = self.waiting.pop(0)
            self.running[r.rid] = r
            self.prompt_tokens += len(r.prompt_ids)
        outs = []
        for rid, r in list(self.running.items()):
            for s in r.seqs:
                if s.finish_reason:
                    continue
                tid = self._next_token(r, s)
                s.token_ids.append(tid)
                s.text += self.tokenizer.decode([tid])
                if r.params.logprobs is not None:
                    alt = 3 + 97 + (tid - 3 - 97 + 1) % 26
                    s.logprobs.append({tid: Logprob(-0.5, 1), alt: Logprob(-1.5, 2)})
                self.gen_tokens += 1
                for stop in r.params.stop or []:
                    if stop in s.text:
                        s.text = s.text[: s.text.index(stop)]
                        s.finish_reason, s.stop_reason = "stop", stop
                if not s.finish_reason and len(s.token_ids) >= r.params.max_tokens:
                    s.finish_reason = "length"
            finished = all(s.finish_reason for s in r.seqs)
            outs.append(
                SimpleNamespace(
                    request_id=rid,
                    prompt=r.prompt,
                    prompt_token_ids=r.prompt_ids,
                    prompt_logprobs=None,
                    finished=finished,
                    metrics=None,
                    outputs=[
                        SimpleNamespace(
                            index=s.index,
                            text=s.text,
                            token_ids=list(s.token_ids),
                            cumulative_logprob=-0.5 * len(s.token_ids),
                            logprobs=list(s.logprobs) if r.params.logprobs is not None else None,
                            finish_reason=s.finish_reason,
                            stop_reason=s.stop_reason,
                        )
                        for s in r.seqs
                    ],
                )
            )
            if finished:
                del self.running[rid]
        return outs

    def get_stats(self):
        used = sum(
            math.ceil((len(r.prompt_ids) + len(s.token_ids)) / 16)
            for r in self.running.values()
            for s in r.seqs
        )
        return SimpleNamespace(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
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
