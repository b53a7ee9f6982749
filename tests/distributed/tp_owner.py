"""A process that owns tensor_parallel_size=2 engines, one after another, for the teardown tests.

    python tp_owner.py MODEL

Reads one MODE a line from stdin. For each it builds a fresh engine, prints `PIDS [..]` (its
worker ranks) and `FORKSERVER pid` once the engine is up, generates once, then runs MODE:
`exit` (return from main without shutdown: the process ends with the engine up), `del` (drop
the LLM), `loop` (generate until a signal ends the process, printing `STEP` after each call),
`kill-worker` (SIGKILL rank 1, then report what check_health and the next two calls raise),
`worker-error` (an exception inside a call on every rank, then how the next two calls fail).
A mode that returns prints `DONE`, and the process waits for the next; stdin's end ends it.
"""

from __future__ import annotations

import faulthandler
import gc
import json
import os
import signal
import sys
import time
from multiprocessing import forkserver

from paged_engine.distributed.launch import forkserver_context


def run_mode(model: str, mode: str) -> None:
    from paged_engine import LLM, SamplingParams
    from paged_engine.executor.base import EngineDeadError

    llm = LLM(model=model, dtype="float32", max_model_len=128, tensor_parallel_size=2)
    pids = [p.pid for p in llm.llm_engine.executor._procs]
    print("PIDS", json.dumps(pids), flush=True)
    # The forkserver the ranks were forked from lives as long as this process.
    print("FORKSERVER", forkserver._forkserver._forkserver_pid, flush=True)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate(["hello"], params, use_tqdm=False)
    if mode == "del":
        del llm
        gc.collect()
        print("DELETED", flush=True)
    elif mode == "loop":
        print("LOOPING", flush=True)
        while True:
            llm.generate(["hello"] * 4, params, use_tqdm=False)
            print("STEP", flush=True)  # one more call begins: a signal now lands mid-generate
    elif mode == "worker-error":  # every rank raises inside a call (rank 0 included)
        try:
            llm.llm_engine.executor._call("no_such_method")
        except EngineDeadError as e:
            print(f"DEAD1 {e}", flush=True)
        try:
            llm.generate(["hello"], params, use_tqdm=False)
        except EngineDeadError as e:
            print(f"DEAD2 {e}", flush=True)
    elif mode == "kill-worker":  # check_health finds it without a step, then two calls fail
        llm.llm_engine.check_health()
        os.kill(pids[0], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                llm.llm_engine.check_health()
            except EngineDeadError as e:
                print(f"HEALTH {e}", flush=True)
                break
            time.sleep(0.05)
        for attempt in (1, 2):
            try:
                llm.generate(["hello"], params, use_tqdm=False)
            except EngineDeadError as e:
                print(f"DEAD{attempt} {e}", flush=True)
    elif mode != "exit":
        raise ValueError(f"unknown mode {mode!r}")


def main() -> None:
    # The engine's own forkserver (the engine finds it running), started before the engine's
    # imports so that its preload runs beside them, not after them. Those imports stay in
    # functions: each rank imports this file again as its `__mp_main__`.
    forkserver_context()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test's dump of a hang
    # Ctrl-C's handler, as in a terminal: a process started from a background job (`cmd &` in a
    # script, nohup) inherits SIGINT *ignored*, and would go on generating through the test's
    # SIGINT.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    model = sys.argv[1]
    while mode := sys.stdin.readline().strip():
        run_mode(model, mode)
        if mode == "exit":  # its engine not shut down: the process ends with it up
            return
        print("DONE", flush=True)


if __name__ == "__main__":
    main()
