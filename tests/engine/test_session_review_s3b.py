"""Review of the hostile-input commit's big-stack threads (structured_output/grammar.py).

- `grammar_text` ran every call on a fresh 256 MB-stack thread, a cached grammar too: the
  server checks each structured request on its HTTP thread, so every request paid a thread's
  start (~0.34 ms against ~4 us for the cache). A cache hit starts no thread now.
- Any number of such threads could live at once: 64 concurrent requests reserved 16 GB of
  address space (failing with "can't start new thread" under a 3 GB `ulimit -v`). At most
  MAX_BIG_STACKS run now (llguidance holds the GIL while it builds: more were not faster).
- The stack size is process-wide while a big-stack thread starts, and `Thread.start` waited
  for the new thread with it set: a thread another part of the process started meanwhile got
  a 256 MB stack as well (300 of 300 threads started beside a build loop). The start no longer
  waits with the size set (0 of 5000).
"""

from __future__ import annotations

import ctypes
import sys
import threading
import time

import pytest

from paged_engine.structured_output import grammar
from paged_engine.structured_output.params import StructuredOutputsParams

pytest.importorskip("llguidance")


def test_a_cached_grammar_starts_no_thread(monkeypatch):
    calls: list[str] = []
    real = grammar.on_big_stack

    def counting(fn, *args):
        calls.append(fn.__name__)
        return real(fn, *args)

    monkeypatch.setattr(grammar, "on_big_stack", counting)
    params = StructuredOutputsParams(regex="review-s3b-[0-9]{3}")
    first = grammar.grammar_text(params)
    for _ in range(3):
        assert grammar.grammar_text(StructuredOutputsParams(regex="review-s3b-[0-9]{3}")) == first
    assert len(calls) == 1, calls


def test_an_invalid_grammar_still_fails_each_time():
    """Errors are not cached (lru_cache keeps results only): each call raises the ValueError."""
    for _ in range(2):
        with pytest.raises(ValueError, match=r"structured_outputs\.regex"):
            grammar.grammar_text(StructuredOutputsParams(regex="review-s3b-("))


def test_big_stack_threads_are_bounded():
    live, peak = 0, 0
    lock = threading.Lock()

    def work(i: int) -> int:
        nonlocal live, peak
        with lock:
            live += 1
            peak = max(peak, live)
        time.sleep(0.02)
        with lock:
            live -= 1
        return i

    results: list[int] = []
    callers = [
        threading.Thread(target=lambda i=i: results.append(grammar.on_big_stack(work, i)))
        for i in range(4 * grammar.MAX_BIG_STACKS)
    ]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    assert sorted(results) == list(range(4 * grammar.MAX_BIG_STACKS))
    assert 1 <= peak <= grammar.MAX_BIG_STACKS, peak


def test_a_big_stack_exception_reaches_the_caller_and_frees_its_slot():
    def boom() -> None:
        raise ValueError("structured_outputs.grammar is invalid: boom")

    with pytest.raises(ValueError, match="boom"):
        grammar.on_big_stack(boom)
    taken = [grammar._BIG_STACKS.acquire(timeout=1) for _ in range(grammar.MAX_BIG_STACKS)]
    for ok in taken:
        if ok:
            grammar._BIG_STACKS.release()
    assert all(taken), "a slot stayed taken after an exception"
    assert grammar.on_big_stack(lambda: 7) == 7


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's pthread_getattr_np")
def test_other_threads_keep_their_stack_size_during_a_build():
    libc = ctypes.CDLL(None)
    libc.pthread_self.restype = ctypes.c_ulong

    def own_stack_bytes() -> int:
        attr = ctypes.create_string_buffer(256)  # a pthread_attr_t (56 bytes on x86-64)
        assert libc.pthread_getattr_np(ctypes.c_ulong(libc.pthread_self()), attr) == 0
        size = ctypes.c_size_t()
        libc.pthread_attr_getstacksize(attr, ctypes.byref(size))
        libc.pthread_attr_destroy(attr)
        return size.value

    stop = threading.Event()

    def builds() -> None:
        while not stop.is_set():
            grammar.on_big_stack(lambda: None)

    sizes: list[int] = []
    builder = threading.Thread(target=builds)
    builder.start()
    try:
        for _ in range(200):
            t = threading.Thread(target=lambda: sizes.append(own_stack_bytes()))
            t.start()
            t.join()
    finally:
        stop.set()
        builder.join()
    big = sum(size >= grammar.STACK_BYTES for size in sizes)
    assert len(sizes) == 200 and big == 0, f"{big} of 200 threads got the big stack"
