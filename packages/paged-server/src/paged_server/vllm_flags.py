"""vLLM `serve` flags paged-server accepts without acting on them, so deployment scripts written
for vLLM start unchanged. Each is a knob of something paged does not have or does one way only
(its reason below); none of them changes an answer. The server logs one warning naming the ones
given. Flags that would change answers and that paged lacks are not here: argparse refuses them.
`ONLY_DEFAULT` flags are accepted at the value that says what paged does (vLLM's default, but
for --fingerprint-mode), any other refused naming the flag.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable

from paged_engine.vllm_options import IGNORED as ENGINE_IGNORED

log = logging.getLogger("paged_server")

# vLLM `serve` flags that are LLM(...) options paged ignores too, with the same reason
# (vllm_options.IGNORED's) -> whether the flag takes a value
_ENGINE_IGNORED: dict[str, bool] = {
    "--disable-custom-all-reduce": False,
    "--max-parallel-loading-workers": True,
    "--safetensors-load-strategy": True,
    "--prefix-caching-hash-algo": True,
    "--cuda-graph-sizes": True,
    "--max-seq-len-to-capture": True,
    "--enable-expert-parallel": False,
    "--max-num-partial-prefills": True,
    "--long-prefill-token-threshold": True,
    "--show-hidden-metrics-for-version": True,
    "--max-long-partial-prefills": True,
    "--enable-dbo": False,
    "--enable-eplb": False,
    "--mm-encoder-tp-mode": True,
    "--fully-sharded-loras": False,
    "--cudagraph-capture-sizes": True,
    "--allow-deprecated-quantization": False,
    "--use-tqdm-on-load": False,
    "--pt-load-map-location": True,
    "--all2all-backend": True,
    "--mm-processor-cache-type": True,
    "--skip-mm-profiling": False,
    "--num-lookahead-slots": True,
    "--disable-hybrid-kv-cache-manager": False,
    "--kv-sharing-fast-prefill": False,
    "--otlp-traces-endpoint": True,
    "--collect-detailed-traces": True,
}

# flag -> (takes a value, why it changes nothing here)
IGNORED: dict[str, tuple[bool, str]] = {
    "--disable-fastapi-docs": (False, "paged-server serves no /docs pages"),
    "--disable-frontend-multiprocessing": (False, "the HTTP front runs in the engine's process"),
    "--root-path": (True, "routes are served at the root; a proxy strips its prefix"),
    "--max-cudagraph-capture-size": (True, "CUDA graphs are captured up to --max-num-seqs"),
    "--api-server-count": (True, "one HTTP front, a thread per connection"),
    "--h11-max-incomplete-event-size": (True, "the request line and headers: http.server's limits"),
    "--h11-max-header-count": (True, "http.server takes up to 100 headers a request"),
    "--disable-cascade-attn": (False, "attention has no cascade (shared-prefix) kernel"),
    "--attention-backend": (True, "attention runs in paged's own kernels (Triton; CPU: its own)"),
    "--num-scheduler-steps": (True, "one scheduling decision a step (vLLM v1's too)"),
    "--attention-config": (True, "attention runs in paged's own kernels (Triton; CPU: its own)"),
    "--mm-encoder-attn-backend": (True, "a vision tower's attention runs in torch's SDPA"),
    "--moe-backend": (True, "MoE layers run paged's own grouped GEMMs"),
    "--enable-flashinfer-autotune": (False, "no FlashInfer kernels to tune"),
    "--guided-decoding-disable-fallback": (False, "one grammar engine: nothing to fall back to"),
    "--distributed-timeout-seconds": (True, "ranks keep torch.distributed's default timeout"),
    "--ray-workers-use-nsight": (False, "no Ray workers to profile"),
    "--ubatch-size": (True, "no dual-batch overlap: tensor parallelism all-reduces in line"),
    "--dbo-decode-token-threshold": (True, "no dual-batch overlap"),
    "--dbo-prefill-token-threshold": (True, "no dual-batch overlap"),
    "--enable-elastic-ep": (False, "MoE experts are split by tensor parallelism"),
    "--eplb-config": (True, "MoE experts are split by tensor parallelism, not rebalanced"),
    "--expert-placement-strategy": (True, "MoE experts are split by tensor parallelism"),
    "--num-redundant-experts": (True, "MoE experts are split by tensor parallelism"),
    "--eplb-window-size": (True, "MoE experts are split by tensor parallelism, not rebalanced"),
    "--eplb-step-interval": (True, "MoE experts are split by tensor parallelism, not rebalanced"),
    "--eplb-log-balancedness": (False, "MoE experts are split by tensor parallelism"),
    "--disable-nccl-for-dp-synchronization": (False, "data-parallel replicas never synchronize"),
    "--enable-multimodal-encoder-data-parallel": (False, "a vision tower is split like the LM"),
    "--mm-shm-cache-max-object-size-mb": (True, "no shared-memory cache: one in-process LRU"),
    "--disable-chunked-mm-input": (
        False,
        "a chunk ends inside an image only where that changes nothing (images whose tokens "
        "attend to each other are kept whole)",
    ),
    "--kv-cache-metrics": (False, "GET /metrics has the KV pool's gauges, no sampled ones"),
    "--kv-cache-metrics-sample": (True, "GET /metrics has the KV pool's gauges, no sampled ones"),
    "--cudagraph-metrics": (False, "no CUDA-graph metrics"),
    "--enable-mfu-metrics": (False, "no MFU metrics"),
    "--enable-logging-iteration-details": (False, "no per-step stats log"),
    "--enable-layerwise-nvtx-tracing": (False, "no NVTX ranges"),
    "--aggregate-engine-logging": (False, "no periodic stats log (GET /metrics has the stats)"),
    "--enable-log-deltas": (False, "--enable-log-outputs logs each answer once, when complete"),
    "--disable-access-log-for-endpoints": (
        True,
        "the access log is on or off for every route (--disable-uvicorn-access-log)",
    ),
    "--enable-offline-docs": (False, "paged-server serves no /docs pages"),
    "--cohere-is-reasoning-model": (False, "no /cohere/v2/chat route"),
    "--cohere-format": (True, "no /cohere/v2/chat route nor --tokenizer-mode cohere"),
    "--fail-on-environ-validation": (False, "VLLM_* environment variables are not validated"),
    "--performance-mode": (True, "batch limits are --max-num-seqs / --max-num-batched-tokens"),
    "--scheduler-delay-factor": (True, "waiting prompts are scheduled at the next step"),
    "--ignore-patterns": (True, "the weights are the files --load-format names, nothing else"),
    "--kv-events-config": (True, "no KV-cache events are published"),
    "--kernel-config": (True, "layers run paged's own kernels (nothing to choose or tune)"),
    "--enable-flash-late-interaction": (False, "no late-interaction (MaxSim) scoring"),
    **{
        flag: (takes_value, ENGINE_IGNORED[flag.lstrip("-").replace("-", "_")])
        for flag, takes_value in _ENGINE_IGNORED.items()
    },
}

# list-valued flags among IGNORED (vLLM's nargs="+")
LIST_FLAGS = frozenset({"--cuda-graph-sizes", "--cudagraph-capture-sizes"})

# flag -> (accepts(text), the value(s) accepted: what paged does)
ONLY_DEFAULT: dict[str, tuple[Callable[[str], bool], str]] = {
    "--cpu-offload-gb": (lambda v: _number(v) == 0, "0 (weights stay on the device)"),
    "--offload-backend": (lambda v: v == "auto", "auto (weights stay on the device)"),
    "--mamba-cache-dtype": (
        lambda v: v == "auto",
        "auto (--mamba-ssm-cache-dtype sets the recurrent state's dtype)",
    ),
    "--kv-offloading-backend": (
        lambda v: v == "native",
        "native (--kv-offloading-size GiB of host memory: the prefix cache's CPU tier)",
    ),
    "--data-parallel-backend": (lambda v: v == "mp", "mp (a process per replica)"),
    "--decode-context-parallel-size": (lambda v: v == "1", "1 (no context parallelism)"),
    "--prefill-context-parallel-size": (lambda v: v == "1", "1 (no context parallelism)"),
    "--nnodes": (lambda v: v == "1", "1 (multi-node runs start every rank with torchrun)"),
    "--node-rank": (lambda v: v == "0", "0 (multi-node runs start every rank with torchrun)"),
    "--worker-cls": (lambda v: v == "auto", "auto (paged's own worker)"),
    "--fingerprint-mode": (lambda v: v == "none", "none (answers carry no system_fingerprint)"),
}
SHORT = {"-dcp": "--decode-context-parallel-size", "-pcp": "--prefill-context-parallel-size"}


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def add_ignored_flags(p: argparse.ArgumentParser) -> None:
    """Register IGNORED and ONLY_DEFAULT (dest `vllm_<name>`, default None)."""
    for flag, (takes_value, why) in IGNORED.items():
        dest = "vllm_" + flag.lstrip("-").replace("-", "_")
        if takes_value:
            nargs = "+" if flag in LIST_FLAGS else None
            p.add_argument(
                flag, dest=dest, default=None, nargs=nargs, metavar="V", help=f"ignored: {why}"
            )
        else:
            p.add_argument(
                flag,
                dest=dest,
                action="store_const",
                const=True,
                default=None,
                help=f"ignored: {why}",
            )
    short = {long: s for s, long in SHORT.items()}
    for flag, (accepts, expected) in ONLY_DEFAULT.items():
        names = (short[flag], flag) if flag in short else (flag,)
        p.add_argument(
            *names,
            dest="vllm_" + flag.lstrip("-").replace("-", "_"),
            type=_only(accepts, expected),
            default=None,
            metavar="V",
            help=f"vLLM's; accepted only as {expected}",
        )


def _only(accepts: Callable[[str], bool], expected: str) -> Callable[[str], str]:
    def check(text: str) -> str:
        if not accepts(text.strip()):
            raise argparse.ArgumentTypeError(f"{text!r} is not supported: paged serves {expected}")
        return text

    return check


def warn_ignored(args: argparse.Namespace) -> list[str]:
    """Log one warning naming the ignored flags given; returns them."""
    given = [f for f in IGNORED if getattr(args, "vllm_" + f.lstrip("-").replace("-", "_"), None)]
    if given:
        log.warning(
            "ignoring vLLM flags paged does not need: %s",
            "; ".join(f"{f} ({IGNORED[f][1]})" for f in given),
        )
    return given
