"""`python -m paged_server.entrypoints.openai.run_batch -i IN -o OUT --model M`: `paged-server
run-batch` under vLLM's module path (same flags)."""

from __future__ import annotations

import sys

from paged_server.run_batch import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
