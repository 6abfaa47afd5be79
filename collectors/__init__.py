"""Hardware collectors, one module each, registered by name (see ``base``)."""

from __future__ import annotations

import importlib

from stagetrace.collectors.base import REGISTRY, Collector, Node, Options

# Module names, in the order their series appear in a scrape.
MODULES = ("gpu", "mps", "rdma", "ethtool", "nccl")


def available() -> dict[str, type[Collector]]:
    """Every registered collector by name (importing the modules registers them)."""
    for module in MODULES:
        importlib.import_module(f"stagetrace.collectors.{module}")
    return dict(REGISTRY)


def build_node(names: str | list[str] | None = None, options: Options | None = None) -> Node:
    """A :class:`Node` of the named collectors (``"gpu,rdma"``), or of every default-enabled one."""
    options = options or Options()
    known = available()
    if names is None:
        wanted = [n for n, cls in known.items() if cls.default_enabled]
    else:
        wanted = [n.strip() for n in (names.split(",") if isinstance(names, str) else names) if n.strip()]
        unknown = [n for n in wanted if n not in known]
        if unknown:
            raise ValueError(f"unknown collector {', '.join(unknown)}: choose from {', '.join(known)}")
    return Node([known[n](options) for n in wanted], options.host)
