"""`LLM`: the offline API, named and shaped like vLLM's so code ports by changing the import.

llm = LLM(model="path/or/hub-id-or.gguf")
for out in llm.generate(["Hello, my name is"], SamplingParams(temperature=0.8)):
    print(out.prompt, out.outputs[0].text)
"""

from __future__ import annotations

import dataclasses
import itertools
import numbers
import time
from collections.abc import Callable, Sequence
from typing import Any

from paged_engine import jina_vl_scoring
from paged_engine.beam_search import BeamSearchOutput, BeamSearchSequence
from paged_engine.chat_template import model_chat_template
from paged_engine.classification import ClassificationRequestOutput
from paged_engine.config import EngineConfig
from paged_engine.config_views import ModelConfig
from paged_engine.engine.llm_engine import LLMEngine
from paged_engine.engine.request_latency import RequestClock, RequestLatency, request_clock
from paged_engine.engine.stats import EngineStats
from paged_engine.logging_setup import configure_default_logging
from paged_engine.lora.request import LoRARequest
from paged_engine.metrics_reader import Metric
from paged_engine.metrics_reader import snapshot as metrics_snapshot
from paged_engine.multimodal.chat_format import (
    MediaPlaceholders,
    check_format,
    media_placeholders,
    resolve_content_format,
    string_content,
)
from paged_engine.multimodal.chat_media import split_media
from paged_engine.multimodal.processor_cache import ProcessorCache
from paged_engine.offline_args import (
    TokenizationOptions,
    chat_template_variables,
    conversations,
    per_prompt,
    tokenization_options,
)
from paged_engine.outputs import RequestOutput
from paged_engine.pooling import (
    EmbeddingRequestOutput,
    PoolingParams,
    PoolingRequestOutput,
    encode_truncated,
    truncated,
    truncation_limit,
)
from paged_engine.sampling_params import BeamSearchParams, SamplingParams
from paged_engine.scoring import (
    ScoringRequestOutput,
    cosine_scores,
    cross_encoder_scores,
    pair_indices,
    pair_prompt,
)
from paged_engine.unicode_text import check_text

PromptType = str | list[int] | dict


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        configure_default_logging()  # startup stages at INFO, unless logging is configured
        self.llm_engine = LLMEngine(EngineConfig.from_kwargs(model=model, **kwargs))
        self._counter = itertools.count()
        # the requests this LLM's calls ran (get_metrics); token counts bucketed to max_model_len
        self._latency = RequestLatency(self.llm_engine.config.max_model_len)
        # vLLM's: what the model serves, e.g. ("generate",) or ("embed", "token_embed")
        self.supported_tasks: tuple[str, ...] = self.llm_engine.get_supported_tasks()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    @property
    def model_config(self) -> ModelConfig:
        """vLLM's: `llm_engine.model_config` (config_views.py)."""
        return self.llm_engine.model_config

    def _placeholders(self) -> MediaPlaceholders:
        """The text each image, video and audio part of a string-content chat becomes."""
        ip = self.llm_engine.input_processor
        return media_placeholders(self.llm_engine.tokenizer, ip.images, ip.videos, ip.audios)

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams `generate` and `chat` use when given none: the model's
        generation_config.json recommendations (temperature, top_p, top_k, min_p,
        repetition_penalty, max_new_tokens as max_tokens) over SamplingParams' defaults, as in
        vLLM; plain `SamplingParams()` with generation_config='vllm'."""
        return self.llm_engine.get_default_sampling_params()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams
        | BeamSearchParams
        | Sequence[SamplingParams | BeamSearchParams]
        | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order. `lora_request`: one
        adapter for every prompt, or one (or None) per prompt (needs enable_lora=True).
        `priority`: one int per prompt, lower first (needs scheduling_policy="priority").
        `tokenization_kwargs`: vLLM's (`_tokenize_as`)."""
        opts = tokenization_options(tokenization_kwargs)
        prompt_list = _as_prompt_list(prompts)
        if priority is not None and (
            not isinstance(priority, (list, tuple)) or len(priority) != len(prompt_list)
        ):
            raise ValueError(
                f"priority must be a list of one int per prompt ({len(prompt_list)}), got "
                f"{priority!r}"
            )
        params_list = per_prompt(
            sampling_params,
            len(prompt_list),
            "sampling_params",
            (SamplingParams, BeamSearchParams),
            self.get_default_sampling_params,
        )
        prompt_list, params_list = self._tokenize_as(opts, prompt_list, params_list)
        prompt_list, params_list = self._cut_on_side(opts, prompt_list, params_list)
        loras = _per_prompt_loras(lora_request, len(prompt_list))
        return self._run(list(zip(prompt_list, params_list)), use_tqdm, loras, priority)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: the best `params.beam_width` beams of each prompt, best
        first. As in vLLM, a sequence's `tokens` and `text` include the prompt; the beams run
        in the engine (sharing the prompt's KV blocks), `concurrency_limit` prompts at a time."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        prompt_list = _as_prompt_list(prompts)
        loras = _per_prompt_loras(lora_request, len(prompt_list))
        limit = max(len(prompt_list), 1) if concurrency_limit is None else concurrency_limit
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"concurrency_limit must be None or an int >= 1, got {limit!r}")
        outputs: list[RequestOutput] = []
        for start in range(0, len(prompt_list), limit):
            batch = prompt_list[start : start + limit]
            outputs += self._run(
                [(p, params) for p in batch],
                use_tqdm,
                None if loras is None else loras[start : start + limit],
            )
        tok = self.get_tokenizer()
        results = []
        for prompt, out in zip(prompt_list, outputs, strict=True):
            mm = prompt if isinstance(prompt, dict) else {}
            beams = []
            for c in out.outputs:
                tokens = (out.prompt_token_ids or []) + list(c.token_ids)  # (prompt_embeds: none)
                beams.append(
                    BeamSearchSequence(
                        tokens=tokens,
                        logprobs=list(c.logprobs or []),
                        cum_logprob=c.cumulative_logprob or 0.0,
                        lora_request=out.lora_request,
                        text=tok.decode(tokens),
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                        multi_modal_data=mm.get("multi_modal_data"),
                        mm_processor_kwargs=mm.get("mm_processor_kwargs"),
                    )
                )
            results.append(BeamSearchOutput(sequences=beams))
        return results

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate
        (vLLM's arguments, in vLLM's order). `tools` (OpenAI's function definitions) reach the
        template as transformers passes them; `continue_final_message` renders the last
        (assistant) message open for the model to go on with, instead of a generation prompt;
        `chat_template_kwargs` are extra template variables (e.g. {"enable_thinking": False});
        a key named as one of the arguments gives way to it, or fills it where it is None
        (vLLM's merge; offline_args.chat_template_variables);
        `chat_template_content_format` (vLLM's; multimodal/chat_format.py): "string" makes each
        message's parts one string, its images, videos and audio written as the model's
        placeholder text before the text parts; "openai" keeps the parts; "auto" reads the
        template: "string" unless it loops over a message's content, where a message's media
        parts stay a list and text parts alone are joined.
        A model that takes images (LLaVA) reads `image_url` parts (data: and http(s) URLs) and
        vLLM's `image_pil` parts; the Qwen-VL family (VIDEO_MODELS) also `video_url` parts
        (multimodal/chat_media.py), processed with `mm_processor_kwargs`.
        A tekken.json tokenizer without a template (vLLM's tokenizer_mode="mistral") builds the
        prompt ids as mistral_common does (mistral_chat.py) unless `chat_template` is given.
        `tokenization_kwargs` as `generate`'s; the rendered text is encoded without special
        tokens (the template holds them) unless it says add_special_tokens=True."""
        variables, args = chat_template_variables(
            chat_template_kwargs,
            {
                "add_generation_prompt": add_generation_prompt,
                "continue_final_message": continue_final_message,
                "tools": tools,
                "chat_template": chat_template,
            },
        )
        add_generation_prompt = args["add_generation_prompt"]
        continue_final_message = args["continue_final_message"]
        tools, chat_template = args["tools"], args["chat_template"]
        if continue_final_message and add_generation_prompt:
            raise ValueError(
                "continue_final_message and add_generation_prompt cannot both be True: pass "
                "add_generation_prompt=False to continue the last message"
            )
        check_format(chat_template_content_format, "chat_template_content_format")
        if tools is not None and not (
            isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
        ):
            raise ValueError("tools must be a list of tool definitions (dicts)")
        if chat_template is not None and not isinstance(chat_template, str):
            raise ValueError(f"chat_template must be a str or None, got {chat_template!r:.200}")
        opts = tokenization_options(tokenization_kwargs)
        prompts, token_prompts = [], []
        tok = self.llm_engine.tokenizer
        for conv in conversations(messages):
            in_video = (mm_processor_kwargs or {}).get("use_audio_in_video") is True
            conv, media = split_media(conv, audio_in_video=in_video)
            if continue_final_message and (not conv or conv[-1].get("role") != "assistant"):
                raise ValueError(
                    "continue_final_message needs the last message to be the assistant's"
                )
            template = chat_template or model_chat_template(tok, tools)
            mistral = getattr(tok, "mistral_chat", None) if chat_template is None else None
            if mistral is not None:  # tekken.json, no template: mistral_common's ids (vLLM's)
                # chat_template_kwargs are template variables: no template reads them here
                ids = mistral.render(
                    conv,
                    tools,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                )
                text = tok.decode(ids)
            else:
                from jinja2 import TemplateError

                try:
                    text = self.llm_engine.apply_chat_template(
                        _content_format(
                            conv, chat_template_content_format, template, self._placeholders
                        ),
                        chat_template=chat_template,
                        add_generation_prompt=add_generation_prompt,
                        continue_final_message=continue_final_message,
                        **({"tools": tools} if tools is not None else {}),
                        **variables,
                    )
                except TemplateError as e:  # a template's own raise_exception, a bad template
                    raise ValueError(f"could not apply the chat template: {e}") from e
                # The template already holds any BOS token: encode without adding another.
                text = text.lower() if opts.do_lower_case else text
                ids = tok.encode(text, add_special_tokens=bool(opts.add_special_tokens))
            prompts.append(text)
            prompt: dict[str, Any] = {"prompt_token_ids": ids}
            if media:
                prompt["multi_modal_data"] = media
                if mm_processor_kwargs is not None:
                    prompt["mm_processor_kwargs"] = mm_processor_kwargs
            token_prompts.append(prompt)
        outputs = self.generate(
            token_prompts,
            sampling_params,
            use_tqdm=use_tqdm,
            lora_request=lora_request,
            tokenization_kwargs=tokenization_kwargs,
        )
        for out, text in zip(outputs, prompts):
            out.prompt = text
        return outputs

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """vLLM's `LLM.embed`: one embedding per prompt (`out.outputs.embedding`), pooled from
        the model's final hidden states as `pooler_config` says (last token by default,
        L2-normalized), in input order. The requests batch like any others (pooling.py).
        `truncate_prompt_tokens=k` embeds each prompt's last k tokens (-1: the most that fit)."""
        outs = self.encode(
            prompts,
            _with_task(pooling_params if pooling_params is not None else PoolingParams(), "embed"),
            use_tqdm,
            lora_request,
            truncate_prompt_tokens=truncate_prompt_tokens,
            tokenization_kwargs=tokenization_kwargs,
        )
        return [EmbeddingRequestOutput.from_base(o) for o in outs]

    def classify(
        self,
        prompts: PromptType | Sequence[PromptType],
        *,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        truncate_prompt_tokens: int | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[ClassificationRequestOutput]:
        """vLLM's `LLM.classify` for a `*ForSequenceClassification` model: the label
        probabilities of each prompt (`out.outputs.probs`, one per label, in config.id2label's
        order; `PoolingParams(use_activation=False)`: the raw logits), in input order
        (classification.py). ValueError for a model that is not a classifier."""
        params = pooling_params if pooling_params is not None else PoolingParams()
        outs = self.encode(
            prompts,
            _with_task(params, "classify"),
            use_tqdm,
            lora_request,
            truncate_prompt_tokens=truncate_prompt_tokens,
            tokenization_kwargs=tokenization_kwargs,
        )
        return [ClassificationRequestOutput.from_base(o) for o in outs]

    def reward(
        self,
        prompts: PromptType | Sequence[PromptType],
        /,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[PoolingRequestOutput]:
        """vLLM's `LLM.reward` for a reward model (models/reward_model.py): `encode` with
        task "token_classify", each prompt token's reward in `outputs.data` ([n, 1]; a process
        reward model's: [num_steps, 2], the step tags' label probabilities)."""
        return self.encode(
            prompts,
            pooling_params,
            use_tqdm,
            lora_request,
            truncate_prompt_tokens=truncate_prompt_tokens,
            pooling_task="token_classify",
            tokenization_kwargs=tokenization_kwargs,
        )

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        pooling_task: str | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[PoolingRequestOutput]:
        """vLLM's `LLM.encode`: the pooled vectors as `PoolingRequestOutput`s
        (`outputs.data`: a float32 tensor), in input order: what the model pools by default (an
        embedding; a classifier's label probabilities) unless `pooling_task` (or
        `PoolingParams.task`) says: "token_embed" / "token_classify" give one row per prompt
        token ([num_prompt_tokens, size]). `tokenization_kwargs` as `generate`'s; an explicit
        `truncate_prompt_tokens` wins over every other."""
        if pooling_task is not None:
            pooling_params = _with_task(
                pooling_params if pooling_params is not None else PoolingParams(), pooling_task
            )
        opts = tokenization_options(tokenization_kwargs)
        prompt_list = _as_prompt_list(prompts)
        params_list = per_prompt(
            pooling_params, len(prompt_list), "pooling_params", (PoolingParams,), PoolingParams
        )
        if truncate_prompt_tokens is not None:  # over each params' own (validated there)
            params_list = [
                dataclasses.replace(p, truncate_prompt_tokens=truncate_prompt_tokens)
                for p in params_list
            ]
        prompt_list, params_list = self._tokenize_as(opts, prompt_list, params_list)
        prompt_list, params_list = self._cut_on_side(opts, prompt_list, params_list)
        loras = _per_prompt_loras(lora_request, len(prompt_list))
        return self._run(list(zip(prompt_list, params_list)), use_tqdm, loras)

    def score(
        self,
        data_1: PromptType | Sequence[PromptType],
        data_2: PromptType | Sequence[PromptType],
        /,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        chat_template: str | None = None,
    ) -> list[ScoringRequestOutput]:
        """vLLM's `LLM.score`: one score per pair (`out.outputs.score`), pairing data_1 with
        data_2 1:1, 1:N (one query against each document) or N:N (scoring.py). An embedding
        model scores the cosine similarity of the two texts' embeddings; a single-label
        classifier (a cross-encoder / reranker) reads each pair as one prompt and scores its
        activated logit. As in vLLM, a list `lora_request` has one entry per prompt run: per
        pair for a cross-encoder, per text (data_1's, then data_2's) for an embedding model.
        `chat_template` (vLLM's score template of a cross-encoder) is not supported: None."""
        first, second = _as_prompt_list(data_1), _as_prompt_list(data_2)
        pairs = pair_indices(len(first), len(second), ("data_1", "data_2"))
        if pooling_params is not None and not isinstance(pooling_params, PoolingParams):
            raise ValueError(f"pooling_params must be a PoolingParams, got {pooling_params!r}")
        if chat_template is not None:
            why = "not supported" if self.llm_engine.classifier else "only for a cross-encoder"
            raise ValueError(f"chat_template (a score template) is {why}")
        if self.llm_engine.classifier is not None:
            tokenizer = self.get_tokenizer()
            names = ("data_1", "data_2")
            if jina_vl_scoring.serves(self.llm_engine.classifier):  # its template and images
                prompts = [
                    jina_vl_scoring.pair_request(tokenizer, first[i], second[j], names)
                    for i, j in pairs
                ]
            else:  # a text pair cut by the tokenizer (vLLM), ids by the engine's slice
                keep = truncate_prompt_tokens
                if keep is None and pooling_params is not None:
                    keep = pooling_params.truncate_prompt_tokens
                max_len = self.llm_engine.config.max_model_len
                assert max_len is not None
                limit = truncation_limit(keep, max_len)
                prompts = [
                    {"prompt_token_ids": pair_prompt(tokenizer, first[i], second[j], names, limit)}
                    for i, j in pairs
                ]
            outs = self.encode(
                prompts,
                _with_task(pooling_params or PoolingParams(), "score"),
                use_tqdm,
                lora_request,
                truncate_prompt_tokens=truncate_prompt_tokens,
                tokenization_kwargs=tokenization_kwargs,
            )
            return cross_encoder_scores(outs, [o.prompt_token_ids for o in outs])
        outs = self.encode(
            first + second,
            pooling_params,
            use_tqdm,
            lora_request,
            truncate_prompt_tokens=truncate_prompt_tokens,
            tokenization_kwargs=tokenization_kwargs,
        )
        pad = getattr(self.get_tokenizer(), "pad_token_id", None)
        return cosine_scores(outs[: len(first)], outs[len(first) :], pairs, pad)

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Run `method` on every worker rank (see LLMEngine.collective_rpc); e.g. a weight
        update: `llm.collective_rpc("update_weights", args=(named_tensors,))`."""
        return self.llm_engine.collective_rpc(method, timeout, args, kwargs)

    def apply_model(self, func: Callable[[Any], Any]) -> list[Any]:
        """vLLM's: `func(model)` on every worker rank's model (its shard under tensor
        parallelism), one result per rank; with several ranks `func` must pickle (a
        module-level function)."""
        return self.collective_rpc(_apply_to_model, args=(func,))

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        """Forget the prefix cache (after a weight update); False while requests run, unless
        `reset_running_requests` (vLLM's): those are preempted and recomputed.
        `reset_connector` (vLLM's): the KV connector's stored blocks are not loaded again
        (False, with a warning, when no kv_transfer_config set one up)."""
        for name, value in (
            ("reset_running_requests", reset_running_requests),
            ("reset_connector", reset_connector),
        ):
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool, got {value!r:.200}")
        return self.llm_engine.reset_prefix_cache(reset_running_requests, reset_connector)

    def reset_mm_cache(self) -> None:
        """vLLM's: empty the multimodal processor cache (mm_processor_cache_gb), so images are
        processed again (after their files change, or to free host memory)."""
        images = self.llm_engine.input_processor.images
        cache = getattr(images, "cache", None)
        if cache is not None:
            images.cache = ProcessorCache(cache.max_bytes)

    def get_world_size(self, include_dp: bool = True) -> int:
        """vLLM's: the ranks serving this LLM, tensor_parallel_size * pipeline_parallel_size
        (`include_dp`: times data parallelism, which an LLM runs none of: 1)."""
        config = self.llm_engine.config
        return config.tensor_parallel_size * config.pipeline_parallel_size

    def sleep(self, level: int = 1, mode: str = "abort", *, tags: list[str] | None = None) -> None:
        """vLLM's sleep mode (needs enable_sleep_mode=True; vLLM's arguments in vLLM's order):
        level 1 moves the weights to host memory and discards the KV cache; level 2 discards
        both (then reload_weights or update_weights through collective_rpc); `tags`
        ("weights", "kv_cache"; paged's) name what sleeps instead. Generating raises until
        wake_up()."""
        self.llm_engine.sleep(level, tags, mode)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take the memory back (`tags`: some of it, e.g. ["weights"] before a weight update
        and ["kv_cache"] after it)."""
        self.llm_engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.llm_engine.is_sleeping()

    def start_profile(self, profile_prefix: str | None = None) -> None:
        """Start torch.profiler on every rank (needs PAGED_TORCH_PROFILER_DIR or
        VLLM_TORCH_PROFILER_DIR set before the engine starts; docs/engine.md "Profiling").
        `profile_prefix` (vLLM's): the trace files are named `<prefix>_tp<rank>...`."""
        self.llm_engine.start_profile(profile_prefix)

    def stop_profile(self) -> list[str]:
        """Stop it; returns the trace files written (one per rank, gzipped Chrome traces)."""
        return self.llm_engine.stop_profile()

    def get_stats(self) -> EngineStats:
        return self.llm_engine.get_stats()

    def get_metrics(self) -> list[Metric]:
        """vLLM's: the engine's metrics as reader records (`paged_engine.metrics_reader`:
        Counter, Gauge, Histogram, Vector), named `vllm:...` as vLLM names them; the latency
        histograms and finished-request counts cover the requests this LLM's calls ran."""
        stats = self.llm_engine.get_stats()
        return metrics_snapshot(stats, self._latency, str(self.llm_engine.config.model))

    def _cut_on_side(
        self, opts: TokenizationOptions, prompts: list[PromptType], params: list[Any]
    ) -> tuple[list[PromptType], list[Any]]:
        """tokenization_kwargs' truncation_side where it is not the tokenizer's (which the
        engine cuts on): each prompt whose params truncate is encoded and cut here, on
        `opts.side`, and its params then cut nothing (vLLM's TokenizeParams rule)."""
        tok = self.llm_engine.tokenizer
        if opts.side is None or opts.side == getattr(tok, "truncation_side", "left"):
            return prompts, params
        max_len = self.llm_engine.config.max_model_len
        assert max_len is not None
        out_prompts, out_params = [], []
        for prompt, p in zip(prompts, params, strict=True):
            keep = getattr(p, "truncate_prompt_tokens", None)
            if keep is not None:
                if not self._decoder_text_prompt(prompt):
                    raise ValueError(
                        "tokenization_kwargs['truncation_side'] applies to the text and "
                        "token-id prompts of a decoder-only text model only"
                    )
                generate = isinstance(p, SamplingParams)
                encoded = self._encode_as(
                    prompt, dataclasses.replace(opts, keep=keep), generate, opts.side
                )
                ids = encoded if isinstance(encoded, (list, tuple)) else None
                if isinstance(encoded, dict):
                    ids = encoded.get("prompt_token_ids")
                if isinstance(ids, (list, tuple)):  # (text: cut by the tokenizer already)
                    cut = truncated(list(ids), keep, max_len, generate=generate, side=opts.side)
                    base = encoded if isinstance(encoded, dict) else {}
                    prompt = {k: v for k, v in base.items() if k != "prompt"}
                    prompt["prompt_token_ids"] = cut
                    p = dataclasses.replace(p, truncate_prompt_tokens=None)
                # (no ids: an empty or non-text prompt, which the engine refuses by name)
            out_prompts.append(prompt)
            out_params.append(p)
        return out_prompts, out_params

    def _decoder_text_prompt(self, prompt: PromptType) -> bool:
        """Whether `prompt` is text or token ids alone, for a decoder-only text model: what
        tokenization_kwargs' own encoding and truncation apply to."""
        ip = self.llm_engine.input_processor
        if ip.encoder_prompts is not None or ip.audios is not None:
            return False
        return not (isinstance(prompt, dict) and any(k in prompt for k in _NOT_TEXT_KEYS))

    def _tokenize_as(
        self, opts: TokenizationOptions, prompts: list[PromptType], params: list[Any]
    ) -> tuple[list[PromptType], list[Any]]:
        """vLLM's `tokenization_kwargs` applied to one call: truncation becomes each params'
        truncate_prompt_tokens (where it sets none: its own wins, as in vLLM); text prompts are
        encoded here when they say how (add_special_tokens, do_lower_case) or must be counted
        (max_length without truncation)."""
        if opts.keep is not None:
            params = [_with_keep(p, opts.keep) for p in params]
        if opts.encodes:
            prompts = [
                self._encode_as(p, opts, isinstance(sp, SamplingParams), None, sp)
                for p, sp in zip(prompts, params, strict=True)
            ]
        return prompts, params

    def _encode_as(
        self,
        prompt: PromptType,
        opts: TokenizationOptions,
        generate: bool = False,
        side: str | None = None,
        params: Any = None,
    ) -> PromptType:
        """One prompt as token ids per `opts`; token-id prompts as given (max_length checked).
        A text is truncated by the tokenizer (pooling.encode_truncated, on `side`) to
        `params`' truncate_prompt_tokens (`opts.keep` without params): its special tokens stay."""
        ids: Any = None
        if isinstance(prompt, (list, tuple)):
            ids = prompt
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
        if ids is not None:
            if opts.keep is None and isinstance(ids, (list, tuple)):
                _check_max_length(len(ids), opts.max_length)
            return prompt
        if not self._decoder_text_prompt(prompt):
            raise ValueError(
                "tokenization_kwargs add_special_tokens, do_lower_case and max_length (without "
                "truncation) apply to the text and token-id prompts of a decoder-only text "
                "model only"
            )
        text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
        if not isinstance(text, str) or not text:
            return prompt  # the engine refuses it by name
        check_text(text, "prompt")
        text = text.lower() if opts.do_lower_case else text
        special = True if opts.add_special_tokens is None else opts.add_special_tokens
        keep = opts.keep if params is None else getattr(params, "truncate_prompt_tokens", None)
        max_len = self.llm_engine.config.max_model_len
        assert max_len is not None
        tok = self.llm_engine.tokenizer
        ids = encode_truncated(
            tok, text, keep, max_len, generate=generate, side=side, add_special_tokens=special
        )
        if opts.keep is None:
            _check_max_length(len(ids), opts.max_length)
        base = prompt if isinstance(prompt, dict) else {}
        return {**base, "prompt": text, "prompt_token_ids": ids}

    def _run(
        self,
        items: list[tuple[PromptType, SamplingParams | BeamSearchParams | PoolingParams]],
        use_tqdm: bool | Callable[..., Any],
        loras: Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[Any]:
        engine = self.llm_engine
        if engine.is_sleeping():  # nothing would be scheduled: the call would never return
            raise RuntimeError("the engine is asleep (LLM.sleep): call wake_up() first")
        ids: list[str] = []
        clocks: dict[str, RequestClock] = {}
        try:
            for k, (prompt, params) in enumerate(items):
                rid = str(next(self._counter))
                lora = None if loras is None else loras[k]
                engine.add_request(
                    rid,
                    prompt,
                    params,
                    final_only=True,
                    lora_request=lora,
                    priority=0 if priority is None else priority[k],
                )
                ids.append(rid)
                clocks[rid] = request_clock(time.monotonic(), params)
        except Exception:
            engine.abort_request(ids)  # a bad prompt rejects the whole call; nothing stays queued
            raise
        results: dict[str, Any] = {}
        bar = None
        try:  # (the bar too: a use_tqdm that raises must not leave the requests queued)
            bar = _progress(len(ids), use_tqdm) if use_tqdm else None
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        clock = clocks.get(out.request_id)  # None: added to the engine directly
                        if clock is not None:
                            self._observe(clock, out)
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            engine.abort_request([rid for rid in ids if rid not in results])
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[rid] for rid in ids]

    def _observe(self, clock: RequestClock, out: Any) -> None:
        """A finished output's latencies, from the engine's clock (arrival: its own)."""
        rm = getattr(out, "metrics", None)
        if rm is not None:
            clock.arrival = rm.arrival_time
        self._latency.observe(clock, out, time.monotonic())


def _per_prompt_loras(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, num_prompts: int
) -> list[LoRARequest | None] | None:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return None if lora_request is None else [lora_request] * num_prompts
    if not isinstance(lora_request, (list, tuple)):
        raise ValueError(
            "lora_request must be a LoRARequest, None or a list of them, got "
            f"{type(lora_request).__name__}"
        )
    if len(lora_request) != num_prompts:
        raise ValueError(
            f"got {num_prompts} prompts but {len(lora_request)} lora_request entries: pass one, "
            "or one per prompt"
        )
    return list(lora_request)


def _with_keep(params: Any, keep: int) -> Any:
    """`params` cutting its prompt to `keep` tokens unless it says its own truncation."""
    if isinstance(params, BeamSearchParams):
        raise ValueError("tokenization_kwargs truncation is not supported with BeamSearchParams")
    if not isinstance(params, (SamplingParams, PoolingParams)):
        return params  # refused by name where it is used
    if params.truncate_prompt_tokens is not None:
        return params
    return dataclasses.replace(params, truncate_prompt_tokens=keep)


# prompt keys that make a prompt more than text or token ids
_NOT_TEXT_KEYS = ("multi_modal_data", "prompt_embeds", "encoder_prompt", "decoder_prompt")


def _check_max_length(num_tokens: int, max_length: int | None) -> None:
    if max_length is not None and num_tokens > max_length:
        raise ValueError(
            f"prompt has {num_tokens} tokens, more than tokenization_kwargs['max_length'] = "
            f"{max_length} (pass truncation=True to cut it)"
        )


def _with_task(params: PoolingParams | Sequence[PoolingParams], task: str) -> Any:
    """`params` (one, or one per prompt: None entries are the default) set to run `task`;
    ValueError naming pooling_task when one already names another task (vLLM's rule)."""
    if isinstance(params, PoolingParams):
        params = [params]
        one = True
    else:
        one = False
        if isinstance(params, (list, tuple)):
            params = [PoolingParams() if p is None else p for p in params]
    if not isinstance(params, (list, tuple)) or not all(
        isinstance(p, PoolingParams) for p in params
    ):
        raise ValueError(
            f"pooling_params must be a PoolingParams or a list of them, got {params!r}"
        )
    for p in params:
        if p.task is not None and p.task != task:
            raise ValueError(
                f"pooling_task={task!r} cannot overwrite pooling_params' task={p.task!r}"
            )
    out = [dataclasses.replace(p, task=task) for p in params]
    return out[0] if one else out


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(
            "prompts must be a prompt (str, token-id list or dict) or a list of them, got "
            f"{type(prompts).__name__}"
        )
    prompts = list(prompts)
    # (int before the ABC: isinstance tries them in order, and the ABC costs ~1 us an id)
    if prompts and all(isinstance(t, (int, float, numbers.Integral)) for t in prompts):
        return [prompts]  # one prompt given as token ids (a float among them: refused there)
    return prompts


def _progress(total: int, use_tqdm: bool | Callable[..., Any]):
    """vLLM's: a callable `use_tqdm` is the tqdm class (factory) to draw the bar with."""
    if callable(use_tqdm):
        factory = use_tqdm
    else:
        from tqdm.auto import tqdm as factory
    return factory(total=total, desc="Processed prompts", dynamic_ncols=True)


def _content_format(
    conversation: list[dict],
    given: str,
    template: Any,
    placeholders: Callable[[], MediaPlaceholders],
) -> list[dict]:
    """Messages as the template takes them (multimodal/chat_format.py): "openai" keeps every
    list of parts; "string" (given, or what "auto" finds the template takes) makes each one
    string with the media's placeholder text; "auto" on a template that reads parts keeps a
    message's parts where media are among them and joins text parts alone by newlines."""
    if given == "openai":
        return conversation
    if resolve_content_format(given, template) == "string":
        return string_content(conversation, placeholders())
    out = []
    for m in conversation:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" for p in content
        ):
            m = {**m, "content": "\n".join(str(p.get("text", "")) for p in content)}
        out.append(m)
    return out


def _apply_to_model(worker: Any, func: Callable[[Any], Any]) -> Any:
    """`LLM.apply_model` on one rank (a collective_rpc function)."""
    return func(worker.model_runner.model)
