"""Default logging for `LLM()`: paged_engine's INFO lines (each startup stage, weight loading)
on stderr, as vLLM prints its own, so a user sees what the engine is doing.

Applied only when nothing else configured logging: no handler on the root logger nor on
`paged_engine`'s. `PAGED_CONFIGURE_LOGGING=0` turns it off; `PAGED_LOGGING_LEVEL` sets the level
(INFO by default). Once applied, paged_engine's records stop at its own handler (no duplicate
lines if the application adds a root handler later).
"""

from __future__ import annotations

import logging
import os

FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"


def configure_default_logging() -> None:
    if os.environ.get("PAGED_CONFIGURE_LOGGING", "1") == "0":
        return
    pkg = logging.getLogger("paged_engine")
    if pkg.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()  # stderr
    handler.setFormatter(logging.Formatter(FORMAT, "%m-%d %H:%M:%S"))
    pkg.addHandler(handler)
    if pkg.level == logging.NOTSET:
        pkg.setLevel(os.environ.get("PAGED_LOGGING_LEVEL", "INFO").upper())
    pkg.propagate = False
