"""`python tests/server/fake_server.py [paged-server flags]`: the real server over FakeEngine.

FAKE_STEP_TIME: seconds a step; FAKE_DEAD_AFTER: seconds after start when a "rank" dies;
FAKE_DEAD_FILE: a path: the "rank" dies once it exists (a test decides when, however slowly the
server started)."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))

from fake_engine import FakeEngine

from paged_server.cli import serve
from paged_server.cli_args import parse_args

if __name__ == "__main__":
    args = parse_args(sys.argv[1:])
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(message)s")
    engine = FakeEngine(
        max_model_len=args.max_model_len or 256,
        max_num_seqs=args.max_num_seqs,
        step_time=float(os.environ.get("FAKE_STEP_TIME", "0.002")),
    )
    if os.environ.get("FAKE_DEAD_AFTER"):
        engine.die_at = time.monotonic() + float(os.environ["FAKE_DEAD_AFTER"])
    if os.environ.get("FAKE_DEAD_FILE"):

        def die_when_told(path: str) -> None:
            while not os.path.exists(path):
                time.sleep(0.05)
            engine.die_at = time.monotonic()

        threading.Thread(
            target=die_when_told, args=(os.environ["FAKE_DEAD_FILE"],), daemon=True
        ).start()
    raise SystemExit(serve(args, engine))
