"""Hardware collectors, one module each, registered by name (see ``base``)."""

from __future__ import annotations

import importlib

from stagetrace.collectors.base import REGISTRY, Collector, Node, Options

# Module names, which are the collectors' names, in the order their series appear in a scrape.
MODULES = ("gpu", "mps", "rdma", "ethtool", "nccl")


def available(names: tuple[str, ...] = MODULES) -> dict[str, type[Collector]]:
    """The named collectors (default: all), importing only their modules."""
    for name in names:
        importlib.import_module(f"stagetrace.collectors.{name}")
    return {name: REGISTRY[name] for name in names}


def build_node(names: str | list[str] | None = None, options: Options | None = None) -> Node:
    """A :class:`Node` of the named collectors (``"gpu,rdma"``), or of every default-enabled one."""
    options = options or Options()
    if names is None:
        wanted = [n for n, cls in available().items() if cls.default_enabled]
    else:
        wanted = [n.strip() for n in (names.split(",") if isinstance(names, str) else names) if n.strip()]
        unknown = [n for n in wanted if n not in MODULES]
        if unknown:
            raise ValueError(f"unknown collector {', '.join(unknown)}: choose from {', '.join(MODULES)}")
    known = available(tuple(wanted))
    return Node([known[n](options) for n in wanted], options.host)
