"""The collector contract, metric descriptions as data, and the registry of collectors by name.

A collector reads one hardware source at scrape time and adds samples to a :class:`Samples`
built from :class:`MetricSpec` descriptions (name, type, help, unit, labels), the way
dcgm-exporter describes its counters as data. :class:`Node` runs the enabled collectors,
times them, adds ``host`` to every series and reports ``stagetrace_collector_success`` and
``stagetrace_collector_duration_seconds``; it is itself a client_python collector, so the
Prometheus exporter registers it as is and the ClickHouse writer reads the same families.

A source that is absent (no GPU, no ``/sys/class/infiniband``) raises :class:`SourceUnavailable`;
the node logs that once, reports success 0, and logs again only after the source came back.
"""

from __future__ import annotations

import importlib
import logging
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from stagetrace.environment_variables import STAGETRACE_HOST, STAGETRACE_SYSFS
from stagetrace.errors import SourceUnavailable  # noqa: F401  (the collectors' contract: raised by the binding too)

# the metric model and settings live in the core; collectors (and the tests that write collectors) import them here
from stagetrace.metrics import COUNTER, GAUGE, INFO, MetricSpec, Samples  # noqa: F401
from stagetrace import settings
from stagetrace.settings import Setting  # noqa: F401

if TYPE_CHECKING:
    from prometheus_client.core import Metric

logger = logging.getLogger("stagetrace.collectors")


def path_or_none(text: str) -> Path | None:
    """A path setting whose empty text means "not set"."""
    return Path(text) if text else None


def comma_list(text: str) -> tuple[str, ...]:
    """``a,b,,c`` -> ``("a", "b", "c")``."""
    return tuple(item.strip() for item in text.split(",") if item.strip())


class Options(settings.Options):
    """The value of every setting of every registered collector: ``Options(sysfs=..., host=...)``.

    The settings are the shared ones and those collectors declare (:attr:`Collector.settings`), so the built-in
    collectors' modules are imported first; the rest (keywords, variables, defaults, ``from_args``) is
    ``stagetrace.settings.Options``.
    """

    @classmethod
    def _settings(cls) -> tuple[Setting, ...]:
        return all_settings()


# A setting several collectors read lives here; one only a collector reads lives in its module.
HOST = Setting(
    "host",
    str,
    socket.gethostname,
    env=STAGETRACE_HOST,
    flag="--host",
    metavar="NAME",
    help="the host label on every series",
    shown_default="this machine's hostname",
)
# node_exporter's --path.sysfs: the RDMA collector reads <sysfs>/class/infiniband, the ethtool one <sysfs>/class/net
SYSFS = Setting(
    "sysfs",
    Path,
    "/sys",
    env=STAGETRACE_SYSFS,
    flag="--sysfs",
    metavar="DIR",
    help="sysfs root the RDMA and ethtool collectors read",
)
SHARED_SETTINGS: tuple[Setting, ...] = (HOST, SYSFS)


def all_settings() -> tuple[Setting, ...]:
    """The shared settings, then each registered collector's, in registration order (built-in modules first)."""
    available()
    seen: dict[str, Setting] = {}
    for setting in (*SHARED_SETTINGS, *(s for cls in REGISTRY.values() for s in cls.settings)):
        seen.setdefault(setting.name, setting)
    return tuple(seen.values())


def add_arguments(group) -> None:
    """A flag for every collector setting that has one (``stagetrace.settings.add_arguments``)."""
    settings.add_arguments(group, all_settings())


class Collector:
    """One hardware source. Subclasses set ``name``, declare the ``settings`` they read and implement ``collect``."""

    name: ClassVar[str] = ""
    default_enabled: ClassVar[bool] = True
    # what the collector reads from ``self.options``; the registry makes their flags and environment fallbacks
    settings: ClassVar[tuple[Setting, ...]] = ()

    def __init__(self, options: Options):
        self.options = options

    @classmethod
    def enabled_by_default(cls, options: Options) -> bool:
        """Whether a node built without named collectors runs this one: ``default_enabled``, unless the
        collector looks for its source first (the kubernetes collector runs where the kubelet's socket is)."""
        return cls.default_enabled

    def collect(self, out: Samples) -> None:
        """Read the source now and add its samples; raise SourceUnavailable when it is absent."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the collector holds (threads, library handles)."""


REGISTRY: dict[str, type[Collector]] = {}


def register(cls: type[Collector]) -> type[Collector]:
    """Class decorator: make a collector available under ``cls.name`` (node_exporter's registerCollector)."""
    if not cls.name or cls.name in REGISTRY:
        raise ValueError(f"collector name {cls.name!r} is empty or already registered")
    declared = {s.name: s for s in SHARED_SETTINGS}
    declared.update((s.name, s) for c in REGISTRY.values() for s in c.settings)
    flags = {s.flag: s for s in declared.values() if s.flag}
    for setting in cls.settings:
        other = declared.get(setting.name) or flags.get(setting.flag)
        if other is not None and other is not setting:  # the same Setting object may be read by several collectors
            raise ValueError(f"collector {cls.name}: setting {setting.name} ({setting.flag}) is already declared")
        declared[setting.name] = setting
        if setting.flag:
            flags[setting.flag] = setting
    REGISTRY[cls.name] = cls
    return cls


# Module names, which are the collectors' names, in the order their series appear in a scrape.
MODULES = ("gpu", "mps", "rdma", "ethtool", "nccl", "kubernetes")


def available(names: tuple[str, ...] | None = None) -> dict[str, type[Collector]]:
    """The named collectors (default: every registered one, the built-in modules first), importing only
    the built-in modules among them. ValueError for a name no module or registration provides."""
    for name in MODULES if names is None else names:
        if name in MODULES:
            importlib.import_module(f"stagetrace.collectors.{name}")  # a module registers its collector
    if names is None:
        return {**{name: REGISTRY[name] for name in MODULES}, **REGISTRY}
    unknown = [n for n in names if n not in REGISTRY]
    if unknown:
        choices = list(dict.fromkeys((*MODULES, *REGISTRY)))
        raise ValueError(f"unknown collector {', '.join(unknown)}: choose from {', '.join(choices)}")
    return {name: REGISTRY[name] for name in names}


SUCCESS = MetricSpec(
    "stagetrace_collector_success", GAUGE, "Whether the collector's last scrape succeeded.", ("collector",)
)
DURATION = MetricSpec(
    "stagetrace_collector_duration_seconds",
    GAUGE,
    "How long the collector's last scrape took.",
    ("collector",),
    "seconds",
)


class Node:
    """The enabled collectors of one host, scraped together (a client_python custom collector)."""

    def __init__(self, collectors: list[Collector], host: str):
        self.collectors = collectors
        self.host = host
        self._unavailable: set[str] = set()

    def collect(self) -> Iterator[Metric]:
        for samples in self.collect_samples():
            yield from samples.families(self.host)

    def collect_samples(self) -> list[Samples]:
        """One scrape as :class:`Samples`: each collector's that succeeded, then the collectors' status. The
        metric writer takes these as they are; :meth:`collect` makes client_python's families of them."""
        status = Samples()
        scraped: list[Samples] = []
        for collector in self.collectors:
            out = Samples()
            started = time.perf_counter()
            ok = self._run(collector, out)
            status.add(DURATION, time.perf_counter() - started, collector=collector.name)
            status.add(SUCCESS, 1.0 if ok else 0.0, collector=collector.name)
            if ok:
                scraped.append(out)
        scraped.append(status)
        return scraped

    def _run(self, collector: Collector, out: Samples) -> bool:
        try:
            collector.collect(out)
        except SourceUnavailable as exc:
            if collector.name not in self._unavailable:
                logger.warning("collector %s: %s", collector.name, exc)
                self._unavailable.add(collector.name)
            return False
        except Exception as exc:  # one broken collector must not take the scrape down
            logger.error("collector %s failed: %s: %s", collector.name, type(exc).__name__, exc)
            return False
        if collector.name in self._unavailable:
            logger.info("collector %s: source is back", collector.name)
            self._unavailable.discard(collector.name)
        return True

    def close(self) -> None:
        for collector in self.collectors:
            collector.close()
