"""engine/gc_tuning.py: freezing the startup heap (what paged-server and worker ranks do once
their engine is up) leaves the engine working, and collections no longer walk that heap."""

from __future__ import annotations

import gc

from paged_engine import LLM, SamplingParams
from paged_engine.engine.gc_tuning import freeze_startup_heap


def test_freeze_startup_heap(tiny_model_factory):
    llm = LLM(str(tiny_model_factory("llama")))
    params = SamplingParams(temperature=0, max_tokens=4)
    before = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids
    try:
        frozen = freeze_startup_heap()
        # modules, tokenizer, engine tables; a frozen object another thread drops (xdist's
        # channel, on a loaded machine) leaves the permanent generation: never more after
        assert frozen >= gc.get_freeze_count() > 1000
        assert len(gc.get_objects()) < frozen  # what collections still walk
        after = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids
        assert after == before
    finally:
        gc.unfreeze()
