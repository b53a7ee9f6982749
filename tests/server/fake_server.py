"""`python tests/server/fake_server.py [paged-server flags]`: the real server over FakeEngine."""

from __future__ import annotations

import logging
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from fake_engine import FakeEngine

from paged_server.cli import serve
from paged_server.cli_args import build_parser

if __name__ == "__main__":
    args = build_parser().parse_args(sys.argv[1:])
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(message)s")
    engine = FakeEngine(
        max_model_len=args.max_model_len or 256,
        max_num_seqs=args.max_num_seqs,
        step_time=float(os.environ.get("FAKE_STEP_TIME", "0.002")),
    )
    raise SystemExit(serve(args, engine))
