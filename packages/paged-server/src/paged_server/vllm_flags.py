"""vLLM `serve` flags paged-server accepts without acting on them, so deployment scripts written
for vLLM start unchanged. Each is a knob of something paged does not have or does one way only
(its reason below); none of them changes an answer. The server logs one warning naming the ones
given. Flags that would change answers and that paged lacks are not here: argparse refuses them.
"""

from __future__ import annotations

import argparse
import logging

log = logging.getLogger("paged_server")

# flag -> (takes a value, why it changes nothing here)
IGNORED: dict[str, tuple[bool, str]] = {
    "--disable-fastapi-docs": (False, "paged-server serves no /docs pages"),
    "--disable-custom-all-reduce": (False, "tensor parallelism all-reduces through NCCL / gloo"),
    "--disable-frontend-multiprocessing": (False, "the HTTP front runs in the engine's process"),
    "--max-parallel-loading-workers": (True, "weights stream from one reader"),
    "--safetensors-load-strategy": (True, "safetensors files are memory-mapped"),
    "--prefix-caching-hash-algo": (True, "prefix-cache keys compare whole token blocks"),
    "--root-path": (True, "routes are served at the root; a proxy strips its prefix"),
    "--cuda-graph-sizes": (True, "CUDA graphs are captured at fixed batch-size buckets"),
    "--max-seq-len-to-capture": (True, "CUDA graphs are captured at fixed batch-size buckets"),
    "--max-cudagraph-capture-size": (True, "CUDA graphs are captured up to --max-num-seqs"),
    "--enable-expert-parallel": (False, "MoE experts are split by tensor parallelism"),
    "--max-num-partial-prefills": (True, "chunked prefill shares one token budget"),
    "--long-prefill-token-threshold": (True, "chunked prefill shares one token budget"),
    "--api-server-count": (True, "one HTTP front, a thread per connection"),
    "--h11-max-incomplete-event-size": (True, "the request line and headers: http.server's limits"),
    "--h11-max-header-count": (True, "http.server takes up to 100 headers a request"),
    "--show-hidden-metrics-for-version": (True, "every metric is shown; none was hidden"),
    "--max-long-partial-prefills": (True, "chunked prefill shares one token budget"),
    "--disable-cascade-attn": (False, "attention has no cascade (shared-prefix) kernel"),
    "--attention-backend": (True, "attention runs in paged's own kernels (Triton; CPU: its own)"),
    "--enable-dbo": (False, "no dual-batch overlap: tensor parallelism all-reduces in line"),
    "--enable-eplb": (False, "MoE experts are split by tensor parallelism, not rebalanced"),
    "--mm-encoder-tp-mode": (True, "a vision tower is split like the language model"),
    "--fully-sharded-loras": (False, "LoRA weights are split like the layers they adapt"),
    "--num-scheduler-steps": (True, "one scheduling decision a step (vLLM v1's too)"),
}


def add_ignored_flags(p: argparse.ArgumentParser) -> None:
    """Register IGNORED (dest `vllm_<name>`, default None)."""
    for flag, (takes_value, why) in IGNORED.items():
        dest = "vllm_" + flag.lstrip("-").replace("-", "_")
        if takes_value:
            p.add_argument(flag, dest=dest, default=None, metavar="V", help=f"ignored: {why}")
        else:
            p.add_argument(
                flag,
                dest=dest,
                action="store_const",
                const=True,
                default=None,
                help=f"ignored: {why}",
            )


def warn_ignored(args: argparse.Namespace) -> list[str]:
    """Log one warning naming the ignored flags given; returns them."""
    given = [f for f in IGNORED if getattr(args, "vllm_" + f.lstrip("-").replace("-", "_"), None)]
    if given:
        log.warning(
            "ignoring vLLM flags paged does not need: %s",
            "; ".join(f"{f} ({IGNORED[f][1]})" for f in given),
        )
    return given
