"""stagetrace: tracing and hardware observability for stateless GPU inference pipelines.

The span API (``stagetrace.request``, ``stage``, ``configure``, ...) is imported on first use, so the command line
and the collectors, which need none of it, do not load the OpenTelemetry SDK.
"""

__version__ = "0.1.0"

# eager, and light: importing the submodule would otherwise leave the module, not the function, under this name
from stagetrace.digest import digest  # noqa: E402

_SPAN_API = {
    "Request": "stagetrace.tracing",
    "Stage": "stagetrace.tracing",
    "configure": "stagetrace.tracing",
    "current_carrier": "stagetrace.tracing",
    "flush": "stagetrace.tracing",
    "request": "stagetrace.tracing",
    "shutdown": "stagetrace.tracing",
    "stage": "stagetrace.tracing",
}


def __getattr__(name: str):
    if name in _SPAN_API:
        import importlib

        value = getattr(importlib.import_module(_SPAN_API[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'stagetrace' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_SPAN_API])


__all__ = ["__version__", "digest", *_SPAN_API]
