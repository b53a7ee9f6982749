"""vLLM's `worker_extension_cls`: a class whose methods join every rank's `Worker`, so
`collective_rpc("method")` runs them (RL frameworks sync weights this way).

The worker class is `Worker` with the extension as a second base: its methods see the
worker as `self` (`self.model_runner.model`, `self.device`, ...). An extension may not redefine
a name the worker has (a `ValueError` naming them, as vLLM refuses it), nor take constructor
arguments: the worker is built as without it.
"""

from __future__ import annotations

from paged_engine.named_class import load_named
from paged_engine.worker.worker import Worker


def load_extension(spec: str | type) -> type:
    """The extension class of `spec` (a class, or "module.Class" / "module:Class");
    ValueError naming worker_extension_cls."""
    if isinstance(spec, type):
        cls = spec
    elif isinstance(spec, str) and spec:
        cls = load_named(spec, "worker_extension_cls")
        if not isinstance(cls, type):
            raise ValueError(f"worker_extension_cls={spec!r} is not a class")
    else:
        raise ValueError(f"worker_extension_cls must be a class or its name, got {spec!r}")
    clashes = sorted(
        name
        for name in vars(cls)
        if not (name.startswith("__") and name.endswith("__")) and hasattr(Worker, name)
    )
    if clashes:
        raise ValueError(
            f"worker_extension_cls={spec!r} redefines the worker's {clashes}: rename them"
        )
    return cls


def worker_class(spec: str | type | None) -> type[Worker]:
    """`Worker`, or `Worker` with the extension `spec` mixed in."""
    if spec is None:
        return Worker
    ext = load_extension(spec)
    return type(f"Worker[{ext.__name__}]", (Worker, ext), {})
