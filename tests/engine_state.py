"""The engine's per-request structures, for tests that check an idle engine kept nothing of the
requests it served (tests/server/test_soak.py, tests/engine/test_engine_fuzz.py)."""

from __future__ import annotations

from typing import Any


def leftovers(engine: Any) -> dict[str, object]:
    """Every per-request structure of `engine` (an LLMEngine) that is not back at its idle
    state: {name: its size}."""
    core, sched = engine.engine_core, engine.scheduler
    pool, cpu = engine.block_manager.pool, engine.block_manager.cpu
    runner = engine.model_runner
    batch = runner.batch
    sizes: dict[str, object] = {
        "output_processor.states": engine.output_processor.states,
        "sleep_mode.held": engine.sleep_mode.held,
        "core._compiling": core._compiling,
        "core._constrained": core._constrained,
        "core._in_flight": core._in_flight,
        "core._busy_of": core._busy_of,
        "core._discard": core._discard,
        "core.held": core.held,
        "scheduler.waiting": sched.waiting,
        "scheduler.running": sched.running,
        "scheduler.requests": sched.requests,
        "scheduler.seqs": sched.seqs,
        "scheduler._reshare": sched._reshare,
        "scheduler.step_seqs": sched.step_seqs,
        "scheduler._finished_seq_ids": sched._finished_seq_ids,
        "scheduler._drafts": sched._drafts,
        "scheduler.busy": sched.busy,
        "scheduler.suspects": sched.suspects,
        # every KV block free (a cached one too: it is only the prefix cache's, evictable)
        "blocks in use": [b.block_id for b in pool.blocks[1:] if b.ref_cnt],
        "blocks not in the free list": pool.num_blocks - 1 - pool.num_free_blocks,
        "block_manager._pending_copies": engine.block_manager._pending_copies,
        "block_manager._copy_holds": engine.block_manager._copy_holds,
        # the worker: dropped only with a step's finished_seq_ids, which idle must still send
        "worker batch.seqs": batch.seqs,
        "worker batch.row_of": batch.row_of,
        "worker rows not free": batch.capacity - len(batch._free_rows),
        "worker beam rows": batch.num_beam_rows,
        "worker flags of free rows": [
            r for r in batch._free_rows if any(flags[r] for flags in batch.row_flags())
        ],
        "worker rope_tables": runner.rope_tables,
        "worker image_spans": runner.image_spans.spans,
        "worker sampling history": runner.sampling._history,
    }
    if cpu is not None:  # swapped-out sequences' tables
        sizes["CPU pool tables"] = cpu.tables
        sizes["CPU blocks in use"] = cpu.num_total_blocks - cpu.num_free_blocks
    if runner.images is not None:  # the image encoder's cache: features only while held
        sizes["worker images to run"] = runner.images.images
        sizes["worker image features held"] = runner.images.features
        sizes["worker image users"] = runner.images.users
    if runner.lora is not None:
        sizes["worker LoRA users"] = +runner.lora.users
        sizes["worker LoRA row slots"] = [int(s) for s in runner.lora.row_slot if s >= 0]
    planner = engine.draft_planner
    if planner is not None:  # host-side drafting: per-sequence token buffers and pauses
        sizes["draft planner texts"] = planner._texts
        sizes["draft planner backoff"] = planner._backoff
        if planner.suffix is not None:
            sizes["suffix proposer texts"] = planner.suffix._texts
    slots = sched.state_slots
    if slots is not None:  # a hybrid model's recurrent-state seats
        sizes["state seats taken"] = slots.num_slots - slots.num_free
        sizes["state seats held"] = slots._held
    counts = {k: v if isinstance(v, int) else len(v) for k, v in sizes.items()}
    return {k: n for k, n in counts.items() if n}
