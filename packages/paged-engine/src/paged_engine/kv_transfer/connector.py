"""The scheduler's side of KV transfer (vLLM's connector "scheduler" half, paged's way): at
admission it finds a new request's stored prompt blocks, and at each step it names, as plain
data in the `SchedulerOutput`, the blocks the worker loads before the forward (`kv_loads`) and
those it saves after it (`kv_saves`).

At admission, one sequence (`match`, after the local prefix-cache lookup):

    | local prefix-cache hit | stored blocks (loaded) | rest: prefilled as usual |
    0                 num_cached        +loaded             num_tokens (>= 1 left)

Only full prompt blocks are stored or loaded, and at least the last token is computed so that
its logits exist. Block keys are a chained SHA-256 (`block_keys`) over the engine identity (the
model, dtype, KV cache dtype, block size, tensor-parallel size; the epoch after a
`reset_cache`), the request's LoRA adapter and cache salt, each block's token ids and the
multimodal hashes the prefix cache keys it by: never Python's `hash`, so other processes
compute the same keys.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from typing import TYPE_CHECKING, Any

from paged_engine.kv_transfer.config import KVTransferConfig
from paged_engine.kv_transfer.storage import Spec, block_path, check_block
from paged_engine.multimodal.inputs import block_mm_keys

if TYPE_CHECKING:
    from paged_engine.core.block_manager import BlockManager
    from paged_engine.core.request import Request, Sequence
    from paged_engine.core.sched_output import SchedulerOutput


class KVConnector:
    def __init__(
        self, cfg: KVTransferConfig, identity: dict[str, Any], block_size: int, spec: Spec
    ) -> None:
        self.cfg = cfg
        self.block_size = block_size
        self.world = int(identity["tensor_parallel_size"])
        self.spec = spec  # every rank's block file holds these tensors (same shard shapes)
        self._identity = json.dumps(identity, sort_keys=True, default=str)
        self.epoch = 0  # reset_cache calls: blocks stored under an earlier epoch are not read
        self._engine_key = self._key()
        self._keys: dict[str, list[str]] = {}  # request id -> keys of its full prompt blocks
        self._saved: dict[str, int] = {}  # request id -> prompt blocks handed to the worker
        # seq id -> (blocks to load, prompt tokens looked up), from `match` to its first step
        self._loads: dict[int, tuple[list[tuple[int, str]], int]] = {}
        # vLLM's external prefix-cache counters, in tokens: prompt tokens of requests looked up
        # in storage, and tokens loaded from it
        self.queries = 0
        self.hits = 0
        # keys whose file the worker could not load (gone or changed after `_stored` checked
        # it): never looked up again, so a request sent back to recompute cannot loop
        self._failed: set[str] = set()

    def _key(self) -> str:
        text = self._identity if self.epoch == 0 else f"{self._identity}#{self.epoch}"
        return hashlib.sha256(text.encode()).hexdigest()

    def reset_cache(self) -> None:
        """vLLM's connector reset (after a weight update the stored KV is stale): from now on
        blocks are looked up and stored under the next epoch's keys, so none stored before is
        loaded again (the files stay: other engines may still read them). Engines that share
        storage meet again after the same number of resets."""
        self.epoch += 1
        self._engine_key = self._key()
        self._keys.clear()
        self._failed.clear()

    def block_keys(self, req: Request) -> list[str]:
        """Hex keys of the request's full prompt blocks, chained from its root."""
        keys = self._keys.get(req.request_id)
        if keys is not None:
            return keys
        seq = req.seqs[0]
        root = json.dumps([self._engine_key, req.lora_id, req.lora_path, req.cache_salt])
        parent = hashlib.sha256(root.encode()).digest()
        bs, keys = self.block_size, []
        for i in range(seq.num_prompt_tokens // bs):
            h = hashlib.sha256(parent)
            h.update(array("q", seq.token_ids[i * bs : (i + 1) * bs]).tobytes())
            if req.mm_inputs:
                h.update("\0".join(block_mm_keys(req.mm_inputs, i * bs, (i + 1) * bs)).encode())
            parent = h.digest()
            keys.append(h.hexdigest())
        self._keys[req.request_id] = keys
        return keys

    def _stored(self, key: str) -> bool:
        if key in self._failed:
            return False
        root, spec = self.cfg.shared_storage_path, self.spec
        return all(
            check_block(block_path(root, key, r, self.world), key, spec) for r in range(self.world)
        )

    def match(self, bm: BlockManager, seq: Sequence) -> None:
        """After the local prefix-cache lookup of a sequence at admission: take blocks for its
        stored prompt blocks past the hit and count them as computed (the worker fills them
        before the forward). Nothing changes when storage has none or the pool lacks room."""
        seq.num_external_tokens = 0
        if not self.cfg.loads:
            return
        bs = self.block_size
        assert seq.num_computed_tokens % bs == 0, "admission computes whole blocks"
        first = seq.num_computed_tokens // bs
        limit = min(seq.num_tokens - 1, seq.num_prompt_tokens) // bs
        loads: list[tuple[int, str]] = []
        if first < limit:
            keys = self.block_keys(seq.request)
            n = 0
            while first + n < limit and self._stored(keys[first + n]):
                n += 1
            if n and bm.allocate_slots(seq, n * bs):
                table = seq.block_ids
                loads = [(table[i], keys[i]) for i in range(first, first + n)]
                seq.num_computed_tokens += n * bs
                seq.num_external_tokens = n * bs  # (RequestOutput.num_cached_tokens counts them)
        self._loads[seq.seq_id] = (loads, seq.num_prompt_tokens)

    def build_step(self, out: SchedulerOutput, planned: list[tuple[Sequence, int]]) -> None:
        """Fill `out.kv_loads` / `out.kv_saves`; `num_computed_tokens` already advanced.
        A producer saves each prompt block once per request, in the step that completes it (or
        the first step, for blocks it took from the local prefix cache)."""
        bs, pending = self.block_size, self._loads
        for seq, _ in planned:
            entry = pending.pop(seq.seq_id, None) if pending else None
            if entry is not None:
                loads, queried = entry
                out.kv_loads += loads
                self.queries += queried
                self.hits += len(loads) * bs
            if not self.cfg.saves:
                continue
            req = seq.request
            done = self._saved.get(req.request_id, 0)
            full = min(seq.num_computed_tokens, seq.num_prompt_tokens) // bs
            if full > done:
                keys, table = self.block_keys(req), seq.block_ids
                out.kv_saves += [(table[i], keys[i]) for i in range(done, full)]
                self._saved[req.request_id] = full

    def load_failed(self, keys: list[str]) -> None:
        """The worker could not load these blocks: un-count them, skip their keys from now on."""
        self.hits -= len(keys) * self.block_size
        self._failed.update(keys)

    def forget(self, req: Request) -> None:
        """The request finished: drop what was kept for it."""
        self._keys.pop(req.request_id, None)
        self._saved.pop(req.request_id, None)
        if self._loads:
            for seq in req.seqs:
                self._loads.pop(seq.seq_id, None)


def build_connector(config: Any, hf_config: Any, worker: Any) -> KVConnector:
    """The engine's connector; `worker`: rank 0's (its block files' tensor list is every
    rank's: each holds the same share of the KV heads)."""
    runner = worker.model_runner
    identity = {
        "model": config.model,
        "revision": config.revision,
        "architectures": getattr(hf_config, "architectures", None),
        "hf_overrides": config.hf_overrides,
        "quantization": config.quantization,
        "dtype": str(worker.dtype),
        "kv_cache_dtype": str(runner.kv_cache_dtype),
        "block_size": config.block_size,
        "tensor_parallel_size": config.tensor_parallel_size,
    }
    cfg = KVTransferConfig.parse(config.kv_transfer_config)
    return KVConnector(cfg, identity, config.block_size, runner.kv_transfer.spec)
