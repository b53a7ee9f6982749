"""`LLMEngine`: the step loop the offline `LLM` and the HTTP server both drive.

    add_request -> scheduler queue
    step():  schedule (CPU) -> model runner (device) -> scheduler bookkeeping -> sample + outputs
    abort_request -> every block the request held is free again

Not thread-safe: one thread owns the engine (the server funnels everything through its engine
thread).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from paged_engine.core.block_manager import BlockManager
from paged_engine.config import EngineConfig
from paged_engine.default_model import default_model_path
from paged_engine.engine.input_processor import InputProcessor
from paged_engine.loader import (
    ResolvedModel,
    load_hf_config,
    load_model,
    load_tokenizer,
    resolve_dtype,
    resolve_model,
)
from paged_engine.worker.model_runner import ModelRunner
from paged_engine.engine.output_processor import OutputProcessor
from paged_engine.outputs import RequestOutput
from paged_engine.core.request import Request
from paged_engine.sampling_params import BeamSearchParams, SamplingParams
from paged_engine.core.scheduler import Scheduler

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineStats:
    """A snapshot of the engine; `kv_*` figures are over the running sequences right now."""

    num_running: int
    num_waiting: int
    num_total_blocks: int
    num_used_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    kv_cache_usage: float  # used / total blocks, 0..1
    kv_slots_allocated: int  # block slots held by running sequences (shared blocks once)
    kv_tokens_stored: int  # distinct tokens those slots hold
    kv_waste_perc: float  # 100 * (allocated - stored) / allocated
    blocks_saved_by_sharing: int  # table entries minus distinct blocks (fork and prefix sharing)
    prefix_cache_queries: int  # tokens looked up at admission
    prefix_cache_hits: int  # tokens found cached
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    peak_used_blocks: int
    block_size: int


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **kwargs: Any) -> None:
        config = config if config is not None else EngineConfig.from_kwargs(**kwargs)
        if config.model is None:
            config.model = str(default_model_path())
        self.config = config
        t0 = time.perf_counter()
        self.resolved = resolve_model(config.model)
        self.hf_config = load_hf_config(self.resolved)
        self.tokenizer = load_tokenizer(
            self.resolved if config.tokenizer is None else resolve_model(config.tokenizer),
            trust_remote_code=config.trust_remote_code,
        )
        if config.chat_template is not None:
            self.tokenizer.chat_template = _read_template(config.chat_template)
        self.device = _pick_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.hf_config)
        if config.dtype == "auto" and self.resolved.is_gguf and self.device.type == "cuda":
            # A GGUF file carries no compute dtype (its weights are quantized): on a GPU run in
            # bf16 (fp16 where bf16 is missing) rather than the float32 "auto" gives elsewhere.
            bf16 = torch.cuda.is_bf16_supported()
            self.dtype = torch.bfloat16 if bf16 else torch.float16
        self._resolve_lengths()
        torch.manual_seed(config.seed)
        gpu_baseline = None
        if self.device.type == "cuda" and config.num_gpu_blocks_override is None:
            gpu_baseline = _gpu_baseline(self.device, config.gpu_memory_utilization)
        self.model = load_model(
            self.resolved,
            self.hf_config,
            dtype=self.dtype,
            device=self.device,
            load_format=config.load_format,
            seed=config.seed,
        )
        self.model.eval()
        self.model_runner = ModelRunner(config, self.model, self.hf_config, self.device)
        num_blocks = self.model_runner.profile_num_blocks(baseline_used=gpu_baseline)
        usable = num_blocks - 1  # block 0 is the null block
        if usable * config.block_size < config.max_model_len:
            raise ValueError(
                f"the KV cache holds {max(usable, 0) * config.block_size} tokens "
                f"({num_blocks} blocks of {config.block_size}), fewer than max_model_len="
                f"{config.max_model_len}: raise gpu_memory_utilization (or cpu_kv_cache_gib / "
                "num_gpu_blocks_override) or lower max_model_len"
            )
        self.model_runner.init_kv_cache(num_blocks)
        self.block_manager = BlockManager(
            num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
        )
        self.eos_token_ids = _eos_ids(self.hf_config, self.tokenizer, self.resolved)
        self.output_processor = OutputProcessor(
            self.tokenizer,
            self.scheduler,
            max_model_len=config.max_model_len,
            eos_token_ids=self.eos_token_ids,
            device=self.device,
        )
        self.vocab_size = _vocab_size(self.hf_config)
        self.input_processor = InputProcessor(
            self.tokenizer,
            config,
            vocab_size=self.vocab_size,
            eos_token_ids=self.eos_token_ids,
            device=self.device,
        )
        self._requests: dict[str, Request] = {}
        self.prompt_tokens_total = 0
        self.peak_used_blocks = 0
        self.num_blocks = num_blocks
        logger.info(
            "engine ready in %.1fs: %s on %s (%s), %d KV blocks of %d tokens",
            time.perf_counter() - t0,
            config.model,
            self.device,
            self.dtype,
            num_blocks,
            config.block_size,
        )

    # ---- requests -------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | dict,
        params: SamplingParams | BeamSearchParams | None = None,
        arrival_time: float | None = None,
        *,
        final_only: bool = False,
    ) -> None:
        """Queue a request; raises ValueError (naming the parameter) on bad input.

        `final_only`: `step()` reports this request once, when it finishes (what offline
        generation needs), instead of after every step (what streaming needs)."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        req = self.input_processor.make_request(
            request_id, prompt, params, arrival_time, final_only=final_only
        )
        self._requests[request_id] = req
        self.scheduler.add_request(req)
        self.prompt_tokens_total += len(req.prompt_token_ids)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            if self._requests.pop(rid, None) is not None:
                self.scheduler.abort_request(rid)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.num_running + self.scheduler.num_waiting

    # ---- the step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched_out = self.scheduler.schedule()
        if not sched_out.scheduled:
            return []
        model_out = self.model_runner.execute(sched_out)
        self.scheduler.update_after_step(sched_out)
        outputs = self.output_processor.process(model_out)
        bm = self.block_manager
        self.peak_used_blocks = max(self.peak_used_blocks, bm.num_total_blocks - bm.num_free_blocks)
        for out in outputs:
            if out.finished:
                self._requests.pop(out.request_id, None)
        return outputs

    # ---- chat and stats -------------------------------------------------------------------------
    def apply_chat_template(
        self,
        messages: list[dict],
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        template = chat_template or self.tokenizer.chat_template
        if template is None:
            raise ValueError("the model has no chat template; pass chat_template")
        return self.tokenizer.apply_chat_template(
            messages,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )

    def get_stats(self) -> EngineStats:
        bm = self.block_manager.stats()
        sharing = self.block_manager.sharing_stats(self.scheduler.running_seqs())
        allocated = sharing.slots_allocated
        waste = 100.0 * (allocated - sharing.tokens_stored) / allocated if allocated else 0.0
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_total_blocks=bm.num_total_blocks,
            num_used_blocks=bm.num_used_blocks,
            num_free_blocks=bm.num_free_blocks,
            num_cached_blocks=bm.num_cached_blocks,
            kv_cache_usage=bm.num_used_blocks / bm.num_total_blocks if bm.num_total_blocks else 0,
            kv_slots_allocated=allocated,
            kv_tokens_stored=sharing.tokens_stored,
            kv_waste_perc=waste,
            blocks_saved_by_sharing=sharing.blocks_saved,
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.output_processor.generation_tokens_total,
            peak_used_blocks=self.peak_used_blocks,
            block_size=self.config.block_size,
        )

    def _resolve_lengths(self) -> None:
        cfg = self.config
        limit = _max_positions(self.hf_config)
        if cfg.max_model_len is None:
            cfg.max_model_len = limit
        elif limit is not None and cfg.max_model_len > limit:
            raise ValueError(
                f"max_model_len={cfg.max_model_len} exceeds the model's maximum "
                f"context length {limit}"
            )
        if cfg.max_num_batched_tokens is None:
            cfg.max_num_batched_tokens = max(8192, cfg.max_num_seqs)
        if not cfg.enable_chunked_prefill and cfg.max_num_batched_tokens < cfg.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={cfg.max_num_batched_tokens} is smaller than "
                f"max_model_len={cfg.max_model_len} and chunked prefill is off: a long prompt "
                "could never be scheduled"
            )


def _pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA device is available")
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        # An explicit index: tensors report cuda:N, so `device ==` checks (a seeded generator vs
        # the logits in the sampler) only hold against cuda:N.
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _gpu_baseline(device: torch.device, utilization: float) -> int:
    """Bytes in use on the device before the engine loads anything (other processes, the CUDA
    context). The engine's share, total * utilization, must be free now: fail early if not."""
    free, total = torch.cuda.mem_get_info(device)
    want = total * utilization
    if free < want:
        raise ValueError(
            f"gpu_memory_utilization={utilization} asks for {want / 2**30:.1f} GiB of {device} "
            f"({total / 2**30:.1f} GiB), but only {free / 2**30:.1f} GiB is free (other processes "
            "hold the rest): lower gpu_memory_utilization"
        )
    return total - free


def _max_positions(hf_config) -> int:
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


def _vocab_size(hf_config) -> int:
    return int(hf_config.vocab_size)


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
    sources = (getattr(hf_config, "eos_token_id", None), tokenizer.eos_token_id, gen_eos)
    for source in sources:
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(x) for x in source)
    return ids


def _read_template(value: str) -> str:
    """--chat-template takes the template itself or a path to a file holding it."""
    from pathlib import Path

    path = Path(value)
    if len(value) < 4096 and "{" not in value and path.is_file():
        return path.read_text()
    return value
