"""`ThinkingBudget`: vLLM's `thinking_token_budget`, at most N tokens inside a reasoning block.

    ... <think> t1 t2 ... tN  -> the next tokens are forced to the closing marker's ids: </think>
                                  (then the sequence goes on freely, as the answer)

The markers come from the engine's `reasoning_config` ({"think_start_str": "<think>",
"think_end_str": "</think>"}, tokenized once). A sequence's state starts from its prompt (a
template that opens the block counts the tokens after the opener) and follows each output token:
the opener's ids (re)open the block and reset the count, the closer's ids close it, any other
token inside counts. Once the count reaches the budget, the closer is forced one id a step
(`forced`), as a one-token mask row (structured_output/manager.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class _State:
    tail: list[int]  # the last ids, enough to see either marker end
    inside: bool  # in the block
    count: int  # ids in the block so far
    forcing: int = -1  # index of the closer's next forced id; -1: not forcing


def _ends_with(ids: list[int], marker: tuple[int, ...]) -> bool:
    return len(ids) >= len(marker) and tuple(ids[len(ids) - len(marker) :]) == marker


def _last(ids: list[int], marker: tuple[int, ...]) -> int:
    """Index just past the last occurrence of `marker` in `ids`, -1 when absent."""
    n = len(marker)
    for end in range(len(ids), n - 1, -1):
        if tuple(ids[end - n : end]) == marker:
            return end
    return -1


class ThinkingBudget:
    __slots__ = ("budget", "close", "open", "states", "template")

    def __init__(
        self, open_ids: list[int], close_ids: list[int], budget: int, prompt_ids: list[int]
    ) -> None:
        self.open, self.close, self.budget = tuple(open_ids), tuple(close_ids), budget
        opened, closed = _last(prompt_ids, self.open), _last(prompt_ids, self.close)
        inside = opened > closed
        keep = max(len(self.open), len(self.close))
        self.template = _State(
            list(prompt_ids[-keep:]), inside, len(prompt_ids) - opened if inside else 0
        )
        self._check_budget(self.template)
        self.states: dict[int, _State] = {}  # seq_id -> its state (the first: the template's)

    def _state(self, seq_id: int) -> _State:
        s = self.states.get(seq_id)
        if s is None:
            t = self.template
            s = self.states[seq_id] = _State(list(t.tail), t.inside, t.count, t.forcing)
        return s

    def _check_budget(self, s: _State) -> None:
        """Spent: force the closer, from where the tail already holds its beginning (a model
        that started to close the block itself is not made to start over)."""
        if s.inside and s.forcing < 0 and s.count >= self.budget:
            close = self.close
            s.forcing = next(
                (k for k in range(len(close) - 1, 0, -1) if _ends_with(s.tail, close[:k])), 0
            )

    def forced(self, seq_id: int) -> int | None:
        """The id the sequence's next token must be, None when it is free."""
        s = self._state(seq_id)
        return self.close[s.forcing] if s.forcing >= 0 else None

    def accept(self, seq_id: int, token: int) -> None:
        s = self._state(seq_id)
        s.tail.append(token)
        del s.tail[: -max(len(self.open), len(self.close))]
        if s.forcing >= 0:
            s.forcing += 1
            if s.forcing < len(self.close):
                return
            s.forcing = -1
        if _ends_with(s.tail, self.open):
            s.inside, s.count = True, 0
        elif _ends_with(s.tail, self.close):
            s.inside, s.count = False, 0
        elif s.inside:
            s.count += 1
        self._check_budget(s)

    def fork(self, parent_id: int, child_ids: list[int]) -> None:
        p = self._state(parent_id)
        for child in child_ids:
            self.states[child] = _State(list(p.tail), p.inside, p.count, p.forcing)

    def drop(self, seq_id: int) -> None:
        self.states.pop(seq_id, None)
