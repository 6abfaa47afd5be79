"""Hardware collectors, one module each, registered by name (see ``base``).

Each collector declares the settings it reads (``Collector.settings``); :func:`add_arguments` makes their
flags and :meth:`Options.from_args` their values (flag, else environment variable, else default), so a new
collector touches neither the command line nor a shared list of options.
"""

from __future__ import annotations

import importlib

from stagetrace.collectors.base import REGISTRY, Collector, Node, Options, Setting, add_arguments, all_settings

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

# Module names, which are the collectors' names, in the order their series appear in a scrape.
MODULES = ("gpu", "mps", "rdma", "ethtool", "nccl", "kubernetes")


def available(names: tuple[str, ...] | None = None) -> dict[str, type[Collector]]:
    """The named collectors (default: every registered one, the built-in modules first), importing only
    the built-in modules among them. ValueError for a name no module or registration provides."""
    for name in MODULES if names is None else names:
        if name in MODULES:
            importlib.import_module(f"stagetrace.collectors.{name}")
    if names is None:
        return {**{name: REGISTRY[name] for name in MODULES}, **REGISTRY}
    unknown = [n for n in names if n not in REGISTRY]
    if unknown:
        choices = list(dict.fromkeys((*MODULES, *REGISTRY)))
        raise ValueError(f"unknown collector {', '.join(unknown)}: choose from {', '.join(choices)}")
    return {name: REGISTRY[name] for name in names}


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
