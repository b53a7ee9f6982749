"""A time budget for rendering a chat template the client sent (--trust-request-chat-template).

Jinja's sandbox refuses attribute escapes and ranges past 100,000 items, but not work: two
nested 100,000-item loops, or `lipsum(10**5)`, kept the request's thread busy for hours.
`bounded` runs a render with a trace function on the calling thread only (no other thread pays
for it) that raises `TemplateBudgetExceeded` once the budget is spent, at a Python call or at a
line of the template's own code (Jinja compiles a template to Python: each loop iteration is a
line). Never at a line elsewhere: a raise between a lock's acquire and its `try` (logging's, for
one) would leave the lock held. One C-level step (a single huge string operation, which Jinja
may also fold while compiling) is not interrupted: it ends on its own, or with MemoryError.
With `max_chars`, the text the template's root function yields is counted as it goes (a yield
is a "return" event of its generator): past the bound, `TemplateOutputExceeded` stops it, so a
short loop of large pieces never holds gigabytes before the clock is read.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

REQUEST_TEMPLATE_SECONDS = 5.0  # a real chat template renders in milliseconds
# trace events between clock reads: an event may follow a costly C step (a 40 MB string per
# loop iteration ran a 0.5 s budget to 1.7 s at 256); the read costs little beside the event
_CHECK_EVERY = 16
_TEMPLATE_CODE = "<template>"  # the file name of the code Jinja compiles a template to


class TemplateBudgetExceeded(BaseException):
    """Raised into the render when its budget is spent. A BaseException: template code and the
    libraries under it catch `Exception` in places, and must not swallow it (the trace function
    is gone once it raised)."""


class TemplateOutputExceeded(TemplateBudgetExceeded):
    """Raised into the render once its output passed the character bound; `chars`: its length
    by then (at most the bound plus one piece)."""

    def __init__(self, chars: int) -> None:
        super().__init__(chars)
        self.chars = chars


def bounded(render: Callable[[], T], seconds: float, max_chars: int | None = None) -> T:
    """`render()`, or TemplateBudgetExceeded once it ran `seconds` (wall clock) on this
    thread, or TemplateOutputExceeded once the template yielded over `max_chars` characters.
    The caller's own trace function (a debugger, coverage) is put back afterwards."""
    deadline = time.monotonic() + seconds
    events = chars = 0

    def trace(frame: Any, event: str, arg: Any) -> Any:
        nonlocal events, chars
        events += 1
        if events % _CHECK_EVERY == 0 and time.monotonic() > deadline:
            raise TemplateBudgetExceeded(seconds)
        # (only template frames get local events: blocks yield through root, macros return
        # text root yields again, so root's yields count each piece once)
        if (
            event == "return"
            and max_chars is not None
            and isinstance(arg, str)
            and frame.f_code.co_name == "root"
        ):
            chars += len(arg)
            if chars > max_chars:
                raise TemplateOutputExceeded(chars)
        # line events only in the template's code (Jinja's compiled code, named "<template>")
        return trace if frame.f_code.co_filename == _TEMPLATE_CODE else None

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        return render()
    finally:
        sys.settrace(previous)
