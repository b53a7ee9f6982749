"""Sampling parameters with vLLM's names, defaults and meanings.

`SamplingParams` validates itself on construction: every bad value raises a `ValueError` whose
message names the parameter and the value, so the server can return it as a 400 as is.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import logging
import math
import numbers
import operator
from dataclasses import dataclass, field
from typing import Any

from paged_engine.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# Temperatures below this are greedy (argmax); the same threshold the sampler uses.
SAMPLING_EPS = 1e-5
# vLLM's _MAX_TEMP: a temperature in (0, MIN_TEMPERATURE) is raised to it (logits / 1e-4 can
# overflow to inf / nan); 0 stays greedy.
MIN_TEMPERATURE = 1e-2


class RequestOutputKind(enum.IntEnum):
    """What each `RequestOutput` of a request holds (vLLM's names).

    CUMULATIVE: everything so far (text, token_ids, logprobs), after every step.
    DELTA: only what is new since the previous output (streaming consumers).
    FINAL_ONLY: one output, when the request finishes (offline generation).
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2
    BEAM = 3


def _as_float(name: str, value: object) -> float:
    """A finite float: NaN / inf would poison every comparison and score downstream."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):  # (numpy's too)
        raise ValueError(f"{name} must be a number, got {value!r:.200} ({type(value).__name__}).")
    try:
        number = float(value)  # (an int past float's range raises OverflowError)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number, got {value!r:.200}.")
    return number


def _as_output_kind(value: object) -> RequestOutputKind:
    try:
        return RequestOutputKind(value)
    except (ValueError, TypeError):
        raise ValueError(
            f"output_kind must be a RequestOutputKind (0, 1 or 2), got {value!r:.200}."
        ) from None


# Each stop string (and bad word) is searched for after every token of its request, on the one
# thread that steps the engine: a request with a million of them would slow every other request
# by seconds a token. (vLLM sets no bound; OpenAI's API and TGI's default take 4 stop strings.)
MAX_STOP_STRINGS = 1024
# vLLM's MAX_LOGPROB_TOKEN_IDS: the most logprob_token_ids one request may ask for (its own
# bound: max_logprobs bounds the top-k counts, not these ids)
MAX_LOGPROB_TOKEN_IDS = 128


def _check_early_stopping(value: object) -> None:
    # `1 in (True, False)` holds, but the beam search tests `is True`: only real bools pass.
    if not (isinstance(value, bool) or value == "never"):
        raise ValueError(f"early_stopping must be True, False or 'never', got {value!r:.200}.")


# A beam's score divides by generated_len ** length_penalty, a float: within this bound it is
# finite and non-zero for every length up to 2**20 tokens (2**(20 * 50) < 2**1024).
MAX_LENGTH_PENALTY = 50.0


def _check_length_penalty(value: float) -> None:
    if abs(value) > MAX_LENGTH_PENALTY:
        raise ValueError(
            f"length_penalty must be in [-{MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}] (beam "
            f"scores divide by length ** length_penalty), got {value!r}."
        )


def _check_bools(obj: object, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be a bool, got {value!r:.200} ({type(value).__name__}).")


def _as_int(name: str, value: object, *, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, float) and value.is_integer():
        return int(value)  # JSON clients send 16.0; accept integral floats
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)  # int, numpy ints
    except TypeError:
        raise ValueError(
            f"{name} must be an integer, got {value!r:.200} ({type(value).__name__})."
        ) from None


_BOOL_FIELDS = (
    "ignore_eos",
    "detokenize",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "use_beam_search",
    "skip_clone",
    "flat_logprobs",
)


@dataclass(slots=True)
class RepetitionDetectionParams:
    """vLLM's early stop on a loop: a sequence ends (finish_reason "repetition", stop_reason
    "repetition_detected") once its output ends with a pattern of `min_pattern_size` to
    `max_pattern_size` tokens repeated `min_count` times back to back. max_pattern_size 0 is off."""

    max_pattern_size: int = 0
    min_pattern_size: int = 0  # 0: 1
    min_count: int = 0

    def __post_init__(self) -> None:
        for name in ("max_pattern_size", "min_pattern_size", "min_count"):
            setattr(self, name, _as_int(f"repetition_detection.{name}", getattr(self, name)))
        if not 0 <= self.min_pattern_size <= self.max_pattern_size:
            raise ValueError(
                "repetition_detection: max_pattern_size and min_pattern_size must be >= 0 with "
                f"min_pattern_size <= max_pattern_size, got {self.min_pattern_size} and "
                f"{self.max_pattern_size}."
            )
        if self.max_pattern_size > 0 and self.min_count < 2:
            raise ValueError(
                f"repetition_detection.min_count must be >= 2 to detect a repetition, got "
                f"{self.min_count} (max_pattern_size 0 turns detection off)."
            )

    @classmethod
    def of(cls, value: object) -> RepetitionDetectionParams | None:
        """From an instance, a dict of its fields (a JSON request's) or None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - {"max_pattern_size", "min_pattern_size", "min_count"})
            if unknown:
                raise ValueError(f"repetition_detection has unknown fields {unknown}.")
            return cls(**value)
        raise ValueError(
            "repetition_detection must be a RepetitionDetectionParams or a dict, got "
            f"{value!r:.200}."
        )

    def found(self, tokens: list[int], num_out: int) -> bool:
        """Whether the last `num_out` of `tokens` (the output) end with a pattern repeated
        min_count times. O(max_pattern_size * min_count) a token: the tail is all it reads."""
        if self.max_pattern_size <= 0:
            return False
        count, end = self.min_count, len(tokens)
        for size in range(max(self.min_pattern_size, 1), self.max_pattern_size + 1):
            if size * count > num_out:
                return False
            if tokens[end - 1] != tokens[end - 1 - size]:  # the cheap test first
                continue
            tail = tokens[end - size :]
            if all(tokens[end - size * (k + 1) : end - size * k] == tail for k in range(1, count)):
                return True
        return False


@dataclass(slots=True)
class SamplingParams:
    """How to sample one request (vLLM semantics).

    `temperature` 0 is greedy: top_p, top_k and min_p are then normalized to "off"; one in
    (0, 0.01) is raised to 0.01 with a warning (vLLM's clamp), so it samples.
    `top_k` 0 or -1 means off (stored as 0). `max_tokens=None` means up to max_model_len.
    `logprobs=k` returns the top-k raw logprobs per output token plus the sampled one (0: only
    the sampled token). `use_beam_search=True` makes the engine run beam search with
    `beam_width = max(n, best_of)` (see `to_beam_search_params`).
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Token rules (vLLM's names): the output follows a grammar; token id -> bias added to its
    # logit (clamped to [-100, 100]); only these ids may be sampled; these words never appear.
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None  # vLLM's older name of the above
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # vLLM's: arguments for custom sampling code and plugins (custom logits processors read
    # them: sample/logits_processor.py)
    extra_args: dict[str, Any] | None = None
    # vLLM v0's per-request callables: refused with where they go instead (as vLLM v1 does)
    logits_processors: list[Any] | None = None
    skip_clone: bool = False  # clone() copies shallowly
    # streaming outputs carry at least this many new tokens each (the first and the last
    # come at once); the engine's stream_interval is the floor
    stream_interval: int | None = None
    # True: the request takes nothing from the prefix cache (None: only with prompt_logprobs)
    skip_reading_prefix_cache: bool | None = None
    repetition_detection: RepetitionDetectionParams | None = None
    # at most this many tokens inside the reasoning block, then its closer is forced (the
    # engine's reasoning_config names the markers); None (or -1): no limit
    thinking_token_budget: int | None = None
    # vLLM's: keep the prompt's last k tokens (-1: as many as a prompt may hold)
    truncate_prompt_tokens: int | None = None
    # vLLM's: the logprobs of these token ids (at most MAX_LOGPROB_TOKEN_IDS) at each generated
    # position, in place of a top-k (the sampled token's too); turns logprobs on, and logprobs
    # must then be None or their count. None or []: top-k as usual.
    logprob_token_ids: list[int] | None = None
    # vLLM's: logprobs and prompt_logprobs come as `FlatLogprobs` (paged_engine.logprobs): the
    # same positions as the lists of dicts, in flat columns (a few objects, whatever the length)
    flat_logprobs: bool = False
    # vLLM's fields paged does not run: accepted at their defaults, any other value refused by
    # name (UNSUPPORTED_FIELDS) rather than silently ignored
    prompt_logprob_token_ids: list[int] | None = None
    prompt_logprob_start: int | None = None
    routed_experts_prompt_start: int = 0
    trace_decode_token_ids: list[int] | None = None
    # vLLM's: characters of output text held back while a stop string may still be completing
    # (the longest stop string's length - 1; 0 with include_stop_str_in_output). Not an argument.
    output_text_buffer_length: int = field(default=0, init=False, repr=False)
    # Token ids that end the sequence: stop_token_ids here, plus the model's eos id(s), which
    # the engine adds when it accepts the request unless ignore_eos. Not a constructor argument.
    all_stop_token_ids: set[int] = field(default_factory=set, init=False, repr=False)
    # vLLM's: the primary eos id `update_from_generation_config` was given (None: ignore_eos)
    _eos_token_id: int | None = field(default=None, init=False, repr=False)
    # vLLM's: bad_words as token id sequences, set by `update_from_tokenizer`
    _bad_words_token_ids: list[list[int]] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.n = _as_int("n", self.n)
        self.best_of = _as_int("best_of", self.best_of, optional=True)
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
            setattr(self, name, _as_float(name, getattr(self, name)))
        for name in ("temperature", "top_p", "min_p", "length_penalty"):
            setattr(self, name, _as_float(name, getattr(self, name)))
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            logger.warning(
                "temperature %s is below %s (logits would overflow): using %s",
                self.temperature,
                MIN_TEMPERATURE,
                MIN_TEMPERATURE,
            )
            self.temperature = MIN_TEMPERATURE
        self.top_k = _as_int("top_k", self.top_k)
        self.seed = _as_int("seed", self.seed, optional=True)
        if self.seed == -1:  # vLLM: -1 is no seed
            self.seed = None
        self.max_tokens = _as_int("max_tokens", self.max_tokens, optional=True)
        self.min_tokens = _as_int("min_tokens", self.min_tokens)
        _check_unsupported(self)
        # vLLM reads logprobs=True / prompt_logprobs=True as 1
        self.logprobs = _as_int(
            "logprobs", 1 if self.logprobs is True else self.logprobs, optional=True
        )
        self.prompt_logprobs = _as_int(
            "prompt_logprobs",
            1 if self.prompt_logprobs is True else self.prompt_logprobs,
            optional=True,
        )
        self.output_kind = _as_output_kind(self.output_kind)

        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise ValueError(f"stop must be a str or a list of str, got {self.stop!r:.200}.")
        if not isinstance(self.stop_token_ids, (list, tuple, set, type(None))):
            raise ValueError(
                f"stop_token_ids must be a list of int, got {self.stop_token_ids!r:.200}."
            )
        ids = [_as_int("stop_token_ids", t) for t in self.stop_token_ids or ()]
        self.stop_token_ids = list(dict.fromkeys(ids))  # (vLLM drops repeats)
        self.stream_interval = _as_int("stream_interval", self.stream_interval, optional=True)
        budget = _as_int("thinking_token_budget", self.thinking_token_budget, optional=True)
        self.thinking_token_budget = None if budget == -1 else budget
        self.repetition_detection = RepetitionDetectionParams.of(self.repetition_detection)
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise ValueError(
                    "guided_decoding and structured_outputs both given: guided_decoding is "
                    "vLLM's older name of structured_outputs"
                )
            self.structured_outputs = self.guided_decoding
        k = _as_int("truncate_prompt_tokens", self.truncate_prompt_tokens, optional=True)
        if k is not None and k != -1 and k < 1:
            raise ValueError(
                f"truncate_prompt_tokens must be an int >= 1, -1 or None, got {k!r:.200}"
            )
        self.truncate_prompt_tokens = k
        if self.logits_processors:
            raise ValueError(
                "logits_processors per request (vLLM v0's callables) are not supported: wrap "
                "them in a paged_engine.sample.logits_processor.AdapterLogitsProcessor and pass "
                "LLM(logits_processors=[...])"
            )
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ValueError(f"extra_args must be a dict or None, got {self.extra_args!r:.200}.")
        if self.skip_reading_prefix_cache is not None:
            _check_bools(self, ("skip_reading_prefix_cache",))
        if self.top_k == -1 or self.top_k >= 2**31:  # no vocabulary is that large: off
            self.top_k = 0
        _check_token_rules(self)
        self._explicit_logprobs()
        self._verify()
        if self.temperature < SAMPLING_EPS:
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        beam_conflict = self.top_p < 1.0 or self.top_k != 0 or self.min_p > 0.0
        if self.use_beam_search and beam_conflict:
            raise ValueError(
                "top_p, top_k and min_p must be off with use_beam_search, got "
                f"top_p={self.top_p}, top_k={self.top_k}, min_p={self.min_p}."
            )
        if self.use_beam_search:
            self._verify_beam_search()
            _check_length_penalty(self.length_penalty)
        self.all_stop_token_ids = set(self.stop_token_ids)
        if self.stop and not self.include_stop_str_in_output:
            self.output_text_buffer_length = max(len(s) for s in self.stop) - 1

    def _verify_beam_search(self) -> None:
        """Beam search (`to_beam_search_params`) would silently drop these: refuse them."""
        unsupported = {
            "stop": bool(self.stop),
            "stop_token_ids": bool(self.stop_token_ids),
            "logprob_token_ids": self.logprob_token_ids is not None,  # (before: it sets logprobs)
            "prompt_logprobs": self.prompt_logprobs is not None,
            "min_tokens": self.min_tokens > 0,
            "presence_penalty": self.presence_penalty != 0.0,
            "frequency_penalty": self.frequency_penalty != 0.0,
            "repetition_penalty": self.repetition_penalty != 1.0,
            "structured_outputs": self.structured_outputs is not None,
            "logit_bias": bool(self.logit_bias),
            "allowed_token_ids": self.allowed_token_ids is not None,
            "bad_words": bool(self.bad_words),
            "repetition_detection": self.repetition_detection is not None,
            "thinking_token_budget": self.thinking_token_budget is not None,
            "truncate_prompt_tokens": self.truncate_prompt_tokens is not None,
        }
        for name, used in unsupported.items():
            if used:
                raise ValueError(
                    f"{name} is not supported with use_beam_search, got "
                    f"{getattr(self, name)!r:.200}."
                )

    def _explicit_logprobs(self) -> None:
        """logprob_token_ids: at most MAX_LOGPROB_TOKEN_IDS non-negative ids (vocabulary: the
        engine checks), or None. As in vLLM, logprobs is None or the ids' count as given; after
        this the ids are distinct and logprobs is their count, which turns logprobs on (and
        passes this check again in a `dataclasses.replace`)."""
        ids = self.logprob_token_ids
        if ids is None:
            return
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"logprob_token_ids must be a list of token ids, got {ids!r:.200}.")
        if len(ids) > MAX_LOGPROB_TOKEN_IDS:
            raise ValueError(
                f"logprob_token_ids holds at most {MAX_LOGPROB_TOKEN_IDS} token ids, got "
                f"{len(ids)}."
            )
        tokens = [_token_id("logprob_token_ids", t) for t in ids]
        if self.logprobs is not None and self.logprobs != len(tokens):
            raise ValueError(
                f"logprob_token_ids holds {len(tokens)} ids: logprobs must then be None or "
                f"{len(tokens)} (their count), got logprobs={self.logprobs}."
            )
        if not tokens:  # (vLLM: no ids; logprobs None or 0 stays)
            self.logprob_token_ids = None
            return
        self.logprob_token_ids = list(dict.fromkeys(tokens))
        self.logprobs = len(self.logprob_token_ids)

    def _verify(self) -> None:
        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"{name} must be {rule}, got {getattr(self, name)!r:.200}.")

        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise bad("seed", "a 64-bit integer")
        if self.n < 1:
            raise bad("n", "at least 1")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of must be >= n (n={self.n}), got {self.best_of}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", "greater than 0")
        if not self.temperature >= 0.0:
            raise bad("temperature", "non-negative")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]")
        if self.top_k < 0:
            raise bad("top_k", "0 or -1 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1]")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", "at least 1")
        if self.min_tokens < 0:
            raise bad("min_tokens", "non-negative")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}."
            )
        if self.logprobs is not None and self.logprobs < -1:
            raise bad("logprobs", "non-negative or -1 (the whole vocabulary)")
        if self.prompt_logprobs is not None and self.prompt_logprobs < -1:
            raise bad("prompt_logprobs", "non-negative or -1 (the whole vocabulary)")
        if self.stream_interval is not None and self.stream_interval < 1:
            raise bad("stream_interval", "at least 1")
        if self.thinking_token_budget is not None and self.thinking_token_budget < 0:
            raise bad("thinking_token_budget", "non-negative, or -1 / None for no limit")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(
                f"stop holds at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}: each one "
                "is searched for after every token."
            )
        for i, s in enumerate(self.stop):
            if not isinstance(s, str) or not s:
                raise ValueError(
                    f"stop must contain only non-empty strings, got stop[{i}] = {s!r:.80}."
                )
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True, got detokenize=False.")
        _check_early_stopping(self.early_stopping)
        _check_bools(self, _BOOL_FIELDS)

    @property
    def num_top_logprobs(self) -> int | None:
        """Entries reported beside each sampled token: the explicit ids' count, or the top-k
        (None: no logprobs)."""
        return len(self.logprob_token_ids) if self.logprob_token_ids else self.logprobs

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def is_beam_search(self) -> bool:
        return self.use_beam_search

    @property
    def sampling_type(self) -> SamplingType:
        if self.use_beam_search:
            return SamplingType.BEAM
        if self.is_greedy:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def num_sequences(self) -> int:
        """Sequences the engine runs for this request: max(n, best_of)."""
        return max(self.n, self.best_of or self.n)

    def to_beam_search_params(self) -> BeamSearchParams:
        return BeamSearchParams(
            beam_width=self.num_sequences,
            max_tokens=self.max_tokens,
            ignore_eos=self.ignore_eos,
            temperature=self.temperature,
            length_penalty=self.length_penalty,
            include_stop_str_in_output=self.include_stop_str_in_output,
            early_stopping=self.early_stopping,
            output_kind=self.output_kind,
        )

    def clone(self) -> SamplingParams:
        """A copy that shares nothing mutable with self (stop lists, all_stop_token_ids); a
        shallow one with skip_clone (vLLM's)."""
        return copy.copy(self) if self.skip_clone else copy.deepcopy(self)

    # ---- vLLM's helpers for code that builds requests itself ---------------------------------
    @staticmethod
    def from_optional(**kwargs: Any) -> SamplingParams:
        """vLLM's: SamplingParams(**kwargs), None standing for the default of n, the three
        penalties, temperature and top_p (a generation config's unset values)."""
        for name in _OPTIONAL_DEFAULTS:
            if kwargs.get(name) is None:
                kwargs.pop(name, None)
        return SamplingParams(**kwargs)

    @property
    def num_logprobs(self) -> int | None:
        """vLLM's name of `num_top_logprobs`."""
        return self.num_top_logprobs

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_token_id

    def update_from_generation_config(
        self, generation_config: dict[str, Any], eos_token_id: int | None = None
    ) -> None:
        """vLLM's: `eos_token_id` (the tokenizer's) and generation_config's other eos ids end
        the sequence: all join all_stop_token_ids; the others also join stop_token_ids
        unless ignore_eos."""
        if not self.ignore_eos:
            self._eos_token_id = eos_token_id
        if eos_token_id is not None:
            self.all_stop_token_ids.add(eos_token_id)
        ids = generation_config.get("eos_token_id")
        if ids is None:
            return
        extra = {ids} if isinstance(ids, int) else set(ids)
        extra.discard(eos_token_id)  # type: ignore[arg-type]
        self.all_stop_token_ids.update(extra)
        if extra and not self.ignore_eos:
            assert self.stop_token_ids is not None
            self.stop_token_ids = list(dict.fromkeys([*self.stop_token_ids, *sorted(extra)]))

    @property
    def bad_words_token_ids(self) -> list[list[int]] | None:
        """vLLM's: `bad_words` as token ids (None until `update_from_tokenizer`)."""
        return self._bad_words_token_ids

    def update_from_tokenizer(self, tokenizer: Any) -> None:
        """vLLM's: resolve `bad_words` with `tokenizer` into `bad_words_token_ids`. Each word
        as it starts the text, and after a space when that spelling is as many tokens with
        another first token (a word-start token); ValueError for a word that yields no tokens
        or ids outside the tokenizer's vocabulary. Nothing to do without bad_words. (The engine
        resolves bad words itself on add_request, banning the spaced spelling whenever it
        differs: input_processor.py.)"""
        if not self.bad_words:
            return
        resolved: list[list[int]] = []
        for word in self.bad_words:
            bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            if not bare:
                raise ValueError(f"bad_words: {word!r:.100} encodes to no tokens")
            resolved.append(list(bare))
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
                resolved.append(list(spaced))
        top = getattr(tokenizer, "max_token_id", None)
        top = len(tokenizer) - 1 if top is None else top
        bad = sorted({t for ids in resolved for t in ids if not 0 <= t <= top})
        if bad:
            raise ValueError(
                f"bad_words: token ids {bad[:5]} are outside the vocabulary [0, {top}]"
            )
        self._bad_words_token_ids = resolved


# The fields `SamplingParams.from_optional` reads None in as their defaults (vLLM's).
_OPTIONAL_DEFAULTS = (
    "n",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "temperature",
    "top_p",
)


# vLLM's SamplingParams fields paged accepts only at their defaults (what each would need).
UNSUPPORTED_FIELDS: dict[str, tuple[Any, str]] = {
    "prompt_logprob_token_ids": (None, "the logprobs of chosen ids at prompt rows"),
    "prompt_logprob_start": (None, "prompt_logprob_token_ids"),
    "routed_experts_prompt_start": (0, "returning routed experts (enable_return_routed_experts)"),
    "trace_decode_token_ids": (None, "replaying a fixed decode trace"),
}


def _check_unsupported(p: SamplingParams) -> None:
    for name, (default, needs) in UNSUPPORTED_FIELDS.items():
        value = getattr(p, name)
        if value != default:
            raise ValueError(
                f"{name} is not supported (it needs {needs}, which paged does not run): leave "
                f"it at {default!r}, got {value!r:.200}."
            )


def whole_vocabulary(params: SamplingParams, vocab_size: int) -> SamplingParams:
    """A copy of `params` with logprobs / prompt_logprobs -1 (vLLM: every token) as the count
    (the caller's object keeps its -1)."""

    def count(k: int | None) -> int | None:
        return vocab_size if k == -1 else k

    return dataclasses.replace(
        params, logprobs=count(params.logprobs), prompt_logprobs=count(params.prompt_logprobs)
    )


def _check_token_rules(p: SamplingParams) -> None:
    """Normalize structured_outputs / logit_bias / allowed_token_ids / bad_words; a ValueError
    names the parameter. Token ids are checked against the vocabulary by the engine."""
    if p.structured_outputs is not None:
        p.structured_outputs = StructuredOutputsParams.from_dict(p.structured_outputs)
    if p.logit_bias is not None:
        if not isinstance(p.logit_bias, dict):
            raise ValueError(
                f"logit_bias must be a dict of token id -> bias, got {p.logit_bias!r:.200}"
            )
        bias: dict[int, float] = {}
        for key, value in p.logit_bias.items():
            token = _token_id("logit_bias", key)
            if isinstance(value, numbers.Real) and not isinstance(value, bool) and value == value:
                # clamped as vLLM's from_optional does; -inf (vLLM: "never") and ints past
                # float's range too
                value = 100.0 if value > 100 else -100.0 if value < -100 else value
            bias[token] = _as_float(f"logit_bias[{key!r:.200}]", value)
        p.logit_bias = bias
    if p.allowed_token_ids is not None:
        ids = p.allowed_token_ids
        if not isinstance(ids, (list, tuple)) or not ids:
            raise ValueError(f"allowed_token_ids must be a non-empty list of ids, got {ids!r:.200}")
        p.allowed_token_ids = [_token_id("allowed_token_ids", t) for t in ids]
    if p.bad_words is None:
        p.bad_words = []  # vLLM's: an empty list, not None
    else:
        words = p.bad_words
        if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) and w for w in words):
            raise ValueError(f"bad_words must be a list of non-empty strings, got {words!r:.200}")
        p.bad_words = list(dict.fromkeys(words))
        if len(p.bad_words) > MAX_STOP_STRINGS:  # each is matched against every step's tail
            raise ValueError(
                f"bad_words holds at most {MAX_STOP_STRINGS} words, got {len(p.bad_words)}."
            )


def _token_id(name: str, value: Any) -> int:
    """A non-negative token id; JSON object keys arrive as strings ("50256")."""
    if isinstance(value, str):
        digits = value.strip().removeprefix("-")
        # ASCII and short, else int() raises unnamed ('²' is a digit; 5000 digits overflow)
        if digits.isascii() and digits.isdigit() and len(digits) <= 20:
            value = int(value)
    token = _as_int(name, value)
    assert token is not None
    if token < 0:
        raise ValueError(f"{name} token ids must be non-negative, got {token}.")
    return token


@dataclass(slots=True)
class BeamSearchParams:
    """Beam search (vLLM's `LLM.beam_search` parameters). Scores are cumulative raw logprobs
    divided by `len ** length_penalty`; `early_stopping` is True, False or "never" (HF meaning).
    The engine returns the best `beam_width` finished hypotheses."""

    beam_width: int
    max_tokens: int | None
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool | str = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        self.output_kind = _as_output_kind(self.output_kind)
        self.beam_width = _as_int("beam_width", self.beam_width)
        self.max_tokens = _as_int("max_tokens", self.max_tokens, optional=True)
        self.temperature = _as_float("temperature", self.temperature)
        self.length_penalty = _as_float("length_penalty", self.length_penalty)
        _check_length_penalty(self.length_penalty)
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be at least 1, got {self.beam_width}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        _check_early_stopping(self.early_stopping)
        _check_bools(self, ("ignore_eos", "include_stop_str_in_output"))
