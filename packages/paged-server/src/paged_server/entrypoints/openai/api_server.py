"""`python -m paged_server.entrypoints.openai.api_server --model M`: `paged-server` under
vLLM's module path (same flags, same server)."""

from __future__ import annotations

from paged_server.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
