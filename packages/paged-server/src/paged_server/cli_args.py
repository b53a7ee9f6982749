"""paged-server's command line: every flag (named as in vLLM) and its checks.

`parse_args` returns the namespace `cli.py` starts the server from; a bad combination of flags
exits with argparse's usage error naming the flag, before anything loads.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any

from paged_server import vllm_argv
from paged_server.cors import CorsPolicy
from paged_server.lora import lora_names_error, parse_lora_module
from paged_server.media import fetch_timeout, local_media_dir, media_io_kwargs
from paged_server.reasoning import REASONING_PARSERS
from paged_server.tls import CERT_REQS, TLSConfig
from paged_server.tool_parsers import TOOL_PARSERS
from paged_server.vllm_flags import add_ignored_flags


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="paged-server",
        description="OpenAI-compatible HTTP server for paged-engine.",
        usage="paged-server [serve] [MODEL] [options]  (or --model MODEL)",
        epilog="other commands: `paged-server run-batch -i IN -o OUT [MODEL] [options]` (a file "
        "of OpenAI batch requests, offline), `paged-server chat` / `paged-server complete` "
        "(a terminal client of a running server); each takes --help",
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
    p.add_argument(
        "--uds",
        default=None,
        metavar="PATH",
        help="serve on this Unix domain socket instead of --host / --port (vLLM's)",
    )
    p.add_argument(
        "--api-key",
        nargs="+",
        action=_OneApiKey,
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* (default: VLLM_API_KEY, as vLLM; "
        "one key)",
    )
    p.add_argument(
        "--metrics-prefix",
        type=_metrics_prefix,
        default="paged",
        help="/metrics names are PREFIX:name (default paged; 'vllm' gives vLLM's own names, "
        "for dashboards and autoscalers written for vLLM)",
    )
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
    p.add_argument("--ssl-keyfile", default=None, help="HTTPS: the server's private key (PEM)")
    p.add_argument("--ssl-certfile", default=None, help="HTTPS: the server's certificate chain")
    p.add_argument(
        "--ssl-ca-certs", default=None, help="HTTPS: CA file that client certificates must match"
    )
    p.add_argument(
        "--ssl-cert-reqs",
        type=int,
        default=0,
        help="HTTPS client certificates: 0 not asked, 1 optional, 2 required (vLLM's values)",
    )
    p.add_argument("--ssl-ciphers", default=None, help="HTTPS: OpenSSL cipher list (TLS 1.2)")
    p.add_argument(
        "--enable-ssl-refresh",
        action="store_true",
        help="HTTPS: reload the key and certificates when their files change (no restart)",
    )
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    p.add_argument(
        "--speculative-config",
        type=_json_object,
        default=None,
        help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'; '
        '\'{"model": DRAFT, ...}\' (a draft model) or \'{"method": "eagle3", "model": HEAD, '
        '...}\' (an EAGLE-3 head); \'{"method": "suffix"}\' (suffix decoding: no model)',
    )
    p.add_argument(
        "--kv-transfer-config",
        type=_json_object,
        default=None,
        help="KV transfer through shared storage (disaggregated prefill), vLLM's form, e.g. "
        '\'{"kv_connector": "ExampleConnector", "kv_role": "kv_producer", '
        '"kv_connector_extra_config": {"shared_storage_path": "/shared/kv"}}\'',
    )
    p.add_argument(
        "--model-impl",
        choices=("auto", "vllm", "transformers"),
        default="auto",
        help="vLLM's flag: 'vllm' this engine's own implementations, 'transformers' "
        "transformers' modeling code with paged attention, 'auto' the own one, else that",
    )
    p.add_argument(
        "--worker-extension-cls",
        default=None,
        metavar="MODULE.CLASS",
        help="a class whose methods join every worker rank (for collective_rpc), as vLLM's",
    )
    p.add_argument(
        "--logits-processors",
        nargs="+",
        default=None,
        metavar="MODULE:CLASS",
        help="custom logits processors (paged_engine.sample.logits_processor.LogitsProcessor "
        "subclasses), importable where the server runs; requests pass them arguments in "
        "'vllm_xargs'",
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
        "--runner",
        choices=["auto", "generate", "pooling"],
        default="auto",
        help="what the server runs (vLLM's): generate, pooling (embeddings, classify, score, "
        "rerank) or auto (a classifier pools; other models do both)",
    )
    p.add_argument(
        "--convert",
        choices=["auto", "none", "embed", "classify"],
        default="auto",
        help="classify: serve a *ForCausalLM as its *ForSequenceClassification (with "
        "--hf-overrides classifier_from_token for a reranker); embed: embeddings only",
    )
    p.add_argument(
        "--task",
        choices=["auto", "generate", "embed", "embedding", "classify", "score"],
        default=None,
        help="vLLM's older spelling of --runner / --convert",
    )
    p.add_argument(
        "--hf-overrides",
        "--hf_overrides",
        type=_json_object,
        default=None,
        help="fields set on the model's HF config, e.g. '{\"architectures\": "
        '["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", '
        '"yes"], "is_original_qwen3_reranker": true}\' (Qwen3-Reranker as a reranker)',
    )
    p.add_argument(
        "--pooler-config",
        "--override-pooler-config",
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
    p.add_argument(
        "--enable-sleep-mode",
        action="store_true",
        help="vLLM's sleep mode: POST /sleep gives back device memory between rollouts (its "
        "routes need PAGED_SERVER_DEV_MODE=1 or VLLM_SERVER_DEV_MODE=1; docs/server.md)",
    )
    p.add_argument("--dtype", default="auto")
    p.add_argument(
        "--max-model-len",
        type=_max_model_len,
        default=None,
        help="the context length (vLLM's forms: 4096, 32k, 1K = 1024; auto / -1: the model's "
        "own, as when unset: startup fails naming it if the KV cache cannot hold it)",
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=human_readable_int, default=None)
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
        choices=["auto", "hf", "mistral", "grok2"],
        default="auto",
        help="vLLM's: paged loads the Hugging Face (fast) tokenizer in each mode, or a "
        "Mistral repo's tekken.json / Grok-2's tokenizer.tok.json where it has no HF tokenizer "
        "files",
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
        help="the most logprobs / prompt_logprobs a request may ask for (the API caps at 20; "
        "-1 lets logprobs=-1 ask for every token)",
    )
    p.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="streamed chunks carry at least this many new tokens each (vLLM's; the first and "
        "last come at once)",
    )
    p.add_argument("--num-gpu-blocks-override", type=int, default=None)
    p.add_argument(
        "--kv-cache-memory-bytes",
        type=human_readable_int,
        default=None,
        metavar="BYTES",
        help="the KV pool's size per rank (e.g. 8Gi, 8G = 8e9), in place of "
        "--gpu-memory-utilization's profile (vLLM's flag)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat-template", default=None, help="a Jinja template or a path to one")
    p.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="render a chat_template sent in a request (default: refuse it with a 400)",
    )
    p.add_argument(
        "--default-chat-template-kwargs",
        type=_json_object,
        default=None,
        metavar="JSON",
        help="chat template variables for every request, under its own chat_template_kwargs "
        """(e.g. '{"enable_thinking": false}')""",
    )
    p.add_argument(
        "--exclude-tools-when-tool-choice-none",
        action="store_true",
        help="a request with tool_choice 'none' renders its prompt without the tools",
    )
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        help="answer 429 while this many requests wait; default: unbounded",
    )
    p.add_argument(
        "--load-format",
        default="auto",
        help="auto, safetensors, pt, gguf, dummy, or mistral (consolidated*.safetensors); "
        "auto prefers HF-named weights where a repo has both",
    )
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="let transformers run the model repository's own config / tokenizer code",
    )
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument(
        "--compilation-config",
        "-O",
        "-cc",
        type=_compilation_config,
        default=None,
        help="0: eager (default); 1-3 (-O3): torch.compile the model forward (CPU), or "
        "'{\"level\": 3}'",
    )
    p.add_argument("--kv-cache-dtype", default="auto", help="auto, fp8 (= fp8_e4m3), fp8_e5m2")
    p.add_argument(
        "--mamba-ssm-cache-dtype",
        default="auto",
        help="hybrid models' recurrent state: auto (the config's mamba_ssm_dtype, else the "
        "model dtype), float32, float16, bfloat16",
    )
    p.add_argument(
        "--prefix-state-snapshots",
        type=int,
        default=None,
        help="hybrid models' prefix caching: state snapshots kept, out of the KV cache's memory "
        "(default: as many as fit in a tenth of it, at most max-num-seqs; 0: prefix caching off)",
    )
    p.add_argument("--swap-space", type=float, default=0.0, help="GiB of CPU swap for preemption")
    p.add_argument("--preemption-mode", default=None, help="recompute or swap (default: by cost)")
    p.add_argument(
        "--cpu-offload-gib",
        "--kv-offloading-size",
        type=float,
        default=0.0,
        help="GiB of host memory for the prefix cache's CPU tier (vLLM's --kv-offloading-size "
        "with its native backend)",
    )
    p.add_argument(
        "--optimization-level",
        type=int,
        choices=range(4),
        default=None,
        help="vLLM's -O level: as --compilation-config LEVEL where that is not given",
    )
    p.add_argument(
        "--language-model-only",
        action="store_true",
        help="serve a multimodal checkpoint's language model only (--limit-mm-per-prompt 0 for "
        "every modality)",
    )
    p.add_argument(
        "--quantization",
        "-q",
        default=None,
        help="weight-only: fp8 or int4 (CUDA: Triton GEMMs; a 4-bit GPTQ / AWQ checkpoint "
        "keeps its codes there by default), or on the CPU fp16 (fbgemm, x86), int8 or int4; "
        "gptq / awq / compressed-tensors / bitsandbytes (and vLLM's *_marlin names) check the "
        "checkpoint's own scheme (it loads without this too)",
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
    p.add_argument(
        "--log-level",
        "--uvicorn-log-level",
        type=_log_level,
        default="info",
        help="debug, info, warning, error or critical (vLLM's trace: debug)",
    )
    p.add_argument(
        "--disable-uvicorn-access-log",
        action="store_true",
        help="no INFO line per request (it is logged at DEBUG)",
    )
    p.add_argument(
        "--enable-request-id-headers",
        action="store_true",
        help="answer with an X-Request-Id header: the request's own, else a new id",
    )
    p.add_argument(
        "--enable-force-include-usage",
        action="store_true",
        help="every streamed completion / chat answer ends with its usage chunk",
    )
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule step N+1 while step N runs (default: on for CUDA, off on CPU)",
    )
    p.add_argument(
        "--guided-decoding-backend",
        default=None,
        help="accepted for vLLM scripts: structured outputs always compile with llguidance",
    )
    p.add_argument(
        "--structured-outputs-config",
        type=_json_object,
        default=None,
        help="accepted for vLLM scripts ('backend' as above); other keys are refused",
    )
    p.add_argument(
        "--enable-server-load-tracking",
        action="store_true",
        help='GET /load answers {"server_load": n}, the POST requests being answered (else 0)',
    )
    p.add_argument(
        "--chat-template-content-format",
        choices=["auto", "string", "openai"],
        default="auto",
        help="vLLM's: 'string' gives templates each message as one string, its images, videos "
        "and audio as the model's placeholder text; 'openai' a message with media as its parts "
        "list ({'type': 'image'} / 'text'); 'auto' reads the template (a loop over a message's "
        "content: parts, else string)",
    )
    p.add_argument(
        "--config-format",
        choices=["auto", "hf", "mistral"],
        default="auto",
        help="vLLM's: 'hf' config.json (or a GGUF file's metadata), 'mistral' params.json "
        "(Mistral's native format); 'auto' config.json where there is one, else params.json",
    )
    p.add_argument(
        "--logprobs-mode",
        choices=["raw_logprobs"],
        default="raw_logprobs",
        help="logprobs are the model's raw distribution (vLLM's default mode, the only one)",
    )
    p.add_argument(
        "--limit-mm-per-prompt",
        type=_limit_mm,
        default=None,
        help='images and videos per prompt, vLLM\'s \'{"image": 2, "video": 1}\' (or '
        "image=2,video=1); image 0 serves a LLaVA checkpoint's text model only, video 0 turns "
        "videos off (default: any number)",
    )
    p.add_argument(
        "--media-io-kwargs",
        type=_media_io,
        default=None,
        help='how media are loaded, vLLM\'s JSON: \'{"video": {"num_frames": 16}}\' samples '
        "16 frames of each video (-1: every frame; default 32); a request's own "
        "media_io_kwargs go on top",
    )
    p.add_argument(
        "--mm-processor-kwargs",
        type=_json_object,
        default=None,
        help="arguments for the checkpoint's image processor, vLLM's JSON, e.g. Qwen2-VL's "
        "'{\"max_pixels\": 1003520}' (a request's own mm_processor_kwargs go on top)",
    )
    p.add_argument(
        "--mm-processor-cache-gb",
        type=float,
        default=4.0,
        metavar="GIB",
        help="keep images' processed pixel values for reuse (a chat resends its images every "
        "turn) up to this many GiB; 0 turns it off (default: 4)",
    )
    p.add_argument(
        "--disable-mm-preprocessor-cache",
        action="store_true",
        help="vLLM's older spelling of --mm-processor-cache-gb 0",
    )
    p.add_argument(
        "--enable-mm-embeds",
        action="store_true",
        help="take image features as chat `image_embeds` parts (vLLM's flag: base64 of a "
        "torch.save tensor or .npy array; for trusted clients)",
    )
    p.add_argument(
        "--enable-prompt-embeds",
        action="store_true",
        help="take /v1/completions `prompt_embeds` (vLLM's flag: base64 of a torch.save "
        "tensor [tokens, hidden size] of the model's token embeddings; for trusted clients)",
    )
    p.add_argument(
        "--allowed-local-media-path",
        default=None,
        metavar="DIR",
        help="let requests name images by file:// URLs inside DIR (default: refused; a "
        "security risk, for trusted clients)",
    )
    p.add_argument(
        "--allowed-media-domains",
        nargs="+",
        default=None,
        metavar="HOST",
        help="fetch http(s) images and videos only from these hosts (redirects too); default: any",
    )
    p.add_argument(
        "--log-config-file",
        default=None,
        metavar="PATH",
        help="a JSON logging.config dictionary applied at start (vLLM's; also "
        "VLLM_LOGGING_CONFIG_PATH)",
    )
    add_ignored_flags(p)
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
        "--enable-tokenizer-info-endpoint",
        action="store_true",
        help="serve GET /tokenizer_info: the tokenizer's settings, class and chat template",
    )
    p.add_argument(
        "--log-error-stack",
        action="store_true",
        help="log each error answer (4xx included) with the stack where it was raised",
    )
    p.add_argument(
        "--enable-log-outputs",
        action="store_true",
        help="log each answer once it is complete (streamed ones too): its text and token ids "
        "(cut to --max-log-len) and finish reason",
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
        default=None,
        metavar="{" + ",".join(sorted(TOOL_PARSERS)) + "}",
        help="parse the model's tool calls for tool_choice 'auto': hermes (Hermes / Qwen), "
        "llama3_json, mistral ([TOOL_CALLS]), pythonic (Llama 3.2 / 4 [f(x=1)]), lfm2 (LFM2: "
        "<|tool_call_start|>[f(x=1)]<|tool_call_end|>), qwen3_coder "
        "(= qwen3_xml, Qwen3-Coder's <function=f>), granite (<|tool_call|>), phi4_mini_json "
        "(functools[...]), openai (gpt-oss: Harmony messages to=functions.NAME), deepseek_v3 / "
        "deepseek_v31 (DeepSeek-V3 / R1 / V3.1 tool-call tokens), kimi_k2, glm45 (= glm47: "
        "GLM-4.5-4.7's <tool_call>NAME<arg_key>...), seed_oss (<seed:tool_call><function=f>), "
        "minimax_m2 (<minimax:tool_call><invoke name=f>), hunyuan_a13b / jamba "
        "(<tool_calls>[json]</tool_calls>), ernie45 (= hermes), internlm (<|action_start|>"
        "<|plugin|>{json}), olmo3 (pythonic lines in <function_calls>), xlam (a JSON list of "
        "calls), llama4_pythonic (= pythonic), llama4_json (= llama3_json)",
    )
    p.add_argument(
        "--reasoning-parser",
        default=None,
        metavar="{" + ",".join(REASONING_PARSERS) + "}",
        help="chat: the model's reasoning goes to message.reasoning_content: deepseek_r1 / "
        "qwen3 / glm45 / kimi_k2 (<think>...</think>; deepseek_r1 and kimi_k2 from the first "
        "token, qwen3 and glm45 from the model's own <think>), seed_oss (<seed:think>), mistral "
        "([THINK]...[/THINK]), minimax_m2 (minimax_m2_append_think: no split, <think> put "
        "first), olmo3, ernie45 (<response> unwrapped), granite ('Here is my thought "
        "process:'), hunyuan_a13b (<answer> unwrapped), deepseek_v3 (as deepseek_r1 when "
        "chat_template_kwargs turn thinking on), openai_gptoss (gpt-oss's Harmony analysis "
        "channel; the final channel is the content; with --tool-call-parser openai)",
    )
    for what in ("tool", "reasoning"):
        p.add_argument(
            f"--{what}-parser-plugin",
            default=None,
            metavar="FILE",
            help=f"a Python file that registers {what} parsers (paged_server.parser_plugins), "
            f"run at start: their names join --{'tool-call' if what == 'tool' else what}-parser's",
        )
    p.add_argument(
        "--reasoning-config",
        type=_json_object,
        default=None,
        help="vLLM's: the reasoning block's markers for thinking_token_budget, e.g. "
        '\'{"think_start_str": "<think>", "think_end_str": "</think>"}\' (default: the '
        "--reasoning-parser's markers)",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted for vLLM compatibility: --tool-call-parser enables tool_choice 'auto'",
    )
    return p


def _log_level(text: str) -> str:
    level = text.strip().lower()
    level = "debug" if level == "trace" else level
    if level not in ("debug", "info", "warning", "error", "critical"):
        raise argparse.ArgumentTypeError("expected debug, info, warning, error or critical")
    return level


def _metrics_prefix(text: str) -> str:
    from paged_server.metrics import check_prefix

    try:
        return check_prefix(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


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


_MODALITIES = ("image", "video", "audio")  # what vLLM's limit may name


def _media_io(text: str) -> dict[str, Any]:
    """--media-io-kwargs: vLLM's JSON object, checked as a request's media_io_kwargs is."""
    value = _json_object(text)
    try:
        media_io_kwargs(value, "--media-io-kwargs")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def _limit_mm(text: str) -> dict[str, int]:
    """--limit-mm-per-prompt: vLLM's JSON object (`'{"image": 2, "video": 0}'`, a count or
    `{"count": n, ...}` per modality) or the older `image=2,video=0`."""
    stripped = text.strip()
    if stripped.startswith("{"):
        try:
            value = json.loads(stripped)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError("expected a JSON object such as '{\"image\": 2}'")
    else:
        value = {}
        for item in filter(None, (s.strip() for s in stripped.split(","))):
            key, eq, count = item.partition("=")
            if not eq or not count.strip().isdigit():
                raise argparse.ArgumentTypeError(
                    f"{item!r} is not MODALITY=COUNT: expected '{{\"image\": 2}}' or image=2"
                )
            value[key.strip()] = int(count)
    limits = {}
    for key, count in value.items():
        if isinstance(count, dict):  # vLLM's {"count": n, "width": ..., "height": ...}
            count = count.get("count")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise argparse.ArgumentTypeError(f"{key!r}: the limit must be an integer >= 0")
        if key not in _MODALITIES:
            raise argparse.ArgumentTypeError(
                f"unknown modality {key!r} (expected one of {', '.join(_MODALITIES)})"
            )
        limits[key] = count
    return limits


def cors_policy(args: argparse.Namespace) -> CorsPolicy:
    """The CORS flags' policy; ValueError on an empty or malformed list."""
    return CorsPolicy.from_lists(
        getattr(args, "allowed_origins", None),
        getattr(args, "allowed_methods", None),
        getattr(args, "allowed_headers", None),
        getattr(args, "allow_credentials", False),
    )


def _parser_plugins(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Run --tool-parser-plugin / --reasoning-parser-plugin, then check the parser names against
    every registered one (built in or a plugin's)."""
    from paged_server.parser_plugins import load_plugin, reasoning_parsers

    for flag in ("tool_parser_plugin", "reasoning_parser_plugin"):
        path = getattr(args, flag)
        if path is not None:
            try:
                load_plugin(path)
            except ValueError as e:
                parser.error(f"argument --{flag.replace('_', '-')}: {e}")
    for flag, names in (
        ("tool_call_parser", sorted(TOOL_PARSERS)),
        ("reasoning_parser", reasoning_parsers()),
    ):
        value = getattr(args, flag)
        if value is not None and value not in names:
            parser.error(
                f"argument --{flag.replace('_', '-')}: invalid choice: {value!r} (choose from "
                f"{', '.join(names)}; or register one with --{flag.split('_')[0]}-parser-plugin)"
            )


def parse_args(
    argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None
) -> argparse.Namespace:
    """`paged-server [serve] [MODEL] [options]`: the model positionally (vLLM's `vllm serve
    MODEL`, the `serve` word optional) or as --model; `parser`: build_parser()'s, extended
    (run-batch's)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        argv = argv[1:]
    parser = parser or build_parser()
    argv = vllm_argv.normalize(argv, parser)
    args = parser.parse_args(argv)
    args.command_line = argv  # plain argparse form: what data-parallel replicas are given
    if args.compilation_config is None:
        args.compilation_config = args.optimization_level
    if args.language_model_only:
        args.limit_mm_per_prompt = dict.fromkeys(_MODALITIES, 0)
    if args.api_key is None:  # vLLM's default
        args.api_key = os.environ.get("VLLM_API_KEY") or None
    _parser_plugins(args, parser)
    if args.disable_mm_preprocessor_cache:
        args.mm_processor_cache_gb = 0.0
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            parser.error(f"two models given: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    try:
        cors_policy(args)
    except ValueError as e:
        parser.error(str(e))
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        parser.error("HTTPS needs both --ssl-keyfile and --ssl-certfile")
    if args.ssl_cert_reqs not in CERT_REQS:
        parser.error(f"--ssl-cert-reqs must be 0, 1 or 2, got {args.ssl_cert_reqs}")
    if args.ssl_keyfile is None and (
        args.ssl_ca_certs or args.ssl_cert_reqs or args.ssl_ciphers or args.enable_ssl_refresh
    ):
        parser.error("the --ssl-* options need --ssl-keyfile and --ssl-certfile (HTTPS)")
    if args.lora_modules and not args.enable_lora:
        parser.error("--lora-modules needs --enable-lora")
    why = lora_names_error(args.lora_modules or [], served_names(args))
    if why is not None:
        parser.error(f"--lora-modules: {why}")
    try:
        args.keep_alive_on_engine_death = keep_alive_on_engine_death()
        local_media_dir(args.allowed_local_media_path)
        fetch_timeout()
        fetch_timeout(kind="video")
    except ValueError as e:
        parser.error(str(e))
    _check_structured_backend(parser, args)
    _check_default_template_kwargs(parser, args.default_chat_template_kwargs)
    return args


def _check_default_template_kwargs(parser: argparse.ArgumentParser, value: dict | None) -> None:
    """The variables a request's chat_template_kwargs could hold; not a template (that is
    --chat-template's)."""
    from paged_server.chat_messages import template_kwargs
    from paged_server.errors import APIError

    flag = "--default-chat-template-kwargs"
    if value is not None and "chat_template" in value:
        parser.error(f"{flag} may not hold a chat_template: use --chat-template")
    try:
        template_kwargs(value)
    except APIError as e:
        parser.error(f"{flag}: {e.message}")


# vLLM's structured-output backends: paged compiles every grammar with llguidance, which takes
# the same requests (a script naming another backend gets the same constraints).
_STRUCTURED_BACKENDS = (
    "auto",
    "xgrammar",
    "guidance",
    "llguidance",
    "outlines",
    "lm-format-enforcer",
)


def _check_structured_backend(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    config = args.structured_outputs_config or {}
    unknown = sorted(set(config) - {"backend"})
    if unknown:
        parser.error(
            f"--structured-outputs-config: {unknown[0]!r} is not supported (only 'backend')"
        )
    for flag, backend in (
        ("--guided-decoding-backend", args.guided_decoding_backend),
        ("--structured-outputs-config", config.get("backend")),
    ):
        if backend is not None and backend not in _STRUCTURED_BACKENDS:
            parser.error(f"{flag}: unknown backend {backend!r}; vLLM's: {_STRUCTURED_BACKENDS}")


KEEP_ALIVE_ENV = ("PAGED_KEEP_ALIVE_ON_ENGINE_DEATH", "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH")


def keep_alive_on_engine_death(environ: Any = None) -> bool:
    """Whether the server stays up, answering 503, once its engine has failed (a rank died).
    Off by default, as in vLLM: the server shuts down and exits with 1, for a supervisor to
    restart it. The first of the two variables that is set decides."""
    env = os.environ if environ is None else environ
    for name in KEEP_ALIVE_ENV:
        raw = env.get(name, "").strip().lower()
        if not raw:
            continue
        if raw in ("1", "true", "yes", "on"):
            return True
        if raw in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name}={env[name]!r} is invalid: expected 1 or 0")
    return False


def served_names(args: argparse.Namespace) -> list[str]:
    """Like vLLM: --served-model-name, else the --model string itself; the built-in default
    model is served by its plain name."""
    from paged_engine.default_model import DEFAULT_MODEL_NAME  # stdlib-only module

    return args.served_model_name or [args.model or DEFAULT_MODEL_NAME]


_SI = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "M": 10**6, "G": 10**9, "T": 10**12}
_IEC = {"K": 2**10, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def human_readable_int(text: str) -> int:
    """An int with vLLM's suffixes: SI k / M / G / T (decimals allowed, lowercase too) or IEC
    Ki / Mi / Gi / Ti (and K); "8G" is 8e9 as in current vLLM, "8Gi" 8 x 2**30."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|[kmgtKMGT])?", text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"not an int (suffixes k/M/G/T, Ki/Mi/Gi/Ti): {text!r}")
    number, suffix = match.groups()
    if suffix is None:
        if "." in number:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}")
        return int(number)
    if suffix in _IEC:
        if "." in number:
            raise argparse.ArgumentTypeError(f"decimals need an SI suffix (k/M/G/T): {text!r}")
        return int(number) * _IEC[suffix]
    return int(float(number) * _SI[suffix])


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


class _OneApiKey(argparse.Action):
    """vLLM's `--api-key KEY [KEY ...]` form, one key: stored as a string."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if len(values) > 1:
            parser.error("argument --api-key: one key only (vLLM takes several)")
        setattr(namespace, self.dest, values[0] or None)


def _max_model_len(text: str) -> int | None:
    """vLLM's --max-model-len: human_readable_int, or auto / -1 (None: the model's own)."""
    if text.strip().lower() in ("auto", "-1"):
        return None
    return human_readable_int(text)


def _compilation_config(text: str) -> int | dict:
    """vLLM's forms: an optimization level (`-O3`, `-O 3`) or a JSON object."""
    try:
        return int(text)
    except ValueError:
        return _json_object(text)


def tls_config(args: argparse.Namespace) -> TLSConfig | None:
    """The HTTPS settings of the --ssl-* flags; None for plain HTTP."""
    if getattr(args, "ssl_keyfile", None) is None:
        return None
    return TLSConfig(
        keyfile=args.ssl_keyfile,
        certfile=args.ssl_certfile,
        ca_certs=args.ssl_ca_certs,
        cert_reqs=args.ssl_cert_reqs,
        ciphers=args.ssl_ciphers,
    )
