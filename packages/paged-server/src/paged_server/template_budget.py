"""A time budget for rendering a chat template the client sent (--trust-request-chat-template).

Jinja's sandbox refuses attribute escapes and ranges past 100,000 items, but not work: two
nested 100,000-item loops, or `lipsum(10**5)`, kept the request's thread busy for hours.
`bounded` runs a render with a trace function on the calling thread only (no other thread pays
for it) that raises `TemplateBudgetExceeded` once the budget is spent, at a Python call or at a
line of the template's own code (Jinja compiles a template to Python: each loop iteration is a
line). Never at a line elsewhere: a raise between a lock's acquire and its `try` (logging's, for
one) would leave the lock held. One C-level step (a single huge string operation, which Jinja
may also fold while compiling) is not interrupted: it ends on its own, or with MemoryError.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

REQUEST_TEMPLATE_SECONDS = 5.0  # a real chat template renders in milliseconds
_CHECK_EVERY = 256  # trace events between clock reads
_TEMPLATE_CODE = "<template>"  # the file name of the code Jinja compiles a template to


class TemplateBudgetExceeded(BaseException):
    """Raised into the render when its budget is spent. A BaseException: template code and the
    libraries under it catch `Exception` in places, and must not swallow it (the trace function
    is gone once it raised)."""


def bounded(render: Callable[[], T], seconds: float) -> T:
    """`render()`, or TemplateBudgetExceeded once it ran `seconds` (wall clock) on this
    thread. The caller's own trace function (a debugger, coverage) is put back afterwards."""
    deadline = time.monotonic() + seconds
    events = 0

    def trace(frame: Any, event: str, arg: Any) -> Any:
        nonlocal events
        events += 1
        if events % _CHECK_EVERY == 0 and time.monotonic() > deadline:
            raise TemplateBudgetExceeded(seconds)
        # line events only in the template's code (Jinja's compiled code, named "<template>")
        return trace if frame.f_code.co_filename == _TEMPLATE_CODE else None

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        return render()
    finally:
        sys.settrace(previous)
