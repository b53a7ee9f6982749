"""Run code in a fresh interpreter, optionally one where triton looks uninstalled.

The blocker is a `sys.meta_path` finder placed first: for `triton` and its submodules it raises
ModuleNotFoundError(name=...), as the import system does for a package that is not installed.
It must be installed before anything imports triton, so it only works in a fresh process.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

BLOCK_TRITON = """\
import sys


class _NoTriton:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "triton":
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
        return None


sys.meta_path.insert(0, _NoTriton())
"""


def run_python(code: str, *, block_triton: bool, timeout: float = 600) -> str:
    """Run `code` with this interpreter and environment; return its stdout (fails on exit != 0)."""
    source = (BLOCK_TRITON if block_triton else "") + textwrap.dedent(code)
    proc = subprocess.run(
        [sys.executable, "-c", source], capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"child exited {proc.returncode}:\n{proc.stderr}"
    return proc.stdout
