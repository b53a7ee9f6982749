"""Whisper's cross-attention pool (worker/cross_attention.py): counted where the KV cache is
sized, bounded by it, and read in place by every attention backend.

The tiny Whisper of test_whisper.py (2 decoder layers, 4 heads of 8, 100 encoder frames: a slot
is 7 blocks of 16 frames, 2 x 2 x 112 x 32 float32 = 56 KiB; a KV block 8 KiB). Checked:
kv_cache_memory_bytes leaves its blocks minus the pool's, num_gpu_blocks_override leaves them
all; a KV cache holding two seats runs four clips two at a time (max_num_seqs lowered to 2)
with the outputs of a roomy engine, a request of more sequences than that is refused by name
and one too small for a seat refuses to start; forks and one clip in two requests share a slot
(one encode); preemption frees the slot and the sequence's clip is encoded again when it comes
back; one slot serves clip after clip (each encoded into it afresh); greedy tokens and top-5
logprobs of HF through the CPU, torch and Triton (interpreted) backends with a chunked prompt
(prefill rows see every frame); TP=2 with two seats against one process.
"""

from __future__ import annotations

import pytest
from hf_reference import assert_matches
from image_checks import greedy

pytest.importorskip("transformers.models.whisper")

from test_whisper import (
    SR,
    _requests,
    clip,
    engine,
    features,
    hf_loop,
    long_prompt,
    same,
    write_tiny_whisper,
)

from paged_engine import SamplingParams
from paged_engine.worker import cross_attention

BLOCK = 2 * 2 * 16 * 32 * 4  # a KV block: K and V, 2 layers, 16 tokens, 32 wide, float32
SLOT = 2 * 2 * 112 * 32 * 4  # a clip's K and V over both layers, 7 blocks of frames
SEAT = SLOT + 8 * BLOCK  # and max_model_len=128 tokens of decoder KV


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_whisper(tmp_path_factory.mktemp("whisper_memory"))


@pytest.fixture(scope="module")
def hf(tiny):
    import transformers

    return transformers.WhisperForConditionalGeneration.from_pretrained(tiny).float().eval()


@pytest.fixture(scope="module")
def reqs(tiny):
    tok = engine(tiny, max_model_len=128, num_gpu_blocks_override=64).get_tokenizer()
    return _requests(tok, [clip(i, 0.5 + 0.3 * i) for i in range(4)])


def watch(llm) -> list[dict[int, int]]:
    """Each step's {seq id: its slot}, as the worker ran it."""
    cross = llm.llm_engine.model_runner.cross
    steps: list[dict[int, int]] = []
    run = cross.step

    def step(seq_ids, num_new, md, *rest):
        out = run(seq_ids, num_new, md, *rest)
        steps.append({s: cross.seqs[s][0] for s in seq_ids})
        return out

    cross.step = step
    return steps


def two_seats(path, tp: int = 1, **kw):
    """An engine whose KV cache holds two seats (a slot and 8 blocks each, and the null
    block): 36 blocks of memory -> 2 slots (14 blocks), 22 KV blocks. Under TP each rank holds
    its share of the heads in its kv_cache_memory_bytes."""
    size = 36 * BLOCK // tp
    return engine(
        path,
        max_model_len=128,
        max_num_seqs=8,
        kv_cache_memory_bytes=size,
        tensor_parallel_size=tp,
        **kw,
    )


def test_pool_counted_in_kv_cache(tiny):
    llm = engine(tiny, max_model_len=128, max_num_seqs=5, kv_cache_memory_bytes=1000 * BLOCK)
    cross = llm.llm_engine.model_runner.cross
    assert cross.slot_bytes == SLOT
    assert cross.num_slots == 5
    assert sum(t.numel() * t.element_size() for t in cross.tensors()) == 5 * SLOT
    assert llm.llm_engine.num_blocks == 1000 - -(-5 * SLOT // BLOCK)
    fixed = engine(tiny, max_model_len=128, max_num_seqs=3, num_gpu_blocks_override=40)
    assert fixed.llm_engine.num_blocks == 40  # a fixed block count: the pool comes beside
    assert fixed.llm_engine.model_runner.cross.num_slots == 3


def test_seats_bound_running_clips(tiny, reqs):
    want = engine(tiny, max_model_len=128).generate(reqs, greedy(3, 12), use_tqdm=False)
    llm = two_seats(tiny)
    eng = llm.llm_engine
    assert (eng.config.max_num_seqs, eng.scheduler.max_num_seqs) == (2, 2)
    assert eng.model_runner.cross.num_slots == 2 and eng.num_blocks == 36 - 14
    steps = watch(llm)
    same(llm.generate(reqs, greedy(3, 12), use_tqdm=False), want)
    assert max(len(s) for s in steps) == 2  # two at a time, the others queued
    assert {slot for s in steps for slot in s.values()} == {0, 1}
    assert eng.model_runner.cross.encoded == 4
    n3 = SamplingParams(n=3, max_tokens=4, seed=0)
    with pytest.raises(ValueError, match=r"n/best_of/beam_width=3 exceeds .*max_num_seqs=2"):
        llm.generate([reqs[0]], n3, use_tqdm=False)
    same(llm.generate(reqs[:1], greedy(3, 12), use_tqdm=False), want[:1])  # still serving
    with pytest.raises(ValueError, match=r"cross-attention K / V .* kv_cache_memory_bytes"):
        engine(tiny, max_model_len=128, kv_cache_memory_bytes=10 * BLOCK)


def test_forks_and_equal_clips_share_a_slot(tiny, reqs):
    llm = engine(tiny, max_model_len=128, num_gpu_blocks_override=64)
    cross = llm.llm_engine.model_runner.cross
    steps = watch(llm)
    sampled = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=6)
    llm.generate([reqs[0]], sampled, use_tqdm=False)
    assert cross.encoded == 1
    assert max(len(s) for s in steps) == 3  # the forks ran together ...
    assert all(len(set(s.values())) == 1 for s in steps)  # ... on one slot
    steps.clear()
    twice = [reqs[1], {**reqs[1]}]
    outs = llm.generate(twice, greedy(3, 6), use_tqdm=False)
    same(outs[1:], outs[:1])
    assert cross.encoded == 2  # the second request's clip is the first's: one slot, one encode
    assert max(len(s) for s in steps) == 2 and all(len(set(s.values())) == 1 for s in steps)


def test_preemption_frees_and_reencodes(tiny, reqs, monkeypatch):
    # the roomy engine encodes its four clips of one step three at a time, then one
    monkeypatch.setattr(cross_attention, "ENCODE_BATCH", 3)
    want = engine(tiny, max_model_len=128).generate(reqs, greedy(3, 20), use_tqdm=False)
    monkeypatch.undo()
    small = engine(tiny, max_model_len=128, num_gpu_blocks_override=12)
    cross = small.llm_engine.model_runner.cross
    same(small.generate(reqs, greedy(3, 20), use_tqdm=False), want)
    preemptions = small.llm_engine.scheduler.num_preemptions
    assert preemptions > 0
    assert cross.encoded > len(reqs)  # a preempted clip's slot went with it: encoded again
    assert len(cross.kv) <= 1  # the last one's end reaches the worker with the next step


def test_one_slot_clip_after_clip(tiny, hf, reqs):
    """One seat: each request waits for the one before it to finish, whose slot it takes in
    the step that drops it, and is encoded into it afresh."""
    llm = engine(tiny, max_model_len=128, max_num_seqs=4, kv_cache_memory_bytes=20 * BLOCK)
    cross = llm.llm_engine.model_runner.cross
    assert cross.num_slots == 1
    steps = watch(llm)
    outs = llm.generate(reqs[:3], greedy(5, 6), use_tqdm=False)
    assert all(s and set(s.values()) == {0} and len(s) == 1 for s in steps)
    assert cross.encoded == 3
    tok = llm.get_tokenizer()
    for i, out in enumerate(outs):
        wave = clip(i, 0.5 + 0.3 * i)
        assert_matches(
            f"slot reuse {i}", out, hf_loop(hf, features(tiny, wave), long_prompt(tok, i), 6)
        )
    assert cross.num_free == 0  # the last request holds it until the next step ...
    llm.generate(reqs[3:], greedy(0, 1), use_tqdm=False)
    assert cross.seqs and list(cross.kv.values()) == [0]  # ... which drops it first


@pytest.mark.parametrize("backend", ["cpu", "torch", "triton"])
def test_backends_match_hf(tiny, hf, backend):
    """A 30-token prompt chunked 16 tokens a step (prefill rows see all 100 frames) then
    decode rows, through each backend's paged attention over the pool."""
    llm = engine(
        tiny,
        max_model_len=128,
        max_num_batched_tokens=16,
        num_gpu_blocks_override=32,
        max_num_seqs=2,
        attention_backend=backend,
    )
    ids = long_prompt(llm.get_tokenizer(), 7)
    wave = clip(7, 1.1)
    prompt = {"prompt_token_ids": ids, "multi_modal_data": {"audio": (wave, SR)}}
    n = 2 if backend == "triton" else 4  # the interpreter: one decode step serves (~1 s a step)
    out = llm.generate([prompt], greedy(5, n), use_tqdm=False)[0]
    assert_matches(f"whisper {backend}", out, hf_loop(hf, features(tiny, wave), ids, n))


def test_tensor_parallel_two_seats(tiny, reqs):
    one = two_seats(tiny).generate(reqs[:3], greedy(5, 6), use_tqdm=False)
    llm = two_seats(tiny, tp=2)
    try:
        assert llm.llm_engine.config.max_num_seqs == 2  # every rank fit the same seats
        two = llm.generate(reqs[:3], greedy(5, 6), use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    same(two, one)
