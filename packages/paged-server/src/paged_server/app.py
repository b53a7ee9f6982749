"""The OpenAI-compatible routes: validation -> engine requests -> JSON or SSE responses.

Every route runs on its connection's HTTP thread. A route that started engine requests aborts
them on any way out other than their completion (error, disconnect, failed write), so KV blocks
are never held for a client that is gone.

`tokenizer` is the HTTP side's own (never the engine's: the engine and output threads use that
one without a lock), shared by the HTTP threads under `tok_lock` (a text or id list past
`_LONG_TEXT` characters or ids goes to a second copy under a lock of its own: a huge prompt
holds up no other request's tokenization; chat templates render under neither lock). A prompt
is tokenized here once; the engine gets its ids with its text and does not tokenize it again.
"""

from __future__ import annotations

import copy
import hmac
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from paged_engine.chat_template import model_chat_template
from paged_engine.classification import ClassifierInfo
from paged_engine.pooling import check_truncation
from paged_server import __version__, answers
from paged_server.anthropic_api import (
    anthropic_errors,
    anthropic_model,
    anthropic_model_list,
    serve_count_tokens,
    serve_messages,
    wants_anthropic_errors,
)
from paged_server.classify import serve_classify
from paged_server.dev_routes import ROUTES as DEV_ROUTES
from paged_server.dev_routes import dev_routes
from paged_server.embeddings import serve_embeddings, text_tokens
from paged_server.engine_client import EngineClient
from paged_server.errors import APIError, bad_request
from paged_server.http import Handler
from paged_server.lora import LoRARegistry, serve_load_adapter, serve_unload_adapter
from paged_server.media import MediaLoader, MediaRef, decode_tensor
from paged_server.openai_protocol import (
    GenerationRequest,
    check_context,
    model_not_found,
    parse_chat,
    parse_completion,
)
from paged_server.openai_responses import (
    token_id_text,
)
from paged_server.profiling import profile_routes
from paged_server.reasoning import ReasoningRequest
from paged_server.request_group import RequestGroup
from paged_server.responses_api import (
    ResponseStore,
    serve_cancel_response,
    serve_create_response,
    serve_delete_response,
    serve_get_response,
    serve_input_items,
    serve_input_tokens,
)
from paged_server.scores import SCORE_SIDES, serve_rerank, serve_score
from paged_server.structured_request import check_structured
from paged_server.template_budget import (
    REQUEST_TEMPLATE_SECONDS,
    TemplateBudgetExceeded,
    TemplateOutputExceeded,
    bounded,
)
from paged_server.tool_parsers import TOOL_PARSERS
from paged_server.transcriptions import serve_speech

# characters (or ids): a longer job runs on a tokenizer copy of its own (App._sized_tokenizer)
_LONG_TEXT = 1 << 16
# characters a request's chat template may render: the default request body limit's worth
MAX_RENDERED_CHARS = 16 << 20
_MODEL_ROUTE = "/v1/models/"
_RESPONSE_ROUTE = "/v1/responses/"
_RESPONSE_SUBROUTES = ("", "input_items", "cancel")  # /v1/responses/{id}[/sub]: dispatch's keys
# Routes outside /v1 that run the model: --api-key guards them as it guards /v1.
_KEYED = frozenset({"/score", "/rerank", "/v2/rerank", "/classify", "/invocations", "/pooling"})


log = logging.getLogger("paged_server")


ALL_LOGPROBS = 1 << 30  # a top-k no vocabulary reaches: logprobs=-1 as the answers count it


class OpenAIApp:
    def __init__(
        self,
        client: EngineClient,
        tokenizer: Any,
        *,
        served_model_names: list[str],
        model_path: str,
        max_model_len: int,
        api_key: str | None = None,
        chat_template: str | None = None,
        trust_request_chat_template: bool = False,
        chat_template_content_format: str = "auto",
        default_template_kwargs: dict[str, Any] | None = None,
        exclude_tools_when_none: bool = False,
        engine_version: str | None = None,
        poll_interval: float = 0.25,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
        lora: LoRARegistry | None = None,
        runtime_lora_updates: bool = False,
        sampling_defaults: dict[str, Any] | None = None,
        prompt_tokens_details: bool = False,
        tokens_as_ids: bool = False,
        tokenizer_info: bool = False,
        response_role: str = "assistant",
        log_requests: int | None = None,
        log_outputs: int | None = None,
        classifier: ClassifierInfo | None = None,
        force_include_usage: bool = False,
        load_tracking: bool = False,
        images: Any = None,
        videos: Any = None,
        audios: Any = None,
        multimodal: Any = None,
        mm_limits: dict[str, int] | None = None,
        media: MediaLoader | None = None,
        mm_embeds: bool = False,
        prompt_embeds_width: int | None = None,
        max_logprobs: int = 20,
        encoder_decoder: bool = False,
        generates: bool = True,
    ):
        # vLLM's server flags: usage.prompt_tokens_details.cached_tokens; the default of the
        # return_tokens_as_token_ids field; the role of chat answers; log each request (its
        # prompt cut to this many characters / ids) when not None.
        self.prompt_tokens_details = prompt_tokens_details
        self.tokens_as_ids = tokens_as_ids
        self.response_role = response_role
        self.log_requests = log_requests
        self.log_outputs = log_outputs  # --enable-log-outputs: each answer, cut to this
        # The model's generation-config sampling defaults (SamplingParams keywords): a request
        # field left unset takes them; "max_tokens" caps every request (vLLM's behaviour).
        self.sampling_defaults = dict(sampling_defaults or {})
        self.tool_call_parser = tool_call_parser  # --tool-call-parser: tool_choice "auto"
        self.reasoning_parser = reasoning_parser  # --reasoning-parser: reasoning.py
        # A *ForSequenceClassification model's labels and activations (it serves /classify and,
        # with one label, cross-encoder /score and /rerank; no generation)
        self.classifier = classifier
        # False on a pooling-only engine (no "generate" task): /invocations then pools chats
        self.generates = generates
        self.force_include_usage = force_include_usage  # streams end with usage, always
        # vLLM's --enable-server-load-tracking: GET /load counts the POSTs being answered
        self.load_tracking = load_tracking
        self.server_load = 0
        self._load_lock = threading.Lock()
        # The engine's ImageProcessor when the model takes images (chat image parts: their
        # placeholders expanded here, so lengths and usage count the image tokens), else None;
        # `media` loads what the parts point at.
        self.images = images
        # a VIDEO_MODELS checkpoint's video processor (chat video parts), else None; `multimodal`
        # places a prompt's loaded images and videos (the engine's
        # InputProcessor.multimodal); `mm_limits`: --limit-mm-per-prompt
        self.videos = videos
        self.audios = audios  # the engine's AudioProcessor where the model takes audio, else None
        self.multimodal = multimodal
        self.mm_limits = mm_limits
        self.media = media or MediaLoader()
        self.mm_embeds = mm_embeds  # --enable-mm-embeds: `image_embeds` parts are taken
        # --enable-prompt-embeds: the token embedding's width (completions' prompt_embeds are
        # taken), else None
        self.prompt_embeds_width = prompt_embeds_width
        self.max_logprobs = max_logprobs  # the engine's (-1: the vocabulary)
        # a text encoder-decoder (BART, Florence-2): a completion's prompt is the encoder
        # prompt, the RequestOutput's prompt_token_ids the decoder prompt's
        self.encoder_decoder = encoder_decoder
        self.client = client
        self.tokenizer = tokenizer
        self.names = served_model_names
        # Adapters served beside the model (lora.py): a `model` naming one runs with it.
        self.lora = lora or LoRARegistry(served_model_names, enabled=False)
        self.model_path = model_path
        self.max_model_len = max_model_len
        if (metrics := getattr(client, "metrics", None)) is not None:  # token histograms' buckets
            metrics.set_max_model_len(max_model_len)
        self.api_key = api_key
        self.chat_template = chat_template
        self.trust_request_chat_template = trust_request_chat_template
        self.template_seconds = REQUEST_TEMPLATE_SECONDS  # a request template's render budget
        # --chat-template-content-format: "string" templates get media parts as placeholder
        # text (paged_engine/multimodal/chat_format.py); "auto" reads the template
        self.content_format = chat_template_content_format
        # --default-chat-template-kwargs: every chat render's variables, under the request's
        self.default_template_kwargs = dict(default_template_kwargs or {})
        # --exclude-tools-when-tool-choice-none: tool_choice "none" renders without the tools
        self.exclude_tools_when_none = exclude_tools_when_none
        self.engine_version = engine_version
        self.poll_interval = poll_interval
        self.vocab_size = len(tokenizer)
        self.created = int(time.time())
        self.tok_lock = threading.Lock()  # HF tokenizers are not guaranteed thread-safe
        self.long_tok_lock = threading.Lock()  # guards `_long_tokenizer` (made on first use)
        self._long_tokenizer: Any = None
        self.response_store = ResponseStore()  # /v1/responses with store: the newest finished
        self.routes: dict[str, dict[str, Callable[[Handler], None]]] = {
            "/health": {"GET": self.health},
            "/ping": {"GET": self.health, "POST": self.health},  # vLLM's (SageMaker's) probe
            "/version": {"GET": self.version},
            "/load": {"GET": self.load},
            "/metrics": {"GET": self.metrics},
            "/v1/models": {"GET": self.models},
            "/v1/completions": {"POST": self.completions},
            "/v1/chat/completions": {"POST": self.chat},
            "/v1/embeddings": {"POST": self.embeddings},
            # SageMaker's inference route (vLLM's): the API the body's fields name
            "/invocations": {"POST": self.invocations},
            "/classify": {"POST": self.classify},  # vLLM's classification API (classify.py)
            "/pooling": {"POST": self.pooling},  # vLLM's: the model's pooled output
            "/v1/classify": {"POST": self.classify},
            # vLLM's score / rerank APIs (scores.py), under each path vLLM serves them on
            "/score": {"POST": self.score},
            "/v1/score": {"POST": self.score},
            "/rerank": {"POST": self.rerank},
            "/v1/rerank": {"POST": self.rerank},
            "/v2/rerank": {"POST": self.rerank},
            "/v1/responses": {"POST": self.create_response},
            # Anthropic's Messages API (anthropic_api.py)
            "/v1/messages": {"POST": lambda h: serve_messages(self, h)},
            "/v1/messages/count_tokens": {"POST": lambda h: serve_count_tokens(self, h)},
            "/v1/responses/input_tokens": {"POST": lambda h: serve_input_tokens(self, h)},
            "/tokenize": {"POST": self.tokenize},
            "/detokenize": {"POST": self.detokenize},
            # OpenAI's speech-to-text (transcriptions.py): multipart uploads, audio models
            "/v1/audio/transcriptions": {"POST": lambda h: serve_speech(self, h, "transcribe")},
            "/v1/audio/translations": {"POST": lambda h: serve_speech(self, h, "translate")},
        }
        self.routes.update(profile_routes(client))  # with the profiler variable set
        self.routes.update(dev_routes(client))  # with PAGED_SERVER_DEV_MODE=1 (sleep mode)
        if tokenizer_info:  # --enable-tokenizer-info-endpoint (vLLM's; off: a 404)
            self.routes["/tokenizer_info"] = {"GET": self.tokenizer_info}
        if runtime_lora_updates:  # else these are unknown routes (404), as in vLLM
            self.routes["/v1/load_lora_adapter"] = {"POST": self.load_lora_adapter}
            self.routes["/v1/unload_lora_adapter"] = {"POST": self.unload_lora_adapter}

    # ---- routing ---------------------------------------------------------------------------
    def dispatch(self, h: Handler, method: str, path: str) -> None:
        route = path.rstrip("/") or "/"
        if wants_anthropic_errors(route, h.headers):
            with anthropic_errors():  # Anthropic's error shape, 401s and 404s included
                self._dispatch(h, method, path, route)
        else:
            self._dispatch(h, method, path, route)

    def _dispatch(self, h: Handler, method: str, path: str, route: str) -> None:
        if self.api_key is not None and (
            route.startswith("/v1") or route in _KEYED or route in DEV_ROUTES
        ):
            self._check_key(h)
        methods = self.routes.get(route)
        if methods is None and route.startswith(_MODEL_ROUTE):
            # OpenAI's "retrieve model"; a served name may hold "/" (an org/name hub id), sent
            # as it is or as %2F (http.py decoded the path once: decoding again would misread "%")
            name = route[len(_MODEL_ROUTE) :]
            methods = {"GET": lambda h: self.model(h, name)}
        if methods is None and route.startswith(_RESPONSE_ROUTE):
            rid, _, sub = route[len(_RESPONSE_ROUTE) :].partition("/")
            methods = {
                "": {
                    "GET": lambda h: serve_get_response(self, h, rid),
                    "DELETE": lambda h: serve_delete_response(self, h, rid),
                },
                "input_items": {"GET": lambda h: serve_input_items(self, h, rid)},
                "cancel": {"POST": lambda h: serve_cancel_response(self, h, rid)},
            }.get(sub)
        if methods is None:
            raise APIError(404, f"route {path} not found", code="not_found")
        if route != path:  # a trailing "/": Starlette's redirect_slashes, whatever the method
            h.redirect(route)
            return
        fn = methods.get("GET" if method == "HEAD" else method)
        if fn is None:
            allow = ", ".join(methods)
            raise APIError(
                405,
                f"method {method} not allowed on {route}; use {allow}",
                code="method_not_allowed",
                headers={"Allow": allow},
            )
        if not (self.load_tracking and method == "POST"):
            fn(h)
            return
        with self._load_lock:
            self.server_load += 1
        try:
            fn(h)  # a streamed answer is written inside: counted until its end
        finally:
            with self._load_lock:
                self.server_load -= 1

    def record(self, path: str, status: int) -> None:
        route = path.rstrip("/") or "/"
        if route in self.routes:
            pass
        elif route.startswith(_MODEL_ROUTE):
            route = _MODEL_ROUTE + "{model}"
        elif route.startswith(_RESPONSE_ROUTE):
            sub = route[len(_RESPONSE_ROUTE) :].partition("/")[2]
            # a label per route, not per path
            known = _RESPONSE_ROUTE + "{response_id}" + (f"/{sub}" if sub else "")
            route = known if sub in _RESPONSE_SUBROUTES else "other"
        else:
            route = "other"
        self.client.metrics.count_http(route, status)

    def _check_key(self, h: Handler) -> None:
        """`Authorization: Bearer KEY` (OpenAI's clients), or `x-api-key: KEY` (Anthropic's)."""
        auth = h.headers.get("Authorization", "")
        scheme, _, given = auth.partition(" ")
        if scheme.lower() != "bearer":
            given = h.headers.get("x-api-key", "")
        ok = bool(given) and hmac.compare_digest(given.strip().encode(), self.api_key.encode())
        if not ok:
            raise APIError(
                401,
                "invalid or missing API key",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    def _model(self, requested: str | None) -> str:
        return self._resolve(requested)[0]

    @staticmethod
    def base_request_id(h: Handler, default: str | None = None) -> str:
        """vLLM's `_base_request_id`: the X-Request-Id header when sent, else `default` (the
        body's `request_id`), else a random id. The response id is a prefix plus this; it need
        not be unique (each engine request gets an internal id of its own: engine_client.py).
        A 400 names a header that makes no id (ASCII only: headers arrive decoded as Latin-1)."""
        rid = h.headers.get("X-Request-Id") if h.headers is not None else None
        if not rid:  # absent or empty (as a proxy may send it): not the client's choice
            return default or uuid.uuid4().hex
        if not (len(rid) <= 128 and rid.isascii() and rid.isprintable()):
            raise bad_request(
                "the 'X-Request-Id' header must be at most 128 printable ASCII characters",
                "X-Request-Id",
            )
        return rid

    def _resolve(self, requested: str | None) -> tuple[str, Any]:
        """(the name responses echo, the adapter's LoRARequest or None for the base model)."""
        if requested is not None and not isinstance(requested, str):
            raise bad_request(f"'model' must be a string, got {type(requested).__name__}", "model")
        if requested is None or requested in self.names:
            return requested or self.names[0], None
        lora = self.lora.get(requested)
        if lora is None:
            raise model_not_found(requested)
        return requested, lora

    # ---- simple routes ---------------------------------------------------------------------
    def health(self, h: Handler) -> None:
        if not self.client.alive:
            raise APIError(503, self.client.failure or "the engine loop is not running")
        h.send_json(200, {"status": "ok"})

    def load(self, h: Handler) -> None:
        h.send_json(200, {"server_load": self.server_load})

    def version(self, h: Handler) -> None:
        h.send_json(200, {"version": __version__, "engine_version": self.engine_version})

    def metrics(self, h: Handler) -> None:
        accept = h.headers.get("Accept", "")
        body, ctype = self.client.metrics.exposition(self.client.stats, accept)
        h.send_bytes(200, body, ctype)

    def _card(self, name: str, lora: Any = None) -> dict[str, Any]:
        """A served name's card, or an adapter's: root its path, parent its base model."""
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "paged",
            "root": self.model_path if lora is None else lora.lora_path,
            "parent": None if lora is None else self.lora.parent(lora),
            "max_model_len": self.max_model_len,
        }

    def models(self, h: Handler) -> None:
        cards = [self._card(n) for n in self.names]
        cards += [self._card(a.lora_name, a) for a in self.lora.adapters()]
        if h.headers.get("anthropic-version") is not None:  # an Anthropic SDK asks
            with anthropic_errors():
                h.send_json(200, anthropic_model_list(h, cards))
            return
        h.send_json(200, {"object": "list", "data": cards})

    def model(self, h: Handler, name: str) -> None:
        if h.headers.get("anthropic-version") is not None:
            with anthropic_errors():
                _, lora = self._resolve(name)
                h.send_json(200, anthropic_model(self._card(name, lora)))
            return
        _, lora = self._resolve(name)
        h.send_json(200, self._card(name, lora))

    # ---- runtime LoRA updates (lora.py) ----------------------------------------------------
    def load_lora_adapter(self, h: Handler) -> None:
        serve_load_adapter(self, h)

    def unload_lora_adapter(self, h: Handler) -> None:
        serve_unload_adapter(self, h)

    @property
    def takes_media(self) -> bool:
        """Whether chat image / video / audio parts are taken at all (else they are a 400
        naming the server as text-only)."""
        return self.images is not None or self.videos is not None or self.audios is not None

    def tokenize(self, h: Handler) -> None:
        body = h.read_json()
        if not isinstance(body, dict):
            raise bad_request("request body must be a JSON object")
        self._model(body.get("model"))
        special = body.get("add_special_tokens")
        if special is not None and not isinstance(special, bool):
            raise bad_request("'add_special_tokens' must be a boolean", "add_special_tokens")
        strs = body.get("return_token_strs", False)
        if not isinstance(strs, bool | None):
            raise bad_request("'return_token_strs' must be a boolean", "return_token_strs")
        if "messages" in body:
            own = ("add_special_tokens", "return_token_strs")  # /tokenize's, not chat's
            chat = {k: v for k, v in body.items() if k not in own}
            # the tools render as a chat request's would (its tool_choice checks included)
            req = parse_chat(chat, self.tool_call_parser, self.takes_media)
            ids = self._expand_media(req, self._chat_ids(req, bool(special))[1])
        elif isinstance(body.get("prompt"), str):
            ids = self._encode(body["prompt"], True if special is None else special)
        else:
            raise bad_request("'prompt' (a string) or 'messages' is required", "prompt")
        token_strs = None
        if strs:  # vLLM's: each id's vocabulary entry (byte-level pieces, as the tokenizer has it)
            with self._sized_tokenizer(len(ids)) as tok:
                token_strs = list(tok.convert_ids_to_tokens(ids))
        h.send_json(
            200,
            {
                "count": len(ids),
                "max_model_len": self.max_model_len,
                "tokens": ids,
                "token_strs": token_strs,
            },
        )

    def tokenizer_info(self, h: Handler) -> None:
        """vLLM's `GET /tokenizer_info`: the tokenizer's settings (its init kwargs, file paths
        left out, special tokens as their text), its class and the chat template in effect."""
        with self.tok_lock:
            settings = dict(getattr(self.tokenizer, "init_kwargs", None) or {})
            template = self.chat_template or getattr(self.tokenizer, "chat_template", None)
        for path in ("vocab_file", "merges_file", "tokenizer_file", "name_or_path"):
            settings.pop(path, None)
        info = _json_safe(settings)
        info["tokenizer_class"] = type(self.tokenizer).__name__
        if template:
            info["chat_template"] = template
        h.send_json(200, info)

    def detokenize(self, h: Handler) -> None:
        body = h.read_json()
        if not isinstance(body, dict):
            raise bad_request("request body must be a JSON object")
        self._model(body.get("model"))
        ids = body.get("tokens")
        if not isinstance(ids, list):
            raise bad_request("'tokens' must be a list of token ids", "tokens")
        self._check_ids(ids, "tokens")
        with self._sized_tokenizer(len(ids)) as tok:
            text = tok.decode(ids)
        h.send_json(200, {"prompt": text})

    # ---- tokenizer helpers -----------------------------------------------------------------
    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """`text`'s ids (a 15 MB prompt encodes for ~20 s: `_sized_tokenizer`)."""
        with self._sized_tokenizer(len(text)) as tok:
            return list(tok.encode(text, add_special_tokens=add_special_tokens))

    @contextmanager
    def _sized_tokenizer(self, size: int) -> Iterator[Any]:
        """The tokenizer for a job of `size` characters or ids: the shared one under `tok_lock`,
        or past _LONG_TEXT a copy under a lock of its own (made on first use), so a huge job
        (an 8M-id /detokenize takes seconds too) holds up only other huge ones, never every
        request's tokenization."""
        if size <= _LONG_TEXT:
            with self.tok_lock:
                yield self.tokenizer
            return
        with self.long_tok_lock:
            if self._long_tokenizer is None:
                with self.tok_lock:
                    self._long_tokenizer = copy.deepcopy(self.tokenizer)
            yield self._long_tokenizer

    def _decode_one(self, tid: int) -> str:
        with self.tok_lock:
            return self.tokenizer.decode([tid])

    def _decoder(self, req: GenerationRequest) -> Callable[[int], str]:
        """How logprob entries show a token: its text, or "token_id:{id}" when asked (by the
        request, or by --return-tokens-as-token-ids for every request)."""
        return token_id_text if req.tokens_as_ids or self.tokens_as_ids else self._decode_one

    def _cached(self, group: RequestGroup) -> int | None:
        """Prompt tokens the prefix cache served (None unless --enable-prompt-tokens-details)."""
        if not self.prompt_tokens_details:
            return None
        return sum(getattr(out, "num_cached_tokens", 0) or 0 for out in group.latest)

    def _check_ids(self, ids: list, param: str) -> None:
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise bad_request(f"token id {t!r} is not in [0, {self.vocab_size})", param)

    def _chat_ids(self, req: GenerationRequest, special: bool) -> tuple[str, list[int]]:
        """A chat request's prompt text and ids: the template's text encoded, or, for a
        tekken.json tokenizer without a template (vLLM's tokenizer_mode="mistral"), the ids
        mistral_common would build (paged_engine/mistral_chat.py) and their text."""
        mistral = getattr(self.tokenizer, "mistral_chat", None)
        asked = req.chat_template or req.chat_template_kwargs.get("chat_template")
        if mistral is None or asked is not None or self.chat_template is not None:
            text = self._render_chat(req)
            return text, self._encode(text, special)
        # chat_template_kwargs (also Anthropic's `thinking`, --default-chat-template-kwargs) are
        # template variables: no template reads them here, as in vLLM's mistral mode
        if req.documents:
            raise bad_request("'documents' is not taken by a Mistral chat", "documents")
        tools = req.tools.tools if req.tools is not None else None
        if self.exclude_tools_when_none and req.tools is not None and req.tools.choice == "none":
            tools = None
        try:
            with self.tok_lock:
                ids = mistral.render(
                    req.messages,
                    tools,
                    add_generation_prompt=req.add_generation_prompt,
                    continue_final_message=req.continue_final_message,
                )
                return self.tokenizer.decode(ids), ids
        except (ValueError, TypeError, RecursionError) as e:
            raise bad_request(f"could not build the Mistral chat: {e}", "messages") from None

    def _render_chat(self, req: GenerationRequest) -> str:
        """The conversation through the chat template. A template sent by the client is code
        it chose: refused unless the server trusts request templates (vLLM's rule); either way
        transformers renders it in Jinja's sandbox, and a request's template within a time
        budget and an output bound (template_budget.py). The request's chat_template_kwargs
        take the server's defaults first (what the reasoning split reads afterwards sees them
        too). No render holds `tok_lock`: it reads the tokenizer's special tokens only, and a
        slow one must not hold up every other request's tokenization."""
        if self.default_template_kwargs:
            req.chat_template_kwargs = {**self.default_template_kwargs, **req.chat_template_kwargs}
        variables = dict(req.chat_template_kwargs)
        request_template = req.chat_template
        if variables.get("chat_template") is not None:
            request_template = request_template or variables["chat_template"]
        variables.pop("chat_template", None)
        param = "chat_template" if req.chat_template is not None else "chat_template_kwargs"
        if request_template is not None and not self.trust_request_chat_template:
            raise bad_request(
                "a chat template was sent with the request, but this server renders only its "
                "own (start it with --trust-request-chat-template to allow request templates)",
                param,
            )
        shown = req.tools is not None and not (
            self.exclude_tools_when_none and req.tools.choice == "none"
        )
        template = request_template or self.chat_template
        if template is None:  # the model's; of named ones, "tool_use" with tools, else "default"
            try:
                template = model_chat_template(self.tokenizer, req.tools.tools if shown else None)
            except ValueError as e:  # named templates, none of them fitting
                raise bad_request(str(e), "messages") from None
        if template is None:  # vLLM's per-model fallback (CLIP / SigLIP: each content in turn)
            from paged_engine.multimodal.chat_format import fallback_template

            template = fallback_template(self.images)
        if template is None:
            raise bad_request("this model has no chat template", "messages")
        if shown:  # the template shows the model its tools
            variables["tools"] = req.tools.tools
        if req.documents is not None:
            variables["documents"] = req.documents
        if req.reasoning_effort is not None:  # gpt-oss's template reads it
            variables["reasoning_effort"] = req.reasoning_effort
            # vLLM: an effort also flips the thinking switch (Qwen3's, Gemma 4's), "none" off,
            # unless chat_template_kwargs set it
            variables.setdefault("enable_thinking", req.reasoning_effort != "none")

        def render() -> str:  # (the content format compiles the template: inside the budget)
            return self.tokenizer.apply_chat_template(
                self._content_format(req.messages, template),
                chat_template=template,
                tokenize=False,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                **variables,
            )

        try:
            if request_template is None:
                return render()
            text = bounded(render, self.template_seconds, MAX_RENDERED_CHARS)
            size = len(text)
        except TemplateOutputExceeded as e:  # stopped as it passed the bound, never held whole
            text, size = "", e.chars
        except TemplateBudgetExceeded:
            raise bad_request(
                f"the request's chat template did not render within {self.template_seconds:g} "
                "seconds",
                param,
            ) from None
        except Exception as e:  # template errors are the request's (or the template's) fault
            raise bad_request(f"could not apply the chat template: {e}", "messages") from None
        if size > MAX_RENDERED_CHARS:  # (its tokenization would take minutes)
            raise bad_request(
                f"the request's chat template rendered {size} characters, over "
                f"{MAX_RENDERED_CHARS} (the request body limit's worth of prompt)",
                param,
            )
        return text

    def _content_format(self, messages: list[dict], template: Any) -> list[dict]:
        """The messages in the content format the template takes (vLLM's rule): as parsed
        (text parts joined, media parts a list), or each one string with its media written as
        the model's placeholder text where the format is (or "auto" finds) "string"."""
        from paged_engine.multimodal.chat_format import (
            media_placeholders,
            resolve_content_format,
            string_content,
        )

        if self.content_format == "openai":
            return messages
        if resolve_content_format(self.content_format, template) != "string":
            return messages
        with self.tok_lock:
            marks = media_placeholders(self.tokenizer, self.images, self.videos, self.audios)
        return string_content(messages, marks)

    def invocations(self, h: Handler) -> None:
        """SageMaker's `POST /invocations`: the body is one of the other APIs', told by its
        fields (vLLM's order of the engine's tasks): `messages` chat, or on a pooling-only
        engine the chat form of classify (a classifier) or embeddings; `prompt` completions;
        `query` + `documents` rerank; score's sides score; `input` classify or embeddings."""
        body = h.read_json()  # the route chosen reads it again (Handler caches it)
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        pool = self.classify if self.classifier is not None else self.embeddings
        if "messages" in body:
            route = self.chat if self.generates else pool
        elif "prompt" in body:
            route = self.completions
        elif "query" in body and "documents" in body:
            route = self.rerank
        elif any(a in body and b in body for a, b in SCORE_SIDES):
            route = self.score
        elif "input" in body:
            route = pool
        else:
            raise bad_request(
                "/invocations takes a chat ('messages'), completion ('prompt'), embedding or "
                "classification ('input'), score or rerank ('query' and 'documents') body"
            )
        route(h)

    def embeddings(self, h: Handler) -> None:
        serve_embeddings(self, h)  # embeddings.py

    def pooling(self, h: Handler) -> None:
        serve_embeddings(self, h, "/pooling")  # embeddings.py: the model's pooled output

    def classify(self, h: Handler) -> None:
        serve_classify(self, h)  # classify.py: a classifier's label probabilities

    def score(self, h: Handler) -> None:
        serve_score(self, h)  # scores.py: embeddings' cosine, or a cross-encoder's score

    def rerank(self, h: Handler) -> None:
        serve_rerank(self, h)  # scores.py: documents by their score against a query

    def create_response(self, h: Handler) -> None:
        serve_create_response(self, h)  # responses_api.py: OpenAI's Responses API

    # ---- generation ------------------------------------------------------------------------
    def completions(self, h: Handler) -> None:
        req = parse_completion(h.read_json())
        model, lora = self._resolve(req.model)
        texts: list[str | None] = []
        ids: list[list[int] | None] = []
        if req.prompt_embeds:  # first, as in vLLM; no ids
            req.prompt_embeds = self._decode_prompt_embeds(req.prompt_embeds)
            texts, ids = [None] * len(req.prompt_embeds), [None] * len(req.prompt_embeds)
        for p in req.prompts:
            if isinstance(p, str):  # cut by the tokenizer (its BOS stays), as in vLLM
                one, cut = text_tokens(
                    self, p, req.truncate_prompt_tokens, req.add_special_tokens, generate=True
                )
                texts.append(None if cut else p)  # (None: re-derived from the ids)
                ids.append(one)
            else:
                self._check_ids(p, "prompt")
                texts.append(None)
                ids.append(p)
        self._generate(h, req, model, texts, ids, chat=False, lora=lora)

    def _check_logprobs(self, req: GenerationRequest, chat: bool) -> None:
        """A 400 naming the field for more logprobs than --max-logprobs allows (-1 asks for
        the vocabulary, which only --max-logprobs -1 allows)."""
        cap = self.max_logprobs
        explicit = req.sampling.get("logprob_token_ids")
        fields = (("top_logprobs" if chat else "logprobs", req.logprobs),)
        if explicit is not None:
            # As in vLLM, --max-logprobs does not bound the ids (SamplingParams does, with
            # MAX_LOGPROB_TOKEN_IDS), and the logprobs count is not sent beside them: it only
            # counts as an echoed prompt's prompt_logprobs
            self._check_ids(explicit, "logprob_token_ids")
            fields = fields if req.echo and not chat else ()
        for name, k in (*fields, ("prompt_logprobs", req.prompt_logprobs)):
            if k is None or cap == -1 or (k != -1 and k <= cap):
                continue
            asked = "every token (-1)" if k == -1 else k
            raise bad_request(
                f"'{name}' asks for {asked} logprobs, over this server's --max-logprobs {cap} "
                "(vLLM's limit; -1 allows the vocabulary)",
                name,
            )

    def _decode_prompt_embeds(self, values: list[str]) -> list[Any]:
        """completions' prompt_embeds as tensors: only with --enable-prompt-embeds, each at
        most max_model_len rows of the embedding's width before it is expanded (the engine
        checks the rest: shape, dtype, finite values)."""
        width = self.prompt_embeds_width
        if width is None:
            raise bad_request(
                "'prompt_embeds' is off: start paged-server with --enable-prompt-embeds "
                "(vLLM's flag; for trusted clients)",
                "prompt_embeds",
            )
        cap = self.max_model_len * width
        tensors = [decode_tensor(f"prompt_embeds[{i}]", v, cap) for i, v in enumerate(values)]
        return [t[0] if t.dim() == 3 and t.shape[0] == 1 else t for t in tensors]  # HF's [1, L, D]

    def _truncate(
        self, req: GenerationRequest, texts: list[str | None], ids: list[list[int] | None]
    ) -> None:
        """truncate_prompt_tokens (vLLM): keep each prompt's last k tokens (from the left, so
        the end of the prompt, next to what is generated, stays); a cut prompt's text is
        re-derived from its ids. Prompt embeddings keep their last k rows."""
        k = req.truncate_prompt_tokens
        if k is None:
            return
        try:
            check_truncation(k, self.max_model_len)
        except ValueError as e:
            raise bad_request(str(e), "truncate_prompt_tokens") from None
        req.prompt_embeds = [t[-k:] for t in req.prompt_embeds]
        for i, t in enumerate(ids):
            if t is not None and len(t) > k:
                ids[i], texts[i] = t[-k:], None

    def chat(self, h: Handler) -> None:
        req = parse_chat(h.read_json(), self.tool_call_parser, self.takes_media)
        model, lora = self._resolve(req.model)
        text, ids, reasoning = self._chat_prompt(req)
        self._generate(h, req, model, [text], [ids], chat=True, reasoning=reasoning, lora=lora)

    def _chat_prompt(
        self, req: GenerationRequest
    ) -> tuple[str, list[int], ReasoningRequest | None]:
        """A chat request's rendered prompt, its ids (each image's placeholder run expanded)
        and its reasoning handling (chat completions and the Responses API)."""
        text, ids = self._chat_ids(req, req.add_special_tokens)  # default off: BOS is in it
        ids = self._expand_media(req, ids)
        auto = req.tools is not None and req.tools.choice == "auto"
        parser = TOOL_PARSERS.get(self.tool_call_parser or "") if auto else None
        if parser is not None and parser.keeps_special_tokens:
            req.sampling.setdefault("skip_special_tokens", False)  # the call marker is one
        reasoning = None
        # A constrained output (structured outputs, forced tool calls) is the answer from its
        # first token: it holds no reasoning.
        if self.reasoning_parser is not None and req.structured is None:
            markup = parser is not None and parser.reads_harmony
            reasoning = ReasoningRequest(
                self.reasoning_parser, req.include_reasoning, markup, req.chat_template_kwargs
            )
            if reasoning.keeps_special_tokens:  # Harmony's markers
                req.sampling.setdefault("skip_special_tokens", False)
        return text, ids, reasoning

    def _expand_media(self, req: GenerationRequest, ids: list[int]) -> list[int]:
        """The prompt with each image's (and video's) placeholder as the run of tokens the
        engine fills with its features; a 400 for more than --limit-mm-per-prompt, a kind the
        model does not take, or a rendered prompt without one placeholder per part. Where every
        image takes the same run (LLaVA) only the images' count is needed: nothing is fetched
        yet. Where an image's size decides its run (LLaVA-NeXT), and for videos, the media are
        loaded and processed here."""
        n = len(req.media_refs)
        if not n:
            return ids
        self._check_media_kinds(req.media_refs)
        embeds = [r for r in req.media_refs if r.embeds is not None]
        if embeds and not self.mm_embeds:
            raise bad_request(
                f"{embeds[0].param}: image embeddings input is off: start paged-server with "
                "--enable-mm-embeds (vLLM's flag; for trusted clients)",
                embeds[0].param,
            )
        image_refs = [r for r in req.media_refs if r.kind == "image"]
        if embeds and len(embeds) != len(image_refs):
            param = next(r.param for r in image_refs if r.embeds is None)
            raise bad_request(
                f"{param}: a request gives its images either as image_url or as image_embeds "
                "parts, not both",
                param,
            )
        plain = image_refs and len(image_refs) == n and not embeds
        if plain and self.images.layout.marker == self.images.image_token_id:
            each = self.images.tokens_per_image
            try:
                expanded = self.images.expand(ids, [each or 1] * n)
            except ValueError as e:  # the template dropped an image, or the text holds its token
                raise bad_request(
                    f"the chat template's prompt does not hold one image placeholder per image "
                    f"part: {e}",
                    "messages",
                ) from None
            if each is not None:
                return expanded
        # videos, features, Gemma 3's <start_of_image> (the image's text), runs sized by the
        # image: processed now
        expanded, req.processed_media = self._process_media(req, ids)
        return expanded

    def _check_media_kinds(self, refs: list[MediaRef]) -> None:
        """A 400 naming the first part of a kind this model does not take, or the prompt's
        parts over --limit-mm-per-prompt."""
        for kind, side in (("image", self.images), ("video", self.videos), ("audio", self.audios)):
            mine = [r for r in refs if r.kind == kind]
            if mine and side is None:
                from paged_engine.multimodal.archs import VIDEO_MODELS  # (torch: on errors only)

                why = (
                    "--limit-mm-per-prompt gives it 0"
                    if (self.mm_limits or {}).get(kind) == 0
                    else f"videos run on {VIDEO_MODELS} checkpoints"
                    if kind == "video"
                    else f"audio runs on {_audio_archs()} checkpoints"
                    if kind == "audio"
                    else "the server takes no images"
                )
                noun = kind if kind == "audio" else f"{kind}s"
                raise bad_request(
                    f"{mine[0].param}: this model takes no {noun} ({why})", mine[0].param
                )
            limit = side.limit if side is not None else None
            if limit is not None and len(mine) > limit:
                raise bad_request(
                    f"the messages hold {len(mine)} {kind}s, over this server's limit of "
                    f"{limit} per prompt (--limit-mm-per-prompt '{{\"{kind}\": {limit}}}')",
                    "messages",
                )

    def _process_media(
        self, req: GenerationRequest, ids: list[int]
    ) -> tuple[list[int], dict[str, list]]:
        """Fetch, decode and process a chat request's images and videos on this (the
        request's) thread: (the ids with each one's run, the multi_modal_data of processed
        items the engine only checks); a 400 naming what cannot be read."""
        images: Any = self.media.load_all([r for r in req.media_refs if r.kind == "image"])
        if images and all(isinstance(m, dict) for m in images):  # Qwen2-VL's: one dict
            images = _qwen_embeds(images)
        video_refs = [r for r in req.media_refs if r.kind == "video"]
        clips = self.media.load_all([r for r in req.media_refs if r.kind == "audio"])
        if (req.mm_processor_kwargs or {}).get("use_audio_in_video") is True and video_refs:
            # Qwen-Omni: each video's own soundtrack, in video order (the engine pairs them)
            pairs = [self.media.load_with_soundtrack(r, req.num_frames) for r in video_refs]
            videos, clips = [v for v, _ in pairs], clips + [a for _, a in pairs]
        else:
            videos = self.media.load_all(video_refs, req.num_frames)
        mm = {k: v for k, v in (("image", images), ("video", videos), ("audio", clips)) if len(v)}
        try:
            expanded, items = self.multimodal(ids, mm, req.mm_processor_kwargs)
        except ValueError as e:  # an image the processor cannot read, a bad kwarg
            param = "mm_processor_kwargs" if "mm_processor_kwargs" in str(e) else "messages"
            raise bad_request(str(e), param) from None
        video_id = self.videos.video_token_id if video_refs else None
        kinds: dict[str, list] = {"image": [], "video": [], "audio": []}
        for m in items:
            kind = "audio" if m.modality == "audio" else "image"
            kinds["video" if expanded[m.offset] == video_id else kind].append(m)
        return expanded, {k: v for k, v in kinds.items() if v}

    def _generate(
        self,
        h: Handler,
        req: GenerationRequest,
        model: str,
        texts: list[str | None],
        ids: list[list[int] | None],
        chat: bool,
        reasoning: ReasoningRequest | None = None,
        lora: Any = None,
    ) -> None:
        """`texts[i]` is prompt i as the client wrote it (None for token ids), `ids[i]` its ids;
        `lora` the adapter `model` named (every prompt runs with it)."""
        if self.force_include_usage and req.stream:
            req.include_usage = True  # vLLM's --enable-force-include-usage
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{self.base_request_id(h, req.request_id)}"
        scoring_stream = req.stream and req.max_tokens == 0  # answered whole, then as one event
        group, rids = self._submit(
            req, texts, ids, rid, chat=chat, lora=lora, stream=req.stream and not scoring_stream
        )
        with self._in_flight(h, group, rids, req.structured_param):
            if req.stream and not scoring_stream:
                answers.stream(self, h, req, model, rid, group, texts, ids, chat, reasoning)
            else:
                self._wait(h, group)
                body = answers.final_body(
                    self, h, req, model, rid, group, texts, ids, chat, reasoning
                )
                if scoring_stream:
                    answers.stream_final(h, req, body)
                else:
                    h.send_json(200, body)

    def _submit(
        self,
        req: GenerationRequest,
        texts: list[str | None],
        ids: list[list[int] | None],
        rid: str,
        *,
        chat: bool,
        lora: Any,
        stream: bool,
    ) -> tuple[RequestGroup, list[str]]:
        """Check the prompts against the context, build the SamplingParams (DELTA outputs for
        a stream), load a chat request's images and hand one engine request per prompt
        (`rid-i`) to the engine loop."""
        k = req.truncate_prompt_tokens
        if req.media_refs and k is not None and any(len(i) > k for i in ids):
            raise bad_request(
                "'truncate_prompt_tokens' would cut a prompt with images (an image's tokens "
                "are kept whole): send a shorter conversation or no truncation",
                "truncate_prompt_tokens",
            )
        if self.encoder_decoder and req.echo and not chat:
            raise bad_request(
                "'echo' is not supported for encoder-decoder models: the prompt is the "
                "encoder's, while the tokens and logprobs echoed would be the decoder prompt's",
                "echo",
            )
        self._check_logprobs(req, chat)
        self._truncate(req, texts, ids)
        param = "messages" if chat else "prompt"
        what = "encoder prompt" if self.encoder_decoder else "prompt"  # (what the ids are)
        max_tokens = min(
            check_context(n, req.max_tokens, self.max_model_len, param, what)
            for n in answers.prompt_lengths(req, ids)
        )
        self.client.check_queue()
        defaults = self.sampling_defaults
        cap = defaults.get("max_tokens")
        if cap is not None and max_tokens > cap:
            max_tokens = cap
        if req.use_beam_search:  # beams sample nothing: only the length cap applies
            defaults = {}
        kwargs = {**defaults, **req.sampling, "max_tokens": max_tokens}
        if max_tokens == 0:
            # Prompt scoring (echo only): the engine runs the prompt and samples one token,
            # which is dropped (its prompt logprobs survive a request that ends at prefill).
            kwargs.update(max_tokens=1, min_tokens=0)
        if req.logprobs is not None:
            if "logprob_token_ids" not in req.sampling:  # (vLLM: the ids set the count)
                kwargs["logprobs"] = req.logprobs
            if req.echo and not chat:  # an echoed prompt's tokens lead the logprobs
                kwargs["prompt_logprobs"] = req.logprobs
        if req.prompt_logprobs is not None:
            wanted = (req.prompt_logprobs, kwargs.get("prompt_logprobs", 0))
            kwargs["prompt_logprobs"] = -1 if -1 in wanted else max(wanted)  # -1: every token
        if req.structured is not None:
            kwargs["structured_outputs"] = req.structured
        beam = req.use_beam_search and max_tokens > 0
        try:
            params = self.client.make_params(kwargs, beam=beam, stream=stream)
        except APIError as e:  # the constraint's shape: name the field the client sent
            if e.param == "structured_outputs" and req.structured_param is not None:
                e.param = req.structured_param
            raise
        # -1 (every token, as the engine took it), or explicit ids (the sampled token and each
        # of them): the answers keep whatever came back
        if req.logprobs == -1 or params.logprob_token_ids:
            req.logprobs = ALL_LOGPROBS
        if req.prompt_logprobs == -1:
            req.prompt_logprobs = ALL_LOGPROBS
        if req.structured is not None:
            check_structured(params, req.structured_param)
        rids = [f"{rid}-{i}" for i in range(len(ids))]
        if self.log_requests is not None:
            self._log_request(rids, texts, ids, params)
        prompts: list[dict[str, Any]] = [{"prompt_embeds": e} for e in req.prompt_embeds]
        prompts += [
            {"prompt_token_ids": i} if t is None else {"prompt": t, "prompt_token_ids": i}
            for t, i in zip(texts[len(prompts) :], ids[len(prompts) :])
        ]
        if req.cache_salt is not None:
            for p in prompts:
                p["cache_salt"] = req.cache_salt
        if req.media_refs:  # one chat prompt; its media fetched, decoded and processed on
            (prompt,) = prompts  # this thread: the engine's thread only checks them
            processed = req.processed_media
            if processed is None:
                _, processed = self._process_media(req, prompt["prompt_token_ids"])
            prompt["multi_modal_data"] = processed
        group = self.client.add(rids, prompts, params, lora, req.priority)
        group.log_outputs = self.log_outputs  # read where the outputs arrive, on this thread
        return group, rids

    def _log_request(
        self, rids: list[str], texts: list[str | None], ids: list[list[int] | None], params: Any
    ) -> None:
        """--enable-log-requests: one INFO line per engine request, its prompt cut short."""
        cut = self.log_requests
        for rid, text, tids in zip(rids, texts, ids):
            if tids is None:
                log.info("request %s: prompt_embeds, params %s", rid, params)
                continue
            shown = text[:cut] if text is not None else tids[:cut]
            log.info(
                "request %s: %d prompt tokens, prompt %r, params %s", rid, len(tids), shown, params
            )

    @contextmanager
    def _in_flight(
        self, h: Handler, group: RequestGroup, rids: list[str], structured_param: str | None = None
    ) -> Iterator[None]:
        """Wait until the engine took the group (its refusal becomes an HTTP error before a
        stream's headers go out: `_await_added`), then run the body; every way out but the
        group's completion aborts its requests."""
        try:
            self._await_added(h, group, structured_param)
            yield
        finally:
            if not group.done:
                self.client.abort(rids, group)
                if group.add_error is None:  # a refusal (a 4xx) took nothing to abort
                    h.log_extra += " aborted"

    def _await_added(
        self, h: Handler, group: RequestGroup, structured_param: str | None = None
    ) -> None:
        """Until the engine took (or refused: raised here) every member of `group`;
        ConnectionResetError when the client left meanwhile. A refusal of the constraint (e.g.
        a special token the tokenizer lacks) names `structured_param`, the field the client
        used, in `param` and in the message (an Anthropic error has only the message)."""
        try:
            while not group.wait_added(self.poll_interval):
                if h.client_gone():
                    raise ConnectionResetError("client disconnected")
        except APIError as e:
            if e.param == "structured_outputs" and structured_param is not None:
                e.param = structured_param
                e.message = f"'{structured_param}': {e.message}"
            raise

    def arrivals(self, h: Handler, group: RequestGroup) -> Iterator[list]:
        """Each batch of (prompt index, output) pairs as it arrives until the group is done;
        ConnectionResetError when the client left while nothing arrived."""
        while not group.done:
            arrived = group.next(self.poll_interval)
            if arrived:
                yield arrived
            elif h.client_gone():
                raise ConnectionResetError("client disconnected")

    def _wait(self, h: Handler, group: RequestGroup) -> None:
        next_check = time.monotonic() + self.poll_interval
        while not group.done:
            group.next(self.poll_interval)
            if time.monotonic() >= next_check:
                if h.client_gone():
                    raise ConnectionResetError("client disconnected")
                next_check = time.monotonic() + self.poll_interval

    def _echo(self, req: GenerationRequest, text: str | None, ids: list[int], chat: bool) -> str:
        """What `echo` puts before the answer: the prompt (completions), or the last message
        when it is the assistant's (chat, as vLLM does: the answer continues it)."""
        if not chat:
            return self._prompt_text(text, ids)
        last = req.messages[-1]
        return last["content"] if last["role"] == "assistant" else ""

    def _prompt_text(self, text: str | None, prompt_ids: list[int]) -> str:
        if text is not None:
            return text
        with self.tok_lock:
            return self.tokenizer.decode(prompt_ids)


def _json_safe(value: Any) -> Any:
    """`value` as JSON holds it: a special token (AddedToken) as its text, other objects as
    their str."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    content = getattr(value, "content", None)
    return content if isinstance(content, str) else str(value)


def _qwen_embeds(parts: list[dict]) -> dict | list:
    """Qwen2-VL `image_embeds` parts (each {"image_embeds": rows, "image_grid_thw": grid})
    as the one dict the engine takes: every part's rows, then every part's grid. Parts
    without a grid are each one image's rows (the engine asks Qwen2-VL for its grids)."""
    import torch

    rows = [p["image_embeds"] for p in parts]
    grids = [p.get("image_grid_thw") for p in parts]
    if any(g is None for g in grids):
        return rows
    try:
        grid = torch.cat([g.reshape(-1, 3) for g in grids])
        return {"image_embeds": torch.cat(rows), "image_grid_thw": grid}
    except (RuntimeError, TypeError) as e:  # rows of other widths, grids of other shapes
        raise bad_request(
            f"the messages' image_embeds do not fit together: {e}", "messages"
        ) from None


def _audio_archs() -> str:
    """The architectures whose audio runs, for a refusal's message (torch: on errors only)."""
    from paged_engine.multimodal.audio_archs import AUDIO_ARCHS

    return ", ".join(AUDIO_ARCHS)
