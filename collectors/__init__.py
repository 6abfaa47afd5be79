"""Hardware collectors, one module each, registered by name (see ``base``).

Each collector declares the settings it reads (``Collector.settings``); :func:`add_arguments` makes their
flags and :meth:`Options.from_args` their values (flag, else environment variable, else default), so a new
collector touches neither the command line nor a shared list of options (the machinery is ``stagetrace.settings``).
"""

from __future__ import annotations

from stagetrace.collectors.base import (
    MODULES,
    Collector,
    Node,
    Options,
    Setting,
    add_arguments,
    all_settings,
    available,
)

__all__ = [
    "MODULES",
    "Collector",
    "Node",
    "Options",
    "Setting",
    "add_arguments",
    "all_settings",
    "available",
    "build_node",
]


def build_node(names: str | list[str] | None = None, options: Options | None = None) -> Node:
    """A :class:`Node` of the named collectors (``"gpu,rdma"``), or of every one enabled by default for these
    options (:meth:`Collector.enabled_by_default`)."""
    options = options or Options()
    if names is None:
        wanted = [n for n, cls in available().items() if cls.enabled_by_default(options)]
    else:
        wanted = [n.strip() for n in (names.split(",") if isinstance(names, str) else names) if n.strip()]
    known = available(tuple(wanted))
    return Node([known[n](options) for n in wanted], options.host)
