"""A process that owns a tensor_parallel_size=2 engine, for the teardown tests.

    python tp_owner.py MODEL MODE

Prints `PIDS [..]` (its worker ranks) and `FORKSERVER pid` once the engine is up, then MODE:
`exit` (return without shutdown), `del` (drop the LLM, then idle), `loop` (generate until a
signal ends it, printing `STEP` after each call), `kill-worker` (SIGKILL rank 1, then report
what check_health and the next two calls raise), `worker-error` (an exception inside a call on
every rank, then how the next two calls fail).
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


def main() -> None:
    # The engine's own forkserver (the engine finds it running), started before the engine's
    # imports so that its preload runs beside them, not after them. Those imports stay in
    # here: each rank imports this file again as its `__mp_main__`.
    forkserver_context()
    from paged_engine import LLM, SamplingParams
    from paged_engine.executor.base import EngineDeadError

    model, mode = sys.argv[1], sys.argv[2]
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test's dump of a hang
    # Ctrl-C's handler, as in a terminal: a process started from a background job (`cmd &` in a
    # script, nohup) inherits SIGINT *ignored*, and would go on generating through the test's
    # SIGINT.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    llm = LLM(model=model, dtype="float32", max_model_len=128, tensor_parallel_size=2)
    pids = [p.pid for p in llm.llm_engine.executor._procs]
    print("PIDS", json.dumps(pids), flush=True)
    # The forkserver the ranks were forked from lives as long as this process.
    print("FORKSERVER", forkserver._forkserver._forkserver_pid, flush=True)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate(["hello"], params, use_tqdm=False)
    if mode == "exit":
        return
    if mode == "del":
        del llm
        gc.collect()
        print("DELETED", flush=True)
        time.sleep(60)
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


if __name__ == "__main__":
    main()
