"""`paged-server` / `python -m paged_server`: flags named as in vLLM, startup, graceful shutdown."""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from paged_server.cors import CorsPolicy
from paged_server.http import Server
from paged_server.lora import (
    load_lora_modules,
    lora_names_error,
    parse_lora_module,
    runtime_updates_allowed,
)

if TYPE_CHECKING:
    from paged_server.app import OpenAIApp
    from paged_server.engine_client import EngineClient

log = logging.getLogger("paged_server")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="paged-server",
        description="OpenAI-compatible HTTP server for paged-engine.",
        usage="paged-server [serve] [MODEL] [options]  (or --model MODEL)",
    )
    p.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model, as vLLM's `vllm serve MODEL` takes it (same as --model)",
    )
    p.add_argument(
        "--model",
        default=None,
        help="HF model dir, .gguf file or hub id (downloaded unless cached or HF_HUB_OFFLINE=1);"
        " default: SmolLM2-135M-Instruct",
    )
    p.add_argument("--revision", default=None, help="hub branch, tag or commit of the model")
    p.add_argument("--tokenizer", default=None, help="tokenizer dir or hub id (default: model's)")
    p.add_argument("--tokenizer-revision", default=None, help="hub revision of --tokenizer")
    p.add_argument(
        "--download-dir", default=None, help="hub cache directory (default: huggingface_hub's)"
    )
    p.add_argument("--hf-token", default=None, help="Hub token (default: HF_TOKEN or the login)")
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="name(s) clients use; the first is reported in responses",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    for flag, what in (("origins", "origins"), ("methods", "methods"), ("headers", "headers")):
        p.add_argument(
            f"--allowed-{flag}",
            type=_json_list,
            default=None,
            help=f'CORS: allowed {what}, a JSON list or comma-separated (default: ["*"], any)',
        )
    p.add_argument(
        "--allow-credentials", action="store_true", help="CORS: allow credentials (cookies)"
    )
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    p.add_argument(
        "--speculative-config",
        type=_json_object,
        default=None,
        help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'',
    )
    p.add_argument(
        "--generation-config",
        default="auto",
        help="sampling defaults for fields a request leaves unset: 'auto' (the model's "
        "generation_config.json), 'vllm' (none) or a directory holding one",
    )
    p.add_argument(
        "--override-generation-config",
        type=_json_object,
        default=None,
        help="sampling defaults on top of --generation-config, e.g. '{\"temperature\": 0.5}'",
    )
    p.add_argument(
        "--scheduling-policy",
        choices=["fcfs", "priority"],
        default="fcfs",
        help="fcfs: arrival order; priority: a request's 'priority' first (lower runs "
        "first), then arrival; preemption takes the request that sorts last",
    )
    p.add_argument(
        "--pooler-config",
        type=_json_object,
        default=None,
        help='/v1/embeddings pooling, e.g. \'{"pooling_type": "MEAN", "normalize": true}\' '
        "(default: last token, normalized)",
    )
    p.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        help="engine replicas behind this server, each on its own GPUs (tp * pp per replica)",
    )
    p.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters: --lora-modules, or runtime loads (docs/server.md)",
    )
    p.add_argument(
        "--lora-modules",
        nargs="+",
        type=parse_lora_module,
        default=None,
        metavar="NAME=PATH",
        help='adapters served under their names: name=path, or \'{"name": ..., "path": ..., '
        '"base_model_name": ...}\' (needs --enable-lora)',
    )
    p.add_argument("--max-loras", type=int, default=1, help="distinct adapters in one batch")
    p.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank")
    p.add_argument(
        "--max-cpu-loras",
        type=int,
        default=None,
        help="adapters kept loaded in host memory (default: --max-loras)",
    )
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--distributed-executor-backend",
        choices=["mp", "uni"],
        default=None,
        help="vLLM's: 'mp' (a process per rank, what paged runs) or 'uni' (one process: "
        "tensor and pipeline parallel size 1)",
    )
    p.add_argument(
        "--tokenizer-mode",
        choices=["auto", "hf"],
        default="auto",
        help="vLLM's: paged loads the Hugging Face (fast) tokenizer in either mode",
    )
    p.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="split long prompts across steps (on by default, as in vLLM V1)",
    )
    p.add_argument(
        "--max-logprobs",
        type=int,
        default=20,
        help="the most logprobs / prompt_logprobs a request may ask for (the API caps at 20)",
    )
    p.add_argument("--num-gpu-blocks-override", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat-template", default=None, help="a Jinja template or a path to one")
    p.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="render a chat_template sent in a request (default: refuse it with a 400)",
    )
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        help="answer 429 while this many requests wait; default: unbounded",
    )
    p.add_argument("--load-format", default="auto")
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="let transformers run the model repository's own config / tokenizer code",
    )
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument(
        "--compilation-config",
        "-O",
        type=_compilation_config,
        default=None,
        help="0: eager (default); 1-3 (-O3): torch.compile the model forward (CPU), or "
        "'{\"level\": 3}'",
    )
    p.add_argument("--kv-cache-dtype", default="auto", help="auto, fp8 (= fp8_e4m3), fp8_e5m2")
    p.add_argument("--swap-space", type=float, default=0.0, help="GiB of CPU swap for preemption")
    p.add_argument("--preemption-mode", default=None, help="recompute or swap (default: by cost)")
    p.add_argument("--cpu-offload-gib", type=float, default=0.0, help="prefix cache CPU tier")
    p.add_argument(
        "--quantization",
        "-q",
        default=None,
        help="CPU weight-only fp16 (fbgemm, x86), int8 or int4",
    )
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="logits of a request bit-identical whatever else is in the batch (CPU backend in "
        "float32, or the Triton kernels in any dtype)",
    )
    p.add_argument("--cpu-num-threads", type=int, default=None, help="default: physical cores")
    p.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=5.0,
        help="seconds an idle keep-alive connection is kept open",
    )
    p.add_argument(
        "--client-timeout",
        type=float,
        default=30.0,
        help="seconds a body read or a response write may stall before we give up",
    )
    p.add_argument("--max-request-body-bytes", type=int, default=16 << 20)
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="on SIGINT/SIGTERM, seconds to let requests finish before aborting them",
    )
    p.add_argument("--log-level", default="info")
    p.add_argument(
        "--enable-log-requests",
        action="store_true",
        help="log one INFO line per request: its id, prompt (cut to --max-log-len) and params",
    )
    p.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="vLLM's older spelling of the default (requests are not logged)",
    )
    p.add_argument(
        "--max-log-len",
        type=int,
        default=None,
        help="characters (or token ids) of a prompt that --enable-log-requests logs (all)",
    )
    p.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="accepted for vLLM scripts: paged logs no periodic stats (GET /metrics has them)",
    )
    p.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="usage.prompt_tokens_details.cached_tokens: prompt tokens the prefix cache served",
    )
    p.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help="logprob tokens read 'token_id:<id>' in every answer (the request field's default)",
    )
    p.add_argument(
        "--response-role", default="assistant", help="the role of chat answers (vLLM's flag)"
    )
    p.add_argument(
        "--tool-call-parser",
        choices=["hermes", "llama3_json", "mistral", "pythonic"],
        default=None,
        help="parse the model's tool calls for tool_choice 'auto' (Hermes/Qwen, Llama 3 JSON, "
        "Mistral [TOOL_CALLS], or Llama 3.2/4 pythonic [f(x=1)])",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=["deepseek_r1", "qwen3"],
        default=None,
        help="chat: the model's <think>...</think> text goes to message.reasoning_content",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted for vLLM compatibility: --tool-call-parser enables tool_choice 'auto'",
    )
    return p


def _json_list(text: str) -> list[str]:
    """vLLM's JSON list (`'["http://a.com"]'`), or plain comma-separated values."""
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            value = json.loads(stripped)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list: {e}") from None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError("expected a JSON list of strings")
        return value
    return [v.strip() for v in stripped.split(",") if v.strip()]


def cors_policy(args: argparse.Namespace) -> CorsPolicy:
    """The CORS flags' policy; ValueError on an empty or malformed list."""
    return CorsPolicy.from_lists(
        getattr(args, "allowed_origins", None),
        getattr(args, "allowed_methods", None),
        getattr(args, "allowed_headers", None),
        getattr(args, "allow_credentials", False),
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """`paged-server [serve] [MODEL] [options]`: the model positionally (vLLM's `vllm serve
    MODEL`, the `serve` word optional) or as --model."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        argv = argv[1:]
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            parser.error(f"two models given: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    try:
        cors_policy(args)
    except ValueError as e:
        parser.error(str(e))
    if args.lora_modules and not args.enable_lora:
        parser.error("--lora-modules needs --enable-lora")
    why = lora_names_error(args.lora_modules or [], served_names(args))
    if why is not None:
        parser.error(f"--lora-modules: {why}")
    return args


def served_names(args: argparse.Namespace) -> list[str]:
    """Like vLLM: --served-model-name, else the --model string itself; the built-in default
    model is served by its plain name."""
    from paged_engine.default_model import DEFAULT_MODEL_NAME  # stdlib-only module

    return args.served_model_name or [args.model or DEFAULT_MODEL_NAME]


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
        seed=args.seed,
        load_format=args.load_format,
        trust_remote_code=args.trust_remote_code,
        enforce_eager=args.enforce_eager,
        compilation_config=args.compilation_config,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        speculative_config=args.speculative_config,
        pooler_config=args.pooler_config,
        chat_template=args.chat_template,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        kv_cache_dtype=args.kv_cache_dtype,
        swap_space=args.swap_space,
        preemption_mode=args.preemption_mode,
        cpu_offload_gib=args.cpu_offload_gib,
        quantization=args.quantization,
        batch_invariant=args.batch_invariant,
        cpu_num_threads=args.cpu_num_threads,
        generation_config=args.generation_config,
        override_generation_config=args.override_generation_config,
        scheduling_policy=args.scheduling_policy,
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


def build_app(args: argparse.Namespace, engine: Any) -> tuple[EngineClient, OpenAIApp]:
    """The engine loop (not started yet) and the routes over it.

    The routes get a copy of the engine's tokenizer, made before the engine loop starts: the
    engine's is the engine and output threads' alone, which only read it (HF fast tokenizers fail
    with "Already borrowed" when two threads use one while either changes its settings, e.g.
    truncation or padding). The --lora-modules adapters are loaded into the engine here, on the
    thread that owns it, before its loop starts; ValueError naming one the engine refuses.
    """
    # Imported here, not at the top: `main` binds the port before anything heavier than the
    # HTTP server is imported (the engine client pulls in the engine's modules).
    from paged_server.app import OpenAIApp
    from paged_server.engine_client import EngineClient
    from paged_server.metrics import Metrics

    model_path = str(getattr(engine.config, "model", args.model))
    names = served_names(args)
    if args.lora_modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    lora = load_lora_modules(engine, args.lora_modules or [], names, enabled=args.enable_lora)
    metrics = Metrics(names[0])
    client = EngineClient(engine, metrics=metrics, max_queued_requests=args.max_queued_requests)
    app = OpenAIApp(
        client,
        copy.deepcopy(engine.tokenizer),
        served_model_names=names,
        model_path=model_path,
        max_model_len=engine.config.max_model_len,
        api_key=args.api_key,
        trust_request_chat_template=args.trust_request_chat_template,
        engine_version=getattr(sys.modules.get("paged_engine"), "__version__", None),
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        lora=lora,
        runtime_lora_updates=runtime_updates_allowed(),
        sampling_defaults=getattr(engine, "generation_defaults", None),
        prompt_tokens_details=args.enable_prompt_tokens_details,
        tokens_as_ids=args.return_tokens_as_token_ids,
        response_role=args.response_role,
        log_requests=_log_requests(args),
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
    if args.max_log_len is not None and args.max_log_len < 0:
        raise ValueError(f"--max-log-len must be >= 0, got {args.max_log_len}")
    if not args.enable_log_requests:
        return None
    return args.max_log_len if args.max_log_len is not None else 1 << 62


def bind(args: argparse.Namespace) -> Server | None:
    """The server's socket, bound (not yet listening) before the model loads, so a busy port
    fails at once; None after printing why it cannot be bound."""
    try:
        return Server(
            (args.host, args.port),
            None,
            max_body_bytes=args.max_request_body_bytes,
            keep_alive_timeout=args.timeout_keep_alive,
            io_timeout=args.client_timeout,
            listen=False,
            cors=cors_policy(args),
        )
    except OSError as e:
        print(f"paged-server: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return None


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
    except ValueError as e:  # an invalid --lora-modules adapter
        server.server_close()
        shutdown = getattr(engine, "shutdown", None)
        if shutdown is not None:
            shutdown()
        print(f"paged-server: cannot start: {e}", file=sys.stderr)
        return 2
    server.app = app
    _freeze_startup_heap(engine)
    server.server_activate()  # listen: connections queue from here on
    client.start(engine_thread=False)  # this thread loaded the engine: it runs the loop
    stop = threading.Event()

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
    host, port = server.server_address[:2]
    print(
        f"paged-server: model {app.names[0]} ({app.model_path}), max_model_len "
        f"{engine.config.max_model_len}, KV pool {stats.num_total_blocks} blocks x {block_size} "
        f"= {stats.num_total_blocks * block_size} tokens\n"
        f"paged-server: serving on http://{host}:{port} (OpenAI API at http://{host}:{port}/v1)",
        flush=True,
    )

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
    server.app = dp.ReplicaRouter(replicas, timeout=max(args.client_timeout, 600.0))
    server.server_activate()
    threading.Thread(target=server.serve_forever, args=(0.1,), daemon=True).start()
    host, port = server.server_address[:2]
    print(
        f"paged-server: {len(replicas)} engine replicas, requests to the least loaded\n"
        f"paged-server: serving on http://{host}:{port} (OpenAI API at http://{host}:{port}/v1)",
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
    dp.stop_replicas(replicas)
    return 0


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def _compilation_config(text: str) -> int | dict:
    """vLLM's forms: an optimization level (`-O3`, `-O 3`) or a JSON object."""
    try:
        return int(text)
    except ValueError:
        return _json_object(text)


def _torchrun_rank() -> int:
    """This process's global rank when torchrun (or a launcher setting its variables) started
    it, else 0 (as paged_engine.distributed.launch decides)."""
    launched = "TORCHELASTIC_RUN_ID" in os.environ or "MASTER_ADDR" in os.environ
    return int(os.environ.get("RANK", "0")) if launched else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.tensor_parallel_size * args.pipeline_parallel_size > 1 and _torchrun_rank() > 0:
        # torchrun started every rank with this command: rank 0 serves HTTP, the others serve
        # rank 0's engine (build_engine returns by SystemExit when rank 0 shuts down).
        build_engine(args)
        return 0
    if args.data_parallel_size < 1:
        print("paged-server: --data-parallel-size must be >= 1", file=sys.stderr)
        return 2
    server = bind(args)  # before the model: a busy port fails in a fraction of a second
    if server is None:
        return 2
    if args.data_parallel_size > 1:
        argv = list(sys.argv[1:] if argv is None else argv)
        return serve_replicas(args, argv, server)
    try:
        engine = build_engine(args)
    except (ValueError, NotImplementedError, FileNotFoundError, OSError, RuntimeError) as e:
        server.server_close()
        log.debug("the engine did not start", exc_info=True)
        hint = ""
        if "trust_remote_code" in str(e) and not args.trust_remote_code:
            hint = " (paged-server: pass --trust-remote-code to run it)"
        print(f"paged-server: cannot start the engine: {e}{hint}", file=sys.stderr)
        return 2
    return serve(args, engine, server)


if __name__ == "__main__":
    raise SystemExit(main())
