"""`paged-server` / `python -m paged_server`: startup (port, engine, routes) and graceful
shutdown; the flags and their checks live in cli_args.py."""

from __future__ import annotations

import argparse
import copy
import json
import logging
import logging.config
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from paged_server.cli_args import cors_policy, parse_args, served_names, tls_config
from paged_server.http import Server
from paged_server.lora import load_lora_modules, runtime_updates_allowed
from paged_server.tls import TLS
from paged_server.vllm_flags import warn_ignored

if TYPE_CHECKING:
    from paged_server.app import OpenAIApp
    from paged_server.engine_client import EngineClient

log = logging.getLogger("paged_server")


def reasoning_config(given: dict | None, parser: str | None) -> dict | None:
    """--reasoning-config, or the markers of a --reasoning-parser that has one opener and one
    closer (thinking_token_budget counts between them)."""
    if given is not None or parser is None:
        return given
    from paged_server.reasoning import THINK_FORMATS

    fmt = THINK_FORMATS.get(parser)
    if fmt is None or len(fmt.opens) != 1 or len(fmt.closes) != 1:
        return None
    return {"think_start_str": fmt.opens[0], "think_end_str": fmt.closes[0]}


def build_engine(args: argparse.Namespace) -> Any:
    """The engine (it imports torch; we never do)."""
    from paged_engine import EngineConfig, LLMEngine

    _check_executor(args)

    model = args.model
    if model is None:
        from paged_engine.default_model import default_model_path

        model = str(default_model_path())
    config = EngineConfig(
        model=model,
        revision=args.revision,
        tokenizer=args.tokenizer,
        tokenizer_revision=args.tokenizer_revision,
        download_dir=args.download_dir,
        hf_token=args.hf_token,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
        max_logprobs=args.max_logprobs,
        stream_interval=args.stream_interval,
        seed=args.seed,
        load_format=args.load_format,
        config_format=args.config_format,
        trust_remote_code=args.trust_remote_code,
        enforce_eager=args.enforce_eager,
        compilation_config=args.compilation_config,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        speculative_config=args.speculative_config,
        kv_transfer_config=args.kv_transfer_config,
        logits_processors=args.logits_processors,
        worker_extension_cls=args.worker_extension_cls,
        model_impl=args.model_impl,
        pooler_config=args.pooler_config,
        hf_overrides=args.hf_overrides,
        runner=args.runner,
        async_scheduling=args.async_scheduling,
        convert=args.convert,
        task=args.task,
        chat_template=args.chat_template,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        kv_cache_dtype=args.kv_cache_dtype,
        mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
        prefix_state_snapshots=args.prefix_state_snapshots,
        swap_space=args.swap_space,
        preemption_mode=args.preemption_mode,
        cpu_offload_gib=args.cpu_offload_gib,
        quantization=args.quantization,
        batch_invariant=args.batch_invariant,
        cpu_num_threads=args.cpu_num_threads,
        generation_config=args.generation_config,
        override_generation_config=args.override_generation_config,
        scheduling_policy=args.scheduling_policy,
        enable_sleep_mode=args.enable_sleep_mode,
        limit_mm_per_prompt=args.limit_mm_per_prompt,
        mm_processor_kwargs=args.mm_processor_kwargs,
        mm_processor_cache_gb=args.mm_processor_cache_gb,
        enable_mm_embeds=args.enable_mm_embeds,
        enable_prompt_embeds=args.enable_prompt_embeds,
        reasoning_config=reasoning_config(args.reasoning_config, args.reasoning_parser),
        **_lora_config(args),
    )
    return LLMEngine(config)


def _lora_config(args: argparse.Namespace) -> dict[str, Any]:
    """The LoRA engine args; none without --enable-lora (the engine's defaults: off)."""
    if not args.enable_lora:
        return {}
    return {
        "enable_lora": True,
        "max_loras": args.max_loras,
        "max_lora_rank": args.max_lora_rank,
        "max_cpu_loras": args.max_cpu_loras,
    }


def _generates(engine: Any) -> bool:
    """Whether the engine runs the "generate" task (vLLM's get_supported_tasks)."""
    tasks = getattr(engine, "get_supported_tasks", None)
    return tasks is None or "generate" in tasks()


def build_app(args: argparse.Namespace, engine: Any) -> tuple[EngineClient, OpenAIApp]:
    """The engine loop (not started yet) and the routes over it.

    The routes get a copy of the engine's tokenizer, made before the engine loop starts: the
    engine's is the engine and output threads' alone, which only read it (HF fast tokenizers fail
    with "Already borrowed" when two threads use one while either changes its settings, e.g.
    truncation or padding). The --lora-modules adapters are loaded into the engine here, on the
    thread that owns it, before its loop starts; ValueError naming one the engine refuses (or
    a bad --allowed-local-media-path / image fetch timeout).
    """
    # Imported here, not at the top: `main` binds the port before anything heavier than the
    # HTTP server is imported (the engine client pulls in the engine's modules).
    from paged_server.app import OpenAIApp
    from paged_server.engine_client import EngineClient
    from paged_server.media import DEFAULT_NUM_FRAMES, MediaLoader, fetch_timeout, media_io_kwargs
    from paged_server.metrics import Metrics

    model_path = str(getattr(engine.config, "model", args.model))
    names = served_names(args)
    if args.lora_modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    lora = load_lora_modules(engine, args.lora_modules or [], names, enabled=args.enable_lora)
    media = MediaLoader(
        args.allowed_local_media_path,
        {kind: fetch_timeout(kind=kind) for kind in ("image", "video", "audio")},
        num_frames=media_io_kwargs(args.media_io_kwargs) or DEFAULT_NUM_FRAMES,
        domains=args.allowed_media_domains,
    )
    metrics = Metrics(names[0], args.metrics_prefix)
    client = EngineClient(engine, metrics=metrics, max_queued_requests=args.max_queued_requests)
    app = OpenAIApp(
        client,
        copy.deepcopy(engine.tokenizer),
        served_model_names=names,
        model_path=model_path,
        max_model_len=engine.config.max_model_len,
        api_key=args.api_key,
        trust_request_chat_template=args.trust_request_chat_template,
        chat_template_content_format=args.chat_template_content_format,
        default_template_kwargs=args.default_chat_template_kwargs,
        exclude_tools_when_none=args.exclude_tools_when_tool_choice_none,
        engine_version=getattr(sys.modules.get("paged_engine"), "__version__", None),
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        lora=lora,
        runtime_lora_updates=runtime_updates_allowed(),
        sampling_defaults=getattr(engine, "generation_defaults", None),
        prompt_tokens_details=args.enable_prompt_tokens_details,
        tokens_as_ids=args.return_tokens_as_token_ids,
        tokenizer_info=args.enable_tokenizer_info_endpoint,
        response_role=args.response_role,
        log_requests=_log_requests(args),
        log_outputs=_log_cut(args) if args.enable_log_outputs else None,
        classifier=getattr(engine, "classifier", None),
        generates=_generates(engine),
        force_include_usage=args.enable_force_include_usage,
        load_tracking=args.enable_server_load_tracking,
        # the model's image processor (None: a text model, or served text-only)
        images=getattr(getattr(engine, "input_processor", None), "images", None),
        # the video processor of a VIDEO_MODELS checkpoint (None: the model takes no videos)
        videos=getattr(getattr(engine, "input_processor", None), "videos", None),
        # the audio side of a checkpoint whose audio runs (None: the model takes no audio)
        audios=getattr(getattr(engine, "input_processor", None), "audios", None),
        multimodal=getattr(getattr(engine, "input_processor", None), "multimodal", None),
        mm_limits=args.limit_mm_per_prompt,
        media=media,
        mm_embeds=args.enable_mm_embeds,
        # --enable-prompt-embeds: the width the engine checks rows against
        prompt_embeds_width=getattr(getattr(engine, "input_processor", None), "embeds_width", None),
        max_logprobs=int(getattr(engine.config, "max_logprobs", 20)),
        # a text encoder-decoder (BART, Florence-2: engine/encoder_prompt.py)
        encoder_decoder=(
            getattr(getattr(engine, "input_processor", None), "encoder_prompts", None) is not None
        ),
    )
    return client, app


def _check_executor(args: argparse.Namespace) -> None:
    world = args.tensor_parallel_size * args.pipeline_parallel_size
    if args.distributed_executor_backend == "uni" and world > 1:
        raise ValueError(
            "--distributed-executor-backend uni runs one process: it needs tensor and pipeline "
            f"parallel size 1 (got {world} ranks); use mp"
        )


def _log_requests(args: argparse.Namespace) -> int | None:
    """How much of each prompt --enable-log-requests logs (None: requests are not logged)."""
    cut = _log_cut(args)  # checked whether or not requests are logged
    return cut if args.enable_log_requests else None


def _log_cut(args: argparse.Namespace) -> int:
    """--max-log-len: how much of a logged prompt or answer is shown (default: all)."""
    if args.max_log_len is not None and args.max_log_len < 0:
        raise ValueError(f"--max-log-len must be >= 0, got {args.max_log_len}")
    return args.max_log_len if args.max_log_len is not None else 1 << 62


def bind(args: argparse.Namespace) -> Server | None:
    """The server's socket, bound (not yet listening) before the model loads, so a busy port
    or an unreadable certificate fails at once; None after printing why it cannot serve."""
    config = tls_config(args)
    try:
        tls = TLS(config, refresh=args.enable_ssl_refresh) if config is not None else None
    except ValueError as e:
        print(f"paged-server: cannot serve HTTPS: {e}", file=sys.stderr)
        return None
    try:
        return Server(
            args.uds or (args.host, args.port),
            None,
            max_body_bytes=args.max_request_body_bytes,
            keep_alive_timeout=args.timeout_keep_alive,
            io_timeout=args.client_timeout,
            listen=False,
            cors=cors_policy(args),
            tls=tls,
            access_log=not args.disable_uvicorn_access_log,
            request_id_headers=args.enable_request_id_headers,
            log_error_stack=args.log_error_stack,
        )
    except OSError as e:
        where = f"unix:{args.uds}" if args.uds else f"{args.host}:{args.port}"
        print(f"paged-server: cannot listen on {where}: {e}", file=sys.stderr)
        return None


def server_url(server: Server) -> str:
    """Where clients reach it: scheme://host:port, or unix:PATH for a Unix socket (HTTP over
    it, e.g. `curl --unix-socket PATH http://localhost/v1/models`)."""
    if server.unix:
        return f"unix:{server.server_address}"
    host, port = server.server_address[:2]
    return f"{server.scheme}://{host}:{port}"


def api_url(server: Server) -> str:
    """The OpenAI base URL clients use (on a Unix socket: its path, then http://localhost/v1)."""
    if server.unix:
        return f"http://localhost/v1 over unix:{server.server_address}"
    return server_url(server) + "/v1"


def _freeze_startup_heap(engine: Any) -> None:
    """This process exists to serve: the garbage collector stops walking the startup heap and
    collects less often (paged_engine/engine/gc_tuning.py). Not over a test's fake engine."""
    if type(engine).__module__.startswith("paged_engine."):
        from paged_engine.engine.gc_tuning import freeze_startup_heap

        freeze_startup_heap()


def serve(args: argparse.Namespace, engine: Any, server: Server | None = None) -> int:
    """Serve `engine` until SIGINT / SIGTERM on `server` (bound here if None); returns the
    exit code."""
    server = server or bind(args)
    if server is None:
        return 2
    try:
        client, app = build_app(args, engine)
    except ValueError as e:  # an invalid --lora-modules adapter, a media setting
        server.server_close()
        shutdown = getattr(engine, "shutdown", None)
        if shutdown is not None:
            shutdown()
        print(f"paged-server: cannot start: {e}", file=sys.stderr)
        return 2
    server.app = app
    _freeze_startup_heap(engine)
    server.server_activate()  # listen: connections queue from here on
    stop = threading.Event()

    def on_engine_death() -> None:  # the engine thread, once: requests in flight have failed
        if getattr(args, "keep_alive_on_engine_death", False):
            log.error("the engine failed; answering 503 until stopped (keep-alive on death)")
        else:
            log.error(
                "the engine failed; shutting down (PAGED_KEEP_ALIVE_ON_ENGINE_DEATH=1 keeps the "
                "server up, answering 503)"
            )
            stop.set()

    client.on_engine_death = on_engine_death
    client.start(engine_thread=False)  # this thread loaded the engine: it runs the loop

    def on_signal(signum: int, _frame: Any) -> None:
        if stop.is_set():  # a second signal: stop waiting for requests
            client.abort_all()
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    serving = threading.Thread(
        target=server.serve_forever, args=(0.1,), name="http-accept", daemon=True
    )
    serving.start()
    stats = client.stats
    block_size = getattr(engine.config, "block_size", args.block_size)
    url = server_url(server)
    print(
        f"paged-server: model {app.names[0]} ({app.model_path}), max_model_len "
        f"{engine.config.max_model_len}, KV pool {stats.num_total_blocks} blocks x {block_size} "
        f"= {stats.num_total_blocks * block_size} tokens\n"
        f"paged-server: serving on {url} (OpenAI API at {api_url(server)})",
        flush=True,
    )
    warm = getattr(engine, "warm_structured_outputs", None)
    if warm is not None:  # the grammar backend, off the step thread (~1.4 s at 50k tokens)
        warm()

    def shut_down() -> None:
        stop.wait()
        log.info("shutting down: no new requests; %d in flight", client.num_in_flight())
        server.accepting = False
        server.shutdown()
        server.server_close()
        deadline = time.monotonic() + args.shutdown_timeout
        while client.num_in_flight() and time.monotonic() < deadline:
            time.sleep(0.05)
        if client.num_in_flight():
            log.info("aborting %d requests still in flight", client.num_in_flight())
            client.abort_all()
        deadline = time.monotonic() + 2.0
        while server.active_requests() and time.monotonic() < deadline:
            time.sleep(0.05)
        client.stop()

    closer = threading.Thread(target=shut_down, name="shutdown", daemon=True)
    closer.start()
    client.run_engine_loop()  # until shut_down() stops it; signals still reach this thread
    closer.join()
    shutdown = getattr(engine, "shutdown", None)
    if shutdown is not None:  # stops worker ranks (tensor / pipeline parallelism)
        shutdown()
    if client.failure is not None:  # a supervisor sees the failure in the exit code
        log.error("exiting with code 1: %s", client.failure)
        return 1
    log.info("bye")
    return 0


def serve_replicas(args: argparse.Namespace, argv: list[str], server: Server) -> int:
    """--data-parallel-size K: K child servers (engines) behind this one, until a signal."""
    from paged_server import data_parallel as dp

    try:
        per_replica = args.tensor_parallel_size * args.pipeline_parallel_size
        replicas = dp.start_replicas(dp.replica_argv(argv), args.data_parallel_size, per_replica)
    except (ValueError, RuntimeError) as e:
        server.server_close()
        print(f"paged-server: cannot start the engine replicas: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    server.app = router = dp.ReplicaRouter(
        replicas, timeout=max(args.client_timeout, 600.0), keep_alive=args.timeout_keep_alive
    )
    server.server_activate()
    threading.Thread(target=server.serve_forever, args=(0.1,), daemon=True).start()
    url = server_url(server)
    print(
        f"paged-server: {len(replicas)} engine replicas, requests to the least loaded\n"
        f"paged-server: serving on {url} (OpenAI API at {api_url(server)})",
        flush=True,
    )
    reported: set[int] = set()
    while not stop.wait(1.0):
        for r in replicas:
            if r.proc.poll() is not None and r.index not in reported:
                reported.add(r.index)
                log.error(
                    "engine replica %d exited (%s); /health answers 503", r.index, r.proc.poll()
                )
    server.accepting = False
    server.shutdown()
    server.server_close()
    router.close()  # the idle pooled connections, before the replicas go
    dp.stop_replicas(replicas)
    return 0


def torchrun_rank() -> int:
    """This process's global rank when torchrun (or a launcher setting its variables) started
    it, else 0 (as paged_engine.distributed.launch decides)."""
    launched = "TORCHELASTIC_RUN_ID" in os.environ or "MASTER_ADDR" in os.environ
    return int(os.environ.get("RANK", "0")) if launched else 0


def configure(args: argparse.Namespace) -> None:
    """Logging at --log-level (or as --log-config-file says), then the warnings the flags call
    for (once, at start)."""
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    path = args.log_config_file or os.environ.get("VLLM_LOGGING_CONFIG_PATH")
    if path:
        log_config(path)
    warn_ignored(args)  # vLLM flags that change nothing here, named once
    backend = args.guided_decoding_backend or (args.structured_outputs_config or {}).get("backend")
    if backend not in (None, "auto", "guidance", "llguidance"):
        log.warning(
            "structured outputs compile with llguidance, not %s (the same constraints)", backend
        )


def log_config(path: str) -> None:
    """vLLM's --log-config-file (or VLLM_LOGGING_CONFIG_PATH): a JSON `logging.config`
    dictionary applied over the default setup; SystemExit naming the flag when it is not one."""
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
        if not isinstance(config, dict):
            raise ValueError("the file must hold a JSON object (a logging.config dictionary)")
        logging.config.dictConfig(config)
    except (OSError, ValueError, TypeError, AttributeError, ImportError) as e:
        raise SystemExit(f"paged-server: --log-config-file {path}: {e}") from None


def serves_rank0(args: argparse.Namespace) -> bool:
    """True on the torchrun ranks > 0 of a tensor / pipeline parallel engine: torchrun started
    every rank with the same command, and these serve rank 0's engine (build_engine returns by
    SystemExit when rank 0 shuts down) instead of running the command's front."""
    return args.tensor_parallel_size * args.pipeline_parallel_size > 1 and torchrun_rank() > 0


def start_engine(args: argparse.Namespace, prog: str) -> Any | None:
    """The engine, or None after printing why it did not start (with the flag to pass when
    the model's own code needs --trust-remote-code)."""
    try:
        return build_engine(args)
    except (ValueError, NotImplementedError, FileNotFoundError, OSError, RuntimeError) as e:
        log.debug("the engine did not start", exc_info=True)
        hint = ""
        if "trust_remote_code" in str(e) and not args.trust_remote_code:
            hint = f" ({prog}: pass --trust-remote-code to run it)"
        print(f"{prog}: cannot start the engine: {e}{hint}", file=sys.stderr)
        return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run-batch"]:  # vLLM's `vllm run-batch`: a batch file offline
        from paged_server.run_batch import main as run_batch

        return run_batch(argv[1:])
    if argv[:1] in (["chat"], ["complete"]):  # vLLM's `vllm chat` / `vllm complete` clients
        from paged_server.client_cli import main as client

        return client(argv[0], argv[1:])
    args = parse_args(argv)
    configure(args)
    if serves_rank0(args):  # rank 0 serves HTTP
        build_engine(args)
        return 0
    if args.data_parallel_size < 1:
        print("paged-server: --data-parallel-size must be >= 1", file=sys.stderr)
        return 2
    server = bind(args)  # before the model: a busy port fails in a fraction of a second
    if server is None:
        return 2
    if args.data_parallel_size > 1:
        return serve_replicas(args, args.command_line, server)
    engine = start_engine(args, "paged-server")
    if engine is None:
        server.server_close()
        return 2
    return serve(args, engine, server)


if __name__ == "__main__":
    raise SystemExit(main())
