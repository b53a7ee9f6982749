"""Validation of OpenAI request bodies into plain records the server can act on.

Every check raises `APIError(400)` naming the offending parameter. The result carries sampling
keyword arguments for the engine's `SamplingParams` (only what the client set, plus our defaults),
so this module never imports the engine (nor torch).
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from paged_server.chat_messages import chat_documents, chat_message, template_kwargs
from paged_server.errors import APIError, bad_request
from paged_server.media import MediaRef, media_io_kwargs
from paged_server.structured_request import FIELDS as STRUCTURED_FIELDS
from paged_server.structured_request import check_schema_given, parse_structured
from paged_server.tools import ToolRequest, parse_tools

MAX_N = 128
# logprobs / top_logprobs / prompt_logprobs: a sanity bound; the app holds each request to the
# engine's max_logprobs (--max-logprobs, 20 by default, as in vLLM)
MAX_LOGPROBS = 1 << 20

# Accepted and ignored: they change nothing about generation.
_IGNORED = {
    "user",
    "store",
    "metadata",
    "service_tier",
    "prompt_cache_key",
    "prompt_cache_retention",  # caching hints: the prefix cache is automatic
    "prompt_cache_options",
    "safety_identifier",
}
# Known OpenAI / vLLM parameters we do not implement; allowed only at their "off" values.
_UNSUPPORTED_UNLESS = {
    "suffix": (None, ""),
    "functions": (None, []),
    "function_call": (None, "none"),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "web_search_options": (None,),
    "verbosity": (None,),
    "lora_request": (None,),
    "moderation": (None,),
    # vLLM extras left out (docs/server.md lists why)
    "logits_processors": (None, []),
    "mm_processor_kwargs": (None, {}),
    "prompt_embeds": (None,),  # completions only (_COMPLETION_KEYS)
    "kv_transfer_params": (None,),
    "ec_transfer_params": (None,),  # encoder-cache disaggregation
    "return_token_offsets": (None, False),  # vLLM honours it on its /render routes only
    # the prompt is cut keeping its last truncate_prompt_tokens tokens: the left side
    "truncation_side": (None, "left"),
}

_SAMPLING = (
    "n",
    "best_of",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "length_penalty",
)
_COMMON = {
    "model",
    "stream",
    "stream_options",
    "use_beam_search",
    "max_tokens",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "spaces_between_special_tokens",
    "truncate_prompt_tokens",
    "add_special_tokens",
    "prompt_logprobs",
    "return_token_ids",
    "return_tokens_as_token_ids",
    "request_id",
    "priority",
    "cache_salt",
    "repetition_detection",
    "max_repetition_pattern_size",  # older vLLM's spelling of repetition_detection
    "min_repetition_pattern_size",
    "repetition_min_count",
    "vllm_xargs",
    "skip_reading_prefix_cache",
    "thinking_token_budget",
    "logprob_token_ids",
    *_SAMPLING,
    *STRUCTURED_FIELDS,
}
_COMPLETION_KEYS = _COMMON | {"prompt", "logprobs", "echo", "prompt_embeds"}
_CHAT_KEYS = _COMMON | {
    "messages",
    "echo",
    "continue_final_message",
    "documents",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "chat_template",
    "chat_template_kwargs",
    "mm_processor_kwargs",
    "media_io_kwargs",
    "add_generation_prompt",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "include_reasoning",
    "reasoning_effort",
}
# OpenAI's efforts, as vLLM takes them ("none": pydantic-ai's thinking=False; vLLM's chat also
# takes DeepSeek V4's "max", left out here)
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


@dataclass(slots=True)
class GenerationRequest:
    """What both endpoints reduce to; `prompts` are strings or token-id lists."""

    model: str | None
    prompts: list[str | list[int]]
    sampling: dict[str, Any]
    max_tokens: int | None  # None: fill the context (no limit in chat, or a null one)
    stream: bool
    include_usage: bool
    use_beam_search: bool
    logprobs: int | None  # top-k per token; 0 = the sampled token only; None = no logprobs
    echo: bool = False
    messages: list[dict[str, str]] = field(default_factory=list)
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # extra template variables
    add_generation_prompt: bool = True
    structured: dict[str, Any] | None = None  # for SamplingParams(structured_outputs=...)
    structured_param: str | None = None  # the request field that set it (names its errors)
    tools: ToolRequest | None = None
    include_reasoning: bool = True  # chat: keep the reasoning a --reasoning-parser splits off
    reasoning_effort: str | None = None  # chat: a template variable (gpt-oss's template reads it)
    continue_final_message: bool = False  # the template leaves the last message open
    documents: list[dict[str, Any]] | None = None  # for RAG chat templates
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens
    add_special_tokens: bool = True  # BOS etc. when tokenizing (chat: False, the template has it)
    request_id: str | None = None  # vLLM: the response id is "cmpl-" / "chatcmpl-" + this
    prompt_logprobs: int | None = None  # vLLM: top-k logprobs of every prompt token
    continuous_usage: bool = False  # usage in every stream chunk
    return_token_ids: bool = False  # vLLM: prompt_token_ids and each choice's token_ids
    priority: int = 0  # vLLM: lower runs first under --scheduling-policy priority
    cache_salt: str | None = None  # vLLM: prefix-cache hits only among the same salt
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: "token_id:{id}" in logprobs
    media_refs: list[MediaRef] = field(default_factory=list)  # chat: images, videos, in order
    # completions: base64 torch.save'd [L, D] tensors, as vLLM takes them; they run before
    # the `prompts` (choice indexes count them first), decoded by the app (prompt_embeds.py)
    prompt_embeds: list[str] = field(default_factory=list)
    # chat: vLLM's mm_processor_kwargs, for the image processor on this request's images
    mm_processor_kwargs: dict[str, Any] | None = None
    # chat: vLLM's media_io_kwargs {"video": {"num_frames": N}}: frames sampled per video
    num_frames: int | None = None
    # chat: the multi_modal_data of its media processed already ({"image": [ImageInput, ...],
    # "video": [...]}), where their runs' lengths needed them
    processed_media: dict[str, list] | None = None

    @property
    def n(self) -> int:
        return self.sampling.get("n", 1)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


class _Body:
    """Typed access to a JSON object; every getter treats `null` as absent."""

    def __init__(self, body: Any, allowed: set[str]):
        if not isinstance(body, dict):
            raise bad_request("request body must be a JSON object")
        for key in body:
            if key in allowed or key in _IGNORED or key in _UNSUPPORTED_UNLESS:
                continue
            raise bad_request(f"Unrecognized request argument supplied: {key}", key)
        # (a field this route serves, e.g. prompt_embeds when enabled, takes any value)
        check_defaults(body, _UNSUPPORTED_UNLESS, served=allowed)
        self.d = body

    def has(self, name: str) -> bool:
        return self.d.get(name) is not None

    def int(
        self, name: str, default: int | None = None, lo: int | None = None, hi: int | None = None
    ) -> int | None:
        v = self.d.get(name)
        if v is None:
            return default
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if not _is_int(v):
            raise bad_request(f"'{name}' must be an integer, got {type(v).__name__}", name)
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise bad_request(f"'{name}' must be in [{lo}, {hi}], got {v}", name)
        return v

    def float(
        self, name: str, lo: float | None = None, hi: float | None = None, lo_open: bool = False
    ) -> float | None:
        v = self.d.get(name)
        if v is None:
            return None
        if not _is_num(v):
            raise bad_request(f"'{name}' must be a finite number, got {v!r}", name)
        if (lo is not None and (v < lo or (lo_open and v == lo))) or (hi is not None and v > hi):
            lo_s = f"({lo}" if lo_open else f"[{lo}"
            raise bad_request(f"'{name}' must be in {lo_s}, {hi}], got {v}", name)
        return float(v)

    def bool(self, name: str, default: bool = False) -> bool:
        v = self.d.get(name)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise bad_request(f"'{name}' must be a boolean, got {type(v).__name__}", name)
        return v

    def str(self, name: str) -> str | None:
        v = self.d.get(name)
        if v is not None and not isinstance(v, str):
            raise bad_request(f"'{name}' must be a string, got {type(v).__name__}", name)
        return v

    def int_list(self, name: str) -> list[int] | None:
        v = self.d.get(name)
        if v is None:
            return None
        if not isinstance(v, list) or not all(_is_int(x) and x >= 0 for x in v):
            raise bad_request(f"'{name}' must be a list of non-negative integers", name)
        return v


_SALT_FORBIDDEN = frozenset("@/\\\x00")


def _logprob_token_ids(b: _Body) -> list[int] | None:
    ids = b.int_list("logprob_token_ids")
    if ids == []:  # vLLM: a 400, not the top-k logprobs of an absent list
        raise bad_request("'logprob_token_ids' must not be an empty list", "logprob_token_ids")
    return ids


def _sampling(b: _Body) -> dict[str, Any]:
    s: dict[str, Any] = {}
    checks = {
        "temperature": lambda: b.float("temperature", 0.0, 100.0),
        "top_p": lambda: b.float("top_p", 0.0, 1.0, lo_open=True),
        "top_k": lambda: b.int("top_k", None, -1, 1 << 20),
        "min_p": lambda: b.float("min_p", 0.0, 1.0),
        "presence_penalty": lambda: b.float("presence_penalty", -2.0, 2.0),
        "frequency_penalty": lambda: b.float("frequency_penalty", -2.0, 2.0),
        "repetition_penalty": lambda: b.float("repetition_penalty", 0.0, 100.0, lo_open=True),
        "length_penalty": lambda: b.float("length_penalty", -100.0, 100.0),
        "seed": lambda: b.int("seed", None, -(1 << 63), (1 << 64) - 1),
        "min_tokens": lambda: b.int("min_tokens", None, 0, 1 << 31),
        "stop_token_ids": lambda: b.int_list("stop_token_ids"),
        "ignore_eos": lambda: b.bool("ignore_eos") if b.has("ignore_eos") else None,
        "skip_special_tokens": lambda: (
            b.bool("skip_special_tokens") if b.has("skip_special_tokens") else None
        ),
        "include_stop_str_in_output": lambda: (
            b.bool("include_stop_str_in_output") if b.has("include_stop_str_in_output") else None
        ),
        "spaces_between_special_tokens": lambda: (
            b.bool("spaces_between_special_tokens")
            if b.has("spaces_between_special_tokens")
            else None
        ),
        "allowed_token_ids": lambda: b.int_list("allowed_token_ids"),
        "logprob_token_ids": lambda: _logprob_token_ids(b),
        "logit_bias": lambda: _logit_bias(b.d.get("logit_bias")),
        "bad_words": lambda: _bad_words(b.d.get("bad_words")),
        "repetition_detection": lambda: _repetition_detection(b),
        "extra_args": lambda: parse_xargs(b.d.get("vllm_xargs")),
        "thinking_token_budget": lambda: b.int("thinking_token_budget", None, -1, 1 << 31),
        "skip_reading_prefix_cache": lambda: (
            b.bool("skip_reading_prefix_cache") if b.has("skip_reading_prefix_cache") else None
        ),
    }
    for name, check in checks.items():
        value = check()
        if value is not None:
            s[name] = value
    n = b.int("n", 1, 1, MAX_N)
    s["n"] = n
    if b.has("best_of"):
        best_of = b.int("best_of", None, 1, MAX_N)
        if best_of < n:
            raise bad_request(f"'best_of' ({best_of}) must be >= 'n' ({n})", "best_of")
        s["best_of"] = best_of
    stop = b.d.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(x, str) and x for x in stop):
            raise bad_request("'stop' must be a non-empty string or a list of them", "stop")
        if stop:
            s["stop"] = stop
    return s


def _logit_bias(value: Any) -> dict[str, float] | None:
    """{token id (JSON keys are strings): bias}; SamplingParams clamps to [-100, 100] and the
    engine checks the ids against the vocabulary."""
    if value is None or value == {}:
        return None
    if not isinstance(value, dict) or not all(_is_num(v) for v in value.values()):
        raise bad_request("'logit_bias' must map token ids to numbers", "logit_bias")
    return value


_MAX_PATTERN = 1024  # the check reads up to max_pattern_size * min_count tokens a step


def _repetition_detection(b: _Body) -> dict[str, int] | None:
    """vLLM's `repetition_detection` object, or its older top-level fields (0: off); sizes and
    counts over 1024 are refused here (a client must not make the engine's per-token check
    slow for everyone), the rest is checked by SamplingParams (a 400 naming
    repetition_detection)."""
    value = b.d.get("repetition_detection")
    legacy = {
        "max_pattern_size": b.int("max_repetition_pattern_size", 0, 0, _MAX_PATTERN),
        "min_pattern_size": b.int("min_repetition_pattern_size", 0, 0, _MAX_PATTERN),
        "min_count": b.int("repetition_min_count", 0, 0, _MAX_PATTERN),
    }
    if value is None:
        return legacy if legacy["max_pattern_size"] else None
    if not isinstance(value, dict):
        raise bad_request("'repetition_detection' must be an object", "repetition_detection")
    for k, v in value.items():
        if _is_int(v) and v > _MAX_PATTERN:
            raise bad_request(
                f"'repetition_detection.{k}' must be at most {_MAX_PATTERN}, got {v}",
                "repetition_detection",
            )
    return value


def check_defaults(
    body: dict[str, Any], table: dict[str, tuple[Any, ...]], served: Collection[str] = ()
) -> None:
    """Fields this server accepts only at the values in `table` (vLLM's defaults, asking for
    nothing it lacks), unless the route `served` them: another value is a 400 naming the field."""
    for key, values in table.items():
        if key in body and key not in served and body[key] not in values:
            raise bad_request(f"parameter '{key}' is not supported by this server", key)


def parse_xargs(value: Any) -> dict[str, Any] | None:
    """vLLM's `vllm_xargs`: SamplingParams.extra_args, for custom sampling code and plugins."""
    if value is None or value == {}:
        return None
    ok = isinstance(value, dict) and all(
        isinstance(v, (str, int, float))
        or (isinstance(v, list) and all(isinstance(x, (str, int, float)) for x in v))
        for v in value.values()
    )
    if not ok:
        raise bad_request(
            "'vllm_xargs' must map names to strings, numbers or lists of them", "vllm_xargs"
        )
    return value


def _bad_words(value: Any) -> list[str] | None:
    if value is None or value == []:
        return None
    if not isinstance(value, list) or not all(isinstance(w, str) and w for w in value):
        raise bad_request("'bad_words' must be a list of non-empty strings", "bad_words")
    return value


_STREAM_OPTIONS = {"include_usage", "include_obfuscation", "continuous_usage_stats"}


def _stream_flags(b: _Body) -> tuple[bool, bool]:
    stream = b.bool("stream")
    opts = b.d.get("stream_options")
    if opts is None:
        return stream, False
    # include_obfuscation (OpenAI's padding against side channels) changes nothing here;
    # continuous_usage_stats (vLLM) is read by _continuous_usage.
    if not isinstance(opts, dict) or set(opts) - _STREAM_OPTIONS:
        raise bad_request("'stream_options' must be {\"include_usage\": bool}", "stream_options")
    if not stream:  # vLLM refuses only options set: `{}` without a stream is served
        if opts:
            raise bad_request(
                "'stream_options' is only allowed when 'stream' is true", "stream_options"
            )
        return stream, False
    usage = opts.get("include_usage", False)
    if not isinstance(usage, bool):
        raise bad_request("'stream_options.include_usage' must be a boolean", "stream_options")
    return stream, usage


def _continuous_usage(b: _Body, include_usage: bool) -> bool:
    """vLLM's stream_options.continuous_usage_stats: usage in every chunk (with include_usage)."""
    opts = b.d.get("stream_options") or {}
    value = opts.get("continuous_usage_stats", False)
    if not isinstance(value, bool):
        raise bad_request(
            "'stream_options.continuous_usage_stats' must be a boolean", "stream_options"
        )
    return value and include_usage


def _common(b: _Body, req: GenerationRequest) -> None:
    model = b.str("model")
    req.model = model
    # vLLM: -1 means the whole context, i.e. no truncation beyond the max_model_len check.
    truncate = b.int("truncate_prompt_tokens", None, -1, 1 << 31)
    if truncate == 0:
        raise bad_request("'truncate_prompt_tokens' must be >= 1 (or -1)", "truncate_prompt_tokens")
    req.truncate_prompt_tokens = None if truncate == -1 else truncate
    req.add_special_tokens = b.bool("add_special_tokens", req.add_special_tokens)
    rid = b.str("request_id")
    if rid is not None and not (0 < len(rid) <= 128 and rid.isprintable()):
        raise bad_request("'request_id' must be 1-128 printable characters", "request_id")
    req.request_id = rid
    req.priority = b.int("priority", 0, -(1 << 63), (1 << 63) - 1)
    salt = b.d.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise bad_request("'cache_salt' must be a non-empty string if provided", "cache_salt")
    if salt is not None and (len(salt) > 128 or not _SALT_FORBIDDEN.isdisjoint(salt)):
        raise bad_request(  # (vLLM's validate_cache_salt: what cache backends key safely)
            "'cache_salt' must be at most 128 characters and must not contain '@', '/', '\\' "
            "or NUL",
            "cache_salt",
        )
    req.cache_salt = salt
    req.continuous_usage = _continuous_usage(b, req.include_usage)
    req.return_token_ids = b.bool("return_token_ids")
    req.tokens_as_ids = b.bool("return_tokens_as_token_ids")
    req.prompt_logprobs = b.int("prompt_logprobs", None, -1, MAX_LOGPROBS)
    if req.prompt_logprobs not in (None, 0) and req.stream:  # (0, as vLLM: nothing to send)
        raise bad_request("'prompt_logprobs' is not available with 'stream'", "prompt_logprobs")
    if req.use_beam_search and req.stream:
        raise bad_request("streaming is not supported with beam search", "use_beam_search")
    best_of = req.sampling.get("best_of")
    if req.stream and best_of is not None and best_of != req.n:
        raise bad_request("'best_of' != 'n' is not supported with streaming", "best_of")


def _prompts(value: Any) -> list[str | list[int]]:
    """prompt: str | list[str] | list[int] | list[list[int]], each non-empty."""
    if isinstance(value, str):
        prompts: list = [value]
    elif isinstance(value, list) and value and all(_is_int(x) for x in value):
        prompts = [value]
    elif isinstance(value, list) and value:
        prompts = value
    else:
        raise bad_request("'prompt' must be a string, a list of strings or of token ids", "prompt")
    for p in prompts:
        # Ids out of the vocabulary (negative ones too) are the route's to name, with the range.
        ok = isinstance(p, str) or (isinstance(p, list) and p and all(_is_int(x) for x in p))
        if not ok:
            raise bad_request(
                "'prompt' items must be strings or non-empty token-id lists", "prompt"
            )
        if isinstance(p, str) and not p:
            raise bad_request("'prompt' must not be empty", "prompt")
    return prompts


def _prompt_embeds(value: Any) -> list[str]:
    """prompt_embeds: a base64 string (a torch.save'd tensor) or a list of them; [] for null."""
    if value is None:
        return []
    items = value if isinstance(value, list) else [value]
    if not items or not all(isinstance(v, str) and v for v in items):
        raise bad_request(
            "'prompt_embeds' must be a base64 string of a torch.save'd tensor, or a non-empty "
            "list of them",
            "prompt_embeds",
        )
    return items


def parse_completion(body: Any) -> GenerationRequest:
    b = _Body(body, _COMPLETION_KEYS)
    embeds = _prompt_embeds(b.d.get("prompt_embeds"))
    prompt = b.d.get("prompt")
    if embeds and prompt in ("", []):  # the openai client's stand-in for "no text prompt"
        prompt = None
    if prompt is None and not embeds:
        raise bad_request("'prompt' (or 'prompt_embeds') is required", "prompt")
    stream, usage = _stream_flags(b)
    req = GenerationRequest(
        model=None,
        prompts=[] if prompt is None else _prompts(prompt),
        sampling=_sampling(b),
        # 16 when absent (OpenAI's default); an explicit null fills the context, as in vLLM
        max_tokens=b.int("max_tokens", None if "max_tokens" in b.d else 16, 0, 1 << 31),
        stream=stream,
        include_usage=usage,
        use_beam_search=b.bool("use_beam_search"),
        logprobs=b.int("logprobs", None, -1, MAX_LOGPROBS),  # -1: every token (max_logprobs)
        echo=b.bool("echo"),
    )
    _common(b, req)
    req.structured, req.structured_param = parse_structured(b.d)
    check_schema_given(req.structured, req.structured_param)
    _check_beam_constraint(req)
    req.prompt_embeds = embeds
    if embeds and req.echo:
        raise bad_request("'echo' is not supported with 'prompt_embeds' (no prompt text)", "echo")
    _check_explicit_logprobs(req, "'logprobs'")
    if req.max_tokens == 0 and "logprob_token_ids" in req.sampling:
        raise bad_request(
            "'logprob_token_ids' reports generated positions: 'max_tokens' 0 generates none "
            "(the echoed prompt's logprobs are 'logprobs' / 'prompt_logprobs')",
            "logprob_token_ids",
        )
    if req.max_tokens == 0 and not req.echo:
        # Prompt scoring (legacy OpenAI, lm-eval-harness): the prompt and its logprobs, nothing
        # generated. Without echo there is nothing to return.
        raise bad_request("'max_tokens' 0 scores the prompt: it needs 'echo': true", "max_tokens")
    return req


def _object_or_none(b: _Body, key: str) -> dict[str, Any] | None:
    value = b.d.get(key)
    if value is not None and not isinstance(value, dict):
        raise bad_request(f"'{key}' must be an object", key)
    return value


def parse_chat(
    body: Any, tool_parser: str | None = None, images: bool = False
) -> GenerationRequest:
    """A chat request; `images`: the model takes images or videos (else such a part is a
    400)."""
    b = _Body(body, _CHAT_KEYS)
    messages = b.d.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    refs: list[MediaRef] | None = [] if images else None
    stream, usage = _stream_flags(b)
    max_tokens = b.int("max_completion_tokens", None, 1, 1 << 31)
    if max_tokens is None:
        max_tokens = b.int("max_tokens", None, 1, 1 << 31)
    logprobs = b.bool("logprobs")
    top = b.int("top_logprobs", None, -1, MAX_LOGPROBS)
    if top not in (None, 0) and not logprobs:  # (0 asks for nothing: vLLM serves it)
        raise bad_request("'top_logprobs' requires 'logprobs': true", "top_logprobs")
    req = GenerationRequest(
        model=None,
        prompts=[],
        sampling=_sampling(b),
        max_tokens=max_tokens,
        stream=stream,
        include_usage=usage,
        use_beam_search=b.bool("use_beam_search"),
        logprobs=(top or 0) if logprobs else None,
        messages=[chat_message(i, m, refs) for i, m in enumerate(messages)],
        chat_template=b.str("chat_template"),
        chat_template_kwargs=template_kwargs(b.d.get("chat_template_kwargs")),
        add_generation_prompt=b.bool("add_generation_prompt", True),
        echo=b.bool("echo"),
        continue_final_message=b.bool("continue_final_message"),
        documents=chat_documents(b.d.get("documents")),
        add_special_tokens=False,
        media_refs=refs or [],
        mm_processor_kwargs=_object_or_none(b, "mm_processor_kwargs"),
    )
    try:
        req.num_frames = media_io_kwargs(b.d.get("media_io_kwargs"))
    except ValueError as e:
        raise bad_request(str(e), "media_io_kwargs") from None
    if req.continue_final_message and req.add_generation_prompt:
        raise bad_request(
            "'continue_final_message' and 'add_generation_prompt' cannot both be true: send "
            "'add_generation_prompt': false to continue the last message",
            "continue_final_message",
        )
    if req.continue_final_message and req.messages[-1]["role"] != "assistant":
        raise bad_request(
            "'continue_final_message' needs the last message to be the assistant's",
            "continue_final_message",
        )
    _common(b, req)
    req.include_reasoning = b.bool("include_reasoning", True)
    effort = b.str("reasoning_effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise bad_request(
            f"'reasoning_effort' must be one of {', '.join(map(repr, REASONING_EFFORTS))}, "
            f"got {effort!r}",
            "reasoning_effort",
        )
    req.reasoning_effort = effort
    _check_explicit_logprobs(req, "'logprobs': true")
    req.structured, req.structured_param = parse_structured(b.d)
    req.tools = parse_tools(b.d, tool_parser)
    forced = req.tools.constraint() if req.tools is not None else None
    if forced is not None:
        # A forced call's schema wins over a response_format json_schema, as in vLLM (that
        # format shapes a later free answer: the Agents SDK's output_type with tool_choice);
        # any other constraint beside a forced call is refused.
        rf_schema = req.structured_param == "response_format" and "json" in (req.structured or {})
        if req.structured is not None and not rf_schema:
            raise bad_request(
                f"'{req.structured_param}' cannot be combined with a forced 'tool_choice'",
                req.structured_param,
            )
        req.structured, req.structured_param = forced, "tools"
    check_schema_given(req.structured, req.structured_param)
    _check_beam_constraint(req)
    return req


def _check_explicit_logprobs(req: GenerationRequest, switch: str) -> None:
    """vLLM's `logprob_token_ids`: the logprobs of those ids in place of the top-k, which
    the logprobs switch still turns on; beam search has no per-token logprobs."""
    if "logprob_token_ids" not in req.sampling:
        return
    if req.logprobs is None:
        raise bad_request(f"'logprob_token_ids' requires {switch}", "logprob_token_ids")
    if req.use_beam_search:
        raise bad_request(
            "'logprob_token_ids' is not supported with 'use_beam_search'", "logprob_token_ids"
        )


def _check_beam_constraint(req: GenerationRequest) -> None:
    """The engine's beam search takes no structured-output constraint (SamplingParams refuses
    it as `structured_outputs`): name the field the client sent instead."""
    if not (req.use_beam_search and req.structured is not None):
        return
    param = "tool_choice" if req.structured_param == "tools" else req.structured_param
    raise bad_request(
        f"'{param}' (a structured-output constraint) is not supported with 'use_beam_search'",
        param,
    )


def check_context(
    prompt_len: int,
    max_tokens: int | None,
    max_model_len: int,
    prompt_param: str = "prompt",
    what: str = "prompt",
) -> int:
    """Resolve max_tokens against the context window; the message gives both lengths.
    `what`: the prompt the length counts ("encoder prompt" for a text encoder-decoder, whose
    usage.prompt_tokens counts its decoder prompt, as vLLM 0.10's did)."""
    if prompt_len >= max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"{what} has {prompt_len} tokens; it must be shorter than the context.",
            prompt_param,
        )
    if max_tokens is None:
        return max_model_len - prompt_len
    if prompt_len + max_tokens > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the {what}, "
            f"{max_tokens} in the completion). Please reduce the prompt or max_tokens.",
            "max_tokens",
        )
    return max_tokens


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")
