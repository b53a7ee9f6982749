"""`Worker`: one device. Loads the model, sizes and owns the KV cache, runs scheduled steps.

The engine core reaches it only through an executor with plain data (`SchedulerOutput` in,
`AsyncRunnerOutput` out), so the same worker can live in another process or thread.
"""

from __future__ import annotations

import functools
import gc
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from paged_engine.attention import get_attention_backend, resolve_backend_name
from paged_engine.config import CHECKPOINT_QUANTIZATIONS, EngineConfig
from paged_engine.core.sched_output import SchedulerOutput
from paged_engine.distributed.communication import all_reduce_min, gather_object
from paged_engine.distributed.parallel_state import get_parallel_state
from paged_engine.layers.batch_invariant import invariant_kernels, make_batch_invariant
from paged_engine.layers.quantization import fp16_gemm_available, require_fp16_gemm
from paged_engine.layers.triton_layers import (
    use_triton_activations,
    use_triton_norms,
    use_triton_rope,
)
from paged_engine.loader import (
    ResolvedModel,
    checkpoint_weights,
    init_dummy_weights,
    load_audio_encoder,
    load_image_encoder,
    load_model,
    resolve_dtype,
)
from paged_engine.lora.manager import LoRAManager
from paged_engine.lora.model import LoRAModel
from paged_engine.models.multimodal_text import text_model_weights
from paged_engine.packed_checkpoint import keeps_codes, packed_scheme
from paged_engine.packed_codes import KEEP_CODES
from paged_engine.quantized_checkpoint import fp8_checkpoint, quant_method
from paged_engine.spec_decode.draft_loader import attach_draft_model
from paged_engine.worker.cache_engine import CacheEngine, kv_head_dim, latent_kv
from paged_engine.worker.cpu_threads import set_cpu_threads
from paged_engine.worker.cross_attention import fit_cross_slots
from paged_engine.worker.image_embeds import ImageEmbedder
from paged_engine.worker.kv_scales import init_kv_scales
from paged_engine.worker.memory_profiler import gpu_baseline, profile_num_blocks
from paged_engine.worker.model_runner import ModelRunner
from paged_engine.worker.profiler import DIR_ENV, WorkerProfiler
from paged_engine.worker.runner_output import AsyncRunnerOutput
from paged_engine.worker.sleep import SleepingMemory, copy_weights, module_tensors
from paged_engine.worker.stage_outputs import StageSends

logger = logging.getLogger(__name__)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA device is available")
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        # An explicit index: tensors report cuda:N, so `device ==` checks only hold against it.
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class Worker:
    def __init__(self, config: EngineConfig, resolved: ResolvedModel, hf_config) -> None:
        self.config = config
        self.resolved, self.hf_config = resolved, hf_config  # _load_model reads them
        self.device = pick_device(config.device)
        self.dtype = resolve_dtype(config.dtype, hf_config)
        if config.dtype == "auto" and resolved.is_gguf and self.device.type == "cuda":
            # A GGUF file carries no compute dtype (its weights are quantized): on a GPU run in
            # bf16 (fp16 where bf16 is missing) rather than the float32 "auto" gives elsewhere.
            bf16 = torch.cuda.is_bf16_supported()
            self.dtype = torch.bfloat16 if bf16 else torch.float16
        # On this thread (every step runs on it). Ranks sharing a machine keep the share of
        # cores their launcher set unless the option says otherwise.
        single = get_parallel_state().world_size == 1
        if self.device.type == "cpu" and (single or config.cpu_num_threads is not None):
            set_cpu_threads(config.cpu_num_threads)
        if config.quantization == "fp8" and self.device.type != "cuda":
            logger.warning(
                "quantization='fp8' dequantizes its weights at every call on %s (the fast "
                "kernel is CUDA's): for speed there use 'int8', 'int4' or 'fp16'",
                self.device.type,
            )
        elif config.quantization not in (None, *CHECKPOINT_QUANTIZATIONS):
            if self.device.type != "cpu" and config.quantization != "int4":
                raise ValueError(
                    f"quantization={config.quantization!r} runs on the CPU only (torch's CPU "
                    f"weight-only kernels), not on {self.device.type}: on CUDA use 'fp8' "
                    "or 'int4'"
                )
            if config.quantization == "fp16":  # float32 activations: fail before loading
                require_fp16_gemm()
            elif config.dtype == "auto" and torch.ops.mkldnn._is_mkldnn_bf16_supported():
                self.dtype = torch.bfloat16  # the fused int8 / int4 kernels are fast in bf16
        self.quantization = self._default_quantization(config, resolved, hf_config)
        invariant = None  # the fixed-order kernel set of batch_invariant=True
        if config.batch_invariant:
            invariant = invariant_kernels(config.attention_backend, self.device, self.dtype)
        if config.compilation_level and self.device.type != "cpu":
            raise ValueError(
                f"compilation_config={config.compilation_config!r} (torch.compile) runs on the "
                f"CPU only so far, not on {self.device.type}: pass compilation_config=0"
            )
        torch.manual_seed(config.seed)
        self._baseline = None
        sized = config.num_gpu_blocks_override is not None or config.kv_cache_memory_bytes
        if self.device.type == "cuda" and not sized:
            self._baseline = gpu_baseline(self.device, config.gpu_memory_utilization)
        model = self._load_model()
        model.eval()
        if invariant is not None:
            make_batch_invariant(model, invariant)
        elif resolve_backend_name(config.attention_backend, self.device) == "triton":
            # CUDA's default; on a CPU, Triton's interpreter: fused norms (with the residual
            # adds before them), rope (with Qwen3's q/k norms) and gated SiLU
            use_triton_norms(model)
            use_triton_rope(model)
            use_triton_activations(model)
        backend = get_attention_backend(
            config.attention_backend,
            self.device,
            batch_invariant=config.batch_invariant,
            # A latent cache has its own kernel (mla_attention) whatever its width.
            head_dim=None if latent_kv(hf_config) else kv_head_dim(hf_config),
        )
        self.model_runner = ModelRunner(config, model, hf_config, self.device, backend)
        if config.enable_lora:  # slots allocated before the KV cache is sized
            self.model_runner.lora = LoRAManager(
                LoRAModel(
                    model,
                    max_loras=config.max_loras,
                    max_rank=config.max_lora_rank,
                    max_tokens=max(config.max_num_batched_tokens or 0, config.max_num_seqs),
                    dtype=self.dtype,
                    device=self.device,
                ),
                config.max_num_seqs,
            )
        first = get_parallel_state().is_first_stage
        # the media towers (first pipeline stage only): images', audio's
        towers = {
            "dtype": self.dtype,
            "device": self.device,
            "load_format": config.load_format,
            "seed": config.seed,
            "trust_remote_code": config.trust_remote_code,
        }
        encoder = audio = None
        if config.image_limit != 0 and first:
            encoder = load_image_encoder(resolved, hf_config, **towers)
            if encoder is not None:
                check_deepstack(encoder, model, config.pipeline_parallel_size)
        if config.audio_limit != 0 and first:
            audio = load_audio_encoder(resolved, hf_config, **towers)
        if first and (encoder is not None or audio is not None or config.enable_prompt_embeds):
            # images embedded at their placeholders, prompt_embeds rows at theirs; the token
            # embedding as the model's first stage computes it (Gemma scales it, and so does
            # HF's input embedding there: prompt_embeds rows go after the scale, as images do)
            lookup = model.get_submodule(model.embed_path)
            owner = model.get_submodule(model.embed_path.rpartition(".")[0])
            embed = getattr(owner, "embed_input_ids", None)
            # idle features kept for reuse: one full step's rows of the text hidden size
            elems = (config.max_num_batched_tokens or 0) * int(hf_config.hidden_size)
            self.model_runner.images = ImageEmbedder(
                encoder,
                lookup if embed is None else embed,
                lookup if embed is None else None,
                self.device,
                cache_elems=elems,
                audio_encoder=audio,
            )
        attach_draft_model(self.model_runner, self.quantization, resolved)  # drafts, heads
        init_kv_scales(self.model_runner)  # fp8 caches: before anything is written to one
        # start_profile / stop_profile: on when the environment names a trace directory.
        self.profiler = WorkerProfiler.from_env(get_parallel_state().rank, self.device)
        self.memory = SleepingMemory(self.device)  # sleep mode's freed storages
        # pipeline stages: the async sends a later step proved received are dropped
        pp = config.pipeline_parallel_size
        self.stage_sends = StageSends(pp) if pp > 1 else None

    def _load_model(self) -> torch.nn.Module:
        """The checkpoint's model on this rank's device, dtype and quantization."""
        cfg = self.config
        return load_model(
            self.resolved,
            self.hf_config,
            dtype=self.dtype,
            device=self.device,
            load_format=cfg.load_format,
            seed=cfg.seed,
            quantization=self.quantization,
            max_model_len=cfg.max_model_len,
        )

    def _default_quantization(
        self, config: EngineConfig, resolved: ResolvedModel, hf_config
    ) -> str | None:
        """`config.quantization`; KEEP_CODES for a 4-bit GPTQ / AWQ / W4A16 checkpoint on CUDA
        (its own codes, packed_codes.py), "int4" (the codes, bf16 activations: sets self.dtype)
        for one on a CPU with bf16 support and dtype="auto"; else "fp8" for an FP8
        checkpoint on CUDA (its weights stay 8-bit, as vLLM runs them); else "fp16" for a GGUF
        checkpoint on an x86 CPU when neither dtype nor quantization was chosen: its weights
        are 4-8 bit already, float16 holds each of them to 2**-11 of itself, and matmuls that
        read half of float32's bytes decode about 1.85x faster (docs/engine.md).
        dtype="float32" keeps float32 weights."""
        if config.quantization in CHECKPOINT_QUANTIZATIONS:
            # vLLM's name for the checkpoint's own scheme: it must be the checkpoint's
            wanted, method = CHECKPOINT_QUANTIZATIONS[config.quantization], quant_method(hf_config)
            if method != wanted:
                raise ValueError(
                    f"quantization={config.quantization!r} but the checkpoint's quant_method is "
                    f"{method!r}: leave quantization unset to load the checkpoint as it is"
                )
        # A 4-bit checkpoint's codes run as they are: on CUDA through the int4 Triton kernel;
        # on a CPU with bf16 support, with dtype="auto", as quantization="int4" (torch's fused
        # int4 kernel over bf16 activations: 3x a dense float32 model's one-stream decode on the
        # project's CPU; the layers the codes cannot serve rounded to int4 too). dtype="float32"
        # keeps it dense and float32 (docs/engine.md).
        codes = keeps_codes(packed_scheme(hf_config)) and not config.batch_invariant
        checkpoint_scheme = config.quantization in (None, *CHECKPOINT_QUANTIZATIONS)
        if codes and checkpoint_scheme and self.device.type == "cuda":
            logger.info("4-bit checkpoint: linear layers keep its codes (int4 kernels)")
            return KEEP_CODES
        if (
            codes
            and checkpoint_scheme
            and self.device.type == "cpu"
            and config.dtype == "auto"
            and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        ):
            logger.info(
                "4-bit checkpoint on CPU: its codes kept as int4 with bfloat16 activations "
                "(dtype='float32' loads it dense)"
            )
            self.dtype = torch.bfloat16
            return "int4"
        if config.quantization in CHECKPOINT_QUANTIZATIONS:
            return None
        if (
            config.quantization is None
            and self.device.type == "cuda"
            and not config.batch_invariant
            and fp8_checkpoint(hf_config)
        ):
            logger.info("FP8 checkpoint on CUDA: linear weights and experts stay FP8")
            return "fp8"
        if (
            config.quantization is None
            and config.dtype == "auto"
            and resolved.is_gguf
            and self.device.type == "cpu"
            and not config.batch_invariant
            and fp16_gemm_available()
        ):
            logger.info(
                "GGUF on CPU: linear weights in float16 through fbgemm, float32 arithmetic "
                "(dtype='float32' keeps float32 weights)"
            )
            return "fp16"
        return config.quantization

    def determine_num_blocks(self) -> int:
        """Blocks every rank can hold: the minimum over the world (each rank profiles its own
        shard and device); an encoder-decoder model's cross-attention pool comes out of them
        (the same on every rank: a slot holds this rank's heads, as a block does)."""
        runner = self.model_runner
        num_blocks = all_reduce_min(profile_num_blocks(runner, baseline_used=self._baseline))
        if runner.cross is not None:
            block_bytes = CacheEngine.bytes_per_block(
                self.hf_config, self.config.block_size, runner.kv_cache_dtype
            )
            num_blocks = fit_cross_slots(
                self.config, num_blocks, block_bytes, runner.cross.slot_bytes
            )
        return num_blocks

    def snapshot_costs(self) -> tuple[int, int]:
        """(KV bytes of one block, recurrent-state bytes of one row) on this rank: what a
        block frees against what a prefix-cache state snapshot takes (pipeline stages hold
        different layers, so their ratios differ)."""
        runner = self.model_runner
        block = CacheEngine.bytes_per_block(
            self.hf_config, self.config.block_size, runner.kv_cache_dtype
        )
        return block, (0 if runner.states is None else runner.states.nbytes_per_row)

    def initialize_cache(self, num_blocks: int, num_state_snapshots: int = 0) -> None:
        self.model_runner.init_kv_cache(num_blocks, num_state_snapshots)

    def execute_model(self, sched: SchedulerOutput) -> AsyncRunnerOutput:
        out = self.model_runner.execute_model(sched)
        if self.stage_sends is not None and sched.seq_ids:  # a step the stages ran
            self.stage_sends.step_done()
        return out

    def collective_rpc(
        self, method: str | Callable[..., Any], args: tuple = (), kwargs: dict | None = None
    ) -> list[Any] | None:
        """Run `method` (a Worker method's name, or a function called as fn(worker, *args,
        **kwargs)) on this rank; rank 0 returns every rank's result, in rank order, and raises
        RpcError if any rank failed (every rank has returned by then: none is left behind
        in a collective)."""
        fn = getattr(self, method) if isinstance(method, str) else functools.partial(method, self)
        try:
            result: tuple[bool, Any] = (True, fn(*args, **(kwargs or {})))
        except Exception as e:  # reported by rank 0 below
            result = (False, f"{type(e).__name__}: {e}")
        results = gather_object(result)
        if results is None:
            return None
        failed = [(rank, msg) for rank, (ok, msg) in enumerate(results) if not ok]
        if failed:
            rank, msg = failed[0]
            raise RpcError(f"collective_rpc({_rpc_name(method)}) failed on rank {rank}: {msg}")
        return [value for _, value in results]

    @torch.no_grad()
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy HF-named tensors (all of the model's or some) into this rank's shard of the
        weights, in place (CUDA graphs keep replaying them); returns the parameters updated.
        The caller resets the prefix cache (its KV came from the old weights)."""
        if self.quantization is not None:
            raise ValueError(
                f"update_weights cannot run on quantization={self.quantization!r} weights (the "
                "dense weights were dropped at load)"
            )
        self._check_weights_awake("update_weights")
        model = self.model_runner.model
        weights = text_model_weights(weights, getattr(model, "config", None))  # VLM names -> ours
        loaded = model.load_weights(
            ((name, w.to(self.device)) for name, w in weights), strict=False
        )
        return len(loaded)

    @torch.no_grad()
    def reload_weights(self) -> int:
        """vLLM's: the checkpoint's weights again, in place (after a level-2 sleep, or to undo
        update_weights); returns the tensors written. Quantized weights are rebuilt in a
        second model and copied over (the dense ones they came from were dropped at load), so
        this rank briefly holds its weights twice."""
        self._check_weights_awake("reload_weights")
        model, cfg = self.model_runner.model, self.config
        if self.quantization is None and cfg.load_format == "dummy":
            init_dummy_weights(model, cfg.seed)
            return sum(1 for _ in model.parameters())
        if self.quantization is None:
            weights = checkpoint_weights(
                self.resolved, self.hf_config, self.dtype, self.device, cfg.load_format
            )
            return len(model.load_weights(weights))
        fresh = self._load_model()
        count = copy_weights(model, fresh)
        del fresh
        self._release_cached_memory()
        return count

    # ---- sleep mode (vLLM's sleep / wake_up; worker/sleep.py) --------------------------------
    def sleep(self, tags: list[str], offload: bool = True) -> int:
        """Give back this rank's device memory of `tags` ("weights", "kv_cache"); `offload`
        keeps a host copy of the weights (level 1), else only the buffers are kept (level 2).
        Returns the bytes freed. The engine has run every step it submitted."""
        runner = self.model_runner
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        runner.graphs = None  # they point at memory freed here: captured again on wake-up
        kv = list(runner.kv_tensors())
        if runner.images is not None:  # the encoder cache's idle features
            runner.images.clear_idle()
        freed = 0
        if "kv_cache" in tags and "kv_cache" not in self.memory.asleep:
            freed += self.memory.sleep("kv_cache", ((t, False) for t in kv), offload=False)
        if "weights" in tags and "weights" not in self.memory.asleep:
            kv_ptrs = {t.untyped_storage().data_ptr() for t in kv}
            freed += self.memory.sleep(
                "weights", self._weight_tensors(), offload=offload, exclude=kv_ptrs
            )
        self._release_cached_memory()
        logger.info("sleep (%s) freed %.2f GiB", ", ".join(tags), freed / 2**30)
        return freed

    def wake_up(self, tags: list[str]) -> None:
        """Take the memory of `tags` back (see SleepingMemory.wake_up); with nothing left
        asleep, capture the CUDA graphs again."""
        for tag in tags:
            self.memory.wake_up(tag)
        if not self.memory.asleep:
            self.model_runner.capture_graphs()

    def _weight_tensors(self):
        """The "weights" tag: the model's tensors, and a draft model's and the vision tower's
        as buffers (kept at every level: reload_weights reads the text model's weights only)."""
        runner = self.model_runner
        yield from module_tensors(runner.model)
        kept = [runner.draft.model] if runner.draft is not None else []
        if runner.images is not None and runner.images.encoder is not None:
            kept.append(runner.images.encoder)
        for module in kept:
            yield from ((t, False) for t, _ in module_tensors(module))

    def _check_weights_awake(self, what: str) -> None:
        if "weights" in self.memory.asleep:
            raise RuntimeError(f"{what}: the weights are asleep; wake_up(tags=['weights']) first")

    def _release_cached_memory(self) -> None:
        """Hand the caching allocator's free blocks back to the driver (CUDA)."""
        if self.device.type == "cuda":
            gc.collect()  # CUDA graphs just dropped hold their memory pool until collected
            torch.cuda.empty_cache()

    def start_profile(self, profile_prefix: str | None = None) -> None:
        self._profiler().start(profile_prefix)

    def stop_profile(self) -> str:
        """This rank's trace file."""
        return self._profiler().stop()

    def _profiler(self) -> WorkerProfiler:
        if self.profiler is None:
            raise RuntimeError(
                f"profiling is off: start the engine with {DIR_ENV} (or VLLM_TORCH_PROFILER_DIR) "
                "naming a directory for the traces"
            )
        return self.profiler

    def add_lora(self, lora_id: int, path: str, report: bool = False) -> None:
        """Read and pack this rank's part of an adapter into host memory; ValueError when it
        does not fit. `report` (ranks > 0, after rank 0 packed its part): the error is not
        raised but gathered to rank 0 (None: packed), so no rank leaves the world over it."""
        try:
            lora = self.model_runner.lora
            if lora is None:
                raise ValueError("lora_request needs an engine started with enable_lora=True")
            lora.add(lora_id, path)
        except ValueError as e:
            if not report:
                raise
            gather_object(str(e))
            return
        if report:
            gather_object(None)

    def remove_lora(self, lora_id: int) -> None:
        if self.model_runner.lora is not None:
            self.model_runner.lora.remove(lora_id)


class RpcError(RuntimeError):
    """A collective_rpc function failed on some rank; every rank returned (the engine goes on)."""


def _rpc_name(method: str | Callable[..., Any]) -> str:
    return method if isinstance(method, str) else getattr(method, "__name__", repr(method))


def check_deepstack(encoder: nn.Module, model: nn.Module, stages: int) -> None:
    """Qwen3-VL's deepstack rows are added after the first k decoder layers, which must all be
    on the first pipeline stage (where the image encoder runs)."""
    deepstack = getattr(encoder, "num_deepstack", 0)
    if not deepstack:
        return
    built = len(list(model.model.stage.layers(model.model.layers)))
    if deepstack > built:
        raise ValueError(
            f"pipeline_parallel_size={stages}: the first stage holds {built} layers, fewer than "
            f"the {deepstack} that take Qwen3-VL's deepstack image features; use fewer stages"
        )
