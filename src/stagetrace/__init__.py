"""stagetrace: tracing and hardware observability for stateless GPU inference pipelines."""

__version__ = "0.1.0"

from stagetrace.digest import digest  # noqa: E402
from stagetrace.tracing import (  # noqa: E402
    Request,
    Stage,
    configure,
    current_carrier,
    flush,
    request,
    shutdown,
    stage,
)

__all__ = [
    "__version__",
    "Request",
    "Stage",
    "configure",
    "current_carrier",
    "digest",
    "flush",
    "request",
    "shutdown",
    "stage",
]
