"""`LLMEngine`: the front end the offline `LLM` and the HTTP server both drive.

    add_request:  input processor (tokenize, validate) -> engine core + output stage
    step():       engine core (schedule -> executor -> worker -> apply) -> output stage
    abort_request -> every block the request held is free again

The engine core holds token-level state; the output stage text-level state; each request is
registered in both (the core's scheduler and the output stage's states) and nowhere else.
Not thread-safe: one thread owns the engine (the server funnels everything through its engine
thread). The tokenizer is the engine thread's: other threads use their own copy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

import torch

from paged_engine import jina_vl_scoring
from paged_engine.chat_template import model_chat_template
from paged_engine.classification import classifier_info, resolve_from_token
from paged_engine.config import EngineConfig
from paged_engine.config_views import ModelConfig, VllmConfig
from paged_engine.core.block_manager import BlockManager
from paged_engine.core.core_output import EngineCoreOutput
from paged_engine.core.engine_core import EngineCore
from paged_engine.core.scheduler import Scheduler
from paged_engine.core.state_slots import StateSlots
from paged_engine.core.step_isolation import RequestFailedError
from paged_engine.default_model import default_model_path
from paged_engine.distributed.launch import (
    forkserver_context,
    is_worker_rank,
    start_method,
    torchrun_env,
)
from paged_engine.distributed.parallel_state import check_model_parallelism
from paged_engine.engine.encoder import (
    encoder_class,
    encoder_engine_config,
    encoder_sep_token,
    sentence_transformers_lower_case,
)
from paged_engine.engine.encoder_prompt import encoder_prompts  # BART: decoder / encoder
from paged_engine.engine.generation_defaults import generation_defaults
from paged_engine.engine.input_processor import InputProcessor
from paged_engine.engine.output_processor import OutputProcessor, ProcessedOutputs
from paged_engine.engine.prompt_embeds import (
    check_prompt_embeds,
    embedding_width,
)
from paged_engine.engine.request_ids import internal_request_id
from paged_engine.engine.sleep_mode import SleepMode
from paged_engine.engine.stats import EngineStats, engine_stats
from paged_engine.executor.base import Executor
from paged_engine.executor.multiproc import MultiprocExecutor
from paged_engine.executor.uniproc import UniprocExecutor
from paged_engine.kv_transfer.config import check_model as check_kv_transfer_model
from paged_engine.kv_transfer.connector import build_connector
from paged_engine.layers.rotary import (
    is_dynamic_ntk,
    longrope_default_context,
    scaled_context_limit,
)
from paged_engine.loader import (
    ResolvedModel,
    apply_hf_overrides,
    load_hf_config,
    load_tokenizer,
    resolve_model,
    takes_audio,
    takes_images,
)
from paged_engine.lora.registry import LoRARegistry
from paged_engine.lora.request import LoRARequest
from paged_engine.models.base_model import (
    base_model_engine_config,
    causal_st_engine_config,
    pooling_only,
)
from paged_engine.models.hybrid import num_kv_layers
from paged_engine.models.st_modules import load_dense_stack
from paged_engine.models.transformers_backend.selection import select_model_impl
from paged_engine.models.utils import CONTEXT_LENGTH_KEYS
from paged_engine.multimodal.archs import supported_tower, vision_tower_type
from paged_engine.multimodal.audio import AudioProcessor
from paged_engine.multimodal.inputs import is_embeds_prompt
from paged_engine.multimodal.mantis import ARCH as MANTIS
from paged_engine.multimodal.mantis import as_mantis
from paged_engine.multimodal.processor import (
    ImageProcessor,
    builds_own_processor,
    processor_saved,
    wrapper_config,
)
from paged_engine.multimodal.processor_cache import ProcessorCache
from paged_engine.multimodal.processor_files import ProcessorFileError
from paged_engine.multimodal.qwen_omni import thinker_config
from paged_engine.multimodal.video_archs import VideoProcessor, video_processor_class
from paged_engine.outputs import RequestOutput
from paged_engine.pooling import PoolingParams, matryoshka_sizes, to_sampling_params
from paged_engine.runner import convert_architectures, serves
from paged_engine.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from paged_engine.spec_decode.config import SpeculativeConfig
from paged_engine.spec_decode.draft_loader import resolve_speculative_config
from paged_engine.spec_decode.planner import DraftPlanner
from paged_engine.structured_output.manager import StructuredOutputManager
from paged_engine.unicode_text import check_text
from paged_engine.worker.cache_engine import num_cpu_blocks
from paged_engine.worker.cross_attention import encoder_decoder_engine_config, is_encoder_decoder
from paged_engine.worker.recurrent_state import (
    fit_state_snapshots,
    hybrid_engine_config,
    is_hybrid,
    states_depend_on_prompt,
)
from paged_engine.worker.worker import pick_device
from paged_engine.worker.worker_loop import run_torchrun_worker

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **kwargs: Any) -> None:
        config = config if config is not None else EngineConfig.from_kwargs(**kwargs)
        if config.model is None:
            config.model = str(default_model_path())
        self.config = config
        t0 = time.perf_counter()
        world_size = config.tensor_parallel_size * config.pipeline_parallel_size
        # Ranks 1.. will be forked here: the forkserver imports what they need meanwhile.
        if (
            world_size > 1
            and torchrun_env() is None
            and start_method(pick_device(config.device).type) == "forkserver"
        ):
            forkserver_context()
        logger.info("resolving model %s", config.model)
        self.resolved = resolve_model(
            config.model,
            config.revision,
            config.download_dir,
            token=config.hf_token,
            mistral="mistral" in (config.config_format, config.load_format),  # hub files
        )
        self.hf_config = load_hf_config(
            self.resolved, config.trust_remote_code, config.config_format
        )
        apply_hf_overrides(self.hf_config, config.hf_overrides)
        convert_architectures(self.hf_config, config.convert)  # convert="classify"
        select_model_impl(config, self.hf_config)  # model_impl="transformers" / its fallback
        hybrid_engine_config(config, self.hf_config)  # before any worker reads the config
        encoder_decoder_engine_config(config, self.hf_config)  # Whisper: refusals, lengths
        # BERT / RoBERTa (engine/encoder.py): whole sequences in one step, pooling only
        self.encoder = encoder_engine_config(
            config, self.hf_config, None if self.resolved.is_gguf else self.resolved.path
        )
        self.is_encoder = self.encoder is not None
        # a base <Stem>Model or a reward model: it only pools (models/base_model.py)
        self.pooling_only = pooling_only(self.hf_config)
        base_model_engine_config(
            config, self.hf_config, None if self.resolved.is_gguf else self.resolved.path
        )
        check_prompt_embeds(config, self.hf_config, self.is_encoder)
        if config.kv_transfer_config is not None:  # models with state outside the KV blocks
            check_kv_transfer_model(self.hf_config, is_encoder=self.is_encoder)
        self.tokenizer = load_tokenizer(
            self.resolved
            if config.tokenizer is None
            else resolve_model(
                config.tokenizer,
                config.tokenizer_revision,
                config.download_dir,
                weights=False,
                token=config.hf_token,
            ),
            trust_remote_code=config.trust_remote_code,
        )
        # LLaVA: the host side of image prompts; before the workers, which load the vision
        # tower only where images can run
        images = self._image_processor()
        videos = self._video_processor(images)
        audios = self._audio_processor()
        if config.chat_template is not None:
            self.tokenizer.chat_template = _read_template(config.chat_template)
        # A *ForSequenceClassification model: it classifies and scores, never generates.
        resolve_from_token(self.hf_config, self.tokenizer)  # a head built from LM-head rows
        if self.is_encoder:
            encoder_sep_token(self.hf_config, self.tokenizer)
        self.classifier = classifier_info(self.hf_config)
        if self.classifier is not None and self.encoder is not None:
            after = getattr(self.encoder, "head_after_pooling", lambda c: False)(self.hf_config)
            self.classifier = dataclasses.replace(self.classifier, head_after_pooling=after)
        if jina_vl_scoring.serves(self.classifier):  # its MLP head reads the last token alone
            jina_vl_scoring.check_pooler_config(config.pooler_config)
        # "generate", "pooling" or "both": the requests add_request takes (runner.py)
        if self.pooling_only is not None and config.runner == "generate":
            arch = ", ".join(getattr(self.hf_config, "architectures", None) or ["?"])
            raise ValueError(
                f"runner='generate': this model ({arch}) is {self.pooling_only}, which only "
                "pools (use runner='pooling' or 'auto')"
            )
        self.serves = serves(
            config.runner,
            config.convert,
            self.classifier is not None,
            self.is_encoder or self.pooling_only is not None,
        )
        # vLLM's tokenizer truncation_side (truncate_prompt_tokens cuts on it): "right" (keep
        # the start) for a pooling runner, else "left" (keep the end)
        with contextlib.suppress(AttributeError):
            self.tokenizer.truncation_side = "right" if self.serves == "pooling" else "left"
        # sentence-transformers Dense modules: run on each embedding (models/st_modules.py)
        # Invariant: st_dense_error is set only when the engine also generates: a Dense module
        # it cannot run fails its embed requests (add_request), never its generation
        self.st_dense = None
        self.st_dense_error: ValueError | None = None
        if self.serves != "generate" and self.classifier is None and not self.resolved.is_gguf:
            width = int(getattr(self.hf_config, "hidden_size", 0) or 0)
            if hasattr(self.encoder, "pooled_width"):  # rows projected (EmbeddingGemma 2)
                width = self.encoder.pooled_width(self.hf_config)
            try:
                if not self.is_encoder and self.pooling_only is None:  # those read them above
                    causal_st_engine_config(config, self.hf_config, self.resolved.path)
                self.st_dense = load_dense_stack(self.resolved.path, width)
            except ValueError as error:
                if self.serves == "pooling":
                    raise
                logger.warning("embedding requests will be refused: %s", error)
                self.st_dense_error = error
        if self.serves == "pooling" and config.logits_processors:
            raise ValueError("logits_processors: a pooling model samples no tokens to process")
        if self.classifier is not None and config.speculative_config is not None:
            raise ValueError(
                "speculative_config: a sequence-classification model generates no tokens to "
                "speculate on"
            )
        # SamplingParams keywords replacing its defaults where a request leaves them unset
        self.generation_defaults = generation_defaults(
            None if self.resolved.is_gguf else self.resolved.path,
            config.generation_config,
            config.override_generation_config,
        )
        self._resolve_lengths()
        if images is not None and images.layout.bidirectional:  # Gemma 3: one step an image
            per_image = images.tokens_per_image
            assert per_image is not None and config.max_num_batched_tokens is not None
            if config.max_num_batched_tokens < per_image:
                raise ValueError(
                    f"max_num_batched_tokens={config.max_num_batched_tokens} is below the "
                    f"{per_image} tokens of one image, which must run in one step (they attend "
                    "to each other both ways)"
                )
        if config.speculative_config is not None:  # completed from the model, checked
            resolve_speculative_config(config, self.hf_config, self.tokenizer)
        logger.info(
            "model %s: %s, config and tokenizer loaded; max_model_len %d",
            self.resolved.gguf_file or self.resolved.path,
            ", ".join(getattr(self.hf_config, "architectures", None) or ["?"]),
            config.max_model_len,
        )
        self.executor: Executor
        if world_size > 1:  # on every torchrun rank too: each names the shape it refuses
            check_model_parallelism(
                self.hf_config, config.tensor_parallel_size, config.pipeline_parallel_size
            )
        if is_worker_rank(world_size):  # torchrun rank > 0: serve rank 0's engine, then leave
            run_torchrun_worker(config, self.resolved, self.hf_config)
            raise SystemExit(0)
        if world_size > 1:
            self.executor = MultiprocExecutor(config, self.resolved, self.hf_config)
        else:
            self.executor = UniprocExecutor(
                config, self.resolved, self.hf_config, overlap=bool(config.async_scheduling)
            )
        worker = self.executor.worker
        self.device, self.dtype = worker.device, worker.dtype
        if config.async_scheduling is None:
            # Pipeline stages keep steps in flight their own way (micro-batches of disjoint
            # requests, core/engine_core.py), never with pending tokens: no async scheduling.
            # So does speculation: drafts come from the host's tokens.
            # Custom logits processors read every output token on the host.
            pipelined = config.pipeline_parallel_size > 1
            sync = pipelined or config.speculative_config is not None or config.logits_processors
            config.async_scheduling = auto_async_scheduling(self.device) and not bool(sync)
        logger.info("sizing the KV cache on %s", self.device)
        num_blocks = self.executor.determine_num_blocks()
        states = worker.model_runner.states
        block_bytes = None
        if states is not None:  # the prefix cache's state snapshots share the KV cache's memory
            block_bytes, row_bytes = worker.snapshot_costs()
            if config.pipeline_parallel_size > 1:  # sized by the stage a snapshot costs most
                costs = self.executor.collective_rpc("snapshot_costs")
                block_bytes, row_bytes = max(costs, key=lambda c: c[1] / max(c[0], 1))
            num_blocks = fit_state_snapshots(config, num_blocks, block_bytes, row_bytes)
        usable = num_blocks - 1  # block 0 is the null block
        if usable * config.block_size < config.max_model_len:
            seats = (
                ""
                if states is None
                else f", or lower max_num_seqs or prefix_state_snapshots (each seat and snapshot"
                f" holds {states.nbytes_per_row / 2**20:.1f} MiB of recurrent state)"
            )
            raise ValueError(
                f"the KV cache holds {max(usable, 0) * config.block_size} tokens "
                f"({num_blocks} blocks of {config.block_size}), fewer than max_model_len="
                f"{config.max_model_len}: raise gpu_memory_utilization (or cpu_kv_cache_gib / "
                f"kv_cache_memory_bytes / num_gpu_blocks_override) or lower max_model_len{seats}"
            )
        logger.info(
            "allocating the KV cache: %d blocks x %d tokens = %d token slots%s%s",
            num_blocks,
            config.block_size,
            num_blocks * config.block_size,
            " (no KV layers: the blocks only count tokens)" if states and not block_bytes else "",
            "" if self.device.type != "cuda" or config.enforce_eager else " (then CUDA graphs)",
        )
        self.executor.initialize_cache(num_blocks, config.prefix_state_snapshots or 0)
        self.num_blocks = num_blocks
        cpu_gib = config.swap_space + config.cpu_offload_gib
        kv_dtype = worker.model_runner.kv_cache_dtype
        # Mamba2 layers with a dt limit update their state one way for prompt tokens and another
        # for generated ones: the prefix cache then holds prompt tokens only (KV and snapshots).
        prompt_only = states_depend_on_prompt(worker.model_runner.model)
        self.block_manager = BlockManager(
            num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            num_cpu_blocks=num_cpu_blocks(self.hf_config, config.block_size, kv_dtype, cpu_gib),
            cpu_offload=config.cpu_offload_gib > 0,
            prompt_only=prompt_only,
        )
        self.draft_planner = None
        if config.speculative_config is not None:
            spec = SpeculativeConfig.from_dict(config.speculative_config)
            self.draft_planner = DraftPlanner(spec, config.max_model_len)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            draft_planner=self.draft_planner,
            # The CPU pool swaps only with swap_space (cpu_offload_gib alone is the tier's).
            preemption_mode=config.preemption_mode if config.swap_space else "recompute",
            max_loras=config.max_loras if config.enable_lora else 0,
            policy=config.scheduling_policy,
            kv_connector=(
                None
                if config.kv_transfer_config is None
                else build_connector(config, self.hf_config, worker)
            ),
            state_slots=(
                StateSlots(
                    config.max_num_seqs,
                    config.prefix_state_snapshots or 0,
                    past_prompt=not prompt_only,
                )
                if is_hybrid(self.hf_config)
                else None
            ),
        )
        self.lora_registry = None
        if config.enable_lora:
            scheduler = self.scheduler
            manager = getattr(worker.model_runner, "lora", None)  # rank 0's: reads ahead
            self.lora_registry = LoRARegistry(
                self.executor,
                config.max_cpu_loras or config.max_loras,
                lambda: {r.lora_id for r in scheduler.requests.values() if r.lora_id},
                loader=None if manager is None else manager.loader,
            )
        self.eos_token_ids = _eos_ids(self.hf_config, self.tokenizer, self.resolved)
        self.vocab_size = int(self.hf_config.vocab_size)
        # Grammars compile on the manager's thread; llguidance loads with the first one.
        structured = StructuredOutputManager(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.engine_core = EngineCore(
            self.scheduler,
            self.executor,
            max_model_len=config.max_model_len,
            async_scheduling=config.async_scheduling,
            structured=structured,
        )
        self.input_processor = InputProcessor(
            self.tokenizer,
            config,
            vocab_size=self.vocab_size,
            eos_token_ids=self.eos_token_ids,
            structured=structured,
            default_params=self.generation_defaults,
            images=images,
            videos=videos,
            audios=audios,
            embeds_width=embedding_width(self.hf_config) if config.enable_prompt_embeds else None,
            think_ids=_think_ids(config.reasoning_config, self.tokenizer),
            lower_case=not self.resolved.is_gguf
            and sentence_transformers_lower_case(self.resolved.path),
            encoder_prompts=encoder_prompts(
                self.hf_config, self.tokenizer, self.vocab_size, self.resolved.path
            ),
        )
        self.output_processor = OutputProcessor(self.tokenizer, config.stream_interval)
        if self.st_dense is not None:
            self.output_processor.project = self.st_dense.project
        self.sleep_mode = SleepMode(self)  # sleep / wake_up / pause_generation
        logger.info(
            "engine ready in %.1fs: %s on %s (%s), %d KV blocks of %d tokens, async scheduling %s",
            time.perf_counter() - t0,
            config.model,
            self.device,
            self.dtype,
            num_blocks,
            config.block_size,
            "on" if config.async_scheduling else "off",
        )

    @classmethod
    def from_engine_args(cls, engine_args: Any, **_: Any) -> LLMEngine:
        """vLLM's: the engine of an `EngineArgs` (`usage_context` and the like are ignored)."""
        return cls(engine_args.create_engine_config())

    @property
    def model_runner(self):
        """The in-process worker's runner (tests and benchmarks reach the model through it)."""
        return self.executor.worker.model_runner

    # vLLM's names for the settings (config_views.py: read-only views of `config` and the model)
    @property
    def vllm_config(self) -> VllmConfig:
        return VllmConfig(self)

    @property
    def model_config(self) -> ModelConfig:
        return ModelConfig(self)

    def get_model_config(self) -> ModelConfig:
        return ModelConfig(self)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    # ---- requests -------------------------------------------------------------------------------
    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: SamplingParams with the model's generation-config defaults (a new object
        each call; `SamplingParams()` when there are none or generation_config='vllm')."""
        return SamplingParams(**self.generation_defaults)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | dict,
        params: SamplingParams | BeamSearchParams | PoolingParams | None = None,
        arrival_time: float | None = None,
        *,
        final_only: bool = False,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
    ) -> str:
        """Queue a request; raises ValueError (naming the parameter) on bad input. Returns
        the engine's id of it: `request_id`, or, while `request_id` is in use, that plus 8
        random hex digits (as vLLM: the duplicate is served too; its outputs say `request_id`).

        What each output holds follows `params.output_kind` (CUMULATIVE by default, DELTA for
        streaming); `final_only=True` overrides it with FINAL_ONLY (offline generation).
        `lora_request` runs it with that adapter (loaded now if it is not). `priority`: with
        scheduling_policy="priority", lower runs first (and is preempted last)."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
        check_priority(priority, self.config.scheduling_policy)
        external_req_id = None
        if request_id in self.output_processor.states:
            # vLLM (InputProcessor.assign_request_id): served under an internal id of its own;
            # its outputs carry the caller's id, and aborting that id aborts every such request
            external_req_id, request_id = request_id, internal_request_id(request_id)
        if self.serves != "both" and isinstance(params, PoolingParams) != (
            self.serves == "pooling"
        ):
            self._refuse(params)
        if isinstance(params, PoolingParams):  # pooling.py: ends at its prefill
            if self.st_dense_error is not None:  # a Dense module this engine cannot run
                raise ValueError(f"params: {self.st_dense_error}")
            if params.task in ("token_embed", "token_classify") and getattr(
                self.encoder, "pooled_rows", False
            ):  # SPLADE, GritLM (models/splade.py, gritlm.py): their rows are already pooled
                raise ValueError(
                    f"task={params.task!r} is not supported: this model's rows are pooled "
                    "vectors (use LLM.embed)"
                )
            hidden_size = int(self.hf_config.hidden_size)
            if hasattr(self.encoder, "pooled_width"):  # rows projected (EmbeddingGemma 2)
                hidden_size = self.encoder.pooled_width(self.hf_config)
            if self.st_dense is not None:  # the embedding is the last Dense module's output
                hidden_size = self.st_dense.out_features
            params = to_sampling_params(
                params,
                self.config.pooler_config,
                hidden_size,
                self.classifier,
                matryoshka_sizes(self.hf_config),
            )
        if lora_request is not None:
            if self.lora_registry is None:
                raise ValueError("lora_request needs an engine started with enable_lora=True")
            self.lora_registry.ensure(lora_request)  # raises ValueError for a bad adapter
        p = self.input_processor.make_request(request_id, prompt, params, arrival_time)
        req = p.request
        req.priority = priority
        if lora_request is not None:
            req.lora_id, req.lora_path = lora_request.lora_int_id, lora_request.lora_path
        kind = RequestOutputKind.FINAL_ONLY if final_only else req.params.output_kind
        self.engine_core.add_request(req)
        embeds = is_embeds_prompt(req.mm_inputs)  # placeholders, not tokens
        self.output_processor.add_request(
            request_id,
            p.prompt_text,
            None if embeds else req.prompt_token_ids,
            req.params,
            req.arrival_time,
            num_prompt_tokens=len(req.prompt_token_ids),
            num_returned=p.num_returned,
            beam_logprobs=p.beam_logprobs,
            kind=kind,
            lora_request=lora_request,
            encoder_prompt=p.encoder_prompt,
            external_req_id=external_req_id,
        )
        return request_id

    def _refuse(self, params: Any) -> None:
        """ValueError naming `params` for a request this engine does not serve."""
        if self.pooling_only is not None and self.classifier is None:
            arch = ", ".join(getattr(self.hf_config, "architectures", None) or ["?"])
            raise ValueError(
                f"params: this model ({arch}) is {self.pooling_only}: it embeds (LLM.embed, "
                "LLM.encode), it does not generate (task 'generate'); pass PoolingParams"
            )
        if self.classifier is not None and self.classifier.per_token:
            raise ValueError(
                f"params: this model ({self.classifier.architecture}) is a token classifier: it "
                "labels each token (LLM.encode, task 'token_classify' on /pooling), it does not "
                "generate; pass PoolingParams"
            )
        if self.classifier is not None:
            raise ValueError(
                f"params: this model ({self.classifier.architecture}) is a sequence classifier: "
                "it classifies (LLM.classify) and scores text pairs (LLM.score), it does not "
                "generate; pass PoolingParams"
            )
        if self.is_encoder:
            arch = ", ".join(getattr(self.hf_config, "architectures", None) or ["?"])
            raise ValueError(
                f"params: this model ({arch}) is encoder-only: it embeds (LLM.embed) and, with a "
                "classification head, classifies and scores; it does not generate"
            )
        if self.serves == "pooling":
            raise ValueError(
                "params: this engine runs pooling requests only (runner='pooling'); pass "
                "PoolingParams (LLM.embed)"
            )
        raise ValueError(
            "params: this engine generates only (runner='generate'); start it with "
            "runner='pooling' or 'auto' to embed"
        )

    # ---- workers, weights and the prefix cache (what RL rollout loops call) ------------------
    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """vLLM's `collective_rpc`: run `method` on every worker rank, one result per rank in
        rank order. `method` is a Worker method's name (e.g. "update_weights") or a function
        called as fn(worker, *args, **kwargs) (module-level, so it pickles, with tensor or
        pipeline parallelism). A failure on any rank raises RpcError; the engine goes on.
        `timeout` is accepted for vLLM's signature; calls wait for every rank. It runs after
        any step already submitted (same thread, stream or broadcast order)."""
        return self.executor.collective_rpc(method, args, kwargs)

    def start_profile(self, profile_prefix: str | None = None) -> None:
        """vLLM's: every rank starts torch.profiler (worker/profiler.py); RuntimeError unless
        the engine started with PAGED_TORCH_PROFILER_DIR (or VLLM_TORCH_PROFILER_DIR) set, or
        while it already runs. `profile_prefix`: the trace files' names start with it."""
        if profile_prefix is not None and (
            not isinstance(profile_prefix, str)
            or not profile_prefix
            or any(c in profile_prefix for c in "/\\\0")
        ):
            raise ValueError(
                f"profile_prefix must be a non-empty file name part (no path separators), got "
                f"{profile_prefix!r:.200}"
            )
        self.collective_rpc("start_profile", args=(profile_prefix,))

    def stop_profile(self) -> list[str]:
        """Stop every rank's profiler; returns the trace files written, one per rank."""
        return self.collective_rpc("stop_profile")

    def get_supported_tasks(self) -> tuple[str, ...]:
        """vLLM's: the tasks this engine serves, named as vllm/tasks.py names them: "generate"
        unless it only pools, then the pooling tasks its model runs unless it only generates
        (an embedding model: "embed", "token_embed"; a sequence classifier: "classify" and,
        unless it pools before its head, "token_classify"; a token classifier:
        "token_classify")."""
        tasks = [] if self.serves == "pooling" else ["generate"]
        if self.serves == "generate":
            return tuple(tasks)
        info = self.classifier
        if info is None:
            if self.st_dense_error is None:  # (a Dense module it cannot run: embeds refused)
                tasks.append("embed")
                if not getattr(self.encoder, "pooled_rows", False):
                    tasks.append("token_embed")
        elif info.per_token:
            tasks.append("token_classify")
        else:
            tasks += ["classify"] if info.head_after_pooling else ["classify", "token_classify"]
        return tuple(tasks)

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        """Forget every cached block (after a weight update its KV is stale). False, and
        nothing changes, while requests are unfinished (their blocks stay registered), unless
        `reset_running_requests` (vLLM's): those are preempted first and recomputed.
        `reset_connector` (vLLM's): the KV connector's stored blocks are never loaded again
        (kv_transfer/connector.py `reset_cache`); False without a connector."""
        if reset_connector:
            done = self.reset_prefix_cache(reset_running_requests)
            connector = self.scheduler.kv_connector
            if connector is None:
                logger.warning("reset_connector: this engine has no KV connector")
                return False
            connector.reset_cache()
            return done
        if self.scheduler.has_unfinished_requests():
            if not reset_running_requests:
                return False
            failed = self.engine_core.drain()
            self.engine_core.preempt_all()
            if failed:  # their results failed to apply: they failed (the cache is reset)
                self.forget_prefix_cache()
                ids = [rid for e in failed for rid in e.request_ids]
                self.output_processor.abort(ids)
                raise RequestFailedError(ids, failed[0].cause) from failed[0].cause
        self.forget_prefix_cache()
        return True

    def forget_prefix_cache(self) -> None:
        """Drop every prefix-cache entry (blocks in use keep their data) and state snapshot."""
        self.block_manager.reset_prefix_cache()
        if self.scheduler.state_slots is not None:
            self.scheduler.state_slots.reset_snapshots()

    # ---- sleep mode and pausing (engine/sleep_mode.py) --------------------------------------
    def sleep(self, level: int = 1, tags: list[str] | None = None, mode: str = "abort") -> None:
        """vLLM's: give back device memory. level 1: weights to host memory, KV cache
        discarded; 2: both discarded (reload_weights / update_weights before generating);
        0: pause only; `tags` ("weights", "kv_cache") name what sleeps instead. `mode` settles
        the requests in flight ("abort", "wait", "keep"). Needs enable_sleep_mode=True."""
        self.sleep_mode.sleep(level, tags, mode)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take back the memory of `tags` (None: all); scheduling resumes once all is awake."""
        self.sleep_mode.wake_up(tags)

    def is_sleeping(self) -> bool:
        """True while any memory is asleep or scheduling is paused."""
        return self.sleep_mode.is_sleeping()

    def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """vLLM's: stop scheduling (e.g. for a weight update) after settling the requests in
        flight by `mode`; `clear_cache` resets the prefix cache (not with "keep")."""
        self.sleep_mode.pause(mode, clear_cache=clear_cache)

    def resume_generation(self) -> None:
        """Schedule again; RuntimeError while memory is asleep (wake_up resumes then)."""
        self.sleep_mode.resume()

    def is_paused(self) -> bool:
        return self.sleep_mode.paused

    def can_step(self) -> bool:
        """Whether step() has work: unfinished requests while not paused, or held outputs."""
        return bool(self.sleep_mode.held) or self.engine_core.can_step()

    # ---- LoRA adapters (vLLM's add_lora / remove_lora / list_loras) ---------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter ahead of its requests; ValueError when it cannot be served."""
        if self.lora_registry is None:
            raise ValueError("add_lora needs an engine started with enable_lora=True")
        self.lora_registry.ensure(lora_request)
        return True

    def prefetch_lora(self, lora_request: LoRARequest) -> Future | None:
        """Start reading an adapter's files on a loader thread; the one call any thread may
        make. The Future is done when the read ended: an `add_request` / `add_lora` naming the
        adapter after that installs it without reading (and raises the read's ValueError).
        None when there is nothing to read ahead (loaded already, or LoRA is off)."""
        if self.lora_registry is None:
            return None
        return self.lora_registry.prefetch(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        """Unload an adapter; False when it is not loaded or unfinished requests use it."""
        return self.lora_registry is not None and self.lora_registry.remove(lora_id)

    def list_loras(self) -> set[int]:
        return set() if self.lora_registry is None else self.lora_registry.ids()

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Abort these requests: an id names the request added under it and every duplicate
        added while it was in use (or one duplicate, by the id `add_request` returned)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        ids += self.output_processor.duplicates_of(ids)
        self.output_processor.abort(ids)
        self.engine_core.abort_requests(ids)
        if self.lora_registry is not None:  # adapters only they held go back to max_cpu_loras
            self.lora_registry.trim()

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        sched = self.scheduler
        return sched.num_running + sched.num_waiting + self.engine_core.num_compiling

    # ---- the step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        held = self.sleep_mode.take_held() if self.sleep_mode.held else []
        try:
            core_outputs = self.step_core()
        except BaseException:  # (a culprit's RequestFailedError): the held ones are not lost
            if held:
                self.sleep_mode.held[:0] = held
            raise
        if not core_outputs:
            return held
        processed = self.process_outputs(core_outputs)
        if processed.stopped:
            self.finish_seqs(processed.stopped)
        return held + processed.request_outputs if held else processed.request_outputs

    # The two halves of step(), for a caller that runs the output stage on a thread of its own
    # (the server): step_core and finish_seqs on the engine thread, process_outputs anywhere.
    def step_core(self) -> list[EngineCoreOutput]:
        """One engine-core step: token-level results as plain data. RequestFailedError when
        a step failed with only its requests in it (core/step_isolation.py): they are gone,
        every other request goes on."""
        try:
            outputs = self.engine_core.step()
        except RequestFailedError as e:
            self.output_processor.abort(e.request_ids)
            raise
        if self.lora_registry is not None:  # adapters only finished requests held
            self.lora_registry.trim()
        return outputs

    def process_outputs(self, core_outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        """The output stage: text, stop strings, RequestOutputs. Pass `.stopped` back to
        `finish_seqs` (on the engine thread)."""
        return self.output_processor.process(core_outputs)

    def finish_seqs(self, stopped: list[tuple[str, int, str]]) -> None:
        """Free sequences the output stage ended with a stop string."""
        self.engine_core.finish_seqs(stopped)
        if self.lora_registry is not None:
            self.lora_registry.trim()

    def check_health(self) -> None:
        """Raise EngineDeadError if a worker rank has died, without running a step (vLLM's
        `check_health`; paged-server calls it while idle, so /health sees a lost rank)."""
        self.engine_core.check_health()

    def shutdown(self) -> None:
        self.engine_core.shutdown()
        if self.lora_registry is not None:
            self.lora_registry.shutdown()

    def warm_structured_outputs(self) -> None:
        """Build the grammar backend in the background now (paged-server, once serving), so
        that no constrained request waits for it and no step stalls on it."""
        if self.engine_core.structured is not None:
            self.engine_core.structured.warm()

    # ---- chat and stats -------------------------------------------------------------------------
    def apply_chat_template(
        self,
        messages: list[dict],
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        template = chat_template or model_chat_template(self.tokenizer, kwargs.get("tools"))
        if template is None:
            raise ValueError("the model has no chat template; pass chat_template")
        check_text(messages, "messages")  # rendering would raise a UnicodeEncodeError
        return self.tokenizer.apply_chat_template(
            messages,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )

    def get_stats(self) -> EngineStats:
        return engine_stats(self)

    def _image_processor(self) -> ImageProcessor | None:
        """The host side of image prompts where the checkpoint's images run (multimodal/);
        None for text-only models and with limit_mm_per_prompt={"image": 0}."""
        cfg = self.config
        if not takes_images(self.resolved, self.hf_config) or cfg.image_limit == 0:
            return None
        config = wrapper_config(self.resolved.path, cfg.trust_remote_code)
        why = None
        if not supported_tower(config):  # e.g. Pixtral-12B's HF form: LLaVA, a Pixtral tower
            why = f"its vision tower ({vision_tower_type(config)}) is not one paged runs"
        elif not processor_saved(self.resolved.path) and not builds_own_processor(config):
            why = "it has no image processor (preprocessor_config.json or processor_config.json)"
        if why is not None:
            logger.warning("%s: %s; serving the text model only", self.resolved.path, why)
            cfg.limit_mm_per_prompt = {**(cfg.limit_mm_per_prompt or {}), "image": 0}
            return None
        if getattr(self.hf_config, "served_as", None) == MANTIS:  # hf_overrides' vLLM name
            config = as_mantis(config)
        images = ImageProcessor(self.resolved.path, config, cfg.image_limit, self.tokenizer)
        images.max_model_len = cfg.max_model_len
        if cfg.mm_processor_kwargs:
            images.kwargs = images.processor_kwargs(cfg.mm_processor_kwargs)
        if cfg.mm_processor_cache_gb > 0:
            images.cache = ProcessorCache(int(cfg.mm_processor_cache_gb * 2**30))
        return images

    def _video_processor(self, images: ImageProcessor | None) -> VideoProcessor | None:
        """The host side of video prompts on VIDEO_MODELS checkpoints (multimodal/archs.py),
        built by multimodal/video_archs.py's table; None for other models and with
        limit_mm_per_prompt={"video": 0}. `images`: the image side, whose wrapper config it
        shares when there is one."""
        cfg = self.config
        if cfg.video_limit == 0 or not takes_images(self.resolved, self.hf_config):
            return None
        config = (
            images.config
            if images is not None
            else wrapper_config(self.resolved.path, cfg.trust_remote_code)
        )
        archs = (config.architectures or ()) if config is not None else ()
        build = video_processor_class(archs)
        if build is None:
            return None
        if not processor_saved(self.resolved.path):  # served as its text model (logged above)
            return None
        try:
            return build(self.resolved.path, config, self.tokenizer, cfg.video_limit, cfg)
        except ValueError as e:  # no processor settings a video can use: images only
            if isinstance(e, ProcessorFileError):  # a broken file: refused, not skipped
                raise
            logger.warning("%s: videos are not taken: %s", self.resolved.path, e)
            return None

    def _audio_processor(self) -> AudioProcessor | None:
        """The host side of audio prompts where the checkpoint's audio runs
        (multimodal/audio_archs.py); None for other models and with
        limit_mm_per_prompt={"audio": 0}."""
        cfg = self.config
        if not takes_audio(self.resolved, self.hf_config) or cfg.audio_limit == 0:
            return None
        from transformers import AutoConfig

        from paged_engine.mistral_audio import native_audio_config
        from paged_engine.models.remote_aliases import remote_config
        from paged_engine.multimodal.audio_archs import build_audio_host

        path, trust = self.resolved.path, cfg.trust_remote_code
        config = thinker_config(  # (remote_config: a renamed class, Qwen2_5OmniModel)
            native_audio_config(path)  # Voxtral's params.json: its HF wrapper's
            or remote_config(path)
            or AutoConfig.from_pretrained(path, trust_remote_code=trust)
        )
        try:
            return build_audio_host(self.resolved.path, config, self.tokenizer, cfg.audio_limit)
        except ValueError as e:  # no feature extractor saved: the text model only
            # (Whisper has no text-only model; a broken processor file is refused, not skipped)
            if is_encoder_decoder(self.hf_config) or isinstance(e, ProcessorFileError):
                raise
            logger.warning("%s: %s; serving without audio", self.resolved.path, e)
            cfg.limit_mm_per_prompt = {**(cfg.limit_mm_per_prompt or {}), "audio": 0}
            return None

    def _resolve_lengths(self) -> None:
        cfg = self.config
        limit = _max_positions(self.hf_config)
        # A yarn / linear rope scaling stretches the context past max_position_embeddings (as
        # vLLM allows, e.g. Qwen's YaRN recipe); the default stays the config's own length.
        stretched = max(limit or 0, scaled_context_limit(self.hf_config) or 0) or None
        if cfg.max_model_len is None:
            # longrope (Phi-3.5, Phi-4-mini): the original context, as vLLM defaults it
            original = longrope_default_context(self.hf_config)
            cfg.max_model_len = min(original, limit or original) if original else limit
            cfg.max_model_len = cfg.max_model_len or _DEFAULT_MAX_MODEL_LEN
        elif stretched is not None and cfg.max_model_len > stretched:
            # the key that set the limit (an encoder's may differ from its key: RoBERTa's offset)
            keys = [k for k in CONTEXT_LENGTH_KEYS if getattr(self.hf_config, k, None) == limit]
            origin = f"the config's {keys[0]}={limit}" if keys else f"{limit}"
            scaled = ", stretched by its rope scaling" if stretched != limit else ""
            if is_dynamic_ntk(self.hf_config):
                # vLLM would serve it with one base fixed at max_position x factor: angles HF
                # computes for no sequence
                scaled += (
                    "; its dynamic NTK rope grows its base with each sequence's length past "
                    "it, as HF computes it, which paged does not serve"
                )
            raise ValueError(
                f"max_model_len={cfg.max_model_len} exceeds the model's maximum "
                f"context length {stretched} ({origin}{scaled})"
            )
        if cfg.max_num_batched_tokens is None:
            cfg.max_num_batched_tokens = max(8192, cfg.max_num_seqs)
        if not cfg.enable_chunked_prefill and cfg.max_num_batched_tokens < cfg.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={cfg.max_num_batched_tokens} is smaller than "
                f"max_model_len={cfg.max_model_len} and chunked prefill is off: a long prompt "
                "could never be scheduled"
            )


def auto_async_scheduling(device: torch.device) -> bool:
    """async_scheduling=None: on where the device computes asynchronously (CUDA), so the host
    schedules the next step while the device runs this one. On CPU the forward computes on the
    host itself; async scheduling then runs it on a worker thread (opt in with True)."""
    return device.type == "cuda"


_DEFAULT_MAX_MODEL_LEN = 2048


def _max_positions(hf_config) -> int | None:
    """The model's context limit; None for a pure state-space model (no attention, no
    positions: Mamba), whose max_model_len is the user's choice (default 2048)."""
    if is_hybrid(hf_config) and num_kv_layers(hf_config) == 0:
        return None
    encoder = encoder_class(hf_config)
    if encoder is not None:  # RoBERTa's positions start past the padding id
        return encoder.max_positions(hf_config)
    for key in CONTEXT_LENGTH_KEYS:
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return _DEFAULT_MAX_MODEL_LEN


def _think_ids(reasoning_config: dict | None, tokenizer: Any) -> tuple[list[int], list[int]] | None:
    """reasoning_config's markers as token ids (thinking_token_budget), None without one."""
    if reasoning_config is None:
        return None
    ids = [
        tokenizer.encode(reasoning_config[k], add_special_tokens=False)
        for k in ("think_start_str", "think_end_str")
    ]
    if not all(ids):
        raise ValueError(f"reasoning_config: a marker tokenizes to nothing: {reasoning_config}")
    return ids[0], ids[1]


def _eos_ids(hf_config, tokenizer, resolved: ResolvedModel) -> set[int]:
    """EOS ids of the config, the tokenizer and generation_config.json (chat models list their
    end-of-turn token there, e.g. Qwen2.5's <|endoftext|> besides <|im_end|>; vLLM stops on all)."""
    ids: set[int] = set()
    gen_eos = None
    gen_path = resolved.path / "generation_config.json"
    if not resolved.is_gguf and gen_path.is_file():
        try:
            gen_eos = json.loads(gen_path.read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            gen_eos = None  # a broken generation config only loses its extra stop ids
        # Readable but wrong: an id that is no int would be dropped (generation then runs
        # past where transformers stops, or fails there): refused, as transformers' generate
        # refuses it on use.
        items = gen_eos if isinstance(gen_eos, list) else [gen_eos]
        if any(isinstance(x, bool) or not isinstance(x, int) for x in items if gen_eos is not None):
            raise ValueError(
                f"{gen_path}: eos_token_id must be a token id or a list of token ids, got "
                f"{gen_eos!r:.80}"
            )
    sources = (getattr(hf_config, "eos_token_id", None), tokenizer.eos_token_id, gen_eos)
    for source in sources:
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(x) for x in source)
    return ids


def check_priority(priority: object, policy: str) -> None:
    """A request's priority: an int; non-zero only under the priority policy (as in vLLM)."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority must be an int, got {priority!r}")
    if not -(1 << 63) <= priority < 1 << 63:
        raise ValueError(f"priority must fit in 64 bits, got {priority}")
    if priority and policy != "priority":
        raise ValueError(
            f"priority={priority} needs priority scheduling: start the engine with "
            "scheduling_policy='priority' (--scheduling-policy priority)"
        )


def _read_template(value: str) -> str:
    """--chat-template takes the template itself or a path to a file holding it."""
    from pathlib import Path

    path = Path(value)
    if len(value) < 4096 and "{" not in value and path.is_file():
        return path.read_text()
    return value
