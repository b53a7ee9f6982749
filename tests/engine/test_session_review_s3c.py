"""Review of BART's batched encoder (models/bart.py `PaddedBatch`, `BartModel.encode_batch`,
Florence-2's prefixes) and the bounded big-stack threads (structured_output/grammar.py
`on_big_stack`): the edges the commits' own tests leave out, pinned.

- The padding layout: equal lengths and one prompt take no index and no mask (the plain 4-D
  view); a prompt of one token beside longer ones keeps exactly its own key.
- In bfloat16 / float16 a batch (one token, equal lengths, mixed) gives each prompt's lone rows,
  in the model's dtype, with float32 prefix rows (Florence-2's tower output) cast to it.
- A big-stack thread that cannot start (`_thread.start_new_thread`'s RuntimeError, as under a
  low `ulimit -v`) fails the call at once: the process-wide stack size is restored and the
  semaphore's slot freed; a BaseException in the build (KeyboardInterrupt, SystemExit) reaches
  the caller, slot freed.

Tiny BartModel built directly (d_model 32, 2 layers), no engine: ~1 s.
"""

from __future__ import annotations

import threading

import pytest
import torch
import transformers
from vlm_checkpoints import tiny_bart_fields

from paged_engine.models.bart import BartModel, PaddedBatch
from paged_engine.structured_output import grammar

BATCHES = ((1,), (4, 4, 4), (1, 1), (1, 6, 3))


@pytest.fixture(scope="module")
def mbart() -> BartModel:
    config = transformers.MBartConfig(
        **tiny_bart_fields(100, 64),
        architectures=["MBartForConditionalGeneration"],
        scale_embedding=True,
    )
    model = BartModel(config).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model


def test_padding_layout_edges():
    for lengths in ((5, 5, 5), (1,), (7,)):
        pad = PaddedBatch.of(list(lengths), torch.device("cpu"))
        assert pad.index is None and pad.mask is None, lengths
        assert (pad.batch, pad.width) == (len(lengths), max(lengths))
    pad = PaddedBatch.of([1, 3], torch.device("cpu"))
    assert pad.mask is not None and pad.index is not None
    assert pad.mask.dtype == torch.bool and pad.mask.shape == (2, 1, 1, 3)
    assert pad.mask[:, 0, 0].tolist() == [[True, False, False], [True, True, True]]
    assert pad.index.tolist() == [0, 3, 4, 5]
    x = torch.arange(4.0)[:, None, None]  # [N, H=1, Dh=1]
    assert pad.unpad(pad.pad(x)).flatten().tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_batches_equal_lone_prompts(mbart, dtype):
    model = mbart.to(dtype)
    try:
        g = torch.Generator().manual_seed(5)
        d = model.shared.weight.shape[1]
        for lengths in BATCHES:
            ids = [torch.randint(3, 100, (n,), generator=g) for n in lengths]
            # float32 prefix rows (the tower's output) on every other prompt
            prefixes = [
                torch.randn(2, d, generator=g) if i % 2 == 0 else None for i in range(len(ids))
            ]
            for pre in (None, prefixes):
                alone = [
                    model.encode(t, None if pre is None else pre[i]) for i, t in enumerate(ids)
                ]
                together = model.encode_batch(ids, pre)
                assert together.dtype == dtype, (lengths, together.dtype)
                assert torch.isfinite(together).all(), lengths
                torch.testing.assert_close(
                    together.float(), torch.cat(alone).float(), atol=2e-2, rtol=0
                )
    finally:
        mbart.float()


def _free_slots() -> int:
    taken = 0
    while grammar._BIG_STACKS.acquire(blocking=False):
        taken += 1
    for _ in range(taken):
        grammar._BIG_STACKS.release()
    return taken


def test_a_thread_that_cannot_start_fails_at_once(monkeypatch):
    before = threading.stack_size()

    def cannot_start(*args):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(grammar._thread, "start_new_thread", cannot_start)
    errors: list[BaseException] = []

    def call() -> None:
        for _ in range(grammar.MAX_BIG_STACKS + 2):  # more than the slots: none leaks
            try:
                grammar.on_big_stack(lambda: 1)
            except RuntimeError as e:
                errors.append(e)

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    caller.join(timeout=10)
    assert not caller.is_alive(), "on_big_stack waited for a thread that never started"
    assert len(errors) == grammar.MAX_BIG_STACKS + 2
    assert threading.stack_size() == before
    monkeypatch.undo()
    assert _free_slots() == grammar.MAX_BIG_STACKS
    assert grammar.on_big_stack(lambda: 7) == 7


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_a_base_exception_in_the_build_reaches_the_caller(exc):
    def build() -> None:
        raise exc()

    with pytest.raises(exc):
        grammar.on_big_stack(build)
    assert _free_slots() == grammar.MAX_BIG_STACKS
